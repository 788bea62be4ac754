"""LLM: vLLM-style offline generation, a client of the engine core (``serving/engine_core.py``).

    llm = qwen_ops.LLM()                       # the embedded default model
    outs = llm.generate(["def fibonacci(n):"], qwen_ops.SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

Each iteration is one ``EngineCore.step``: schedule, one forward pass over the merged prefill
chunks and decodes with sampling, update, outputs.

An ``LLM`` may be shared by threads: every call into the core (``add_request``, ``step``,
``abort``, ``stats``, and each iteration inside ``generate`` and ``stream``) holds the core's
lock. Concurrent ``generate`` calls therefore interleave their iterations, and requests from
several threads share forward passes; each caller gets exactly its own outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from qwen_ops.engine.batch import RequestId
from qwen_ops.engine.engine import QwenEngine, _compile_backend
from qwen_ops.engine.lora import LoRARequest
from qwen_ops.models.config import FULL_ATTENTION, QwenConfig
from qwen_ops.models.loader import resolve_dtype
from qwen_ops.ops.kv_quant import resolve_kv_cache_dtype
from qwen_ops.ops.memory import available_bytes, host_total_bytes
from qwen_ops.models.parallel import check_tp_config
from qwen_ops.models.tokenizer import QwenTokenizer
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.engine.speculative import SpeculativeConfig
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.engine_core import EngineCore
from qwen_ops.serving.outputs import CompletionOutput, RequestOutput, num_cached_tokens  # noqa: F401
from qwen_ops.serving.pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                      EmbeddingRequestOutput, PoolingOutput, PoolingParams,  # noqa: F401
                                      PoolingRequestOutput, ScoringRequestOutput, check_pooling_task,
                                      classifier_probs, classifier_tokens, pooling_tasks, reranker_head,
                                      resolve_runner, run_pooling, run_pooling_requests, split_hf_overrides,
                                      ScorePlan)
from qwen_ops.models.pooler_config import PoolerConfig, is_embedding_checkpoint, read_pooler_config
from qwen_ops.engine.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int], torch.Tensor]

DEFAULT_KV_CACHE_BYTES = 1 << 30     # KV budget when num_kv_blocks is None on the CPU
CUDA_GRAPH_RESERVE_BYTES = 1 << 30   # kept free on a GPU for activations and CUDA-graph capture
MAX_DEFAULT_SWAP_SPACE_BYTES = 4 << 30   # vLLM's default swap_space (4 GiB)
PROMPTS_EXPECTED = ("a str, a list of token ids, a 1-D integer tensor, a dict {'prompt': str} or "
                    "{'prompt_token_ids': [...]} (vLLM's TextPrompt / TokensPrompt), or a list of those")


class _ProgressBar:
    """``LLM.generate``'s progress bar (vLLM's): prompts done, and input / output tokens per second
    of the prompts done so far."""

    def __init__(self, use_tqdm, states) -> None:
        if callable(use_tqdm) and not isinstance(use_tqdm, bool):
            factory = use_tqdm
        else:
            from tqdm.auto import tqdm as factory
        self.states = states
        self.done = [False] * len(states)
        self.num_done = 0
        self.tokens_in = self.tokens_out = 0
        self.start = time.perf_counter()
        self.bar = factory(total=len(states), desc="Processed prompts", dynamic_ncols=True,
                           postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

    def update(self) -> bool:
        """Count the prompts finished since the last call; True when every one has."""
        new = 0
        for i, st in enumerate(self.states):
            if not self.done[i] and st.finished:
                self.done[i] = True
                new += 1
                self.tokens_in += len(st.prompt_token_ids)
                self.tokens_out += sum(len(c.request.output_token_ids) for c in st.completions)
        if new:
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            self.bar.postfix = (f"est. speed input: {self.tokens_in / elapsed:.2f} toks/s, "
                                f"output: {self.tokens_out / elapsed:.2f} toks/s")
            self.bar.update(new)
            self.num_done += new
        return self.num_done == len(self.states)

    def close(self) -> None:
        self.bar.close()


# vLLM's environment variable naming the torch profiler's trace folder (its older spelling of
# profiler_config's torch_profiler_dir).
PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


def profiler_dir(profiler_config) -> Path:
    """The folder ``LLM.start_profile`` writes its trace to: vLLM's ``profiler_config`` (a dict or an object
    with ``profiler`` and ``torch_profiler_dir``) if it names one, else $VLLM_TORCH_PROFILER_DIR."""
    if profiler_config is not None:
        get = profiler_config.get if isinstance(profiler_config, dict) else (
            lambda k: getattr(profiler_config, k, None))
        kind, folder = get("profiler"), get("torch_profiler_dir")
        if kind not in (None, "torch"):
            raise ValueError(f"profiler_config.profiler = {kind!r}, but only the torch profiler runs here; "
                             "expected 'torch'")
        if folder:
            return Path(folder).expanduser().resolve()
    folder = os.environ.get(PROFILER_DIR_ENV, "").strip()
    if folder:
        return Path(folder).expanduser().resolve()
    raise RuntimeError("Profiling is not enabled: no trace folder is set. Set profiler_config="
                       "{'profiler': 'torch', 'torch_profiler_dir': DIR} (vLLM's --profiler-config) or "
                       f"${PROFILER_DIR_ENV}=DIR before start_profile")


class _TorchProfile:
    """One ``start_profile`` .. ``stop_profile`` session of ``torch.profiler`` in this process (the
    engine core and, on one rank, the model); ``stop`` writes its Chrome trace (``chrome://tracing``,
    Perfetto) into ``folder``."""

    def __init__(self, folder: Path, prefix: Optional[str], device: torch.device):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.path = folder / f"{prefix or 'qwen_ops'}_pid{os.getpid()}_{time.time_ns()}.pt.trace.json"
        folder.mkdir(parents=True, exist_ok=True)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def stop(self) -> Path:
        self.profiler.stop()
        self.profiler.export_chrome_trace(str(self.path))
        return self.path


def default_swap_space_bytes() -> int:
    """Host memory for swapped KV: a quarter of physical memory, at most 4 GiB (vLLM's default)."""
    host = host_total_bytes()
    return min(MAX_DEFAULT_SWAP_SPACE_BYTES, (16 << 30 if host is None else host) // 4)


def normalize_prompts(prompts) -> list:
    """One list of prompts from what ``generate``/``stream`` accept: a str, a list of token ids, a
    1-D tensor (one prompt), a 2-D tensor (one prompt per row), or a list of those."""
    if prompts is None:
        raise ValueError(f"prompts = None, expected {PROMPTS_EXPECTED}")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise ValueError(f"prompts is a tensor of shape {tuple(prompts.shape)}, expected 1-D (one prompt) "
                         "or 2-D (one prompt per row)")
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts = {prompts!r}, expected {PROMPTS_EXPECTED}")
    if prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
        return [prompts]
    return list(prompts)


def _rss_bytes() -> int:
    """This process's resident memory now (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_kv_budget(utilization: float) -> int:
    """vLLM-CPU's KV budget for ``gpu_memory_utilization`` (on the CPU backend, despite its name, the share of
    the RAM this engine may take): that share of the RAM less what the process already holds (the weights),
    with vLLM-CPU's errors when it is more than is available or nothing is left."""
    GiB = float(1 << 30)
    total, available = host_total_bytes(), available_bytes(torch.device("cpu"))
    if total is None or available is None:
        raise ValueError(f"gpu_memory_utilization = {utilization} on the CPU is a share of the RAM, which this "
                         "system does not report (/proc/meminfo); give kv_cache_memory_bytes instead")
    requested = math.ceil(total * utilization)
    if requested > available:
        raise ValueError(f"Available memory ({available / GiB:.2f}/{total / GiB:.2f} GiB) is less than desired CPU "
                         f"memory utilization ({utilization}, {requested / GiB:.2f} GiB). On the CPU, "
                         "`gpu_memory_utilization` is the fraction of CPU memory reserved (despite its name): "
                         "decrease it, or give `kv_cache_memory_bytes`.")
    consumed = _rss_bytes()
    if requested - consumed <= 0:
        raise ValueError(f"gpu_memory_utilization = {utilization} reserves {requested / GiB:.2f} GiB of "
                         f"{total / GiB:.2f} GiB of CPU memory, but this process already uses "
                         f"{consumed / GiB:.2f} GiB, which leaves nothing for the KV cache; increase it, or give "
                         "`kv_cache_memory_bytes`.")
    return requested - consumed


def _default_kv_budget(device: torch.device, utilization: Optional[float] = None) -> int:
    """Bytes for the KV cache: 1 GiB on the CPU, or with ``utilization`` vLLM-CPU's share of the RAM
    (``_cpu_kv_budget``); on a GPU, 90% of what is
    free after the weights, or with ``utilization`` that share of the whole device less what is in
    use, less a reserve for activations and graph capture, taken before the cache is sized."""
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_BYTES if utilization is None else _cpu_kv_budget(utilization)
    free, total = torch.cuda.mem_get_info(device)
    if utilization is None:
        return max(0, int(0.9 * (free - CUDA_GRAPH_RESERVE_BYTES)))
    return max(0, int(utilization * total - (total - free) - CUDA_GRAPH_RESERVE_BYTES))


# generation_config.json keys that vLLM takes as sampling defaults, and their SamplingParams names.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_overrides(model_path: Path, generation_config: Union[str, Path] = "auto") -> dict:
    """The ``SamplingParams`` fields ``generation_config`` sets (vLLM's ``get_diff_sampling_param``):
    the defaults of ``LLM`` calls without parameters and of server requests' unset fields."""
    import json

    if generation_config == "vllm":
        return {}
    folder = Path(model_path) if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config = {str(generation_config)!r}, expected 'auto', 'vllm' or a directory "
                         "holding generation_config.json")
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        cfg = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    kwargs = {name: cfg[key] for key, name in GENERATION_CONFIG_KEYS.items() if cfg.get(key) is not None}
    try:
        SamplingParams(**kwargs)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return kwargs


def _encode(tokenizer: Optional[QwenTokenizer], prompt: Prompt, index: int) -> list[int]:
    if isinstance(prompt, dict):                 # vLLM's TextPrompt / TokensPrompt
        keys = set(prompt)
        if keys == {"prompt_token_ids"}:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, torch.Tensor)):
                raise ValueError(f"prompts[{index}]['prompt_token_ids'] = {ids!r}, expected a list of token ids")
            return _encode(tokenizer, ids, index)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return _encode(tokenizer, prompt["prompt"], index)
        raise ValueError(f"prompts[{index}] is a dict with keys {sorted(map(str, keys))}, expected exactly "
                         "'prompt' (a str) or 'prompt_token_ids' (token ids)")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompts[{index}] is text, but the checkpoint has no tokenizer.json; "
                             "pass token ids instead")
        return tokenizer.encode(prompt)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex:
            raise ValueError(f"prompts[{index}] is a {prompt.dtype} tensor of shape {tuple(prompt.shape)}, "
                             "expected a 1-D integer tensor of token ids")
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise ValueError(f"prompts[{index}] = {prompt!r}, expected a str, a list of token ids or a 1-D tensor")
    return list(prompt)


def prepare_requests(prompts: Union[Prompt, Sequence[Prompt]],
                     sampling_params: Union[SamplingParams, Sequence[SamplingParams], None], *,
                     tokenizer: Optional[QwenTokenizer], vocab_size: int, max_model_len: int
                     ) -> list[tuple[Prompt, list[int], SamplingParams]]:
    """Validate every request before any work; errors name the request index.

    The one validation of ``LLM.generate``, ``stream`` and ``add_request``, and of ``AsyncLLM``
    (which runs it in the caller, also when the engine runs in another process)."""
    prompts = normalize_prompts(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
        params = list(sampling_params)
    else:
        raise ValueError(f"sampling_params = {sampling_params!r}, expected a SamplingParams, a list of them "
                         "(one per prompt), or None")
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params has {len(params)} entries, expected one per prompt ({len(prompts)})")
    out = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params[{i}] = {sp!r}, expected a qwen_ops.SamplingParams")
        sp.check_vocab(vocab_size)
        if sp.stop and tokenizer is None:
            raise ValueError(f"sampling_params[{i}].stop = {list(sp.stop)!r}, but the checkpoint has no "
                             "tokenizer.json to decode text with; use stop_token_ids")
        ids = _encode(tokenizer, prompt, i)
        if not ids:
            raise ValueError(f"prompts[{i}] is empty; expected at least one token")
        if len(ids) >= max_model_len:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens; max_model_len = {max_model_len} leaves no room "
                             "to generate")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompts[{i}][{j}] = {t!r}, expected a token id in [0, {vocab_size})")
        # each request keeps its own copy: the caller may change or reuse its SamplingParams afterwards
        out.append((prompt, ids, sp.clone().with_bad_words_token_ids(tokenizer)))
    return out


def pooling_ids(prompts, *, tokenizer: Optional[QwenTokenizer], vocab_size: int, max_model_len: int
                ) -> list[list[int]]:
    """The token ids of pooling prompts (``LLM.embed``'s and ``AsyncLLM.embed``'s: as ``generate``'s,
    up to ``max_model_len`` tokens, since nothing is generated); errors name the prompt index."""
    out = []
    for i, prompt in enumerate(normalize_prompts(prompts)):
        ids = _encode(tokenizer, prompt, i)
        if not ids:
            raise ValueError(f"prompts[{i}] is empty; expected at least one token")
        if len(ids) > max_model_len:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens, expected at most max_model_len = {max_model_len}")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompts[{i}][{j}] = {t!r}, expected a token id in [0, {vocab_size})")
        out.append(ids)
    return out


# vLLM's chat_template_content_format values (``LLM.chat``).
CHAT_CONTENT_FORMATS = ("auto", "string", "openai")
CHAT_TOKENIZATION_KEYS = ("add_special_tokens", "truncation", "max_length")


def _chat_tokenization_kwargs(tokenization_kwargs: Optional[dict]) -> dict:
    """``QwenTokenizer.encode``'s keywords for a rendered chat: no special tokens (the template wrote
    them, vLLM's default) unless ``tokenization_kwargs`` says otherwise."""
    if tokenization_kwargs is None:
        return {"add_special_tokens": False}
    if not isinstance(tokenization_kwargs, dict):
        raise ValueError(f"tokenization_kwargs = {tokenization_kwargs!r}, expected a dict or None")
    unknown = sorted(set(tokenization_kwargs) - set(CHAT_TOKENIZATION_KEYS))
    if unknown:
        raise ValueError(f"tokenization_kwargs has {unknown}, expected only {', '.join(CHAT_TOKENIZATION_KEYS)}")
    return {"add_special_tokens": False, **tokenization_kwargs}


def _chat_content(message: dict, content_format: str, where: str) -> dict:
    """A message with its content as the template reads it: ``"openai"`` a list of text parts (a str
    becomes one part), ``"auto"`` / ``"string"`` a str (the text parts joined by newlines, as vLLM's
    string format and the server do)."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        if content_format == "openai" and content is not None:
            return {**message, "content": [{"type": "text", "text": content}]}
        return message
    if not isinstance(content, list):
        raise ValueError(f"{where}['content'] = {content!r}, expected a str or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}['content'][{k}] = {part!r}, expected a text part {{'type': 'text', 'text': str}} "
                             "(the models here read text only)")
        texts.append(part["text"])
    return message if content_format == "openai" else {**message, "content": "\n".join(texts)}


# ----------------------------------------------------------------------------- LLM.__init__'s pieces
def _tokenizer_override(tokenizer, tokenizer_path: Optional[Path]) -> Optional[QwenTokenizer]:
    """``LLM(tokenizer=...)``'s tokenizer (None: the model's own)."""
    if tokenizer_path is None:
        return None
    from qwen_ops.models.tokenizer import load_tokenizer

    own = load_tokenizer(tokenizer_path)
    if own is None:
        raise ValueError(f"tokenizer = {str(tokenizer)!r}: {tokenizer_path} has no tokenizer.json (nor is it a "
                         "GGUF file with a tokenizer)")
    return own


def _resolve_runner(args: EngineArgs, path, spec: Optional[SpeculativeConfig]) -> str:
    """``"generate"`` or ``"pooling"`` (``"auto"``: as the checkpoint says; a reranker pools), and
    what the pooling runner cannot do with it."""
    reranker = split_hf_overrides(args.hf_overrides)[0] is not None
    runner = resolve_runner(args.runner, args.task, reranker or is_embedding_checkpoint(path))
    if runner == "pooling" and (spec is not None or args.tensor_parallel_size > 1 or args.enable_lora):
        raise ValueError(f"runner = 'pooling' with speculative_config, tensor_parallel_size = "
                         f"{args.tensor_parallel_size} or enable_lora = {args.enable_lora}; the pooling runner runs "
                         "one rank without drafts or adapters, expected none of them")
    return runner


def _max_model_len(max_model_len: Optional[int], cfg: QwenConfig) -> int:
    """``max_model_len``, else the model's own limit (``_fit_kv_cache`` lowers that to what the KV cache holds)."""
    if max_model_len is None:
        return cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len = {max_model_len}, but the model supports max_position_embeddings = "
                         f"{cfg.max_position_embeddings}; expected at most that")
    return max_model_len


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16 extension), as
    /proc/cpuinfo says; elsewhere (no such file) assumed yes, as vLLM's CPU platform does."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return True


def _resolve_dtype(dtype, cfg: QwenConfig, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype. ``"auto"`` (vLLM's default) is the checkpoint's dtype (config.json's;
    float32 where it names none, as a GGUF file), but on a CPU without bfloat16 arithmetic a bfloat16
    checkpoint loads as float32. vLLM-CPU also downcasts a float32 checkpoint to bfloat16; here it stays
    float32 (docs/vllm_compat.md says why)."""
    resolved = resolve_dtype(dtype, cfg)
    auto = isinstance(dtype, str) and dtype.strip().lower() == "auto"
    if auto and resolved == torch.bfloat16 and device.type == "cpu" and not _cpu_has_bf16():
        logger.info("dtype='auto': the checkpoint is bfloat16, which this CPU does not compute in; loading float32")
        return torch.float32
    return resolved


def _seed_everything(seed: int) -> None:
    """vLLM's ``set_random_seed`` for ``LLM(seed=...)``: Python's ``random``, numpy's and torch's global
    generators, so a script's own draws after building the engine repeat from run to run, as they do
    with vLLM (its in-process engine). The engine's own noise is the seed's, per request
    (``SchedulerConfig.seed``), and reads none of them."""
    import random

    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (1 << 32))
    except ImportError:
        pass
    torch.manual_seed(seed)


def _check_load_format(args: EngineArgs, path) -> None:
    """``load_format`` / ``config_format`` against what ``path`` is (a GGUF file or a checkpoint folder)."""
    gguf = getattr(path, "gguf", None) is not None       # resolve_model_path opened a GGUF file
    for name in ("load_format", "config_format"):
        value = getattr(args, name)
        if value == "gguf" and not gguf:
            raise ValueError(f"{name} = 'gguf', but model = {str(args.model)!r} is not a GGUF file")
        if value in ("safetensors", "hf") and gguf:
            raise ValueError(f"{name} = {value!r}, but model = {str(args.model)!r} is a GGUF file; expected 'auto' "
                             "or 'gguf'")


def generation_overrides(overrides: Optional[dict]) -> dict:
    """vLLM's ``override_generation_config``: generation-config keys (``max_new_tokens`` is ``max_tokens``)
    over the checkpoint's defaults; each must be a ``SamplingParams`` field."""
    if not overrides:
        return {}
    kwargs = {GENERATION_CONFIG_KEYS.get(k, k): v for k, v in overrides.items()}
    try:
        SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"override_generation_config = {overrides!r}: {e}") from None
    return kwargs


def _kv_block_bytes(args: EngineArgs, cfg: QwenConfig, ckpt) -> int:
    """Bytes of one KV block (keys and values of every attention layer; this rank's heads)."""
    if ckpt is not None:
        elem = resolve_kv_cache_dtype(args.kv_cache_dtype, next(ckpt.model.parameters()).dtype).itemsize
        attention_layers = list(ckpt.model.layer_kinds).count("attention")   # hybrid models: 1 in 4
        if getattr(ckpt.model, "mtp", None) is not None:       # speculative "mtp": its layer's KV too
            attention_layers += 1
        kv_heads = cfg.num_key_value_heads
    else:                               # before the load, or tensor parallel: from the config
        elem = resolve_kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype, cfg)).itemsize
        attention_layers = (list(cfg.layer_types).count(FULL_ATTENTION) if cfg.layer_types
                            else cfg.num_hidden_layers)
        spec = args.speculative()
        attention_layers += int(spec is not None and spec.method == "mtp")
        kv_heads = max(1, cfg.num_key_value_heads // args.tensor_parallel_size)
    return 2 * attention_layers * args.block_size * kv_heads * cfg.head_dim * elem


def _fit_kv_cache(args: EngineArgs, cfg: QwenConfig, ckpt, device: torch.device, max_model_len: int,
                  quiet: bool = False) -> tuple[int, int]:
    """``(max_model_len, num_kv_blocks)``. The blocks: ``num_kv_blocks`` (``num_gpu_blocks_override``), else
    what the KV budget holds (``VLLM_CPU_KVCACHE_SPACE``, ``kv_cache_memory_bytes``, else the device's
    default or ``gpu_memory_utilization``'s share), up to ``max_num_seqs`` full sequences. They must hold one
    ``max_model_len`` sequence: a ``max_model_len`` left to the model's limit is lowered to what they hold
    (logged); one that was given and does not fit is vLLM's error, with its estimate."""
    GiB = float(1 << 30)
    block_bytes = _kv_block_bytes(args, cfg, ckpt)
    num_kv_blocks = args.kv_blocks()
    budget = None
    if num_kv_blocks is None:
        budget = args.kv_cache_budget()
        if budget is None:
            budget = _default_kv_budget(device, args.gpu_memory_utilization)
        if budget < block_bytes:
            raise ValueError(f"No available memory for the cache blocks: block_size = {args.block_size} makes one "
                             f"KV block {block_bytes} bytes, more than the {budget} bytes of KV cache that is "
                             "available. Lower block_size, or increase `gpu_memory_utilization` or "
                             "`kv_cache_memory_bytes` (VLLM_CPU_KVCACHE_SPACE).")
        available = budget // block_bytes
    else:
        available = num_kv_blocks
    per_seq_blocks = -(-max_model_len // args.block_size)
    if per_seq_blocks > available:
        fits = available * args.block_size
        if args.max_model_len is None:
            if not quiet:
                logger.info("max_model_len = %d (the model's %d lowered to what the KV cache holds: %d blocks of %d; "
                            "give kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE for more)", fits, max_model_len,
                            available, args.block_size)
            max_model_len, per_seq_blocks = fits, available
        else:
            held = (f"available KV cache memory ({available * block_bytes / GiB:.2f} GiB)" if budget is not None
                    else f"num_kv_blocks = {available} ({available * block_bytes / GiB:.2f} GiB)")
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({max_model_len}), "
                f"({per_seq_blocks * block_bytes / GiB:.2f} GiB KV cache is needed, which is larger than the {held}. "
                f"Based on the available memory, the estimated maximum model length is {fits}. Try increasing "
                "`gpu_memory_utilization` or `kv_cache_memory_bytes` (VLLM_CPU_KVCACHE_SPACE on the CPU) or "
                "decreasing `max_model_len` when initializing the engine.")
    if num_kv_blocks is None:
        num_kv_blocks = min(args.max_num_seqs * per_seq_blocks, available)
    return max_model_len, num_kv_blocks


def _engine_kwargs(args: EngineArgs, max_model_len: int, num_kv_blocks: int, pooling: bool) -> dict:
    """``QwenEngine``'s keywords from the arguments (``enforce_eager``: no compile, no CUDA graphs)."""
    eager = args.enforce_eager
    kwargs = dict(max_slots=args.max_num_seqs, max_seq_len=max_model_len, block_size=args.block_size,
                  num_kv_blocks=num_kv_blocks, compile=False if eager else args.compile,
                  decode_buckets=args.decode_buckets, cuda_graphs=False if eager else args.cuda_graphs,
                  compile_backend=_compile_backend(args.compile_backend, args.backend),
                  enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                  calculate_kv_scales=args.calculate_kv_scales)
    if pooling:
        kwargs["pooling"] = True
    lora = args.lora_config()
    if lora is not None:
        kwargs["lora"] = lora
    return kwargs


def _build_engine(args: EngineArgs, path, cfg: QwenConfig, ckpt, own_tokenizer: Optional[QwenTokenizer],
                  device: torch.device, engine_kwargs: dict) -> QwenEngine:
    """The engine over the loaded checkpoint, or over ``tensor_parallel_size`` ranks that load their own."""
    if ckpt is not None:
        return QwenEngine(ckpt.model, cfg, tokenizer=own_tokenizer or ckpt.tokenizer,
                          eos_token_ids=ckpt.eos_token_ids, **engine_kwargs)
    engine = QwenEngine.from_pretrained(path, dtype=args.dtype, device=device,
                                        tensor_parallel_size=args.tensor_parallel_size, tp_port=args.tp_port,
                                        quantization=args.quantization, **engine_kwargs)
    if own_tokenizer is not None:
        engine.tokenizer = own_tokenizer
    return engine


def _scheduler_config(args: EngineArgs, max_model_len: int) -> SchedulerConfig:
    swap_space_bytes = default_swap_space_bytes() if args.swap_space is None else int(args.swap_space * (1 << 30))
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(512, args.max_num_seqs)
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, preemption_mode=args.preemption_mode,
                           swap_space_bytes=swap_space_bytes, check_invariants=args.check_invariants, seed=args.seed)


def _pooling_head(hf_overrides: Optional[dict], path, ckpt, tokenizer) -> tuple[PoolerConfig, Optional[torch.Tensor]]:
    """The pooling runner's pooling and classifier. The pooling: the checkpoint's sentence-transformers
    modules, else last token + L2. The classifier [num_labels, hidden] over the raw last row:
    Qwen3-Reranker's (from two LM-head rows, ``hf_overrides``) or a sequence classifier's ``score``
    head (Qwen3ForSequenceClassification); None for an embedding model. A classifier pools the last
    row unnormalized."""
    pooler = read_pooler_config(path) or PoolerConfig()
    classifier = None
    if hf_overrides is not None:
        no, yes = classifier_tokens(hf_overrides, tokenizer)
        head = ckpt.model.lm_head
        if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise ValueError(f"hf_overrides names classifier tokens, but {path} has no plain lm_head to take "
                             "their rows from; expected a causal-LM checkpoint (Qwen3-Reranker)")
        for name, tid in (("no", no), ("yes", yes)):
            if not 0 <= tid < head.weight.shape[0]:
                raise ValueError(f"hf_overrides['classifier_from_token'] {name} id = {tid}, expected a token id "
                                 f"in [0, {head.weight.shape[0]})")
        classifier = reranker_head(head.weight.detach(), no, yes)
    elif getattr(ckpt.model, "score", None) is not None:
        classifier = ckpt.model.score.weight.detach().float().clone()
    if classifier is not None:
        pooler = PoolerConfig("last", normalize=False)
    return pooler, classifier


class LLM:
    def __init__(self, model: Union[str, Path, None] = None, **kwargs: Any) -> None:
        """vLLM's ``LLM``: ``model`` (a checkpoint directory, a GGUF file or a Hugging Face model id;
        None: the embedded model) and the keyword arguments of ``EngineArgs``
        (``serving/engine_args.py``, which says what each does). They are checked by name
        (``EngineArgs.validate``) before the (slow) load; an unknown keyword is a TypeError."""
        from qwen_ops.models.defaults import resolve_model_path
        from qwen_ops.models.gguf import as_path
        from qwen_ops.models.loader import load_checkpoint

        # vLLM's LLM keeps no request stats unless asked (disable_log_stats=False: get_metrics); the server's
        # engine arguments log them by default (EngineArgs' default, False)
        args = EngineArgs(model=model, **{"disable_log_stats": True, **kwargs})
        args.validate()
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size = {args.data_parallel_size}, but this LLM class "
                             "(qwen_ops.serving.llm.LLM) runs one engine in this process; expected 1, or "
                             "qwen_ops.LLM (serving/offline.py), which runs data-parallel replicas")
        device = torch.device(args.device)
        spec = args.speculative()
        # None: the embedded model; a model id: the Hugging Face cache (revision, download_dir, hf_token)
        path = resolve_model_path(model, revision=args.revision, cache_dir=args.download_dir, token=args.hf_token)
        tokenizer_path = None if args.tokenizer is None else resolve_model_path(
            args.tokenizer, revision=args.tokenizer_revision, cache_dir=args.download_dir, token=args.hf_token)
        _check_load_format(args, path)
        own_tokenizer = _tokenizer_override(args.tokenizer, tokenizer_path)
        self.runner = _resolve_runner(args, path, spec)
        pooling = self.runner == "pooling"
        # The config first: max_model_len decides how much of the model's RoPE table is built.
        reranker_overrides, config_overrides = split_hf_overrides(args.hf_overrides)
        cfg = QwenConfig.from_pretrained(path, overrides=config_overrides)
        args = dataclasses.replace(args, dtype=_resolve_dtype(args.dtype, cfg, device))   # "auto" as vLLM-CPU
        if args.seed is not None:
            _seed_everything(args.seed)
        # the model's limit, lowered (from the config's KV bytes) to what the KV cache holds: the RoPE table
        # is built for this many positions; after the load the blocks are counted again from the model
        max_model_len, _ = _fit_kv_cache(args, cfg, None, device, _max_model_len(args.max_model_len, cfg),
                                         quiet=True)
        ckpt = None                               # with tensor parallelism each rank loads its own slice
        if args.tensor_parallel_size == 1:
            ckpt = load_checkpoint(path, dtype=args.dtype, device=device, max_positions=max_model_len, config=cfg,
                                   quantization=args.quantization, mtp=spec is not None and spec.method == "mtp",
                                   pooling=pooling)
        else:
            check_tp_config(cfg, args.tensor_parallel_size)
        max_model_len, num_kv_blocks = _fit_kv_cache(args, cfg, ckpt, device, max_model_len)
        self.engine = _build_engine(args, path, cfg, ckpt, own_tokenizer, device, _engine_kwargs(
            args, max_model_len, num_kv_blocks, pooling))
        self._attach_speculative(spec, cfg, args.dtype, device, max_model_len)
        self.tokenizer = self.engine.tokenizer
        self.core = EngineCore(self.engine, _scheduler_config(args, max_model_len), spec)
        self.core.max_grammar_compile_s = args.max_grammar_compile_seconds
        self.core.max_logprobs = 20 if args.max_logprobs == -1 else args.max_logprobs
        self.scheduler = self.core.scheduler
        self.model_path = as_path(path)      # a GGUF file's path carries the file, read once
        # where the tokenizer and the chat template come from (``tokenizer``, else the model)
        self.tokenizer_path = as_path(tokenizer_path) if tokenizer_path is not None else self.model_path
        self.sampling_overrides = {**sampling_overrides(self.model_path, args.generation_config),
                                   **generation_overrides(args.override_generation_config)}
        if args.skip_tokenizer_init:              # vLLM's: token ids in and out, no text
            self.engine.tokenizer = self.tokenizer = None
        self._default_sampling = SamplingParams(**self.sampling_overrides)
        self.engine_args = args      # read by get_metrics (disable_log_stats) and start_profile (profiler_config)
        self.pooler, self.classifier = (_pooling_head(reranker_overrides, path, ckpt, self.tokenizer) if pooling
                                        else (None, None))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """The ``LLM`` of ``engine_args`` (the ``qwen-ops`` commands build theirs from their flags)."""
        return cls(engine_args.model, **engine_args.llm_kwargs())

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a call that passes none (vLLM's): with ``generation_config="auto"``
        the checkpoint's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``,
        ``min_p``, ``repetition_penalty``, ``max_new_tokens``) over vLLM's defaults. A new copy each
        call (vLLM's): changing it changes no other call's defaults."""
        return self._default_sampling.clone()

    def _attach_speculative(self, spec: Optional[SpeculativeConfig], cfg: QwenConfig, dtype, device,
                            max_model_len: int) -> None:
        """Give the runner ``spec``'s proposer: prompt lookup (ngram, the runner's own), a draft model
        or the checkpoint's MTP layer; and room to verify ``num_speculative_tokens`` per decode."""
        if spec is None:
            return
        self.engine.runner.set_verify_rows(spec.num_speculative_tokens + 1)
        if spec.method == "draft_model":
            self._attach_draft(spec, cfg, dtype, device, max_model_len)
        elif spec.method == "mtp":
            from qwen_ops.engine.mtp import MTPRunner

            self.engine.runner.attach_proposer(MTPRunner(self.engine.runner.model, self.engine.runner))

    def _attach_draft(self, spec: SpeculativeConfig, cfg: QwenConfig, dtype, device, max_model_len: int) -> None:
        """Load the draft model of ``"method": "draft_model"`` beside the target (``engine/draft.py``)."""
        from qwen_ops.models.loader import load_checkpoint

        try:
            draft_cfg = QwenConfig.from_pretrained(spec.model)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model = {spec.model!r} is not a checkpoint this package loads: "
                             f"{e}") from e
        if draft_cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"speculative_config.model = {spec.model!r} has vocab_size = {draft_cfg.vocab_size}, "
                             f"expected the target's {cfg.vocab_size}")
        if max_model_len > draft_cfg.max_position_embeddings:
            raise ValueError(f"speculative_config.model = {spec.model!r} supports max_position_embeddings = "
                             f"{draft_cfg.max_position_embeddings}, expected at least max_model_len = {max_model_len}")
        draft = load_checkpoint(spec.model, dtype=dtype, device=device, max_positions=max_model_len, config=draft_cfg)
        from qwen_ops.engine.draft import DraftRunner

        self.engine.runner.attach_proposer(DraftRunner(draft.model, self.engine.runner))

    # ------------------------------------------------------------------ inputs
    def _prepare(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None]
                 ) -> list[tuple[Prompt, list[int], SamplingParams]]:
        if self.runner == "pooling":
            raise ValueError("this LLM runs runner = 'pooling' (an embedding model); it has embed and score, "
                             "expected LLM(..., runner='generate') to generate")
        if sampling_params is None:
            sampling_params = self._default_sampling
        return prepare_requests(prompts, sampling_params, tokenizer=self.tokenizer,
                                vocab_size=self.engine.vocab_size, max_model_len=self.scheduler.config.max_model_len)

    def _loras(self, lora_request, n: int) -> Optional[list]:
        """One ``LoRARequest`` (or None) per prompt from vLLM's ``lora_request``: one for all, or a list."""
        if lora_request is None:
            return None
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(loras) != n:
            raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts; expected one each, or one "
                             "LoRARequest for all")
        for i, lr in enumerate(loras):
            if lr is not None and not isinstance(lr, LoRARequest):
                raise ValueError(f"lora_request[{i}] = {lr!r}, expected a LoRARequest or None")
        return loras

    def add_request(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> str:
        """Queue one request (validated like ``generate``); ``step()`` runs it. Returns its id."""
        (state,) = self.core.add_requests(self._prepare([prompt], [sampling_params or SamplingParams()]), [request_id],
                                          lora_requests=self._loras(lora_request, 1))
        return state.request_id

    # ------------------------------------------------------------------ LoRA adapters (vLLM's)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Parse an adapter into host memory ahead of its requests (its errors raise here)."""
        self._lora_manager().prepare(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (host memory and its slot); False if it was not loaded."""
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters held in host memory."""
        return {r.lora_int_id for r in self._lora_manager().list_loras()}

    def _lora_manager(self):
        if self.engine.lora is None:
            raise ValueError("LoRA is not enabled; expected LLM(enable_lora=True)")
        return self.engine.lora

    def has_unfinished_requests(self) -> bool:
        return self.core.has_work()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prefix, so that later prompts compute theirs afresh (after the
        weights changed, or to measure without the cache). True when reset. As vLLM's, it refuses
        (False) while any request holds KV blocks, unless ``reset_running_requests``. vLLM then
        preempts the running requests to recompute them; here they keep their blocks and their KV
        (only the index by content is forgotten: what they hold stays theirs, found by no new
        request), so nothing is recomputed. ``reset_connector``: there is no KV connector here,
        nothing to reset (as vLLM without one)."""
        for name, value in (("reset_running_requests", reset_running_requests),
                            ("reset_connector", reset_connector)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} = {value!r}, expected True or False")
        with self.core.lock:
            kv = self.engine.kv
            if not reset_running_requests and kv.num_free_blocks < kv.num_total_blocks:
                return False
            self.scheduler.reset_cache()
            return True

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration of the engine core. Returns an output for every request that gained
        tokens or finished in it (cumulative; ``new_token_ids`` holds what is new).

        Raises ``SchedulerStuckError`` when requests are pending and none can ever run."""
        with self.core.lock:
            states = self.core.step()
            if not self.engine_args.disable_log_stats:   # get_metrics' counts: a call only when one finishes
                for st in states:
                    if st.num_unfinished == 0:
                        self._request_stats.record((st,))
            return [st.output()[0] for st in states]

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 use_tqdm: Union[bool, Callable[..., Any]] = True,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order. ``sampling_params`` None:
        ``get_default_sampling_params()``. ``use_tqdm`` (vLLM's): a progress bar on stderr of the
        prompts done and the tokens/s in and out (a callable: the ``tqdm``-like class to use).
        ``lora_request`` (vLLM's; needs ``enable_lora=True``): one ``LoRARequest`` for every prompt,
        or a list with one (or None: the base model) per prompt."""
        core = self.core
        prepared = self._prepare(prompts, sampling_params)
        states = core.add_requests(prepared, lora_requests=self._loras(lora_request, len(prepared)))
        bar = _ProgressBar(use_tqdm, states) if use_tqdm else None
        try:
            # One pass over the states per step: the bar's count, or the plain check.
            while not (bar.update() if bar is not None else all(st.finished for st in states)):
                core.step()
        finally:
            if bar is not None:
                bar.close()
            core.abort_unfinished(states)
        with core.lock:
            self._record(states)
            return [st.output()[0] for st in states]

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]],
               sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
               ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` with ``new_token_ids`` whenever a request gains tokens.

        Validated exactly like ``generate``, here, before anything is queued: a bad request
        raises ``ValueError`` and none runs. The requests are queued when iteration starts;
        closing the iterator early aborts what is left.
        """
        prepared = self._prepare(prompts, sampling_params)
        return self._stream(prepared, self._loras(lora_request, len(prepared)))

    def _stream(self, prepared: list[tuple[Prompt, list[int], SamplingParams]],
                loras: Optional[list] = None) -> Iterator[RequestOutput]:
        core = self.core
        states = core.add_requests(prepared, lora_requests=loras)
        done = [False] * len(states)
        try:
            while True:
                # Report what any iteration (ours or another thread's) produced, then run one more.
                for i, st in enumerate(states):
                    if done[i]:
                        continue
                    if st.aborted:
                        done[i] = True            # aborted by the caller: no more updates
                        continue
                    with core.lock:
                        out, new = st.output() if st.dirty or st.finished else (None, [])
                        self._record((st,))
                    if out is not None and (new or st.finished):
                        done[i] = st.finished
                        yield out
                if all(done):
                    return
                core.step()
        finally:
            core.abort_unfinished(states)

    def beam_search(self, prompts, params, lora_request: Optional[LoRARequest] = None, use_tqdm: bool = False,
                    concurrency_limit: Optional[int] = None) -> list:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` best continuations of each prompt
        (``BeamSearchParams``; ``serving/beam_search.py``), as ``BeamSearchOutput``s in prompt order;
        each sequence's ``tokens`` and ``text`` hold the prompt too. ``concurrency_limit``: at most
        that many prompts searched at once; ``lora_request``: only None (beams run on the base
        model); ``use_tqdm`` draws no bar here."""
        from qwen_ops.serving.beam_search import beam_search

        if lora_request is not None:
            raise ValueError(f"lora_request = {lora_request!r}, but beam search runs the base model only; "
                             "expected None")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or
                                              not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit = {concurrency_limit!r}, expected an int >= 1 or None")
        return beam_search(self, prompts, params, concurrency_limit)

    # ------------------------------------------------------------------ pooling (runner="pooling")
    def _pooling_ids(self, prompts) -> list[list[int]]:
        if self.runner != "pooling":
            raise ValueError("this LLM runs runner = 'generate'; embed and score need LLM(..., runner='pooling') "
                             "(or task='embed')")
        return pooling_ids(prompts, tokenizer=self.tokenizer, vocab_size=self.engine.vocab_size,
                           max_model_len=self.scheduler.config.max_model_len)

    def embed(self, prompts, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, *,
              use_tqdm: Union[bool, Callable[..., Any]] = True) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one embedding per prompt (``.outputs.embedding``, a list of floats),
        pooled as the checkpoint says (``self.pooler``), truncated to ``pooling_params.dimensions``
        and normalized (``pooling_params.normalize``, default the checkpoint's). Prompts as ``generate``'s."""
        if self.classifier is not None:
            raise ValueError("this LLM is a classifier (a reranker or a sequence classifier); it has classify and "
                             "score, expected an embedding model for embed")
        ids = self._pooling_ids(prompts)
        tasks = pooling_tasks(pooling_params, len(ids), self.pooler, self.engine.config.hidden_size)
        vectors = run_pooling(self, ids, tasks, use_tqdm)
        return [EmbeddingRequestOutput(str(i), p, EmbeddingOutput(v.tolist())) for i, (p, v) in
                enumerate(zip(ids, vectors))]

    def score(self, text_1, text_2, *, use_tqdm: Union[bool, Callable[..., Any]] = True
              ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` for an embedding model: the cosine similarity of ``text_1``'s and
        ``text_2``'s embeddings (``.outputs.score``), one against one, one against N, or N against N
        pairwise (``serving/pooling.py`` ``score_pairs``)."""
        plan = ScorePlan(text_1, text_2, self._pooling_ids, self.classifier)
        tasks = pooling_tasks(None, len(plan.prompts), self.pooler, self.engine.config.hidden_size)
        return plan.outputs(run_pooling(self, plan.prompts, tasks, use_tqdm))

    def classify(self, prompts, *, use_tqdm: Union[bool, Callable[..., Any]] = True
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: per prompt the classifier's probabilities (``.outputs.probs``) at
        its last token: softmax over a sequence classifier's labels, or sigmoid of a one-label head
        (Qwen3-Reranker's relevance of a prompt already joined)."""
        if self.classifier is None:
            raise ValueError("classify needs a classifier: a Qwen3ForSequenceClassification checkpoint, or "
                             "Qwen3-Reranker's hf_overrides; this LLM has none")
        ids = self._pooling_ids(prompts)
        return [ClassificationRequestOutput(str(k), x, ClassificationOutput(p))
                for k, (x, p) in enumerate(zip(ids, self._classify_ids(ids, use_tqdm)))]

    def encode(self, prompts, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, *,
               use_tqdm: Union[bool, Callable[..., Any]] = True, lora_request: Optional[LoRARequest] = None,
               pooling_task: Optional[str] = None, tokenization_kwargs: Optional[dict] = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: per prompt a ``PoolingRequestOutput`` whose ``.outputs.data`` is a
        float32 tensor: ``pooling_task="embed"`` the embedding (as ``embed``), ``"classify"`` the
        classifier's probabilities (as ``classify``). vLLM requires ``pooling_task``; the per-token
        tasks are not run here (one vector per prompt). ``lora_request`` and ``tokenization_kwargs``:
        only None (the pooling runner serves the base model; prompts are tokenized as ``embed``'s)."""
        check_pooling_task(pooling_task, self.classifier is not None)
        if lora_request is not None:
            raise ValueError(f"lora_request = {lora_request!r}, but the pooling runner serves the base model only; "
                             "expected None")
        if tokenization_kwargs:
            raise ValueError(f"tokenization_kwargs = {tokenization_kwargs!r}, expected None: pooling prompts are "
                             "tokenized as embed's (special tokens as the tokenizer adds them)")
        ids = self._pooling_ids(prompts)
        if pooling_task == "classify":
            if pooling_params is not None and any(p.dimensions is not None or p.normalize is not None for p in
                                                  ([pooling_params] if isinstance(pooling_params, PoolingParams)
                                                   else pooling_params)):
                raise ValueError(f"pooling_params = {pooling_params!r}: dimensions and normalize apply to "
                                 "embeddings; expected None (or PoolingParams()) with pooling_task='classify'")
            pooling_params = None
        tasks = pooling_tasks(pooling_params, len(ids), self.pooler, self.engine.config.hidden_size)
        reqs = run_pooling_requests(self, ids, tasks, use_tqdm)
        data = [r.embedding.float() for r in reqs]
        if pooling_task == "classify":
            data = [torch.tensor(p, dtype=torch.float32) for p in
                    classifier_probs(torch.stack(data), self.classifier)]
        return [PoolingRequestOutput(str(k), PoolingOutput(d), x, num_cached_tokens(r))
                for k, (x, d, r) in enumerate(zip(ids, data, reqs))]

    def reward(self, prompts, /, *, truncate_prompt_tokens: Optional[int] = None,
               use_tqdm: Union[bool, Callable[..., Any]] = True,
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               lora_request: Optional[LoRARequest] = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward``: a reward model's score of each prompt, ``.outputs.data`` (a tensor):
        ``encode(pooling_task="classify")`` (vLLM's advice for rewards now; its per-token rewards
        need a per-token pooler, which does not run here). ``truncate_prompt_tokens``: keep each
        prompt's last that many tokens."""
        if truncate_prompt_tokens is not None:
            k = truncate_prompt_tokens
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"truncate_prompt_tokens = {k!r}, expected an int >= 1 or None")
            prompts = [{"prompt_token_ids": ids[-k:]} for ids in self._pooling_ids(prompts)]
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify")

    def _classify_ids(self, ids: list[list[int]], use_tqdm) -> list[list[float]]:
        tasks = pooling_tasks(None, len(ids), self.pooler, self.engine.config.hidden_size)
        return classifier_probs(torch.stack(run_pooling(self, ids, tasks, use_tqdm)), self.classifier)

    def get_tokenizer(self) -> Optional[QwenTokenizer]:
        """The checkpoint's tokenizer (None when it has no tokenizer.json), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: Union[bool, Callable[..., Any]] = True,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
             priority: Union[int, Sequence[int], None] = None, chat_template: Optional[str] = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list] = None,
             chat_template_kwargs: Optional[dict] = None, tokenization_kwargs: Optional[dict] = None,
             mm_processor_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Generate replies to conversations (vLLM's ``LLM.chat``, its arguments in its order):
        ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.
        Each is rendered by the tokenizer's chat template (``QwenTokenizer.get_chat_template``: the
        checkpoint's, ``chat_template`` if given, ChatML if neither), the same renderer as
        ``/v1/chat/completions`` and ``tokenizer.apply_chat_template``, with ``tools`` and
        ``chat_template_kwargs`` (e.g. ``enable_thinking``) as template variables, and tokenized
        without special tokens (``tokenization_kwargs`` may say otherwise), as vLLM does.
        ``continue_final_message``: the prompt ends inside the final message (with
        ``add_generation_prompt=False``). ``lora_request`` goes to ``generate``. ``chat_template_content_format``
        ``"auto"`` / ``"string"`` joins a list content's text parts with newlines (the models here
        read text); ``"openai"`` gives the template the parts. ``priority``: only 0 (requests run in
        arrival order); ``mm_processor_kwargs``: only None (text-only models)."""
        if priority is not None and any(p != 0 for p in ([priority] if isinstance(priority, int) else priority)):
            raise ValueError(f"priority = {priority!r}, but requests run in arrival order here (scheduling_policy "
                             "'fcfs'; vLLM's priority scheduling is not supported); expected None or 0")
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs = {mm_processor_kwargs!r}, but the models here read text only; "
                             "expected None")
        prompts = self._chat_prompts(messages, add_generation_prompt, chat_template_kwargs, chat_template=chat_template,
                                     content_format=chat_template_content_format,
                                     continue_final_message=continue_final_message, tools=tools,
                                     tokenization_kwargs=tokenization_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _chat_prompts(self, messages, add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict] = None,
                      *, chat_template: Optional[str] = None, content_format: str = "auto",
                      continue_final_message: bool = False, tools: Optional[list] = None,
                      tokenization_kwargs: Optional[dict] = None) -> list[dict]:
        """The ``{"prompt_token_ids": [...]}`` prompts ``chat`` sends, one per conversation; ``qwen-ops
        chat`` streams them through ``stream``, so its prompt is exactly ``chat``'s."""
        from qwen_ops.models.chat_template import ChatTemplateError

        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer, but the checkpoint has no tokenizer.json")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs = {chat_template_kwargs!r}, expected a dict or None")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt = True and continue_final_message = True: cannot set both "
                             "(vLLM's rule); expected add_generation_prompt=False to continue the final message")
        if content_format not in CHAT_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format = {content_format!r}, expected one of "
                             f"{', '.join(map(repr, CHAT_CONTENT_FORMATS))}")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools = {tools!r}, expected a list of tool dicts (OpenAI's function tools) or None")
        encode_kwargs = _chat_tokenization_kwargs(tokenization_kwargs)
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError(f"messages = {messages!r}, expected a list of {{'role', 'content'}} dicts, or a list of "
                             "such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        try:
            template = self.tokenizer.get_chat_template(chat_template, tools)
            # before **chat_template_kwargs below collides with add_generation_prompt=
            template.check_kwargs(chat_template_kwargs)
        except ChatTemplateError as e:
            raise ValueError(str(e)) from None
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, Sequence) or not all(isinstance(m, dict) for m in conv):
                raise ValueError(f"messages[{i}] = {conv!r}, expected a list of {{'role', 'content'}} dicts")
            conv = [_chat_content(m, content_format, f"messages[{i}][{j}]") for j, m in enumerate(conv)]
            try:
                text = template.render(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                       continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            except ChatTemplateError as e:
                raise ValueError(f"messages[{i}]: {e}") from None
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, **encode_kwargs)})
        return prompts

    def abort(self, request_id: Union[str, int, RequestId]) -> None:
        """Abort a request by the id ``add_request`` returned (all its completions)."""
        self.core.abort(request_id)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op without them)."""
        self.engine.shutdown()

    def stats(self) -> dict:
        return self.core.stats()

    # ------------------------------------------------------------------ metrics and profiling (vLLM's)
    @functools.cached_property
    def _request_stats(self):
        """What ``get_metrics`` reports of finished requests (created on first use, under the core's lock)."""
        from qwen_ops.serving.metrics_reader import RequestStats

        return RequestStats(self.scheduler.config.max_model_len)

    def _record(self, states) -> None:
        """Count the finished ones of ``states`` in ``get_metrics`` (each once); the caller holds the core's lock."""
        if not self.engine_args.disable_log_stats:
            self._request_stats.record(states)

    def get_metrics(self) -> list:
        """vLLM's ``LLM.get_metrics()``: a snapshot of the metrics (``vllm.v1.metrics.reader``'s
        ``Counter``, ``Gauge``, ``Histogram``; ``serving/metrics_reader.py``) under vLLM's names: the
        engine's state and counts now, and the requests this ``LLM`` has finished (tokens, finish
        reasons, latencies). Needs ``LLM(..., disable_log_stats=False)`` (True is LLM's default, as vLLM's)."""
        from qwen_ops.serving.metrics_reader import engine_metrics

        if self.engine_args.disable_log_stats:
            raise ValueError("get_metrics: disable_log_stats = True, so no stats are kept; expected "
                             "LLM(..., disable_log_stats=False)")
        name = self.engine_args.served_model_name
        if not isinstance(name, str):
            name = name[0] if name else str(self.model_path)
        labels = {"model_name": name, "engine": "0"}
        with self.core.lock:
            return engine_metrics(self.core.stats(), labels) + self._request_stats.metrics(labels)

    def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None) -> None:
        """vLLM's: start ``torch.profiler`` here (the engine core and the model; with tensor parallelism,
        not the other ranks' processes) until ``stop_profile``, which writes the Chrome trace
        ``<profile_prefix or qwen_ops>_pid<pid>_<ns>.pt.trace.json`` into the folder of
        ``profiler_config`` (``torch_profiler_dir``) or $VLLM_TORCH_PROFILER_DIR; neither set is an
        error, as vLLM's. ``delay_iterations`` / ``max_iterations``: only None or 0 (the whole session)."""
        import re

        if self.__dict__.get("_profile") is not None:
            raise RuntimeError("start_profile: a profile is running already; expected stop_profile first")
        for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
            if value not in (None, 0) or isinstance(value, bool):
                raise ValueError(f"{name} = {value!r}, but the profile here covers every iteration between "
                                 "start_profile and stop_profile; expected None or 0")
        if profile_prefix is not None and (not isinstance(profile_prefix, str)
                                           or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", profile_prefix)):
            raise ValueError(f"profile_prefix = {profile_prefix!r}, expected 1-128 ASCII letters, digits, '.', '_' "
                             "or '-', starting with a letter or digit (vLLM's rule), or None")
        options = self.engine_args.vllm_options or {}
        folder = profiler_dir(options.get("profiler_config"))
        self._profile = _TorchProfile(folder, profile_prefix, torch.device(self.engine_args.device))

    def stop_profile(self) -> Path:
        """Stop the profile ``start_profile`` began and write its trace; returns the trace's path."""
        profile = self.__dict__.pop("_profile", None)
        if profile is None:
            raise RuntimeError("stop_profile: no profile is running; expected start_profile first")
        path = profile.stop()
        logger.info("torch profiler trace written to %s", path)
        return path
