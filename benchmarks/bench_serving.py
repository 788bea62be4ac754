"""Serving benchmark for ``qwen-ops serve``: streaming requests at a Poisson rate, vLLM-style report.

    # against a running server (qwen-ops serve --api-key K)
    OMP_NUM_THREADS=1 python benchmarks/bench_serving.py --api-key K --num-prompts 64 --input-len 128 --output-len 64
    # start one in this process on a free loopback port, and compare with offline LLM.generate
    OMP_NUM_THREADS=1 python benchmarks/bench_serving.py --launch --offline --request-rate inf
    OMP_NUM_THREADS=1 python benchmarks/bench_serving.py --launch --offline --request-rate 1 --num-prompts 16

Prompts are random token ids (exactly ``--input-len`` each), sent to ``/v1/completions`` with
``stream=True``, greedy, ``ignore_eos`` so every request makes ``--output-len`` tokens. Request
send times follow a Poisson process at ``--request-rate`` per second (``inf``: all at once).
TTFT is send to the first chunk with a choice (the first token; its text may be empty while a
UTF-8 character is incomplete); ITL the gaps between later chunks; TPOT (E2E - TTFT) /
(output tokens - 1); E2E send to the last byte.

``--offline`` then runs the same workload (a fresh set of random prompts of the same shape, so that
neither side hits the other's prefix cache) through ``qwen_ops.LLM.generate`` in this process (the
launched server's own ``LLM`` with ``--launch``, so weights and settings are the same) and
prints server / offline output throughput, and the offline first-token time (16 prompts one at a
time through ``LLM.stream``, paced at ``--request-rate`` like the server's) beside the server's
TTFT. Figures go in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx

LINE = "=" * 50


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


async def _one(client: httpx.AsyncClient, url: str, headers: dict, body: dict) -> RequestResult:
    """One streamed request. The SSE events are split from raw bytes and only the usage and error
    events are parsed as JSON: the client should cost the machine little next to the server."""
    res = RequestResult(prompt_len=len(body["prompt"]))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            pending = b""
            async for data in resp.aiter_raw():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: [DONE]"):
                        break
                    if event.startswith(b'data: {"error"'):
                        res.error = event[6:].decode()
                        return res
                    if b'"choices":[{' in event:    # a chunk per step with new tokens (its text may be
                        if res.ttft == 0.0:         # empty: an incomplete UTF-8 character is held back)
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                    elif b'"usage":{' in event:
                        res.output_tokens = json.loads(event[6:])["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft > 0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_clients(base_url: str, api_key: Optional[str], model: str, prompts: list[list[int]],
                      output_len: int, request_rate: float, seed: int, timeout: float
                      ) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/completions"
    rng = random.Random(seed + 1)
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            if i and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
            body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(_one(client, url, headers, body)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _ms(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return float("nan"), float("nan"), float("nan")
    qs = sorted(values)
    p99 = qs[min(len(qs) - 1, int(round(0.99 * (len(qs) - 1))))]
    return 1000 * statistics.fmean(values), 1000 * statistics.median(values), 1000 * p99


def report(results: list[RequestResult], duration: float, request_rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    rows = [
        ("Successful requests:", f"{len(ok)}"),
        ("Failed requests:", f"{len(results) - len(ok)}"),
        ("Request rate (req/s):", f"{request_rate}"),
        ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", f"{in_tokens}"),
        ("Total generated tokens:", f"{out_tokens}"),
        ("Request throughput (req/s):", f"{len(ok) / duration:.2f}"),
        ("Output token throughput (tok/s):", f"{out_tokens / duration:.2f}"),
        ("Total Token throughput (tok/s):", f"{(in_tokens + out_tokens) / duration:.2f}"),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    stats = {}
    for title, short, values in (("Time to First Token", "TTFT", [r.ttft for r in ok]),
                                 ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
                                 ("Inter-token Latency", "ITL", [x for r in ok for x in r.itl]),
                                 ("End-to-end Latency", "E2EL", [r.e2e for r in ok])):
        mean, median, p99 = _ms(values)
        stats[short] = (mean, median, p99)
        print(f"{title:-^50}")
        print(f"{'Mean ' + short + ' (ms):':<40}{mean:<10.2f}")
        print(f"{'Median ' + short + ' (ms):':<40}{median:<10.2f}")
        print(f"{'P99 ' + short + ' (ms):':<40}{p99:<10.2f}")
    print(LINE)
    for r in results:
        if not r.ok:
            print(f"failed: {r.error}", file=sys.stderr)
            break
    return {"output_throughput": out_tokens / duration, "ttft": stats["TTFT"], "ok": len(ok)}


def run_offline(llm, prompts: list[list[int]], output_len: int, alone: list[list[int]], request_rate: float,
                seed: int) -> dict:
    """The workload through ``LLM.generate``, then the first-token time of each of ``alone`` (other
    prompts, so none is in the prefix cache) run one at a time through ``LLM.stream``, paced like
    the server's requests (Poisson at ``request_rate``): a request after an idle second finds
    colder caches than one right after another, on either path."""
    from qwen_ops import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.thread_time()
    outs = llm.generate(prompts, params)
    duration, cpu = time.perf_counter() - start, time.thread_time() - cpu
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    firsts = []
    rng = random.Random(seed + 1)
    for i, p in enumerate(alone):
        if i and request_rate != float("inf"):
            time.sleep(rng.expovariate(request_rate))
        t0 = time.perf_counter()
        stream = llm.stream([p], params)
        next(iter(stream))
        firsts.append(time.perf_counter() - t0)
        stream.close()
    in_tokens = sum(len(p) for p in prompts)
    print(f"{' Offline LLM.generate (same workload) ':=^50}")
    print(f"{'Benchmark duration (s):':<40}{duration:<10.2f}")
    print(f"{'CPU (s):':<40}{cpu:<10.3f}")
    print(f"{'Output token throughput (tok/s):':<40}{out_tokens / duration:<10.2f}")
    print(f"{'Total Token throughput (tok/s):':<40}{(in_tokens + out_tokens) / duration:<10.2f}")
    print(f"{'Median first token, one at a time (ms):':<40}{1000 * statistics.median(firsts):<10.2f}")
    print(LINE)
    return {"output_throughput": out_tokens / duration, "first_token": statistics.median(firsts)}


def measure(args, base_url: str, model: str, prompts: list[list[int]], output_len: int, seed: int
            ) -> tuple[list[RequestResult], float]:
    """Run the clients here (``--client inprocess``) or in a child process (``--client process``,
    as vLLM's benchmark runs apart from its server: the clients then take no GIL from the server)."""
    if args.client == "inprocess":
        return asyncio.run(run_clients(base_url, args.api_key, model, prompts, output_len, args.request_rate, seed,
                                       args.timeout))
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"base_url": base_url, "api_key": args.api_key, "model": model, "prompts": prompts,
                                   "output_len": output_len, "request_rate": args.request_rate, "seed": seed,
                                   "timeout": args.timeout}))
        subprocess.run([sys.executable, __file__, "--client-job", str(job)], check=True)
        done = json.loads((Path(tmp) / "results.json").read_text())
    return [RequestResult(**r) for r in done["results"]], done["duration"]


def _client_job(path: str) -> int:
    job = json.loads(Path(path).read_text())
    results, duration = asyncio.run(run_clients(job["base_url"], job["api_key"], job["model"], job["prompts"],
                                                job["output_len"], job["request_rate"], job["seed"], job["timeout"]))
    (Path(path).parent / "results.json").write_text(json.dumps({"results": [asdict(r) for r in results],
                                                                "duration": duration}))
    return 0


def _thread_cpu(thread) -> Optional[float]:
    if thread is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@contextlib.contextmanager
def launched(args):
    """An in-process server on a free loopback port (``--launch``): yields its base URL, the
    AsyncLLM and the server's thread."""
    from qwen_ops.serving.async_llm import AsyncLLM
    from qwen_ops.serving.openai import ServerThread, build_app, default_served_model_name

    engine = AsyncLLM.from_pretrained(args.checkpoint, max_num_seqs=args.max_num_seqs,
                                      max_model_len=args.max_model_len)
    try:
        app = build_app(engine, served_model_name=default_served_model_name(args.checkpoint), api_key=args.api_key)
        with ServerThread(app, host="127.0.0.1", port=0, log_level="warning") as server:
            yield server.base_url, engine, server.thread
    finally:
        engine.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    ap.add_argument("--launch", action="store_true", help="start a server in this process on a free port")
    ap.add_argument("--checkpoint", default=None, help="with --launch/--offline: checkpoint dir (default: embedded)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="with --launch/--offline")
    ap.add_argument("--max-model-len", type=int, default=None, help="with --launch/--offline")
    ap.add_argument("--offline", action="store_true", help="also run the workload through LLM.generate and compare")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--repeats", type=int, default=1, help="alternate server and offline runs this many times")
    ap.add_argument("--client", choices=("process", "inprocess"), default="process",
                    help="run the HTTP clients in a child process (default) or in this one")
    ap.add_argument("--client-job", default=None, help=argparse.SUPPRESS)     # the child's side of --client process
    args = ap.parse_args(argv)
    if args.client_job:
        return _client_job(args.client_job)
    for flag in ("num_prompts", "input_len", "output_len", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} = {getattr(args, flag)}, expected >= 1")
    if not args.request_rate > 0:
        ap.error(f"--request-rate = {args.request_rate}, expected > 0 (inf: all at once)")

    with contextlib.ExitStack() as stack:
        llm = server_thread = engine_thread = None
        if args.launch:
            base_url, engine, server_thread = stack.enter_context(launched(args))
            llm = engine.llm
            engine_thread = getattr(engine, "_thread", None)      # AsyncLLM's loop (diagnostics only)
        else:
            base_url = args.base_url
        if args.offline and llm is None:
            from qwen_ops import LLM
            llm = LLM(args.checkpoint, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        info = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30).raise_for_status().json()
        model = args.model or info["data"][0]["id"]
        vocab = llm.engine.vocab_size if llm is not None else 4000

        def prompts(run: int) -> list[list[int]]:
            # A fresh set per run, so no run finds another's prompts in the prefix cache.
            return _prompts(args.num_prompts, args.input_len, vocab, args.seed * 1000 + run)

        # Warm up both paths (first-call costs: kernel caches, packed weights, connections).
        measure(args, base_url, model, prompts(0)[:2], 4, args.seed)
        if llm is not None and args.offline:
            from qwen_ops import SamplingParams
            llm.generate(prompts(1)[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        ratios, ttft_gaps = [], []
        for rep in range(args.repeats):
            cpu_before = _thread_cpu(server_thread), _thread_cpu(engine_thread)
            results, duration = measure(args, base_url, model, prompts(2 + 2 * rep), args.output_len, args.seed + rep)
            served = report(results, duration, args.request_rate)
            if None not in cpu_before:
                # What each thread cost, whatever else runs on the machine: the HTTP layer (the
                # server's event loop) per generated token, and the engine loop.
                loop_cpu = _thread_cpu(server_thread) - cpu_before[0]
                tokens = sum(r.output_tokens for r in results if r.ok)
                print(f"{'Server event-loop CPU (s):':<40}{loop_cpu:<10.3f}")
                print(f"{'Server event-loop CPU per token (us):':<40}{1e6 * loop_cpu / max(tokens, 1):<10.1f}")
                print(f"{'Engine thread CPU (s):':<40}{_thread_cpu(engine_thread) - cpu_before[1]:<10.3f}")
                print(LINE)
            if args.offline:
                off = run_offline(llm, prompts(3 + 2 * rep), args.output_len, alone=prompts(10_000 + rep)[:16],
                                  request_rate=args.request_rate, seed=args.seed + rep)
                ratios.append(served["output_throughput"] / off["output_throughput"])
                ttft_gaps.append(1000 * (served["ttft"][1] / 1000 - off["first_token"]))
                print(f"{'Server / offline output throughput:':<40}{ratios[-1]:<10.3f}")
                print(f"{'Server p50 TTFT - offline first (ms):':<40}{ttft_gaps[-1]:<+10.2f}")
                print(LINE)
        if args.offline and args.repeats > 1:
            print(f"{'Median throughput ratio:':<40}{statistics.median(ratios):<10.3f}")
            print(f"{'Median TTFT gap (ms):':<40}{statistics.median(ttft_gaps):<+10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
