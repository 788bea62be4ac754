"""Issue 25's hardening of the serving stack: bounds on what one request may ask for, an iteration
that costs what it changed (not n), admission that counts completions, request preparation off
the event loop, no silent "no auth", 4xx for malformed bodies, a dead or stopped engine, request
and idle-connection timeouts, and a port in use. Each test fails on the code before the issue."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from qwen_ops import LLM, SamplingParams
from qwen_ops.engine.sampling import MAX_N
from qwen_ops.serving.async_llm import AsyncLLM, QueueFullError
from qwen_ops.serving.cli import main
from qwen_ops.serving.engine_core import EngineCore
from qwen_ops.serving.openai import ServerThread, build_app
from qwen_ops.serving.openai import protocol as P
from qwen_ops.serving.outputs import RequestAccumulator

from server_fixture import ENGINE_KWARGS, SERVED_NAME, blocks_in_use, make_engine, running_server, scrape, wait_for

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as srv:
        yield srv


def _post(url: str, body, path: str = "/v1/completions", timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


# ----------------------------------------------------------------------------- 1. bounds on one request
@pytest.mark.parametrize("override,param", [
    ({"n": P.MAX_N + 1}, "n"),
    ({"best_of": P.MAX_N + 1}, "best_of"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"prompt": ["a"] * (P.MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": ["a"] * 9, "n": 128}, "n"),                 # 1152 completions > MAX_CHOICES
])
def test_what_one_request_may_ask_for_is_bounded(server, override, param):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1, **override}
    err = _error(_post(server.url, body), 400)
    assert err["param"] == param, err
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **override}
    if "prompt" not in override and "best_of" not in override:
        assert _error(_post(server.url, chat, "/v1/chat/completions"), 400)["param"] == param


def test_n_at_the_cap_is_served(server):
    r = _post(server.url, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1, "n": P.MAX_N})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(P.MAX_N))


def test_sampling_params_n_is_bounded():
    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(ValueError, match=rf"n = {MAX_N + 1}, expected an int in \[1, {MAX_N}\]"):
        SamplingParams(n=MAX_N + 1)


# ----------------------------------------------------------------------------- 1c. cost per iteration
def test_an_iteration_reports_only_the_completions_it_touched():
    """n = 12 completions with 2 slots: at most 2 run per iteration, so a delta (what crosses the
    pipe) names at most 2 of them; before, every delta listed all 12. The deltas folded on the
    caller's side equal LLM.generate's outputs (the oracle: no deltas at all)."""
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=12, ignore_eos=True)
    llm = LLM(None, max_num_seqs=2, max_model_len=64)
    (want,) = llm.generate([PROMPT], sp)
    ids = llm.tokenizer.encode(PROMPT)
    core = llm.core
    assert core.add("r", ids, sp) is None
    acc = RequestAccumulator("r", None, ids, sp)
    sizes, previous, identical = [], None, 0
    for _ in range(200):
        deltas = core.step_deltas()
        for d in deltas:
            sizes.append(len(d.completions))
            acc.apply(d)
            out = acc.output([])
            if previous is not None:   # a completion no delta named keeps its object: nothing rebuilt
                touched = {c.index for c in d.completions}
                identical += sum(out.outputs[i] is previous.outputs[i] for i in range(12) if i not in touched)
                assert all(out.outputs[i] is not previous.outputs[i] for i in touched)
            previous = out
        if acc.finished:
            break
    assert acc.finished and sizes and max(sizes) <= 2, sizes
    assert identical > 0
    got = acc.output([])
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in got.outputs] == \
        [(c.index, c.token_ids, c.text, c.finish_reason) for c in want.outputs]


# ----------------------------------------------------------------------------- 2. admission counts completions
def test_waiting_limits_count_completions(engine):
    llm = LLM(None, **ENGINE_KWARGS)
    eng = AsyncLLM(llm, max_waiting_requests=2)
    try:
        async def run(n):
            return [o async for o in eng.generate(PROMPT, SamplingParams(max_tokens=1, n=n))]

        with pytest.raises(QueueFullError, match="n = 3"):
            asyncio.run(run(3))
        assert asyncio.run(run(2))[-1].finished
    finally:
        eng.shutdown()
    with running_server(engine, max_waiting=2) as srv:       # the server's own bound counts them too
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1}
        r = _post(srv.url, {**body, "n": 3})
        assert _error(r, 503)["type"] == "ServiceUnavailableError" and r.headers["retry-after"] == "1"
        assert _post(srv.url, {**body, "n": 2}).status_code == 200


# ----------------------------------------------------------------------------- 3. preparation off the event loop
class _SlowTokenizer:
    """The real tokenizer, but text holding SLOW takes SLOW_S to encode (as a huge prompt does;
    the Rust tokenizer releases the GIL, as time.sleep does)."""
    SLOW_S = 3.0

    def __init__(self, real):
        self.real = real

    def encode(self, text, add_special_tokens=True):
        if "SLOW" in text:
            time.sleep(self.SLOW_S)
        return self.real.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=False):
        return self.real.decode(ids, skip_special_tokens)


class _SlowEngine:
    def __init__(self, real):
        self.real = real
        self.tokenizer = _SlowTokenizer(real.tokenizer)
        self.vocab_size, self.max_model_len, self.model_path = real.vocab_size, real.max_model_len, real.model_path
        self.stats, self.abort, self.generate = real.stats, real.abort, real.generate


def test_health_answers_while_a_big_prompt_is_tokenized(engine):
    with running_server(_SlowEngine(engine)) as srv:
        body = {"model": SERVED_NAME, "prompt": "SLOW " + "x" * (40 << 10), "max_tokens": 1}   # > 32 KiB
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", _post(srv.url, body)))
        t.start()
        time.sleep(0.3)                          # the request is being tokenized now
        latencies = []
        with httpx.Client(timeout=10) as c:
            while t.is_alive() and len(latencies) < 40:
                start = time.perf_counter()
                assert c.get(srv.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.05)
        t.join(30)
        assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
        assert result["r"].status_code == 400    # 40 KiB of text cannot fit max_model_len = 512 tokens


def test_text_that_cannot_fit_is_refused_before_tokenizing(server):
    err = _error(_post(server.url, {"model": SERVED_NAME, "prompt": "ab" * 100_000, "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "200000 characters" in err["message"]


# ----------------------------------------------------------------------------- 4. no silent "no auth"
def test_blank_api_keys_are_errors(engine, monkeypatch, capsys):
    for key in ("", "  ", "\t"):
        with pytest.raises(ValueError, match="api_key"):
            build_app(engine, served_model_name="m", api_key=key)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AsyncLLM, "from_pretrained", no_load)
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    monkeypatch.delenv("QWEN_OPS_API_KEY", raising=False)
    assert main(["serve", "--port", "0", "--api-key", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --api-key = '' is empty"), err
    monkeypatch.setenv("QWEN_OPS_API_KEY", " ")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: QWEN_OPS_API_KEY = ' ' is empty"), err


# ----------------------------------------------------------------------------- 5. malformed bodies
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b"[" * 100_000, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000, None),
    ("/v1/completions", b'{"model": "qwen-ops-default", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
     "messages[0].content"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
])
def test_malformed_bodies_are_400(server, path, body, param):
    err = _error(_post(server.url, body, path), 400)
    assert err["param"] == param and err["type"] == "BadRequestError", err


# ----------------------------------------------------------------------------- 5. a stopped, then dead, engine
def _sse_reader(url: str, body: dict, out: list) -> threading.Thread:
    def run():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_stopped_engine_is_unhealthy_requests_time_out_and_a_dead_one_is_503(caplog):
    eng = make_engine()
    pid = eng._core.process.pid
    try:
        with running_server(eng, heartbeat_timeout=0.5, request_timeout=1.5) as srv:
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            events: list[str] = []
            reader = _sse_reader(srv.url, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 480,
                                           "ignore_eos": True, "stream": True}, events)
            assert wait_for(lambda: len(events) > 0, timeout_s=30)
            os.kill(pid, signal.SIGSTOP)
            try:
                assert wait_for(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 503,
                                timeout_s=10, interval_s=0.1)
                r = _post(srv.url, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2})
                assert _error(r, 504)["type"] == "TimeoutError"       # the stopped engine never answered
                reader.join(30)
                assert not reader.is_alive() and events[-1] == "[DONE]"
                assert json.loads(events[-2])["error"]["code"] == 504  # the started stream: in-band
            finally:
                os.kill(pid, signal.SIGCONT)
            assert wait_for(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 200, timeout_s=10)
            assert wait_for(lambda: blocks_in_use(srv.url) == 0)      # both timed-out requests were aborted
            assert _post(srv.url, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2}).status_code == 200
            assert scrape(srv.url)["qwen_ops:engine_up"] == 1

            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: not eng.is_running)
            caplog.clear()
            with caplog.at_level(logging.INFO):
                for _ in range(3):
                    r = _post(srv.url, {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2})
                    assert _error(r, 503)["type"] == "ServiceUnavailableError" and "retry-after" not in r.headers
            assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
            m = scrape(srv.url)
            assert m["qwen_ops:engine_up"] == 0 and "qwen_ops:num_requests_running" not in m
            assert "qwen_ops:kv_cache_blocks_in_use" not in m
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        eng.shutdown()


# ----------------------------------------------------------------------------- 5. idle connections
def test_idle_connections_are_closed(engine):
    app = build_app(engine, served_model_name=SERVED_NAME)
    with ServerThread(app, timeout_keep_alive=1) as srv:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(20)]
        socks[0].sendall(b"GET /health HTTP/1.1\r\nHo")                  # half a request head, then nothing
        socks[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")     # a response, then nothing
        start = time.monotonic()
        for s in socks:
            s.settimeout(max(0.1, start + 4 - time.monotonic()))
            try:
                while s.recv(65536):
                    pass                 # the one response, then EOF
            except ConnectionResetError:
                pass
            except socket.timeout:
                pytest.fail("an idle connection was still open 4 s after a 1 s timeout")
            finally:
                s.close()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


# ----------------------------------------------------------------------------- 6. a port in use
def test_serve_on_a_port_in_use_is_one_line(monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AsyncLLM, "from_pretrained", no_load)
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    monkeypatch.delenv("QWEN_OPS_API_KEY", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot listen on 127.0.0.1:{port}: address already in use"], err
