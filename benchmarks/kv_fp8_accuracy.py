"""Accuracy of the fp8 KV cache against the model-dtype cache (issue 42 item 4).

For each of N prompts of L random token ids (seeded; the same for every cache), one engine per
``kv_cache_dtype`` runs the slot API (``QwenEngine.prefill`` / ``decode_step``):

* logit error of the prompt's last position (the first token's logits, which read all L keys of
  every layer): max |fp8 - auto| and its ratio to the logits' standard deviation;
* teacher-forced agreement: the fp8 engine is fed the auto engine's greedy tokens and its own
  argmax compared with the auto engine's at each of the next T steps (no drift after a first
  difference);
* free-running greedy agreement: the share of prompts whose T greedy tokens equal the auto
  engine's, and the mean length of the common prefix.

Usage (one thread, as the other benchmarks):
    OMP_NUM_THREADS=1 python benchmarks/kv_fp8_accuracy.py [--model DIR] [--dtype bfloat16]
        [--prompts 32] [--prompt-len 1000] [--new-tokens 32] [--caches fp8 fp8_e5m2 fp8:calc] [--out F.json]
``--model`` defaults to the embedded model; ``fp8:calc`` is fp8 with ``calculate_kv_scales``;
``dtype:float32`` (a yardstick) is the whole model in fp32 against the same bf16 reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_engine(path, dtype: str, cache: str, prompts, new_tokens: int, forced=None):
    """(first logits per prompt, greedy tokens per prompt, teacher-forced argmaxes per prompt)."""
    from qwen_ops.engine.engine import QwenEngine

    kv, opt = (cache.split(":") + [""])[:2]
    if kv == "dtype":               # the yardstick: the model in another dtype, its cache in that dtype
        dtype, kv, opt = opt, "auto", ""
    engine = QwenEngine.from_pretrained(path, dtype=dtype, max_slots=1, max_seq_len=len(prompts[0]) + new_tokens + 1,
                                        kv_cache_dtype=kv, calculate_kv_scales=opt == "calc")
    logits, greedy, teacher = [], [], []
    for i, prompt in enumerate(prompts):
        first = engine.prefill(prompt)
        logits.append(first.logits.float().clone())
        toks = [first.next_token]
        for _ in range(new_tokens - 1):
            toks.append(engine.decode_step(toks[-1]).next_token)
        greedy.append(toks)
        if forced is not None:      # the reference's tokens fed back: this engine's argmax at each step
            r = engine.prefill(prompt)
            argmaxes = [r.next_token]
            for tok in forced[i][:-1]:
                argmaxes.append(engine.decode_step(tok).next_token)
            teacher.append(argmaxes)
    return logits, greedy, teacher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--caches", nargs="+", default=["fp8", "fp8_e5m2", "fp8:calc", "dtype:float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.defaults import default_model_path

    path = args.model or default_model_path()
    vocab = QwenConfig.from_pretrained(path).vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    t0 = time.perf_counter()
    ref_logits, ref_greedy, _ = run_engine(path, args.dtype, "auto", prompts, args.new_tokens)
    print(f"auto cache: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for cache in args.caches:
        t0 = time.perf_counter()
        logits, greedy, teacher = run_engine(path, args.dtype, cache, prompts, args.new_tokens, forced=ref_greedy)
        errs = [float((a - b).abs().max()) for a, b in zip(logits, ref_logits)]
        rel = [e / float(b.std()) for e, b in zip(errs, ref_logits)]
        steps = [sum(x == y for x, y in zip(t, g)) for t, g in zip(teacher, ref_greedy)]
        prefix = []
        for g, r in zip(greedy, ref_greedy):
            n = 0
            while n < len(r) and g[n] == r[n]:
                n += 1
            prefix.append(n)
        row = {"cache": cache, "max_logit_error_median": statistics.median(errs), "max_logit_error_max": max(errs),
               "error_over_logit_std_median": statistics.median(rel), "error_over_logit_std_max": max(rel),
               "teacher_forced_top1_agreement": sum(steps) / (len(steps) * args.new_tokens),
               "greedy_identical_prompts": sum(p == args.new_tokens for p in prefix) / len(prefix),
               "greedy_common_prefix_mean": statistics.mean(prefix), "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": str(path), "dtype": args.dtype, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rows": rows}
    print("\n| cache | max logit error (median / max) | / logit std (median / max) | teacher-forced top-1 "
          "agreement | prompts with identical greedy tokens | mean common prefix |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['max_logit_error_median']:.3f} / {r['max_logit_error_max']:.3f} | "
              f"{r['error_over_logit_std_median']:.3f} / {r['error_over_logit_std_max']:.3f} | "
              f"{100 * r['teacher_forced_top1_agreement']:.1f}% | {100 * r['greedy_identical_prompts']:.0f}% | "
              f"{r['greedy_common_prefix_mean']:.1f} of {args.new_tokens} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
