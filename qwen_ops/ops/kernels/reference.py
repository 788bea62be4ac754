"""Reference kernels: plain torch, the specification of torch.ops.qwen.* and the test oracle.

Layouts (DESIGN.md section 3):
  key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_table             int32 [max_slots, max_blocks_per_slot]; slot s, position p lives in
                          block block_table[s, p // block_size], row p % block_size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from qwen_ops.ops.kernels.kv_fp8 import dequantize, is_fp8, quantize


def kv_write_reference(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                       v_scale=None) -> None:
    """Write token i's key/value to slot slot_ids[i] at positions[i]; slot -1 writes nothing. An fp8
    cache gets ``kv_quant.quantize(key, k_scale)`` (values by v_scale)."""
    if is_fp8(key_cache.dtype):
        key, value = quantize(key, k_scale, key_cache.dtype), quantize(value, v_scale, value_cache.dtype)
    if not bool((slot_ids >= 0).all()):
        live = slot_ids >= 0
        key, value, slot_ids, positions = key[live], value[live], slot_ids[live], positions[live]
    pos = positions.long()
    block_size = key_cache.shape[1]
    blocks = block_table[slot_ids.long(), pos // block_size].long()
    rows = pos % block_size
    key_cache[blocks, rows] = key
    value_cache[blocks, rows] = value


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` as [S, n_blocks * block_size, kv_heads, head_dim]; blocks: int64 [S, n_blocks].

    (Advanced indexing rather than ``index_select`` on flattened ids: benchmarks/README.md,
    "Measured design choices".)
    """
    S, n_blocks = blocks.shape
    return cache[blocks].view(S, n_blocks * cache.shape[1], cache.shape[2], cache.shape[3])


def _as_float(kv: torch.Tensor, scale) -> torch.Tensor:
    """Gathered cache rows in fp32: an fp8 cache dequantized (``float(q) * scale``)."""
    return dequantize(kv, scale) if is_fp8(kv.dtype) else kv.float()


def _attend(query, out, key_cache, value_cache, block_table, slots, starts, q_lens, seq_lens, scale, gate,
            k_scale=None, v_scale=None):
    """Causal attention for a group of sequences, padded to the longest query and context.

    slots, starts, q_lens, seq_lens: int64 tensors [S]. Query row j of a sequence with q query
    tokens and seq_len keys sits at position seq_len - q + j and sees keys <= that.
    """
    num_kv_heads = key_cache.shape[2]
    num_heads = query.shape[1]
    block_size = key_cache.shape[1]
    device = query.device
    S = slots.shape[0]
    Q = int(q_lens.max())
    L = int(seq_lens.max())
    n_blocks = (L + block_size - 1) // block_size

    # Keys/values of every sequence, gathered block by block: [S, kv_heads, L, head_dim] in fp32.
    # Block ids past a sequence's length may be junk: clamp them, and zero the keys/values past
    # seq_len, because a masked score of NaN junk would still poison the softmax.
    blocks = block_table[slots, :n_blocks].long().clamp(0, key_cache.shape[0] - 1)
    key_valid = (torch.arange(L, device=device)[None, :] < seq_lens[:, None])[:, None, :, None]

    ragged = S > 1 and bool((seq_lens != L).any())   # some sequence has keys past its seq_len

    def gather(cache, kv_scale):
        kv = _as_float(_gather_blocks(cache, blocks)[:, :L], kv_scale).transpose(1, 2)
        return kv.masked_fill(~key_valid, 0.0) if ragged else kv

    k, v = gather(key_cache, k_scale), gather(value_cache, v_scale)

    # Query rows padded to Q per sequence: [S, heads, Q, head_dim].
    j = torch.arange(Q, device=device)
    rows = starts[:, None] + j[None, :]
    if Q > 1:
        row_ok = j[None, :] < q_lens[:, None]                   # [S, Q]
        rows = rows.clamp(max=query.shape[0] - 1)
    q = query[rows].transpose(1, 2).float()

    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]            # [S, Q] absolute positions
    visible = torch.arange(L, device=device)[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    # fp32 inputs, so the softmax is accumulated in fp32 whatever the cache dtype.
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale,
                                       enable_gqa=num_heads != num_kv_heads).transpose(1, 2)  # [S, Q, H, D]
    if gate is not None:
        o = o * torch.sigmoid(gate[rows].float())
    if Q > 1:
        out[rows[row_ok]] = o[row_ok].to(out.dtype)
    else:
        out[rows[:, 0]] = o[:, 0].to(out.dtype)


# Above this many bytes of keys per sequence, decode attends one sequence at a time through one
# reused gather buffer (kept hot in cache; no fresh multi-MB allocation per call); below it the
# batched form wins, as a Python loop over many short sequences costs more (figures:
# benchmarks/README.md, "Measured design choices").
PER_SEQUENCE_KV_BYTES = 256 * 1024


def _decode_attend_per_sequence(query, key_cache, value_cache, blocks, lens, scale, gate, k_scale, v_scale):
    """``_decode_attend`` for long contexts: each sequence's keys exactly (no padding, no mask)."""
    S, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty(S, num_heads, head_dim, dtype=query.dtype, device=query.device)
    k_buf = key_cache.new_empty((blocks.shape[1],) + tuple(key_cache.shape[1:]))
    v_buf = torch.empty_like(k_buf)
    for s, n in enumerate(lens):
        nb = (n + block_size - 1) // block_size
        k = torch.index_select(key_cache, 0, blocks[s, :nb], out=k_buf[:nb])
        v = torch.index_select(value_cache, 0, blocks[s, :nb], out=v_buf[:nb])
        k = _as_float(k.view(1, nb * block_size, num_kv_heads, head_dim)[:, :n], k_scale).transpose(1, 2)
        v = _as_float(v.view(1, nb * block_size, num_kv_heads, head_dim)[:, :n], v_scale).transpose(1, 2)
        o = F.scaled_dot_product_attention(query[s:s + 1, :, None, :].float(), k, v, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)[0, :, 0]   # [H, D] fp32
        if gate is not None:
            o = o * torch.sigmoid(gate[s].float())
        out[s] = o.to(query.dtype)
    return out


def _decode_attend(query, key_cache, value_cache, block_table, seq_slots, seq_lens, scale, gate, k_scale=None,
                   v_scale=None):
    """The pure-decode case (every sequence live, one query row each, rows in sequence order).

    Same math as ``_attend`` with fewer steps: the query rows need no gather, the output no
    scatter, and a single sequence (or equal lengths) needs no key mask.
    """
    S, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    lens = seq_lens.long()
    L = int(lens.max())
    n_blocks = (L + block_size - 1) // block_size
    blocks = block_table.index_select(0, seq_slots.long())[:, :n_blocks].long().clamp_(0, key_cache.shape[0] - 1)
    if S > 1 and L * num_kv_heads * head_dim * key_cache.element_size() >= PER_SEQUENCE_KV_BYTES:
        return _decode_attend_per_sequence(query, key_cache, value_cache, blocks, lens.tolist(), scale, gate,
                                           k_scale, v_scale)
    k = _gather_blocks(key_cache, blocks)[:, :L]     # fresh copies
    v = _gather_blocks(value_cache, blocks)[:, :L]
    if is_fp8(k.dtype):
        k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    mask = None
    if S > 1 and bool((lens != L).any()):
        junk = torch.arange(L, device=query.device)[None, :] >= lens[:, None]           # [S, L]
        # Zero the junk rows in place on the gathered copies (contiguous, before any transpose).
        k.masked_fill_(junk[:, :, None, None], 0.0)
        v.masked_fill_(junk[:, :, None, None], 0.0)
        mask = torch.zeros(S, 1, 1, L, device=query.device).masked_fill_(junk[:, None, None, :], float("-inf"))
    k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
    o = F.scaled_dot_product_attention(query[:, :, None, :].float(), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)[:, :, 0]   # [S, H, D] fp32
    if gate is not None:
        o = o * torch.sigmoid(gate.float())
    return o.to(query.dtype)


def slot_attention_reference(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                             seq_lens, scale: float, max_query_len: int,
                             gate: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
                             v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal GQA attention of each sequence's query rows over its slot's cached keys.

    Returns [num_tokens, num_heads, head_dim] in query.dtype; rows of padding sequences
    (seq_slots == -1) are zero. Softmax is accumulated in fp32. An fp8 cache is read as
    ``float(cache) * k_scale`` / ``* v_scale`` (fp32).
    """
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    q_list, slot_list = q_lens.tolist(), seq_slots.tolist()
    if len(q_list) == query.shape[0] and all(q == 1 for q in q_list) and min(slot_list, default=-1) >= 0:
        return _decode_attend(query, key_cache, value_cache, block_table, seq_slots, seq_lens, scale, gate,
                              k_scale, v_scale)
    # Otherwise decode rows (one query token) are attended in one padded batch and longer
    # queries one sequence at a time, so a long prefill never pads the whole batch to its length.
    out = torch.zeros_like(query)
    starts, slots, lens = query_start_loc[:-1].long(), seq_slots.long(), seq_lens.long()
    single = [i for i, (q, s) in enumerate(zip(q_list, slot_list)) if q == 1 and s >= 0]
    groups = [torch.tensor([i], device=query.device) for i, (q, s) in enumerate(zip(q_list, slot_list))
              if q > 1 and s >= 0]
    if single:
        groups.append(torch.tensor(single, device=query.device))
    for idx in groups:
        _attend(query, out, key_cache, value_cache, block_table, slots[idx], starts[idx], q_lens[idx],
                lens[idx], scale, gate, k_scale, v_scale)
    return out


# The state ops of hybrid models (causal_conv1d, gated_delta_rule) have their reference kernels
# in reference_gated_delta.py; they are re-exported here so every backend module has the same names.
from qwen_ops.ops.kernels.reference_gated_delta import causal_conv1d_reference, gated_delta_rule_reference  # noqa: E402,F401

# fused_moe's reference kernel lives in reference_moe.py, re-exported here like the state ops.
from qwen_ops.ops.kernels.reference_moe import fused_moe_reference  # noqa: E402,F401
