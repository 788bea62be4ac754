"""The qwen-ops command: --help everywhere, generate streams text, bench prints its table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qwen_ops.cli import build_parser, main

from checkpoints import make_qwen3_checkpoint


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 0
    assert "usage: qwen-ops" in capsys.readouterr().out


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "qwen_ops.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout and "bench" in out.stdout


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_cli"))


def test_bench_prints_the_table(ckpt, capsys):
    assert main(["bench", "--model", str(ckpt), "--num-requests", "6", "--prompt-len", "5", "--output-len", "4",
                 "--max-num-seqs", "4", "--max-model-len", "64", "--num-kv-blocks", "20", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    for row in ("output throughput", "TTFT p50/p90/p99", "ITL p50/p90/p99", "preemptions", "mean batch size"):
        assert row in out, row


def test_generate_without_tokenizer_is_a_clear_error(ckpt, capsys):
    assert main(["generate", "--model", str(ckpt), "hello"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "hi"]) == 2
    assert "config.json" in capsys.readouterr().err
