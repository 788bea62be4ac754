"""Triton kernels of torch.ops.qwen.kv_write and torch.ops.qwen.slot_attention (DESIGN.md section 3).

Layouts (validated before these launchers run):
  key, value              [num_tokens, num_kv_heads, head_dim]
  key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_table             int32 [max_slots, max_blocks_per_slot]; slot s, position p lives in block
                          block_table[s, p // block_size], row p % block_size (any block_size >= 1)
  query, gate, output     [num_tokens, num_heads, head_dim]

Every float tensor may be a strided view: the kernels take the strides of all dimensions but the
last, which validation guarantees is contiguous. The small 1-D index tensors are made contiguous
(a no-op in the usual case).

Attention kernels:
  * ``_slot_attention_decode_kernel`` (max_query_len == 1): flash-decoding. One program per
    (sequence, kv head, split); the query heads of one kv head form the rows of one tile. The
    number of splits comes from static shapes only (never from device values), so the launch is
    CUDA-graph capturable. With several splits each program writes fp32 partial max / sum / acc
    and ``_merge_kernel`` combines them.
  * ``_slot_attention_prefill_kernel`` (prefill, chunked prefill, mixed batches): a tile of
    BLOCK_Q query tokens x GROUP query heads per program, programs numbered over the whole
    batch (query block b of sequence s has id ``query_start_loc[s] // BLOCK_Q + s + b``; a
    binary search finds s), online softmax in fp32 over key tiles gathered through the block
    table, causal by absolute position ``seq_len - q_len + j``.

The output is allocated with ``torch.zeros``: rows of padding sequences (slot -1) and rows no
sequence covers are never written and stay zero. Block-table entries past a sequence's last
used block are never loaded, and neither are cache rows at positions >= seq_len.

Under ``TRITON_INTERPRET=1`` (CPU tensors) ``tl.dot`` on bf16 returns garbage, so the kernels
upcast q/k/v to fp32 after loading when the ``UPCAST`` constexpr is set (interpreter + bf16).

The launch plans (``kv_write_launches``, ``slot_attention_launches``) are shared with
``.ci/compile_triton_sm90.py``, which compiles exactly these kernel configurations for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from qwen_ops.ops.kernels import triton_interpret
from qwen_ops.ops.kernels.triton_common import Launch, _find_sequence

# Flash-decoding: aim for this many programs in flight (about 4 per SM of an H100/H200, 132 SMs),
# give every split at least MIN_KEY_TILES_PER_SPLIT key tiles and never more than MAX_SPLITS splits.
TARGET_DECODE_PROGRAMS = 528
MIN_KEY_TILES_PER_SPLIT = 4
MAX_SPLITS = 16
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

# fp8 caches (FP8 constexpr: 0 none, 1 float8_e4m3fn, 2 float8_e5m2) are passed as uint8 views and
# converted in integer arithmetic (no fp8 conversion instructions needed; the interpreter runs it).

@triton.jit
def _fp8_to_f32(b, FP8: tl.constexpr):
    """uint8 codes -> fp32, exactly: the byte moved into an fp16's bit pattern (e4m3's exponent is 8
    below fp16's: times 2^8), subnormals included."""
    b = b.to(tl.uint16)
    if FP8 == 2:
        h = b << 8
        return h.to(tl.float16, bitcast=True).to(tl.float32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _f32_to_fp8(x, FP8: tl.constexpr):
    """fp32 -> uint8 codes, round to nearest even, saturated at the largest finite value; NaN stays NaN.
    Below the smallest normal: a power-of-two scaling rounded by adding and removing 2^23."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    af = tl.minimum(a.to(tl.float32, bitcast=True), 1.0)    # the subnormal branch's input (others masked)
    if FP8 == 2:
        sub = ((af * 65536.0 + 8388608.0) - 8388608.0).to(tl.uint32)
        normal = ((a + 0xFFFFF + ((a >> 21) & 1)) >> 21) - (112 << 2)
        code = tl.where(a < 0x38800000, sub, normal)
        code = tl.where(a >= 0x47600000, 0x7B, code)
    else:
        sub = ((af * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        code = tl.where(a < 0x3C800000, sub, normal)
        code = tl.where(a >= 0x43E00000, 0x7E, code)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (sign | code).to(tl.uint8)


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ids_ptr, positions_ptr, block_table_ptr,
    k_scale_ptr, v_scale_ptr,                                         # fp8 caches only
    stride_kt, stride_kh, stride_vt, stride_vh,                      # key / value [T, KVH, D]
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,  # caches [NB, BS, KVH, D]
    stride_bts, stride_btb,                                           # block_table [slots, blocks]
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    # One program per token; it copies all kv heads of the token (a [BLOCK_H, BLOCK_D] tile).
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ids_ptr + tok)
    if slot < 0:  # padding token: write nothing
        return
    pos = tl.load(positions_ptr + tok)
    block = tl.load(block_table_ptr + slot.to(tl.int64) * stride_bts + (pos // block_size) * stride_btb)
    row = pos % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = key_cache_ptr + block.to(tl.int64) * stride_kcb + row * stride_kcs
    vc = value_cache_ptr + block.to(tl.int64) * stride_vcb + row * stride_vcs
    if FP8 != 0:
        k = _f32_to_fp8(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), FP8)
        v = _f32_to_fp8(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), FP8)
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, bt_row_ptr, stride_btb,
                 stride_kb, stride_ks, stride_vb, stride_vs, k_head_off, v_head_off,
                 start_n, kv_end, q_pos, block_size, qk_scale, offs_d,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step over key positions [start_n, start_n + BLOCK_N) ∩ [0, kv_end).

    q [M, BLOCK_D]; m_i, l_i [M] fp32 (log2 domain); acc [M, BLOCK_D] fp32; q_pos [M] absolute
    positions of the query rows: row m sees keys at positions <= q_pos[m] (causal).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < kv_end
    # Physical block of every key position; entries past the sequence's blocks are not loaded.
    block = tl.load(bt_row_ptr + (offs_n // block_size) * stride_btb, mask=key_ok, other=0).to(tl.int64)
    row = offs_n % block_size
    kv_mask = key_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_cache_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks + k_head_off
                + offs_d[None, :], mask=kv_mask, other=0)
    v = tl.load(value_cache_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs + v_head_off
                + offs_d[None, :], mask=kv_mask, other=0)
    if FP8 != 0:   # widened exactly to q's dtype; the scales are in qk_scale and applied to the output
        k = _fp8_to_f32(k, FP8).to(q.dtype)
        v = _fp8_to_f32(v, FP8).to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale          # [M, BLOCK_N] fp32
    visible = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no visible key yet keep m = -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _slot_attention_decode_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_slots_ptr, query_start_loc_ptr,
    seq_lens_ptr, gate_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,                                                         # scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_gt, stride_gh,  # [T, H, D] tensors
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,  # caches [NB, BS, KVH, D]
    stride_bts, stride_btb,                                           # block_table
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    # Program (seq, kv head, split): the GROUP query heads of one kv head over one key range.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(seq_slots_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (slot < 0) | (q_len <= 0):  # padding sequence, or no query row: the output stays zero
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    tok = q_start.to(tl.int64)
    q = tl.load(query_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=row_mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # This split's key range; its length is a whole number of tiles. Later splits may be empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + slot.to(tl.int64) * stride_bts
    if FP8 != 0:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    for start_n in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, bt_row, stride_btb,
                                     stride_kb, stride_ks, stride_vb, stride_vs, kvh * stride_kh,
                                     kvh * stride_vh, start_n, end, q_pos, block_size, qk_scale, offs_d,
                                     HEAD_DIM, BLOCK_N, UPCAST, FP8)
    if FP8 != 0:
        acc = acc * tl.load(v_scale_ptr)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if HAS_GATE:
            g = tl.load(gate_ptr + tok * stride_gt + heads[:, None] * stride_gh + offs_d[None, :], mask=row_mask,
                        other=0.0)
            out = out * tl.sigmoid(g.to(tl.float32))
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # Partials [num_seqs, num_kv_heads, NUM_SPLITS, GROUP(, HEAD_DIM)] fp32, contiguous.
        base = ((seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * GROUP
        g_mask = offs_g < GROUP
        tl.store(part_m_ptr + base + offs_g, m_i, mask=g_mask)
        tl.store(part_l_ptr + base + offs_g, l_i, mask=g_mask)
        tl.store(part_acc_ptr + (base + offs_g[:, None]) * HEAD_DIM + offs_d[None, :], acc, mask=row_mask)


@triton.jit
def _merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, seq_slots_ptr, query_start_loc_ptr, gate_ptr,
    stride_ot, stride_oh, stride_gt, stride_gh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr,
):
    # Program (seq, kv head): combine the NUM_SPLITS partial softmax states of GROUP query heads.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(seq_slots_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (slot < 0) | (q_len <= 0):  # the decode kernel wrote no partials for this sequence
        return
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    row_mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        base = ((seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * GROUP
        m_s = tl.load(part_m_ptr + base + offs_g, mask=g_mask, other=float("-inf"))
        l_s = tl.load(part_l_ptr + base + offs_g, mask=g_mask, other=0.0)
        acc_s = tl.load(part_acc_ptr + (base + offs_g[:, None]) * HEAD_DIM + offs_d[None, :], mask=row_mask,
                        other=0.0)
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.math.exp2(m - m_safe)
        b = tl.math.exp2(m_s - m_safe)
        l_sum = l_sum * a + l_s * b
        acc = acc * a[:, None] + acc_s * b[:, None]
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    heads = kvh * GROUP + offs_g
    tok = q_start.to(tl.int64)
    if HAS_GATE:
        g = tl.load(gate_ptr + tok * stride_gt + heads[:, None] * stride_gh + offs_d[None, :], mask=row_mask,
                    other=0.0)
        out = out * tl.sigmoid(g.to(tl.float32))
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _slot_attention_prefill_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_slots_ptr, query_start_loc_ptr,
    seq_lens_ptr, gate_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_gt, stride_gh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bts, stride_btb,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GATE: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    # Program (query block id, kv head). Tile rows m = (query token m // GROUP, head m % GROUP).
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence s owns block ids [query_start_loc[s] // BLOCK_Q + s, query_start_loc[s+1] // BLOCK_Q + s + 1).
    seq = _find_sequence(query_start_loc_ptr, qb, num_seqs, BLOCK_Q)
    slot = tl.load(seq_slots_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = qb - (q_start // BLOCK_Q + seq)
    if (slot < 0) | (local * BLOCK_Q >= q_len):  # padding sequence or spare id: rows stay zero
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tok = local * BLOCK_Q + offs_m // GROUP                       # token index inside the sequence
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_tok < q_len)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    tok = (q_start + q_tok).to(tl.int64)
    q = tl.load(query_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = seq_len - q_len + q_tok                                 # absolute position of each row

    # Keys up to the last row's position (causal): [0, seq_len - q_len + min(q_len, (local+1)*BLOCK_Q)).
    kv_end = seq_len - q_len + tl.minimum(q_len, (local + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + slot.to(tl.int64) * stride_bts
    if FP8 != 0:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    for start_n in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, bt_row, stride_btb,
                                     stride_kb, stride_ks, stride_vb, stride_vs, kvh * stride_kh,
                                     kvh * stride_vh, start_n, kv_end, q_pos, block_size, qk_scale, offs_d,
                                     HEAD_DIM, BLOCK_N, UPCAST, FP8)
    if FP8 != 0:
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if HAS_GATE:
        g = tl.load(gate_ptr + tok[:, None] * stride_gt + heads[:, None] * stride_gh + offs_d[None, :], mask=mask,
                    other=0.0)
        out = out * tl.sigmoid(g.to(tl.float32))
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Configurations (static shapes only) and launch plans
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeConfig:
    block_g: int      # query-head rows of a tile (>= 16 for tl.dot)
    block_d: int
    block_n: int      # key positions per tile
    num_splits: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int      # tile rows = block_q query tokens x GROUP heads (+ padding rows)
    block_q: int
    block_d: int
    block_n: int
    num_warps: int
    num_stages: int


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def decode_config(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, capacity: int,
                  dtype: torch.dtype, interpret: bool) -> DecodeConfig:
    """Tiles and split count for the decode kernel; ``capacity`` = positions a slot can hold."""
    block_d = _block_d(head_dim)
    if interpret:
        block_n, num_warps, num_stages = 16, 4, 1
    else:
        block_n = 64 if block_d <= 128 else 32
        num_warps = 4 if block_d <= 128 else 8
        num_stages = 2 if (block_d >= 256 and dtype == torch.float32) else 3
    max_useful = triton.cdiv(capacity, block_n * MIN_KEY_TILES_PER_SPLIT)
    wanted = triton.cdiv(TARGET_DECODE_PROGRAMS, max(1, num_seqs * num_kv_heads))
    num_splits = max(1, min(MAX_SPLITS, max_useful, wanted))
    return DecodeConfig(max(16, triton.next_power_of_2(group)), block_d, block_n, num_splits, num_warps,
                        num_stages)


def prefill_config(group: int, head_dim: int, dtype: torch.dtype, interpret: bool) -> PrefillConfig:
    block_d = _block_d(head_dim)
    if interpret:
        block_m, block_n, num_warps, num_stages = 16, 16, 4, 1
    elif block_d <= 128:
        block_m, block_n, num_warps, num_stages = 64, 64, 4, 3
    else:
        block_m, block_n, num_warps = 64, 32, 8
        num_stages = 2 if dtype == torch.float32 else 3
    block_m = max(block_m, triton.next_power_of_2(group))
    return PrefillConfig(block_m, block_m // group, block_d, block_n, num_warps, num_stages)


_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def _fp8_args(key_cache, value_cache, k_scale, v_scale):
    """(FP8 code, key cache, value cache, k_scale, v_scale) for the kernels: fp8 caches as uint8 views
    and their scales as one-element fp32 tensors (ones where None); else the caches and unread stand-ins."""
    code = _FP8_CODES.get(key_cache.dtype, 0)
    if code == 0:
        return 0, key_cache, value_cache, key_cache, key_cache
    ones = None
    if k_scale is None or v_scale is None:
        ones = torch.ones(1, dtype=torch.float32, device=key_cache.device)
    return (code, key_cache.view(torch.uint8), value_cache.view(torch.uint8),
            ones if k_scale is None else k_scale.reshape(1), ones if v_scale is None else v_scale.reshape(1))


def kv_write_launches(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                      v_scale=None) -> list[Launch]:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return []
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    fp8, key_cache, value_cache, k_scale, v_scale = _fp8_args(key_cache, value_cache, k_scale, v_scale)
    args = (key, value, key_cache, value_cache, slot_ids.contiguous(), positions.contiguous(), block_table,
            k_scale, v_scale, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *key_cache.stride()[:3], *value_cache.stride()[:3], *block_table.stride(),
            key_cache.shape[1])
    constexprs = (("NUM_KV_HEADS", num_kv_heads), ("HEAD_DIM", head_dim), ("BLOCK_H", block_h),
                  ("BLOCK_D", block_d), ("FP8", fp8))
    num_warps = 1 if block_h * block_d <= 512 else 4
    return [Launch(_kv_write_kernel, (num_tokens,), args, constexprs, num_warps=num_warps, num_stages=1)]


def slot_attention_launches(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                            scale: float, max_query_len: int, gate: Optional[torch.Tensor], out: torch.Tensor,
                            interpret: bool, k_scale: Optional[torch.Tensor] = None,
                            v_scale: Optional[torch.Tensor] = None) -> list[Launch]:
    """The launches that fill ``out`` (zeros on entry, [num_tokens, num_heads, head_dim])."""
    fp8, key_cache, value_cache, k_scale, v_scale = _fp8_args(key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return []
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    upcast = interpret and query.dtype == torch.bfloat16
    seq_slots, query_start_loc, seq_lens = (t.contiguous() for t in (seq_slots, query_start_loc, seq_lens))
    has_gate = gate is not None
    gate_t = gate if has_gate else query          # never read when HAS_GATE is False
    tensor_strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                      gate_t.stride(0), gate_t.stride(1),
                      *key_cache.stride()[:3], *value_cache.stride()[:3], *block_table.stride(),
                      key_cache.shape[1])
    qk_scale = float(scale) * LOG2E

    if max_query_len == 1:
        capacity = block_table.shape[1] * key_cache.shape[1]
        cfg = decode_config(num_seqs, num_kv_heads, group, head_dim, capacity, query.dtype, interpret)
        if cfg.num_splits > 1:
            part = (num_seqs, num_kv_heads, cfg.num_splits, group)
            part_m = torch.empty(part, dtype=torch.float32, device=query.device)
            part_l = torch.empty(part, dtype=torch.float32, device=query.device)
            part_acc = torch.empty(part + (head_dim,), dtype=torch.float32, device=query.device)
        else:
            part_m = part_l = part_acc = out      # unused with one split
        common = (("GROUP", group), ("HEAD_DIM", head_dim), ("BLOCK_G", cfg.block_g), ("BLOCK_D", cfg.block_d))
        launches = [Launch(
            _slot_attention_decode_kernel, (num_seqs, num_kv_heads, cfg.num_splits),
            (out, part_m, part_l, part_acc, query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
             seq_lens, gate_t, k_scale, v_scale, qk_scale, *tensor_strides),
            common + (("BLOCK_N", cfg.block_n), ("NUM_SPLITS", cfg.num_splits), ("HAS_GATE", has_gate),
                      ("UPCAST", upcast), ("FP8", fp8)),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)]
        if cfg.num_splits > 1:
            launches.append(Launch(
                _merge_kernel, (num_seqs, num_kv_heads),
                (out, part_m, part_l, part_acc, seq_slots, query_start_loc, gate_t,
                 out.stride(0), out.stride(1), gate_t.stride(0), gate_t.stride(1)),
                common + (("NUM_SPLITS", cfg.num_splits), ("HAS_GATE", has_gate)),
                num_warps=4, num_stages=1))
        return launches

    cfg = prefill_config(group, head_dim, query.dtype, interpret)
    # Upper bound of sum over sequences of cdiv(q_len, BLOCK_Q); spare ids exit at once.
    num_q_blocks = num_tokens // cfg.block_q + num_seqs
    return [Launch(
        _slot_attention_prefill_kernel, (num_q_blocks, num_kv_heads),
        (out, query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens, gate_t,
         k_scale, v_scale, qk_scale, num_seqs, *tensor_strides),
        (("GROUP", group), ("HEAD_DIM", head_dim), ("BLOCK_M", cfg.block_m), ("BLOCK_Q", cfg.block_q),
         ("BLOCK_D", cfg.block_d), ("BLOCK_N", cfg.block_n), ("HAS_GATE", has_gate), ("UPCAST", upcast),
         ("FP8", fp8)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)]


# --------------------------------------------------------------------------------------------
# Launchers called by qwen_ops.ops.backend (arguments already validated)
# --------------------------------------------------------------------------------------------

def kv_write_triton(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                    v_scale=None) -> None:
    """Write token i's key/value to slot slot_ids[i] at positions[i]; slot -1 writes nothing."""
    for launch in kv_write_launches(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale,
                                    v_scale):
        launch.run()


def slot_attention_triton(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                          scale: float, max_query_len: int, gate: Optional[torch.Tensor] = None,
                          k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """Causal GQA attention over the paged cache; [num_tokens, num_heads, head_dim] in query.dtype."""
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    for launch in slot_attention_launches(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                                          seq_lens, scale, max_query_len, gate, out, triton_interpret(), k_scale,
                                          v_scale):
        launch.run()
    return out


# --------------------------------------------------------------------------------------------
# The hybrid models' slot-state ops and the MoE op live in their own modules; this backend module
# names them too (backend.kernels("triton") is where the registry looks).
# --------------------------------------------------------------------------------------------

from qwen_ops.ops.kernels.triton_gated_delta import causal_conv1d_triton, gated_delta_rule_triton  # noqa: E402,F401
from qwen_ops.ops.kernels.triton_moe import fused_moe_triton  # noqa: E402,F401
