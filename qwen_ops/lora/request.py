"""vLLM's ``vllm.lora.request`` (a re-export)."""

from qwen_ops.engine.lora import LoRARequest

__all__ = ["LoRARequest"]
