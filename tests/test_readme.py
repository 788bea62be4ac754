"""Every ```python snippet in README.md runs as pasted, each in a fresh namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# A fence opening with exactly ```python (other languages and bare ``` blocks are not code to run).
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def _first_line(code: str) -> str:
    return next((line.strip() for line in code.splitlines() if line.strip()), "<empty>")[:60]


def test_extraction_finds_the_snippets():
    assert len(BLOCKS) >= 2, f"found {len(BLOCKS)} ```python blocks in {README}"
    # The extractor takes python fences only, whole and in order.
    sample = "x\n```python\na = 1\n```\n```\nnot python\n```\n```python\nb = 2\nc = 3\n```\n"
    assert python_blocks(sample) == ["a = 1\n", "b = 2\nc = 3\n"]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"{i}:{_first_line(b)}" for i, b in enumerate(BLOCKS)])
def test_readme_snippet_runs(code):
    exec(compile(code, f"README.md python block starting {_first_line(code)!r}", "exec"), {"__name__": "__readme__"})
