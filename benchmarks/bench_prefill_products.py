"""Products at prefill sizes (issue 42 item 2): ``torch.ops.qwen.linear_packed`` on bf16 rows against
oneDNN's prepacked GEMM (``F.linear`` on bf16), Qwen3-0.6B's four products (q|k|v, o, gate|up, down),
one thread, the two alternating, medians of 6 timed runs after one.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_products.py [ROWS ...]   # default: 512 2000

Prints GFLOP/s of each and the ratio of times (ours / oneDNN: below 1, ours faster), and the largest
difference of the two results (both accumulate in fp32 and round once to bf16; they differ where the
summation orders round apart). Nothing here is a gate; figures go to benchmarks/README.md by hand.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import qwen_ops
from qwen_ops.ops.kernels.cpu import pack_panels

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}   # (N, K)


def run(rows: int, reps: int = 7) -> None:
    gen = torch.Generator().manual_seed(0)
    total = {"ours": 0.0, "onednn": 0.0}
    flops = 0
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        x = torch.randn(rows, k, generator=gen).bfloat16()
        packed = pack_panels(w)
        with qwen_ops.use_backend("cpu"):
            diff = (torch.ops.qwen.linear_packed(x, packed, None, n).float() - F.linear(x, w).float()).abs().max()
        times = {"ours": [], "onednn": []}
        for _ in range(reps):
            for which in times:
                t = time.perf_counter()
                if which == "ours":
                    with qwen_ops.use_backend("cpu"):
                        torch.ops.qwen.linear_packed(x, packed, None, n)
                else:
                    F.linear(x, w)
                times[which].append(time.perf_counter() - t)
        f = 2 * rows * n * k
        flops += f
        med = {which: statistics.median(ts[1:]) for which, ts in times.items()}
        for which in med:
            total[which] += med[which]
        print(f"{name:8s} rows={rows}  ours {med['ours'] * 1e3:6.2f} ms {f / med['ours'] / 1e9:6.0f} GFLOP/s  "
              f"oneDNN {med['onednn'] * 1e3:6.2f} ms {f / med['onednn'] / 1e9:6.0f} GFLOP/s  "
              f"ours/oneDNN {med['ours'] / med['onednn']:.2f}  max diff {diff.item():.3g}")
    print(f"all four, rows={rows}: ours {total['ours'] * 1e3:.2f} ms ({flops / total['ours'] / 1e9:.0f} GFLOP/s), "
          f"oneDNN {total['onednn'] * 1e3:.2f} ms, ours/oneDNN {total['ours'] / total['onednn']:.2f}")


def main() -> None:
    torch.set_num_threads(1)
    for rows in [int(a) for a in sys.argv[1:]] or [512, 2000]:
        run(rows)


if __name__ == "__main__":
    main()
