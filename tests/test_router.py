"""``qwen-ops router`` (qwen_ops/serving/router.py) in front of real ``qwen-ops serve`` workers and of
fake ones, driven through the official ``openai`` client.

Oracles, none of them the router: the same request sent straight to a worker (greedy text); each
worker's own ``/metrics`` (requests it finished, prefix-cache hits); the fake workers' own counts of
what they were sent. The ring's own tests are in tests/test_hash_ring.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import httpx
import openai
import pytest

import qwen_ops_cli
from qwen_ops.serving.openai import ServerThread
from qwen_ops.serving.router import POLICIES, WORKER_HEADER, Router, RouterConfig
from server_fixture import SERVED_NAME, cli_server_port, scrape, wait_for

HEALTH_INTERVAL_S = 0.5
MAX_TOKENS = 8
OVERLAPPING = {"max_tokens": 32, "extra_body": {"ignore_eos": True}}    # requests sent together overlap
LONG_TOKENS = 128             # a few tenths of a second a request on these workers: long enough to die during
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self):",
           "for i in range(10):", "# A function that", "while True:", "print('hello"]
WORKER_FLAGS = ["--no-engine-process", "--disable-log-stats", "--max-model-len", "256", "--max-num-seqs", "4"]
SUCCESS = "qwen_ops:request_success_total"


# ----------------------------------------------------------------------------- real workers
@contextlib.contextmanager
def serve_workers(count: int) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``count`` ``qwen-ops serve`` processes on free ports (the embedded model, the engine in the
    server's process so that killing it kills the worker whole): [(url, process)]."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", "--port", "0", *WORKER_FLAGS],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
             for _ in range(count)]
    try:
        out = []
        for proc in procs:
            port, _ = cli_server_port(proc, timeout_s=120.0)
            # uvicorn logs every request on stderr: keep reading it, or a full pipe would stall the worker
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            out.append((f"http://127.0.0.1:{port}", proc))
        yield out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def workers():
    """Two workers for the module: their base URLs."""
    with serve_workers(2) as started:
        yield [url for url, _ in started]


@contextlib.contextmanager
def routing(worker_urls, policy="cache_aware", **config) -> Iterator[tuple[Router, ServerThread]]:
    """A router over ``worker_urls`` served in this process (uvicorn in a thread)."""
    config.setdefault("health_interval", HEALTH_INTERVAL_S)
    router = Router(RouterConfig(workers=tuple(worker_urls), policy=policy, **config))
    with ServerThread(router.app) as server:
        yield router, server


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = MAX_TOKENS, **extra):
    """(text, the worker that answered) of a greedy completion of ``prompt``."""
    raw = client.completions.with_raw_response.create(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, **extra)
    return raw.parse().choices[0].text, raw.headers.get(WORKER_HEADER)


def state(server: ServerThread, worker: int) -> str:
    """The router's ``/health`` word for ``worker``: up or down."""
    return httpx.get(server.url + "/health", timeout=10).json()["workers"][worker]["state"]


def finished(url: str) -> float:
    """Requests ``url``'s worker says it finished (its own counter)."""
    return sum(v for k, v in scrape(url).items() if k.startswith(SUCCESS))


def test_greedy_through_the_router_is_the_workers_answer(workers):
    """Completions and chat, streamed and not, through a ``qwen-ops router`` process: the text a
    worker gives the same request sent to it directly."""
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops_cli", "router", "--port", "0", "--worker", workers[0],
                             "--worker", workers[1], "--health-interval", str(HEALTH_INTERVAL_S),
                             "--uvicorn-log-level", "warning"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stderr.readline()
        assert line.startswith("qwen-ops router: 2 workers"), line + proc.stderr.read()
        router_url = line.rsplit(" ", 1)[-1].strip()
        assert wait_for(lambda: httpx.get(router_url + "/health").status_code == 200, timeout_s=10)
        direct, routed = client_of(workers[1]), client_of(router_url)
        for prompt in PROMPTS[:3]:
            want, _ = complete(direct, prompt)
            got, worker = complete(routed, prompt)
            assert (got, worker in workers) == (want, True)
            stream = routed.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
        messages = [{"role": "user", "content": "Name a prime number."}]
        want = direct.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0).choices[0].message.content
        got = routed.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].message.content
        stream = routed.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert got == streamed == want
        assert [m.id for m in routed.models.list()] == [m.id for m in direct.models.list()]
        # A 4xx is the worker's own answer, unchanged, and not tried elsewhere.
        bad = {"model": SERVED_NAME, "prompt": "x", "max_tokens": -1}
        direct_bad = httpx.post(workers[0] + "/v1/completions", json=bad)
        routed_bad = httpx.post(router_url + "/v1/completions", json=bad)
        assert direct_bad.status_code == 400
        assert (routed_bad.status_code, routed_bad.json()) == (400, direct_bad.json())
        metrics = scrape(router_url)
        assert [v for k, v in metrics.items() if k.startswith("qwen_ops_router:failed_attempts_total")] == [0, 0]
        assert metrics["qwen_ops_router:retries_total"] == 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "least_load"])
def test_both_workers_get_work_under_concurrency(workers, policy):
    before = [finished(url) for url in workers]
    with routing(workers, policy) as (router, server), client_of(server.url) as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:        # long enough to overlap in the router
            answers = list(pool.map(lambda p: complete(client, p, **OVERLAPPING), PROMPTS))
    served = [finished(url) - b for url, b in zip(workers, before)]
    assert sum(served) == len(PROMPTS)
    assert min(served) >= 1, served
    # the header names the worker that answered: the workers' own counts agree
    assert [sum(w == url for _, w in answers) for url in workers] == served


def test_a_session_key_always_lands_on_the_same_worker(workers):
    keys = [f"session-{i}" for i in range(16)]
    with routing(workers, "consistent_hash") as (router, server), client_of(server.url) as client:
        def send(i: int):
            key = keys[i % len(keys)]
            if i % 2:           # the header, or the body's user field
                return key, complete(client, PROMPTS[i % len(PROMPTS)], extra_headers={"X-Session-ID": key})[1]
            return key, complete(client, PROMPTS[i % len(PROMPTS)], user=key)[1]

        with ThreadPoolExecutor(8) as pool:
            landed = list(pool.map(send, range(4 * len(keys))))
    where: dict[str, set] = {}
    for key, worker in landed:
        where.setdefault(key, set()).add(worker)
    assert all(len(ws) == 1 for ws in where.values()), where
    assert {w for ws in where.values() for w in ws} == set(workers)     # 16 keys: both workers own some


def test_a_second_chat_turn_lands_where_the_first_did(workers):
    # distinct from their first block on (a shared system prompt would send them all where it is cached)
    firsts = [[{"role": "user", "content": f"Question {i}: what is {i} plus {i}? " * 6}] for i in range(4)]
    with routing(workers, "cache_aware") as (router, server), client_of(server.url) as client:
        def turn(messages):
            raw = client.chat.completions.with_raw_response.create(model=SERVED_NAME, messages=messages,
                                                                   temperature=0, **OVERLAPPING)
            return raw.parse().choices[0].message.content, raw.headers[WORKER_HEADER]

        with ThreadPoolExecutor(len(firsts)) as pool:
            first = list(pool.map(turn, firsts))
        assert {w for _, w in first} == set(workers)        # spread by load: nothing cached anywhere yet
        for messages, (reply, worker) in zip(firsts, first):
            hits = {url: scrape(url)["qwen_ops:prefix_cache_hits_total"] for url in workers}
            _, again = turn(messages + [{"role": "assistant", "content": reply},
                                        {"role": "user", "content": "And times two?"}])
            assert again == worker
            # the worker's own counter: its cache held the first turn
            assert scrape(worker)["qwen_ops:prefix_cache_hits_total"] > hits[worker]


def test_a_client_leaving_a_stream_stops_its_worker(workers):
    """The client closes a long stream after two chunks: the worker sees it go (its own counter counts
    an aborted request, not one run to its length) and the router holds nothing for it."""
    def aborted(url):
        return scrape(url).get(f"{SUCCESS}{{finished_reason=abort}}", 0)

    with routing(workers, "round_robin") as (router, server), client_of(server.url) as client:
        before = [aborted(url) for url in workers]
        stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=240, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for _, chunk in zip(range(2), stream):
            pass
        stream.close()
        assert wait_for(lambda: sum(aborted(url) for url in workers) == sum(before) + 1, timeout_s=10)
        assert wait_for(lambda: router.in_flight == [0, 0] and router.balancer.loads() == [0, 0], timeout_s=5)


def test_a_worker_stopped_mid_run(workers):
    """Sixteen longer non-streamed requests round-robin over two workers (four running in each, four
    waiting there); one worker is killed while it has requests: every request is answered (by the other), with
    the text the survivor gives directly; the router reports the dead worker down within two health
    intervals; nothing hangs."""
    survivor = workers[0]
    prompts = PROMPTS * 2
    long = {"max_tokens": LONG_TOKENS, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        want = dict(zip(PROMPTS, pool.map(lambda p: complete(client_of(survivor), p, **long)[0], PROMPTS)))
    with serve_workers(1) as [(victim, proc)]:
        with routing([survivor, victim], "round_robin") as (router, server), client_of(server.url) as client:
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(complete, client, p, **long) for p in prompts]
                # the victim is working on some of them (its own gauge), with more waiting behind them
                assert wait_for(lambda: scrape(victim).get("qwen_ops:num_requests_running", 0) >= 1, timeout_s=30)
                proc.kill()
                killed = time.monotonic()
                assert wait_for(lambda: state(server, 1) == "down", timeout_s=10)
                down_after = time.monotonic() - killed
                answers = [f.result(timeout=60) for f in futures]
            assert state(server, 0) == "up"
            metrics = scrape(server.url)
    assert [text for text, _ in answers] == [want[p] for p in prompts]
    assert {worker for _, worker in answers} <= {survivor, victim}
    assert down_after < 2 * HEALTH_INTERVAL_S
    failed = {url: metrics[f"qwen_ops_router:failed_attempts_total{{worker={url}}}"] for url in (survivor, victim)}
    assert failed[victim] >= 1 and failed[survivor] == 0
    assert metrics["qwen_ops_router:retries_total"] == failed[victim]      # each one tried again on the survivor


def test_the_dead_worker_is_reported_down_within_two_health_intervals(workers):
    with serve_workers(1) as [(victim, proc)]:
        with routing([workers[0], victim], "least_load") as (router, server):
            assert state(server, 1) == "up"
            proc.kill()                          # no request in flight: only the health check can notice
            killed = time.monotonic()
            assert wait_for(lambda: state(server, 1) == "down", timeout_s=10)
            assert time.monotonic() - killed < 2 * HEALTH_INTERVAL_S + 0.5
            text, worker = complete(client_of(server.url), PROMPTS[0])
            assert worker == workers[0]


# ----------------------------------------------------------------------------- fake workers
class FakeWorker:
    """A worker that answers as told (``behaviour``), counting what it is sent:

    ok: a completion whose text is the worker's URL; 503 / 400: that error, OpenAI-shaped; drop: the
    connection closed before any answer; cut: an SSE answer of two events, then the connection closed
    mid-body. ``/health`` answers 200 while ``healthy``."""

    def __init__(self, behaviour: str, healthy: bool = True, metrics: str = ""):
        self.behaviour, self.healthy, self.hits = behaviour, healthy, 0
        self.metrics = metrics              # its /metrics body (empty: 404, as a server without metrics)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics":
                    self._send(200 if fake.metrics else 404, fake.metrics.encode(), "text/plain")
                else:
                    self._send(200 if fake.healthy else 503, b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.hits += 1
                if fake.behaviour == "ok":
                    self._send(200, json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                                "choices": [{"index": 0, "text": fake.url, "finish_reason": "stop",
                                                             "logprobs": None}]}).encode())
                elif fake.behaviour in ("503", "400"):
                    self._send(int(fake.behaviour), json.dumps({"error": {
                        "message": f"fake {fake.behaviour}", "type": "x", "param": None,
                        "code": int(fake.behaviour)}}).encode())
                elif fake.behaviour == "cut":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for word in ("Hello", " world"):
                        event = json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                            "choices": [{"index": 0, "delta": {"content": word},
                                                         "finish_reason": None}]})
                        data = f"data: {event}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                self.close_connection = fake.behaviour in ("drop", "cut")   # no answer / no end of the body

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeWorker":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def fakes(*behaviours: str, policy: str = "round_robin", **config):
    with contextlib.ExitStack() as stack:
        fs = [stack.enter_context(FakeWorker(b)) for b in behaviours]
        router, server = stack.enter_context(routing([f.url for f in fs], policy, **config))
        yield fs, router, server


def post(server: ServerThread, **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x", **extra}, timeout=30)


@pytest.mark.parametrize("failure", ["503", "drop"])
def test_a_request_failing_before_its_first_byte_is_retried_elsewhere(failure):
    # health checks 30 s apart: none runs (and brings a dropped worker back) during the test
    with fakes(failure, "ok", health_interval=30) as ([bad, good], router, server):
        r = post(server)
        assert (r.status_code, r.json()["choices"][0]["text"], r.headers[WORKER_HEADER]) == (200, good.url, good.url)
        assert (bad.hits, good.hits) == (1, 1)
        # a lost connection also takes the worker out at once; a 503 leaves that to its /health
        assert [state(server, 0), state(server, 1)] == (["down", "up"] if failure == "drop" else ["up", "up"])


def test_retries_are_bounded_and_the_last_503_is_handed_on():
    with fakes("503", "503", "503", max_retries=1) as (fs, router, server):
        r = post(server)
        assert (r.status_code, r.json()["error"]["message"]) == (503, "fake 503")
        assert sorted(f.hits for f in fs) == [0, 1, 1]
        metrics = scrape(server.url)
        assert (metrics["qwen_ops_router:unanswered_total"], metrics["qwen_ops_router:retries_total"]) == (1, 1)


def test_a_4xx_is_handed_on_unchanged_and_not_retried():
    with fakes("400", "ok") as ([bad, good], router, server):
        r = post(server)
        assert (r.status_code, r.json()["error"]["message"], r.headers[WORKER_HEADER]) == (400, "fake 400", bad.url)
        assert (bad.hits, good.hits) == (1, 0)


def test_a_stream_whose_worker_dies_mid_way_ends_with_an_error_event():
    with fakes("cut", "ok") as ([cut, good], router, server), client_of(server.url) as client:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        words = []
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="went away mid-stream"):
            for chunk in stream:
                words.append(chunk.choices[0].delta.content)
        assert words == ["Hello", " world"]             # what the worker sent, then the error, no hang
        assert time.monotonic() - started < 10
        assert (cut.hits, good.hits) == (1, 0)           # bytes had gone out: not retried
        assert scrape(server.url)[f"qwen_ops_router:cut_streams_total{{worker={cut.url}}}"] == 1


def test_unhealthy_workers_are_reported_and_skipped():
    with fakes("ok", "ok", policy="least_load") as ([sick, well], router, server):
        sick.healthy = False
        assert wait_for(lambda: httpx.get(server.url + "/health").json()["workers"][0]["state"] == "down",
                        timeout_s=5)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200
        assert health.json()["workers"][0]["error"] == "/health answered 503"
        assert {post(server).headers[WORKER_HEADER] for _ in range(4)} == {well.url}
        assert sick.hits == 0
        assert scrape(server.url)["qwen_ops_router:workers_up"] == 1
        well.healthy = False
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, timeout_s=5)
        r = post(server)
        assert (r.status_code, r.json()["error"]["type"]) == (503, "ServiceUnavailableError")
        sick.healthy = True                              # a passing check brings it back
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout_s=5)
        assert post(server).headers[WORKER_HEADER] == sick.url


# ----------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("flags, message", [
    (["--worker", "localhost:8001"], "workers[0] (--worker) = 'localhost:8001', expected a server's root"),
    (["--worker", "http://a:1/v1"], "has a path or query"),
    (["--worker", "http://a:1", "--worker", "http://a:1/"], "workers[1] (--worker) = 'http://a:1/' repeats workers[0]"),
    (["--worker", "http://a:1", "--health-interval", "0"], "health_interval (--health-interval) = 0.0, expected"),
    (["--worker", "http://a:1", "--max-retries", "-1"], "max_retries (--max-retries) = -1, expected an int >= 0"),
    (["--worker", "http://a:1", "--port", "70000"], "--port = 70000, expected 0..65535"),
])
def test_bad_flags_are_one_line_naming_the_flag(flags, message, capsys):
    assert qwen_ops_cli.main(["router", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_the_command_line_knows_the_routers_policies():
    assert qwen_ops_cli.ROUTER_POLICIES == POLICIES
    with pytest.raises(SystemExit):
        qwen_ops_cli.build_parser().parse_args(["router", "--worker", "http://a:1", "--policy", "random"])


def test_the_router_loads_no_torch():
    code = ("import sys, qwen_ops_cli\n"
            "m = qwen_ops_cli._router_module()\n"
            "m.Router(m.RouterConfig(workers=('http://127.0.0.1:9',)))\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr[-2000:]


BUSY = ('# HELP vllm:num_requests_running Requests in the running batch.\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 30.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 10.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 8.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n')


def test_worker_requests_sums_running_and_waiting_over_engines():
    from qwen_ops.serving.router import worker_requests

    assert worker_requests(BUSY) == 48
    assert worker_requests("vllm:kv_cache_usage_perc 0.5\n") is None
    assert worker_requests("") is None


@pytest.mark.parametrize("read", [True, False])
def test_work_a_worker_reports_from_other_clients_steers_requests_away(read):
    """A worker whose /metrics says it runs 48 requests nobody sent through this router: least_load
    sends new work to the idle one (after one health round); with --no-worker-metrics it cannot know."""
    with contextlib.ExitStack() as stack:
        busy = stack.enter_context(FakeWorker("ok", metrics=BUSY))
        idle = stack.enter_context(FakeWorker("ok", metrics=BUSY.replace("30.0", "0.0").replace("10.0", "0.0")
                                              .replace("8.0", "0.0")))
        router, server = stack.enter_context(routing([busy.url, idle.url], "least_load", health_interval=0.2,
                                                     worker_metrics=read))
        assert wait_for(lambda: httpx.get(server.url + "/health").json()["workers"][0]["load_tokens"] > 0,
                        timeout_s=5 if read else 1.5) == read
        for _ in range(4):                               # one at a time: the router's own count stays at 0
            assert post(server).status_code == 200
        assert (busy.hits, idle.hits) == ((0, 4) if read else (4, 0))     # without: ties go to the first
