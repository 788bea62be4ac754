"""The fp8 KV cache's arithmetic in plain torch (the format: ``qwen_ops/ops/kv_quant.py``): what the
reference kernels and the tests' oracle quantize and dequantize with."""

from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _scale_value(scale: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return scale.reshape(()).to(torch.float32)


def quantize(x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``fp8(clamp(float(x) / scale))`` in ``dtype`` (float8_e4m3fn or float8_e5m2)."""
    m = fp8_max(dtype)
    return (x.float() / _scale_value(scale, x.device)).clamp(-m, m).to(dtype)


def dequantize(q: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``float(q) * scale`` in fp32."""
    return q.float() * _scale_value(scale, q.device)
