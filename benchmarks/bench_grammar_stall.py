"""Does a slow grammar stall the server? (issue 44 item 4)

    OMP_NUM_THREADS=1 python benchmarks/bench_grammar_stall.py [--json FILE]

The embedded model behind ``qwen-ops serve``'s app (engine in its own process, as the command
runs it, ``--max-grammar-compile-seconds 5``). Idle, then while hostile structured outputs
compile, it times ``/health`` and a 2-token completion, one after the other, over and over:
- ``schema``: a 16 KiB ``json_schema`` of 300 string properties, each ``"pattern": "[a-z]{1,1000}"``
  (it compiled for 24 s on the server's event loop and again in the engine before issue 44);
- ``choice``: a ``choice`` list of 4,096 items (the most accepted; 10**5 items are a 400 at once).
Reports medians and maxima (ms) per phase, the ratio to idle, and what the hostile request got.
A small request whose text is empty counts as a failure (exit 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from server_fixture import running_server  # noqa: E402

from qwen_ops.serving.async_llm import AsyncLLM  # noqa: E402

NAME = "qwen-ops-default"


def hostile(kind: str) -> dict:
    if kind == "schema":
        props = {f"field_{i:03d}": {"type": "string", "pattern": "[a-z]{1,1000}"} for i in range(300)}
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "h", "schema": {"type": "object", "properties": props, "required": list(props)}}}}
    return {"structured_outputs": {"choice": [f"option number {i} of many" for i in range(4096)]}}


def sample(client: httpx.Client, url: str, seconds: float, until=None) -> dict:
    health, small = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and (until is None or not until()):
        t0 = time.perf_counter()
        assert client.get(url + "/health").status_code == 200
        health.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = client.post(url + "/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 2,
                                                       "temperature": 0})
        small.append(time.perf_counter() - t0)
        if r.status_code != 200 or not r.json()["choices"][0]["text"]:
            raise SystemExit(f"a small request failed while a grammar compiled: {r.status_code} {r.text[:200]}")
    ms = lambda xs: {"n": len(xs), "median_ms": round(1e3 * statistics.median(xs), 1),  # noqa: E731
                     "max_ms": round(1e3 * max(xs), 1)}
    return {"health": ms(health), "small_request": ms(small)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    engine = AsyncLLM.from_pretrained(None, max_num_seqs=8, max_model_len=512, max_grammar_compile_seconds=5.0)
    rows = {}
    try:
        with running_server(engine) as srv, httpx.Client(timeout=120) as client:
            url = srv.url
            sample(client, url, 2.0)                                   # warm-up
            rows["idle"] = sample(client, url, 6.0)
            for kind in ("schema", "choice"):
                got = {}

                def send(kind=kind, got=got):
                    t0 = time.perf_counter()
                    body = {"model": NAME, "prompt": "x", "max_tokens": 8, **hostile(kind)}
                    path = "/v1/chat/completions" if kind == "schema" else "/v1/completions"
                    if kind == "schema":
                        body.pop("prompt")
                        body["messages"] = [{"role": "user", "content": "x"}]
                    r = httpx.post(url + path, json=body, timeout=300)
                    got.update(status=r.status_code, seconds=round(time.perf_counter() - t0, 2),
                               body=r.text[:160])

                th = threading.Thread(target=send)
                th.start()
                time.sleep(0.2)
                rows[kind] = sample(client, url, 8.0, until=lambda: not th.is_alive())
                th.join()
                rows[kind]["hostile_request"] = got
                rows[kind]["health_ratio"] = round(rows[kind]["health"]["median_ms"] / rows["idle"]["health"]["median_ms"], 2)
                rows[kind]["small_ratio"] = round(rows[kind]["small_request"]["median_ms"]
                                                  / rows["idle"]["small_request"]["median_ms"], 2)
                time.sleep(15)                      # let a compile still running after its timeout finish
    finally:
        engine.shutdown()
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
