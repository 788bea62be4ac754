"""Multi-LoRA in the model's one forward (Punica / S-LoRA, vLLM's LoRA layers): every token names an
adapter slot, and one pair of ops (``torch.ops.qwen.lora_shrink`` / ``lora_expand``) adds each
token's own adapter's delta to a projection's output.

``enable_lora(model, max_loras, max_rank, max_tokens)`` (the runner calls it once, when LoRA is on)
gives the model a :class:`LoRAContext` (``model.lora_context``: the step's per-token slot ids and
the slots' scalings, buffers at fixed addresses, so compiled steps and CUDA graphs read them as
inputs and loading an adapter recompiles nothing) and gives every attention layer (q|k|v, o) and
dense MLP (gate|up, down; a MoE model's shared expert too) the stacked A and B weights of
``max_loras`` slots per group of projections, zero (no delta) until an adapter is written into a
slot (:func:`write_adapter`). A layer adds the deltas after its products on every path (the CPU
fast path's packed products, its plain forward, quantized base weights), chosen once, when LoRA is
enabled; without it nothing changes and nothing is paid.

Tensor parallelism: a column-parallel projection (q, k, v, gate, up) holds A whole and its rows of
B; a row-parallel one (o, down) its columns of A and B whole, and the rank-R partial products are
summed across the ranks before the expand (one all-reduce of ``[tokens, R]``), as vLLM shards them.

Adapters are PEFT's format (:func:`load_peft_adapter`): ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``.bin``), ``r``, ``lora_alpha``, ``use_rslora``; the modules and
layers an adapter adapts are those its file holds weights for (what PEFT saved for its
``target_modules`` and ``layers_to_transform``); what is not supported says which field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)

LORA_SHRINK = torch.ops.qwen.lora_shrink.default
LORA_EXPAND = torch.ops.qwen.lora_expand.default

# The projections an adapter may target, and the group (one shrink, one expand) each belongs to.
TARGETS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
           "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
GROUP_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
               "down": ("down_proj",)}


class LoRAError(ValueError):
    """An adapter that cannot be used: the message names the file or field and what was expected."""


class LoRAContext(nn.Module):
    """What every LoRA layer of one model reads each step: ``indices`` (int32 ``[max_tokens]``, the
    adapter slot of each token of the step, -1 = none; the runner writes it before the forward) and
    ``scalings`` (fp32 ``[max_loras]``, each slot's ``lora_alpha / r`` or ``/ sqrt(r)``)."""

    def __init__(self, max_loras: int, max_rank: int, max_tokens: int, device: torch.device) -> None:
        super().__init__()
        self.max_loras, self.max_rank, self.max_tokens = max_loras, max_rank, max_tokens
        self.register_buffer("indices", torch.full((max_tokens,), -1, dtype=torch.int32, device=device),
                             persistent=False)
        self.register_buffer("scalings", torch.zeros(max_loras, dtype=torch.float32, device=device), persistent=False)
        self._written = 0               # indices[:_written] may hold slots from an earlier step

    def set_indices(self, slots: torch.Tensor) -> None:
        """The step's per-token slots (int32 ``[T]``, host or device); the rest of the buffer -1."""
        n = slots.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"a step of {n} tokens, expected at most max_tokens = {self.max_tokens} (LoRA)")
        self.indices[:n].copy_(slots, non_blocking=True)
        if self._written > n:
            self.indices[n:self._written].fill_(-1)
        self._written = n


@dataclass
class LoRAGroup:
    """One group of projections of a layer (q|k|v, o, gate|up or down): its parts' output sizes (this
    rank's), the buffers' names on the layer, and the all-reduce of a row-parallel group (None)."""

    name: str
    parts: tuple[str, ...]
    sizes: tuple[int, ...]
    in_features: int
    reduce: object = None


def _tp_of(module: nn.Module):
    """``(dim, pieces, full)`` of a tensor-parallel projection's weight, or None."""
    return getattr(getattr(module, "weight", None), "tp_slice", None) or getattr(module, "tp_slice", None)


def attach_group(layer: nn.Module, ctx: LoRAContext, group: str, modules: Sequence[nn.Module],
                 dtype: torch.dtype) -> LoRAGroup:
    """Zero A ``[L, S * R, K]`` and B ``[L, N, R]`` buffers ``<group>_lora_a`` / ``_lora_b`` on ``layer``,
    recorded in ``layer._lora_groups`` (with ``layer._lora``, the context its forwards read)."""
    device = ctx.indices.device
    sizes = tuple(int(m.out_features) for m in modules)
    k = int(modules[0].in_features)
    L, R = ctx.max_loras, ctx.max_rank
    layer.register_buffer(f"{group}_lora_a", torch.zeros(L, len(sizes) * R, k, dtype=dtype, device=device),
                          persistent=False)
    layer.register_buffer(f"{group}_lora_b", torch.zeros(L, sum(sizes), R, dtype=dtype, device=device),
                          persistent=False)
    # a row-parallel projection (models/parallel.py RowParallelLinear) of more than one rank: its
    # partial rank-R products are summed across the ranks
    tp = getattr(modules[0], "tp", None)
    reduce = modules[0].all_reduce if tp is not None and tp.size > 1 and hasattr(modules[0], "all_reduce") else None
    layer.__dict__.setdefault("_lora_groups", {})[group] = g = LoRAGroup(group, GROUP_PARTS[group], sizes, k, reduce)
    layer.__dict__["_lora"] = ctx
    return g


def add_delta(layer: nn.Module, ctx: LoRAContext, g: LoRAGroup, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y [T, sum(sizes)]`` plus each token's adapter's delta of ``x [T, K]`` (in place; returned)."""
    idx = ctx.indices[:x.shape[0]]
    buf = LORA_SHRINK(x, getattr(layer, f"{g.name}_lora_a"), idx, ctx.scalings)
    if g.reduce is not None:
        buf = g.reduce(buf)
    if not y.is_contiguous():
        y = y.contiguous()
    LORA_EXPAND(y, buf, getattr(layer, f"{g.name}_lora_b"), idx, list(g.sizes))
    return y


def add_delta_parts(layer: nn.Module, ctx: LoRAContext, g: LoRAGroup, parts: Sequence[torch.Tensor],
                    x: torch.Tensor) -> list[torch.Tensor]:
    """The plain forward's projections (one tensor per part, ``[T, size]``) with their deltas added."""
    y = parts[0].contiguous() if len(parts) == 1 else torch.cat(list(parts), dim=-1)
    y = add_delta(layer, ctx, g, y, x.reshape(-1, x.shape[-1]).contiguous())
    return list(y.split(list(g.sizes), dim=-1)) if len(parts) > 1 else [y]


def with_delta(layer: nn.Module, ctx: LoRAContext, g: LoRAGroup, product):
    """A fused product ``x -> y`` followed by the deltas (the CPU fast path's products)."""
    def product_lora(x: torch.Tensor) -> torch.Tensor:
        return add_delta(layer, ctx, g, product(x), x)
    return product_lora


def enable_lora(model: nn.Module, max_loras: int, max_rank: int, max_tokens: int) -> LoRAContext:
    """Give ``model`` its LoRA context and every layer's zero slots (module docstring: each layer
    that has an ``enable_lora(ctx)`` method attaches its groups with :func:`attach_group`); the
    caller then lets the layers choose their forwards again (``process_weights_after_loading``)."""
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_rank), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}, expected a positive int")
    device = next(model.parameters()).device
    ctx = LoRAContext(max_loras, max_rank, max_tokens, device)
    model.lora_context = ctx
    for m in list(model.modules()):
        if m is not model and hasattr(m, "enable_lora"):
            m.enable_lora(ctx)
    return ctx


# ------------------------------------------------------------------------------------------------
# PEFT adapters
# ------------------------------------------------------------------------------------------------

@dataclass
class LoRAAdapter:
    """A parsed PEFT adapter in host memory: ``weights[module name] = (A [r, in], B [out, r])`` in
    fp32, full (unsharded), and its scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA)."""

    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "layer_replication": "layer_replication"}


def load_peft_adapter(path: str | Path, module_names, max_rank: int,
                      checkpoint_name=lambda n: n) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory for a model whose LoRA-capable projections are
    ``module_names`` (our names; a dict: with their full ``(in, out)`` features, which A and B must
    fit, :func:`lora_module_names`; ``checkpoint_name`` maps one to the base checkpoint's). Raises
    :class:`LoRAError` naming the file or field for anything it cannot serve."""
    shapes = module_names
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAError(f"lora_path = {str(path)!r}: no adapter_config.json there (expected a PEFT LoRA adapter "
                        "directory, as PeftModel.save_pretrained writes)")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_file}: not readable JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{cfg_file}: peft_type = {config.get('peft_type')!r}, expected 'LORA'")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAError(f"{cfg_file}: {key} = {config[key]!r}: {what} is not supported (expected it unset)")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_file}: bias = {config['bias']!r}, expected 'none' (LoRA biases are not supported)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{cfg_file}: r = {rank!r}, expected a positive int")
    if rank > max_rank:
        raise LoRAError(f"{cfg_file}: r = {rank} is above max_lora_rank = {max_rank}; expected r <= {max_rank} "
                        "(raise max_lora_rank)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"{cfg_file}: {key} = {config[key]!r}: per-module ranks are not supported (expected {{}})")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{cfg_file}: lora_alpha = {alpha!r}, expected a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    known = set()
    for name in module_names:
        ck = checkpoint_name(name + ".weight").removesuffix(".weight")
        known.add(ck)
        a = tensors.pop(f"base_model.model.{ck}.lora_A.weight", None)
        b = tensors.pop(f"base_model.model.{ck}.lora_B.weight", None)
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise LoRAError(f"{path}: {ck} has lora_{'A' if a is None else 'B'}.weight missing")
        fan_in, fan_out = shapes[name] if isinstance(shapes, dict) else (None, None)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank or \
                (fan_in is not None and (a.shape[1] != fan_in or b.shape[0] != fan_out)):
            want_in, want_out = fan_in or "in_features", fan_out or "out_features"
            raise LoRAError(f"{path}: {ck} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                            f"[{rank}, {want_in}] and [{want_out}, {rank}] (r = {rank}; the base model's projection)")
        weights[name] = (a.float(), b.float())
    if tensors:
        first = sorted(tensors)[0]
        inner = re.sub(r"\.(lora_[A-Za-z_]+|base_layer)(\..*)?$|\.weight$", "", first.removeprefix("base_model.model."))
        raise LoRAError(f"{path}: tensor {first!r} targets {inner!r}, which LoRA does not support here; expected "
                        f"only {', '.join(TARGETS)} of the decoder layers (no embedding, lm_head or other modules)")
    if not weights:
        raise LoRAError(f"{path}: no LoRA weights for this model's projections (target_modules = "
                        f"{config.get('target_modules')!r})")
    return LoRAAdapter(str(path), rank, float(scaling), weights)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            return dict(load_file(str(st)))
        if pt.is_file():
            return dict(torch.load(str(pt), map_location="cpu", weights_only=True))
    except Exception as e:     # noqa: BLE001  (a damaged file: its request fails, nothing else)
        raise LoRAError(f"{st if st.is_file() else pt}: cannot be read ({type(e).__name__}: {e})") from None
    raise LoRAError(f"lora_path = {str(path)!r}: no adapter_model.safetensors or adapter_model.bin there")


def _shard(t: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """The rank's pieces of a full tensor along ``dim`` (a projection's ``tp_slice``)."""
    _, pieces, _ = tp
    return torch.cat([t.narrow(dim, a, b - a) for a, b in pieces], dim=dim)


def lora_module_names(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection an adapter may target (``model.layers.3.self_attn.q_proj`` ...) and its full
    (unsharded) ``(in_features, out_features)``: what an adapter's A and B must fit."""
    names = {}
    for layer_name, layer in model.named_modules():
        for g in layer.__dict__.get("_lora_groups", {}).values():
            for part, size in zip(g.parts, g.sizes):
                module = getattr(layer, part)
                full = [g.in_features, size]
                tp = _tp_of(module)
                if tp is not None:
                    full[1 - tp[0]] = tp[2]        # dim 0 of the weight is out_features
                names[f"{layer_name}.{part}"] = (full[0], full[1])
    return names


@torch.no_grad()
def write_adapter(model: nn.Module, slot: int, adapter: Optional[LoRAAdapter]) -> None:
    """Write ``adapter`` into slot ``slot`` of every LoRA layer of ``model`` (None: clear the slot);
    projections it does not target get zeros. Tensor-parallel layers take their rank's share."""
    ctx: LoRAContext = model.lora_context
    R = ctx.max_rank
    for layer_name, layer in model.named_modules():
        for g in layer.__dict__.get("_lora_groups", {}).values():
            a_all, b_all = getattr(layer, f"{g.name}_lora_a"), getattr(layer, f"{g.name}_lora_b")
            a_all[slot].zero_()
            b_all[slot].zero_()
            if adapter is None:
                continue
            start = 0
            for s, (part, size) in enumerate(zip(g.parts, g.sizes)):
                w = adapter.weights.get(f"{layer_name}.{part}")
                if w is not None:
                    a, b = w
                    tp = _tp_of(getattr(layer, part))
                    if tp is not None and tp[0] == 1:
                        a = _shard(a, tp, 1)
                    elif tp is not None and tp[0] == 0:
                        b = _shard(b, tp, 0)
                    if a.shape[1] != g.in_features or b.shape[0] != size:
                        raise LoRAError(f"{adapter.path}: {layer_name}.{part} has lora_A {tuple(w[0].shape)} and "
                                        f"lora_B {tuple(w[1].shape)}, which do not fit the projection "
                                        f"({g.in_features} in, {size} out on this rank)")
                    r = a.shape[0]
                    a_all[slot, s * R:s * R + r].copy_(a)
                    b_all[slot, start:start + size, :r].copy_(b)
                start += size
    ctx.scalings[slot] = 0.0 if adapter is None else adapter.scaling
