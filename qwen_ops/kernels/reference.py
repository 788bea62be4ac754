"""Reference kernels: plain torch, the specification of torch.ops.qwen.* and the test oracle.

Layouts (DESIGN.md section 3):
  key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_table             int32 [max_slots, max_blocks_per_slot]; slot s, position p lives in
                          block block_table[s, p // block_size], row p % block_size.
"""

from __future__ import annotations

from typing import Optional

import torch


def kv_write_reference(key, value, key_cache, value_cache, slot_ids, positions, block_table) -> None:
    """Write token i's key/value to slot slot_ids[i] at positions[i]; slot -1 writes nothing."""
    live = slot_ids >= 0
    slots = slot_ids[live].long()
    pos = positions[live].long()
    block_size = key_cache.shape[1]
    blocks = block_table[slots, pos // block_size].long()
    rows = pos % block_size
    key_cache[blocks, rows] = key[live]
    value_cache[blocks, rows] = value[live]


def _attend(query, out, key_cache, value_cache, block_table, slots, starts, q_lens, seq_lens, scale, gate):
    """Causal attention for a group of sequences, padded to the longest query and context.

    slots, starts, q_lens, seq_lens: int64 CPU-or-device tensors [S]. Query row j of a sequence
    with q query tokens and seq_len keys sits at position seq_len - q + j and sees keys <= that.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    device = query.device
    S = slots.shape[0]
    Q = int(q_lens.max())
    L = int(seq_lens.max())
    n_blocks = (L + block_size - 1) // block_size

    # Keys/values of every sequence, gathered block by block: [S, L, kv_heads, head_dim] in fp32.
    # Block ids past a sequence's length may be junk; clamp them and mask those keys out below.
    blocks = block_table[slots, :n_blocks].long().clamp(0, key_cache.shape[0] - 1)
    k = key_cache[blocks].reshape(S, n_blocks * block_size, num_kv_heads, head_dim)[:, :L].float()
    v = value_cache[blocks].reshape(S, n_blocks * block_size, num_kv_heads, head_dim)[:, :L].float()
    # Zero the values past each seq_len: a masked probability is 0, but 0 * NaN junk is NaN.
    key_valid = torch.arange(L, device=device)[None, :] < seq_lens[:, None]          # [S, L]
    v = v.masked_fill(~key_valid[:, :, None, None], 0.0)

    # Query rows padded to Q per sequence: [S, Q, kv_heads, group, head_dim].
    j = torch.arange(Q, device=device)
    row_ok = j[None, :] < q_lens[:, None]                       # [S, Q]
    rows = (starts[:, None] + j[None, :]).clamp(max=max(query.shape[0] - 1, 0))
    q = query[rows].float().view(S, Q, num_kv_heads, group, head_dim)

    scores = torch.einsum("sqhgd,skhd->shgqk", q, k) * scale   # fp32 [S, kvh, g, Q, L]
    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]           # [S, Q]
    visible = torch.arange(L, device=device)[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("shgqk,skhd->sqhgd", probs, v).reshape(S, Q, num_heads, head_dim)
    if gate is not None:
        o = o * torch.sigmoid(gate[rows].float())
    out[rows[row_ok]] = o[row_ok].to(out.dtype)


def slot_attention_reference(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                             seq_lens, scale: float, max_query_len: int,
                             gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal GQA attention of each sequence's query rows over its slot's cached keys.

    Returns [num_tokens, num_heads, head_dim] in query.dtype; rows of padding sequences
    (seq_slots == -1) are zero. Softmax is accumulated in fp32.
    """
    out = torch.zeros_like(query)
    starts = query_start_loc[:-1].long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    live = (seq_slots >= 0) & (q_lens > 0)
    # Decode rows (one query token) are attended in one padded batch; longer queries one
    # sequence at a time, so a long prefill never pads the whole batch to its length.
    single = live & (q_lens == 1)
    groups = []
    if bool(single.any()):
        groups.append(single.nonzero().flatten())
    groups += [i.view(1) for i in (live & (q_lens > 1)).nonzero().flatten()]
    for idx in groups:
        _attend(query, out, key_cache, value_cache, block_table, seq_slots[idx].long(), starts[idx],
                q_lens[idx], seq_lens[idx].long(), scale, gate)
    return out
