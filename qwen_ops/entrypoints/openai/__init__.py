"""vLLM's ``vllm.entrypoints.openai`` package; the server itself is ``qwen_ops/serving/openai/``."""
