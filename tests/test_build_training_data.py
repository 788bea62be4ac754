"""Tests of ``scripts/build_training_data.py``: licence filtering, chat examples and the ChatML
rendering, checked against Jinja's rendering of the chat template string (as transformers does)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build_training_data.py"
_spec = importlib.util.spec_from_file_location("build_training_data", SCRIPT)
bd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bd  # its dataclass looks the module up while it is created
_spec.loader.exec_module(bd)

SOURCE = '''
import os


def add(a, b):
    """Return the sum of *a* and *b*.

    More detail that is not part of the request.
    """
    return a + b


# Copy a file to a folder.
@staticmethod
def copy(src, dst):
    return dst


def _helper():
    """>>> _helper()"""
    return 1
'''

EXPECTED_ADD = (
    "<|im_start|>user\nWrite a function that returns the sum of *a* and *b*.<|im_end|>\n"
    "<|im_start|>assistant\n"
    'def add(a, b):\n    """Return the sum of *a* and *b*.\n\n    More detail that is not part of the request.\n'
    '    """\n    return a + b<|im_end|>\n'
)


def test_chat_examples_render_chatml():
    examples = bd.chat_examples(SOURCE)
    assert [e["messages"][0]["content"] for e in examples] == [
        "Write a function that returns the sum of *a* and *b*.",
        "Write a function that copies a file to a folder.",
    ]  # _helper's docstring is a doctest, not a description
    add = next(e for e in examples if "sum" in e["text"])
    assert add["text"] == EXPECTED_ADD
    copy = next(e for e in examples if "copies" in e["text"])
    assert copy["messages"][1]["content"] == "@staticmethod\ndef copy(src, dst):\n    return dst"


def test_chat_template_matches_render_chat():
    jinja2 = pytest.importorskip("jinja2")
    messages = bd.chat_examples(SOURCE)[0]["messages"]
    template = jinja2.Environment().from_string(bd.CHAT_TEMPLATE)
    for generation_prompt in (False, True):
        shown = messages[:1] if generation_prompt else messages
        assert (template.render(messages=shown, add_generation_prompt=generation_prompt)
                == bd.render_chat(shown, add_generation_prompt=generation_prompt))
    assert bd.render_chat(messages[:1], add_generation_prompt=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("verb, expected", [("Return", "returns"), ("Process", "processes"),
                                            ("Copy", "copies"), ("Returns", "returns"), ("Say", "says")])
def test_third_person(verb, expected):
    assert bd.third_person(verb) == expected


@pytest.mark.parametrize("expression, permissive", [
    ("MIT", True), ("Apache-2.0 OR BSD-2-Clause", True), ("MPL-2.0 AND MIT", False), ("MPL-2.0", False),
    ("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSL-1.0", True), ("", False),
    ("GPL-3.0-only OR MIT", True), ("(MIT AND GPL-2.0)", False),
])
def test_is_permissive(expression, permissive):
    assert bd.is_permissive(expression) is permissive
