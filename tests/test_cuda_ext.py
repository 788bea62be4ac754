"""Tests of the CUDA C++ backend: csrc/ built as ``qwen_ops._qwen_C`` (torch.ops._qwen_C.*).

Four layers, each skipping with its reason where it cannot run:

* everywhere with g++: csrc/qwen_index.h (the kernels' index arithmetic) compiled on the host and
  compared with the reference arithmetic;
* everywhere with g++: the kernels themselves (csrc/qwen_kernels.cuh, with their dispatch and
  launch plan) compiled over a SIMT shim (tests/emulation/: a std::thread per CUDA thread,
  barriers for __syncthreads and shuffles) and run on CPU tensors against the reference, so the
  kernel logic is exercised on machines without a GPU (not the CUDA compiler or the hardware);
* with the extension built (a CUDA build of torch; no GPU needed): the private schemas equal
  torch_library/qwen.schema, the kernels are registered for CUDA only, the extension's host-side
  hooks (the same helpers and launch plans the kernels use) agree with Python, and
  ``torch.library.opcheck`` still passes for torch.ops.qwen.* on CPU tensors;
* with a GPU: the ``cuda`` backend against the reference kernel on fresh random inputs, caches
  poisoned with NaN outside the rows a sequence owns and outputs poisoned before each run.

``QWEN_OPS_REQUIRE_CUDA_EXT=1`` (set by .ci/build_cuda_ext.sh) turns a missing extension into a
failure, and ``QWEN_OPS_REQUIRE_GPU=1`` (for the device check) a missing GPU, so those runs
cannot pass by skipping.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import random
import shutil
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import qwen_ops
from qwen_ops.ops.kernels import cuda as cuda_kernels
from qwen_ops.ops.kernels.reference import kv_write_reference, slot_attention_reference
from qwen_ops.torch_library import SCHEMAS

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"
INDEX_HEADER = CSRC / "qwen_index.h"
EMULATOR_SOURCE = REPO / "tests" / "emulation" / "simt_emulator.cpp"


def _extension_reason() -> str | None:
    try:
        import qwen_ops._qwen_C  # noqa: F401
    except ImportError as exc:
        return f"qwen_ops._qwen_C is not built here ({exc}); build it with QWEN_OPS_BUILD_CUDA=1 (.ci/build_cuda_ext.sh)"
    return None


EXT_REASON = _extension_reason()
GPU_REASON = EXT_REASON or (None if torch.cuda.is_available() else "no CUDA device on this machine")
needs_ext = pytest.mark.skipif(EXT_REASON is not None, reason=str(EXT_REASON))
# GPU work: deselected without a CUDA GPU (conftest.py); skipped when the extension is not built.
def needs_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))(test))

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)   # the kernel templates
PADDED_HEAD_DIMS = (24, 48, 80)      # other head dims, run in the next template with zero padding
GQA_GROUPS = (1, 2, 3, 4, 7, 16)
BLOCK_SIZES = (1, 16, "max")  # "max": one block per slot (the seed's contiguous layout)
SCENARIOS = ("decode", "prefill", "chunk", "mixed", "padding")
KV_WRITE_LAYOUTS = ("contiguous", "fused_qkv_view", "unaligned")
CUDA_OPS = ("kv_write", "slot_attention", "causal_conv1d", "gated_delta_rule")  # the qwen ops csrc/ implements

# Output vs the reference; both round an fp32 result to the dtype (|out| < ~4 for randn values).
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}


# ---- requirements of CI and of the device check --------------------------------------------------

def test_extension_present_when_required():
    if os.environ.get("QWEN_OPS_REQUIRE_CUDA_EXT", "0") in ("", "0"):
        pytest.skip("QWEN_OPS_REQUIRE_CUDA_EXT is not set (only the CUDA build step requires the extension)")
    assert EXT_REASON is None, EXT_REASON


def test_gpu_present_when_required():
    if os.environ.get("QWEN_OPS_REQUIRE_GPU", "0") in ("", "0"):
        pytest.skip("QWEN_OPS_REQUIRE_GPU is not set (only the device check requires a GPU)")
    assert GPU_REASON is None, GPU_REASON


def test_why_unavailable_never_raises():
    reason = cuda_kernels.why_unavailable()
    if EXT_REASON is not None:
        assert isinstance(reason, str) and "_qwen_C" in reason
    elif not torch.cuda.is_available():
        assert isinstance(reason, str) and "no CUDA device" in reason
    else:
        assert reason is None


# ---- the index header, compiled with g++ ----------------------------------------------------------

_HEADER_DRIVER = r"""
#include <cstdio>
#include "qwen_index.h"
using namespace qwen_index;
int main() {
  char op[16];
  long long a, b, c, d, e;
  while (std::scanf("%15s", op) == 1) {
    if (op[0] == 'L') {  // L pos block_size
      std::scanf("%lld %lld", &a, &b);
      std::printf("%lld %lld %lld\n", (long long)block_column(a, b), (long long)block_row(a, b),
                  (long long)block_column_u32((unsigned)a, (unsigned)b));
    } else if (op[0] == 'S') {  // S seq_len num_splits align
      std::scanf("%lld %lld %lld", &a, &b, &c);
      for (long long s = 0; s < b; ++s)
        std::printf("%lld %lld ", (long long)split_begin(a, b, c, s), (long long)split_end(a, b, c, s));
      std::printf("\n");
    } else if (op[0] == 'T') {  // T seq_len q_len row_begin row_end
      std::scanf("%lld %lld %lld %lld", &a, &b, &c, &d);
      std::printf("%lld\n", (long long)tile_key_end(a, b, c, d));
    } else if (op[0] == 'P') {  // P base_blocks capacity num_sms min_split max_splits
      std::scanf("%lld %lld %lld %lld %lld", &a, &b, &c, &d, &e);
      std::printf("%lld\n", (long long)num_decode_splits(a, b, c, d, e));
    }
  }
  return 0;
}
"""


def _visible_key_end(seq_len: int, q_len: int, row_begin: int, row_end: int) -> int:
    """One past the last key any real row of the tile sees, from the reference's causal mask."""
    visible = [k for j in range(row_begin, min(row_end, q_len)) for k in range(seq_len) if k <= seq_len - q_len + j]
    return max(visible) + 1 if visible else 0


def _split_ranges_reference(seq_len: int, num_splits: int, align: int) -> list[tuple[int, int]]:
    length = max(align, -(-max(-(-max(seq_len, 1) // num_splits), 1) // align) * align)
    return [(min(s * length, seq_len), min((s + 1) * length, seq_len)) for s in range(num_splits)]


def _num_splits_reference(base_blocks: int, capacity: int, num_sms: int, min_split: int, max_splits: int) -> int:
    if base_blocks <= 0:
        return 1
    wanted = -(-4 * max(num_sms, 1) // base_blocks)
    by_length = max(1, -(-capacity // max(min_split, 1)))
    return max(1, min(wanted, by_length, max_splits))


def _check_partition(ranges: list[tuple[int, int]], seq_len: int, align: int) -> None:
    """Split ranges cover [0, seq_len) in order, without overlap, starting on tile boundaries."""
    expect_begin = 0
    for begin, end in ranges:
        assert begin <= end, ranges
        if begin < end:
            assert begin == expect_begin and begin % align == 0, ranges
            expect_begin = end
    assert expect_begin == seq_len, (ranges, seq_len)


def _header_cases(rng: random.Random):
    loc = [(rng.randrange(0, 5000), rng.choice([1, 2, 3, 16, 17, 256, 4096])) for _ in range(200)]
    loc += [((1 << 31) - 1, 1), ((1 << 31) - 1, 7), ((1 << 31) - 5, 4096)]
    split = [(rng.choice([0, 1, 2, 31, 32, 33, 1000, 4096, 100_000]), rng.choice([1, 2, 3, 7, 64]),
              rng.choice([8, 16, 32, 64, 128])) for _ in range(120)]
    tile = [(s, q, rb, rb + rows) for s, q, rb, rows in
            ((rng.randrange(0, 90), rng.randrange(0, 40), rng.randrange(0, 48), rng.choice([16, 32]))
             for _ in range(200)) if q <= s or rng.random() < 0.2]
    plan = [(rng.choice([0, 1, 6, 64, 512, 5000]), rng.choice([1, 100, 4096, 131072]), rng.choice([1, 108, 132]),
             256, 64) for _ in range(60)]
    return loc, split, tile, plan


def test_index_header_with_gxx(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    (tmp_path / "driver.cpp").write_text(_HEADER_DRIVER)
    exe = tmp_path / "driver"
    subprocess.run([gxx, "-std=c++17", "-O1", "-I", str(INDEX_HEADER.parent), str(tmp_path / "driver.cpp"),
                    "-o", str(exe)], check=True, capture_output=True, timeout=120)
    loc, split, tile, plan = _header_cases(random.Random(0))
    commands = ([f"L {p} {b}" for p, b in loc] + [f"S {s} {n} {a}" for s, n, a in split] +
                [f"T {s} {q} {rb} {re}" for s, q, rb, re in tile] + [f"P {' '.join(map(str, c))}" for c in plan])
    lines = subprocess.run([str(exe)], input="\n".join(commands) + "\n", capture_output=True, text=True,
                           check=True, timeout=60).stdout.splitlines()
    assert len(lines) == len(commands)
    it = iter(lines)
    for p, b in loc:
        assert tuple(map(int, next(it).split())) == (p // b, p % b, p // b), (p, b)
    for s, n, a in split:
        got = list(map(int, next(it).split()))
        ranges = list(zip(got[::2], got[1::2]))
        assert ranges == _split_ranges_reference(s, n, a), (s, n, a)
        _check_partition(ranges, s, a)
    for s, q, rb, re in tile:
        assert int(next(it)) == _visible_key_end(s, q, rb, re), (s, q, rb, re)
    for c in plan:
        assert int(next(it)) == _num_splits_reference(*c), c


# ---- the built extension, no GPU needed ------------------------------------------------------------

def _argument_signature(schema) -> list[tuple]:
    """What must agree between two schemas: per argument name, type, alias/mutation, default."""
    def alias(a):
        info = a.alias_info
        return None if info is None else (info.is_write, tuple(sorted(str(s) for s in info.before_set)))
    args = [(a.name, str(a.type), alias(a), repr(a.default_value), a.kwarg_only) for a in schema.arguments]
    rets = [(str(r.type), alias(r)) for r in schema.returns]
    return args + [("->",)] + rets


@needs_ext
@pytest.mark.parametrize("name", CUDA_OPS)
def test_private_schema_matches_schema_file(name):
    from_file = torch._C.parse_schema(f"qwen::{name}{SCHEMAS[name]}")
    private = getattr(torch.ops._qwen_C, name).default._schema
    public = getattr(torch.ops.qwen, name).default._schema
    assert _argument_signature(private) == _argument_signature(from_file)
    assert _argument_signature(public) == _argument_signature(from_file)
    # The comparison itself must notice a drift: rename one argument, drop a mutation mark.
    drifted = SCHEMAS[name].replace("Tensor(a!) ", "Tensor ").replace("(Tensor ", "(Tensor renamed_", 1)
    assert _argument_signature(private) != _argument_signature(torch._C.parse_schema(f"qwen::{name}{drifted}"))


@needs_ext
@pytest.mark.parametrize("name", CUDA_OPS)
def test_private_kernels_registered_for_cuda_only(name):
    qualified = f"_qwen_C::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")


@needs_ext
def test_kv_location_hook_matches_reference():
    rng = random.Random(1)
    for block_size, slots, cols in ((1, 3, 9), (16, 5, 4), (7, 2, 3), (64, 4, 1)):
        table = [rng.randrange(0, 1000) for _ in range(slots * cols)]
        slot_ids = [rng.choice([-1] + list(range(slots))) for _ in range(50)]
        positions = [rng.randrange(0, cols * block_size) for _ in slot_ids]
        got = torch.ops._qwen_C._kv_location(slot_ids, positions, table, cols, block_size)
        expected = []
        for s, p in zip(slot_ids, positions):
            expected += [-1, -1] if s < 0 else [table[s * cols + p // block_size], p % block_size]
        assert got == expected


@needs_ext
def test_split_ranges_hook_partition():
    for seq_len, num_splits, align in itertools.product((0, 1, 15, 16, 17, 255, 4096, 70_001), (1, 2, 5, 64),
                                                         (8, 16, 32, 128)):
        got = torch.ops._qwen_C._split_ranges(seq_len, num_splits, align)
        ranges = list(zip(got[::2], got[1::2]))
        assert ranges == _split_ranges_reference(seq_len, num_splits, align)
        _check_partition(ranges, seq_len, align)


@needs_ext
def test_tile_key_end_hook_matches_causal_mask():
    for seq_len, q_len, row_begin in itertools.product((0, 1, 5, 33, 64), (0, 1, 4, 33, 64), (0, 16, 32)):
        if q_len > seq_len:
            continue
        for rows in (16, 32):
            got = torch.ops._qwen_C._tile_key_end(seq_len, q_len, row_begin, row_begin + rows)
            assert got == _visible_key_end(seq_len, q_len, row_begin, row_begin + rows)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_launch_plans(dtype, head_dim):
    elem = torch.empty((), dtype=dtype).element_size()
    for group in GQA_GROUPS:
        hpb, chunks, tile, splits = torch.ops._qwen_C._decode_plan(3, 2 * group, 2, head_dim, elem, 4096, 132)
        assert hpb in (1, 4, 8) and (chunks - 1) * hpb < group <= chunks * hpb
        assert tile > 0 and 1 <= splits <= 64 and splits <= -(-4096 // max(256, tile))
        assert splits == _num_splits_reference(3 * 2 * chunks, 4096, 132, max(256, tile), 64)
    # The decode benchmark shape (batch 64, 32/8 heads, 4096 context) on 132 SMs.
    assert torch.ops._qwen_C._decode_plan(64, 32, 8, head_dim, elem, 4096, 132)[3] == 2
    # A single short slot never gets more splits than its capacity can use.
    assert torch.ops._qwen_C._decode_plan(1, 8, 8, head_dim, elem, 100, 132)[3] == 1
    for max_query_len in (2, 31, 32, 33, 1000):
        rows, keys, q_tiles = torch.ops._qwen_C._prefill_plan(elem, head_dim, max_query_len)
        assert rows in (16, 32) and keys in (8, 16, 32)
        assert (q_tiles - 1) * rows < max_query_len <= q_tiles * rows


@needs_ext
def test_cuda_kernels_reject_cpu_tensors():
    case = make_case(torch.device("cpu"), torch.float32, 32, group=2, block_size=4, q_lens=[1, 1], seq_lens=[3, 5])
    with pytest.raises(NotImplementedError, match="_qwen_C::slot_attention"):
        torch.ops._qwen_C.slot_attention(*case.attention_args(max_query_len=1))


def _opcheck_samples():
    dev = torch.device("cpu")
    decode = make_case(dev, torch.float32, 32, group=2, block_size=4, q_lens=[1, 1, 1], seq_lens=[3, 9, 1],
                       pad_seqs=(1,))
    mixed = make_case(dev, torch.bfloat16, 32, group=3, block_size=8, q_lens=[4, 1, 0, 6], seq_lens=[4, 11, 2, 9],
                      gate=True)
    return [("decode", decode, 1), ("mixed_gate", mixed, 6)]


@needs_ext
@pytest.mark.parametrize("sample", range(2))
def test_opcheck_qwen_ops_on_cpu_with_extension_loaded(sample):
    name, case, max_query_len = _opcheck_samples()[sample]
    test_utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.qwen.slot_attention.default, case.attention_args(max_query_len),
                          test_utils=test_utils)
    key, value, slot_ids, positions = case.write_inputs(num_tokens=5, seed=3)
    torch.library.opcheck(torch.ops.qwen.kv_write.default,
                          (key, value, case.key_cache.clone(), case.value_cache.clone(), slot_ids, positions,
                           case.block_table), test_utils=test_utils)


# ---- inputs ---------------------------------------------------------------------------------------

@dataclass
class Case:
    """One batch of slot_attention inputs; caches poisoned with NaN outside the live rows."""
    query: torch.Tensor            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_table: torch.Tensor      # int32 [num_slots, max_blocks_per_slot]
    seq_slots: torch.Tensor        # int32 [num_seqs], -1 = padding
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor         # int32 [num_seqs]
    gate: torch.Tensor | None
    scale: float

    def attention_args(self, max_query_len: int) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_slots,
                self.query_start_loc, self.seq_lens, self.scale, max_query_len, self.gate)

    def write_inputs(self, num_tokens: int, seed: int):
        """kv_write inputs that rewrite distinct rows live sequences own; a quarter are padding."""
        gen = torch.Generator().manual_seed(seed)
        owned = [(slot, pos) for slot, seq_len in zip(self.seq_slots.tolist(), self.seq_lens.tolist()) if slot >= 0
                 for pos in range(seq_len)]
        pick = torch.randperm(len(owned), generator=gen)[:num_tokens].tolist()
        slot_ids = torch.tensor([owned[i][0] for i in pick], dtype=torch.int32)
        positions = torch.tensor([owned[i][1] for i in pick], dtype=torch.int32)
        slot_ids[torch.rand(len(pick), generator=gen) < 0.25] = -1
        shape = (len(pick),) + tuple(self.key_cache.shape[2:])
        dev, dtype = self.key_cache.device, self.key_cache.dtype
        key = torch.randn(shape, generator=gen).to(dev, dtype)
        value = torch.randn(shape, generator=gen).to(dev, dtype)
        return key, value, slot_ids.to(dev), positions.to(dev)


def make_case(device, dtype, head_dim, *, group, block_size, q_lens, seq_lens, num_kv_heads=2, pad_seqs=(),
              gate=False, seed=0) -> Case:
    """Random paged caches; every block is owned by one slot, in shuffled physical order.

    Cache rows a sequence owns (< its seq_len) hold randn values; every other row, and every
    block no sequence uses, holds NaN, so a kernel that reads a row it must not read fails.
    Block-table columns past a slot's used blocks hold junk (valid ids of poisoned blocks, or
    out-of-range ids), which a kernel must never follow.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    longest = max([1] + list(seq_lens))
    if block_size == "max":
        block_size, cols = longest, 1
    else:
        cols = -(-longest // block_size) + 1
    num_slots = num_seqs + 2
    used = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(used) + 3 + 2 * cols  # spare poisoned blocks for junk entries and kv_write
    order = torch.randperm(num_blocks, generator=gen).tolist()
    slot_of_seq = torch.randperm(num_slots, generator=gen)[:num_seqs].tolist()
    table = torch.full((num_slots, cols), -1, dtype=torch.int32)
    spare = order[sum(used):]
    for s in range(num_slots):  # junk in every column first: poisoned ids or out-of-range ids
        for c in range(cols):
            table[s, c] = spare[(s + c) % len(spare)] if (s + c) % 3 else num_blocks + 7 + c
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    nxt = 0
    for i, (slot, seq_len) in enumerate(zip(slot_of_seq, seq_lens)):
        if i in pad_seqs:
            continue
        for c in range(used[i]):
            block = order[nxt]
            nxt += 1
            table[slot, c] = block
            rows = min(block_size, seq_len - c * block_size)
            key_cache[block, :rows] = torch.randn((rows, num_kv_heads, head_dim), generator=gen)
            value_cache[block, :rows] = torch.randn((rows, num_kv_heads, head_dim), generator=gen)
    seq_slots = torch.tensor([-1 if i in pad_seqs else s for i, s in enumerate(slot_of_seq)], dtype=torch.int32)
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    num_tokens = int(qsl[-1])
    heads = num_kv_heads * group
    query = torch.randn((num_tokens, heads, head_dim), generator=gen)
    gate_t = torch.randn((num_tokens, heads, head_dim), generator=gen) if gate else None
    to = dict(device=device)
    return Case(query.to(dtype=dtype, **to), key_cache.to(dtype=dtype, **to), value_cache.to(dtype=dtype, **to),
                table.to(**to), seq_slots.to(**to), qsl.to(**to), torch.tensor(seq_lens, dtype=torch.int32).to(**to),
                None if gate_t is None else gate_t.to(dtype=dtype, **to), 1.0 / math.sqrt(head_dim))


def scenario_lengths(scenario: str, rng: random.Random) -> tuple[list[int], list[int], tuple[int, ...]]:
    """(q_lens, seq_lens, padding sequence indices) of one batch."""
    if scenario == "decode":
        seq_lens = [1, rng.randrange(2, 40), 16, 17, rng.randrange(40, 300)]
        return [1] * len(seq_lens), seq_lens, ()
    if scenario == "prefill":
        q_lens = [rng.randrange(2, 40), 1, 33, rng.randrange(40, 90)]
        return q_lens, list(q_lens), ()
    if scenario == "chunk":  # chunked prefill continuing a slot that already holds keys
        q_lens = [rng.randrange(2, 20), 31, rng.randrange(20, 70)]
        return q_lens, [q + rng.randrange(1, 120) for q in q_lens], ()
    if scenario == "mixed":
        q_lens = [1, rng.randrange(2, 30), 1, rng.randrange(30, 70), 1]
        return q_lens, [rng.randrange(1, 200), q_lens[1], rng.randrange(50, 260), q_lens[3] + 45, 9], ()
    if scenario == "padding":  # padding sequences with and without query rows, and an empty query
        q_lens = [3, 2, 1, 0, 5, 1]
        return q_lens, [40, 2, 17, 6, 5, 1], (1, 2)
    raise ValueError(f"scenario = {scenario!r}")


# ---- the kernels on the CPU, through the SIMT emulator ----------------------------------------------

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # qwen_cuda::DType


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """tests/emulation/simt_emulator.cpp built with g++ and loaded with ctypes."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    folder = tmp_path_factory.mktemp("simt")
    # The shim needs C++20 <barrier> and _Float16 (g++ 12 or newer); an older compiler is a skip,
    # an error in the kernels a failure.
    (folder / "probe.cpp").write_text("#include <barrier>\n_Float16 h = 1.0f;\nstd::barrier<> b(1);\nint main() {}\n")
    probe = subprocess.run([gxx, "-std=c++20", "-pthread", str(folder / "probe.cpp"), "-o", str(folder / "probe")],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{gxx} lacks C++20 <barrier> or _Float16 (g++ >= 12 needed): {probe.stderr.strip()[:200]}")
    lib_path = folder / "libqwen_simt.so"
    build = subprocess.run([gxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-I", str(CSRC),
                            str(EMULATOR_SOURCE), "-o", str(lib_path)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    return ctypes.CDLL(str(lib_path))


def _i64s(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*[int(v) for v in values])


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def emulate_slot_attention(lib, case: Case, max_query_len: int, num_sms: int) -> tuple[torch.Tensor, list[int]]:
    """The CUDA kernels on CPU tensors; returns (output, decode plan [hpb, chunks, tile, splits])."""
    q, kc, vc, bt, g = case.query, case.key_cache, case.value_cache, case.block_table, case.gate
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # poisoned: every row must be written
    dims = [q.shape[0], q.shape[1], kc.shape[2], kc.shape[3], case.seq_slots.shape[0], bt.shape[0], bt.shape[1],
            kc.shape[1], kc.shape[0]]
    strides = [q.stride(0), q.stride(1), 0 if g is None else g.stride(0), 0 if g is None else g.stride(1),
               *kc.stride()[:3], *vc.stride()[:3], bt.stride(0), bt.stride(1), case.seq_slots.stride(0),
               case.query_start_loc.stride(0), case.seq_lens.stride(0)]
    plan = _i64s([0, 0, 0, 0])
    rc = lib.qwen_emu_slot_attention(
        ctypes.c_int(DTYPE_CODE[q.dtype]), _ptr(q), _ptr(kc), _ptr(vc), _ptr(g), _ptr(out), _ptr(bt),
        _ptr(case.seq_slots), _ptr(case.query_start_loc), _ptr(case.seq_lens), _i64s(dims), _i64s(strides),
        ctypes.c_double(case.scale), ctypes.c_int64(max_query_len), ctypes.c_int64(num_sms), plan)
    assert rc == 0, "no kernel for this dtype / head_dim"
    return out, list(plan)


def _check_emulated(lib, case: Case, max_query_len: int, num_sms: int, what: str) -> list[int]:
    expected = slot_attention_reference(*case.attention_args(max_query_len))
    out, plan = emulate_slot_attention(lib, case, max_query_len, num_sms)
    torch.testing.assert_close(out.float(), expected.float(), equal_nan=False, msg=lambda m: f"{what}\n{m}",
                               **TOLERANCE[case.query.dtype])
    return plan


def _emulated_cases():
    """dtype x head_dim x (decode | one of the prefill-kernel scenarios); group, gate, block size rotate."""
    cases = []
    others = ("prefill", "chunk", "mixed", "padding")
    for i, (dtype, head_dim, kind) in enumerate(itertools.product(DTYPES, HEAD_DIMS, ("decode", "prefill_kernel"))):
        scenario = "decode" if kind == "decode" else others[(i // 2) % 4]
        group = (1, 4, 7)[i % 3]
        block_size = BLOCK_SIZES[(i // 3) % 3]
        gate = (i // 2) % 2 == 0
        cases.append(pytest.param(dtype, head_dim, scenario, group, block_size, gate,
                                  id=f"{str(dtype)[6:]}-d{head_dim}-{scenario}-g{group}-bs{block_size}-gate{int(gate)}"))
    return cases


@pytest.mark.parametrize("dtype, head_dim, scenario, group, block_size, gate", _emulated_cases())
def test_emulated_slot_attention_matches_reference(emulator, dtype, head_dim, scenario, group, block_size, gate):
    rng = random.Random(zlib.crc32(f"emu-{dtype}-{head_dim}-{scenario}".encode()))
    q_lens, seq_lens, pad = scenario_lengths(scenario, rng)
    case = make_case(torch.device("cpu"), dtype, head_dim, group=group, num_kv_heads=1, block_size=block_size,
                     q_lens=q_lens, seq_lens=seq_lens, pad_seqs=pad, gate=gate, seed=rng.randrange(1 << 30))
    max_query_len = 1 if scenario == "decode" else max(q_lens) + 5 * (head_dim == 64)
    _check_emulated(emulator, case, max_query_len, 132, f"{scenario} {dtype} d{head_dim} group {group}")


@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("scenario", ("decode", "mixed"))
def test_emulated_gqa_groups(emulator, group, scenario):
    """Every decode heads-per-block instance (1, 4, 8), partial chunks (2, 3, 7) and two chunks (16)."""
    rng = random.Random(group)
    q_lens, seq_lens, pad = scenario_lengths(scenario, rng)
    case = make_case(torch.device("cpu"), torch.float16, 64, group=group, num_kv_heads=2, block_size=16,
                     q_lens=q_lens, seq_lens=seq_lens, pad_seqs=pad, gate=group % 2 == 1, seed=group)
    plan = _check_emulated(emulator, case, 1 if scenario == "decode" else max(q_lens), 132, f"group {group}")
    assert plan[0] * plan[1] >= group


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (32, 128))
def test_emulated_decode_splits_and_merge(emulator, dtype, head_dim):
    """Long and short contexts in one batch: several splits, some of them empty, merged."""
    seq_lens = [1100, 7, 600, 1]
    case = make_case(torch.device("cpu"), dtype, head_dim, group=2, num_kv_heads=1, block_size=16, q_lens=[1] * 4,
                     seq_lens=seq_lens, pad_seqs=(3,), gate=True, seed=head_dim)
    plan = _check_emulated(emulator, case, 1, 132, f"long decode {dtype} d{head_dim}")
    assert plan[3] == 5, f"expected 5 splits of a {case.block_table.shape[1] * 16}-position slot, plan {plan}"
    # Few SMs: the same batch unsplit must agree too.
    assert _check_emulated(emulator, case, 1, 1, "unsplit")[3] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
def test_emulated_padded_head_dims(emulator, dtype, head_dim):
    """A head_dim between the templates runs in the next one up; its padding is never written."""
    for scenario in ("decode", "mixed"):
        q_lens, seq_lens, pad = scenario_lengths(scenario, random.Random(head_dim))
        case = make_case(torch.device("cpu"), dtype, head_dim, group=3, num_kv_heads=1, block_size=16,
                         q_lens=q_lens, seq_lens=seq_lens, pad_seqs=pad, gate=True, seed=head_dim)
        _check_emulated(emulator, case, 1 if scenario == "decode" else max(q_lens), 132, f"{scenario} d{head_dim}")


def test_emulated_unsupported_head_dim_has_no_kernel(emulator):
    """fp16 rows of 20 elements (40 bytes) are not whole 16-byte vectors: no kernel, nothing written."""
    case = make_case(torch.device("cpu"), torch.float16, 20, group=2, num_kv_heads=1, block_size=4, q_lens=[1],
                     seq_lens=[5])
    with pytest.raises(AssertionError, match="no kernel"):
        emulate_slot_attention(emulator, case, 1, 132)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_strided_query_and_gate(emulator, dtype):
    """Query and gate as views of one fused projection (non-contiguous rows, aligned)."""
    for q_lens, seq_lens, max_query_len in (([5, 1, 12], [9, 30, 12], 12), ([1, 1], [9, 30], 1)):
        case = make_case(torch.device("cpu"), dtype, 64, group=4, num_kv_heads=1, block_size=16, q_lens=q_lens,
                         seq_lens=seq_lens, gate=True, seed=11)
        tokens, heads, dim = case.query.shape
        fused = torch.randn((tokens, heads, 2 * dim)).to(dtype)
        case.query, case.gate = fused[..., :dim], fused[..., dim:]
        _check_emulated(emulator, case, max_query_len, 132, f"strided query, max_query_len {max_query_len}")


def kv_write_inputs(dtype, head_dim, block_size, layout, device, seed):
    """Caches full of NaN, a shuffled block table, 23 tokens to distinct (slot, position), 1/4 padding."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, num_kv_heads, num_tokens = 5, 2, 23
    if block_size == "max":  # one block per slot
        block_size, cols = 48, 1
    else:
        cols = -(-48 // block_size)
    capacity = cols * block_size
    num_blocks = num_slots * cols + 4
    table = torch.randperm(num_blocks, generator=gen)[: num_slots * cols].view(num_slots, cols).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), device=device, dtype=dtype)
    value_cache = torch.full(shape, float("nan"), device=device, dtype=dtype)
    pairs = torch.randperm(num_slots * capacity, generator=gen)[:num_tokens]
    slot_ids = (pairs // capacity).to(torch.int32)
    positions = (pairs % capacity).to(torch.int32)
    slot_ids[::4] = -1
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(device, dtype)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(device, dtype)
    key_in, value_in = _kv_write_views(layout, key, value)
    return key, value, key_in, value_in, key_cache, value_cache, slot_ids.to(device), positions.to(device), table.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor, so NaN poison compares exactly."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _kv_write_views(layout: str, key: torch.Tensor, value: torch.Tensor):
    """The same key/value values laid out as the kernel may receive them."""
    if layout == "contiguous":
        return key, value
    tokens, heads, dim = key.shape
    if layout == "fused_qkv_view":  # [tokens, (q + k + v) heads, dim], k and v sliced out
        fused = torch.randn((tokens, 3 * heads, dim), device=key.device).to(key.dtype)
        fused[:, heads:2 * heads], fused[:, 2 * heads:] = key, value
        return fused[:, heads:2 * heads], fused[:, 2 * heads:]
    # "unaligned": rows start one element into a buffer, so 16-byte moves are impossible
    views = []
    for t in (key, value):
        flat = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
        views.append(flat[1:].view(t.shape))
        views[-1].copy_(t)
    return views[0], views[1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", KV_WRITE_LAYOUTS)
@pytest.mark.parametrize("head_dim", (64, 20))  # 20: rows not a multiple of 16 bytes
def test_emulated_kv_write_matches_reference(emulator, dtype, block_size, layout, head_dim):
    key, value, key_in, value_in, kc, vc, slot_ids, positions, table = kv_write_inputs(
        dtype, head_dim, block_size, layout, "cpu", zlib.crc32(f"{dtype}-{block_size}-{layout}-{head_dim}".encode()))
    exp_k, exp_v = kc.clone(), vc.clone()
    kv_write_reference(key, value, exp_k, exp_v, slot_ids, positions, table)
    dims = [key.shape[0], kc.shape[2], kc.shape[3], table.shape[0], table.shape[1], kc.shape[1], kc.shape[0]]
    strides = [key_in.stride(0), key_in.stride(1), value_in.stride(0), value_in.stride(1), *kc.stride()[:3],
               *vc.stride()[:3], slot_ids.stride(0), positions.stride(0), table.stride(0), table.stride(1)]
    width = emulator.qwen_emu_kv_write(ctypes.c_int64(kc.element_size()), _ptr(key_in), _ptr(value_in), _ptr(kc),
                                       _ptr(vc), _ptr(slot_ids), _ptr(positions), _ptr(table), _i64s(dims),
                                       _i64s(strides))
    aligned = layout != "unaligned" and (head_dim * kc.element_size()) % 16 == 0
    assert width == (16 if aligned else kc.element_size())
    assert torch.equal(_bits(kc), _bits(exp_k)), "key_cache differs from the reference write"
    assert torch.equal(_bits(vc), _bits(exp_v)), "value_cache differs from the reference write"


# ---- GPU: the cuda backend against the reference ----------------------------------------------------

def _poison_next_allocation(like: torch.Tensor) -> None:
    """Free a NaN tensor of `like`'s size, so the caching allocator hands its memory to the op's output."""
    junk = torch.full_like(like, float("nan"))
    del junk


def _run_cuda_attention(case: Case, max_query_len: int) -> torch.Tensor:
    _poison_next_allocation(case.query)
    with qwen_ops.use_backend("cuda"):
        out = qwen_ops.slot_attention(*case.attention_args(max_query_len))
    torch.cuda.synchronize()
    return out


def _check_attention(case: Case, max_query_len: int, dtype, what: str) -> None:
    expected = slot_attention_reference(*case.attention_args(max_query_len))
    out = _run_cuda_attention(case, max_query_len)
    assert out.shape == case.query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), equal_nan=False, msg=lambda m: f"{what}\n{m}",
                               **TOLERANCE[dtype])
    pad_rows = [r for i, s in enumerate(case.seq_slots.tolist()) if s < 0
                for r in range(int(case.query_start_loc[i]), int(case.query_start_loc[i + 1]))]
    if pad_rows:
        assert bool((out[pad_rows] == 0).all()), f"{what}: padding rows are not zero"


def _matrix_cases():
    """dtype x head_dim x scenario; GQA group, gate and block size rotate so all of them meet."""
    cases = []
    for i, (dtype, head_dim, scenario) in enumerate(itertools.product(DTYPES, HEAD_DIMS, SCENARIOS)):
        group = (1, 4, 7)[i % 3]
        block_size = BLOCK_SIZES[(i // 3) % 3]
        gate = i % 2 == 1
        cases.append(pytest.param(dtype, head_dim, scenario, group, block_size, gate,
                                  id=f"{str(dtype)[6:]}-d{head_dim}-{scenario}-g{group}-bs{block_size}-gate{int(gate)}"))
    return cases


@needs_gpu
@pytest.mark.parametrize("dtype, head_dim, scenario, group, block_size, gate", _matrix_cases())
def test_slot_attention_matches_reference(dtype, head_dim, scenario, group, block_size, gate):
    rng = random.Random(zlib.crc32(f"{dtype}-{head_dim}-{scenario}".encode()))
    q_lens, seq_lens, pad = scenario_lengths(scenario, rng)
    case = make_case(torch.device("cuda"), dtype, head_dim, group=group, block_size=block_size, q_lens=q_lens,
                     seq_lens=seq_lens, pad_seqs=pad, gate=gate, seed=rng.randrange(1 << 30))
    max_query_len = max(q_lens) if scenario != "decode" else 1
    _check_attention(case, max_query_len, dtype, f"{scenario} {dtype} d{head_dim} group {group} bs {block_size}")
    if scenario in ("prefill", "chunk", "mixed"):  # a loose static hint must not change the answer
        _check_attention(case, max_query_len + 37, dtype, "max_query_len + 37")


@needs_gpu
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("gate", (False, True))
@pytest.mark.parametrize("scenario", ("decode", "mixed"))
def test_slot_attention_gqa_gate_block_size(group, block_size, gate, scenario):
    rng = random.Random(group * 131 + gate)
    q_lens, seq_lens, pad = scenario_lengths(scenario, rng)
    case = make_case(torch.device("cuda"), torch.bfloat16, 128, group=group, block_size=block_size, q_lens=q_lens,
                     seq_lens=seq_lens, pad_seqs=pad, gate=gate, seed=rng.randrange(1 << 30))
    _check_attention(case, 1 if scenario == "decode" else max(q_lens), torch.bfloat16, f"{scenario} group {group}")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_long_context_splits(dtype, head_dim):
    """Few sequences, long contexts: the decode kernel splits them and the merge kernel combines."""
    seq_lens = [2500, 7, 1300, 1]
    case = make_case(torch.device("cuda"), dtype, head_dim, group=4, block_size=16, q_lens=[1] * 4, seq_lens=seq_lens,
                     gate=head_dim == 128, seed=head_dim)
    elem = case.query.element_size()
    capacity = case.block_table.shape[1] * case.key_cache.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = torch.ops._qwen_C._decode_plan(4, 8, 2, head_dim, elem, capacity, sms)[3]
    assert splits > 1, "this test must exercise the split + merge path"
    _check_attention(case, 1, dtype, f"long decode {dtype} d{head_dim} ({splits} splits)")


@needs_gpu
def test_decode_one_split_writes_output_directly():
    """A batch large enough that the decode kernel runs unsplit (no merge kernel)."""
    num_seqs = 96
    rng = random.Random(5)
    seq_lens = [rng.randrange(1, 300) for _ in range(num_seqs)]
    case = make_case(torch.device("cuda"), torch.float16, 128, num_kv_heads=8, group=4, block_size=16,
                     q_lens=[1] * num_seqs, seq_lens=seq_lens, pad_seqs=(3, 50), seed=5)
    capacity = case.block_table.shape[1] * case.key_cache.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = torch.ops._qwen_C._decode_plan(num_seqs, 32, 8, 128, 2, capacity, sms)[3]
    if splits != 1:
        pytest.skip(f"{sms} SMs: this shape is split {splits} ways here")
    _check_attention(case, 1, torch.float16, "unsplit decode")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slot_attention_strided_query_and_gate(dtype):
    """Query and gate as views of one fused projection [tokens, 2 * heads * head_dim] (Qwen3-Next)."""
    case = make_case(torch.device("cuda"), dtype, 64, group=4, block_size=16, q_lens=[5, 1, 12], seq_lens=[9, 30, 12],
                     gate=True, seed=11)
    tokens, heads, dim = case.query.shape
    fused = torch.randn((tokens, heads, 2 * dim), device="cuda").to(dtype)
    case.query, case.gate = fused[..., :dim], fused[..., dim:]
    assert not case.query.is_contiguous()
    _check_attention(case, 12, dtype, "strided query prefill")
    decode = make_case(torch.device("cuda"), dtype, 64, group=4, block_size=16, q_lens=[1, 1], seq_lens=[9, 30],
                       gate=True, seed=12)
    fused = torch.randn((2, heads, 2 * dim), device="cuda").to(dtype)
    decode.query, decode.gate = fused[..., :dim], fused[..., dim:]
    _check_attention(decode, 1, dtype, "strided query decode")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS + (20,))  # 20: rows not a multiple of 16 bytes
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", KV_WRITE_LAYOUTS)
def test_kv_write_matches_reference(dtype, head_dim, block_size, layout):
    key, value, key_in, value_in, kc, vc, slot_ids, positions, table = kv_write_inputs(
        dtype, head_dim, block_size, layout, "cuda", zlib.crc32(f"{dtype}-{block_size}-{layout}-{head_dim}".encode()))
    exp_k, exp_v = kc.clone(), vc.clone()
    kv_write_reference(key, value, exp_k, exp_v, slot_ids, positions, table)
    with qwen_ops.use_backend("cuda"):
        qwen_ops.kv_write(key_in, value_in, kc, vc, slot_ids, positions, table)
    torch.cuda.synchronize()
    assert torch.equal(_bits(kc), _bits(exp_k)), "key_cache differs from the reference write"
    assert torch.equal(_bits(vc), _bits(exp_v)), "value_cache differs from the reference write"


@needs_gpu
def test_bad_input_raises_and_writes_nothing():
    case = make_case(torch.device("cuda"), torch.bfloat16, 64, group=2, block_size=8, q_lens=[1, 1], seq_lens=[3, 9])
    key, value, slot_ids, positions = case.write_inputs(num_tokens=4, seed=1)
    before = case.key_cache.clone()
    with qwen_ops.use_backend("cuda"):
        with pytest.raises(ValueError, match="positions"):
            qwen_ops.kv_write(key, value, case.key_cache, case.value_cache, slot_ids, positions.long(),
                              case.block_table)
        with pytest.raises(ValueError, match="gate"):
            qwen_ops.slot_attention(*case.attention_args(1)[:-1], torch.randn(3, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(_bits(case.key_cache), _bits(before))


@needs_gpu
def test_unsupported_head_dim_names_it():
    case = make_case(torch.device("cuda"), torch.float16, 20, group=2, block_size=8, q_lens=[1], seq_lens=[5])
    with qwen_ops.use_backend("cuda"), pytest.raises(RuntimeError, match="head_dim = 20"):
        qwen_ops.slot_attention(*case.attention_args(1))


@needs_gpu
@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
def test_padded_head_dims(head_dim):
    for scenario in ("decode", "mixed"):
        q_lens, seq_lens, pad = scenario_lengths(scenario, random.Random(head_dim))
        case = make_case(torch.device("cuda"), torch.bfloat16, head_dim, group=3, block_size=16, q_lens=q_lens,
                         seq_lens=seq_lens, pad_seqs=pad, gate=True, seed=head_dim)
        _check_attention(case, 1 if scenario == "decode" else max(q_lens), torch.bfloat16, f"{scenario} d{head_dim}")


@needs_gpu
def test_rows_no_sequence_covers_are_zero():
    """Rows past query_start_loc[-1] (invalid input the value checks would reject) come back zero."""
    case = make_case(torch.device("cuda"), torch.float16, 64, group=2, block_size=8, q_lens=[1, 3], seq_lens=[5, 9])
    extra = torch.randn((3,) + tuple(case.query.shape[1:]), device="cuda").to(torch.float16)
    case.query = torch.cat([case.query, extra])
    _poison_next_allocation(case.query)
    with qwen_ops.use_backend("cuda"):
        out = qwen_ops.slot_attention(*case.attention_args(3))
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


def capture_in_cuda_graph(step):
    """Warm ``step`` up on a side stream, then capture it on the cuda backend; returns (graph, outputs)."""
    with qwen_ops.use_backend("cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
    return graph, outputs


@needs_gpu
@pytest.mark.parametrize("seq_len", (40, 3000))
def test_decode_step_captured_in_cuda_graph(seq_len):
    """kv_write + decode attention captured once, replayed on new values in the same buffers."""
    num_seqs = 3
    case = make_case(torch.device("cuda"), torch.bfloat16, 128, group=4, block_size=16, q_lens=[1] * num_seqs,
                     seq_lens=[seq_len, seq_len // 2, 5], seed=seq_len)
    live_slots = case.seq_slots.clone()
    key = torch.randn((num_seqs, 2, 128), device="cuda").to(torch.bfloat16)
    value = torch.randn_like(key)
    positions = (case.seq_lens - 1).clone()

    def step():
        qwen_ops.kv_write(key, value, case.key_cache, case.value_cache, live_slots, positions, case.block_table)
        return qwen_ops.slot_attention(*case.attention_args(1))

    graph, out = capture_in_cuda_graph(step)
    # New values in the captured buffers; the last sequence becomes padding.
    key.copy_(torch.randn_like(key))
    value.copy_(torch.randn_like(value))
    case.query.copy_(torch.randn_like(case.query))
    case.seq_slots[2] = -1
    exp_k, exp_v = case.key_cache.clone(), case.value_cache.clone()
    kv_write_reference(key, value, exp_k, exp_v, live_slots, positions, case.block_table)
    expected = slot_attention_reference(case.query, exp_k, exp_v, case.block_table, case.seq_slots,
                                        case.query_start_loc, case.seq_lens, case.scale, 1, None)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[torch.bfloat16])
    assert bool((out[2] == 0).all())
