"""vLLM's ``vllm.engine.llm_engine`` (a re-export of ``serving/llm_engine.py``; a vLLM path, not a module
of the engine layer: tests/test_layout.py lists it with the other vLLM paths)."""

from qwen_ops.serving.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
