"""The qwen3 reasoning parser on its own: whole texts and every way of streaming them."""

from __future__ import annotations

import pytest

from qwen_ops.serving.openai.reasoning import Qwen3ReasoningParser


@pytest.mark.parametrize("text,prompt,want", [
    ("<think>\nplan\n</think>\n\nanswer", "", ("\nplan\n", "answer")),
    ("plain answer", "", (None, "plain answer")),
    ("<think>cut off by max_tokens", "", ("cut off by max_tokens", "")),
    ("plan</think>answer", "<|im_start|>assistant\n<think>\n", ("plan", "answer")),   # the template opened it
    ("a </think> inside an answer", "", (None, "a </think> inside an answer")),
    ("<think></think>\n\nno thoughts", "", ("", "no thoughts")),
])
def test_split(text, prompt, want):
    assert Qwen3ReasoningParser(prompt).split(text) == want


@pytest.mark.parametrize("text,prompt", [
    ("<think>\nplan it\n</think>\n\nthe answer </think> x", ""),
    ("plain answer with <think> later", ""),
    ("<think>never closed </thi", ""),
    ("thinking</think>\nanswer", "x<think>\n"),
])
def test_streaming_deltas_add_up_to_the_whole(text, prompt):
    """Every prefix of the text: the split only grows (so deltas are suffixes), holds back partial
    tags, and the final split equals the whole text's."""
    p = Qwen3ReasoningParser(prompt)
    sent_r, sent_c = "", ""
    for n in range(len(text) + 1):
        r, c = p.split(text[:n], final=n == len(text))
        r = r or ""
        assert r.startswith(sent_r) and c.startswith(sent_c), (n, r, c)
        assert "</think" not in r and (not text.startswith("<thi") or "<thi" not in r), (n, r)
        sent_r, sent_c = r, c
    whole = p.split(text)
    assert (sent_r, sent_c) == (whole[0] or "", whole[1])
