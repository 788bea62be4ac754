"""Reference and cpu kernels of torch.ops.qwen.fused_moe (mixture-of-experts expert computation).

Layouts (validated before these run):
  hidden_states  [num_tokens, hidden]                    x
  w13            [num_experts, 2 * inter, hidden]        gate rows, then up rows (transformers' gate_up_proj)
  w2             [num_experts, hidden, inter]            down projection (transformers' down_proj)
  topk_weights   [num_tokens, top_k]  float              routing weight of each choice
  topk_ids       [num_tokens, top_k]  int32              expert of each choice

``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t]))`` with
``e = topk_ids[t, j]``, returned in hidden_states' dtype.

* ``fused_moe_reference`` is the specification: every product in fp32 (inputs upcast), one expert
  at a time, the weighted sum accumulated in fp32 and rounded once to the output dtype.
* ``fused_moe_cpu`` groups the (token, choice) pairs by expert: one stable sort of the expert ids,
  one gather of the rows, then one GEMM per non-empty expert for gate|up and one for down on that
  expert's contiguous run of rows, SiLU * up over all rows at once, and the weighted rows summed
  per token in fp32. The GEMMs run in the input dtype (oneDNN / MKL accumulate in fp32 inside),
  so fp16 / bf16 results carry the roundings of a same-dtype torch computation, not more.
  The per-expert GEMMs are one ``torch.nn.functional.grouped_mm`` call (its CPU kernel loops over
  the groups in C++: no Python loop, no host sync for the group sizes) when the batch has at least
  a quarter as many pairs as experts and the strides suit it (multiples of 16 bytes); otherwise,
  e.g. one decode token over 128 experts, a Python loop over only the non-empty experts is cheaper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_reference(hidden_states, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The specification of fused_moe: plain fp32 torch, one expert at a time."""
    num_tokens, hidden = hidden_states.shape
    inter = w13.shape[1] // 2
    x = hidden_states.float()
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for expert in torch.unique(topk_ids).tolist():
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)   # the pairs routed to this expert
        gate_up = x[token] @ w13[expert].float().t()                   # [n, 2 * inter]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]          # [n, inter]
        y = act @ w2[expert].float().t()                               # [n, hidden]
        out.index_add_(0, token, y * topk_weights[token, choice].float()[:, None])
    return out.to(hidden_states.dtype)


def _grouped_mm_suits(num_pairs: int, num_experts: int, *tensors: torch.Tensor) -> bool:
    """Whether one grouped_mm call beats the loop here, and its CPU kernel takes these strides."""
    if not hasattr(F, "grouped_mm") or 4 * num_pairs < num_experts:
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
            return False
    return True


def fused_moe_cpu(hidden_states, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Tokens grouped by expert: one GEMM per non-empty expert and projection (no per-token loop)."""
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    dtype = hidden_states.dtype
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    num_pairs = num_tokens * top_k
    # Pair p = t * top_k + j. A stable sort keeps each expert's pairs in token order.
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    tokens = torch.div(order, top_k, rounding_mode="floor")
    rows = hidden_states.index_select(0, tokens)                        # [P, hidden], grouped by expert
    grouped = _grouped_mm_suits(num_pairs, num_experts, rows, w13, w2) and (inter * rows.element_size()) % 16 == 0
    if grouped:
        offsets = torch.bincount(sorted_ids, minlength=num_experts).cumsum(0, dtype=torch.int32)
        gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    else:
        experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        groups = list(zip(experts.tolist(), counts.tolist()))
        gate_up = rows.new_empty(num_pairs, 2 * inter)
        start = 0
        for expert, n in groups:
            torch.mm(rows[start:start + n], w13[expert].t(), out=gate_up[start:start + n])
            start += n
    if dtype == torch.float32:
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    else:   # SiLU and the product in fp32, rounded once for the down GEMM
        act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(dtype)
    if grouped:
        y = F.grouped_mm(act, w2.transpose(1, 2), offs=offsets)
    else:
        y = rows.new_empty(num_pairs, hidden)
        start = 0
        for expert, n in groups:
            torch.mm(act[start:start + n], w2[expert].t(), out=y[start:start + n])
            start += n
    weighted = y.float() if dtype != torch.float32 else y
    weighted = weighted.mul_(topk_weights.reshape(-1).index_select(0, order).float()[:, None])
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    out.index_add_(0, tokens, weighted)
    return out.to(dtype)
