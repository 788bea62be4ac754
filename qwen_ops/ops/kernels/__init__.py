"""Kernel implementations of torch.ops.qwen.*: reference (plain torch), triton, cuda.

Each module exposes ``kv_write_<backend>`` and ``slot_attention_<backend>`` with the op's
signature. They assume validated inputs; validation lives in ``qwen_ops.ops.validation``.
"""
