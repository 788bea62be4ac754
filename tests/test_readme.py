"""Every ```python snippet in README.md runs as pasted, each in a fresh namespace.

A snippet that talks to ``qwen-ops serve`` at its default address runs against a live server
(tests/server_fixture.py) on a free loopback port, started with the key the README's
``qwen-ops serve --api-key`` line gives; only the address in the snippet is rewritten."""

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
SERVE_ADDRESS = "http://127.0.0.1:8000"            # qwen-ops serve's default --host and --port
_SERVE_KEY = re.compile(r"qwen-ops serve\b[^\n]*--api-key\s+(\S+)")


@pytest.fixture(scope="module")
def readme_server():
    from server_fixture import make_engine, running_server

    key = _SERVE_KEY.search(README.read_text(encoding="utf-8"))
    engine = make_engine()
    try:
        with running_server(engine, api_key=key.group(1) if key else None) as server:
            yield server
    finally:
        engine.shutdown()


def _first_line(code: str) -> str:
    return next((line.strip() for line in code.splitlines() if line.strip()), "<empty>")[:60]


def test_extraction_finds_the_snippets():
    assert len(BLOCKS) >= 2, f"found {len(BLOCKS)} ```python blocks in {README}"
    # The extractor takes python fences only, whole and in order.
    sample = "x\n```python\na = 1\n```\n```\nnot python\n```\n```python\nb = 2\nc = 3\n```\n"
    assert python_blocks(sample) == ["a = 1\n", "b = 2\nc = 3\n"]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"{i}:{_first_line(b)}" for i, b in enumerate(BLOCKS)])
def test_readme_snippet_runs(code, request):
    if SERVE_ADDRESS in code:
        code = code.replace(SERVE_ADDRESS, request.getfixturevalue("readme_server").url)
    # As a script: a snippet's ``if __name__ == "__main__":`` body (needed where it spawns processes) runs.
    exec(compile(code, f"README.md python block starting {_first_line(code)!r}", "exec"), {"__name__": "__main__"})


def test_readme_prefix_caching_example_hits(capsys):
    """The prefix-caching snippet prints a hit rate above 0 (the second prompt reuses the first's
    blocks), not only runs: the oracle is the same snippet with prefix caching off, which prints 0."""
    (code,) = [b for b in BLOCKS if "prefix_cache_hit_rate" in b]
    exec(compile(code, "README.md prefix caching", "exec"), {"__name__": "__main__"})
    hit_rate = float(capsys.readouterr().out.strip().splitlines()[-1])
    off = code.replace("LLM()", "LLM(enable_prefix_caching=False)")
    assert off != code
    exec(compile(off, "README.md prefix caching, off", "exec"), {"__name__": "__main__"})
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) == 0.0
    assert hit_rate > 0, f"the README's prefix-caching example printed {hit_rate}: the shared prompt was not reused"


def test_readme_structured_and_tool_call_examples_print_valid_json(capsys, request):
    """The structured-output snippet prints a dict that validates against its schema, and the
    tool-call snippet a get_weather call whose arguments validate (issue 30); the oracle is
    ``jsonschema`` on the printed values, the same text the README shows."""
    import ast
    import json

    jsonschema = pytest.importorskip("jsonschema")
    (code,) = [b for b in BLOCKS if "structured_outputs" in b and "LLM()" in b]
    scope = {"__name__": "__main__"}
    exec(compile(code, "README.md structured outputs", "exec"), scope)
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    jsonschema.validate(ast.literal_eval(printed), scope["schema"])
    assert printed in README.read_text(encoding="utf-8"), "the README shows what the snippet prints"
    (code,) = [b for b in BLOCKS if "tool_calls" in b]
    code = code.replace(SERVE_ADDRESS, request.getfixturevalue("readme_server").url)
    scope = {"__name__": "__main__"}
    exec(compile(code, "README.md tool call", "exec"), scope)
    name, args = capsys.readouterr().out.strip().splitlines()[-1].split(" ", 1)
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), scope["tools"][0]["function"]["parameters"])
    assert f"{name} {args}" in README.read_text(encoding="utf-8"), "the README shows what the snippet prints"
