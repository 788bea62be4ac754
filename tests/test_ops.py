"""Tests of torch.ops.qwen.kv_write and torch.ops.qwen.slot_attention (qwen_ops/ops/registry.py) on every backend.

* The reference kernel is checked against a per-token loop oracle written here (plain matmul on
  KV gathered position by position into contiguous tensors, in fp64).
* Every available backend is checked against the reference on fresh random inputs: attention
  over caches that hold NaN at every position a sequence must not read, block tables with random
  physical blocks and junk ids past each sequence's used blocks, NaN query/gate rows for padding
  sequences, strided views; kv_write into caches of random junk, compared bit-exactly with the
  reference-written copy (including the storage around the cache view).
* opcheck, bad inputs (and that nothing was written when they are rejected), backend selection,
  torch.compile(fullgraph=True) of a toy module, and GPU-only checks (CUDA graphs, long contexts).

On a CPU-only machine the triton backend runs under TRITON_INTERPRET=1 (tests/conftest.py), at
about 1 ms per program instance, so the shapes here are small.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import qwen_ops
from qwen_ops.ops import backend as backend_mod
from qwen_ops.ops.kernels import reference as reference_kernels
from qwen_ops.ops.kernels.reference import kv_write_reference, slot_attention_reference
from tolerances import assert_attention_close, assert_within_flash_bound

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOW_PRECISION_DTYPES = [torch.float16, torch.bfloat16]
GQA_RATIOS = [1, 4, 7]
GATES = [False, True]
HEAD_DIMS = [64, 128, 256]
BLOCK_SIZES = [1, 3, 16, "max_seq_len"]   # "max_seq_len": one block per slot, block_table[s, 0] == s
LAYOUTS = ["contiguous", "strided"]
KV_HEADS = [1, 3]

MAX_SLOTS = 4
MAX_SEQ_LEN = 40
# Long enough that the decode kernel splits the context (at least 4 key tiles of 16 under the
# interpreter, of 64 on a GPU, per split): test_decode_split_scenario_splits checks it does.
LONG_CONTEXT = 600 if torch.cuda.is_available() else 150


@dataclass(frozen=True)
class Seq:
    slot: int      # slot the sequence reads; -1 = padding sequence
    context: int   # tokens already in the slot before this step
    q_len: int     # query tokens this step; seq_len = context + q_len


SCENARIOS = {
    # max_query_len == 1: the decode kernel; a padding sequence in the middle (CUDA-graph batch).
    "decode": (Seq(2, 4, 1), Seq(-1, 0, 1), Seq(0, 17, 1), Seq(3, 0, 1)),
    # every sequence live, ragged lengths: the reference's batched pure-decode path
    "decode_live": (Seq(2, 4, 1), Seq(0, 17, 1), Seq(3, 0, 1), Seq(1, 40, 1)),
    "decode_split": (Seq(0, LONG_CONTEXT - 1, 1), Seq(-1, 0, 1), Seq(2, LONG_CONTEXT // 2, 1), Seq(1, 3, 1)),
    "prefill": (Seq(1, 0, 7), Seq(0, 0, 12), Seq(3, 0, 1)),
    "chunk": (Seq(2, 9, 6), Seq(0, 20, 11)),                       # chunks continuing filled slots
    "mixed": (Seq(0, 10, 1), Seq(1, 0, 9), Seq(2, 5, 4), Seq(3, 30, 1)),
    # padding sequences with query rows, a live sequence with no query row this step
    "padding": (Seq(1, 6, 3), Seq(-1, 0, 2), Seq(2, 5, 0), Seq(0, 12, 1), Seq(-1, 0, 1)),
}
SCENARIO_NAMES = list(SCENARIOS)
DECODE_AND_MIXED = ["decode", "mixed"]
# The expensive opcheck runs on these (scenario, dtype) pairs only.
OPCHECK_CASES = [("decode_split", torch.float32), ("mixed", torch.float32)]


def _ids(value) -> str:
    return str(value).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCase:
    seqs: tuple[Seq, ...]
    query: torch.Tensor          # [T, H, D]; rows of padding sequences are NaN
    key_cache: torch.Tensor      # [NB, BS, KVH, D]; NaN at every position no sequence may read
    value_cache: torch.Tensor
    block_table: torch.Tensor    # int32 [MAX_SLOTS, blocks per slot]; junk ids past used blocks
    seq_slots: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    max_query_len: int
    gate: Optional[torch.Tensor]

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_slots,
                self.query_start_loc, self.seq_lens, self.scale, self.max_query_len, self.gate)


def _strided(shape: tuple[int, ...], dtype, device, layout: str, fill: float = float("nan")) -> torch.Tensor:
    """A tensor of ``shape``; "strided": a view into wider storage (last dim padded by 16)."""
    if layout == "contiguous":
        return torch.full(shape, fill, dtype=dtype, device=device)
    storage = torch.full(shape[:-1] + (shape[-1] + 16,), fill, dtype=dtype, device=device)
    return storage[..., : shape[-1]]


def _block_table(used_blocks: dict[int, int], blocks_per_slot: int, num_blocks: int, contiguous: bool,
                 gen: torch.Generator) -> torch.Tensor:
    """Random physical blocks per slot; ids past a slot's ``used_blocks`` are junk (never valid)."""
    if contiguous:                        # the seed's layout: slot s is block s
        return torch.arange(MAX_SLOTS, dtype=torch.int32).view(MAX_SLOTS, 1)
    table = torch.randperm(num_blocks, generator=gen)[: MAX_SLOTS * blocks_per_slot]
    table = table.view(MAX_SLOTS, blocks_per_slot).to(torch.int32)
    for slot in range(MAX_SLOTS):
        used = used_blocks.get(slot, 0)
        junk = torch.randint(num_blocks, 2**30, (blocks_per_slot - used,), generator=gen, dtype=torch.int32)
        junk[::2] = -7 - junk[::2] % 1000  # negative junk too
        table[slot, used:] = junk
    return table


def make_attention_case(scenario: str, *, dtype, device, group: int = 4, num_kv_heads: int = 2,
                        head_dim: int = 64, block_size=3, gate: bool = True, layout: str = "strided",
                        seed: int = 0) -> AttentionCase:
    gen = torch.Generator().manual_seed(seed)
    seqs = SCENARIOS[scenario] if isinstance(scenario, str) else scenario   # a name, or the Seqs themselves
    max_seq_len = max(MAX_SEQ_LEN, max(s.context + s.q_len for s in seqs))
    contiguous = block_size == "max_seq_len"
    block_size = max_seq_len if contiguous else block_size
    blocks_per_slot = math.ceil(max_seq_len / block_size)
    num_blocks = MAX_SLOTS if contiguous else MAX_SLOTS * blocks_per_slot + 3
    live = [s for s in seqs if s.slot >= 0]
    used = {s.slot: math.ceil((s.context + s.q_len) / block_size) for s in live}
    block_table = _block_table(used, blocks_per_slot, num_blocks, contiguous, gen)

    num_heads = group * num_kv_heads
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = _strided(cache_shape, dtype, device, layout)
    value_cache = _strided(cache_shape, dtype, device, layout)
    for s in live:  # fill exactly the positions [0, seq_len) of each live slot
        pos = torch.arange(s.context + s.q_len)
        blocks, rows = block_table[s.slot, pos // block_size].long(), pos % block_size
        key_cache[blocks, rows] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen).to(device, dtype)
        value_cache[blocks, rows] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen).to(device, dtype)

    num_tokens = sum(s.q_len for s in seqs)
    qg = torch.randn(num_tokens, num_heads, 2 * head_dim, generator=gen).to(device, dtype)
    if layout == "strided":   # query and gate as halves of one projection, as Qwen3-Next splits them
        query, gate_t = qg[..., :head_dim], qg[..., head_dim:]
    else:
        query, gate_t = qg[..., :head_dim].contiguous(), qg[..., head_dim:].contiguous()
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.q_len)
    for i, s in enumerate(seqs):
        if s.slot < 0:  # padding rows may hold anything: their output must still be zero
            query[starts[i]:starts[i + 1]] = float("nan")
            gate_t[starts[i]:starts[i + 1]] = float("nan")

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return AttentionCase(
        seqs=seqs, query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table.to(device),
        seq_slots=i32([s.slot for s in seqs]), query_start_loc=i32(starts),
        seq_lens=i32([s.context + s.q_len if s.slot >= 0 else 5 for s in seqs]),
        scale=head_dim ** -0.5, max_query_len=max(1, max(s.q_len for s in seqs)),
        gate=gate_t if gate else None)


def loop_oracle_attention(case: AttentionCase, compute_dtype=torch.float64) -> torch.Tensor:
    """Per query token, per position gathering: the spec of slot_attention written the slow way."""
    num_tokens, num_heads, head_dim = case.query.shape
    group = num_heads // case.key_cache.shape[2]
    block_size = case.key_cache.shape[1]
    table = case.block_table.cpu()
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=compute_dtype)
    start = 0
    for s in case.seqs:
        if s.slot >= 0 and s.q_len:
            seq_len = s.context + s.q_len
            idx = [(int(table[s.slot, p // block_size]), p % block_size) for p in range(seq_len)]
            # contiguous [seq_len, H, D]: kv head of query head h is h // group
            k = torch.stack([case.key_cache[b, r] for b, r in idx]).cpu().to(compute_dtype)
            v = torch.stack([case.value_cache[b, r] for b, r in idx]).cpu().to(compute_dtype)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            for j in range(s.q_len):
                last = s.context + j                               # this row's absolute position
                q = case.query[start + j].cpu().to(compute_dtype)  # [H, D]
                scores = (k[: last + 1].transpose(0, 1) @ q[:, :, None]).squeeze(-1) * case.scale  # [H, L]
                probs = torch.softmax(scores, dim=-1)
                o = (probs[:, None, :] @ v[: last + 1].transpose(0, 1)).squeeze(1)             # [H, D]
                if case.gate is not None:
                    o = o * torch.sigmoid(case.gate[start + j].cpu().to(compute_dtype))
                out[start + j] = o
        start += s.q_len
    return out


def poison_allocator(like: torch.Tensor) -> None:
    """Free a NaN-filled block of ``like``'s size, so a kernel's torch.empty output likely reuses it."""
    torch.full((like.numel() + 64,), float("nan"), dtype=like.dtype, device=like.device)


def run_op(backend: str, op, *args):
    with qwen_ops.use_backend(backend):
        return op(*args)


def maybe_opcheck(op, args: tuple, cond: bool) -> None:
    """torch.library.opcheck when ``cond`` (it runs the op several times), else nothing."""
    if cond:
        torch.library.opcheck(op, args)


# --------------------------------------------------------------------------------------------
# The reference against the loop oracle
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_reference_matches_loop_oracle(scenario, dtype, device):
    case = make_attention_case(scenario, dtype=dtype, device=device, seed=1)
    out = slot_attention_reference(*case.args())
    assert_attention_close(out.cpu(), loop_oracle_attention(case), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("group", GQA_RATIOS)
def test_reference_per_sequence_decode_matches_loop_oracle(group, dtype, device, monkeypatch):
    """The long-context decode path (one sequence at a time through a reused buffer), forced on."""
    from qwen_ops.ops.kernels import reference

    calls = []
    per_sequence = reference._decode_attend_per_sequence
    monkeypatch.setattr(reference, "PER_SEQUENCE_KV_BYTES", 0)
    monkeypatch.setattr(reference, "_decode_attend_per_sequence", lambda *a: calls.append(1) or per_sequence(*a))
    case = make_attention_case("decode_live", dtype=dtype, device=device, group=group, gate=group != 1, seed=3)
    out = slot_attention_reference(*case.args())
    assert calls, "the per-sequence path did not run"
    assert_attention_close(out.cpu(), loop_oracle_attention(case), dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("group", GQA_RATIOS)
def test_reference_matches_loop_oracle_layouts(group, block_size, device):
    case = make_attention_case("mixed", dtype=torch.float32, device=device, group=group, block_size=block_size,
                               gate=group != 4, seed=2)
    out = slot_attention_reference(*case.args())
    assert_attention_close(out.cpu(), loop_oracle_attention(case), torch.float32)


def test_loop_oracle_is_not_vacuous(device):
    """The oracle sees every input: changing one visible key changes its output."""
    case = make_attention_case("chunk", dtype=torch.float32, device=device, seed=3)
    before = loop_oracle_attention(case)
    s = case.seqs[0]
    case.key_cache[int(case.block_table[s.slot, 0]), 0] += 1.0   # position 0 of the first sequence
    assert not torch.allclose(before, loop_oracle_attention(case))


# --------------------------------------------------------------------------------------------
# Every backend against the reference: slot_attention
# --------------------------------------------------------------------------------------------

def check_attention(backend: str, case: AttentionCase, dtype, opcheck: bool = False) -> torch.Tensor:
    expected = slot_attention_reference(*case.args())
    assert not expected.isnan().any(), "the reference read a position it must not read"
    maybe_opcheck(torch.ops.qwen.slot_attention.default, case.args(), opcheck and backend != "reference")
    poison_allocator(case.query)
    out = run_op(backend, torch.ops.qwen.slot_attention, *case.args())
    assert out.shape == case.query.shape and out.dtype == case.query.dtype and out.device == case.query.device
    assert_attention_close(out, expected, dtype, msg=f"backend {backend}")
    start = 0
    for s in case.seqs:   # padding rows: exactly zero
        if s.slot < 0:
            assert torch.equal(out[start:start + s.q_len], torch.zeros_like(out[start:start + s.q_len]))
        start += s.q_len
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_slot_attention_scenarios(backend, scenario, dtype, layout, device):
    case = make_attention_case(scenario, dtype=dtype, device=device, layout=layout, gate=layout == "strided",
                               seed=10)
    check_attention(backend, case, dtype, opcheck=(scenario, dtype) in OPCHECK_CASES and layout == "strided")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("group", GQA_RATIOS)
@pytest.mark.parametrize("scenario", DECODE_AND_MIXED)
def test_slot_attention_gqa_and_gate(backend, scenario, group, gate, device):
    case = make_attention_case(scenario, dtype=torch.float16, device=device, group=group, gate=gate, seed=11)
    check_attention(backend, case, torch.float16)


@pytest.mark.parametrize("block_size", [3, 16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_slot_attention_vector_paths(backend, dtype, group, head_dim, block_size, device):
    """The CPU kernel's vector paths on fp32 and bf16 caches as stored: query heads per kv head in
    groups of 16, 4, 2 and 1 (7 = 4 + 2 + 1; Qwen3-0.6B has 2, the embedded model 4), head dims
    with register accumulators (32 .. 256) and one without (80), and key tiles (16 / heads keys) that
    fill a block of 16 or are cut short by the block's or the sequence's end."""
    # with blocks of 16: decode rows over 3 full blocks, 1 block and 5 keys, 31 keys; a padding row; a chunk
    seqs = (Seq(0, 47, 1), Seq(1, 20, 1), Seq(-1, 0, 1), Seq(2, 5, 4), Seq(3, 30, 1)) if block_size == 16 else "mixed"
    case = make_attention_case(seqs, dtype=dtype, device=device, group=group, head_dim=head_dim,
                               block_size=block_size, gate=False, seed=15)
    check_attention(backend, case, dtype)


# The CPU kernel's flash path (qwen_cpu_flash.c: sequences of FLASH_MIN_QUERY = 2 query rows or more):
# whole prompts and chunks whose lengths cross the 64-key blocks, the 256-key softmax blocks of the
# tiles' path, the query blocks (64 rows of positions x heads) and the pages, a chunk starting off the diagonal, next to decode rows (the row
# path), a padding sequence and short queries (2 and 15 rows).
FLASH_CASES = {
    "prompt": (Seq(0, 0, 130),),
    "chunk": (Seq(1, 70, 67), Seq(2, 128, 64)),
    "mixed": (Seq(0, 5, 1), Seq(1, 0, 100), Seq(-1, 0, 3), Seq(2, 33, 2), Seq(3, 40, 15)),
    # past the AMX path's softmax blocks of 256 keys: a prompt of 300 and a chunk across key 256
    "long": (Seq(0, 0, 300), Seq(1, 230, 90)),
}


@pytest.mark.parametrize("gate", [False, True], ids=["plain", "gate"])
@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case_name", list(FLASH_CASES))
def test_slot_attention_cpu_flash(case_name, dtype, group, gate):
    """The flash path against the reference (outputs poisoned), and for bf16 (P rounded to bf16 before
    the P V product, as flash kernels do) within flash-attention's bound of the float64 loop oracle;
    the same bits on one thread and on two (tasks are computed alike whoever takes them)."""
    reason = backend_mod.why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    case = make_attention_case(FLASH_CASES[case_name], dtype=dtype, device=torch.device("cpu"), group=group,
                               num_kv_heads=2, head_dim=64 if group != 3 else 80, block_size=16, gate=gate,
                               seed=17)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = check_attention("cpu", case, dtype)
        torch.set_num_threads(2)
        poison_allocator(case.query)
        two = run_op("cpu", torch.ops.qwen.slot_attention, *case.args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), "two threads differ from one"
    if dtype != torch.float32:
        assert_within_flash_bound(one, loop_oracle_attention(case), loop_oracle_attention(case, compute_dtype=dtype))


@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_slot_attention_cpu_flash_head_dims_and_pages(head_dim):
    """Head dims of one, four and eight 32-wide tile steps, on pages of 1 and 3 rows (a 16-key tile
    spans pages) against the float64 loop oracle."""
    reason = backend_mod.why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    for block_size in (1, 3):
        for dtype in (torch.float32, torch.bfloat16):
            case = make_attention_case((Seq(1, 21, 50),), dtype=dtype, device=torch.device("cpu"), group=2,
                                       num_kv_heads=1, head_dim=head_dim, block_size=block_size, seed=18)
            check_attention("cpu", case, dtype)


@pytest.mark.parametrize("mode", ["amx", "dot", "widening"])
def test_slot_attention_cpu_flash_every_bf16_path(tmp_path, monkeypatch, mode):
    """The bf16 flash path on each of the products' paths, forced in a fresh load of the library that
    the CPU kernel of slot_attention calls for the test: AMX tiles, AVX512-BF16 dot products (each only where the CPU has it) and widening into
    fp32 FMAs. Against the reference (outputs poisoned) and within flash-attention's bound of the
    float64 loop oracle; head dims 80 (the dot path's output dims in a group of 4 vectors and one of 2),
    64 and 128, GQA groups 1, 2 and 8, the gate, whole prompts, chunks and mixed batches; the same bits
    on one thread and two."""
    from qwen_ops.ops.kernels import cpu
    from qwen_tiny import fresh_library

    reason = backend_mod.why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    lib = fresh_library(tmp_path, monkeypatch, QWEN_OPS_BF16_PRODUCTS=mode)
    if lib.qwen_bf16_products() != {"amx": 2, "dot": 1, "widening": 0}[mode]:
        pytest.skip(f"this CPU has no {mode} bf16 products")
    monkeypatch.setattr(cpu, "library", lambda: lib)      # slot_attention's CPU kernel calls library()
    cases = [("chunk", 2, 80, False), ("mixed", 8, 64, True), ("prompt", 1, 128, False), ("long", 2, 64, True)]
    before = torch.get_num_threads()
    try:
        for name, group, head_dim, gate in cases:
            case = make_attention_case(FLASH_CASES[name], dtype=torch.bfloat16, device=torch.device("cpu"),
                                       group=group, num_kv_heads=2, head_dim=head_dim, block_size=16, gate=gate,
                                       seed=19)
            torch.set_num_threads(1)
            one = check_attention("cpu", case, torch.bfloat16)
            torch.set_num_threads(2)
            poison_allocator(case.query)
            two = run_op("cpu", torch.ops.qwen.slot_attention, *case.args())
            assert torch.equal(one, two), f"{name}: two threads differ from one"
            assert_within_flash_bound(one, loop_oracle_attention(case),
                                      loop_oracle_attention(case, compute_dtype=torch.bfloat16))
    finally:
        torch.set_num_threads(before)


# The CPU kernel's split over threads: one decode row split by kv heads (3 threads over 4 kv heads:
# ranges of 1, 1 and 2 heads), and batches of rows split by rows.
THREAD_CASES = {"lone_decode": (Seq(1, 70, 1),), "decode": SCENARIOS["decode_live"], "mixed": SCENARIOS["mixed"]}


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("gate", [False, True], ids=["plain", "gate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case_name", list(THREAD_CASES))
def test_slot_attention_threads(case_name, dtype, gate, threads):
    """The CPU kernel on several threads: against the reference, and the same bits as on one thread
    (each piece writes its own heads of its own row, in the one-thread order)."""
    from qwen_ops.ops.backend import why_unavailable

    reason = why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    case = make_attention_case(THREAD_CASES[case_name], dtype=dtype, device=torch.device("cpu"), group=2,
                               num_kv_heads=4, head_dim=64, block_size=16, gate=gate, seed=16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_op("cpu", torch.ops.qwen.slot_attention, *case.args())
        torch.set_num_threads(threads)
        many = check_attention("cpu", case, dtype)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(many, one), f"{threads} threads differ from one"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("scenario", DECODE_AND_MIXED)
def test_slot_attention_head_dims(backend, scenario, head_dim, device):
    case = make_attention_case(scenario, dtype=torch.bfloat16, device=device, num_kv_heads=1, head_dim=head_dim,
                               seed=12)
    check_attention(backend, case, torch.bfloat16)


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("scenario", ["decode", "decode_split", "chunk", "mixed"])
def test_slot_attention_block_sizes(backend, scenario, block_size, device):
    case = make_attention_case(scenario, dtype=torch.float32, device=device, block_size=block_size, seed=13)
    check_attention(backend, case, torch.float32)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=_ids)
@pytest.mark.parametrize("scenario", ["decode_split", "mixed"])
def test_slot_attention_flash_bound(backend, scenario, dtype, device):
    """Error vs the fp64 oracle at most twice that of plain torch run in the same dtype."""
    case = make_attention_case(scenario, dtype=dtype, device=device, seed=14)
    exact = loop_oracle_attention(case)
    same_dtype = loop_oracle_attention(case, compute_dtype=dtype)
    out = run_op(backend, torch.ops.qwen.slot_attention, *case.args())
    assert_within_flash_bound(out.cpu(), exact, same_dtype)


def test_decode_split_scenario_splits(device):
    """The decode_split cases really exercise several splits and the merge kernel."""
    pytest.importorskip("triton", reason="the split count belongs to the triton backend")
    from qwen_ops.ops.kernels import triton as triton_kernels
    for head_dim in (64, 256):
        case = make_attention_case("decode_split", dtype=torch.float32, device=device, head_dim=head_dim)
        out = torch.zeros_like(case.query)
        launches = triton_kernels.slot_attention_launches(*case.args(), out,
                                                          interpret=backend_mod.triton_interpret())
        splits = dict(launches[0].constexprs)["NUM_SPLITS"]
        assert splits > 1 and [ln.kernel.__name__ for ln in launches][-1] == "_merge_kernel", splits


def test_triton_launch_plan_reads_no_device_values(device):
    """Grids and constexprs depend on shapes only (CUDA-graph capture): same shapes, other values."""
    pytest.importorskip("triton", reason="checks the triton backend's launch plans")
    from qwen_ops.ops.kernels import triton as triton_kernels
    plans = []
    for scenario, seed in (("decode", 0), ("decode", 5), ("mixed", 0), ("mixed", 5)):
        case = make_attention_case(scenario, dtype=torch.float16, device=device, seed=seed)
        lens = case.seq_lens.clone().fill_(1) if seed else case.seq_lens
        args = case.args()[:6] + (lens,) + case.args()[7:]
        launches = triton_kernels.slot_attention_launches(*args, torch.zeros_like(case.query), interpret=False)
        plans.append([(ln.kernel.__name__, ln.grid, ln.constexprs) for ln in launches])
    assert plans[0] == plans[1] and plans[2] == plans[3] and plans[0] != plans[2]


@pytest.mark.parametrize("scenario", DECODE_AND_MIXED)
def test_triton_rows_no_sequence_covers_are_zero(scenario, device):
    """The launcher's output is fully defined: rows past query_start_loc[-1] (which only the value
    checks reject, and those are off on the triton path) come back zero, not uninitialised."""
    if backend_mod.why_unavailable("triton", device) is not None:
        pytest.skip(f"triton unavailable on {device}: {backend_mod.why_unavailable('triton', device)}")
    from qwen_ops.ops.kernels.triton import slot_attention_triton
    case = make_attention_case(scenario, dtype=torch.float16, device=device, seed=15)
    extra = torch.randn(3, *case.query.shape[1:], device=device).to(torch.float16)
    query = torch.cat([case.query, extra])
    gate = torch.cat([case.gate, extra])
    poison_allocator(query)
    out = slot_attention_triton(query, *case.args()[1:9], gate)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    assert_attention_close(out[:-3], slot_attention_reference(*case.args()), torch.float16)


def test_slot_attention_empty_batch(backend, device):
    case = make_attention_case("decode", dtype=torch.float32, device=device)
    query = case.query[:0]
    out = run_op(backend, torch.ops.qwen.slot_attention, query, case.key_cache, case.value_cache,
                 case.block_table, case.seq_slots[:0], case.query_start_loc[:1], case.seq_lens[:0], 0.5, 1, None)
    assert out.shape == query.shape


# --------------------------------------------------------------------------------------------
# Every backend against the reference: kv_write
# --------------------------------------------------------------------------------------------

# slot of each token (-1 = padding); positions are drawn per slot without repeats.
KV_WRITE_SLOTS = [1, -1, 0, 3, 3, -1, 2, 0, 1, 1]


def make_kv_write_args(*, dtype, device, block_size, num_kv_heads=2, head_dim=64, seed=0):
    """(key, value, key_cache, value_cache, slot_ids, positions, block_table, cache storages)."""
    gen = torch.Generator().manual_seed(seed)
    contiguous = block_size == "max_seq_len"
    block_size = MAX_SEQ_LEN if contiguous else block_size
    blocks_per_slot = math.ceil(MAX_SEQ_LEN / block_size)
    num_blocks = MAX_SLOTS if contiguous else MAX_SLOTS * blocks_per_slot + 3
    positions, used = [], {}
    orders = {s: torch.randperm(MAX_SEQ_LEN, generator=gen).tolist() for s in range(MAX_SLOTS)}
    for slot in KV_WRITE_SLOTS:
        if slot < 0:
            positions.append(10**6)      # padding: a junk position that must not be used
            continue
        pos = orders[slot].pop()
        positions.append(pos)
        used[slot] = max(used.get(slot, 0), pos // block_size + 1)
    table = _block_table(used, blocks_per_slot, num_blocks, contiguous, gen).to(device)

    num_tokens = len(KV_WRITE_SLOTS)
    kv = torch.randn(num_tokens, num_kv_heads, 2 * head_dim, generator=gen).to(device, dtype)
    key, value = kv[..., :head_dim], kv[..., head_dim:]    # strided views, as split from a projection
    pad = torch.tensor(KV_WRITE_SLOTS) < 0
    kv[pad.to(device)] = float("nan")                     # padding tokens' rows must never be written
    storage_shape = (num_blocks, block_size, num_kv_heads, head_dim + 16)
    storages = [torch.randn(storage_shape, generator=gen).to(device, dtype) for _ in range(2)]  # random junk
    key_cache, value_cache = (s[..., :head_dim] for s in storages)
    i32 = dict(dtype=torch.int32, device=device)
    return (key, value, key_cache, value_cache, torch.tensor(KV_WRITE_SLOTS, **i32), torch.tensor(positions, **i32),
            table), storages


def _with_fresh_caches(args, storages):
    """The same arguments over clones of the cache storages (returned too)."""
    clones = [s.clone() for s in storages]
    head_dim = args[0].shape[-1]
    return args[:2] + (clones[0][..., :head_dim], clones[1][..., :head_dim]) + args[4:], clones


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_kv_write(backend, dtype, block_size, device):
    args, storages = make_kv_write_args(dtype=dtype, device=device, block_size=block_size, seed=20)
    expected_args, expected = _with_fresh_caches(args, storages)
    kv_write_reference(*expected_args)
    assert not any(s.isnan().any() for s in expected), "the reference wrote a padding token"
    assert not torch.equal(expected[0], storages[0]), "nothing was written: the test would be vacuous"
    out_args, written = _with_fresh_caches(args, storages)
    run_op(backend, torch.ops.qwen.kv_write, *out_args)
    assert torch.equal(written[0], expected[0]) and torch.equal(written[1], expected[1])
    if dtype == torch.float32 and block_size == 3 and backend != "reference":
        opcheck_args, _ = _with_fresh_caches(args, storages)
        with qwen_ops.use_backend(backend):
            torch.library.opcheck(torch.ops.qwen.kv_write.default, opcheck_args)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
def test_kv_write_heads(backend, num_kv_heads, head_dim, device):
    args, storages = make_kv_write_args(dtype=torch.bfloat16, device=device, block_size=16,
                                        num_kv_heads=num_kv_heads, head_dim=head_dim, seed=21)
    expected_args, expected = _with_fresh_caches(args, storages)
    kv_write_reference(*expected_args)
    out_args, written = _with_fresh_caches(args, storages)
    run_op(backend, torch.ops.qwen.kv_write, *out_args)
    assert torch.equal(written[0], expected[0]) and torch.equal(written[1], expected[1])


def test_kv_write_then_attend(backend, device):
    """A mixed step end to end: write this step's K/V, then attend over them."""
    case = make_attention_case("mixed", dtype=torch.float16, device=device, seed=22)
    token_slots, token_pos = [], []
    for s in case.seqs:
        token_slots += [s.slot] * s.q_len
        token_pos += list(range(s.context, s.context + s.q_len))
    num_tokens, kvh, hd = case.query.shape[0], case.key_cache.shape[2], case.key_cache.shape[3]
    key = torch.randn(num_tokens, kvh, hd, device=device).to(torch.float16)
    value = torch.randn(num_tokens, kvh, hd, device=device).to(torch.float16)
    i32 = dict(dtype=torch.int32, device=device)
    write = (key, value) + (None, None) + (torch.tensor(token_slots, **i32), torch.tensor(token_pos, **i32),
                                           case.block_table)
    results = {}
    for name in ("reference", backend):
        caches = (case.key_cache.clone(), case.value_cache.clone())
        run_op(name, torch.ops.qwen.kv_write, *write[:2], *caches, *write[4:])
        args = case.args()[:1] + caches + case.args()[3:]
        results[name] = (run_op(name, torch.ops.qwen.slot_attention, *args), caches)
    out, caches = results[backend]
    ref, ref_caches = results["reference"]
    for got, want in zip(caches, ref_caches):   # NaN junk where nothing was written, on both sides
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    assert_attention_close(out, ref, torch.float16)


# --------------------------------------------------------------------------------------------
# Bad inputs: a clear ValueError naming the argument, raised before anything is written
# --------------------------------------------------------------------------------------------

def _replace(args: tuple, index: int, value) -> tuple:
    return args[:index] + (value,) + args[index + 1:]


# (id, index of the argument to replace, replacement(args), message fragment)
BAD_KV_WRITE = [
    ("key_rank", 0, lambda a: a[0][0], "key has shape"),
    ("key_heads", 0, lambda a: torch.randn(a[0].shape[0], 5, a[0].shape[2], dtype=a[0].dtype), "key has shape"),
    ("value_head_dim", 1, lambda a: a[1][..., :32], "value has shape"),
    ("key_dtype", 0, lambda a: a[0].double(), "key has dtype"),
    ("slot_ids_int64", 4, lambda a: a[4].long(), "slot_ids has dtype"),
    ("positions_int64", 5, lambda a: a[5].long(), "positions has dtype"),
    ("block_table_int64", 6, lambda a: a[6].long(), "block_table has dtype"),
    ("positions_length", 5, lambda a: a[5][:-1], "positions has"),
    ("key_last_dim_strided", 0, lambda a: torch.randn(*a[0].shape[:2], 2 * a[0].shape[2],
                                                      dtype=a[0].dtype)[..., ::2], "last dimension"),
    ("key_other_device", 0, lambda a: a[0].to("meta"), "all tensors must be on one device"),
]
# Value checks (they read index tensors): host backends (reference, cpu) always, others under QWEN_OPS_DEBUG=1.
# Backends that check index values on every call without QWEN_OPS_DEBUG (they run on the host;
# the cpu backend's C kernels index memory with them directly).
HOST_BACKENDS = backend_mod.HOST_BACKENDS

BAD_KV_WRITE_VALUES = [
    ("slot_out_of_range", 4, lambda a: _set(a[4], 2, MAX_SLOTS), "slot_ids\\[2\\] = 4"),
    ("slot_below_padding", 4, lambda a: _set(a[4], 3, -2), "slot_ids\\[3\\] = -2"),
    ("position_beyond_capacity", 5, lambda a: _set(a[5], 0, 10**4), "positions\\[0\\] = 10000"),
    ("negative_position", 5, lambda a: _set(a[5], 0, -1), "positions\\[0\\] = -1"),
]

BAD_ATTENTION = [
    ("query_rank", 0, lambda a: a[0][0], "query has shape"),
    ("heads_not_multiple", 0, lambda a: torch.randn(a[0].shape[0], 3, a[0].shape[2], dtype=a[0].dtype),
     "multiple of the cache's num_kv_heads"),
    ("head_dim", 0, lambda a: a[0][..., :32], "query has head_dim"),
    ("seq_slots_int64", 4, lambda a: a[4].long(), "seq_slots has dtype"),
    ("query_start_loc_int64", 5, lambda a: a[5].long(), "query_start_loc has dtype"),
    ("seq_lens_int64", 6, lambda a: a[6].long(), "seq_lens has dtype"),
    ("query_start_loc_length", 5, lambda a: a[5][:-1], "query_start_loc has"),
    ("seq_lens_length", 6, lambda a: a[6][:-1], "seq_lens has"),
    ("gate_shape", 9, lambda a: a[9][:, :4], "gate has shape"),
    ("cache_dtype", 2, lambda a: a[2].double(), "value_cache has dtype"),
    ("query_last_dim_strided", 0, lambda a: torch.randn(*a[0].shape[:2], 2 * a[0].shape[2],
                                                        dtype=a[0].dtype)[..., ::2], "last dimension"),
    ("query_other_device", 0, lambda a: a[0].to("meta"), "all tensors must be on one device"),
    ("max_query_len_zero", 8, lambda a: 0, "max_query_len"),
]
BAD_ATTENTION_VALUES = [
    ("seq_slot_out_of_range", 4, lambda a: _set(a[4], 0, MAX_SLOTS + 1), "seq_slots\\[0\\] = 5"),
    ("seq_len_beyond_capacity", 6, lambda a: _set(a[6], 0, 10**4), "seq_lens\\[0\\] = 10000"),
    ("seq_len_below_query", 6, lambda a: _set(a[6], 1, 3), "seq_lens\\[1\\] = 3"),
    ("max_query_len_too_small", 8, lambda a: 2, "max_query_len = 2"),
    ("query_start_loc_end", 5, lambda a: _set(a[5], -1, 20), "query_start_loc\\[-1\\] = 20"),
    ("block_id_out_of_range", 3, lambda a: _set(a[3], (int(a[4][0]), 0), a[1].shape[0]), "block_table\\[.*a block the"),
]


def _set(t: torch.Tensor, index: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _on_cpu_device(args: tuple, device) -> tuple:
    """Replacement tensors are built on the CPU; move them to the test device (not meta)."""
    return tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in args)


@pytest.mark.parametrize("bad_id,index,make,message", BAD_KV_WRITE + BAD_KV_WRITE_VALUES,
                         ids=[c[0] for c in BAD_KV_WRITE + BAD_KV_WRITE_VALUES])
def test_kv_write_rejects_bad_input(backend, bad_id, index, make, message, device, monkeypatch):
    if (bad_id, index, make, message) in BAD_KV_WRITE_VALUES and backend not in HOST_BACKENDS:
        monkeypatch.setenv("QWEN_OPS_DEBUG", "1")   # value checks read the device: opt-in off the host backends
    args, storages = make_kv_write_args(dtype=torch.float32, device=device, block_size=3, seed=30)
    args, written = _with_fresh_caches(args, storages)
    bad = _on_cpu_device(_replace(args, index, make(args)), device) if "device" not in bad_id else \
        _replace(args, index, make(args))
    with pytest.raises(ValueError, match=message):
        run_op(backend, torch.ops.qwen.kv_write, *bad)
    assert torch.equal(written[0], storages[0]) and torch.equal(written[1], storages[1]), "cache was written"


@pytest.mark.parametrize("bad_id,index,make,message", BAD_ATTENTION + BAD_ATTENTION_VALUES,
                         ids=[c[0] for c in BAD_ATTENTION + BAD_ATTENTION_VALUES])
def test_slot_attention_rejects_bad_input(backend, bad_id, index, make, message, device, monkeypatch):
    if (bad_id, index, make, message) in BAD_ATTENTION_VALUES and backend not in HOST_BACKENDS:
        monkeypatch.setenv("QWEN_OPS_DEBUG", "1")
    case = make_attention_case("chunk", dtype=torch.float32, device=device, seed=31)
    args = case.args()
    bad = _replace(args, index, make(args))
    if "device" not in bad_id:
        bad = _on_cpu_device(bad, device)
    with pytest.raises(ValueError, match=message):
        run_op(backend, torch.ops.qwen.slot_attention, *bad)


# --------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------

@pytest.fixture
def spy_reference(monkeypatch):
    """Counts calls of the reference attention kernel (ops.py looks it up at call time)."""
    calls = []

    def spy(*args):
        calls.append(1)
        return slot_attention_reference(*args)

    monkeypatch.setattr(reference_kernels, "slot_attention_reference", spy)
    return calls


def test_env_variable_selects_backend(monkeypatch, spy_reference):
    case = make_attention_case("decode", dtype=torch.float32, device="cpu")
    monkeypatch.setenv("QWEN_OPS_BACKEND", "reference")
    assert qwen_ops.get_backend() == "reference"
    torch.ops.qwen.slot_attention(*case.args())
    assert len(spy_reference) == 1
    monkeypatch.setenv("QWEN_OPS_BACKEND", "auto")
    assert qwen_ops.resolve_backend(torch.device("cpu")) == "reference"   # auto on CPU tensors
    if backend_mod.why_unavailable("triton", torch.device("cpu")) is None:
        monkeypatch.setenv("QWEN_OPS_BACKEND", "Triton ")                  # case and blanks ignored
        torch.ops.qwen.slot_attention(*case.args())
        assert len(spy_reference) == 1 and qwen_ops.resolve_backend(torch.device("cpu")) == "triton"


def test_set_backend_and_use_backend(monkeypatch, spy_reference):
    monkeypatch.setenv("QWEN_OPS_BACKEND", "cuda")   # overridden below, never consulted
    case = make_attention_case("decode", dtype=torch.float32, device="cpu")
    with qwen_ops.use_backend("reference"):
        assert qwen_ops.get_backend() == "reference"
        torch.ops.qwen.slot_attention(*case.args())
    assert qwen_ops.get_backend() == "cuda" and len(spy_reference) == 1
    qwen_ops.set_backend("reference")
    try:
        assert qwen_ops.get_backend() == "reference"
        torch.ops.qwen.slot_attention(*case.args())
        assert len(spy_reference) == 2
    finally:
        qwen_ops.set_backend(None)
    assert qwen_ops.get_backend() == "cuda"


def test_explicit_unavailable_backend_raises(monkeypatch):
    case = make_attention_case("decode", dtype=torch.float32, device="cpu")
    with qwen_ops.use_backend("cuda"), pytest.raises(RuntimeError, match="'cuda' is unavailable.*CUDA tensors"):
        torch.ops.qwen.slot_attention(*case.args())
    monkeypatch.setenv("TRITON_INTERPRET", "0")      # triton on CPU tensors needs the interpreter
    with qwen_ops.use_backend("triton"), pytest.raises(RuntimeError, match="'triton' is unavailable"):
        torch.ops.qwen.slot_attention(*case.args())


def test_bad_backend_name_raises(monkeypatch):
    with pytest.raises(ValueError, match="backend = 'tpu'"):
        qwen_ops.set_backend("tpu")
    with pytest.raises(ValueError, match="backend = 'tpu'"):
        with qwen_ops.use_backend("tpu"):
            pass
    monkeypatch.setenv("QWEN_OPS_BACKEND", "tpu")
    case = make_attention_case("decode", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="QWEN_OPS_BACKEND = 'tpu'"):
        torch.ops.qwen.slot_attention(*case.args())


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------

class ToyAttentionBlock(torch.nn.Module):
    """A decoder block's attention: project, write K/V into the cache buffers, attend, project."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv = torch.nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim)
        self.out = torch.nn.Linear(num_heads * head_dim, hidden)
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.register_buffer("key_cache", torch.randn(cache_shape))     # junk until written
        self.register_buffer("value_cache", torch.randn(cache_shape))

    def forward(self, x, slot_ids, positions, block_table, seq_slots, query_start_loc, seq_lens,
                max_query_len: int):
        # x [T, hidden] -> q [T, H, D], k/v [T, KVH, D] as strided views of one projection
        qkv = self.qkv(x).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        torch.ops.qwen.kv_write(k, v, self.key_cache, self.value_cache, slot_ids, positions, block_table)
        o = torch.ops.qwen.slot_attention(q, self.key_cache, self.value_cache, block_table, seq_slots,
                                          query_start_loc, seq_lens, self.head_dim ** -0.5, max_query_len)
        return self.out(o.flatten(1))


def _toy_steps(device):
    """Two steps on slots 2 and 0 (+ a padding token/sequence): a mixed prefill, then a decode."""
    i32 = dict(dtype=torch.int32, device=device)
    block_table = torch.tensor([[3, 1, 5], [0, 7, 2], [6, 4, 8]], **i32)   # block_size 4: 12 positions
    prefill = dict(slot_ids=[2, 2, 2, 2, 2, 0, 0, -1], positions=[0, 1, 2, 3, 4, 0, 1, 0],
                   seq_slots=[2, 0, -1], query_start_loc=[0, 5, 7, 8], seq_lens=[5, 2, 0], max_query_len=5)
    decode = dict(slot_ids=[2, -1, 0], positions=[5, 0, 2], seq_slots=[2, -1, 0], query_start_loc=[0, 1, 2, 3],
                  seq_lens=[6, 0, 3], max_query_len=1)
    steps = []
    for step in (prefill, decode):
        t = {k: torch.tensor(v, **i32) for k, v in step.items() if k != "max_query_len"}
        steps.append((t["slot_ids"], t["positions"], block_table, t["seq_slots"], t["query_start_loc"],
                      t["seq_lens"], step["max_query_len"]))
    return steps


def available_backends(device: torch.device) -> list[str]:
    def ok(name):
        try:
            return backend_mod.why_unavailable(name, device) is None
        except ImportError:
            return False
    return [name for name in ("reference", "triton", "cuda") if ok(name)]


def test_compile_fullgraph_matches_eager(device):
    """One compiled graph (backend chosen inside the op at run time) matches eager on every backend."""
    torch.manual_seed(40)
    eager = ToyAttentionBlock(hidden=32, num_heads=4, num_kv_heads=2, head_dim=16, num_blocks=9,
                              block_size=4).to(device).requires_grad_(False)   # inference, as the engine runs it
    initial = (eager.key_cache.clone(), eager.value_cache.clone())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for name in available_backends(device):
        for m in (eager, model):
            m.key_cache.copy_(initial[0])
            m.value_cache.copy_(initial[1])
        with qwen_ops.use_backend(name):
            for step in _toy_steps(device):
                x = torch.randn(step[0].shape[0], 32, device=device)
                torch.testing.assert_close(compiled(x, *step), eager(x, *step), atol=1e-5, rtol=1e-5)
        assert torch.equal(model.key_cache, eager.key_cache), f"{name}: cache not written in place"
        assert torch.equal(model.value_cache, eager.value_cache)
        assert not torch.equal(model.key_cache, initial[0])
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


# --------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------

def test_cuda_graph_decode(backend, cuda_device):
    """kv_write + decode attention captured once, replayed with other padding, positions and lengths."""
    if backend == "reference":
        pytest.skip("the reference reads index values on the host, so it cannot be captured")
    case = make_attention_case("decode", dtype=torch.bfloat16, device=cuda_device, layout="contiguous", seed=50)
    num_kv_heads, head_dim = case.key_cache.shape[2:]
    key = torch.randn(len(case.seqs), num_kv_heads, head_dim, device=cuda_device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slot_ids, seq_slots, seq_lens = case.seq_slots.clone(), case.seq_slots.clone(), case.seq_lens.clone()
    positions = (seq_lens - 1).clamp(min=0)
    caches = (case.key_cache.clone(), case.value_cache.clone())
    ref_caches = (case.key_cache.clone(), case.value_cache.clone())

    def step(kv_write, attention, kv):
        kv_write(key, value, *kv, slot_ids, positions, case.block_table)
        return attention(case.query, *kv, case.block_table, seq_slots, case.query_start_loc, seq_lens, case.scale,
                         1, case.gate)

    with qwen_ops.use_backend(backend):
        step(torch.ops.qwen.kv_write, torch.ops.qwen.slot_attention, caches)   # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(torch.ops.qwen.kv_write, torch.ops.qwen.slot_attention, caches)
    step(kv_write_reference, slot_attention_reference, ref_caches)              # the warm-up write
    # decode scenario: slots [2, -1, 0, 3] holding [5, -, 18, 1] tokens; then fewer tokens and more padding
    for slots, lens in (([2, -1, 0, 3], [5, 5, 18, 1]), ([2, -1, -1, 3], [3, 5, 5, 1])):
        for t, values in ((slot_ids, slots), (seq_slots, slots), (seq_lens, lens)):
            t.copy_(torch.tensor(values, dtype=torch.int32))
        positions.copy_((seq_lens - 1).clamp(min=0))
        graph.replay()
        expected = step(kv_write_reference, slot_attention_reference, ref_caches)
        assert_attention_close(out, expected, torch.bfloat16)
        torch.testing.assert_close(caches, ref_caches, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES, ids=_ids)
def test_long_context_gpu(backend, dtype, cuda_device):
    """Realistic sizes on a GPU: 8 sequences of up to 4000 tokens, block size 16, GQA 4, head_dim 128."""
    gen = torch.Generator().manual_seed(51)
    num_seqs, kvh, group, hd, bs = 8, 4, 4, 128, 16
    context = torch.randint(1000, 3800, (num_seqs,), generator=gen)   # + 200 <= 4096
    blocks_per_slot = 4096 // bs
    table = torch.randperm(num_seqs * blocks_per_slot, generator=gen).view(num_seqs, blocks_per_slot)
    key_cache = torch.randn(num_seqs * blocks_per_slot, bs, kvh, hd, device=cuda_device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    i32 = dict(dtype=torch.int32, device=cuda_device)
    for q_len in (1, 200):
        seq_lens = (context + q_len).to(**i32)
        qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, **i32)
        query = torch.randn(num_seqs * q_len, kvh * group, hd, device=cuda_device, dtype=dtype)
        args = (query, key_cache, value_cache, table.to(**i32), torch.arange(num_seqs, **i32), qsl, seq_lens,
                hd ** -0.5, q_len, None)
        out = run_op(backend, torch.ops.qwen.slot_attention, *args)
        assert_attention_close(out, slot_attention_reference(*args), dtype, msg=f"q_len {q_len}")
