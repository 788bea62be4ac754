"""benchmarks/bench_gguf.py reports no speed for a configuration whose greedy tokens differ from the reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="the tiny file is written with ggml's gguf package")

from test_gguf import T, tiny_model, write_gguf  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gguf.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrong_tokens_fail_the_speed_run(tmp_path):
    bench = _bench()
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model("qwen3"), path, "qwen3", T.Q4_1)
    from qwen_ops import LLM, SamplingParams

    right = list(LLM(str(path), kv_cache_bytes=1 << 24).chat(bench.QUESTION, SamplingParams(
        temperature=0, max_tokens=bench.CHECK_TOKENS), use_tqdm=False)[0].outputs[0].token_ids)
    wrong = [(t + 1) % 320 for t in right]
    with pytest.raises(SystemExit, match=r"gguf: greedy tokens .* differ from the reference"):
        bench.measure_ours(path, "gguf", 1, wrong, 320, 256)
    result = bench.measure_ours(path, "gguf", 1, right, 320, 256)
    assert result["pp512"] > 0 and result["tg"] > 0 and result["tg8"] > 0
