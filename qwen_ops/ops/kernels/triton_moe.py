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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwen_ops.ops.backend import triton_interpret
from qwen_ops.ops.kernels.triton import Launch


@triton.jit
def _fused_moe_w13_kernel(
    act_ptr, x_ptr, w13_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at,        # x [T, H]; w13 [E, 2I, H]; act [P, I]
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
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
    gate_rows = w13_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn   # [1, BLOCK_N]
    up_rows = gate_rows + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + offs_k) < hidden
        x = tl.load(x_ptr + token[:, None] * stride_xt + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(gate_rows + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)     # [BLOCK_K, BLOCK_N]
        wu = tl.load(up_rows + (k0 + offs_k)[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + pair[:, None].to(tl.int64) * stride_at + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _fused_moe_w2_kernel(
    partial_ptr, act_ptr, w2_ptr, topk_weights_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_pt,        # act [P, I]; w2 [E, H, I]; partial [P, H]
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
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
    w_rows = w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn    # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + offs_k) < inter
        a = tl.load(act_ptr + pair64[:, None] * stride_at + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
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


def fused_moe_launches(hidden_states, w13, w2, topk_weights, alignment: Alignment, top_k: int,
                       act: torch.Tensor, partial: torch.Tensor, cfg: MoeConfig, upcast: bool) -> list[Launch]:
    """The two launches: ``act [P, inter]`` (x's dtype) from w13, then ``partial [P, hidden]`` (fp32) from w2.

    ``topk_weights`` must be contiguous ([num_tokens, top_k], read at pair id t * top_k + j).
    """
    num_tokens, hidden = hidden_states.shape
    inter = w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return []
    common = (alignment.sorted_pairs, alignment.block_experts, alignment.num_padded, num_pairs, hidden, inter)
    tiles = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k), ("UPCAST", upcast))
    return [
        Launch(_fused_moe_w13_kernel, (alignment.num_blocks, triton.cdiv(inter, cfg.block_n)),
               (act, hidden_states, w13) + common
               + (hidden_states.stride(0), w13.stride(0), w13.stride(1), act.stride(0)),
               (("TOP_K", top_k),) + tiles, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        Launch(_fused_moe_w2_kernel, (alignment.num_blocks, triton.cdiv(hidden, cfg.block_n)),
               (partial, act, w2, topk_weights) + common
               + (act.stride(0), w2.stride(0), w2.stride(1), partial.stride(0)),
               tiles, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
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
