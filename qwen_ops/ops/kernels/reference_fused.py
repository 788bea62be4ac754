"""Plain-torch references (the specification and test oracle) of the CPU fast path's ops:
linear_packed (and the panel layout it reads), rms_norm, add_rms_norm, qk_norm_rope, silu_mul and
moe_packed. They compute what the model's torch layers compute (qwen_ops/models/layers.py, moe.py),
with the same roundings: norms and RoPE in fp32 with casts back to the input dtype at the same
points, products accumulated in fp32 and rounded once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from qwen_ops.ops.kernels.reference_moe import fused_moe_reference

PANEL = 32   # output features per packed panel


def pack_panels_reference(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` in the layout of ``cpu.pack_panels``: fp32 ``[P, K, 32]`` with
    ``packed[p, k, j] = weight[32 p + j, k]``; bf16 ``[P, ceil(K / 2), 32, 2]`` with
    ``packed[p, kk, j, e] = weight[32 p + j, 2 kk + e]``; zeros past N and K."""
    n, k = weight.shape
    p = (n + PANEL - 1) // PANEL
    if weight.dtype == torch.bfloat16:
        k2 = (k + 1) // 2
        w = weight.new_zeros((p * PANEL, 2 * k2))
        w[:n, :k] = weight
        return w.view(p, PANEL, k2, 2).permute(0, 2, 1, 3).contiguous()
    w = weight.new_zeros((p * PANEL, k))
    w[:n] = weight
    return w.view(p, PANEL, k).permute(0, 2, 1).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight that ``packed`` holds."""
    if packed.dim() == 4:    # bf16 pairs
        p, k2 = packed.shape[:2]
        return packed.permute(0, 2, 1, 3).reshape(p * PANEL, 2 * k2)[:out_features, :in_features]
    p, k = packed.shape[:2]
    return packed.permute(0, 2, 1).reshape(p * PANEL, k)[:out_features, :in_features]


def linear_packed_reference(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                            out_features: int) -> torch.Tensor:
    w = unpack_panels(packed, out_features, x.shape[1])
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                           k_weight: Optional[torch.Tensor], eps: float, cos_sin: torch.Tensor,
                           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.index_select(cos_sin, 0, positions.long()).to(q.dtype)
    half = table.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    if q_weight is not None:
        q = rms_norm_reference(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm_reference(k, k_weight, eps)
    return _rope(q, cos, sin).contiguous(), _rope(k, cos, sin).contiguous()


def attention_block_reference(qkv, q_weight, k_weight, eps, cos_sin, positions, key_cache, value_cache, slot_ids,
                              block_table, seq_slots, query_start_loc, seq_lens, scale, max_query_len, num_heads,
                              k_scale=None, v_scale=None):
    from qwen_ops.ops.kernels.reference import kv_write_reference, slot_attention_reference

    T = qkv.shape[0]
    nk, D = key_cache.shape[2], key_cache.shape[3]
    q, k, v = qkv.view(T, -1, D).split([num_heads, nk, nk], 1)
    q, k = qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos_sin, positions)
    kv_write_reference(k, v, key_cache, value_cache, slot_ids, positions, block_table, k_scale, v_scale)
    return slot_attention_reference(q, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                                    scale, max_query_len, None, k_scale, v_scale).reshape(T, num_heads * D)


def group_mins_add_reference(y: torch.Tensor, x: torch.Tensor, mins_t: torch.Tensor) -> None:
    """``y += (x summed per group, fp32) @ mins_t`` in place (schema: group_mins_add)."""
    sums = x.float().reshape(x.shape[0], mins_t.shape[0], -1).sum(-1)
    y.copy_((y.float() + sums @ mins_t.float()).to(y.dtype))


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_silu_mul_packed_reference(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                                     out_features: int) -> torch.Tensor:
    return silu_mul_reference(linear_packed_reference(x, packed, bias, out_features))


def moe_packed_reference(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    hidden, inter = hidden_states.shape[1], w2.shape[2]
    w13_full = torch.stack([unpack_panels(w, 2 * inter, hidden) for w in w13])
    w2_full = torch.stack([unpack_panels(w, hidden, inter) for w in w2])
    return fused_moe_reference(hidden_states, w13_full, w2_full, topk_weights, topk_ids)
