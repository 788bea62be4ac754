"""The qwen-ops command: --help everywhere, generate streams text, bench prints its table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwen_ops.serving.cli import build_parser, main

from checkpoints import make_qwen3_checkpoint


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 0
    assert "usage: qwen-ops" in capsys.readouterr().out


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "qwen_ops.serving.cli", "--help"], capture_output=True, text=True)
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


# ----------------------------------------------------------------------------- errors: one line, no traceback
def _one_error_line(captured) -> str:
    """The single non-empty stderr line of ``captured`` (a capsys.readouterr() result)."""
    err_lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err_lines) == 1, err_lines
    assert err_lines[0].startswith("error: "), err_lines
    assert "Traceback" not in err_lines[0]
    return err_lines[0]


@pytest.fixture
def no_debug_env(monkeypatch):
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)


def test_debug_flag_parses_before_and_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["--debug", "generate", "hi"]).debug is True
    assert parser.parse_args(["generate", "--debug", "hi"]).debug is True
    assert parser.parse_args(["generate", "hi"]).debug is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_generate_on_cuda_without_cuda_is_one_line(ckpt, capsys, no_debug_env):
    assert main(["generate", "--device", "cuda", "hi"]) != 0       # the embedded model
    captured = capsys.readouterr()
    line = _one_error_line(captured)
    assert "device = 'cuda', but this torch build has no CUDA" in line and "device='cpu'" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_generate_on_cuda_without_cuda_raises_with_debug(ckpt, capsys, no_debug_env):
    with pytest.raises(ValueError, match="device = 'cuda', but"):
        main(["--debug", "generate", "--device", "cuda", "--model", str(ckpt), "hi"])


def test_bad_device_name_is_one_line(ckpt, capsys, no_debug_env):
    assert main(["generate", "--device", "gpu0", "--model", str(ckpt), "hi"]) != 0
    captured = capsys.readouterr()
    assert "device = 'gpu0', expected 'cpu', 'cuda' or 'cuda:N'" in _one_error_line(captured)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_triton_backend_without_a_gpu_is_one_line(ckpt, capsys, monkeypatch, no_debug_env):
    monkeypatch.setenv("QWEN_OPS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")      # conftest turns the interpreter on for CPU runs
    argv = ["bench", "--model", str(ckpt), "--num-requests", "1", "--prompt-len", "2", "--output-len", "1",
            "--max-model-len", "16", "--num-kv-blocks", "4", "--block-size", "4"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "backend 'triton' is unavailable" in _one_error_line(captured)
    # QWEN_OPS_DEBUG=1 (the package's debug switch) lets the exception through, like --debug.
    monkeypatch.setenv("QWEN_OPS_DEBUG", "1")
    with pytest.raises(RuntimeError, match="backend 'triton' is unavailable"):
        main(argv)


def test_unexpected_exception_is_one_line_and_names_its_type(ckpt, capsys, monkeypatch, no_debug_env):
    import qwen_ops.serving.llm

    def broken(*args, **kwargs):
        raise KeyError("boom\nsecond line")

    monkeypatch.setattr(qwen_ops.serving.llm.LLM, "__init__", broken)
    assert main(["generate", "--model", str(ckpt), "hi"]) == 1
    captured = capsys.readouterr()
    line = _one_error_line(captured)
    assert line.startswith("error: KeyError: ") and "boom" in line and "--debug" in line
    with pytest.raises(KeyError):
        main(["generate", "--model", str(ckpt), "--debug", "hi"])


def test_keyboard_interrupt_prints_interrupted_and_returns_130(ckpt, capsys, monkeypatch):
    import qwen_ops.serving.llm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(qwen_ops.serving.llm.LLM, "__init__", interrupted)
    assert main(["generate", "--model", str(ckpt), "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


# ----------------------------------------------------------------------------- bench: validated up front
BENCH_TINY = ["--max-num-seqs", "2", "--num-kv-blocks", "8", "--block-size", "4"]


@pytest.mark.parametrize("flag", ["--prompt-len", "--output-len", "--num-requests"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_bench_rejects_counts_below_one(flag, value, ckpt, capsys, no_debug_env):
    assert main(["bench", "--model", str(ckpt), flag, value] + BENCH_TINY) == 2
    captured = capsys.readouterr()
    assert _one_error_line(captured) == f"error: {flag} = {value}, expected >= 1"
    assert captured.out == ""


@pytest.mark.parametrize("prompt_len", [16, 20])
def test_bench_with_prompts_too_long_for_max_model_len_fails(prompt_len, ckpt, capsys, no_debug_env):
    argv = ["bench", "--model", str(ckpt), "--num-requests", "3", "--prompt-len", str(prompt_len),
            "--output-len", "2", "--max-model-len", "16"] + BENCH_TINY
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured)
    assert line.startswith(f"error: prompts[0] has {prompt_len} tokens; max_model_len = 16"), line
    assert "throughput" not in captured.out


def test_bench_without_generated_tokens_prints_no_throughput(ckpt, capsys, monkeypatch, no_debug_env):
    import qwen_ops.serving.llm

    monkeypatch.setattr(qwen_ops.serving.llm.LLM, "stream", lambda self, prompts, params: iter(()))
    argv = ["bench", "--model", str(ckpt), "--num-requests", "2", "--prompt-len", "3", "--output-len", "2",
            "--max-model-len", "16"] + BENCH_TINY
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1].startswith("error: no tokens were generated")
    assert "throughput" not in captured.out


@pytest.mark.parametrize("argv, expected", [
    (["--num-requests", "1000000000"], "--num-requests = 1000000000, expected at most 100000"),
    (["--prompt-len", "1000000000"], "prompts[0] has 1000000000 tokens; max_model_len = "),
    (["--block-size", "1000000000"], "block_size = 1000000000"),
    (["--num-kv-blocks", "1000000000000"], "num_kv_blocks = 1000000000000"),
])
def test_bench_sizes_are_bounded_before_anything_is_built(argv, expected, capsys, no_debug_env):
    assert main(["bench", *argv]) == 2                   # the embedded model
    assert expected in _one_error_line(capsys.readouterr())


def test_help_does_not_import_torch():
    # qwen-ops --help answers from qwen_ops_cli before torch loads (2 s, 6-9 s on a busy machine).
    probe = ("import sys, qwen_ops_cli\ntry:\n    qwen_ops_cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), out.stdout + out.stderr
    assert "usage: qwen-ops" in out.stdout


def test_speculative_config_flag(capsys, no_debug_env):
    """--speculative-config is vLLM's JSON: parsed on generate, bench and serve; bad JSON or a bad
    method is one line naming the flag or the field."""
    parser = build_parser()
    for cmd in (["generate", "hi"], ["bench"], ["serve"]):
        args = parser.parse_args(cmd + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
        assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--speculative-config", "{method: ngram}"])
    assert "argument --speculative-config: '{method: ngram}' is not JSON" in capsys.readouterr().err
    assert main(["generate", "def f():", "--speculative-config", '{"method": "medusa"}']) != 0
    assert "speculative_config.method = 'medusa', expected one of" in capsys.readouterr().err


def test_generate_with_ngram_speculation_prints_the_same_text(capsys):
    """The embedded model with and without n-gram speculation: the same greedy text."""
    assert main(["generate", "def fibonacci(n):", "--max-tokens", "24"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "def fibonacci(n):", "--max-tokens", "24", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 4}']) == 0
    spec = capsys.readouterr().out
    text = plain.rsplit("\n[24 tokens", 1)[0]
    assert len(text) > 40 and spec.rsplit("\n[24 tokens", 1)[0] == text


def test_serve_flags_of_vllm():
    """serve takes vLLM's --tensor-parallel-size, --[no-]enable-prefix-caching and --reasoning-parser."""
    args = build_parser().parse_args(["serve", "-tp", "2", "--no-enable-prefix-caching", "--reasoning-parser", "qwen3"])
    assert (args.tensor_parallel_size, args.enable_prefix_caching, args.reasoning_parser) == (2, False, "qwen3")
    args = build_parser().parse_args(["serve"])
    assert (args.tensor_parallel_size, args.enable_prefix_caching, args.reasoning_parser) == (1, True, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
