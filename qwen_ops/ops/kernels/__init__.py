"""Kernel implementations of torch.ops.qwen.*: reference (plain torch), triton, cuda.

Each module exposes ``kv_write_<backend>`` and ``slot_attention_<backend>`` with the op's
signature. They assume validated inputs; validation lives in ``qwen_ops.ops.validation``.
"""

import os


def triton_interpret() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``: kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
