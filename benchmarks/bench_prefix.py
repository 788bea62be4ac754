"""Prefix caching on and off, in one run, on the embedded model (or --model).

Workloads (greedy, ignore_eos):
  shared      64 requests sharing a 1,024-token system prompt, each with 32 unique tokens, 32 new
  multiturn   16 chats of 4 turns: each turn resends the conversation so far plus 16 new tokens,
              16 new tokens per answer; the 16 chats of a turn run together
  unrelated   64 random prompts of 64-256 tokens, 32 new (nothing to share: the cost of caching)

For each: end-to-end throughput (generated tokens / s), p50 and p99 time to first token, the
cache hit rate in prompt tokens, and the ratios on / off. Both engines are built first and the
workload alternates between them (on, off, on, off ...) so that machine drift hits both alike;
medians over ``--repeats``.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from qwen_ops import LLM, SamplingParams


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def shared_prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    system = [rng.randrange(3, vocab) for _ in range(1024)]
    return [system + [rng.randrange(3, vocab) for _ in range(32)] for _ in range(64)]


def unrelated_prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 256))] for _ in range(64)]


def run_batch(llm: LLM, prompts, new_tokens: int) -> tuple[float, list[float], list[list[int]], int]:
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttfts = [o.metrics.time_to_first_token for o in outs]
    return dt, ttfts, [o.outputs[0].token_ids for o in outs], sum(len(o.outputs[0].token_ids) for o in outs)


def run_multiturn(llm: LLM, rng: random.Random, vocab: int) -> tuple[float, list[float], list[list[int]], int]:
    chats = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(16)]
    total_t, ttfts, answers, generated = 0.0, [], [], 0
    for _turn in range(4):
        dt, tt, outs, n = run_batch(llm, chats, 16)
        total_t += dt
        ttfts += tt
        generated += n
        answers += outs
        chats = [c + a + [rng.randrange(3, vocab) for _ in range(16)] for c, a in zip(chats, outs)]
    return total_t, ttfts, answers, generated


def measure(model, repeats: int) -> dict:
    kw = dict(max_num_seqs=64, max_model_len=2048)
    llms = {"on": LLM(model, enable_prefix_caching=True, **kw), "off": LLM(model, enable_prefix_caching=False, **kw)}
    vocab = llms["on"].engine.vocab_size
    results = {}
    for name in ("shared", "multiturn", "unrelated"):
        rows = {k: {"tok_s": [], "ttft_p50": [], "ttft_p99": [], "hit_rate": []} for k in llms}
        tokens = {}
        for rep in range(repeats + 1):                     # the first round warms up
            for k, llm in llms.items():
                rng = random.Random(1000 * rep + 7)       # a fresh workload each round, the same for on and off
                before = llm.stats()
                if name == "multiturn":
                    dt, ttfts, toks, n = run_multiturn(llm, rng, vocab)
                else:
                    prompts = shared_prompts(rng, vocab) if name == "shared" else unrelated_prompts(rng, vocab)
                    dt, ttfts, toks, n = run_batch(llm, prompts, 32)
                after = llm.stats()
                tokens[k] = toks
                if rep == 0:
                    continue
                q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
                h = after["prefix_cache_hits"] - before["prefix_cache_hits"]
                rows[k]["tok_s"].append(n / dt)
                rows[k]["ttft_p50"].append(_percentile(ttfts, 0.5))
                rows[k]["ttft_p99"].append(_percentile(ttfts, 0.99))
                rows[k]["hit_rate"].append(h / q if q else 0.0)
            if tokens["on"] != tokens["off"]:
                raise AssertionError(f"{name}: greedy tokens differ with prefix caching on and off")
        med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rows.items()}
        med["throughput_ratio"] = med["on"]["tok_s"] / med["off"]["tok_s"]
        med["ttft_p50_ratio"] = med["off"]["ttft_p50"] / med["on"]["ttft_p50"]
        results[name] = med
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    res = measure(args.model, args.repeats)
    print(f"{'workload':<10} {'cache':<5} {'tok/s':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'hit rate':>9}")
    for name, r in res.items():
        for k in ("on", "off"):
            m = r[k]
            print(f"{name:<10} {k:<5} {m['tok_s']:>9.1f} {1e3 * m['ttft_p50']:>12.1f} {1e3 * m['ttft_p99']:>12.1f} "
                  f"{m['hit_rate']:>9.2%}")
        print(f"{name:<10} on/off throughput {r['throughput_ratio']:.2f}x, TTFT p50 {r['ttft_p50_ratio']:.2f}x lower")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
