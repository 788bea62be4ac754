"""EngineArgs: the arguments of an engine, one dataclass (vLLM's ``EngineArgs``).

``LLM(model, **kwargs)`` builds one from its keywords, and every ``qwen-ops`` command from its flags
(``EngineArgs.add_cli_args`` / ``from_cli_args``), so the offline API and the command line share
the names, the defaults and ``validate()``, the one place the arguments are checked: the same bad
value gives the same error, word for word, from ``LLM(...)`` and from ``qwen-ops serve``.

This module imports without torch (the torch-free ``qwen_ops_cli`` builds its parser from it, so
``qwen-ops --help`` is instant); ``validate()`` imports what it checks against when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


def json_object(text: str, expected: str = f"an object such as '{SPECULATIVE_EXAMPLE}'") -> dict:
    """A flag's JSON-object value (``--speculative-config``, ``--hf-overrides``; ``--lora-modules``'
    JSON form), or an error naming ``expected``: argparse reports it with the flag's name."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}); expected {expected}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, expected an object")
    return value


def _json_overrides(text: str) -> dict:
    return json_object(text, "an object such as '{\"architectures\": [\"Qwen3ForSequenceClassification\"], ...}'")


def _arg(default: Any, help: str, *aliases: str, **argparse_kwargs: Any) -> Any:
    """A field and its flag: ``--<name with dashes>`` (vLLM's spelling), ``aliases``, ``help`` and
    argparse's keywords (``type``, ``action``, ``nargs``, ``metavar``)."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "argparse": argparse_kwargs})


QUANTIZATION_HELP = (
    "int8, int4 or fp8: quantize a full-precision checkpoint's projections as it loads (w8a8: int8 weights and "
    "int8 activations); a checkpoint quantized as fp8 (block-wise), awq or gptq loads quantized without it "
    "(awq_a8 / gptq_a8: with int8 activations); a GGUF file keeps its blocks as stored (gguf_a8: with int8 "
    "activations, llama.cpp's arithmetic; dequantize: all to --dtype) (default: none)")


@dataclass(frozen=True)
class EngineArgs:
    """Every argument of ``LLM`` (and of ``AsyncLLM.from_pretrained``) with its default.

    ``model``: a checkpoint directory (Hugging Face layout), a GGUF file or a Hugging Face model id
    (from the cache); None is the embedded default model. ``tokenizer`` (vLLM's): a checkpoint
    directory with a ``tokenizer.json``, or a GGUF file, whose tokenizer and chat template are used
    instead of ``model``'s (None: ``model``'s own).

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
    loop; ``generate`` compiles in the caller's thread and waits). None: no bound (``qwen-ops
    serve``: 5 s).

    ``enable_lora`` (vLLM's): serve LoRA adapters, ``max_loras`` of them in one step, of rank up to
    ``max_lora_rank``, ``max_cpu_loras`` parsed ones kept in host memory (default ``max_loras``).

    ``runner`` (vLLM's): ``"generate"``, ``"pooling"`` (an embedding model: ``embed`` and
    ``score``, no ``generate``; ``serving/pooling.py``) or ``"auto"``: pooling where the checkpoint
    says so (a sentence-transformers ``modules.json`` with a ``Pooling`` module, or config.json's
    architectures ``Qwen3Model``). ``task`` is vLLM's older spelling: ``"embed"`` and ``"score"``
    mean ``runner="pooling"``. One runner per ``LLM``.

    ``hf_overrides`` (vLLM's, for Qwen3-Reranker only): ``{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True}`` runs a causal-LM checkpoint as a reranker: the pooling
    runner, and ``score`` is the softmax share of "yes" over the two tokens' logits at the last
    position of ``text_1 + text_2`` (``qwen3_reranker_inputs`` formats them as its model card says).

    ``compile_backend`` (``"inductor"`` or ``"tensorrt"``) compiles the decode step; ``backend`` is
    its deprecated older name. ``check_invariants`` asserts the scheduler's invariants every
    iteration (tests).
    """

    model: Union[str, Path, None] = None
    dtype: Union[str, torch.dtype] = _arg("float32", "float32, bfloat16, float16 or auto (config.json's) "
                                                     "(default: float32)")
    device: Union[str, torch.device] = _arg("cpu", "cpu, cuda or cuda:N (default: cpu)")
    max_num_seqs: int = _arg(64, "most requests running at once (default: 64)", type=int)
    max_model_len: Optional[int] = _arg(None, "most tokens per request (default: the model's limit, at most 4096)",
                                        type=int)
    block_size: int = _arg(16, "tokens per KV block (default: 16)", type=int)
    num_kv_blocks: Optional[int] = _arg(None, "KV blocks (default: sized from memory)", type=int)
    max_num_batched_tokens: Optional[int] = _arg(
        None, "most tokens in one forward pass, prefill chunks and decodes together (default: the larger of 512 "
              "and --max-num-seqs)", type=int)
    preemption_mode: str = _arg("recompute", "recompute or swap: what a request preempted for KV blocks loses "
                                             "(default: recompute)", metavar="{recompute,swap}")
    kv_cache_bytes: Optional[int] = _arg(
        None, "bytes of KV cache when --num-kv-blocks is not given (default: 1 GiB on the CPU, on a GPU what "
              "the weights leave)", type=int)
    swap_space: Optional[float] = _arg(
        None, "GiB of host memory for swapped KV, as vLLM's (default: a quarter of RAM, at most 4 GiB)", type=float)
    check_invariants: bool = _arg(False, "assert the scheduler's invariants every iteration (slow; tests)",
                                  action="store_true")
    compile: Optional[bool] = _arg(None, "compile the decode step (default: on for CUDA, off on the CPU)",
                                   action=argparse.BooleanOptionalAction)
    decode_buckets: Optional[Sequence[int]] = _arg(
        None, "the decode batch sizes compiled / captured (default: the engine's)", type=int, nargs="+",
        metavar="N")
    cuda_graphs: Optional[bool] = _arg(None, "replay decode steps as CUDA graphs (default: on for CUDA)",
                                       action=argparse.BooleanOptionalAction)
    compile_backend: str = _arg("inductor", "inductor or tensorrt (default: inductor)",
                                metavar="{inductor,tensorrt}")
    backend: Optional[str] = None                 # compile_backend's deprecated name; no flag
    enable_prefix_caching: bool = _arg(
        True, "share KV blocks of common prompt prefixes (default: on; off for hybrid models)",
        action=argparse.BooleanOptionalAction)
    tensor_parallel_size: int = _arg(1, "split the model over this many processes (default: 1)", "-tp", type=int)
    tp_port: Optional[int] = _arg(None, "the tensor-parallel workers' rendezvous port (default: a free one)",
                                  type=int)
    quantization: Optional[str] = _arg(None, QUANTIZATION_HELP, "-q")
    speculative_config: Optional[dict] = _arg(
        None, f"speculative decoding, vLLM's JSON, e.g. '{SPECULATIVE_EXAMPLE}' (default: off)", type=json_object,
        metavar="JSON")
    kv_cache_dtype: str = _arg(
        "auto", "KV cache dtype, as vLLM's: auto (the model's dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, one byte an "
                "element, per-tensor scales (default: auto)", metavar="{auto,fp8,fp8_e4m3,fp8_e5m2}")
    calculate_kv_scales: bool = _arg(
        False, "with an fp8 KV cache: set each layer's k/v scales from the first batch (default: the "
               "checkpoint's, else 1.0)", action="store_true")
    seed: Optional[int] = _arg(None, "seed of the sampling noise of requests without a seed of their own "
                                     "(default: torch's global generator)", type=int)
    enforce_eager: bool = _arg(False, "no compile and no CUDA graphs", action="store_true")
    gpu_memory_utilization: Optional[float] = _arg(
        None, "share (0, 1] of the GPU's memory for weights and KV cache; on the CPU, of the default 1 GiB KV "
              "budget (default: 90%% of what the weights leave)", type=float)
    generation_config: Union[str, Path] = _arg(
        "auto", "auto (the checkpoint's generation_config.json), vllm (none) or a directory: the default "
                "sampling parameters (default: auto)")
    max_grammar_compile_seconds: Optional[float] = _arg(
        None, "a structured output (response_format, structured_outputs, forced tool_choice) whose grammar "
              "compiles for longer fails its own request (serve: with a 400); grammars compile beside the engine "
              "loop, so other requests keep running meanwhile (default: no bound; serve: 5)", type=float,
        metavar="SECONDS")
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT directories) on top of the model, each under a "
                                    "model name of its own", action="store_true")
    max_loras: int = _arg(1, "most distinct adapters in one step (default: 1)", type=int)
    max_lora_rank: int = _arg(16, "largest adapter rank served (default: 16)", type=int)
    max_cpu_loras: Optional[int] = _arg(None, "parsed adapters kept in host memory (default: --max-loras)",
                                        type=int)
    runner: str = _arg(
        "auto", "generate (completions, chat) or pooling (an embedding model or reranker: /v1/embeddings, "
                "/v1/score, /rerank), as vLLM's; auto: pooling where the checkpoint says so (a "
                "sentence-transformers Pooling module, or a Qwen3Model / sequence-classifier checkpoint)",
        metavar="{auto,generate,pooling}")
    task: Optional[str] = _arg(None, "vLLM's older spelling of --runner: embed and score mean pooling")
    hf_overrides: Optional[dict] = _arg(
        None, "vLLM's JSON for Qwen3-Reranker: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
              "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'",
        type=_json_overrides, metavar="JSON")
    tokenizer: Union[str, Path, None] = _arg(
        None, "a checkpoint directory with a tokenizer.json, or a GGUF file, whose tokenizer and chat template to "
              "use instead of the model's (vLLM's flag)")

    # ------------------------------------------------------------------ the command line
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, positional_model: bool = False,
                     exclude: Sequence[str] = ()) -> argparse.ArgumentParser:
        """Add a flag per field (vLLM's spellings: ``--max-num-seqs``) with the field's default; the
        model is MODEL (``positional_model``) or ``--model``. ``exclude``: fields whose flag the
        command spells otherwise (``generate``'s ``--seed`` seeds its one request)."""
        model_help = "checkpoint directory (Hugging Face layout) or GGUF file; default: the embedded model"
        if positional_model:
            parser.add_argument("model", nargs="?", default=None, help=model_help)
        else:
            parser.add_argument("--model", default=None, help=model_help)
        for f in fields(cls):
            if f.name in exclude or "help" not in f.metadata:
                continue
            flags = ["--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
            parser.add_argument(*flags, default=f.default, help=f.metadata["help"], **f.metadata["argparse"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The fields ``args`` has (those ``add_cli_args`` added); the others keep their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def llm_kwargs(self) -> dict:
        """``LLM(self.model, **self.llm_kwargs())``'s keywords: every field but ``model``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}

    # ------------------------------------------------------------------ the one validation
    def validate(self) -> None:
        """Check every argument by name, before anything is loaded; raise ``ValueError`` naming the
        argument, its value and what was expected. What needs the checkpoint (``max_model_len``
        against the model's limit, the KV budget, the runner ``"auto"`` picks) is checked by ``LLM``."""
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise ValueError(f"model = {self.model!r}, expected a checkpoint directory or a Hugging Face model id "
                             "(str or Path), or None")
        _check_dtype(self.dtype)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed = {self.seed!r}, expected an int or None")
        _check_bool("enforce_eager", self.enforce_eager)
        if self.enforce_eager:
            for name, flag in (("compile", self.compile), ("cuda_graphs", self.cuda_graphs)):
                if flag:
                    raise ValueError(f"{name} = True with enforce_eager = True; enforce_eager means no compile and "
                                     f"no CUDA graphs, expected one of them")
        if self.gpu_memory_utilization is not None and (not _is_number(self.gpu_memory_utilization)
                                                        or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization = {self.gpu_memory_utilization!r}, expected a number in (0, 1] "
                             "or None")
        seconds = self.max_grammar_compile_seconds
        if seconds is not None and (not _is_number(seconds) or not 0 < seconds < math.inf):
            raise ValueError(f"max_grammar_compile_seconds = {seconds!r}, expected a number of seconds > 0 or None")
        if not isinstance(self.generation_config, (str, Path)) or not self.generation_config:
            raise ValueError(f"generation_config = {self.generation_config!r}, expected 'auto', 'vllm' or a "
                             "directory")
        _check_kv_cache_dtype(self.kv_cache_dtype)
        _check_bool("calculate_kv_scales", self.calculate_kv_scales)
        if self.swap_space is not None and (not _is_number(self.swap_space) or not math.isfinite(self.swap_space)
                                            or self.swap_space < 0):
            raise ValueError(f"swap_space = {self.swap_space!r}, expected a number of GiB >= 0 (vLLM's unit) or None")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode = {self.preemption_mode!r}, expected 'recompute' or 'swap'")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("check_invariants", self.check_invariants)
        _check_bool("compile", self.compile, optional=True)
        _check_bool("cuda_graphs", self.cuda_graphs, optional=True)
        if self.decode_buckets is not None:
            buckets = list(self.decode_buckets)
            if not buckets:
                raise ValueError("decode_buckets is empty; expected batch sizes >= 1, or None")
            for i, b in enumerate(buckets):
                _check_int(f"decode_buckets[{i}]", b, 1)
        compile_backend = self.compile_backend if self.backend is None else self.backend
        if compile_backend not in ("inductor", "tensorrt"):
            raise ValueError(f"compile_backend = {compile_backend!r}, expected 'inductor' or 'tensorrt'")
        _check_device(self.device)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_bool("enable_lora", self.enable_lora)
        self.lora_config()
        if self.speculative() is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config = {self.speculative_config!r} with tensor_parallel_size = "
                             f"{self.tensor_parallel_size}: speculative decoding runs on one rank only; expected "
                             "tensor_parallel_size = 1 or no speculative_config")
        self._check_runner()
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, Path)):
            raise ValueError(f"tokenizer = {self.tokenizer!r}, expected a checkpoint directory with a tokenizer.json, "
                             "a GGUF file or a Hugging Face model id (str or Path), or None")

    def _check_runner(self) -> None:
        from qwen_ops.serving.pooling import check_hf_overrides, resolve_runner

        resolve_runner(self.runner, self.task, False)       # the names; "auto" is decided by the checkpoint
        if self.hf_overrides is not None:
            check_hf_overrides(self.hf_overrides)
            if self.runner == "generate" or self.task == "generate":
                raise ValueError("hf_overrides (a Qwen3-Reranker classifier) with a generate runner; expected "
                                 "runner='pooling' or 'auto'")

    # ------------------------------------------------------------------ the configs built from the fields
    def lora_config(self):
        """The engine's ``LoRAConfig`` (None without ``enable_lora``), which checks its numbers."""
        from qwen_ops.engine.lora import LoRAConfig

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None

    def speculative(self):
        """The engine's ``SpeculativeConfig`` of ``speculative_config`` (None: no speculation)."""
        from qwen_ops.engine.speculative import SpeculativeConfig

        return SpeculativeConfig.from_dict(self.speculative_config)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}, expected an int >= {low}" + (" or None" if optional else ""))


def _check_bool(name: str, value: Any, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise ValueError(f"{name} = {value!r}, expected True or False" + (" or None" if optional else ""))


def _check_dtype(dtype: Any) -> None:
    from qwen_ops.models.loader import resolve_dtype

    # "auto" is config.json's dtype, unknown before the load: here any name resolves or fails.
    resolve_dtype(dtype, SimpleNamespace(dtype=None))


def _check_kv_cache_dtype(kv_cache_dtype: Any) -> None:
    from qwen_ops.ops.kv_quant import KV_CACHE_DTYPES

    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype = {kv_cache_dtype!r}, expected one of {sorted(KV_CACHE_DTYPES)} "
                         "(vLLM's names)")


def _check_device(device: Any) -> None:
    import torch

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
