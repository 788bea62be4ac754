"""Tool calls in the hermes format Qwen's models write: ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call, after any text (vLLM's ``hermes`` tool-call parser).

``tool_choice="auto"``: the reply is parsed; text before the first block is the ``content``, each
block whose JSON has a string ``name`` is a call (a block that does not parse is left in the text,
as vLLM does); ``parallel_tool_calls = false`` keeps the first call only. ``"required"`` and a named function are forced with a structured output (the
arguments' schema, or an array of ``{"name", "parameters"}``: ``protocol.tool_call_schema``), so
those replies are JSON and always parse (``forced_calls``).

``stream_split(text, final)`` is the streaming view: the content so far (a tail that could still
become ``<tool_call>`` held back) and the calls whose blocks are complete; both only grow.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from qwen_ops.serving.openai.reasoning import partial_tag_tail

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_START) + r"(.*?)" + re.escape(TOOL_END), re.DOTALL)


def _call(obj) -> Optional[tuple[str, str]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _blocks(text: str) -> list[tuple[str, str]]:
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            call = _call(json.loads(m.group(1).strip()))
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    return calls


def parse_hermes(text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
    """``(content, [(name, arguments JSON)])`` of a whole reply (module docstring)."""
    at = text.find(TOOL_START)
    calls = _blocks(text) if at >= 0 else []
    if not calls:
        return text, []
    return text[:at].strip() or None, calls


def stream_split(text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
    """``(content so far, complete calls so far)`` of a streamed reply."""
    at = text.find(TOOL_START)
    if at < 0:
        hold = 0 if final else partial_tag_tail(text, TOOL_START)
        return text[:len(text) - hold], []
    return text[:at], _blocks(text)


def forced_calls(mode: str, text: str, named: Optional[dict]) -> list[tuple[str, str]]:
    """The calls of a reply forced to JSON by ``tool_choice`` "required" or a named function. An
    array cut by ``max_tokens`` still gives the calls it completed (a named call's arguments cut
    short give none)."""
    try:
        value = json.loads(text)
    except ValueError:
        if mode == "named":
            return []                    # cut by max_tokens before the JSON closed
        value = _complete_items(text)
    if mode == "named":
        return [(named["name"], json.dumps(value, ensure_ascii=False))]
    return [c for c in (_call(v) for v in value) if c is not None] if isinstance(value, list) else []


def _complete_items(text: str) -> list:
    """The items of a JSON array that are complete, however the text after them was cut."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[")
    if at < 0:
        return items
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)


def first_call_only(calls: list, parallel: Optional[bool]) -> list:
    """``parallel_tool_calls = false``: at most one call (OpenAI's meaning)."""
    return calls[:1] if parallel is False else calls


def openai_calls(calls: list[tuple[str, str]], with_index: bool = False, start: int = 0) -> list[dict]:
    """OpenAI's ``tool_calls`` objects (``index`` too, for stream deltas)."""
    out = []
    for i, (name, args) in enumerate(calls):
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}
        if with_index:
            call = {"index": start + i, **call}
        out.append(call)
    return out
