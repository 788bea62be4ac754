"""Time ``sampling.sample`` (the one sampler: min-p / top-k floors, then the C pass of temperature,
softmax, top-p and the pick) per filter, at Qwen's vocabulary and the embedded model's, 1 and 8 rows,
fp32, one thread: medians of ``--repeats`` calls after two warm-ups (benchmarks/README.md, "One
sampler"). Each row is seeded, so the picks repeat run to run.

    OMP_NUM_THREADS=1 python benchmarks/bench_sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwen_ops.engine.sampling import SamplingParams, sample

KINDS = {"temperature 0.8": dict(temperature=0.8), "top-p 0.9": dict(temperature=0.8, top_p=0.9),
         "top-k 50": dict(temperature=0.8, top_k=50), "min-p 0.05": dict(temperature=0.8, min_p=0.05),
         "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9)}


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("| vocab | rows | " + " | ".join(KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for vocab in (151_936, 8_192):
        for rows in (1, 8):
            x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
            cells = []
            for kw in KINDS.values():
                params = [SamplingParams(seed=i, **kw) for i in range(rows)]
                noises = [p.make_generator() for p in params]
                cells.append(f"{median_ms(lambda: sample(x, params, noises, [3] * rows), args.repeats):.3f}")
            print(f"| {vocab:,} | {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
