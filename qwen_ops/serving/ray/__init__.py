"""qwen_ops on a Ray cluster (the optional extra ``ray``): Ray places the engines.

- ``build_openai_app`` (serve.py): a Ray Serve application whose replicas each run this project's
  OpenAI-compatible server over an engine of their own (``num_replicas`` or an autoscaling config),
  vLLM's ``ray.serve.llm.build_openai_app`` in shape.
- ``build_llm_processor`` (data.py): batch generation over a Ray Data dataset, one offline ``LLM``
  per actor (``dataset.map_batches``), vLLM's ``ray.data.llm`` in shape.

The names load on first use, and Ray itself when one of them is called (dependency.py): importing
this package needs no Ray, and ``python -m qwen_ops.serving.ray.serve`` runs its module once.
docs/ray.md shows both, runnable on one machine.
"""

from __future__ import annotations

import importlib

_MODULES = {
    "build_openai_app": "qwen_ops.serving.ray.serve", "openai_deployment": "qwen_ops.serving.ray.serve",
    "QwenEngineProcessorConfig": "qwen_ops.serving.ray.data", "QwenProcessor": "qwen_ops.serving.ray.data",
    "build_llm_processor": "qwen_ops.serving.ray.data",
}

__all__ = list(_MODULES)


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
