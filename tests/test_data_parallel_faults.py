"""Data-parallel faults (qwen_ops/serving/data_parallel.py): a replica of a real ``qwen-ops serve
--data-parallel-size 2`` is killed (SIGKILL) or stopped (SIGSTOP: hung) under load.

Oracle: one engine offline (``LLM.generate``, no balancer, no second replica, no failure); every
non-streamed request must come back with its tokens, the failed replica must be restarted (its
``pid`` in ``/health`` changes), and nothing may hang (every call has a client timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from qwen_ops.engine.sampling import SamplingParams
from server_fixture import ENGINE_KWARGS, SERVED_NAME, cli_server_port, scrape, stop_cli_server

NUM_REQUESTS = 16
MAX_TOKENS = 160
PROMPTS = [f"# job {i}\ndef work_{i}(items):" for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def expected():
    from qwen_ops.serving.llm import LLM

    llm = LLM(None, **ENGINE_KWARGS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                                    ignore_eos=True),
                                                     use_tqdm=False)]


@pytest.fixture
def dp_server():
    """A fresh ``-dp 2`` server (this test breaks it), hang timeout 2 s; its stderr drained to a list."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", "--port", "0", "-dp", "2",
                             "--threads-per-replica", "1", "--disable-log-stats", "--replica-hang-timeout", "2",
                             "--disable-uvicorn-access-log",
                             "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
                             "--max-num-seqs", str(ENGINE_KWARGS["max_num_seqs"])],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: list[str] = []
    try:
        port, seen = cli_server_port(proc, timeout_s=180.0)
        log.extend(seen)
        drain = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
        drain.start()
        yield f"http://127.0.0.1:{port}", log
    finally:
        stop_cli_server(proc)


def replicas(url: str) -> list[dict]:
    return httpx.get(url + "/health", timeout=10).json()["replicas"]


def wait_running(url: str, old_pid: int, timeout_s: float = 120.0) -> dict:
    """Replica state once the one that had ``old_pid`` is back with a new process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = replicas(url)
        if all(r["state"] == "running" and r["pid"] != old_pid for r in reps) and any(r["restarts"] for r in reps):
            return {r["engine"]: r for r in reps}
        time.sleep(0.2)
    raise AssertionError(f"no replica came back in {timeout_s} s: {replicas(url)}")


def load_and_break(url: str, expected: list[str], sig: int) -> tuple[list, list, int]:
    """``NUM_REQUESTS`` non-streamed and two streamed requests at once; ``sig`` to replica 1 once
    the requests are in flight. The non-streamed texts, and each stream's outcome."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    victim = replicas(url)[1]["pid"]

    def plain(p):
        return client.completions.create(model=SERVED_NAME, prompt=p, temperature=0, max_tokens=MAX_TOKENS,
                                         extra_body={"ignore_eos": True})

    def streamed(p):
        try:
            chunks = client.completions.create(model=SERVED_NAME, prompt=p, temperature=0, max_tokens=MAX_TOKENS,
                                               stream=True, extra_body={"ignore_eos": True})
            return "ok", "".join(c.choices[0].text for c in chunks)
        except openai.APIError as e:           # an error event after the first bytes
            return "error", str(e)

    with ThreadPoolExecutor(NUM_REQUESTS + 2) as pool:
        futures = [pool.submit(plain, p) for p in PROMPTS]
        streams = [pool.submit(streamed, p) for p in PROMPTS[:2]]
        # the requests are queued or running on both replicas (the balancer's count of each one's load)
        deadline = time.monotonic() + 30
        while not all(r["load_tokens"] > 0 for r in replicas(url)) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(victim, sig)
        got = [f.result(timeout=180) for f in futures]
        outcomes = [f.result(timeout=180) for f in streams]
    client.close()
    return [g.choices[0].text for g in got], outcomes, victim


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_failed_replica_loses_no_unstarted_request_and_comes_back(dp_server, expected, sig):
    url, log = dp_server
    texts, outcomes, victim = load_and_break(url, expected, sig)
    assert texts == expected                     # every non-streamed request succeeded, with its tokens
    assert scrape(url)["qwen_ops:requests_retried_total"] >= 1    # some were on the failed replica, not started
    for (kind, text), want in zip(outcomes, expected[:2]):
        assert kind == "error" and "replica" in text or kind == "ok" and text == want, (kind, text)
    back = wait_running(url, victim)
    assert back[1]["restarts"] == 1 and back[1]["last_failure"].startswith("hung" if sig == signal.SIGSTOP
                                                                             else "died")
    assert any("replica 1" in line and "restarting" in line for line in log), log[-20:]
    assert not any("GET /health" in line for line in log), log[-20:]      # --disable-uvicorn-access-log
    # the restarted replica serves again
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda p: client.completions.create(model=SERVED_NAME, prompt=p, temperature=0,
                                                                  max_tokens=MAX_TOKENS,
                                                                  extra_body={"ignore_eos": True}).choices[0].text,
                                   PROMPTS[:8]))
    assert again == expected[:8]
    if sig == signal.SIGSTOP:
        try:
            os.kill(victim, signal.SIGKILL)      # the stopped process was killed by the restart; make sure
        except ProcessLookupError:
            pass
