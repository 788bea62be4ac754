"""Triton kernels of the quantized linear ops (``linear_int8``, ``linear_int4``, ``linear_fp8``): a
dequantizing GEMM, weights in the ops' layouts (``kernels/reference_quant.py``, the specification).

Program (row block, output block): for each ``BLOCK_K`` slice of the input features (inside one
scale group: ``BLOCK_K`` divides the group size), the weight tile is widened to x's dtype without
its scale (int8 values, int4's ``q - z`` and fp8 values are exact in fp16 and bf16), multiplied by
the x tile with ``tl.dot`` (fp32 accumulation; fp32 activations with ``input_precision="ieee"``, not
TF32), and the product is scaled per output feature and
added to the fp32 accumulator: the reference's arithmetic up to the order of the sums. Bias and the
one rounding to x's dtype at the end. int4 bytes hold two elements, so each byte is loaded for its
two k and shifted by ``(k % 2) * 4``.

Under ``TRITON_INTERPRET=1`` (CPU tensors) ``tl.dot`` on bf16 returns garbage: tiles are upcast to
fp32 when ``UPCAST`` is set. The launch plan (``linear_quant_launches``) is shared with
``.ci/compile_triton_sm90.py``. FP8 weights on sm_89 and later (H100 / H200) run W8A8: the activations are
quantized per row to FP8 (``quantize_rows_fp8``, vLLM's dynamic scheme) and the tiles multiplied as fp8 on
the tensor cores, the row scales applied to the fp32 accumulator at the end.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qwen_ops.ops.kernels import triton_interpret
from qwen_ops.ops.kernels.triton_common import Launch

KINDS = {"int8": 0, "int4": 1, "fp8": 2}


@triton.jit
def _linear_quant_kernel(
    out_ptr, x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, xs_ptr,
    M, N, K, GROUP, BLOCK_ROWS,
    stride_xm, stride_om, stride_wn, stride_sn,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ACT_FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    s_rows = (offs_n // BLOCK_ROWS).to(tl.int64) * stride_sn          # fp8: BLOCK_ROWS = block_n; else 1
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)   # [BLOCK_M, BLOCK_K]
        wmask = k_ok[:, None] & n_ok[None, :]
        grp = k0 // GROUP
        if KIND == 1:
            byte = tl.load(w_cols + (k // 2)[:, None], mask=wmask, other=0).to(tl.int32)
            q = (byte >> ((k % 2) * 4)[:, None]) & 15
            z = tl.load(z_ptr + s_rows + grp, mask=n_ok, other=0).to(tl.int32)
            w = (q - z[None, :]).to(tl.float32)
        elif ACT_FP8:                       # W8A8: fp8 x fp8 products on the tensor cores
            w = tl.load(w_cols + k[:, None], mask=wmask, other=0.0)
        else:
            w = tl.load(w_cols + k[:, None], mask=wmask, other=0.0).to(tl.float32)      # [BLOCK_K, BLOCK_N]
        if UPCAST:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32))
        elif ACT_FP8:
            part = tl.dot(x, w)
        elif IEEE:                          # fp32 activations: full fp32 products, not TF32
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        scale = tl.load(s_ptr + s_rows + grp, mask=n_ok, other=0.0)
        acc += part * scale[None, :]
    if ACT_FP8:                             # the activations' per-row scales
        acc *= tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _block_k(group: int) -> Optional[int]:
    for b in (64, 32, 16):
        if group % b == 0:
            return b
    return None


def linear_quant_launches(kind: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                          zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor], out: torch.Tensor,
                          n: int, k: int, group: int, block_rows: int, upcast: bool,
                          x_scales: Optional[torch.Tensor] = None) -> list[Launch]:
    """The one launch that fills ``out [M, N]``; ``group``: input features per scale column
    (fp8: block_k), ``block_rows``: output features per scale row (fp8: block_n, else 1).
    ``x_scales`` (fp8 only): x is float8_e4m3fn activations quantized per row with these fp32
    scales (W8A8)."""
    m = x.shape[0]
    if m == 0 or n == 0:
        return []
    block_k = _block_k(group)
    if block_k is None:
        raise ValueError(f"group size {group} is not a multiple of 16: the Triton kernel needs one")
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    dummy = scales
    args = (out, x, w, scales, zeros if zeros is not None else dummy, bias if bias is not None else dummy,
            x_scales if x_scales is not None else dummy,
            m, n, k, group, block_rows, x.stride(0), out.stride(0), w.stride(0), scales.stride(0))
    constexprs = (("KIND", KINDS[kind]), ("HAS_BIAS", bias is not None), ("BLOCK_M", block_m), ("BLOCK_N", block_n),
                  ("BLOCK_K", block_k), ("UPCAST", upcast), ("IEEE", x.dtype == torch.float32),
                  ("ACT_FP8", x_scales is not None))
    return [Launch(_linear_quant_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), args, constexprs,
                   num_warps=4, num_stages=3)]


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row FP8 activations (vLLM's dynamic scheme): ``(xq float8_e4m3fn, scale fp32 [rows])``
    with ``x ~ xq * scale``, ``scale = max|x_row| / 448``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return (xf / scale[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def linear_quant_triton(kind: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                        zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor], n: int, k: int, group: int,
                        block_rows: int, act_fp8: bool = False) -> torch.Tensor:
    """Validated arguments of one of the quantized ops -> ``[rows, N]`` in x's dtype. ``act_fp8``
    (fp8 weights): W8A8, the activations quantized per row to FP8 first (sm_89 and later)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    upcast = triton_interpret()
    xin, x_scales = quantize_rows_fp8(x) if (act_fp8 and kind == "fp8") else (x, None)
    for launch in linear_quant_launches(kind, xin, w, scales, zeros, bias, out, n, k, group, block_rows, upcast,
                                        x_scales):
        launch.run()
    return out
