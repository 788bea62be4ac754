"""The prompt shapes ``LLM.generate`` takes, as vLLM's ``vllm.inputs`` names them (typing only: a plain
``dict`` of the same keys is the same prompt)."""

from __future__ import annotations

from typing import Any, Union

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer (special tokens added as it adds them)."""
    prompt: str
    multi_modal_data: NotRequired[Any]         # vLLM's key; an image for a text-only model is an error
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, sent as they are."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]
SingletonPrompt = PromptType

__all__ = ["TextPrompt", "TokensPrompt", "PromptType", "SingletonPrompt"]
