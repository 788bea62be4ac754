"""EngineArgs (issue 61): one dataclass of the engine's arguments, the keywords of ``LLM`` and the
flags of every ``qwen-ops`` command, checked in one place (``validate``) with the same words
offline and served. Oracles: the keywords and defaults ``LLM.__init__`` had before EngineArgs
(written out below), and ``LLM(...)``'s own error for each bad value."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.cli import build_parser, main
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.llm import LLM

# LLM.__init__'s keywords and defaults before issue 61 (its signature then, copied by hand).
LLM_KEYWORDS_BEFORE = {
    "model": None, "dtype": "float32", "device": "cpu", "max_num_seqs": 64, "max_model_len": None, "block_size": 16,
    "num_kv_blocks": None, "max_num_batched_tokens": None, "preemption_mode": "recompute", "kv_cache_bytes": None,
    "swap_space": None, "check_invariants": False, "compile": None, "decode_buckets": None, "cuda_graphs": None,
    "compile_backend": "inductor", "backend": None, "enable_prefix_caching": True, "tensor_parallel_size": 1,
    "tp_port": None, "quantization": None, "speculative_config": None, "kv_cache_dtype": "auto",
    "calculate_kv_scales": False, "seed": None, "enforce_eager": False, "gpu_memory_utilization": None,
    "generation_config": "auto", "max_grammar_compile_seconds": None, "enable_lora": False, "max_loras": 1,
    "max_lora_rank": 16, "max_cpu_loras": None, "runner": "auto", "task": None, "hf_overrides": None,
    "tokenizer": None,
}

# The fields issue 62 added (vLLM's arguments), with vLLM's defaults, and dtype's new default ("auto", vLLM's).
ISSUE_62_FIELDS = {
    "kv_cache_memory_bytes": None, "num_gpu_blocks_override": None, "trust_remote_code": False,
    "tokenizer_mode": "auto", "skip_tokenizer_init": False, "revision": None, "tokenizer_revision": None,
    "code_revision": None, "download_dir": None, "hf_token": None, "load_format": "auto", "config_format": "auto",
    "max_logprobs": 20, "enable_chunked_prefill": None, "override_generation_config": None,
    "disable_log_stats": False, "scheduling_policy": "fcfs", "pipeline_parallel_size": 1, "data_parallel_size": 1,
    "distributed_executor_backend": None, "served_model_name": None, "vllm_options": None,
}
FIELDS_NOW = {**LLM_KEYWORDS_BEFORE, "dtype": "auto", **ISSUE_62_FIELDS}

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}

# A value other than the default for every field that has a flag, and the flags that say it.
# (Parsed only: these are not meant to build an engine together.)
EVERY_FLAG = [
    ("model", "/ckpt", ["--model", "/ckpt"]),
    ("dtype", "bfloat16", ["--dtype", "bfloat16"]),
    ("device", "cuda:1", ["--device", "cuda:1"]),
    ("max_num_seqs", 4, ["--max-num-seqs", "4"]),
    ("max_model_len", 256, ["--max-model-len", "256"]),
    ("block_size", 8, ["--block-size", "8"]),
    ("num_kv_blocks", 100, ["--num-kv-blocks", "100"]),
    ("max_num_batched_tokens", 128, ["--max-num-batched-tokens", "128"]),
    ("preemption_mode", "swap", ["--preemption-mode", "swap"]),
    ("kv_cache_bytes", 1 << 20, ["--kv-cache-bytes", str(1 << 20)]),
    ("swap_space", 0.5, ["--swap-space", "0.5"]),
    ("check_invariants", True, ["--check-invariants"]),
    ("compile", False, ["--no-compile"]),
    ("decode_buckets", [1, 2, 4], ["--decode-buckets", "1", "2", "4"]),
    ("cuda_graphs", True, ["--cuda-graphs"]),
    ("compile_backend", "tensorrt", ["--compile-backend", "tensorrt"]),
    ("enable_prefix_caching", False, ["--no-enable-prefix-caching"]),
    ("tensor_parallel_size", 2, ["-tp", "2"]),
    ("tp_port", 29500, ["--tp-port", "29500"]),
    ("quantization", "int8", ["-q", "int8"]),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 3},
     ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']),
    ("kv_cache_dtype", "fp8", ["--kv-cache-dtype", "fp8"]),
    ("calculate_kv_scales", True, ["--calculate-kv-scales"]),
    ("seed", 7, ["--seed", "7"]),
    ("enforce_eager", True, ["--enforce-eager"]),
    ("gpu_memory_utilization", 0.5, ["--gpu-memory-utilization", "0.5"]),
    ("generation_config", "vllm", ["--generation-config", "vllm"]),
    ("max_grammar_compile_seconds", 2.5, ["--max-grammar-compile-seconds", "2.5"]),
    ("enable_lora", True, ["--enable-lora"]),
    ("max_loras", 2, ["--max-loras", "2"]),
    ("max_lora_rank", 8, ["--max-lora-rank", "8"]),
    ("max_cpu_loras", 4, ["--max-cpu-loras", "4"]),
    ("runner", "pooling", ["--runner", "pooling"]),
    ("task", "embed", ["--task", "embed"]),
    ("hf_overrides", RERANKER, ["--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"], '
                                                  '"classifier_from_token": ["no", "yes"]}']),
    ("tokenizer", "/tok", ["--tokenizer", "/tok"]),
    ("kv_cache_memory_bytes", 1 << 21, ["--kv-cache-memory-bytes", str(1 << 21)]),
    ("num_gpu_blocks_override", 50, ["--num-gpu-blocks-override", "50"]),
    ("trust_remote_code", True, ["--trust-remote-code"]),
    ("tokenizer_mode", "hf", ["--tokenizer-mode", "hf"]),
    ("skip_tokenizer_init", True, ["--skip-tokenizer-init"]),
    ("revision", "v1", ["--revision", "v1"]),
    ("tokenizer_revision", "v2", ["--tokenizer-revision", "v2"]),
    ("code_revision", "v3", ["--code-revision", "v3"]),
    ("download_dir", "/dl", ["--download-dir", "/dl"]),
    ("hf_token", "tok", ["--hf-token", "tok"]),
    ("load_format", "safetensors", ["--load-format", "safetensors"]),
    ("config_format", "hf", ["--config-format", "hf"]),
    ("max_logprobs", 5, ["--max-logprobs", "5"]),
    ("enable_chunked_prefill", True, ["--enable-chunked-prefill"]),
    ("override_generation_config", {"temperature": 0.5}, ["--override-generation-config", '{"temperature": 0.5}']),
    ("disable_log_stats", True, ["--disable-log-stats"]),
    ("scheduling_policy", "fcfs", ["--scheduling-policy", "fcfs"]),
    ("pipeline_parallel_size", 1, ["-pp", "1"]),
    ("data_parallel_size", 1, ["-dp", "1"]),
    ("distributed_executor_backend", "mp", ["--distributed-executor-backend", "mp"]),
]
NO_FLAG = {"backend", "served_model_name", "vllm_options"}   # a keyword, not a flag (serve has its own --served-model-name; vLLM's other arguments have theirs)


def _parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_fields_are_the_keywords_llm_had_with_their_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert fields == FIELDS_NOW
    assert EngineArgs() == EngineArgs(**{**LLM_KEYWORDS_BEFORE, "dtype": "auto"})


def test_llm_takes_the_fields_and_nothing_else():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(None, max_num_seq=4)                       # a misspelt keyword, as before EngineArgs
    with pytest.raises(TypeError, match="max_num_seq"):
        AsyncLLM.from_pretrained(None, max_num_seq=4)  # in the caller, before a process starts
    with pytest.raises(TypeError):
        LLM(None, "float32")                           # keywords only, after the model
    assert EngineArgs(None, **{n: v for n, v in LLM_KEYWORDS_BEFORE.items() if n != "model"}).llm_kwargs() == {
        n: v for n, v in {**FIELDS_NOW, **LLM_KEYWORDS_BEFORE}.items() if n != "model"}


def test_every_field_has_its_flag():
    assert {name for name, _, _ in EVERY_FLAG} | NO_FLAG == set(FIELDS_NOW)
    argv = [a for _, _, flags in EVERY_FLAG for a in flags]
    assert _parse(argv) == EngineArgs(**{name: value for name, value, _ in EVERY_FLAG})


@pytest.mark.parametrize("argv, kwargs", [
    ([], {}),
    (["--max-num-seqs", "4", "--max-model-len", "128", "--compile"], dict(max_num_seqs=4, max_model_len=128,
                                                                          compile=True)),
    (["--dtype", "bfloat16", "--enable-prefix-caching", "--no-cuda-graphs"], dict(dtype="bfloat16",
                                                                                  cuda_graphs=False)),
    (["--enable-lora", "--max-loras", "3", "--swap-space", "2"], dict(enable_lora=True, max_loras=3, swap_space=2.0)),
])
def test_flags_round_trip(argv, kwargs):
    assert _parse(argv) == EngineArgs(**kwargs)


def test_the_commands_keep_their_flags_and_defaults():
    parse = build_parser().parse_args
    serve = parse(["serve", "/ckpt", "--max-num-seqs", "4", "-tp", "2", "--no-enable-prefix-caching", "--compile",
                   "--runner", "pooling", "--enable-lora", "--max-lora-rank", "8", "--port", "0"])
    assert EngineArgs.from_cli_args(serve) == EngineArgs(
        "/ckpt", max_num_seqs=4, tensor_parallel_size=2, enable_prefix_caching=False, compile=True, runner="pooling",
        enable_lora=True, max_lora_rank=8, max_grammar_compile_seconds=5.0)      # serve bounds grammars: 5 s
    assert EngineArgs.from_cli_args(parse(["serve"])) == EngineArgs(max_grammar_compile_seconds=5.0)
    # generate's and chat's --seed seed their requests, bench's its prompts: not the engine's seed.
    generate = parse(["generate", "hi", "--seed", "3", "--model", "/m", "--num-kv-blocks", "9", "-q", "int8"])
    assert generate.sampling_seed == 3
    assert EngineArgs.from_cli_args(generate) == EngineArgs("/m", num_kv_blocks=9, quantization="int8")
    chat = parse(["chat", "/m", "--seed", "4", "--preemption-mode", "swap"])
    assert chat.sampling_seed == 4 and EngineArgs.from_cli_args(chat) == EngineArgs("/m", preemption_mode="swap")
    bench = parse(["bench", "--seed", "5", "--block-size", "4"])
    assert bench.prompt_seed == 5 and EngineArgs.from_cli_args(bench) == EngineArgs(block_size=4)
    perplexity = parse(["perplexity", "/m", "--text", "pydoc", "--seed", "6", "--kv-cache-dtype", "fp8"])
    assert EngineArgs.from_cli_args(perplexity) == EngineArgs("/m", seed=6, kv_cache_dtype="fp8")


# Each bad value, as keywords and as flags.
BAD_VALUES = [
    (dict(max_num_seqs=0), ["--max-num-seqs", "0"]),
    (dict(dtype="float13"), ["--dtype", "float13"]),
    (dict(preemption_mode="x"), ["--preemption-mode", "x"]),
    (dict(kv_cache_dtype="fp4"), ["--kv-cache-dtype", "fp4"]),
    (dict(runner="embed"), ["--runner", "embed"]),
    (dict(max_model_len=1), ["--max-model-len", "1"]),
    (dict(swap_space=-1.0), ["--swap-space", "-1"]),
    (dict(gpu_memory_utilization=1.5), ["--gpu-memory-utilization", "1.5"]),
    (dict(enforce_eager=True, compile=True), ["--enforce-eager", "--compile"]),
    (dict(enable_lora=True, max_loras=0), ["--enable-lora", "--max-loras", "0"]),
    (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), ["--enable-lora", "--max-loras", "2",
                                                            "--max-cpu-loras", "1"]),
    (dict(speculative_config={"method": "medusa"}), ["--speculative-config", '{"method": "medusa"}']),
    (dict(device="tpu"), ["--device", "tpu"]),
    (dict(compile_backend="xla"), ["--compile-backend", "xla"]),
]


@pytest.mark.parametrize("kwargs, argv", BAD_VALUES, ids=[next(iter(k)) for k, _ in BAD_VALUES])
def test_a_bad_value_is_the_same_error_offline_and_served(kwargs, argv, capsys, monkeypatch):
    import qwen_ops.models.defaults
    import qwen_ops.serving.async_llm
    import qwen_ops.serving.openai.server

    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    monkeypatch.delenv("QWEN_OPS_API_KEY", raising=False)
    # Refused before anything happens: no checkpoint is looked up, no port bound, no process started.
    for module, name in ((qwen_ops.models.defaults, "resolve_model_path"),
                         (qwen_ops.serving.openai.server, "bind_socket"), (qwen_ops.serving.async_llm, "ProcessCore")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))
    with pytest.raises(ValueError) as offline:
        LLM(**kwargs)
    message = str(offline.value)
    assert " = " in message and "expected" in message, message      # names the argument, value and expectation
    with pytest.raises(ValueError) as in_caller:
        AsyncLLM.from_pretrained(**kwargs)              # the engine's process never starts
    assert str(in_caller.value) == message
    for command in (["serve", *argv, "--port", "0"], ["generate", *argv, "hi"]):
        assert main(command) == 2
        assert capsys.readouterr().err.strip() == f"error: {message}", command
