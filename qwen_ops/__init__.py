"""qwen_ops: slot-indexed attention and KV-cache custom ops (torch.ops.qwen.*) for Qwen models,
with a Qwen model, an explicit-slot engine and a continuous-batching LLM on top."""

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.attention import AttentionMetadata
from qwen_ops.backend import get_backend, resolve_backend, set_backend, use_backend
from qwen_ops.config import QwenConfig
from qwen_ops.defaults import default_model_path
from qwen_ops.engine import (QwenBatchDecodeResult, QwenBatchedRequest, QwenBatchPrefillResult, QwenEngine,
                             QwenForwardResult)
from qwen_ops.llm import LLM, CompletionOutput, RequestOutput
from qwen_ops.loader import Checkpoint, load_checkpoint, load_model
from qwen_ops.model import QwenForCausalLM
from qwen_ops.ops import kv_write, slot_attention
from qwen_ops.sampling import SamplingParams
from qwen_ops.tokenizer import QwenTokenizer, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "kv_write", "slot_attention", "get_backend", "set_backend", "use_backend", "resolve_backend",
    "QwenEngine", "QwenBatchedRequest", "QwenForwardResult", "QwenBatchPrefillResult", "QwenBatchDecodeResult",
    "SamplingParams", "LLM", "RequestOutput", "CompletionOutput", "default_model_path",
    "AttentionMetadata", "QwenConfig", "QwenForCausalLM", "Checkpoint", "load_checkpoint", "load_model",
    "QwenTokenizer", "load_tokenizer",
]
