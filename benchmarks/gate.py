"""Performance gate: speed ratios measured in ONE run, compared with thresholds.

Absolute times on these shared machines jump around; ratios of two implementations measured
side by side (interleaved where possible, medians) do not. The gate fails only on ratios.

    OMP_NUM_THREADS=1 python benchmarks/gate.py            # full sizes (the issue targets)
    OMP_NUM_THREADS=1 python benchmarks/gate.py --short    # CI: smaller workloads

Ratios (higher is better):
  compiled_vs_eager_decode   eager / compiled per-step decode time, batch 1 (eager: the native CPU executor)
  compiled_vs_op_path_decode the eager op path (the model's forward, no native executor) / compiled, batch 1
  batched_vs_loop_decode     per-token time of a decode_step loop over 32 requests / one batch_decode_step
  generate_vs_transformers   LLM.generate tokens/s / transformers generate tokens/s (32 requests)
  single_vs_transformers     the same for a single request
  *_compiled                 the last two with LLM(compile=True) (full mode only)
The floors are per CPU vendor (THRESHOLDS_BY_VENDOR); the CPU is printed first.
The full mode also runs bench_realsize.py (a Qwen3-0.6B-shaped model, fp32 and bf16, against
transformers, and the decode step against the measured memory bandwidth): figures only, no floor,
so a slow transformers run (or a busy machine) never fails the gate. ``--no-realsize`` skips it.
Thresholds and the last measured values live in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Floors the CI gate enforces, per CPU vendor: regression guards set below what this code
# measures on each kind of 2-core machine here, NOT the issue targets (benchmarks/README.md lists
# those, with the measured values). The vendors differ most where the weights stream: the AMD
# EPYC VMs keep the embedded model's 16.5 MB of packed weights in a large L3, the Intel Xeon VMs
# read them from DRAM, so the batch-1 step is 0.40-0.51 ms there against about 1.0 ms here.
# Each floor still fails the regressions that matter: with the native CPU forward off (the torch
# path), the generate ratios measure about 1x on both (benchmarks/README.md).
THRESHOLDS_BY_VENDOR = {
    "AuthenticAMD": {
        # The eager CPU decode step is one C call (cpu.dense_forward on packed weights); the
        # compiled step runs Inductor's code around MKL and the qwen ops: 0.29-0.50. A loose guard.
        "compiled_vs_eager_decode": 0.15,
        "compiled_vs_op_path_decode": 0.9,   # not measured on AMD yet (Intel: 1.36-1.52); the target is 1.5
        "batched_vs_loop_decode": 4.0,       # 6.5-7.2 measured (full and --short)
        "generate_vs_transformers": 1.8,     # 2.3-2.7
        "single_vs_transformers": 2.5,       # 3.6-4.8
        # full mode only: LLM(compile=True)
        "generate_vs_transformers_compiled": 1.2,   # 1.7-1.9
        "single_vs_transformers_compiled": 1.0,     # 1.4-1.8
    },
    "GenuineIntel": {                        # two Xeon VMs (AVX-512, no AMX), 2026-11-30
        "compiled_vs_eager_decode": 0.15,    # 0.47-0.52
        "compiled_vs_op_path_decode": 1.0,   # 1.36, 1.47 (--short), 1.52 (full)
        "batched_vs_loop_decode": 4.0,       # 7.6-8.6
        "generate_vs_transformers": 1.15,    # 1.27-1.92; 0.80 with the native forward off
        "single_vs_transformers": 1.8,       # 2.41-4.10; 0.79 with the native forward off
        "generate_vs_transformers_compiled": 0.9,   # 1.25-1.31
        "single_vs_transformers_compiled": 1.0,     # 1.88-1.92
    },
}
# Without a C compiler the cpu backend (its packed products, its one-call forward) is off and the
# engine runs torch ops: the floors of that build (AMD measured ~1x before the native kernels,
# Intel 0.79-0.80).
THRESHOLDS_WITHOUT_CPU_KERNELS = {name: 0.6 for name in THRESHOLDS_BY_VENDOR["AuthenticAMD"]} | {
    "batched_vs_loop_decode": 7.0}


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (AuthenticAMD, GenuineIntel, ...), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown model"


def thresholds_for(vendor: str) -> dict[str, float]:
    """The vendor's floors; a CPU not measured here gets the lowest floor of any vendor."""
    if vendor in THRESHOLDS_BY_VENDOR:
        return THRESHOLDS_BY_VENDOR[vendor]
    names = THRESHOLDS_BY_VENDOR["AuthenticAMD"]
    return {n: min(t[n] for t in THRESHOLDS_BY_VENDOR.values()) for n in names}


def _median_interleaved(fns: dict, reps: int) -> dict[str, float]:
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _median_blocked(fns: dict, reps: int, block: int = 10) -> dict[str, float]:
    """Like ``_median_interleaved``, alternating runs of ``block`` calls and dropping each run's
    first call: a decode step is a few hundred microseconds, and right after the other engine's
    step it pays for that step's cache traffic, which a real decode loop never does."""
    times = {k: [] for k in fns}
    for _ in range(max(1, reps // block)):
        for k, fn in fns.items():
            for i in range(block + 1):
                t0 = time.perf_counter()
                fn()
                if i:
                    times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def compiled_vs_eager(path: Path, steps: int) -> dict:
    from qwen_ops.engine.engine import QwenEngine
    from qwen_ops.models.loader import load_checkpoint

    # One model (one copy of the weights) under both engines: steps of the two are interleaved,
    # and two weight copies would evict each other from the cache, measuring the cache, not the step.
    ckpt = load_checkpoint(path)
    state = {}
    for name, comp, native in (("eager", False, True), ("compiled", True, True), ("op_path", False, False)):
        eng = QwenEngine(ckpt.model, ckpt.config, max_slots=4, max_seq_len=512, compile=comp, native_cpu=native)
        t0 = time.perf_counter()
        tok = eng.prefill(list(range(10, 74))).next_token
        for _ in range(3):
            tok = eng.decode_step(tok).next_token
        state[name] = [eng, tok, time.perf_counter() - t0]

    def step(name):
        def run():
            eng, tok, _ = state[name]
            state[name][1] = eng.decode_step(tok).next_token
        return run

    med = _median_blocked({k: step(k) for k in state}, steps)
    return {"ratio": med["eager"] / med["compiled"], "eager_ms": 1e3 * med["eager"],
            "compiled_ms": 1e3 * med["compiled"], "compiled_warmup_s": state["compiled"][2],
            "op_path_ms": 1e3 * med["op_path"]}


def batched_vs_loop(path: Path, n_requests: int, steps: int) -> dict:
    from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
    from qwen_ops.engine.sampling import SamplingParams

    eng = QwenEngine.from_pretrained(path, max_slots=2 * n_requests, max_seq_len=512, compile=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=10_000, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(16)] for i in range(n_requests)]
    batch = [QwenBatchedRequest(i, p, i, sp) for i, p in enumerate(prompts)]
    eng.batch_prefill(batch)
    loop_slots = list(range(n_requests, 2 * n_requests))
    last = [eng.prefill(p, slot_id=s).next_token for p, s in zip(prompts, loop_slots)]

    def batched():
        eng.batch_decode_step(batch)

    def loop():
        for i, s in enumerate(loop_slots):
            last[i] = eng.decode_step(last[i], slot_id=s).next_token

    med = _median_interleaved({"batched": batched, "loop": loop}, steps)
    return {"ratio": med["loop"] / med["batched"], "batched_ms_per_token": 1e3 * med["batched"] / n_requests,
            "loop_ms_per_token": 1e3 * med["loop"] / n_requests}


def generate_vs_transformers(path: Path, n_requests: int, prompt_len: int, new_tokens: int, compile: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from qwen_ops.serving.llm import LLM
    from qwen_ops.engine.sampling import SamplingParams

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (n_requests, prompt_len), generator=g)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The default token budget (512 here): the 32 prompts prefill in 4 steps that mix with decodes.
    # One 2048-token step measured 9% slower end to end (larger temporaries, more cache misses).
    llm = LLM(path, max_num_seqs=max(n_requests, 1), max_model_len=prompt_len + new_tokens + 8, compile=compile)
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    def run_hf(ids):
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    def run_ours(ids):
        return [o.outputs[0].token_ids for o in llm.generate(ids.tolist(), sp)]

    result = {}
    for label, ids in (("batch", prompts), ("single", prompts[:1])):
        # Warm-up on the workload itself: with compile=True the decode step compiles one graph for
        # batch 1 and one for the other buckets, and a short
        # warm-up run would not reach them all.
        run_ours(ids)
        run_hf(ids)
        t_ours, t_hf = [], []
        for _ in range(2 if label == "batch" else 3):
            t0 = time.perf_counter()
            ours = run_ours(ids)
            t_ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = run_hf(ids)
            t_hf.append(time.perf_counter() - t0)
        same = sum(a == b for a, b in zip(ours, ref))
        tokens = ids.shape[0] * new_tokens
        result[label] = {"ratio": statistics.median(t_hf) / statistics.median(t_ours),
                         "ours_tok_s": tokens / statistics.median(t_ours), "hf_tok_s": tokens / statistics.median(t_hf),
                         "same_tokens": f"{same}/{ids.shape[0]}"}
    return result


def realsize() -> dict:
    """bench_realsize.py's measurements, printed (no floor: they never fail the gate; nor does an
    error, which is printed and recorded, so the ratios above still decide)."""
    import importlib.util
    import traceback

    spec = importlib.util.spec_from_file_location("qwen_ops_bench_realsize",
                                                  Path(__file__).with_name("bench_realsize.py"))
    bench = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(bench)
        measured = bench.run()
    except Exception as exc:   # noqa: BLE001  (reported, not fatal: see the docstring)
        traceback.print_exc()
        print(f"real-size benchmark failed: {exc!r} (not a gate failure)", file=sys.stderr)
        return {"error": repr(exc)}
    bench.print_report(measured)
    return measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="smaller workloads for CI")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled-decode ratio")
    parser.add_argument("--no-realsize", action="store_true", help="full mode: skip bench_realsize.py")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: set OMP_NUM_THREADS=1; timings with more threads are erratic here", file=sys.stderr)
    from qwen_ops.models.defaults import default_model_path

    path = args.model or default_model_path()
    short = args.short
    results = {}
    if not args.no_compile:
        decode = compiled_vs_eager(path, steps=30 if short else 100)
        results["compiled_vs_eager_decode"] = decode
        results["compiled_vs_op_path_decode"] = {"ratio": decode["op_path_ms"] / decode["compiled_ms"],
                                                 "op_path_ms": decode["op_path_ms"],
                                                 "compiled_ms": decode["compiled_ms"]}
    results["batched_vs_loop_decode"] = batched_vs_loop(path, n_requests=32, steps=5 if short else 20)
    gen = generate_vs_transformers(path, n_requests=32, prompt_len=64, new_tokens=16 if short else 64,
                                   compile=False)
    results["generate_vs_transformers"] = gen["batch"]
    results["single_vs_transformers"] = gen["single"]
    if not short and not args.no_compile:
        # The same workload with the compiled decode step (compile time excluded: warmed up first).
        gen = generate_vs_transformers(path, n_requests=32, prompt_len=64, new_tokens=64, compile=True)
        results["generate_vs_transformers_compiled"] = gen["batch"]
        results["single_vs_transformers_compiled"] = gen["single"]

    from qwen_ops.ops.kernels import cpu

    vendor = cpu_vendor()
    thresholds = thresholds_for(vendor)
    print(f"CPU: {vendor} ({_cpu_model()}); floors for {vendor if vendor in THRESHOLDS_BY_VENDOR else 'an unmeasured CPU'}")
    if cpu.why_unavailable() is not None:
        print(f"note: cpu backend unavailable ({cpu.why_unavailable()}): torch-path floors", file=sys.stderr)
        thresholds = THRESHOLDS_WITHOUT_CPU_KERNELS
    failed = []
    print(f"{'ratio':<28} {'measured':>9} {'floor':>7}  details")
    for name, r in results.items():
        floor = thresholds[name]
        ok = r["ratio"] >= floor
        failed += [] if ok else [name]
        details = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "ratio")
        print(f"{name:<28} {r['ratio']:>8.2f}x {floor:>6.2f}x  {'ok ' if ok else 'LOW'} {details}")
    if not short and not args.no_realsize:
        results["realsize"] = realsize()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if failed:
        print(f"gate FAILED: {', '.join(failed)} below the floor", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
