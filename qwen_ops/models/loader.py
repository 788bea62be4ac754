"""Load a Hugging Face Qwen checkpoint directory: config, safetensors weights, tokenizer, EOS ids.

Layout read: ``config.json``; ``model.safetensors`` or ``model.safetensors.index.json`` plus
its shards; optional ``tokenizer.json`` and ``generation_config.json``.

Memory: the module is built on the ``meta`` device (no storage), every header is checked
against the config before any data is read, then tensors are copied one by one from the
memory-mapped file into freshly allocated parameters of the target dtype and device. A
mapping is closed after every ``MAP_WINDOW_BYTES`` of tensors read, because pages of a
mapping that stays open count as resident memory: so peak host memory is about the model's
size plus one window (plus the largest single tensor).

Mixture-of-experts weights: the model holds each layer's experts stacked,
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]`` (transformers 5.x's
in-memory names). A checkpoint may store exactly those (``save_pretrained(...,
save_original_format=False)`` writes them), or one tensor per expert, as ``save_pretrained`` and the
Hub checkpoints do: ``mlp.experts.<e>.gate_proj.weight`` and ``up_proj.weight`` ``[I, H]`` (rows 0:I
and I:2I of expert e's slice of gate_up_proj) and ``mlp.experts.<e>.down_proj.weight`` ``[H, I]``.
Either way each tensor is copied straight into its slice of the stacked parameter, which is
allocated once: no second copy of the experts.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from qwen_ops.models.gguf import as_path
from qwen_ops.models.config import QwenConfig, token_ids
from qwen_ops.models.formats import (FILE_DTYPES, INDEX_FILE, MAP_WINDOW_BYTES, SINGLE_FILE, CheckpointError,  # noqa: F401
                                     checkpoint_name, open_file as _open, read_json as _read_json, weight_files)
from qwen_ops.models import quant_load
from qwen_ops.models.dense import QwenForCausalLM
from qwen_ops.models.hybrid import Qwen3_5ForCausalLM
from qwen_ops.models.layers import rope_table
from qwen_ops.models.mtp import MTPHead
from qwen_ops.models.parallel import TPGroup, shard_model, tp_slice
from qwen_ops.models import quant as Q
from qwen_ops.models.tokenizer import QwenTokenizer, load_tokenizer

logger = logging.getLogger(__name__)
GENERATION_CONFIG_FILE = "generation_config.json"

DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Names a checkpoint may hold that carry nothing the model needs (old exports saved RoPE buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# An fp8-KV checkpoint's per-layer cache scales, under an attention module's checkpoint prefix, in the
# spellings vLLM reads (compressed-tensors / ModelOpt / AutoFP8): key scale first, then value scale.
# ``kv_scale`` (AutoFP8's older single scale) is both.
KV_SCALE_NAMES = ((".k_scale", ".v_scale"), (".attn.k_scale", ".attn.v_scale"),
                  (".k_proj.k_scale", ".v_proj.v_scale"), (".k_proj.output_scale", ".v_proj.output_scale"),
                  (".kv_scale", ".kv_scale"))
KV_SCALE_SUFFIXES = tuple({name for pair in KV_SCALE_NAMES for name in pair})
# Qwen3.5 checkpoints: the multi-token-prediction head and (qwen3_5) the vision tower are not loaded.
HYBRID_IGNORED_PREFIXES = ("mtp.", "model.visual.")
# The embedding's name in a checkpoint of the bare decoder (transformers' Qwen3Model, no "model." prefix).
BARE_EMBEDDING = "embed_tokens.weight"
# The classification head of a Qwen3ForSequenceClassification checkpoint (read with pooling=True).
SEQUENCE_CLASSIFIER = "score.weight"
# Stacked expert parameters (qwen_ops.models.moe), which a checkpoint may store one tensor per expert.
EXPERTS_GATE_UP = ".experts.gate_up_proj"
EXPERTS_DOWN = ".experts.down_proj"
MAX_LISTED_PROBLEMS = 20


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: what the engine needs to run it."""
    path: Path
    config: QwenConfig
    model: QwenForCausalLM
    tokenizer: Optional[QwenTokenizer]
    eos_token_ids: tuple[int, ...]

    def require_tokenizer(self) -> QwenTokenizer:
        """The tokenizer, or a clear error for callers that need text in or out."""
        if self.tokenizer is None:
            raise ValueError(f"checkpoint {self.path} has no tokenizer.json, so it cannot encode or decode "
                             "text; pass token ids instead, or add a tokenizer.json to the directory")
        return self.tokenizer


def load_checkpoint(path: str | Path, dtype: Any = "float32", device: Any = "cpu",
                    tp: Optional[TPGroup] = None, max_positions: Optional[int] = None,
                    config: Optional[QwenConfig] = None, quantization: Optional[str] = None,
                    mtp: bool = False, pooling: bool = False) -> Checkpoint:
    """Config, weights (as ``dtype`` on ``device``; this rank's slice with ``tp``), optional
    tokenizer and EOS ids of ``path``. ``max_positions``: rows of the RoPE table (``load_model``);
    ``config``: ``path``'s config when the caller has read it already; ``quantization``: online
    quantization of a full-precision checkpoint (``load_model``); ``pooling``: an embedding model's
    load, where the LM head may be absent (``load_model``)."""
    path = as_path(path)
    config = config or QwenConfig.from_pretrained(path)
    model = load_model(path, dtype, device, config=config, tp=tp, max_positions=max_positions,
                       quantization=quantization, mtp=mtp, pooling=pooling)
    return Checkpoint(path=path, config=config, model=model, tokenizer=load_tokenizer(path),
                      eos_token_ids=load_eos_token_ids(path, config))


def resolve_dtype(dtype: Any, config: QwenConfig) -> torch.dtype:
    """A torch dtype from a dtype or a name; ``'auto'`` is config.json's dtype (float32 if none, as transformers)."""
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name == "auto":
            resolved = config.dtype or torch.float32
        elif name in DTYPE_NAMES:
            resolved = DTYPE_NAMES[name]
        else:
            raise ValueError(f"dtype = {dtype!r}; expected a torch dtype or one of "
                             f"{', '.join(DTYPE_NAMES)}, auto")
    elif isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        raise TypeError(f"dtype = {dtype!r} has type {type(dtype).__name__}, expected a torch.dtype or a str")
    if resolved not in MODEL_DTYPES:
        raise ValueError(f"dtype = {dtype!r} resolves to {resolved}; expected one of float32, bfloat16, float16")
    return resolved


def load_eos_token_ids(path: str | Path, config: QwenConfig) -> tuple[int, ...]:
    """EOS ids of generation_config.json, then config.json's, without repeats, in that order."""
    file = Path(path) / GENERATION_CONFIG_FILE
    ids: list[int] = []
    if file.is_file():
        data = _read_json(file)
        ids += token_ids(data.get("eos_token_id"), f"{file}: eos_token_id")
    ids += config.eos_token_ids
    return tuple(dict.fromkeys(ids))


def load_model(path: str | Path, dtype: Any = "float32", device: Any = "cpu",
               config: Optional[QwenConfig] = None, tp: Optional[TPGroup] = None,
               max_positions: Optional[int] = None, quantization: Optional[str] = None,
               mtp: bool = False, pooling: bool = False) -> QwenForCausalLM:
    """Build the model of ``path`` (:class:`QwenForCausalLM` for qwen2 / qwen3 / qwen3_moe;
    :class:`Qwen3_5ForCausalLM` for the hybrids qwen3_5_text / qwen3_5 / qwen3_5_moe_text / qwen3_5_moe /
    qwen3_next, whose vision tower and ``mtp.*`` tensors are skipped) and fill it from its safetensors
    weights; stacked experts from either checkpoint layout (module docstring).

    With ``tp`` (tensor parallelism), the model is this rank's slice (``models/parallel.py``) and
    each sharded tensor is read as that slice of the file, never whole. ``max_positions``: the
    RoPE table holds positions below it (default ``max_position_embeddings``); an engine with
    ``max_seq_len`` needs only that many.

    The layer count of the config is checked against the checkpoint's tensor names before the
    module is built: a config.json naming more layers than the files hold fails at once.

    Quantized weights (``models/quant.py``): a checkpoint whose config.json has a
    ``quantization_config`` (fp8, awq, gptq) gets QuantLinear layers where its files hold quantized
    tensors, read into the ops' layouts without a full-precision copy; ``quantization`` ("int8",
    "fp8") quantizes a full-precision checkpoint's projections one tensor at a time as they are read.

    ``mtp``: also read the multi-token-prediction layer (``mtp.*``, ``models/mtp.py``) of a Qwen3-Next /
    Qwen3.5 checkpoint, as ``model.mtp`` (speculative decoding's ``"method": "mtp"``).

    A checkpoint saved as the bare decoder (transformers' ``Qwen3Model``: ``embed_tokens.weight``,
    ``layers.*``, ``norm.weight``, without the ``model.`` prefix; Qwen3-Embedding's) loads too.
    ``pooling``: the model will only pool hidden states (``runner="pooling"``), so an untied
    checkpoint without ``lm_head.weight`` loads with ``model.lm_head`` None, and a sequence
    classifier's ``score.weight`` (``Qwen3ForSequenceClassification``) loads as ``model.score``."""
    path = as_path(path)
    config = config or QwenConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    files = weight_files(path)
    _check_layer_count(path, files, config)
    quant = Q.read_quant_config(path, quantization)
    if quant is not None and tp is not None and tp.size > 1:
        raise ValueError(f"tensor parallelism (size {tp.size}) with quantized weights ({quant.method}) is not "
                         "supported yet; load with tensor_parallel_size=1")
    if mtp and (not config.is_hybrid or config.mtp_layers < 1):
        raise ValueError(f"{path / 'config.json'}: model_type = {config.model_type!r} with {config.mtp_layers} MTP "
                         "layers; speculative 'mtp' needs a Qwen3-Next or Qwen3.5 checkpoint with its mtp.* layer "
                         "(num_nextn_predict_layers / mtp_num_hidden_layers >= 1)")
    if mtp and tp is not None and tp.size > 1:
        raise ValueError("the MTP layer with tensor parallelism is not supported; load with tensor_parallel_size=1")
    with torch.device("meta"):
        model = (Qwen3_5ForCausalLM if config.is_hybrid else QwenForCausalLM)(config)
        if mtp:                 # its parameters, mtp.*, are read under their checkpoint names
            model.mtp = MTPHead(config)
    if tp is not None and tp.size > 1:
        shard_model(model, tp)
    plan = quant_load.prepare(path, model, quant, files, config, dtype)     # quantized layers swapped in (meta)
    bare = BARE_EMBEDDING in files and "model.embed_tokens.weight" not in files
    if pooling and not config.tie_word_embeddings and "lm_head.weight" not in files and not config.is_hybrid:
        model.lm_head = None              # nothing to compute logits with; pooling reads hidden states
    if pooling and SEQUENCE_CLASSIFIER in files:     # Qwen3ForSequenceClassification's head: score [labels, hidden]
        with _open(files[SEQUENCE_CLASSIFIER]) as f:
            shape = f.get_slice(SEQUENCE_CLASSIFIER).get_shape()
        if len(shape) != 2 or shape[1] != config.hidden_size:
            raise CheckpointError(f"{path}: tensor {SEQUENCE_CLASSIFIER!r} has shape {list(shape)}, expected "
                                  f"[num_labels, {config.hidden_size}]")
        with torch.device("meta"):
            model.score = nn.Linear(config.hidden_size, shape[0], bias=False)
    # Keyed by checkpoint name; tied lm_head.weight appears once, as embed_tokens.
    params = {checkpoint_name(name, config, bare): p for name, p in model.named_parameters()}
    experts = _expert_pieces(params, files)   # stacked experts the checkpoint stores per expert
    stacked = {piece.param for piece in experts}
    params = {name: p for name, p in params.items() if name not in stacked}
    handled = plan.tensors if plan is not None else set()
    _check_tensors(path, files, params, config, experts, handled)

    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in params:
        by_file[files[name]].append(name)
    renamed = {checkpoint_name(name, config, bare): name for name, _ in model.named_parameters()}
    for file, names in by_file.items():
        _copy_tensors(file, names, model, dtype, device, renamed)
    if experts:
        _copy_expert_pieces(files, experts, model, dtype, device, renamed)
    if config.tie_word_embeddings and model.lm_head is not None and not isinstance(model.lm_head, Q.QuantLinear):
        model.lm_head.weight = model.model.embed_tokens.weight
    quant_load.fill(plan, files, model, config, dtype, device)
    _load_kv_scales(model, files, config, device)
    gguf = getattr(next(iter(files.values()), None), "gguf", None)
    if gguf is not None:        # which tensors run as stored (the plan's, for blocks kept), which were dequantized
        model.gguf_summary = gguf.summary(plan.tensors if plan is not None and plan.quant.method == "gguf" else set())
        logger.info("GGUF %s", model.gguf_summary)
        gguf.release()          # the load's dequantized experts: not kept for the model's life
    model.model.rotary_emb.cos_sin = rope_table(config, device, max_positions)
    return model.eval()


def _load_kv_scales(model: nn.Module, files: dict[str, Path], config: QwenConfig, device: torch.device) -> None:
    """Every attention layer's fp8-KV scales: the checkpoint's (``KV_SCALE_NAMES``), else 1.0 (vLLM's
    default; ``calculate_kv_scales`` measures them instead). Read for fp8 caches only."""
    from qwen_ops.models.layers import SlotAttention

    for module_name, module in model.named_modules():
        if not isinstance(module, SlotAttention):
            continue
        prefix = checkpoint_name(module_name + ".o_proj.weight", config).removesuffix(".o_proj.weight")
        scales = (1.0, 1.0)
        for k_name, v_name in KV_SCALE_NAMES:
            if prefix + k_name in files and prefix + v_name in files:
                with _open(files[prefix + k_name]) as f:
                    k = f.get_tensor(prefix + k_name)
                with _open(files[prefix + v_name]) as f:
                    v = f.get_tensor(prefix + v_name)
                if k.numel() != 1 or v.numel() != 1:
                    raise CheckpointError(f"{prefix + k_name} / {prefix + v_name} have shapes {list(k.shape)} / "
                                          f"{list(v.shape)}, expected one per-tensor scale each")
                scales = (float(k.float().reshape(())), float(v.float().reshape(())))
                break
        module.k_scale = torch.tensor(scales[0], dtype=torch.float32, device=device)
        module.v_scale = torch.tensor(scales[1], dtype=torch.float32, device=device)


_LAYER_NAME = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")


def _check_layer_count(path: Path, files: dict[str, Path], config: QwenConfig) -> None:
    """``num_hidden_layers`` against the decoder layers the tensor names hold (from the index or
    the header alone: no data is read), before a module of that many layers is built.

    A layer index counts only if it holds a tensor a layer of this checkpoint really has: a name
    whose part after ``layers.N.`` the fullest layer of the files (the most tensors) also holds.
    Every kind of decoder layer (attention or linear attention, dense or MoE) shares its norms
    with the others, so all real layers count; a stray tensor (``model.layers.7.bogus.weight``)
    makes no layer, and ``_check_tensors`` names it as unexpected."""
    names: dict[int, set[str]] = defaultdict(set)       # layer index -> the names after "layers.N."
    for name in files:
        if m := _LAYER_NAME.match(name):
            names[int(m.group(1))].add(name[m.end():])
    if not names:
        return
    fullest = max(names.values(), key=len)
    held = {i for i, suffixes in names.items() if not suffixes.isdisjoint(fullest)}
    if held != set(range(config.num_hidden_layers)):
        found = f"layers 0..{max(held)}" if held == set(range(max(held) + 1)) else f"{len(held)} layer indices"
        raise CheckpointError(f"{path / 'config.json'}: num_hidden_layers = {config.num_hidden_layers}, but the "
                              f"checkpoint's weights hold {found} ({len(held)} layers)")


@dataclass(frozen=True)
class _ExpertPiece:
    """One per-expert checkpoint tensor: rows ``rows`` of expert ``expert``'s slice of the stacked
    parameter ``param`` (its checkpoint name). ``part``: under tensor parallelism, the ``(dim,
    start, stop)`` of the file's tensor (of ``shape``) that this rank reads, else None (all of it)."""
    tensor: str
    param: str
    shape: tuple[int, ...]
    expert: int
    rows: tuple[int, int]
    part: Optional[tuple[int, int, int]] = None


def _expert_pieces(params: dict[str, nn.Parameter], files: dict[str, Path]) -> list[_ExpertPiece]:
    """The per-expert tensors that fill each stacked expert parameter the checkpoint does not hold whole."""
    pieces = []
    for name, p in params.items():
        if name in files or not name.endswith((EXPERTS_GATE_UP, EXPERTS_DOWN)):
            continue
        prefix = name.rpartition(".")[0] + "."                       # "...mlp.experts."
        num_experts, rows, cols = p.shape
        spec = tp_slice(p)             # tensor parallelism: a share of every expert's channels
        for e in range(num_experts):
            if name.endswith(EXPERTS_GATE_UP):                       # gate rows, then up rows
                inter = rows // 2
                if spec is not None:
                    (g0, g1), (u0, u1) = spec[1]
                    full = spec[2] // 2
                    gate, up = (0, g0, g1), (0, u0 - full, u1 - full)
                else:
                    full, gate, up = inter, None, None
                pieces.append(_ExpertPiece(f"{prefix}{e}.gate_proj.weight", name, (full, cols), e, (0, inter), gate))
                pieces.append(_ExpertPiece(f"{prefix}{e}.up_proj.weight", name, (full, cols), e, (inter, rows), up))
            elif spec is not None:                                   # down: a range of its columns
                ((d0, d1),) = spec[1]
                pieces.append(_ExpertPiece(f"{prefix}{e}.down_proj.weight", name, (rows, spec[2]), e, (0, rows),
                                           (1, d0, d1)))
            else:
                pieces.append(_ExpertPiece(f"{prefix}{e}.down_proj.weight", name, (rows, cols), e, (0, rows)))
    return pieces


def _check_tensors(path: Path, files: dict[str, Path], params: dict[str, nn.Parameter],
                   config: QwenConfig, experts: list[_ExpertPiece] = (), handled: set[str] = frozenset()) -> None:
    """Every name, shape and dtype in the headers against the model, before any data is read.

    ``params`` are the parameters stored whole; ``experts`` the per-expert tensors of the others;
    ``handled`` the quantized layers' tensors (checked as they are converted, models/quant.py)."""
    problems: list[str] = []
    expert_shapes = {piece.tensor: piece.shape for piece in experts}
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    problems.append(f"tensor {name!r} is missing from {file} (the index places it there)")
                    continue
                if name in handled:
                    continue
                if name not in params and name not in expert_shapes:
                    if not _ignorable(name, config):
                        problems.append(f"unexpected tensor {name!r} in {file}")
                    continue
                view = f.get_slice(name)
                shape, code = tuple(view.get_shape()), view.get_dtype()
                want = tuple(params[name].shape) if name in params else expert_shapes[name]
                spec = tp_slice(params[name]) if name in params else None
                if spec is not None:           # a tensor-parallel slice: the file holds the whole
                    want = want[:spec[0]] + (spec[2],) + want[spec[0] + 1:]
                if shape != want:
                    problems.append(f"tensor {name!r} in {file} has shape {list(shape)}, expected {list(want)} "
                                    f"from {path / 'config.json'}")
                if code not in FILE_DTYPES:
                    problems.append(f"tensor {name!r} in {file} has dtype {code}, expected one of "
                                    f"{', '.join(FILE_DTYPES)} (a quantized checkpoint needs its quantization_config in config.json: "
                                    "fp8, awq or gptq)")
    where = path / INDEX_FILE if (path / INDEX_FILE).is_file() else path / SINGLE_FILE
    problems += [f"missing tensor {name!r} (not in {where})" for name in params if name not in files]
    problems += [f"missing tensor {name!r} of a quantized layer (not in {where})" for name in sorted(handled)
                 if name not in files]
    problems += [f"missing tensor {piece.tensor!r} (not in {where}, which has no stacked {piece.param!r} either)"
                 for piece in experts if piece.tensor not in files]
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        raise CheckpointError(f"checkpoint {path} does not match its config ({config.model_type}, "
                              f"{config.num_hidden_layers} layers):\n  " + "\n  ".join(shown)
                              + (f"\n  ... and {more} more" if more else ""))


def _ignorable(name: str, config: QwenConfig) -> bool:
    # A tied checkpoint may still hold lm_head.weight (transformers 4.x often saved it); it is unused.
    # A switched-off shared expert (shared_expert_intermediate_size 0) is saved as empty tensors.
    shared_off = config.moe is not None and config.moe.shared_expert_intermediate_size == 0
    return (name.endswith(IGNORED_SUFFIXES) or name.endswith(KV_SCALE_SUFFIXES)
            or (config.tie_word_embeddings and name == "lm_head.weight")
            or (config.is_hybrid and name.startswith(HYBRID_IGNORED_PREFIXES))
            or (shared_off and (".mlp.shared_expert." in name or ".mlp.shared_expert_gate." in name)))


def _copy_tensors(file: Path, names: list[str], model: QwenForCausalLM, dtype: torch.dtype,
                  device: torch.device, renamed: Optional[dict[str, str]] = None) -> None:
    """Copy ``names`` from ``file`` into new parameters, unmapping the file every window of bytes.

    A tensor larger than the window (an embedding) is copied in row blocks of about one window,
    so its source pages are never all mapped at once either. ``renamed`` maps a checkpoint name to
    the parameter name where the two differ (``model.language_model.*`` of qwen3_5 checkpoints).
    """
    handle, mapped = None, 0
    try:
        for name in names:
            module_name, _, leaf = (renamed or {}).get(name, name).rpartition(".")  # checkpoint -> param name
            module = model.get_submodule(module_name)
            shape = module._parameters[leaf].shape  # a meta tensor: shape only
            dst = torch.empty(shape, dtype=dtype, device=device)
            spec = tp_slice(module._parameters[leaf])
            if spec is not None:
                if handle is None:
                    handle = _open(file).__enter__()
                mapped += _copy_slice(handle, name, dst, spec)
                module._parameters[leaf] = nn.Parameter(dst, requires_grad=False)
                module._parameters[leaf].tp_slice = spec     # which share it holds (LoRA weights split alike)
                continue
            rows = shape[0] if len(shape) else 1
            if handle is None:
                handle = _open(file).__enter__()
            row_bytes = FILE_DTYPES[handle.get_slice(name).get_dtype()].itemsize * (dst.numel() // max(rows, 1))
            step = rows if row_bytes * rows <= MAP_WINDOW_BYTES else max(1, MAP_WINDOW_BYTES // row_bytes)
            for start in range(0, rows, step):
                if handle is None:
                    handle = _open(file).__enter__()
                if step == rows:
                    src = handle.get_tensor(name)  # a view of the mapped file: no copy yet
                    dst.copy_(src)  # converts and copies; touches the mapped pages once
                else:
                    src = handle.get_slice(name)[start:start + step]
                    dst[start:start + step].copy_(src)
                mapped += src.numel() * src.element_size()
                del src
                if mapped >= MAP_WINDOW_BYTES:  # unmap, so touched file pages stop counting as ours
                    handle.__exit__(None, None, None)
                    handle, mapped = None, 0
            module._parameters[leaf] = nn.Parameter(dst, requires_grad=False)
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def _copy_slice(handle, name: str, dst: torch.Tensor, spec: tuple[int, tuple[tuple[int, int], ...], int]) -> int:
    """Copy the ranges ``[start, stop)`` along ``dim`` (0: rows, in blocks of about one map window;
    else whole slices) of tensor ``name`` into ``dst``, one after another, rows in blocks of about one map window; zero ``dst``'s padding
    past them. Returns bytes read."""
    dim, pieces, _ = spec
    view = handle.get_slice(name)
    read = at = 0
    for start, stop in pieces:
        if dim == 0:
            row_bytes = FILE_DTYPES[view.get_dtype()].itemsize * max(1, dst[0].numel() if dst.dim() > 1 else 1)
            step = max(1, MAP_WINDOW_BYTES // row_bytes)
            for a in range(start, stop, step):
                b = min(stop, a + step)
                src = view[a:b]
                dst[at + a - start:at + b - start].copy_(src)
                read += src.numel() * src.element_size()
                del src
        else:                   # columns (dim 1), or a stacked expert tensor's dim 1 or 2
            src = view[(slice(None),) * dim + (slice(start, stop),)]
            dst.narrow(dim, at, stop - start).copy_(src)
            read += src.numel() * src.element_size()
        at += stop - start
    dst.narrow(dim, at, dst.shape[dim] - at).zero_()
    return read


def _copy_expert_pieces(files: dict[str, Path], pieces: list[_ExpertPiece], model: nn.Module, dtype: torch.dtype,
                        device: torch.device, renamed: dict[str, str]) -> None:
    """Fill each stacked expert parameter from its per-expert tensors (possibly in several files).

    The stacked tensor is allocated once, in ``dtype`` on ``device``; each file is mapped in windows
    of ``MAP_WINDOW_BYTES`` as in :func:`_copy_tensors` (an expert's matrix is far below one).
    """
    stacked: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[_ExpertPiece]] = defaultdict(list)
    for piece in pieces:
        by_file[files[piece.tensor]].append(piece)
    for file, file_pieces in by_file.items():
        handle, mapped = None, 0
        try:
            for piece in file_pieces:
                if piece.param not in stacked:
                    module_name, _, leaf = renamed.get(piece.param, piece.param).rpartition(".")
                    shape = model.get_submodule(module_name)._parameters[leaf].shape   # meta: shape only
                    stacked[piece.param] = torch.empty(shape, dtype=dtype, device=device)
                if handle is None:
                    handle = _open(file).__enter__()
                if piece.part is None:
                    src = handle.get_tensor(piece.tensor)   # a view of the mapped file
                else:
                    dim, a, b = piece.part
                    src = handle.get_slice(piece.tensor)[(slice(None),) * dim + (slice(a, b),)]
                stacked[piece.param][piece.expert, piece.rows[0]:piece.rows[1]].copy_(src)
                mapped += src.numel() * src.element_size()
                del src
                if mapped >= MAP_WINDOW_BYTES:
                    handle.__exit__(None, None, None)
                    handle, mapped = None, 0
        finally:
            if handle is not None:
                handle.__exit__(None, None, None)
    for name, dst in stacked.items():
        module_name, _, leaf = renamed.get(name, name).rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(dst, requires_grad=False)




