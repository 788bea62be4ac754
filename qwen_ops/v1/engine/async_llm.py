"""vLLM's ``vllm.v1.engine.async_llm`` (a re-export of ``serving/async_llm.py``)."""

from qwen_ops.serving.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
