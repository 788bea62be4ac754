"""The fp8 KV cache against the model-dtype cache on the CPU (issue 42 item 4): the real-size
checkpoint of bench_realsize.py (Qwen3-0.6B-shaped, random weights), bf16, one thread.

Two engines in one process (``kv_cache_dtype="auto"`` and ``"fp8"``), driven through the slot API so
that decode steps are timed one by one: for each ``--lengths`` prompt (random ids, the same for both),
both prefill it (alternating, ``--reps`` times: time to first token), then decode ``--steps`` tokens in
groups of ``--group`` steps, the engines alternating group by group (slow drifts of a noisy VM hit
both alike); per-step medians. Then the attention op alone: one layer's decode ``slot_attention``
over the same number of keys, bf16 against fp8 pages, alternating (``--op-reps``).

    OMP_NUM_THREADS=1 python benchmarks/bench_kv_fp8.py [--lengths 2000 4000] [--json F]

The bound: a decode step reads the weights (about 1.19 GB in bf16 with the tied LM head) and every
layer's keys and values (28 x L x 8 x 128 x 2 elements: 0.46 GB bf16 at 4,000, half that in fp8), so a
step limited by memory bandwidth gets at most (1.19 + 0.46) / (1.19 + 0.23) = 1.16x faster at 4,000.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def op_decode(length: int, reps: int) -> dict:
    """Median seconds of one layer's decode attention (16 query / 8 kv heads of 128, one sequence of
    ``length`` keys in pages of 16) from a bf16 cache and from an fp8 one, alternating."""
    import qwen_ops

    g = torch.Generator().manual_seed(0)
    blocks = -(-length // 16)
    kc = torch.randn(blocks, 16, 8, 128, generator=g).to(torch.bfloat16)
    vc = torch.randn(blocks, 16, 8, 128, generator=g).to(torch.bfloat16)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    q = torch.randn(1, 16, 128, generator=g).to(torch.bfloat16)
    meta = (torch.randperm(blocks, generator=g).to(torch.int32)[None], torch.zeros(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([length], dtype=torch.int32))
    one = torch.ones(1)
    runs = {"auto": lambda: torch.ops.qwen.slot_attention(q, kc, vc, *meta, 128 ** -0.5, 1),
            "fp8": lambda: torch.ops.qwen.slot_attention(q, k8, v8, *meta, 128 ** -0.5, 1, None, one, one)}
    times = {k: [] for k in runs}
    with qwen_ops.use_backend("cpu"):
        for _ in range(reps):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                times[name].append((time.perf_counter() - t0) / 10)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[2000, 4000])
    parser.add_argument("--reps", type=int, default=2, help="prefills per engine and length")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per engine and length")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--op-reps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint and short prompts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import bench_long
    import bench_realsize as realsize
    from qwen_ops.engine.engine import QwenEngine

    cache = realsize.default_cache_dir()
    if args.smoke:
        path = realsize.make_checkpoint(cache, bench_long.SMOKE_SHAPE, bench_long.SMOKE_NAME)
        args.lengths, args.steps, args.op_reps = [64, 128], 8, 3
    else:
        path = realsize.make_checkpoint(cache)
    vocab = (bench_long.SMOKE_SHAPE if args.smoke else realsize.SHAPE)["vocab_size"]
    torch.set_num_threads(1)
    max_len = max(args.lengths) + args.steps + 8
    engines = {kv: QwenEngine.from_pretrained(path, dtype=args.dtype, max_slots=1, max_seq_len=max_len,
                                              kv_cache_dtype=kv) for kv in ("auto", "fp8")}
    flags = bench_long.cpu_flags()
    result = {"cpu": realsize._cpu_model(), "cpu_flags": flags, "dtype": args.dtype, "checkpoint": str(path),
              "rows": []}
    print(f"{result['cpu']}; " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in flags.items()), flush=True)
    for L in args.lengths:
        prompt = realsize.prompts(1, L, vocab, seed=L)[0]
        ttft = {k: [] for k in engines}
        for _ in range(args.reps):
            for name, e in engines.items():
                t0 = time.perf_counter()
                first = e.prefill(prompt)
                ttft[name].append(time.perf_counter() - t0)
        # decode from the last prefill of each engine, groups alternating
        tok = {name: e.prefill(prompt).next_token for name, e in engines.items()}
        steps = {k: [] for k in engines}
        for _ in range(0, args.steps, args.group):
            for name, e in engines.items():
                for _ in range(args.group):
                    t0 = time.perf_counter()
                    tok[name] = e.decode_step(tok[name]).next_token
                    steps[name].append(time.perf_counter() - t0)
        op = op_decode(L, args.op_reps)
        row = {"length": L, "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
               "decode_step_s": {k: statistics.median(v) for k, v in steps.items()},
               "op_decode_s": op, "ttft_all": ttft, "steps_all": steps}
        result["rows"].append(row)
        d = row["decode_step_s"]
        print(f"{L} tokens: TTFT auto {row['ttft_s']['auto']:.2f} s, fp8 {row['ttft_s']['fp8']:.2f} s; decode step "
              f"auto {d['auto'] * 1e3:.1f} ms, fp8 {d['fp8'] * 1e3:.1f} ms (fp8 {d['auto'] / d['fp8']:.2f}x); "
              f"attention op auto {op['auto'] * 1e3:.3f} ms, fp8 {op['fp8'] * 1e3:.3f} ms "
              f"({op['auto'] / op['fp8']:.2f}x)", flush=True)
    print("\n| prompt | TTFT auto (s) | TTFT fp8 (s) | decode auto (tok/s) | decode fp8 (tok/s) | fp8 decode speed-up "
          "| one layer's decode attention auto / fp8 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        d, t, o = r["decode_step_s"], r["ttft_s"], r["op_decode_s"]
        print(f"| {r['length']} | {t['auto']:.2f} | {t['fp8']:.2f} | {1 / d['auto']:.2f} | {1 / d['fp8']:.2f} | "
              f"{d['auto'] / d['fp8']:.2f}x | {o['auto'] * 1e3:.3f} / {o['fp8'] * 1e3:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
