"""Quantized decode speed at real size (issue 28): the Qwen3-0.6B-shaped random checkpoint of
``bench_realsize.py`` in fp32, bf16, online int8 and fp8, and written by ``qwen_ops.models.quant_export``
in the GPTQ (4 and 8 bits) and AWQ layouts (group 128), one process, one variant at a time.

    OMP_NUM_THREADS=1 python benchmarks/bench_quant.py [--threads 1 2] [--variants ...] [--json FILE]
        [--checkpoint DIR]    (a smoke run on another full-precision checkpoint)

For each variant and thread count:
- decode alone: the median 1-request ``decode_step``, steps back to back (tokens/s, as llama-bench's tg),
  the bytes of weights one step reads (quantized buffers, packed panels, norm vectors, the LM head) and that
  as a fraction of the machine's read bandwidth, measured before and after the steps (``read_bandwidth_probe``);
- end to end: ``LLM.generate`` of 1 and 8 requests (32-token prompts, 16 new tokens, greedy,
  ignore_eos): generated tokens over the wall time of the call, median of ``--reps``;
- tokens: the quantized model's greedy tokens (8 requests) against the same model with its quantized
  layers on their ops' references (dequantize, then multiply: the oracle): with fp32 activations a
  mismatch marks the row FAIL and the script exits 1 (with bf16 the count of equal tokens is shown);
- the peak host memory of loading each GPTQ / AWQ checkpoint, in a fresh process, against its size.
``--vs-bf16``: only the one-request decode step of each variant against the bf16 model's, the two
stepped alternately in blocks of ``--block`` steps in one process (the ratio the issue's decode targets
name, of the steps that follow a step of the same model; a block's first step apart); with ``--compile``
both engines compile their decode step (``LLM(compile=True)``).
``--one-row``: only the one-row int8 / int4 products of the model's shapes, rows and panels, against the
measured read bandwidth (the issue's item 3): the panels as torch.ops calls from Python, and their kernel
alone, called back to back from C (``one_row_timer.c``, compiled with the system's ``cc``).
Figures: benchmarks/README.md ("Quantized weights (issue 28)").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_realsize import default_cache_dir, make_checkpoint, prompts, read_bandwidth_probe  # noqa: E402

# "<scheme>-bf16": bf16 activations, embeddings and (but for int8) LM head; else fp32.
# "...a8": int8 activations too (quantization "w8a8" online, "gptq_a8" / "awq_a8" on those files).
# "...-qhead": the GPTQ file stores the LM head quantized too (``lm_head: true``).
VARIANTS = ("float32", "bfloat16", "int8", "int8-bf16", "fp8-bf16", "gptq4", "gptq4-bf16", "gptq8-bf16", "awq4-bf16",
            "w8a8", "w8a8-bf16", "gptq4a8-bf16", "awq4a8-bf16", "gptq4-bf16-qhead", "gptq4a8-bf16-qhead")


def checkpoint_for(variant: str, base: Path) -> tuple[Path, dict]:
    """(checkpoint dir, LLM kwargs) of a variant; the GPTQ / AWQ files are written once, into the
    cache dir (``bench_realsize.default_cache_dir``)."""
    if variant in ("float32", "bfloat16"):
        return base, {"dtype": variant}
    qhead = variant.endswith("-qhead")
    scheme, _, act = variant.removesuffix("-qhead").partition("-")
    kwargs = {"dtype": "bfloat16" if act == "bf16" else "float32"}
    if scheme in ("int8", "fp8", "w8a8"):
        return base, {**kwargs, "quantization": scheme}
    a8 = scheme.endswith("a8")
    scheme = scheme.removesuffix("a8")
    fmt, bits = scheme[:-1], int(scheme[-1])
    if a8:
        kwargs["quantization"] = f"{fmt}_a8"
    # never beside a checkpoint in the repo
    path = default_cache_dir() / f"{base.name}-{scheme}-g128{'-qhead' if qhead else ''}"
    if not (path / "model.safetensors").exists():
        from qwen_ops.models.quant_export import export
        export(base, path, fmt, bits, 128, lm_head=qhead)
    return path, kwargs


def step_bytes(model) -> int:
    """Bytes one decode step reads: quantized layers' buffers (not twice: a fused ``*_quant`` product
    and the layers that view it share them), packed panels, 1-D parameters."""
    total = 0
    for name, t in model.named_buffers():
        if name.endswith(("_packed", "_bias")) or (name.rpartition(".")[2] in ("qweight", "scales", "zeros")
                                                    and "_quant." not in name):
            total += t.numel() * t.element_size()
    for p in model.parameters():
        if p.dim() == 1:
            total += p.numel() * p.element_size()
    return total


def reference_twin(llm) -> None:
    """Switch every QuantLinear of the engine's model (the fused products too) to its op's reference
    (dequantize to fp32, then multiply: kernels/reference_quant.py), the oracle of the greedy tokens."""
    from qwen_ops.models.quant import QuantLinear

    for m in llm.engine.model.modules():
        if isinstance(m, QuantLinear):
            m.use_references()


def load_memory(path: Path, kwargs: dict) -> dict:
    """Peak host memory of loading the checkpoint, in a fresh process: the growth of its peak
    resident set (``VmHWM``) over the load, against the checkpoint's bytes on disk. Not
    ``ru_maxrss``: it survives fork + exec, so a child of this (large) process starts with our
    peak and would show no growth at all."""
    import subprocess

    code = ("import json, sys, torch; from qwen_ops.models.loader import load_model; "
            "hwm = lambda: int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024; "
            f"base = hwm(); m = load_model({str(path)!r}, **json.loads(sys.argv[1])); "
            "print(hwm() - base)")
    load_kwargs = {k: v for k, v in kwargs.items() if k in ("dtype", "quantization")}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(load_kwargs)], capture_output=True, text=True,
                         check=True)
    disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    peak = int(out.stdout.strip().splitlines()[-1])
    return {"load_peak_gb": peak / 1e9, "checkpoint_gb": disk / 1e9, "peak_over_checkpoint": peak / disk}


def measure(variant: str, base: Path, threads: int, reps: int, steps: int) -> dict:
    from qwen_ops import LLM, SamplingParams

    torch.set_num_threads(threads)
    path, kwargs = checkpoint_for(variant, base)
    t0 = time.perf_counter()
    llm = LLM(str(path), max_num_seqs=8, max_model_len=64, enable_prefix_caching=False, **kwargs)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    row = {"variant": variant, "threads": threads, "load_s": load_s, "weight_gb": step_bytes(eng.model) / 1e9}
    if threads == 1 and variant.startswith(("gptq", "awq")):
        row.update(load_memory(path, kwargs))
    probe = read_bandwidth_probe()
    slot = eng.allocate_slot("bench_quant")
    vocab = eng.vocab_size
    tok = eng.prefill(prompts(1, 32, vocab)[0], slot_id=slot).next_token
    # The steps back to back, as llama-bench's tg runs them (a 1 GiB probe between steps evicts what a
    # step leaves in the caches for the next; the AMX VM reports a 480 MB L3); the probe three times
    # before and after them.
    times, bws = [], [probe() for _ in range(3)]
    for i in range(steps + 1):
        t = time.perf_counter()
        tok = eng.decode_step(tok, slot_id=slot).next_token
        if i:
            times.append(time.perf_counter() - t)
    bws += [probe() for _ in range(3)]
    eng.free_slot(slot)
    step = statistics.median(times)
    row.update(decode_tok_s=1 / step, read_gb_s=statistics.median(bws) / 1e9,
               bandwidth_fraction=row["weight_gb"] * 1e9 / step / statistics.median(bws))
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for n in (1, 8):
        ps = prompts(n, 32, vocab, seed=n)
        llm.generate(ps, sp, use_tqdm=False)                                   # warm-up
        walls = []
        for _ in range(reps):
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t)
        row[f"e2e_{n}_tok_s"] = 16 * n / statistics.median(walls)
        if n == 8:
            tokens = [o.outputs[0].token_ids for o in outs]
    if variant not in ("float32", "bfloat16"):           # quantized
        reference_twin(llm)
        twin = [o.outputs[0].token_ids for o in llm.generate(prompts(8, 32, vocab, seed=8), sp, use_tqdm=False)]
        same = sum(a == b for t, u in zip(twin, tokens) for a, b in zip(t, u))
        row["tokens_same"] = f"{same}/{sum(len(t) for t in tokens)}"
        # fp32 activations: the kernel and the reference differ in the order of fp32 sums only, so on
        # this peaked model the tokens must agree; bf16 rounds every layer's output, and an order
        # difference can flip a rounding and, rarely, a token: reported, not failed.
        row["tokens_match_reference"] = twin == tokens if kwargs["dtype"] == "float32" else None
    del llm, eng
    gc.collect()
    return row


def decode_vs_bf16(variants, base: Path, threads: int, steps: int, compile: bool = False, block: int = 8
                   ) -> list[dict]:
    """The one-request decode step of each variant against the bf16 model's, the two stepped
    alternately in one process (this VM's read bandwidth drifts by a third between minutes, so a
    ratio of two sequential measurements is mostly noise), in blocks of ``block`` steps: within a
    block a model's steps run back to back, as in a decode (and llama-bench's tg), and the ratio is of
    the medians of those (at least ``steps`` each). A block's first step follows the other model's
    block, which has evicted what a step leaves in the caches for the next: it is kept apart
    (``first_ratio``; stepping one step each in turn measures only such steps)."""
    from qwen_ops import LLM

    if block < 2:
        raise ValueError(f"block = {block}, expected >= 2 (a block's first step is kept apart)")
    torch.set_num_threads(threads)
    rounds = -(-steps // (block - 1))
    max_len = 32 + (rounds + 1) * block + 8
    engines = {"bfloat16": LLM(str(base), max_num_seqs=1, max_model_len=max_len, enable_prefix_caching=False,
                               dtype="bfloat16", compile=compile).engine}
    out = []
    for variant in variants:
        path, kwargs = checkpoint_for(variant, base)
        engines[variant] = LLM(str(path), max_num_seqs=1, max_model_len=max_len, enable_prefix_caching=False,
                               compile=compile, **kwargs).engine
        state = {}
        for name in ("bfloat16", variant):
            eng = engines[name]
            slot = eng.allocate_slot("vs_bf16")
            state[name] = [eng, slot, eng.prefill(prompts(1, 32, eng.vocab_size)[0], slot_id=slot).next_token,
                           [], []]
        for r in range(rounds + 1):          # round 0 warms up
            for name in ("bfloat16", variant):
                st = state[name]
                for i in range(block):
                    t = time.perf_counter()
                    st[2] = st[0].decode_step(st[2], slot_id=st[1]).next_token
                    if r:
                        (st[3] if i else st[4]).append(time.perf_counter() - t)
        for name in ("bfloat16", variant):
            state[name][0].free_slot(state[name][1])
        (bf16, bf16_first), (var, var_first) = ((statistics.median(state[n][3]), statistics.median(state[n][4]))
                                                for n in ("bfloat16", variant))
        out.append({"variant": variant, "threads": threads, "bf16_tok_s": 1 / bf16, "tok_s": 1 / var,
                    "ratio": bf16 / var, "first_ratio": bf16_first / var_first, "bf16_first_tok_s": 1 / bf16_first,
                    "first_tok_s": 1 / var_first, "steps": len(state[variant][3]), "block": block,
                    "compile": compile})
        del engines[variant]
        gc.collect()
    return out


ONE_ROW_SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                  "LM head": (151936, 1024)}


def kernel_timer():
    """``time(kind, x, panels, scales, zeros, n, y) -> seconds``: ``one_row_timer.c`` (compiled here, into the
    CPU kernels' cache directory) calling the loaded library's ``qwen_linear_a8_panels`` once on each of
    ``panels`` from C, back to back: the kernel without a torch.ops call's Python and dispatcher."""
    import ctypes
    import subprocess

    from qwen_ops.ops.kernels import cpu

    source = Path(__file__).resolve().parent / "one_row_timer.c"
    out = cpu.cache_dir() / "one_row_timer.so"
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fPIC", "-shared", str(source), "-o", str(out)],
                       check=True, capture_output=True)
    timer = ctypes.CDLL(str(out))
    timer.qwen_time_a8_panels.restype = ctypes.c_double
    timer.qwen_time_a8_panels.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    kernel = ctypes.cast(cpu.library().qwen_linear_a8_panels, ctypes.c_void_p).value

    def time_calls(kind: str, x: torch.Tensor, panels: list[torch.Tensor], scales: torch.Tensor,
                   zeros, n: int, y: torch.Tensor) -> float:
        ptrs = (ctypes.c_void_p * len(panels))(*[p.data_ptr() for p in panels])
        k = x.shape[1]
        seconds = timer.qwen_time_a8_panels(kernel, 0 if kind == "int8" else 1, x.data_ptr(), ptrs, len(panels),
                                            scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
                                            k // scales.shape[1], n, k, y.data_ptr(), torch.get_num_threads())
        if seconds < 0:
            raise RuntimeError("qwen_linear_a8_panels failed (scratch memory)")
        return seconds

    return time_calls


def one_row_products(threads: int, rounds: int, total_mb: int = 300) -> list[dict]:
    """Item 3's figure: the one-row int8 / int4 (groups of 128) products of the 0.6B model's shapes, each
    streaming ``total_mb`` MB of distinct weights (so from DRAM), as ``linear_*_a8`` rows and as
    ``linear_a8_panels`` (what the layers run on VNNI CPUs; one ``HugePageArena`` as a model's), against the
    read-bandwidth probe measured between them: GB/s of the bytes a product reads (weights, scales and int4's
    zeros), medians of ``rounds`` alternating rounds (this VM's bandwidth drifts)."""
    from qwen_ops.models.quant import pack_a8_panels
    from qwen_ops.ops.kernels import cpu

    torch.set_num_threads(threads)
    probe = read_bandwidth_probe()
    time_kernel = kernel_timer()
    out = []
    for kind in ("int8", "int4"):
        for name, (n, k) in ONE_ROW_SHAPES.items():
            g = torch.Generator().manual_seed(n + k)
            s = torch.rand(n, k // 128, generator=g) * 0.01
            if kind == "int8":
                q, z = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None
            else:
                q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
                z = torch.randint(0, 16, (n, k // 128), generator=g, dtype=torch.uint8)
            w, sp, zp = pack_a8_panels(q, s, z)
            copies = max(2, total_mb * (1 << 20) // q.numel())
            rows = [q.clone() for _ in range(copies)]
            arena = cpu.HugePageArena(copies * (w.numel() + 64))     # as a model's layers: one after another
            panels = [arena.take(tuple(w.shape), w.dtype).copy_(w) for _ in range(copies)]
            x = torch.randn(1, k, generator=g)
            # the overloads themselves, as the layers call them (not the packets, which resolve one per call)
            ref = torch.ops.qwen.linear_int8_a8.default if kind == "int8" else torch.ops.qwen.linear_int4_a8.default
            panels_op = torch.ops.qwen.linear_a8_panels.default
            want = ref(x, q, s, None) if z is None else ref(x, q, s, z, None)
            got = panels_op(x, w, sp, zp, None, n)
            if not torch.equal(got, want):          # a fast wrong product is no figure
                raise AssertionError(f"{kind} {name}: linear_a8_panels differs from linear_{kind}_a8")
            y = torch.full((1, n), float("nan"))
            time_kernel(kind, x, panels[:1], sp, zp, n, y)
            if not torch.equal(y, want):            # the C loop runs the op's kernel, on the same arguments
                raise AssertionError(f"{kind} {name}: the timed kernel differs from linear_{kind}_a8")
            calls = {"rows": lambda: [ref(x, r, s, None) if z is None else ref(x, r, s, z, None) for r in rows],
                     "panels": lambda: [panels_op(x, p, sp, zp, None, n) for p in panels]}
            times = {"rows": [], "panels": [], "kernel": [], "probe": []}
            for fn in calls.values():
                fn()                                 # warm-up
            for _ in range(rounds):
                # each timing after the probe's 1 GB of other reads: the panels and their kernel alone read the
                # same 300 MB, which this host's 480 MB L3 would otherwise keep in part for the second of them
                for key, fn in calls.items():
                    times["probe"].append(probe())
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
                times["probe"].append(probe())
                times["kernel"].append(time_kernel(kind, x, panels, sp, zp, n, y))
            # every byte a product reads: the weights, their scales and (int4) zeros (the same in both layouts)
            nbytes = copies * (q.numel() + 4 * s.numel() + (0 if z is None else z.numel()))
            bw = statistics.median(times["probe"])
            row = {"kind": kind, "shape": name, "n": n, "k": k, "threads": threads, "probe_gb_s": bw / 1e9}
            for key in ("rows", "panels", "kernel"):
                rate = nbytes / statistics.median(times[key])
                row[f"{key}_gb_s"], row[f"{key}_fraction"] = rate / 1e9, rate / bw
            row["bytes_per_call"] = nbytes // copies
            for key in ("panels", "kernel"):
                row[f"{key}_us_per_call"] = statistics.median(times[key]) / copies * 1e6
            out.append(row)
            del rows, panels
            gc.collect()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a full-precision checkpoint instead of the 0.6B-shaped one (a smoke run)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--vs-bf16", action="store_true",
                        help="only the decode step of each variant against bf16's, stepped alternately")
    parser.add_argument("--block", type=int, default=8,
                        help="with --vs-bf16: steps of one model before the other's (a block's first step is kept "
                             "apart)")
    parser.add_argument("--compile", action="store_true",
                        help="with --vs-bf16: both engines with compile=True (the decode step torch.compiled)")
    parser.add_argument("--one-row", action="store_true",
                        help="only the one-row int8 / int4 products of the model's shapes against the read bandwidth")
    args = parser.parse_args(argv)
    if args.one_row:
        rows = [r for threads in args.threads for r in one_row_products(threads, max(3, args.reps))]
        print("| product | shape (N x K) | threads | rows: GB/s, of probe | panels: GB/s, of probe | "
              "panels kernel alone: GB/s, of probe | probe (GB/s) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kind']} {r['shape']} | {r['n']} x {r['k']} | {r['threads']} | {r['rows_gb_s']:.1f}, "
                  f"{100 * r['rows_fraction']:.0f}% | {r['panels_gb_s']:.1f}, {100 * r['panels_fraction']:.0f}% | "
                  f"{r['kernel_gb_s']:.1f}, {100 * r['kernel_fraction']:.0f}% | {r['probe_gb_s']:.1f} |")
        print("\n| panels | threads | per call: torch.ops call, kernel alone, the difference (us) |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['kind']} {r['shape']} | {r['threads']} | {r['panels_us_per_call']:.1f}, "
                  f"{r['kernel_us_per_call']:.1f}, {r['panels_us_per_call'] - r['kernel_us_per_call']:.1f} |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    base = args.checkpoint or make_checkpoint(args.cache_dir or default_cache_dir())
    if args.vs_bf16:
        rows = [r for threads in args.threads
                for r in decode_vs_bf16(args.variants, base, threads, 3 * args.steps, args.compile, args.block)]
        print("| variant | threads | engine | bf16 decode (tok/s) | variant decode (tok/s) | ratio | "
              "a block's first step: ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['threads']} | {'compile=True' if r['compile'] else 'eager'} | "
                  f"{r['bf16_tok_s']:.1f} | {r['tok_s']:.1f} | {r['ratio']:.2f}x | {r['first_ratio']:.2f}x |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    rows = []
    print("| variant | threads | weights read (GB) | decode alone (tok/s) | of read bandwidth | "
          "1 request e2e (tok/s) | 8 requests e2e (tok/s) | greedy = reference |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for variant in args.variants:
            r = measure(variant, base, threads, args.reps, args.steps)
            rows.append(r)
            match = r.get("tokens_match_reference")
            print(f"| {variant} | {threads} | {r['weight_gb']:.2f} | {r['decode_tok_s']:.1f} | "
                  f"{100 * r['bandwidth_fraction']:.0f}% of {r['read_gb_s']:.1f} GB/s | {r['e2e_1_tok_s']:.1f} | "
                  f"{r['e2e_8_tok_s']:.1f} | {r.get('tokens_same', '-')}"
                  f"{'' if match is None else (' yes' if match else ' FAIL')} |", flush=True)
    for r in rows:
        if "load_peak_gb" in r:
            print(f"load of {r['variant']}: peak {r['load_peak_gb']:.2f} GB for a {r['checkpoint_gb']:.2f} GB "
                  f"checkpoint ({r['peak_over_checkpoint']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if any(r.get("tokens_match_reference") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
