"""vLLM's ``vllm.engine.arg_utils`` (a re-export of ``serving/engine_args.py``; a vLLM path, not a
module of the engine layer: tests/test_layout.py lists it with the other vLLM paths)."""

from qwen_ops.serving.engine_args import AsyncEngineArgs, EngineArgs

__all__ = ["EngineArgs", "AsyncEngineArgs"]
