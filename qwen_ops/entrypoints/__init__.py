"""vLLM's ``vllm.entrypoints`` package: ``llm`` (``LLM``) and ``openai.api_server`` (the server, run
as ``python -m qwen_ops.entrypoints.openai.api_server --model M``)."""
