"""The engine layer: explicit per-request slots over a paged KV cache (``QwenEngine``), the
model runner that turns scheduled chunks into one forward pass, block allocation and sampling.

The names below load on first use, so importing one engine module (``qwen_ops.engine.sampling``)
does not import the engine, its runner and the models."""

from __future__ import annotations

import importlib

# Each public name and the module it lives in.
_MODULES = {"QwenEngine": "qwen_ops.engine.engine", "QwenBatchedRequest": "qwen_ops.engine.engine",
            "QwenForwardResult": "qwen_ops.engine.engine", "QwenBatchPrefillResult": "qwen_ops.engine.engine",
            "QwenBatchDecodeResult": "qwen_ops.engine.engine", "SwappedSlot": "qwen_ops.engine.block_manager"}

__all__ = list(_MODULES)


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'qwen_ops.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
