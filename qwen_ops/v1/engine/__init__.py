"""vLLM's ``vllm.v1.engine`` package: ``async_llm`` holds ``AsyncLLM``."""
