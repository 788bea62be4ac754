"""The quantized KV cache's vocabulary: vLLM's ``kv_cache_dtype`` names, the fp8 formats, and the
plain-torch quantize / dequantize that the reference kernels (and the tests' oracle) are written in
(``kernels/kv_fp8.py``, named here).

A cache in ``float8_e4m3fn`` / ``float8_e5m2`` holds ``fp8(clamp(x / scale, -max, max))``: the
division in fp32, rounded to nearest even, saturated at the format's largest finite value (as
vLLM's cache kernels convert, ``__NV_SATFINITE``); the attention reads ``float(q) * scale``. One
scale per layer for keys and one for values (vLLM's per-tensor ``k_scale`` / ``v_scale``), float32
one-element tensors; ``None`` means 1.0.
"""

from __future__ import annotations

from typing import Union

import torch

from qwen_ops.ops.kernels.kv_fp8 import FP8_DTYPES

# vLLM's spellings ("fp8" is e4m3, as in vLLM's CUDA and CPU backends).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}

# vLLM's defaults for calculate_kv_scales (its K_SCALE_CONSTANT / V_SCALE_CONSTANT): the first
# batch's amax divided by these, so a later batch a little larger than the first still fits.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


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
