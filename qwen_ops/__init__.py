"""qwen_ops: slot-indexed attention and KV-cache custom ops (torch.ops.qwen.*) for Qwen models."""

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.backend import get_backend, resolve_backend, set_backend, use_backend
from qwen_ops.ops import kv_write, slot_attention

__version__ = "0.1.0"

__all__ = ["kv_write", "slot_attention", "get_backend", "set_backend", "use_backend", "resolve_backend"]
