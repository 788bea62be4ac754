"""The ops layer's public functions for the CPU fast path, for the model and engine layers (which
never import a kernel module): whether the C library runs here, the fast ops' registration (once),
weight packing into the panels ``torch.ops.qwen.linear_packed`` reads, what this CPU's products run
on, huge-page memory for packed weights and KV caches, and the two host kernels the engine calls on logits
(greedy argmax, a sampled row's weights and inverse-CDF pick, a grammar's token bitmask); and the quantized layers' weight layouts (int4 pairs
in a byte, int8-activation panels) and their ops' references (the oracle twin of a layer). The
functions are ``kernels/cpu.py``'s and ``kernels/reference_quant.py``'s, named here.
"""

from __future__ import annotations

from qwen_ops.ops.kernels.cpu import (HugePageArena, apply_token_bitmask, argmax_rows, bf16_products,  # noqa: F401
                                      huge_page_empty, huge_page_zeros, int8_dot_products, int8_products,
                                      pack_panels, sample_rows, sampling_weights, why_unavailable)
from qwen_ops.ops.kernels import reference_quant as _RQ
from qwen_ops.ops.kernels.reference_quant import pack_int4, unpack_a8_panels  # noqa: F401
from qwen_ops.ops.registry import cpu_fast_ops as fast_ops  # noqa: F401


def quant_reference(kernel: str, panels: bool):
    """The reference of a quantized product (``linear_<kernel>``, or ``linear_a8_panels`` on panels)."""
    return _RQ.linear_a8_panels_reference if panels else _RQ.REFERENCES[kernel]


__all__ = ["HugePageArena", "apply_token_bitmask", "argmax_rows", "bf16_products", "fast_ops", "huge_page_empty",
           "huge_page_zeros", "int8_dot_products", "int8_products", "pack_int4", "pack_panels", "quant_reference",
           "sample_rows", "sampling_weights", "unpack_a8_panels", "why_unavailable"]
