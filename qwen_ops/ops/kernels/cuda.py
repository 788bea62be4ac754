"""CUDA C++ backend of torch.ops.qwen.*: thin calls into the optional extension ``qwen_ops._qwen_C``.

The extension (csrc/, built by setup.py with ``QWEN_OPS_BUILD_CUDA=1``) registers its kernels as
``torch.ops._qwen_C.kv_write`` / ``slot_attention`` / ``causal_conv1d`` / ``gated_delta_rule``, with
the argument lists of the ``qwen`` schemas (the C++ side allocates the zeroed outputs). The public ops validate their arguments (``qwen_ops.ops.validation``) and then
call the functions below, which pass the arguments through unchanged.

Importing this module never fails: the extension is imported only when a kernel runs or when
:func:`why_unavailable` is asked.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

EXTENSION = "qwen_ops._qwen_C"
BUILD_HINT = ("install with `QWEN_OPS_BUILD_CUDA=1 pip install --no-build-isolation -e .` on a machine with "
              "a CUDA toolkit (nvcc; set CUDA_HOME) and a CUDA build of torch")


def _load_extension() -> None:
    """Import the extension (Python caches it in sys.modules), which registers torch.ops._qwen_C."""
    importlib.import_module(EXTENSION)


def why_unavailable() -> Optional[str]:
    """None when the CUDA kernels can run here, otherwise the reason. Never raises."""
    try:
        _load_extension()
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == EXTENSION:
            return f"{EXTENSION} is not built ({BUILD_HINT})"
        return f"{EXTENSION} is built but cannot be loaded ({exc}); rebuild it against torch {torch.__version__}"
    except Exception as exc:  # e.g. a registration error when schema and C++ signatures disagree
        return f"{EXTENSION} failed to load: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return f"{EXTENSION} is built, but no CUDA device is available"
    return None


def _fp8(cache: torch.Tensor) -> bool:
    """fp8 caches have no kernels in the extension: the triton backend's take them (a choice by the
    cache's dtype, fixed when the engine allocates it)."""
    return cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_write_cuda(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                  v_scale=None) -> None:
    """Validated arguments of torch.ops.qwen.kv_write -> the extension's kernel (in place)."""
    if _fp8(key_cache):
        from qwen_ops.ops.kernels.triton import kv_write_triton

        return kv_write_triton(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale, v_scale)
    _load_extension()
    torch.ops._qwen_C.kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table)


def slot_attention_cuda(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                        scale: float, max_query_len: int, gate: Optional[torch.Tensor] = None,
                        k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Validated arguments of torch.ops.qwen.slot_attention -> the extension's kernels."""
    if _fp8(key_cache):
        from qwen_ops.ops.kernels.triton import slot_attention_triton

        return slot_attention_triton(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                                     seq_lens, scale, max_query_len, gate, k_scale, v_scale)
    _load_extension()
    return torch.ops._qwen_C.slot_attention(query, key_cache, value_cache, block_table, seq_slots,
                                            query_start_loc, seq_lens, float(scale), int(max_query_len), gate)


def causal_conv1d_cuda(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> torch.Tensor:
    """Validated arguments of torch.ops.qwen.causal_conv1d -> the extension's kernels (conv_state in place)."""
    _load_extension()
    return torch.ops._qwen_C.causal_conv1d(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens)


def gated_delta_rule_cuda(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens,
                          scale: float) -> torch.Tensor:
    """Validated arguments of torch.ops.qwen.gated_delta_rule -> the extension's recurrent kernel (state in place)."""
    _load_extension()
    return torch.ops._qwen_C.gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens,
                                              float(scale))
