"""vLLM's ``vllm.lora`` package: ``qwen_ops.lora.request`` holds ``LoRARequest``."""
