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
neither side hits the other's prefix cache) through ``qwen_ops.LLM.generate`` in this process (an
``LLM`` with the server's checkpoint and settings; with ``--launch --no-engine-process``, the
server's own) and prints server / offline output throughput; and, for the first-token time, feeds
another such set to that ``LLM`` on the clients' arrival schedule (``add_request`` when a request
is due, ``step()`` otherwise), so that a request shares its first step with the requests still
decoding on both sides. Its median first-token time is printed beside the server's median
TTFT. Figures go in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional

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


class RawHTTP:
    """The benchmark's HTTP/1.1 client: keep-alive connections over asyncio streams, the chunked
    body handed back as it arrives. It does the least a client can (vLLM's benchmark uses aiohttp,
    C-accelerated, for the same reason): a client on the server's machine takes CPU from it, and
    its own per-request cost lands in every TTFT it reports."""

    def __init__(self, base_url: str):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"base_url = {base_url!r}, expected http://host:port/...")
        self.host, self.port, self.prefix = url.hostname, url.port or 80, url.path.rstrip("/")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, headers: dict, body: bytes) -> AsyncIterator:
        """Yields the status code, then the body's pieces (de-chunked) as they arrive."""
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body
        while True:
            # An idle connection the server has closed since (keep-alive timeout) fails before
            # any response: drop it and take the next, as httpx and aiohttp do.
            stale = bool(self._idle)
            reader, writer = self._idle.pop() if stale else await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(head)
                status_line = await reader.readline()
            except ConnectionError:
                status_line = b""
            if status_line or not stale:
                break
            writer.close()
        reusable = False
        try:
            if not status_line:
                raise ConnectionError("the server closed the connection")
            yield int(status_line.split()[1])
            fields = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                fields[name.strip().lower()] = value.strip().lower()
            if fields.get("transfer-encoding") == "chunked":
                while size := int((await reader.readline()).split(b";")[0], 16):
                    yield await reader.readexactly(size)
                    await reader.readexactly(2)
                await reader.readline()
            else:
                yield await reader.readexactly(int(fields.get("content-length", 0)))
            reusable = fields.get("connection") != "close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _one(client: RawHTTP, path: str, headers: dict, body: dict, timeout: float) -> RequestResult:
    """One streamed request. The SSE events are split from raw bytes and only the usage and error
    events are parsed as JSON: the client should cost the machine little next to the server."""
    res = RequestResult(prompt_len=len(body["prompt"]))
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    last = start
    try:
        async with asyncio.timeout(timeout):
            pieces = client.post(path, headers, payload)
            status = await anext(pieces)
            if status != 200:
                res.error = f"HTTP {status}: {b''.join([p async for p in pieces])[:200]!r}"
                return res
            pending = b""
            async for data in pieces:
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
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_clients(base_url: str, api_key: Optional[str], model: str, prompts: list[list[int]],
                      output_len: int, request_rate: float, seed: int, timeout: float
                      ) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed + 1)
    client = RawHTTP(base_url)
    try:
        tasks = []
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            if i and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
            body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(_one(client, "/completions", headers, body, timeout)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start
    finally:
        client.close()


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


def run_offline(llm, prompts: list[list[int]], output_len: int, paced: list[list[int]], request_rate: float,
                seed: int) -> dict:
    """The workload through ``LLM.generate``; then the first-token times of ``paced`` (other
    prompts of the same shape, so none is in the prefix cache) fed to the same ``LLM`` on the
    server's arrival schedule (Poisson at ``request_rate``, the clients' seed): a request joins
    the next ``step()`` after it arrives, and shares it with the requests still decoding, as on
    the server. Only HTTP, JSON and the engine process's pipe are missing."""
    from qwen_ops import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.thread_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration, cpu = time.perf_counter() - start, time.thread_time() - cpu
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    firsts = _paced_first_tokens(llm, paced, params, request_rate, seed)
    in_tokens = sum(len(p) for p in prompts)
    print(f"{' Offline LLM.generate (same workload) ':=^50}")
    print(f"{'Benchmark duration (s):':<40}{duration:<10.2f}")
    print(f"{'CPU (s):':<40}{cpu:<10.3f}")
    print(f"{'Output token throughput (tok/s):':<40}{out_tokens / duration:<10.2f}")
    print(f"{'Total Token throughput (tok/s):':<40}{(in_tokens + out_tokens) / duration:<10.2f}")
    print(f"{'Median first token, same arrivals (ms):':<40}{1000 * statistics.median(firsts):<10.2f}")
    print(LINE)
    return {"output_throughput": out_tokens / duration, "first_token": statistics.median(firsts)}


def _paced_first_tokens(llm, prompts: list[list[int]], params, request_rate: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)                   # run_clients' schedule
    due, t = [], 0.0
    for i in range(len(prompts)):
        if i and request_rate != float("inf"):
            t += rng.expovariate(request_rate)
        due.append(t)
    start = time.perf_counter()
    added: dict[str, float] = {}
    firsts: dict[str, float] = {}
    nxt = 0
    while nxt < len(prompts) or llm.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(prompts) and due[nxt] <= now:
            rid = llm.add_request(prompts[nxt], params, request_id=f"paced-{nxt}")
            # From when it was due, as a client's clock starts at send: one that falls due during a
            # step waits for that step here, as it does in the server's engine loop.
            added[rid] = start + due[nxt]
            nxt += 1
        if llm.has_unfinished_requests():
            for out in llm.step():
                if out.request_id not in firsts and out.outputs[0].token_ids:
                    firsts[out.request_id] = time.perf_counter() - added[out.request_id]
        elif nxt < len(prompts):
            time.sleep(max(0.0, due[nxt] - (time.perf_counter() - start)))
    return list(firsts.values())


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


def _core_cpu_reader(engine):
    """A function giving the CPU seconds of the engine loop: its thread here, or its process."""
    core = engine._core
    if getattr(core, "process", None) is not None:
        path = Path(f"/proc/{core.process.pid}/stat")
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

        def process_cpu() -> Optional[float]:
            try:
                fields = path.read_text().rsplit(")", 1)[1].split()
            except OSError:
                return None
            return (int(fields[11]) + int(fields[12])) / tick      # utime + stime
        return process_cpu
    thread = getattr(core, "thread", None)
    return lambda: _thread_cpu(thread)


@contextlib.contextmanager
def launched(args):
    """An in-process server on a free loopback port (``--launch``): yields its base URL, the
    AsyncLLM and the server's thread."""
    from qwen_ops.serving.async_llm import AsyncLLM
    from qwen_ops.serving.openai import ServerThread, build_app, default_served_model_name

    engine = AsyncLLM.from_pretrained(args.checkpoint, max_num_seqs=args.max_num_seqs,
                                      max_model_len=args.max_model_len, engine_process=args.engine_process)
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
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="with --launch: the engine core in its own process (default) or on a thread here")
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
        llm = server_thread = None
        engine_cpu = lambda: None        # noqa: E731 - CPU seconds of the engine loop, where readable
        if args.launch:
            base_url, engine, server_thread = stack.enter_context(launched(args))
            llm = engine.llm                 # None when the engine core runs in its own process
            engine_cpu = _core_cpu_reader(engine)
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
            llm.generate(prompts(1)[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        ratios, ttft_gaps = [], []
        for rep in range(args.repeats):
            cpu_before = _thread_cpu(server_thread), engine_cpu()
            results, duration = measure(args, base_url, model, prompts(2 + 2 * rep), args.output_len, args.seed + rep)
            served = report(results, duration, args.request_rate)
            if None not in cpu_before:
                # What each thread cost, whatever else runs on the machine: the HTTP layer (the
                # server's event loop) per generated token, and the engine loop.
                loop_cpu = _thread_cpu(server_thread) - cpu_before[0]
                tokens = sum(r.output_tokens for r in results if r.ok)
                print(f"{'Server event-loop CPU (s):':<40}{loop_cpu:<10.3f}")
                print(f"{'Server event-loop CPU per token (us):':<40}{1e6 * loop_cpu / max(tokens, 1):<10.1f}")
                print(f"{'Engine loop CPU (s):':<40}{engine_cpu() - cpu_before[1]:<10.3f}")
                print(LINE)
            if args.offline:
                off = run_offline(llm, prompts(3 + 2 * rep), args.output_len, paced=prompts(10_000 + rep),
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
