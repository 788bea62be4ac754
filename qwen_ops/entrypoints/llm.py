"""vLLM's ``vllm.entrypoints.llm`` (a re-export)."""

from qwen_ops.serving.offline import LLM

__all__ = ["LLM"]
