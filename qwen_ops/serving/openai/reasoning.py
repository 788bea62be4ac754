"""Reasoning parsers (vLLM's ``--reasoning-parser``): split a chat completion's text into
``reasoning_content`` and ``content``.

``qwen3``: Qwen3 thinks inside ``<think> ... </think>`` and then answers. The thinking is
reasoning when the output opens with ``<think>``, or when the prompt already ends with it (the
thinking-only templates put it there). The answer is what follows ``</think>``, leading newlines
dropped. An output that never opens a think block is all content; one that opens it and stops
before ``</think>`` (``max_tokens``) is all reasoning.

``split(text, final)`` is a function of the text so far and only grows as the text does, which
is what streaming needs: the deltas are its new suffixes. While the stream is not final, a tail
that could still become ``<think>`` or ``</think>`` is held back.
"""

from __future__ import annotations

from typing import Optional

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3",)


def partial_tag_tail(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Qwen3ReasoningParser:
    def __init__(self, prompt_text: str = ""):
        self.thinking_from_prompt = prompt_text.rstrip().endswith(THINK_START)

    def split(self, text: str, final: bool = True) -> tuple[Optional[str], str]:
        """``(reasoning or None, content)`` of the text so far (module docstring)."""
        if self.thinking_from_prompt:
            body = text
        elif text.startswith(THINK_START):
            body = text[len(THINK_START):]
        elif not final and THINK_START.startswith(text):
            return None, ""                           # "<thi": wait for the rest of the tag
        else:
            return None, text
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end], body[end + len(THINK_END):].lstrip("\n")
        hold = 0 if final else partial_tag_tail(body, THINK_END)
        return body[:len(body) - hold], ""


def make_parser(name: Optional[str], prompt_text: str):
    if name is None:
        return None
    if name == "qwen3":
        return Qwen3ReasoningParser(prompt_text)
    raise ValueError(f"reasoning_parser = {name!r}, expected one of {list(REASONING_PARSERS)} or None")
