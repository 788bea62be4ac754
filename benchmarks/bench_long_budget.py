"""The prefill token budget (issue 42, item 3): how ``max_num_batched_tokens`` changes a long prompt's
time to first token, and what it does to the decodes that share its steps.

    OMP_NUM_THREADS=1 python benchmarks/bench_long_budget.py [--budgets 512 1024 2048 4096] [--dtype bfloat16]

For each budget, one ``LLM`` on the real-size checkpoint of bench_realsize.py (Qwen3-0.6B-shaped,
random weights) runs, stepping by hand (``add_request`` / ``step``):

- ``--decodes`` (4) requests of 32-token prompts decoding (greedy, ignore_eos) until each has 4 tokens;
- then one ``--length`` (2,000) token prompt (fresh random ids each round) arrives, and the steps run
  until it has its first token. Its time to first token is from its arrival; the decodes' inter-token
  latencies are the gaps between their consecutive tokens inside that window (every decode runs in
  every step, so these are the step times a decode sees while the prompt is prefilled): p50 and p99.

Rounds alternate between the budgets (``--reps`` rounds after a warm-up round), one engine per
budget kept warm, so every budget sees the same machine. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def one_round(llm, sp_decode, sp_long, decodes: int, length: int, rng: random.Random) -> dict:
    ids = [llm.add_request({"prompt_token_ids": [rng.randrange(3, 150000) for _ in range(32)]}, sp_decode)
           for _ in range(decodes)]
    counts = {i: 0 for i in ids}
    while min(counts.values()) < 4:
        for out in llm.step():
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
    last = {i: time.perf_counter() for i in ids}
    arrival = time.perf_counter()
    long_id = llm.add_request({"prompt_token_ids": [rng.randrange(3, 150000) for _ in range(length)]}, sp_long)
    gaps, ttft, steps = [], None, 0
    while ttft is None:
        outs = llm.step()
        now = time.perf_counter()
        steps += 1
        for out in outs:
            if out.request_id == long_id and out.outputs[0].token_ids:
                ttft = now - arrival
            elif out.request_id in last and len(out.outputs[0].token_ids) > counts[out.request_id]:
                counts[out.request_id] = len(out.outputs[0].token_ids)
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for i in ids:   # the decodes are done with: abort them (their blocks go back)
        llm.abort(i)
    while llm.has_unfinished_requests():
        llm.step()
    gaps.sort()
    return {"ttft": ttft, "steps": steps, "itl_p50": statistics.median(gaps) if gaps else None,
            "itl_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
            "itl_max": gaps[-1] if gaps else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    from bench_realsize import default_cache_dir, make_checkpoint
    from qwen_ops import LLM, SamplingParams

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = make_checkpoint(default_cache_dir())
    llms = {b: LLM(str(path), dtype=args.dtype, max_num_seqs=args.decodes + 1, max_model_len=args.length + 64,
                   kv_cache_bytes=4 << 30, max_num_batched_tokens=b) for b in args.budgets}
    sp_decode = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    sp_long = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    rows = {b: [] for b in args.budgets}
    for rnd in range(args.reps + 1):
        for b in args.budgets:
            r = one_round(llms[b], sp_decode, sp_long, args.decodes, args.length, rng)
            print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''}, budget {b}: TTFT {r['ttft']:.3f} s, "
                  f"{r['steps']} steps, decode ITL p50 {r['itl_p50']:.3f} s, p99 {r['itl_p99']:.3f} s", flush=True)
            if rnd:
                rows[b].append(r)
    print(f"\n{args.dtype}, one {args.length}-token prompt arriving while {args.decodes} requests decode; medians of "
          f"{args.reps} rounds\n")
    print("| max_num_batched_tokens | TTFT (s) | steps | decode ITL p50 (s) | decode ITL p99 (s) |")
    print("|---|---|---|---|---|")
    summary = {}
    for b in args.budgets:
        med = {k: statistics.median(r[k] for r in rows[b]) for k in ("ttft", "steps", "itl_p50", "itl_p99")}
        summary[b] = med
        print(f"| {b} | {med['ttft']:.3f} | {med['steps']:.0f} | {med['itl_p50']:.3f} | {med['itl_p99']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "length": args.length, "rounds": rows,
                                         "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
