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
import enum
import json
import math
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
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


@dataclass(frozen=True, init=False)
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

    ``hf_overrides`` (vLLM's): config.json keys laid over the checkpoint's (``{"rope_theta": 1e6,
    "rope_scaling": {"rope_type": "yarn", ...}}``: vLLM's context extension), and for Qwen3-Reranker ``{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True}`` runs a causal-LM checkpoint as a reranker: the pooling
    runner, and ``score`` is the softmax share of "yes" over the two tokens' logits at the last
    position of ``text_1 + text_2`` (``qwen3_reranker_inputs`` formats them as its model card says).

    ``compile_backend`` (``"inductor"`` or ``"tensorrt"``) compiles the decode step; ``backend`` is
    its deprecated older name. ``check_invariants`` asserts the scheduler's invariants every
    iteration (tests).
    """

    model: Union[str, Path, None] = None
    dtype: Union[str, torch.dtype] = _arg(
        "auto", "auto, float32, bfloat16 or float16; auto (vLLM's default): the checkpoint's dtype (config.json's), "
                "bfloat16 only where the CPU computes in it (else float32) (default: auto)")
    device: Union[str, torch.device] = _arg("cpu", "cpu, cuda or cuda:N (default: cpu)")
    max_num_seqs: int = _arg(64, "most requests running at once (default: 64)", type=int)
    max_model_len: Optional[int] = _arg(
        None, "most tokens per request, prompt and output (default: the model's max_position_embeddings, lowered to "
              "what the KV cache holds)", type=int)
    block_size: int = _arg(16, "tokens per KV block (default: 16)", type=int)
    num_kv_blocks: Optional[int] = _arg(None, "KV blocks (default: sized from memory)", type=int)
    max_num_batched_tokens: Optional[int] = _arg(
        None, "most tokens in one forward pass, prefill chunks and decodes together (default: the larger of 512 "
              "and --max-num-seqs)", type=int)
    preemption_mode: str = _arg("recompute", "recompute or swap: what a request preempted for KV blocks loses "
                                             "(default: recompute)", metavar="{recompute,swap}")
    kv_cache_bytes: Optional[int] = _arg(
        None, "the older name of --kv-cache-memory-bytes", type=int)
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
        None, "share (0, 1] of the device's memory for weights and KV cache; on the CPU, as vLLM-CPU: of the RAM, "
              "the KV cache getting what this process does not already use (default: a 1 GiB KV cache on the CPU, "
              "90%% of what the weights leave on a GPU)", type=float)
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

    # vLLM's arguments added for drop-in use (issue 62); VLLM_ARGUMENTS below lists the rest.
    kv_cache_memory_bytes: Optional[int] = _arg(
        None, "bytes of KV cache, as vLLM's (also: VLLM_CPU_KVCACHE_SPACE, GiB, which wins as in vLLM-CPU) "
              "(default: 1 GiB on the CPU, on a GPU what the weights leave)", type=int)
    num_gpu_blocks_override: Optional[int] = _arg(None, "vLLM's name of --num-kv-blocks", type=int)
    trust_remote_code: bool = _arg(
        False, "accepted for vLLM's command lines: qwen_ops runs its own model code, never a checkpoint's",
        action="store_true")
    tokenizer_mode: str = _arg("auto", "auto, hf or slow (vLLM's; all three are the checkpoint's fast tokenizer, "
                                       "tokenizer.json) (default: auto)")
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer: prompts are token ids, outputs carry ids and no "
                                            "text (vLLM's)", action="store_true")
    revision: Optional[str] = _arg(None, "the model id's revision in the Hugging Face cache (a branch, tag or "
                                         "commit; default: main)")
    tokenizer_revision: Optional[str] = _arg(None, "the --tokenizer id's revision (default: main)")
    code_revision: Optional[str] = _arg(None, "accepted for vLLM's command lines (no remote code runs here)")
    download_dir: Optional[str] = _arg(None, "the Hugging Face cache directory model ids are looked up and "
                                             "downloaded in (default: the hub's, HF_HOME)")
    hf_token: Union[str, bool, None] = _arg(None, "a Hugging Face token for downloads (default: the hub's own)")
    load_format: str = _arg("auto", "auto, safetensors or gguf: what the model path holds (vLLM's names; "
                                    "default: auto)")
    config_format: str = _arg("auto", "auto, hf or gguf (vLLM's; default: auto)")
    max_logprobs: int = _arg(20, "most log-probabilities a request may ask for per token (vLLM's; at most 20) "
                                 "(default: 20)", type=int)
    enable_chunked_prefill: Optional[bool] = _arg(
        None, "split long prompts over steps (vLLM's; always on here: --no-enable-chunked-prefill warns)",
        action=argparse.BooleanOptionalAction)
    override_generation_config: Optional[dict] = _arg(
        None, "sampling defaults over the checkpoint's generation_config.json, vLLM's JSON: '{\"temperature\": "
              "0.5}'", type=lambda t: json_object(t, "an object such as '{\"temperature\": 0.5}'"), metavar="JSON")
    disable_log_stats: bool = _arg(False, "no periodic throughput / KV-cache log line (vLLM's)",
                                   action="store_true")
    scheduling_policy: str = _arg("fcfs", "fcfs: requests run in arrival order (vLLM's priority is not "
                                          "supported) (default: fcfs)", metavar="{fcfs}")
    pipeline_parallel_size: int = _arg(1, "vLLM's; only 1 here (use --tensor-parallel-size)", "-pp", type=int)
    data_parallel_size: int = _arg(1, "engine replicas behind one server or LLM, each in its own process with "
                                         "its own KV cache (vLLM's) (default: 1)", "-dp", type=int)
    distributed_executor_backend: Optional[str] = _arg(
        None, "mp (worker processes; the default), uni or external_launcher (torchrun), as vLLM's; not ray")
    served_model_name: Union[str, Sequence[str], None] = None   # vLLM's; the server has the flag, offline unused
    # vLLM's other arguments (VLLM_ARGUMENTS) that were given, by name: accepted with a warning or refused
    # by validate(); collected by __init__ and from_cli_args. No flag of its own.
    vllm_options: Optional[dict] = None

    def __init__(self, model: Union[str, Path, None] = None, **kwargs: Any) -> None:
        """The fields by keyword, as the dataclass's own ``__init__`` would take them, and vLLM's other
        argument names (``VLLM_ARGUMENTS``), kept in ``vllm_options`` for ``validate()`` to warn about
        or refuse. Any other name is a TypeError, as a misspelt keyword of ``LLM`` always was."""
        known = {f.name for f in fields(type(self))}
        options = dict(kwargs.pop("vllm_options", None) or {})
        kwargs.pop("vllm_flags", None)        # add_cli_args' record in a namespace: LLM(**vars(args)) is vLLM's idiom
        for name, value in kwargs.items():
            if name in known:
                object.__setattr__(self, name, value)
            elif name in VLLM_ARGUMENTS:
                options[name] = value
            else:
                import difflib

                close = difflib.get_close_matches(name, sorted(known | set(VLLM_ARGUMENTS)), n=1)
                raise TypeError(f"{type(self).__name__} got an unexpected keyword argument {name!r}"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "vllm_options", options or None)

    # ------------------------------------------------------------------ the command line
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, positional_model: bool = False,
                     exclude: Sequence[str] = ()) -> argparse.ArgumentParser:
        """Add a flag per field (vLLM's spellings: ``--max-num-seqs``) with the field's default, and
        one per name of ``VLLM_ARGUMENTS`` (in a group of their own, for vLLM's command lines); the
        model is ``--model``, and also MODEL with ``positional_model`` (``qwen-ops serve MODEL``, as
        ``vllm serve MODEL``). ``exclude``: fields whose flag the command spells otherwise
        (``generate``'s ``--seed`` seeds its one request); a flag the parser already has is skipped."""
        model_help = "checkpoint directory (Hugging Face layout), GGUF file or model id; default: the embedded model"
        if positional_model:
            parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_help)
            parser.add_argument("--model", default=None, help="the same as MODEL (vLLM's flag)")
        else:
            parser.add_argument("--model", default=None, help=model_help)
        taken = set(getattr(parser, "_option_string_actions", {}))
        for f in fields(cls):
            if f.name in exclude or "help" not in f.metadata:
                continue
            flags = [flag for flag in ("--" + f.name.replace("_", "-"), *f.metadata["aliases"]) if flag not in taken]
            if flags:
                parser.add_argument(*flags, default=f.default, help=f.metadata["help"], **f.metadata["argparse"])
        group = parser.add_argument_group(
            "vLLM's other engine arguments", "accepted so that vLLM's command lines run: one without effect here "
            "warns once, one asking for what is not here is an error (serving/engine_args.py, VLLM_ARGUMENTS)")
        added = []
        for name in VLLM_ARGUMENTS:
            flag = "--" + name.replace("_", "-")
            if name not in exclude and flag not in taken:
                group.add_argument(flag, dest=name, default=argparse.SUPPRESS, nargs="?", const=True,
                                   type=_loose_value, help=argparse.SUPPRESS)
                added.append(name)
        parser.set_defaults(vllm_flags=tuple(added))          # from_cli_args reads these, not a command's own
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The fields ``args`` has (those ``add_cli_args`` added; MODEL or ``--model``), and the vLLM-only
        flags given; the others keep their defaults."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        tag = getattr(args, "model_tag", None)
        if tag is not None:
            if kwargs.get("model") not in (None, tag):
                raise ValueError(f"the model is given twice, as MODEL = {tag!r} and --model = {kwargs['model']!r}; "
                                 "expected one of them")
            kwargs["model"] = args.model = tag          # one name for the commands to read it by
        kwargs.update((name, getattr(args, name)) for name in getattr(args, "vllm_flags", ()) if hasattr(args, name))
        return cls(**kwargs)

    def llm_kwargs(self) -> dict:
        """``LLM(self.model, **self.llm_kwargs())``'s keywords: every field but ``model``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}

    # ------------------------------------------------------------------ what the fields resolve to
    def kv_cache_budget(self) -> Optional[int]:
        """Bytes of KV cache asked for, as vLLM-CPU reads them: ``VLLM_CPU_KVCACHE_SPACE`` (GiB; it wins, as in
        vLLM-CPU, where it is set to a number other than 0), else ``kv_cache_memory_bytes``, else its older name
        ``kv_cache_bytes``; None: none asked for (the default budget, or ``gpu_memory_utilization``'s)."""
        env = os.environ.get(KVCACHE_SPACE_ENV, "").strip()
        if env:
            try:
                gib = float(env)
            except ValueError:
                gib = -1.0
            if not math.isfinite(gib) or gib < 0:
                raise ValueError(f"{KVCACHE_SPACE_ENV} = {env!r}, expected a number of GiB >= 0 (0: not set)")
            if gib > 0 and str(self.device).startswith("cpu"):
                return int(gib * (1 << 30))
        return self.kv_cache_memory_bytes if self.kv_cache_memory_bytes is not None else self.kv_cache_bytes

    def kv_blocks(self) -> Optional[int]:
        """``num_kv_blocks``, or vLLM's ``num_gpu_blocks_override``; None: sized from memory."""
        return self.num_kv_blocks if self.num_kv_blocks is not None else self.num_gpu_blocks_override

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
        self._check_vllm_arguments()
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, Path)):
            raise ValueError(f"tokenizer = {self.tokenizer!r}, expected a checkpoint directory with a tokenizer.json, "
                             "a GGUF file or a Hugging Face model id (str or Path), or None")

    def _check_vllm_arguments(self) -> None:
        """The vLLM arguments of issue 62: each checked by name; those of ``VLLM_ARGUMENTS`` warned
        about (once each, one line) or refused."""
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1, optional=True)
        for a, b in (("kv_cache_memory_bytes", "kv_cache_bytes"), ("num_gpu_blocks_override", "num_kv_blocks")):
            if getattr(self, a) is not None and getattr(self, b) is not None and getattr(self, a) != getattr(self, b):
                raise ValueError(f"{a} = {getattr(self, a)!r} and {b} = {getattr(self, b)!r} disagree; {b} is the "
                                 f"older name of {a}, expected one of them")
        self.kv_cache_budget()                               # VLLM_CPU_KVCACHE_SPACE's value
        for name in ("trust_remote_code", "skip_tokenizer_init", "disable_log_stats"):
            _check_bool(name, getattr(self, name))
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill, optional=True)
        _check_choice("tokenizer_mode", self.tokenizer_mode, ("auto", "hf", "slow"),
                      "vLLM's mistral / custom tokenizers are not supported here")
        _check_choice("load_format", self.load_format, ("auto", "safetensors", "gguf"),
                      "the weights here are safetensors or a GGUF file")
        _check_choice("config_format", self.config_format, ("auto", "hf", "gguf"), "")
        _check_choice("scheduling_policy", self.scheduling_policy, ("fcfs",),
                      "requests run in arrival order here; vLLM's priority scheduling is not supported")
        _check_choice("distributed_executor_backend", self.distributed_executor_backend,
                      (None, "mp", "uni", "external_launcher"), "Ray is not used here")
        for name in ("revision", "tokenizer_revision", "code_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, Path)) or not str(value)):
                raise ValueError(f"{name} = {value!r}, expected a non-empty string or None")
        if self.hf_token is not None and not isinstance(self.hf_token, (str, bool)):
            raise ValueError(f"hf_token = {self.hf_token!r}, expected a token string, True, False or None")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or not -1 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs = {self.max_logprobs!r}, expected an int in [0, 20] (-1: 20, the most "
                             "the sampler returns)")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config = {self.override_generation_config!r}, expected a dict "
                             "such as {'temperature': 0.5} or None")
        _check_int("data_parallel_size", self.data_parallel_size, 1)     # > 1: the server's replicas
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size = {self.pipeline_parallel_size}, but only 1 is supported here; "
                             "expected 1 (split a model with tensor_parallel_size)")
        if self.served_model_name is not None and not isinstance(self.served_model_name, (str, list, tuple)):
            raise ValueError(f"served_model_name = {self.served_model_name!r}, expected a name, a list of names or "
                             "None")
        if self.vllm_options is not None and not isinstance(self.vllm_options, dict):
            raise ValueError(f"vllm_options = {self.vllm_options!r}, expected a dict of vLLM argument names or None")
        for name, value in (self.vllm_options or {}).items():
            if name not in VLLM_ARGUMENTS:
                raise ValueError(f"vllm_options has {name!r}, which is not one of vLLM's engine arguments")
            if _is_vllm_default(name, value):
                continue
            action, why = VLLM_ARGUMENTS[name]
            if action == "read":
                continue
            if action == "refuse":
                default = f"vLLM's default {_VLLM_DEFAULTS[name]!r}" if name in _VLLM_DEFAULTS else "it left out"
                raise ValueError(f"{name} = {value!r} is not supported: {why}; expected {default}")
            logger.warning("%s = %r has no effect here: %s", name, value, why)
        if self.enable_chunked_prefill is False:
            logger.warning("enable_chunked_prefill = False has no effect here: a prompt longer than the step's token "
                           "budget is always split over steps")
        if self.tokenizer_mode == "slow":
            logger.warning("tokenizer_mode = 'slow': the checkpoint's fast tokenizer (tokenizer.json) is used, as "
                           "'auto'")

    def _check_runner(self) -> None:
        from qwen_ops.serving.pooling import check_hf_overrides, resolve_runner, split_hf_overrides

        resolve_runner(self.runner, self.task, False)       # the names; "auto" is decided by the checkpoint
        reranker, config = split_hf_overrides(self.hf_overrides)
        if config and self.tensor_parallel_size > 1:
            raise ValueError(f"hf_overrides = {self.hf_overrides!r} with tensor_parallel_size = "
                             f"{self.tensor_parallel_size}: config overrides apply to one process only; expected "
                             "tensor_parallel_size = 1, or a checkpoint whose config.json holds them")
        if reranker is not None:
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



# ---------------------------------------------------------------------- vLLM's other arguments
# Every argument of vLLM's EngineArgs (0.32) and LLM that has no field above, by what it means here.
# A value other than vLLM's default (or None / empty) is accepted with a one-line warning (``WARN``:
# a setting of hardware, kernels, distribution or observability this engine has no counterpart of;
# what it computes does not change) or refused by ``validate()`` with the reason (``REFUSE``: what
# vLLM would compute differs, or the feature is not here). Names are vLLM's; defaults are vLLM's.
_GPU = "a GPU / kernel setting of vLLM's; the CPU engine has no such knob"
_DIST = "a multi-process setting of vLLM's; here one process per tensor-parallel rank"
_LOAD = "a weight-loading setting of vLLM's; safetensors are memory-mapped here"
_SCHED = "a scheduler knob of vLLM's without a counterpart here"
_OBS = "an observability / logging setting of vLLM's without a counterpart here"
_DP = ("data-parallel replicas here are data_parallel_size processes on one machine behind one balancer; "
       "across machines, qwen-ops router in front of several servers (vLLM's ranks and DP coordinator are not "
       "used)")
_MM = "a multimodal setting; the models here are text-only"
_LORA = "a LoRA setting of vLLM's; adapters here are PEFT, in the model's dtype"
_WARN_GROUPS = {
    _GPU: "cudagraph_capture_sizes max_cudagraph_capture_size ir_op_priority enable_return_routed_experts "
          "moe_backend linear_backend sparse_indexer_topk_backend all2all_backend enable_dbo ubatch_size "
          "dbo_decode_token_threshold dbo_prefill_token_threshold disable_custom_all_reduce enable_shm_tensor_arena "
          "offload_backend cpu_offload_gb cpu_offload_params offload_group_size offload_num_in_group "
          "offload_prefetch_step offload_params use_fp64_gumbel disable_cascade_attn compilation_config "
          "attention_config kernel_config enable_flashinfer_autotune enable_cumem_allocator enable_nccl_comm_suspend "
          "attention_backend mamba_backend mamba_ssu_algorithm enable_mamba_cache_stochastic_rounding "
          "mamba_cache_philox_rounds gdn_prefill_backend kda_prefill_backend kda_decode_backend optimization_level "
          "performance_mode async_scheduling kv_sharing_fast_prefill swa_bounded_replay use_replayssm "
          "replayssm_buffer_len sleep_mode_offload_cudagraph sleep_preserve_parameter_names pt_load_map_location "
          "mamba_config mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size mamba_cache_mode "
          "enable_mamba_shared_prefix_checkpoint kv_offloading_size kv_offloading_backend "
          "kv_cache_dtype_skip_layers enable_expert_parallel enable_eplb eplb_config expert_placement_strategy "
          "enable_ep_weight_filter enable_hc_sp enable_batch_sharded_sampling ray_workers_use_nsight "
          "enable_layerwise_nvtx_tracing max_seq_len_to_capture max_context_len_to_capture "
          "disable_async_output_proc num_scheduler_steps multi_step_stream_outputs use_v2_block_manager block_allocator",
    _DIST: "master_addr master_port distributed_timeout_seconds cpu_distributed_timeout_seconds numa_bind "
           "numa_bind_nodes numa_bind_cpus device_ids dcp_comm_backend dcp_q_replicate dcp_kv_cache_interleave_size "
           "cp_kv_cache_interleave_size data_parallel_backend dp_sync_interval disable_nccl_for_dp_synchronization "
           "elastic_ep_max_dp_size max_parallel_loading_workers",
    _LOAD: "safetensors_load_strategy safetensors_prefetch_num_threads safetensors_prefetch_block_size "
           "model_loader_extra_config ignore_patterns use_tqdm_on_load allow_deprecated_quantization",
    _SCHED: "max_num_scheduled_tokens long_prefill_token_threshold long_prefill_token_threshold_adaptive "
            "max_num_active_seqs max_num_queued_reqs max_num_queued_tokens prefill_schedule_interval watermark "
            "scheduler_reserve_full_isl disable_hybrid_kv_cache_manager disable_sliding_window "
            "prefix_caching_hash_algo prefix_cache_retention_interval prefix_match_unit stream_interval "
            "structured_outputs_config guided_decoding_backend shutdown_timeout additional_config",
    _OBS: "show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces "
          "per_request_spec_decode_metrics kv_cache_metrics kv_cache_metrics_sample custom_histogram_buckets "
          "cudagraph_metrics enable_mfu_metrics enable_logging_iteration_details jit_monitor_mode "
          "jit_monitor_verbose enable_mm_processor_stats logging_config log_level log_config_file "
          "aggregate_engine_logging enable_trace_replay fault_tolerance_config "
          "enable_fault_tolerance fail_on_environ_validation enable_log_requests disable_log_requests "
          "reasoning_parser reasoning_parser_plugin",
    _MM: "allowed_local_media_path allowed_media_domains language_model_only limit_mm_per_prompt "
         "interleave_mm_strings media_io_kwargs mm_processor_kwargs mm_processor_cache_gb mm_processor_cache_type "
         "mm_hasher_algorithm mm_shm_cache_max_object_size_mb mm_encoder_tp_mode mm_encoder_attn_backend "
         "mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path "
         "mm_encoder_fp8_scale_save_margin renderer_num_workers skip_mm_profiling video_pruning_rate "
         "video_pruning_method mm_tensor_ipc mm_processor_device mm_ipc_gpu_memory_gb mm_device_do_normalize "
         "disable_chunked_mm_input",
    _LORA: "fully_sharded_loras lora_dtype enable_tower_connector_lora specialize_active_lora "
           "enable_mixed_moe_lora_format enable_moe_shared_loras",
}
_REFUSED = {
    "return_sampling_mask": "sampling masks are not returned here",
    "model_weights": "weights come from the model path here",
    "hf_config_path": "the config comes from the model path here",
    "convert": "models are not converted to another runner here (runner='pooling' reads a pooling checkpoint)",
    "enable_prompt_embeds": "prompts are text or token ids here",
    "prefill_context_parallel_size": "context parallelism is not implemented here",
    "decode_context_parallel_size": "context parallelism is not implemented here",
    "nnodes": "one machine here", "node_rank": "one machine here",
    "data_parallel_rank": _DP,
    "data_parallel_start_rank": _DP,
    "data_parallel_size_local": _DP,
    "data_parallel_address": _DP,
    "data_parallel_rpc_port": _DP,
    "data_parallel_hybrid_lb": _DP,
    "data_parallel_external_lb": _DP,
    "data_parallel_multi_port_external_lb": _DP,
    "enable_elastic_ep": "expert parallelism is not implemented here",
    "logprobs_mode": "log-probabilities here are the model's raw ones (vLLM's raw_logprobs)",
    "model_class_overrides": "the model classes here are qwen_ops' own",
    "quantization_config": "quantization comes from the checkpoint or --quantization here",
    "enable_mm_embeds": _MM, "mm_encoder_only": _MM, "default_mm_loras": _MM,
    "io_processor_plugin": "plugins are not loaded here",
    "lora_target_modules": "an adapter's target modules come from its adapter_config.json here",
    "max_lora_cls_labels": "LoRA classifier heads are not supported here",
    "spec_method": "use speculative_config", "spec_model": "use speculative_config",
    "spec_tokens": "use speculative_config",
    "watermark_config": "watermarking is not implemented here", "diffusion_config": "diffusion models are not here",
    "scheduler_cls": "the scheduler here is qwen_ops' own", "pooler_config": "pooling comes from the checkpoint here",
    "override_pooler_config": "pooling comes from the checkpoint here",
    "aux_output_config": "auxiliary outputs are not implemented here", "engram_config": "not implemented here",
    "reasoning_config": "reasoning budgets are not implemented here",
    "worker_cls": "the workers here are qwen_ops' own", "worker_extension_cls": "the workers here are qwen_ops' own",
    "kv_transfer_config": "KV transfer (disaggregated prefill) is not implemented here",
    "kv_events_config": "KV events are not implemented here",
    "ec_transfer_config": "encoder-cache transfer is not implemented here", "ec_manager_config": _MM,
    "enable_sleep_mode": "sleep mode is not implemented here",
    "model_impl": "the model code here is qwen_ops' own",
    "logits_processors": "custom logits processors are not supported here",
    "tokens_only": "not implemented here",
    "weight_transfer_config": "weight transfer is not implemented here",
    "worker_use_ray": "Ray is not used here",
}
# vLLM's defaults where a name's non-default value is something other than None, False, 0 or empty.
_VLLM_DEFAULTS = {
    "safetensors_prefetch_num_threads": 8, "safetensors_prefetch_block_size": 16 << 20, "master_addr": "127.0.0.1",
    "master_port": 29501, "nnodes": 1, "dcp_kv_cache_interleave_size": 1, "prefill_context_parallel_size": 1,
    "decode_context_parallel_size": 1, "data_parallel_backend": "mp", "moe_backend": "auto", "linear_backend": "auto",
    "sparse_indexer_topk_backend": "auto", "all2all_backend": "allgather_reducescatter", "dbo_decode_token_threshold": 32,
    "dp_sync_interval": 16, "dbo_prefill_token_threshold": 512, "expert_placement_strategy": "linear",
    "prefix_caching_hash_algo": "sha256", "offload_backend": "auto", "offload_num_in_group": 1,
    "offload_prefetch_step": 1, "logprobs_mode": "raw_logprobs", "mm_processor_cache_gb": 4,
    "mm_processor_cache_type": "lru", "mm_hasher_algorithm": "blake3", "mm_shm_cache_max_object_size_mb": 128,
    "mm_encoder_tp_mode": "weights", "mm_encoder_fp8_scale_save_margin": 1.5, "renderer_num_workers": 1,
    "video_pruning_method": "evs", "mm_tensor_ipc": "direct_rpc", "mm_processor_device": "auto",
    "mm_device_do_normalize": True, "lora_dtype": "auto", "scheduler_reserve_full_isl": True,
    "prefill_schedule_interval": 1, "per_request_spec_decode_metrics": "none", "kv_cache_metrics_sample": 0.01,
    "jit_monitor_mode": "warn", "worker_cls": "auto", "model_impl": "auto", "mamba_cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none", "replayssm_buffer_len": 16, "mamba_backend": "triton",
    "use_tqdm_on_load": True, "pt_load_map_location": "cpu", "stream_interval": 1, "swa_bounded_replay": True,
    "optimization_level": 2, "performance_mode": "balanced", "kv_offloading_backend": "native", "convert": "auto",
    "structured_outputs_config": None, "guided_decoding_backend": "auto", "disable_log_requests": True,
}


# vLLM's arguments read from ``vllm_options`` by the feature they configure (no field of their own; no warning).
_READ = {"profiler_config": "LLM.start_profile's trace folder (torch_profiler_dir)"}


def _vllm_arguments() -> dict[str, tuple[str, str]]:
    table = {name: ("warn", why) for why, names in _WARN_GROUPS.items() for name in names.split()}
    table.update((name, ("refuse", why)) for name, why in _REFUSED.items())
    table.update((name, ("read", why)) for name, why in _READ.items())
    return table


VLLM_ARGUMENTS = MappingProxyType(_vllm_arguments())     # name -> ("warn" | "refuse" | "read", why)


def _is_vllm_default(name: str, value: Any) -> bool:
    if name in _VLLM_DEFAULTS and value == _VLLM_DEFAULTS[name]:
        return True
    if isinstance(value, enum.Enum):
        return _is_vllm_default(name, value.value)
    return value is None or value is False or value == "" or (
        not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0 and name not in _VLLM_DEFAULTS
    ) or (isinstance(value, (dict, list, tuple, set)) and not value)


def _loose_value(text: str) -> Any:
    """A vLLM-only flag's value: JSON where it parses (numbers, true, objects), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's ``FlexibleArgumentParser``: an ``ArgumentParser`` that also takes ``--flag_name`` for
    ``--flag-name`` (vLLM's examples build theirs with it and ``EngineArgs.add_cli_args``)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        fixed = []
        for a in args:
            if a.startswith("--") and "_" in a.split("=", 1)[0]:
                key, eq, value = a.partition("=")
                a = key.replace("_", "-") + eq + value
            fixed.append(a)
        return super().parse_known_args(fixed, namespace)


KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


@dataclass(frozen=True, init=False)
class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs``: the same arguments (``AsyncLLM.from_engine_args`` takes either)."""


def _check_choice(name: str, value: Any, allowed: tuple, why: str) -> None:
    if value not in allowed:
        names = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} = {value!r}, expected one of {names}" + (f" ({why})" if why else ""))


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
