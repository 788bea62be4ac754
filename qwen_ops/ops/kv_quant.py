"""The quantized KV cache's vocabulary: vLLM's ``kv_cache_dtype`` names, the fp8 formats, and the
plain-torch quantize / dequantize that the reference kernels (and the tests' oracle) are written in.

A cache in ``float8_e4m3fn`` / ``float8_e5m2`` holds ``fp8(clamp(x / scale, -max, max))``: the
division in fp32, rounded to nearest even, saturated at the format's largest finite value (as
vLLM's cache kernels convert, ``__NV_SATFINITE``); the attention reads ``float(q) * scale``. One
scale per layer for keys and one for values (vLLM's per-tensor ``k_scale`` / ``v_scale``), float32
one-element tensors; ``None`` means 1.0.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# vLLM's spellings ("fp8" is e4m3, as in vLLM's CUDA and CPU backends).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}

# vLLM's defaults for calculate_kv_scales (its K_SCALE_CONSTANT / V_SCALE_CONSTANT): the first
# batch's amax divided by these, so a later batch a little larger than the first still fits.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def resolve_kv_cache_dtype(kv_cache_dtype: Union[str, torch.dtype, None], model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for vLLM's ``kv_cache_dtype`` argument: ``"auto"`` (or None) is the
    model's dtype; ``"fp8"`` / ``"fp8_e4m3"`` is float8_e4m3fn, ``"fp8_e5m2"`` float8_e5m2."""
    if kv_cache_dtype is None:
        return model_dtype
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype == model_dtype or kv_cache_dtype in FP8_DTYPES:
            return kv_cache_dtype
    elif isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    raise ValueError(f"kv_cache_dtype = {kv_cache_dtype!r}, expected one of {sorted(KV_CACHE_DTYPES)} "
                     f"(vLLM's names), torch.float8_e4m3fn, torch.float8_e5m2 or the model's dtype {model_dtype}")


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
