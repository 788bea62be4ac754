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

import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from qwen_ops.engine.batch import RequestId
from qwen_ops.engine.engine import QwenEngine, _compile_backend
from qwen_ops.engine.lora import LoRAConfig, LoRARequest
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.loader import resolve_dtype
from qwen_ops.ops.kv_quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from qwen_ops.models.parallel import check_tp_config
from qwen_ops.models.tokenizer import QwenTokenizer
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.engine.speculative import SpeculativeConfig
from qwen_ops.serving.engine_core import EngineCore
from qwen_ops.serving.outputs import CompletionOutput, RequestOutput  # noqa: F401  (qwen_ops re-exports them)
from qwen_ops.serving.pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                      EmbeddingRequestOutput, PoolingParams,  # noqa: F401
                                      ScoringRequestOutput, check_hf_overrides, classifier_probs,
                                      classifier_tokens, pooling_tasks, reranker_head, resolve_runner, run_pooling,
                                      ScorePlan)
from qwen_ops.models.pooler_config import PoolerConfig, is_embedding_checkpoint, read_pooler_config
from qwen_ops.serving.scheduler import SchedulerConfig

Prompt = Union[str, Sequence[int], torch.Tensor]

DEFAULT_KV_CACHE_BYTES = 1 << 30     # KV budget when num_kv_blocks is None on the CPU
DEFAULT_MAX_MODEL_LEN = 4096         # cap of the default max_model_len (the model's max_position_embeddings)
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


def default_swap_space_bytes() -> int:
    """Host memory for swapped KV: a quarter of physical memory, at most 4 GiB (vLLM's default)."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host = 16 << 30
    return min(MAX_DEFAULT_SWAP_SPACE_BYTES, host // 4)


def _check_int(name: str, value, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}, expected an int >= {low}" + (" or None" if optional else ""))


def _check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device = {device!r}, expected 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible")
            raise ValueError(f"device = {device!r}, but {why}; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device = {device!r}, but only {torch.cuda.device_count()} CUDA devices exist")
    elif dev.type != "cpu":
        raise ValueError(f"device = {device!r}, expected 'cpu', 'cuda' or 'cuda:N'")
    return dev


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


def _default_kv_budget(device: torch.device, utilization: Optional[float] = None) -> int:
    """Bytes for the KV cache: 1 GiB on the CPU (times ``utilization``); on a GPU, 90% of what is
    free after the weights, or with ``utilization`` that share of the whole device less what is in
    use, less a reserve for activations and graph capture, taken before the cache is sized."""
    if device.type != "cuda":
        return int(DEFAULT_KV_CACHE_BYTES * (1.0 if utilization is None else utilization))
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
        out.append((prompt, ids, sp.with_bad_words_token_ids(tokenizer)))
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


class LLM:
    def __init__(self, model: Union[str, Path, None] = None, *, dtype: Union[str, torch.dtype] = "float32",
                 device: Union[str, torch.device] = "cpu", max_num_seqs: int = 64, max_model_len: Optional[int] = None,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None, preemption_mode: str = "recompute",
                 kv_cache_bytes: Optional[int] = None, swap_space: Optional[float] = None,
                 check_invariants: bool = False,
                 compile: Optional[bool] = None, decode_buckets: Optional[Sequence[int]] = None,
                 cuda_graphs: Optional[bool] = None, compile_backend: str = "inductor",
                 backend: Optional[str] = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, tp_port: Optional[int] = None,
                 quantization: Optional[str] = None, speculative_config: Optional[dict] = None,
                 kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False, seed: Optional[int] = None,
                 enforce_eager: bool = False, gpu_memory_utilization: Optional[float] = None,
                 generation_config: str = "auto", max_grammar_compile_seconds: Optional[float] = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: Optional[int] = None, runner: str = "auto", task: Optional[str] = None,
                 hf_overrides: Optional[dict] = None, tokenizer: Union[str, Path, None] = None):
        """``tokenizer`` (vLLM's): a checkpoint directory with a ``tokenizer.json``, or a GGUF file, whose
        tokenizer and chat template are used instead of ``model``'s (None: ``model``'s own).

        ``kv_cache_dtype`` (vLLM's): ``"auto"`` keeps the KV cache in the model's dtype; ``"fp8"`` (=
        ``"fp8_e4m3"``) or ``"fp8_e5m2"`` stores it in one byte per element, so the same
        ``kv_cache_bytes`` holds twice the tokens (four times in fp32), scaled per tensor by each layer's
        ``k_scale`` / ``v_scale``: the checkpoint's where it carries them, else 1.0, or measured on the
        first batch with ``calculate_kv_scales=True`` (vLLM's). ``ops/kv_quant.py`` has the format.

        ``quantization`` (vLLM's argument): ``"int8"`` or ``"fp8"`` quantizes a full-precision
        checkpoint's projections as they load (``models/quant.py``); a checkpoint quantized in a
        supported format (``quantization_config`` fp8 / awq / gptq) loads as it is, with or without
        naming its method here.

        ``swap_space``: GiB of host memory for KV swapped out by preemption (vLLM's ``swap_space``,
        a number: 0.5 is 512 MiB); default ``default_swap_space_bytes()`` (a quarter of RAM, at most
        4 GiB). When it is full, preemption recomputes instead (``stats()["num_swap_full_recomputes"]``;
        ``stats()["swap_space_bytes"]`` is the bound in bytes).

        ``enable_prefix_caching`` (default on, as in vLLM): full KV blocks are shared by content,
        so a prompt that starts like an earlier one (a system prompt, the previous turns of a
        chat) computes only what is new. Off for models with linear-attention layers (their
        recurrent state is not in the blocks); ``stats()["prefix_caching"]`` says which.

        ``tensor_parallel_size=N`` splits the model over N processes (gloo on the CPU, NCCL on
        CUDA): this process is rank 0 and spawns N-1 workers (``tp_port``: their rendezvous port,
        default a free one), or, under torchrun, every rank runs this same call. ``shutdown()``
        stops the workers (deleting the ``LLM`` does too).

        ``speculative_config`` (vLLM's): ``{"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_min": 1, "prompt_lookup_max": 3}`` drafts up to k tokens per decode by
        prompt lookup and verifies them in the decode's forward pass; the output is the model's own
        (greedy token for token, sampled in distribution; ``engine/speculative.py``).
        ``stats()["spec_*"]`` counts drafts and acceptance.

        vLLM's other offline arguments: ``seed`` seeds the noise of requests that bring no seed of
        their own (one generator of this ``LLM``, so a run repeats; default None: torch's global
        generator); ``enforce_eager=True`` means no compile and no CUDA graphs;
        ``gpu_memory_utilization`` (in (0, 1]) is the share of the device's memory that weights and
        KV cache may take (the KV cache gets what the weights leave of it), and on the CPU the share
        of the default KV budget (``DEFAULT_KV_CACHE_BYTES``, 1 GiB; ``kv_cache_bytes`` sets it
        outright, as vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE`` does); ``generation_config`` (``"auto"``,
        ``"vllm"`` or a directory): where ``get_default_sampling_params()`` takes its defaults, the
        sampling parameters of every call that passes none.

        ``max_grammar_compile_seconds``: a structured output whose grammar takes longer to compile
        fails its own request (``AsyncLLM`` and the server, where grammars compile beside the engine
        loop; ``generate`` compiles in the caller's thread and waits). None: no bound.

        ``runner`` (vLLM's): ``"generate"``, ``"pooling"`` (an embedding model: ``embed`` and
        ``score``, no ``generate``; ``serving/pooling.py``) or ``"auto"``: pooling where the checkpoint
        says so (a sentence-transformers ``modules.json`` with a ``Pooling`` module, or config.json's
        architectures ``Qwen3Model``). ``task`` is vLLM's older spelling: ``"embed"`` and ``"score"``
        mean ``runner="pooling"``. One runner per ``LLM``.

        ``hf_overrides`` (vLLM's, for Qwen3-Reranker only): ``{"architectures":
        ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True}`` runs a causal-LM checkpoint as a reranker: the pooling
        runner, and ``score`` is the softmax share of "yes" over the two tokens' logits at the last
        position of ``text_1 + text_2`` (``qwen3_reranker_inputs`` formats them as its model card says)."""
        from qwen_ops.models.defaults import resolve_model_path
        from qwen_ops.models.loader import load_checkpoint

        # Every argument by name, before the (slow) load.
        if model is not None and not isinstance(model, (str, Path)):
            raise ValueError(f"model = {model!r}, expected a checkpoint directory or a Hugging Face model id "
                             "(str or Path), or None")
        _check_int("max_num_seqs", max_num_seqs, 1)
        _check_int("max_model_len", max_model_len, 2, optional=True)
        _check_int("block_size", block_size, 1)
        _check_int("num_kv_blocks", num_kv_blocks, 1, optional=True)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1, optional=True)
        _check_int("kv_cache_bytes", kv_cache_bytes, 1, optional=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed = {seed!r}, expected an int or None")
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager = {enforce_eager!r}, expected True or False")
        if enforce_eager:
            for name, flag in (("compile", compile), ("cuda_graphs", cuda_graphs)):
                if flag:
                    raise ValueError(f"{name} = True with enforce_eager = True; enforce_eager means no compile and "
                                     f"no CUDA graphs, expected one of them")
            compile = cuda_graphs = False
        if gpu_memory_utilization is not None and (
                isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float))
                or not 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization = {gpu_memory_utilization!r}, expected a number in (0, 1] "
                             "or None")
        if max_grammar_compile_seconds is not None and (
                isinstance(max_grammar_compile_seconds, bool) or not isinstance(max_grammar_compile_seconds, (int, float))
                or not 0 < max_grammar_compile_seconds < float("inf")):
            raise ValueError(f"max_grammar_compile_seconds = {max_grammar_compile_seconds!r}, expected a number of "
                             "seconds > 0 or None")
        if not isinstance(generation_config, (str, Path)) or not generation_config:
            raise ValueError(f"generation_config = {generation_config!r}, expected 'auto', 'vllm' or a directory")
        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype = {kv_cache_dtype!r}, expected one of {sorted(KV_CACHE_DTYPES)} "
                             "(vLLM's names)")
        if not isinstance(calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales = {calculate_kv_scales!r}, expected True or False")
        if swap_space is not None and (isinstance(swap_space, bool) or not isinstance(swap_space, (int, float))
                                       or not math.isfinite(swap_space) or swap_space < 0):
            raise ValueError(f"swap_space = {swap_space!r}, expected a number of GiB >= 0 (vLLM's unit) or None")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode = {preemption_mode!r}, expected 'recompute' or 'swap'")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching = {enable_prefix_caching!r}, expected True or False")
        for name, flag in (("check_invariants", check_invariants), ("compile", compile), ("cuda_graphs", cuda_graphs)):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name} = {flag!r}, expected True or False" + ("" if name == "check_invariants"
                                                                                  else " or None"))
        if decode_buckets is not None:
            buckets = list(decode_buckets)
            if not buckets:
                raise ValueError("decode_buckets is empty; expected batch sizes >= 1, or None")
            for i, b in enumerate(buckets):
                _check_int(f"decode_buckets[{i}]", b, 1)
        compile_backend = _compile_backend(compile_backend, backend)
        if compile_backend not in ("inductor", "tensorrt"):
            raise ValueError(f"compile_backend = {compile_backend!r}, expected 'inductor' or 'tensorrt'")
        device = _check_device(device)
        _check_int("tensor_parallel_size", tensor_parallel_size, 1)
        if not isinstance(enable_lora, bool):
            raise ValueError(f"enable_lora = {enable_lora!r}, expected True or False")
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        spec = SpeculativeConfig.from_dict(speculative_config)
        if spec is not None and tensor_parallel_size > 1:
            raise ValueError(f"speculative_config = {speculative_config!r} with tensor_parallel_size = "
                             f"{tensor_parallel_size}: speculative decoding runs on one rank only; expected "
                             "tensor_parallel_size = 1 or no speculative_config")
        resolve_runner(runner, task, False)       # the names, before anything is read
        path = resolve_model_path(model)          # None: the embedded model; a model id: the HF cache
        if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
            raise ValueError(f"tokenizer = {tokenizer!r}, expected a checkpoint directory with a tokenizer.json, a "
                             "GGUF file or a Hugging Face model id (str or Path), or None")
        tokenizer_path = None if tokenizer is None else resolve_model_path(tokenizer)
        own_tokenizer = None
        if tokenizer_path is not None:
            from qwen_ops.models.tokenizer import load_tokenizer

            own_tokenizer = load_tokenizer(tokenizer_path)
            if own_tokenizer is None:
                raise ValueError(f"tokenizer = {str(tokenizer)!r}: {tokenizer_path} has no tokenizer.json (nor is it a "
                                 "GGUF file with a tokenizer)")
        reranker = hf_overrides is not None
        if reranker:
            check_hf_overrides(hf_overrides)
            if runner == "generate" or task == "generate":
                raise ValueError("hf_overrides (a Qwen3-Reranker classifier) with a generate runner; expected "
                                 "runner='pooling' or 'auto'")
        runner = resolve_runner(runner, task, reranker or is_embedding_checkpoint(path))
        pooling = runner == "pooling"
        if pooling and (spec is not None or tensor_parallel_size > 1 or enable_lora):
            raise ValueError(f"runner = 'pooling' with speculative_config, tensor_parallel_size = "
                             f"{tensor_parallel_size} or enable_lora = {enable_lora}; the pooling runner runs one "
                             "rank without drafts or adapters, expected none of them")
        # The config first: max_model_len decides how much of the model's RoPE table is built.
        cfg = QwenConfig.from_pretrained(path)
        if max_model_len is None:   # the model's own limit, capped so the default KV budget holds one sequence
            max_model_len = min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len = {max_model_len}, but the model supports max_position_embeddings = "
                             f"{cfg.max_position_embeddings}; expected at most that")
        if tensor_parallel_size == 1:
            ckpt = load_checkpoint(path, dtype=dtype, device=device, max_positions=max_model_len, config=cfg,
                                   quantization=quantization, mtp=spec is not None and spec.method == "mtp",
                                   pooling=pooling)
            elem = resolve_kv_cache_dtype(kv_cache_dtype, next(ckpt.model.parameters()).dtype).itemsize
            attention_layers = list(ckpt.model.layer_kinds).count("attention")   # hybrid models: 1 in 4
            if getattr(ckpt.model, "mtp", None) is not None:       # speculative "mtp": its layer's KV too
                attention_layers += 1
            kv_heads = cfg.num_key_value_heads
        else:
            # Each rank loads its own slice in from_pretrained; size the cache from the config.
            check_tp_config(cfg, tensor_parallel_size)
            elem = resolve_kv_cache_dtype(kv_cache_dtype, resolve_dtype(dtype, cfg)).itemsize
            attention_layers = cfg.num_hidden_layers
            kv_heads = max(1, cfg.num_key_value_heads // tensor_parallel_size)
        per_seq_blocks = -(-max_model_len // block_size)
        if num_kv_blocks is None:
            block_bytes = 2 * attention_layers * block_size * kv_heads * cfg.head_dim * elem
            budget = kv_cache_bytes if kv_cache_bytes is not None else _default_kv_budget(device,
                                                                                           gpu_memory_utilization)
            num_kv_blocks = min(max_num_seqs * per_seq_blocks, max(per_seq_blocks, budget // block_bytes))
        if num_kv_blocks < per_seq_blocks:
            raise ValueError(f"num_kv_blocks = {num_kv_blocks} cannot hold one sequence of max_model_len = "
                             f"{max_model_len} ({per_seq_blocks} blocks of {block_size}); raise it or lower max_model_len")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(512, max_num_seqs)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens = {max_num_batched_tokens}, expected >= 1")
        engine_kwargs = dict(max_slots=max_num_seqs, max_seq_len=max_model_len, block_size=block_size,
                             num_kv_blocks=num_kv_blocks, compile=compile, decode_buckets=decode_buckets,
                             cuda_graphs=cuda_graphs, compile_backend=compile_backend,
                             enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                             calculate_kv_scales=calculate_kv_scales)
        if pooling:
            engine_kwargs["pooling"] = True
        if lora is not None:
            engine_kwargs["lora"] = lora
        if tensor_parallel_size == 1:
            self.engine = QwenEngine(ckpt.model, cfg, tokenizer=own_tokenizer or ckpt.tokenizer,
                                     eos_token_ids=ckpt.eos_token_ids, **engine_kwargs)
        else:
            self.engine = QwenEngine.from_pretrained(path, dtype=dtype, device=device,
                                                     tensor_parallel_size=tensor_parallel_size, tp_port=tp_port,
                                                     quantization=quantization, **engine_kwargs)
            if own_tokenizer is not None:
                self.engine.tokenizer = own_tokenizer
        if spec is not None:
            self.engine.runner.set_verify_rows(spec.num_speculative_tokens + 1)
            if spec.method == "draft_model":
                self._attach_draft(spec, cfg, dtype, device, max_model_len)
            elif spec.method == "mtp":
                from qwen_ops.engine.mtp import MTPRunner

                self.engine.runner.attach_proposer(MTPRunner(self.engine.runner.model, self.engine.runner))
        if seed is not None:
            self.engine.runner.sample_generator = torch.Generator(device=device).manual_seed(seed)
        self.tokenizer = self.engine.tokenizer
        self.core = EngineCore(self.engine, SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            swap_space_bytes=default_swap_space_bytes() if swap_space is None else int(swap_space * (1 << 30)),
            check_invariants=check_invariants), spec)
        self.core.max_grammar_compile_s = max_grammar_compile_seconds
        self.scheduler = self.core.scheduler
        from qwen_ops.models.gguf import as_path

        self.model_path = as_path(path)      # a GGUF file's path carries the file, read once
        # where the tokenizer and the chat template come from (``tokenizer``, else the model)
        self.tokenizer_path = as_path(tokenizer_path) if tokenizer_path is not None else self.model_path
        self._chat_template = None      # LLM.chat's, compiled on first use
        self.sampling_overrides = sampling_overrides(self.model_path, generation_config)
        self._default_sampling = SamplingParams(**self.sampling_overrides)
        self.runner = runner
        # The pooling runner's pooling: the checkpoint's sentence-transformers modules, else last token + L2.
        self.pooler = (read_pooler_config(path) or PoolerConfig()) if pooling else None
        # A classifier [num_labels, hidden] over the raw last row: Qwen3-Reranker's (from two LM-head
        # rows) or a sequence classifier's ``score`` head (Qwen3ForSequenceClassification).
        self.classifier = None
        if reranker:
            no, yes = classifier_tokens(hf_overrides, self.tokenizer)
            head = ckpt.model.lm_head
            if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
                raise ValueError(f"hf_overrides names classifier tokens, but {path} has no plain lm_head to take "
                                 "their rows from; expected a causal-LM checkpoint (Qwen3-Reranker)")
            for name, tid in (("no", no), ("yes", yes)):
                if not 0 <= tid < head.weight.shape[0]:
                    raise ValueError(f"hf_overrides['classifier_from_token'] {name} id = {tid}, expected a token id "
                                     f"in [0, {head.weight.shape[0]})")
            self.classifier = reranker_head(head.weight.detach(), no, yes)
        elif pooling and getattr(ckpt.model, "score", None) is not None:
            self.classifier = ckpt.model.score.weight.detach().float().clone()
        if self.classifier is not None:
            self.pooler = PoolerConfig("last", normalize=False)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a call that passes none (vLLM's): with ``generation_config="auto"``
        the checkpoint's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``,
        ``min_p``, ``repetition_penalty``, ``max_new_tokens``) over vLLM's defaults."""
        return self._default_sampling

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

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration of the engine core. Returns an output for every request that gained
        tokens or finished in it (cumulative; ``new_token_ids`` holds what is new).

        Raises ``SchedulerStuckError`` when requests are pending and none can ever run."""
        with self.core.lock:
            return [st.output()[0] for st in self.core.step()]

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
                    if out is not None and (new or st.finished):
                        done[i] = st.finished
                        yield out
                if all(done):
                    return
                core.step()
        finally:
            core.abort_unfinished(states)

    def beam_search(self, prompts, params) -> list:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` best continuations of each prompt
        (``BeamSearchParams``; ``serving/beam_search.py``), as ``BeamSearchOutput``s in prompt order."""
        from qwen_ops.serving.beam_search import beam_search

        return beam_search(self, prompts, params)

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

    def _classify_ids(self, ids: list[list[int]], use_tqdm) -> list[list[float]]:
        tasks = pooling_tasks(None, len(ids), self.pooler, self.engine.config.hidden_size)
        return classifier_probs(torch.stack(run_pooling(self, ids, tasks, use_tqdm)), self.classifier)

    def get_tokenizer(self) -> Optional[QwenTokenizer]:
        """The checkpoint's tokenizer (None when it has no tokenizer.json), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict] = None,
             use_tqdm: Union[bool, Callable[..., Any]] = True) -> list[RequestOutput]:
        """Generate replies to conversations (vLLM's ``LLM.chat``): ``messages`` is one conversation
        (a list of ``{"role", "content"}`` dicts) or a list of them. Each is rendered by the
        checkpoint's chat template (ChatML if it has none), the same ``ChatTemplate`` as
        ``/v1/chat/completions``, and tokenized without special tokens, as the server does;
        ``chat_template_kwargs`` go to the template (e.g. ``enable_thinking``)."""
        prompts = self._chat_prompts(messages, add_generation_prompt, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_prompts(self, messages, add_generation_prompt: bool = True,
                      chat_template_kwargs: Optional[dict] = None) -> list[dict]:
        """The ``{"prompt_token_ids": [...]}`` prompts ``chat`` sends, one per conversation; ``qwen-ops
        chat`` streams them through ``stream``, so its prompt is exactly ``chat``'s."""
        from qwen_ops.serving.openai.chat import ChatTemplate, ChatTemplateError

        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer, but the checkpoint has no tokenizer.json")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs = {chat_template_kwargs!r}, expected a dict or None")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError(f"messages = {messages!r}, expected a list of {{'role', 'content'}} dicts, or a list of "
                             "such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_checkpoint(self.tokenizer_path)
        try:                    # before **chat_template_kwargs below collides with add_generation_prompt=
            self._chat_template.check_kwargs(chat_template_kwargs)
        except ChatTemplateError as e:
            raise ValueError(str(e)) from None
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, Sequence) or not all(isinstance(m, dict) for m in conv):
                raise ValueError(f"messages[{i}] = {conv!r}, expected a list of {{'role', 'content'}} dicts")
            try:
                text = self._chat_template.render(conv, add_generation_prompt=add_generation_prompt,
                                                  **(chat_template_kwargs or {}))
            except ChatTemplateError as e:
                raise ValueError(f"messages[{i}]: {e}") from None
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return prompts

    def abort(self, request_id: Union[str, int, RequestId]) -> None:
        """Abort a request by the id ``add_request`` returned (all its completions)."""
        self.core.abort(request_id)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op without them)."""
        self.engine.shutdown()

    def stats(self) -> dict:
        return self.core.stats()
