"""vLLM's ``vllm.inputs``: the prompt shapes (a re-export of ``serving/prompts.py``)."""

from qwen_ops.serving.prompts import PromptType, SingletonPrompt, TextPrompt, TokensPrompt

__all__ = ["PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
