"""pytest-benchmark suite of torch.ops.qwen.kv_write and torch.ops.qwen.slot_attention.

Each op on each available backend (benchmarks/conftest.py) with a decode and a prefill shape, plus
the reference decode against torch SDPA on KV already gathered into contiguous tensors (the
issue's target: within 1.5x). Shapes: CPU fp32 as in the issue; on a GPU bf16 and larger.

    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_ops.py --benchmark-enable
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import qwen_ops


@dataclass(frozen=True)
class Shape:
    num_seqs: int
    q_len: int          # query tokens per sequence (1 = decode)
    context: int        # tokens per sequence after this step's write
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16


ON_GPU = torch.cuda.is_available()
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
SHAPES = {
    "decode": Shape(64, 1, 4096) if ON_GPU else Shape(8, 1, 1024),
    "prefill": Shape(4, 1024, 1024) if ON_GPU else Shape(1, 256, 256),
}
# The target for reference decode vs SDPA on pre-gathered KV, and a regression limit the
# benchmark enforces (the plain-torch gather alone costs ~0.8x of the SDPA call on the CPU).
DECODE_VS_SDPA_TARGET = 1.5
DECODE_VS_SDPA_LIMIT = 3.0
RATIO_ROUNDS = 30


def make_inputs(shape: Shape, device, dtype=DTYPE, seed: int = 0):
    """Random paged caches with a random block permutation; one slot per sequence."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.num_seqs * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    table = torch.randperm(num_blocks, generator=gen).view(shape.num_seqs, blocks_per_seq)
    i32 = dict(dtype=torch.int32, device=device)
    num_tokens = shape.num_seqs * shape.q_len
    query = torch.randn(num_tokens, shape.num_heads, shape.head_dim, generator=gen).to(device, dtype)
    attention_args = (query, key_cache, value_cache, table.to(**i32), torch.arange(shape.num_seqs, **i32),
                      torch.arange(0, num_tokens + 1, shape.q_len, **i32),
                      torch.full((shape.num_seqs,), shape.context, **i32), shape.head_dim ** -0.5, shape.q_len, None)
    kv = torch.randn(2, num_tokens, shape.num_kv_heads, shape.head_dim, generator=gen).to(device, dtype)
    positions = (torch.arange(shape.q_len) + shape.context - shape.q_len).repeat(shape.num_seqs)
    slots = torch.arange(shape.num_seqs).repeat_interleave(shape.q_len)
    write_args = (kv[0], kv[1], key_cache, value_cache, slots.to(**i32), positions.to(**i32), table.to(**i32))
    return attention_args, write_args


@pytest.mark.parametrize("kind", list(SHAPES))
def test_slot_attention(benchmark, backend, kind, device, synchronized):
    attention_args, _ = make_inputs(SHAPES[kind], device)
    benchmark.group = f"slot_attention-{kind}"
    with qwen_ops.use_backend(backend):
        benchmark(synchronized(lambda: torch.ops.qwen.slot_attention(*attention_args)))


@pytest.mark.parametrize("kind", list(SHAPES))
def test_kv_write(benchmark, backend, kind, device, synchronized):
    _, write_args = make_inputs(SHAPES[kind], device)
    benchmark.group = f"kv_write-{kind}"
    with qwen_ops.use_backend(backend):
        benchmark(synchronized(lambda: torch.ops.qwen.kv_write(*write_args)))


def test_reference_decode_vs_sdpa(benchmark):
    """Reference decode (through the op) vs SDPA on the same KV pre-gathered contiguously, CPU fp32.

    Both are timed in alternating rounds (the same machine noise for both); the median ratio goes
    to extra_info, with whether it meets the issue's 1.5x target. Fails above DECODE_VS_SDPA_LIMIT.
    """
    shape = Shape(8, 1, 1024)
    args, _ = make_inputs(shape, "cpu", torch.float32)
    query, key_cache, value_cache, table = args[:4]
    gathered = [c[table.long()].reshape(shape.num_seqs, shape.context, shape.num_kv_heads, shape.head_dim)
                .transpose(1, 2).contiguous() for c in (key_cache, value_cache)]     # [S, KVH, L, D]

    def sdpa():
        return F.scaled_dot_product_attention(query[:, :, None], *gathered, scale=args[7], enable_gqa=True)[:, :, 0]

    def reference():
        with qwen_ops.use_backend("reference"):
            return torch.ops.qwen.slot_attention(*args)

    torch.testing.assert_close(reference(), sdpa(), atol=1e-5, rtol=1e-5)
    benchmark.group = "decode-vs-sdpa"
    benchmark(reference)
    if benchmark.disabled:
        return
    times = {"reference": [], "sdpa": []}
    for _ in range(RATIO_ROUNDS):
        for name, fn in (("reference", reference), ("sdpa", sdpa)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["reference"] / medians["sdpa"]
    benchmark.extra_info.update(sdpa_median_s=medians["sdpa"], reference_median_s=medians["reference"],
                                ratio_median=ratio, meets_target=ratio <= DECODE_VS_SDPA_TARGET,
                                ratio_min=min(times["reference"]) / min(times["sdpa"]))
    print(f"\nreference decode / SDPA on pre-gathered KV: median {ratio:.2f}x "
          f"({medians['reference'] * 1e3:.2f} / {medians['sdpa'] * 1e3:.2f} ms), target {DECODE_VS_SDPA_TARGET}x")
    assert ratio <= DECODE_VS_SDPA_LIMIT, f"reference decode is {ratio:.2f}x SDPA (limit {DECODE_VS_SDPA_LIMIT}x)"
