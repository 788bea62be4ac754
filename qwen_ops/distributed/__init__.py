"""vLLM's ``vllm.distributed``, for the name its examples import: ``cleanup_dist_env_and_memory``."""

from qwen_ops.engine.distributed import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
