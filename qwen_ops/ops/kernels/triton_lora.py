"""Triton kernels of the multi-LoRA ops ``lora_shrink`` / ``lora_expand`` (contracts in torch_library/qwen.schema,
references in kernels/reference_lora.py), gathered per row (BGMV): each program reads its rows' adapter slots.

Program (row block, output block): the tile's rows may name different slots (a decode batch), so the weights are
gathered per row, ``[BLOCK_M, BLOCK_N, BLOCK_K]``, and multiplied by broadcasting and summing over k. When the
tile has 16 rows or more (``tl.dot``'s minimum) and all its rows with an adapter name one slot (a prefill's run),
that slot's ``[BLOCK_K, BLOCK_N]`` weight tile is multiplied with ``tl.dot`` instead. Sums in fp32; fp32 operands
with ``input_precision="ieee"`` (not TF32). Rows of slot -1: shrink stores zeros, expand leaves y alone.

lora_expand runs one launch per slice (S <= 3 in Qwen's fused layers): slice s's columns and buffer columns
``[s R, (s + 1) R)`` are scalar arguments, so nothing but shapes decides the grid.

Under ``TRITON_INTERPRET=1`` (CPU tensors) ``tl.dot`` on bf16 returns garbage: tiles are upcast to fp32 when
``UPCAST`` is set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwen_ops.ops.kernels import triton_interpret
from qwen_ops.ops.kernels.triton_common import Launch


@triton.jit
def _uniform_slot(slots):
    """The one slot of a tile's rows with an adapter (-1 rows aside), or -2 when they name several (or none)."""
    hi = tl.max(slots, axis=0)
    lo = tl.min(tl.where(slots >= 0, slots, hi), axis=0)
    return tl.where((lo == hi) & (hi >= 0), hi, -2)


@triton.jit
def _lora_shrink_kernel(
    out_ptr, x_ptr, a_ptr, idx_ptr, scale_ptr,
    T, SR, K, stride_xm, stride_al, stride_an,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < T
    n_ok = offs_n < SR
    slots = tl.load(idx_ptr + offs_m, mask=m_ok, other=-1)
    has = slots >= 0
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    uniform = -2
    if USE_DOT:
        uniform = _uniform_slot(slots)
    if uniform >= 0:
        w_cols = a_ptr + uniform.to(tl.int64) * stride_al + offs_n[None, :].to(tl.int64) * stride_an
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=has[:, None] & k_ok[None, :], other=0.0)      # [M, K]
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)     # [K, N]
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
            elif IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
    else:
        w_rows = (a_ptr + slots[:, None, None].to(tl.int64) * stride_al
                  + offs_n[None, :, None].to(tl.int64) * stride_an)                              # [M, N, 1]
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=has[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wmask = has[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
            w = tl.load(w_rows + k[None, None, :], mask=wmask, other=0.0).to(tl.float32)     # [M, N, K]
            acc += tl.sum(x[:, None, :] * w, axis=2)
    scale = tl.load(scale_ptr + slots, mask=has, other=0.0)
    acc = tl.where(has[:, None], acc * scale[:, None], 0.0)
    out = out_ptr + offs_m[:, None].to(tl.int64) * SR + offs_n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr, buf_ptr, b_ptr, idx_ptr,
    T, R, col0, cols, buf_col0, stride_ym, stride_bm, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, USE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = col0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)   # columns of y and rows of lora_b[slot]
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < T
    n_ok = offs_n < col0 + cols
    r_ok = offs_r < R
    slots = tl.load(idx_ptr + offs_m, mask=m_ok, other=-1)
    has = slots >= 0
    buf = tl.load(buf_ptr + offs_m[:, None].to(tl.int64) * stride_bm + buf_col0 + offs_r[None, :],
                  mask=has[:, None] & r_ok[None, :], other=0.0)                                  # [M, R] fp32
    uniform = -2
    if USE_DOT:
        uniform = _uniform_slot(slots)
    if uniform >= 0:
        # (a runtime branch: both sides are compiled, so their locals differ in name, not only in shape)
        w_tile = tl.load(b_ptr + uniform.to(tl.int64) * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn
                         + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)       # [R, N]
        delta = tl.dot(buf, w_tile.to(tl.float32), input_precision="ieee")
    else:
        w_rows = tl.load(b_ptr + slots[:, None, None].to(tl.int64) * stride_bl
                         + offs_n[None, :, None].to(tl.int64) * stride_bn + offs_r[None, None, :],
                         mask=has[:, None, None] & n_ok[None, :, None] & r_ok[None, None, :], other=0.0)  # [M, N, R]
        delta = tl.sum(buf[:, None, :] * w_rows.to(tl.float32), axis=2)
    ys = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    ok = has[:, None] & n_ok[None, :]
    y = tl.load(ys, mask=ok, other=0.0).to(tl.float32)
    tl.store(ys, (y + delta).to(y_ptr.dtype.element_ty), mask=ok)


def _block_m(rows: int) -> int:
    return 16 if rows >= 16 else max(1, triton.next_power_of_2(rows))


def lora_shrink_launches(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, idx: torch.Tensor,
                         scalings: torch.Tensor, upcast: bool) -> list[Launch]:
    """The one launch that fills ``out [T, S * R]`` (what ``lora_shrink_triton`` runs, and what CI compiles
    for sm_90: .ci/compile_triton_sm90.py)."""
    T, K = x.shape
    SR = lora_a.shape[1]
    if T == 0:
        return []
    block_m = _block_m(T)
    block_n = 16 if SR <= 16 else 32
    block_k = 32 if block_m < 16 else 64      # the gathered tile is BLOCK_M x BLOCK_N x BLOCK_K
    args = (out, x, lora_a, idx, scalings, T, SR, K, x.stride(0), lora_a.stride(0), lora_a.stride(1))
    constexprs = (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k), ("USE_DOT", block_m >= 16),
                  ("UPCAST", upcast), ("IEEE", x.dtype == torch.float32))
    return [Launch(_lora_shrink_kernel, (triton.cdiv(T, block_m), triton.cdiv(SR, block_n)), args, constexprs)]


def lora_expand_launches(y: torch.Tensor, buffer: torch.Tensor, lora_b: torch.Tensor, idx: torch.Tensor,
                         slice_sizes: list[int]) -> list[Launch]:
    """One launch per slice, updating ``y`` in place (``lora_expand_triton`` runs them; CI compiles them)."""
    T = y.shape[0]
    if T == 0:
        return []
    R = lora_b.shape[2]
    block_m = _block_m(T)
    block_r = max(16, triton.next_power_of_2(R))
    block_n = 32 if block_m >= 16 or block_r <= 16 else 16
    constexprs = (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_R", block_r), ("USE_DOT", block_m >= 16))
    launches, col0 = [], 0
    for s, cols in enumerate(slice_sizes):
        args = (y, buffer, lora_b, idx, T, R, col0, cols, s * R, y.stride(0), buffer.stride(0), lora_b.stride(0),
                lora_b.stride(1))
        launches.append(Launch(_lora_expand_kernel, (triton.cdiv(T, block_m), triton.cdiv(cols, block_n)), args,
                               constexprs))
        col0 += cols
    return launches


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, lora_indices: torch.Tensor,
                       scalings: torch.Tensor) -> torch.Tensor:
    """Validated arguments of lora_shrink -> fp32 ``[T, S * R]``."""
    out = torch.empty((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for launch in lora_shrink_launches(out, x, lora_a, lora_indices.contiguous(), scalings.contiguous(),
                                       triton_interpret()):
        launch.run()
    return out


def lora_expand_triton(y: torch.Tensor, buffer: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
                       slice_sizes: list[int]) -> None:
    """Validated arguments of lora_expand: y updated in place, one launch per slice."""
    for launch in lora_expand_launches(y, buffer, lora_b, lora_indices.contiguous(), slice_sizes):
        launch.run()
    return None
