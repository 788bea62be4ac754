"""qwen_ops: slot-indexed attention and KV-cache custom ops (torch.ops.qwen.*) for Qwen models,
with a Qwen model, an explicit-slot engine and a continuous-batching LLM on top.

Layers, one folder each, imports flowing one way (serving -> engine -> models -> ops):
``ops/`` the custom ops and their kernels, ``models/`` configs, loading and the models,
``engine/`` slots, runner and sampling, ``serving/`` scheduler, ``LLM`` and the CLI.
"""

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.engine.engine import (QwenBatchDecodeResult, QwenBatchedRequest, QwenBatchPrefillResult, QwenEngine,
                                    QwenForwardResult)
from qwen_ops.engine.lora import LoRARequest
from qwen_ops.engine.pooling import PoolingParams
from qwen_ops.engine.sampling import RequestOutputKind, SamplingParams
from qwen_ops.engine.structured import GuidedDecodingParams, StructuredOutputsParams
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.defaults import default_model_path
from qwen_ops.models.dense import QwenForCausalLM
from qwen_ops.models.loader import Checkpoint, load_checkpoint, load_model
from qwen_ops.models.tokenizer import QwenTokenizer, load_tokenizer
from qwen_ops.ops import kv_write, slot_attention
from qwen_ops.ops.backend import get_backend, resolve_backend, set_backend, use_backend
from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.serving.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from qwen_ops.serving.llm import LLM, CompletionOutput, RequestOutput
from qwen_ops.serving.pooling import (ClassificationRequestOutput, EmbeddingRequestOutput, ScoringRequestOutput,
                                      qwen3_reranker_inputs)

__version__ = "0.1.0"

__all__ = [
    "kv_write", "slot_attention", "get_backend", "set_backend", "use_backend", "resolve_backend",
    "QwenEngine", "QwenBatchedRequest", "QwenForwardResult", "QwenBatchPrefillResult", "QwenBatchDecodeResult",
    "SamplingParams", "RequestOutputKind", "LLM", "RequestOutput", "CompletionOutput", "default_model_path",
    "AttentionMetadata", "QwenConfig", "QwenForCausalLM", "Checkpoint", "load_checkpoint", "load_model",
    "QwenTokenizer", "load_tokenizer", "StructuredOutputsParams", "GuidedDecodingParams",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest", "PoolingParams",
    "EmbeddingRequestOutput", "ScoringRequestOutput", "ClassificationRequestOutput", "qwen3_reranker_inputs",
]
