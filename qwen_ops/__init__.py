"""qwen_ops: slot-indexed attention and KV-cache custom ops (torch.ops.qwen.*) for Qwen models,
with a Qwen model, an explicit-slot engine and a continuous-batching LLM on top.

Layers, one folder each, imports flowing one way (serving -> engine -> models -> ops):
``ops/`` the custom ops and their kernels, ``models/`` configs, loading and the models,
``engine/`` slots, runner and sampling, ``serving/`` scheduler, ``LLM`` and the CLI.

vLLM's module paths are re-exports of these (``qwen_ops.sampling_params``, ``qwen_ops.lora.request``,
``qwen_ops.inputs``, ``qwen_ops.outputs``, ``qwen_ops.pooling_params``, ``qwen_ops.beam_search``,
``qwen_ops.entrypoints.llm``, ``qwen_ops.entrypoints.openai.api_server``, ``qwen_ops.engine.arg_utils``,
``qwen_ops.utils.argparse_utils``), so vLLM code runs with only ``vllm`` changed to ``qwen_ops``.

``import qwen_ops`` registers the custom ops (``torch.ops.qwen.*``, the plugin's promise) and
nothing more: the public names below load on first use (vLLM's lazy root), so importing
``qwen_ops.ops.kernels.reference`` (or any op module) loads no model, engine or serving module.
The torch-free ``qwen-ops --help`` reads the engine's flags without running this file
(``qwen_ops_cli``).
"""

from __future__ import annotations

import importlib

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)

__version__ = "0.1.0"

# Each public name and the module it lives in.
_MODULES = {
    "kv_write": "qwen_ops.ops", "slot_attention": "qwen_ops.ops",
    "get_backend": "qwen_ops.ops.backend", "set_backend": "qwen_ops.ops.backend",
    "use_backend": "qwen_ops.ops.backend", "resolve_backend": "qwen_ops.ops.backend",
    "AttentionMetadata": "qwen_ops.ops.metadata",
    "QwenConfig": "qwen_ops.models.config", "default_model_path": "qwen_ops.models.defaults",
    "QwenForCausalLM": "qwen_ops.models.dense",
    "Checkpoint": "qwen_ops.models.loader", "load_checkpoint": "qwen_ops.models.loader",
    "load_model": "qwen_ops.models.loader",
    "QwenTokenizer": "qwen_ops.models.tokenizer", "load_tokenizer": "qwen_ops.models.tokenizer",
    "QwenEngine": "qwen_ops.engine.engine", "QwenBatchedRequest": "qwen_ops.engine.engine",
    "QwenForwardResult": "qwen_ops.engine.engine", "QwenBatchPrefillResult": "qwen_ops.engine.engine",
    "QwenBatchDecodeResult": "qwen_ops.engine.engine",
    "SamplingParams": "qwen_ops.engine.sampling", "RequestOutputKind": "qwen_ops.engine.sampling",
    "StructuredOutputsParams": "qwen_ops.engine.structured", "GuidedDecodingParams": "qwen_ops.engine.structured",
    "LoRARequest": "qwen_ops.engine.lora", "PoolingParams": "qwen_ops.engine.pooling",
    "LLM": "qwen_ops.serving.offline", "RequestOutput": "qwen_ops.serving.llm", "CompletionOutput": "qwen_ops.serving.llm",
    "EngineArgs": "qwen_ops.serving.engine_args",
    "BeamSearchParams": "qwen_ops.serving.beam_search", "BeamSearchOutput": "qwen_ops.serving.beam_search",
    "BeamSearchSequence": "qwen_ops.serving.beam_search",
    "EmbeddingRequestOutput": "qwen_ops.serving.pooling", "ScoringRequestOutput": "qwen_ops.serving.pooling",
    "PoolingOutput": "qwen_ops.serving.pooling", "PoolingRequestOutput": "qwen_ops.serving.pooling",
    "EmbeddingOutput": "qwen_ops.serving.pooling", "ClassificationOutput": "qwen_ops.serving.pooling",
    "ScoringOutput": "qwen_ops.serving.pooling",
    "TextPrompt": "qwen_ops.serving.prompts", "TokensPrompt": "qwen_ops.serving.prompts",
    "PromptType": "qwen_ops.serving.prompts", "AsyncEngineArgs": "qwen_ops.serving.engine_args",
    "AsyncLLM": "qwen_ops.serving.async_llm", "LLMEngine": "qwen_ops.serving.llm_engine",
    "ClassificationRequestOutput": "qwen_ops.serving.pooling", "qwen3_reranker_inputs": "qwen_ops.serving.pooling",
}

__all__ = list(_MODULES)
_LAYERS = ("ops", "models", "engine", "serving")        # ``qwen_ops.ops.X`` after a bare ``import qwen_ops``


def __getattr__(name: str):
    if name in _LAYERS:
        return importlib.import_module(f"qwen_ops.{name}")
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'qwen_ops' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
