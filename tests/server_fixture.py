"""A live OpenAI-compatible server on 127.0.0.1 for tests: the embedded model under AsyncLLM,
served by uvicorn in a background thread on a free port (tests/test_server.py, test_readme.py)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from typing import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.openai import ServerThread, build_app

SERVED_NAME = "qwen-ops-default"
ENGINE_KWARGS = {"max_num_seqs": 8, "max_model_len": 512}
CLIENT_TIMEOUT_S = 60.0


class PassThroughEngine:
    """An ``AsyncLLM`` stand-in that forwards everything to ``real``: subclasses change
    ``generate`` to inject faults or model output the tiny test models cannot write."""

    def __init__(self, real):
        self.real = real
        self.tokenizer, self.vocab_size, self.max_model_len = real.tokenizer, real.vocab_size, real.max_model_len
        self.model_path = real.model_path

    def stats(self):
        return self.real.stats()

    def abort(self, request_id):
        self.real.abort(request_id)

    async def generate(self, prompt, params, request_id=None):
        async for out in self.real.generate(prompt, params, request_id):
            yield out


class RevealingEngine(PassThroughEngine):
    """The real engine with each choice's text replaced by ``shown(n, finished, text)``: what the reply
    shows after the n-th update, given the real text so far. Handed on as the caller asked: the whole
    text, or (``output_kind`` DELTA, as the server streams) only what is new since the last update."""

    def shown(self, n: int, finished: bool, text: str) -> str:
        raise NotImplementedError

    def finish_reason(self, c):
        return c.finish_reason

    async def generate(self, prompt, params, request_id=None):
        import dataclasses

        from qwen_ops import RequestOutputKind

        delta = params.output_kind == RequestOutputKind.DELTA
        real: dict[int, str] = {}
        sent: dict[int, str] = {}
        n = 0
        async for out in self.real.generate(prompt, params, request_id):
            n += 1
            outs = []
            for c in out.outputs:
                real[c.index] = real.get(c.index, "") + c.text if delta else c.text
                shown = self.shown(n, out.finished, real[c.index])
                text = shown[len(sent.get(c.index, "")):] if delta else shown
                sent[c.index] = shown
                outs.append(dataclasses.replace(c, text=text, finish_reason=self.finish_reason(c)))
            yield dataclasses.replace(out, outputs=outs)


def make_engine() -> AsyncLLM:
    return AsyncLLM.from_pretrained(None, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def engine():
    """A served engine per test module (``make_engine``), shut down after it."""
    eng = make_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline():
    """The same model offline, with the same arguments: the oracle of what a server returns."""
    from qwen_ops.serving.llm import LLM

    return LLM(None, **ENGINE_KWARGS)


@contextlib.contextmanager
def running_server(engine, **app_kwargs) -> Iterator[ServerThread]:
    """``build_app(engine, **app_kwargs)`` listening on a free port of 127.0.0.1 until exit."""
    app_kwargs.setdefault("served_model_name", SERVED_NAME)
    with ServerThread(build_app(engine, **app_kwargs), host="127.0.0.1", port=0) as server:
        yield server


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name (labels folded in): value}``, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_for(predicate: Callable[[], bool], *, timeout_s: float = 10.0, interval_s: float = 0.02,
             max_polls: int = 2000) -> bool:
    """Poll ``predicate`` until true, at most ``timeout_s`` seconds and ``max_polls`` times."""
    deadline = time.monotonic() + timeout_s
    for _ in range(max_polls):
        if predicate():
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(interval_s)
    return predicate()


def blocks_in_use(url: str) -> float:
    return scrape(url)["qwen_ops:kv_cache_blocks_in_use"]


def cli_server_port(proc: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, list[str]]:
    """The port a ``qwen-ops serve --port 0`` subprocess (stderr piped, text) says it listens on, and the
    stderr lines read up to there (an AssertionError with them if it never says so)."""
    deadline, port, seen = time.monotonic() + timeout_s, None, []
    while port is None and time.monotonic() < deadline and len(seen) < 200:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else None
    assert port, "".join(seen)
    return port, seen



def stop_cli_server(proc: subprocess.Popen) -> None:
    """Stop a ``qwen-ops serve`` subprocess as Ctrl-C does (SIGINT), killing it after 30 s; its pipes
    are drained so that a full one cannot hold it up."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
