"""Triton kernels of torch.ops.qwen.fused_moe: a grouped GEMM over tokens sorted by expert.

Layouts and semantics are those of ``kernels/reference_moe.py`` (the specification). The shape of
the computation follows vLLM's fused_moe:

1. ``moe_align_block_size`` (torch ops on the device, no host sync): the P = num_tokens * top_k
   (token, choice) pairs are sorted by expert and each expert's run is padded to a multiple of
   BLOCK_M. ``sorted_pairs`` holds pair ids ``t * top_k + j`` (padding rows hold P),
   ``block_experts`` the expert of every BLOCK_M rows, ``num_padded`` the padded total. The buffers
   are sized by the worst case, ``P + min(P, num_experts) * (BLOCK_M - 1)`` rows, so every size
   depends on shapes only and the launches are CUDA-graph capturable; blocks past ``num_padded``
   exit at once.
2. ``_fused_moe_w13_kernel``: program (row block, intermediate block). It gathers BLOCK_M token
   rows of x, multiplies them by the block's expert's gate rows and up rows (two fp32
   accumulators over the hidden dimension), and writes ``silu(gate) * up`` rounded to x's dtype
   into ``act [P, inter]`` at the pair's row.
3. ``_fused_moe_w2_kernel``: program (row block, hidden block): ``act @ w2[e]^T`` in fp32, times the
   pair's routing weight, written in fp32 to ``partial [P, hidden]`` at the pair's row.
4. ``partial.view(num_tokens, top_k, hidden).sum(1)`` in fp32, rounded once to x's dtype. (vLLM
   sums its per-choice rows the same way, in a separate reduction: deterministic, no atomics.)

Weights may be strided views whose last dimension is contiguous; the kernels take their
strides. Under ``TRITON_INTERPRET=1`` (CPU tensors) ``tl.dot`` on bf16 returns garbage, so the
tiles are upcast to fp32 after loading when the ``UPCAST`` constexpr is set (interpreter + bf16).
The launch plan (``fused_moe_launches``) is shared with ``.ci/compile_triton_sm90.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from qwen_ops.ops.kernels import triton_interpret
from qwen_ops.ops.kernels.triton_common import Launch


@triton.jit
def _dequant_tile(rows, k, n_ok, k_ok, s_rows, z_rows, grp, KIND: tl.constexpr):
    """The weight tile ``[BLOCK_K, BLOCK_N]`` at inputs ``k`` of the rows ``rows`` (pointers ``[1, BLOCK_N]``),
    without its scale: int8 values, int4's ``q - z`` or fp8 values as fp32 (KIND 1, 2, 3), or as stored
    (KIND 0, full precision); and the tile's scales ``[BLOCK_N]`` (KIND 0: unused)."""
    mask = k_ok[:, None] & n_ok[None, :]
    # one return statement: the compiler wants the same return type from every one, constexpr or not
    if KIND == 0:
        w = tl.load(rows + k[:, None], mask=mask, other=0.0)
        scale = n_ok.to(tl.float32)
    elif KIND == 2:
        scale = tl.load(s_rows + grp, mask=n_ok, other=0.0)
        byte = tl.load(rows + (k // 2)[:, None], mask=mask, other=0).to(tl.int32)
        z = tl.load(z_rows + grp, mask=n_ok, other=0).to(tl.int32)
        w = (((byte >> ((k % 2) * 4)[:, None]) & 15) - z[None, :]).to(tl.float32)
    else:
        scale = tl.load(s_rows + grp, mask=n_ok, other=0.0)
        w = tl.load(rows + k[:, None], mask=mask, other=0.0).to(tl.float32)
    return w, scale


@triton.jit
def _tile_dot(a, w, acc, scale, KIND: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ w`` (times the weight tile's per-column scale for a quantized tile), fp32 accumulation:
    fp32 operands with ``input_precision="ieee"``; otherwise the dequantized tile in a's dtype (int8
    values, int4's q - z and fp8 values are exact in fp16 and bf16)."""
    if UPCAST:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if KIND == 0:
        out = tl.dot(a, w, acc, input_precision="ieee")
    else:
        if IEEE or UPCAST:
            part = tl.dot(a, w, input_precision="ieee")
        else:
            part = tl.dot(a, w.to(a.dtype))
        out = acc + part * scale[None, :]
    return out


@triton.jit
def _fused_moe_w13_kernel(
    act_ptr, x_ptr, w13_ptr, s_ptr, z_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter, group,
    stride_xt, stride_we, stride_wn, stride_at,        # x [T, H]; w13 [E, 2I, H]; act [P, I]
    stride_se, stride_sn,                              # scales / zeros [E, 2I, G] (quantized KIND)
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, KIND: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):   # a spare block of the worst-case grid
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pair < num_pairs                          # padding rows hold num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    offs_n64 = offs_n.to(tl.int64)
    gate_rows = w13_ptr + expert * stride_we + offs_n64[None, :] * stride_wn   # [1, BLOCK_N]
    up_rows = gate_rows + inter * stride_wn
    s_gate = s_ptr + expert * stride_se + offs_n64 * stride_sn                 # [BLOCK_N]
    s_up = s_gate + inter * stride_sn
    z_gate = z_ptr + expert * stride_se + offs_n64 * stride_sn
    z_up = z_gate + inter * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < hidden
        x = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        grp = k0 // group                              # BLOCK_K divides the group: one scale a column
        wg, sg = _dequant_tile(gate_rows, k, n_ok, k_ok, s_gate, z_gate, grp, KIND)
        wu, su = _dequant_tile(up_rows, k, n_ok, k_ok, s_up, z_up, grp, KIND)
        acc_gate = _tile_dot(x, wg, acc_gate, sg, KIND, UPCAST, IEEE)
        acc_up = _tile_dot(x, wu, acc_up, su, KIND, UPCAST, IEEE)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + pair[:, None].to(tl.int64) * stride_at + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _fused_moe_w2_kernel(
    partial_ptr, act_ptr, w2_ptr, s_ptr, z_ptr, topk_weights_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_padded_ptr, num_pairs, hidden, inter, group,
    stride_at, stride_we, stride_wn, stride_pt,        # act [P, I]; w2 [E, H, I]; partial [P, H]
    stride_se, stride_sn,                              # scales / zeros [E, H, G] (quantized KIND)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    KIND: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pair < num_pairs
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    offs_n64 = offs_n.to(tl.int64)
    w_rows = w2_ptr + expert * stride_we + offs_n64[None, :] * stride_wn    # [1, BLOCK_N]
    s_rows = s_ptr + expert * stride_se + offs_n64 * stride_sn
    z_rows = z_ptr + expert * stride_se + offs_n64 * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < inter
        a = tl.load(act_ptr + pair64[:, None] * stride_at + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        w, sc = _dequant_tile(w_rows, k, n_ok, k_ok, s_rows, z_rows, k0 // group, KIND)
        acc = _tile_dot(a, w, acc, sc, KIND, UPCAST, IEEE)
    weight = tl.load(topk_weights_ptr + pair64, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(partial_ptr + pair64[:, None] * stride_pt + offs_n[None, :], acc,
             mask=row_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------
# Configurations (static shapes only), alignment and launch plan
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeConfig:
    block_m: int      # rows (token, choice pairs) per tile; every expert's run is padded to a multiple
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype, interpret: bool) -> MoeConfig:
    """Tiles by the average rows per expert (shapes only, as vLLM's default configs choose them).

    Not tuned on a GPU yet (none was lent to this work): a first guess that keeps fp32 tiles
    inside an sm_90 block's shared memory; benchmarks/device_check.py measures it.
    """
    if interpret:
        return MoeConfig(16, 32, 32, 4, 1)
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:       # decode: few rows per expert, the weights stream once
        return MoeConfig(16, 64, 128 if dtype != torch.float32 else 64, 4, 4 if dtype != torch.float32 else 3)
    return MoeConfig(64, 64, 64, 4, 3)


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor    # int32 [num_blocks * BLOCK_M] pair ids t * top_k + j grouped by expert; padding = P
    block_experts: torch.Tensor   # int32 [num_blocks] expert of each BLOCK_M rows
    num_padded: torch.Tensor      # int32 [1] rows in use (blocks at or past it exit)

    @property
    def num_blocks(self) -> int:
        return self.block_experts.shape[0]


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the (token, choice) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Device ops only, no host sync: the buffers have the worst-case size for these shapes.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    num_blocks = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return Alignment(sorted_pairs, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32))


# fused_moe_quant's kernels as the tile loaders' KIND (0: full precision); the _a8 kernels run their
# weight-only kind on activations quantized in torch first (fused_moe_quant_triton).
QUANT_KINDS = {"int8": 1, "int8_a8": 1, "int4": 2, "int4_a8": 2, "fp8": 3}


@dataclass(frozen=True)
class QuantWeights:
    """The quantized experts' scales and zeros (zeros: int4 only) and the inputs per scale column."""
    kind: int
    w13_scales: torch.Tensor
    w13_zeros: Optional[torch.Tensor]
    w13_group: int
    w2_scales: torch.Tensor
    w2_zeros: Optional[torch.Tensor]
    w2_group: int


def fused_moe_launches(hidden_states, w13, w2, topk_weights, alignment: Alignment, top_k: int,
                       act: torch.Tensor, partial: torch.Tensor, cfg: MoeConfig, upcast: bool,
                       quant: Optional[QuantWeights] = None) -> list[Launch]:
    """The two launches: ``act [P, inter]`` (x's dtype) from w13, then ``partial [P, hidden]`` (fp32) from w2.

    ``topk_weights`` must be contiguous ([num_tokens, top_k], read at pair id t * top_k + j). ``quant``:
    w13 and w2 are fused_moe_quant's quantized weights (``cfg.block_k`` must divide both groups).
    """
    num_tokens, hidden = hidden_states.shape
    inter = w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return []
    if quant is None:        # the scale arguments are unused: any tensor, any group
        q13 = (w13, w13, cfg.block_k, 0, 0)
        q2 = (w2, w2, cfg.block_k, 0, 0)
        kind = 0
    else:
        q13 = (quant.w13_scales, quant.w13_zeros if quant.w13_zeros is not None else quant.w13_scales,
               quant.w13_group, quant.w13_scales.stride(0), quant.w13_scales.stride(1))
        q2 = (quant.w2_scales, quant.w2_zeros if quant.w2_zeros is not None else quant.w2_scales,
              quant.w2_group, quant.w2_scales.stride(0), quant.w2_scales.stride(1))
        kind = quant.kind
    common = (alignment.sorted_pairs, alignment.block_experts, alignment.num_padded, num_pairs, hidden, inter)
    kinds = (("KIND", kind), ("IEEE", hidden_states.dtype == torch.float32))
    tiles = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k), ("UPCAST", upcast))
    return [
        Launch(_fused_moe_w13_kernel, (alignment.num_blocks, triton.cdiv(inter, cfg.block_n)),
               (act, hidden_states, w13, q13[0], q13[1]) + common + (q13[2],)
               + (hidden_states.stride(0), w13.stride(0), w13.stride(1), act.stride(0), q13[3], q13[4]),
               (("TOP_K", top_k),) + tiles + kinds, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        Launch(_fused_moe_w2_kernel, (alignment.num_blocks, triton.cdiv(hidden, cfg.block_n)),
               (partial, act, w2, q2[0], q2[1], topk_weights) + common + (q2[2],)
               + (act.stride(0), w2.stride(0), w2.stride(1), partial.stride(0), q2[3], q2[4]),
               tiles + kinds, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    ]


def fused_moe_triton(hidden_states, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Validated arguments of torch.ops.qwen.fused_moe -> [num_tokens, hidden] in hidden_states.dtype."""
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    interpret = triton_interpret()
    cfg = moe_config(num_tokens * top_k, num_experts, hidden_states.dtype, interpret)
    alignment = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    act = hidden_states.new_empty(num_tokens * top_k, inter)
    partial = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=hidden_states.device)
    upcast = interpret and hidden_states.dtype == torch.bfloat16
    for launch in fused_moe_launches(hidden_states, w13, w2, topk_weights.contiguous(), alignment, top_k,
                                     act, partial, cfg, upcast):
        launch.run()
    return partial.view(num_tokens, top_k, hidden).sum(1).to(hidden_states.dtype)


def _quant_block_k(block_k: int, *groups: int) -> int:
    """The largest of ``block_k``, its halves down to 16, dividing every group (a tile inside one scale)."""
    while block_k > 16 and any(g % block_k for g in groups):
        block_k //= 2
    if any(g % block_k for g in groups):
        raise ValueError(f"scale groups of {groups} input features: the Triton kernels need groups that are "
                         "multiples of 16")
    return block_k


def fused_moe_quant_triton(hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros, topk_weights,
                           topk_ids, kernel: str, block_k: int) -> torch.Tensor:
    """Validated arguments of torch.ops.qwen.fused_moe_quant -> [num_tokens, hidden] in hidden_states.dtype.

    The activations (x, then act) are fp32 for the ``_a8`` kernels, quantized in torch as their contract
    says (``reference_quant.quantize_activations``) before each product, and in x's dtype otherwise."""
    from qwen_ops.ops.kernels.reference_quant import quantize_activations

    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    a8 = kernel.endswith("_a8")

    def group(k: int, scales: torch.Tensor) -> int:
        return block_k if kernel == "fp8" else k // scales.shape[2]

    g13, g2 = group(hidden, w13_scales), group(inter, w2_scales)
    quant = QuantWeights(QUANT_KINDS[kernel], w13_scales, w13_zeros, g13, w2_scales, w2_zeros, g2)
    x = quantize_activations(hidden_states, g13) if a8 else hidden_states
    interpret = triton_interpret()
    cfg = moe_config(num_tokens * top_k, num_experts, x.dtype, interpret)
    cfg = replace(cfg, block_k=_quant_block_k(cfg.block_k, g13, g2))
    alignment = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    act = x.new_empty(num_tokens * top_k, inter)
    partial = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    upcast = interpret and x.dtype == torch.bfloat16
    w13_launch, w2_launch = fused_moe_launches(x, w13, w2, topk_weights.contiguous(), alignment, top_k, act, partial,
                                               cfg, upcast, quant)
    w13_launch.run()
    if a8:       # act's rows quantized in place: the w2 launch reads the same buffer
        act.copy_(quantize_activations(act, g2))
    w2_launch.run()
    return partial.view(num_tokens, top_k, hidden).sum(1).to(hidden_states.dtype)
