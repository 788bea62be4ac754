"""vLLM's ``vllm.v1.metrics`` package: ``reader`` holds the shapes of ``LLM.get_metrics()``."""
