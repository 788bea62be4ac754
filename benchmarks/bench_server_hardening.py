"""Two figures of issue 25 through a live server (the embedded model, the engine in its own process):

1. A big-n request (``--n``, max_tokens 1) and a small 2-token request sent right behind it: both
   latencies. (Before the issue's fixes each iteration walked all n completions on both sides of
   the pipe, so the cost grew with n squared.)
2. ``/health`` latency (p50 / max over many polls) while one request with a huge prompt
   (``--huge-chars`` characters, under the 4 MiB body limit) is prepared: parsed, tokenized, refused.

    python benchmarks/bench_server_hardening.py            # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_server_hardening.py

Figures go to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.openai import ServerThread, build_app

NAME = "qwen-ops-default"


def _post(url: str, body: dict, timeout: float = 600) -> tuple[int, float]:
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", content=json.dumps(body), timeout=timeout,
                   headers={"Content-Type": "application/json"})
    return r.status_code, time.perf_counter() - start


def big_n(url: str, n: int) -> None:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("big", _post(url, {"model": NAME, "prompt": "def f(x):",
                                                                           "max_tokens": 1, "n": n})))
    t.start()
    time.sleep(0.05)                                # the big request is in first
    small = _post(url, {"model": NAME, "prompt": "import os\n", "max_tokens": 2})
    t.join()
    (code, big_s) = out["big"]
    print(f"n={n} max_tokens=1: HTTP {code} in {big_s * 1000:.0f} ms; 2-token request behind it: "
          f"HTTP {small[0]} in {small[1] * 1000:.0f} ms")


def health_during_huge_prompt(url: str, chars: int, polls_before: int = 20) -> None:
    body = {"model": NAME, "prompt": "hello world " * (chars // 12), "max_tokens": 1}
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _post(url, body)))
    lat = []
    with httpx.Client(timeout=60) as c:
        for _ in range(polls_before):               # warm: connection open, loop idle
            c.get(url + "/health")
        t.start()
        time.sleep(0.02)
        while t.is_alive():
            start = time.perf_counter()
            c.get(url + "/health")
            lat.append(time.perf_counter() - start)
            time.sleep(0.005)
    t.join()
    code, huge_s = out["r"]
    print(f"{len(body['prompt'])}-character prompt: HTTP {code} after {huge_s * 1000:.0f} ms; /health during it "
          f"({len(lat)} polls): p50 {statistics.median(lat) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms"
          if lat else f"{len(body['prompt'])}-character prompt: HTTP {code} after {huge_s * 1000:.0f} ms "
                      "(done before the first poll)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--huge-chars", type=int, default=3_900_000)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's (4096 at most)")
    args = ap.parse_args()
    engine = AsyncLLM.from_pretrained(None, max_num_seqs=64, max_model_len=args.max_model_len)
    try:
        with ServerThread(build_app(engine, served_model_name=NAME)) as srv:
            _post(srv.url, {"model": NAME, "prompt": "warm up", "max_tokens": 2})
            big_n(srv.url, args.n)
            health_during_huge_prompt(srv.url, args.huge_chars)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
