"""vLLM's ``vllm.entrypoints.llm`` (a re-export)."""

from qwen_ops.serving.llm import LLM

__all__ = ["LLM"]
