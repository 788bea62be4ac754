"""vLLM's ``vllm.pooling_params`` (a re-export)."""

from qwen_ops.engine.pooling import PoolingParams

__all__ = ["PoolingParams"]
