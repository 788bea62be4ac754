"""The layers that the dense and hybrid Qwen models share: RMSNorm (and the Qwen3.5 offset and
gated variants), rotary embeddings (full or partial), the SwiGLU MLP, and attention over the
paged KV cache (the two slot ops), with or without an output gate.

Numerics follow transformers: norms take the mean square in fp32, RoPE tables are fp32 and built
by the same operations transformers runs, and values are cast back at the same points.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.lora import add_delta, add_delta_parts, attach_group, with_delta
from qwen_ops.models.quant import QuantLinear
from qwen_ops.ops import host
from qwen_ops.ops.backend import resolve_backend
from qwen_ops.ops.memory import check_fits
from qwen_ops.ops.metadata import AttentionMetadata

# ----------------------------------------------------------------------------------------------
# The CPU fast path, chosen once per layer (vLLM's CustomOp.dispatch_forward). Each layer below
# starts on its plain-torch forward (``forward_native``); ``process_weights_after_loading()``
# (vLLM's name; the runner calls it on the model once its weights are loaded and placed, and again
# from ``QwenEngine.refresh_weights()``) picks the layer's forward from its device, dtype and the
# backend setting, read then, and packs the weights that forward reads: on CPU tensors in fp32 or
# bf16 with the cpu backend selected (QWEN_OPS_BACKEND=auto|cpu and a C compiler), the ops
# torch.ops.qwen.linear_packed / linear_silu_mul_packed / rms_norm / add_rms_norm / qk_norm_rope /
# silu_mul on weights packed into panels (q|k|v and gate|up fused into one product each, gate|up's with
# its SiLU). The packed copies are what those forwards read: after changing a weight, call
# ``process_weights_after_loading()`` again.
# The choice is the instance's ``forward`` attribute (``self.forward = self.forward_cpu``), which
# nn.Module.__call__ runs, hooks and all: no per-call hop through a dispatching class forward.
# ----------------------------------------------------------------------------------------------


# The ops' default overloads, looked up once: ``torch.ops.qwen.<op>(...)`` resolves its overload on
# every call (about 6 us each, measured; a CPU decode step of the embedded model makes ~50 calls).
LINEAR_PACKED = torch.ops.qwen.linear_packed.default
RMS_NORM = torch.ops.qwen.rms_norm.default
ADD_RMS_NORM = torch.ops.qwen.add_rms_norm.default
QK_NORM_ROPE = torch.ops.qwen.qk_norm_rope.default
SILU_MUL = torch.ops.qwen.silu_mul.default
LINEAR_SILU_MUL_PACKED = torch.ops.qwen.linear_silu_mul_packed.default
ATTENTION_BLOCK = torch.ops.qwen.attention_block.default


def uses_cpu_kernels(weight: torch.Tensor) -> bool:
    """Whether a layer holding ``weight`` takes the CPU fast path's ops (the one choice, read once;
    it registers the ops' CPU kernels, built on first use: ``qwen_ops.ops.host.fast_ops``)."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and resolve_backend(weight.device, "kv_write") == "cpu"):
        return False
    host.fast_ops()
    return True


def forward_hooks(*modules: Optional[nn.Module]) -> tuple[dict, ...]:
    """The forward hook and pre-hook dicts of ``modules`` (None skipped), for :func:`hooked`. Dicts,
    not modules: the check reads no module attribute per call; a deep copy of the owner copies them
    with the modules' own."""
    dicts = []
    for m in modules:
        if m is not None:
            dicts += [m._forward_pre_hooks, m._forward_hooks]
    return tuple(dicts)


# Whether a hook waits on the modules of ``dicts`` (forward_hooks) or on every module (torch's global
# ones, register_module_forward_hook, read at each call): ``any(dicts) or _GLOBAL_FORWARD_HOOKS or
# _GLOBAL_FORWARD_PRE_HOOKS``, written out where a layer's fast forward checks it (no Python call a
# layer; ``hooked`` is the same for the model's once-a-step checks). A fast forward that stands in for modules it
# does not call (the packed q|k|v product for q_proj, k_proj and v_proj) runs only while it is False;
# otherwise the layer runs its plain forward, which calls them as modules, so that every hook runs.
_GLOBAL_FORWARD_HOOKS = _torch_module._global_forward_hooks        # torch mutates these, never rebinds them
_GLOBAL_FORWARD_PRE_HOOKS = _torch_module._global_forward_pre_hooks


def hooked(dicts: tuple[dict, ...]) -> bool:
    """``any(dicts)`` or a global forward (pre-)hook: the check above, as a function."""
    return bool(any(dicts) or _GLOBAL_FORWARD_HOOKS or _GLOBAL_FORWARD_PRE_HOOKS)


def forward_choices(model: nn.Module) -> dict[str, str]:
    """``{module name: "cpu" | "native" | "int8" | "int4" | "fp8" | "int8_a8" | "int4_a8"}``: the forward each layer of
    ``model`` chose (the CPU fast path's ops, or its plain-torch forward), and the scheme of each
    quantized projection; the gate and the tests read it."""
    choices = {name: m.forward.__name__.removeprefix("forward_")
               for name, m in model.named_modules() if "forward" in m.__dict__}
    choices.update({name: m.kernel for name, m in model.named_modules() if isinstance(m, QuantLinear)})
    head = getattr(model, "_lm_head", None)
    if head is not None and not isinstance(getattr(model, "lm_head", None), QuantLinear):   # a QuantLinear: its kernel
        choices["lm_head"] = head.__name__.removeprefix("_lm_head_")
    return choices


def product_choices(model: nn.Module) -> dict[str, str]:
    """``{"<layer>.<product>": kind}``: how each fused product of the CPU fast path runs (packed
    panels, for bf16 with how this CPU runs them: AMX tiles, AVX512-BF16 dot products or widening;
    a quantized op), as chosen once by ``process_weights_after_loading``."""
    return {f"{name}.{product}": kind for name, m in model.named_modules()
            for product, kind in m.__dict__.get("product_kinds", {}).items()}


def _identity(y: torch.Tensor) -> torch.Tensor:
    return y


def weight_like(linear: nn.Module) -> torch.Tensor:
    """A tensor on the device and of the dtype a projection computes in: an ``nn.Linear``'s weight,
    or an empty one for a QuantLinear (whose weight is int8 / uint8 / fp8)."""
    if isinstance(linear, QuantLinear):
        return linear.scales.new_empty(0, dtype=linear.dtype)
    return linear.weight


def fused_product(owner: nn.Module, name: str, *linears: nn.Module):
    """One product over ``linears`` (same input) concatenated by output features, for the CPU fast
    path; returns the callable ``x -> [rows, sum of out_features]``, or None where they cannot fuse.

    nn.Linear layers: their weights packed into panels (``pack_linears``; buffers ``<name>_packed``
    and ``<name>_bias`` of ``owner``), run by ``linear_packed``, then a row-parallel projection's
    all-reduce. QuantLinear layers of one scheme: one QuantLinear over their stacked quantized
    weights (submodule ``<name>_quant``; the layers then read slices of it). A mix cannot fuse."""
    if all(isinstance(m, QuantLinear) for m in linears):
        if not QuantLinear.can_concat(list(linears)):
            return None
        fused = linears[0] if len(linears) == 1 else QuantLinear.concat(list(linears))
        if len(linears) > 1:
            owner.add_module(f"{name}_quant", fused)
        panels = fused.use_panels(tuple(linears) if len(linears) > 1 else ())
        how = "linear_a8_panels" if panels else f"linear_{fused.kernel}"
        if fused.kernel.endswith("_a8"):   # how this CPU runs their batches (amx, avx512_vnni or portable)
            how += f"; {host.int8_products()} past 4 rows"
        owner.__dict__.setdefault("product_kinds", {})[name] = f"{fused.kernel} ({how})"
        return fused.forward
    if any(isinstance(m, QuantLinear) for m in linears):
        return None
    packed, bias, features, finish = pack_linears(*linears)
    packed_name, bias_name = f"{name}_packed", f"{name}_bias"
    owner.register_buffer(packed_name, packed, persistent=False)
    owner.register_buffer(bias_name, bias, persistent=False)
    owner.__dict__.setdefault("product_kinds", {})[name] = (
        f"packed panels ({host.bf16_products()})" if packed.dtype == torch.bfloat16 else "packed panels")
    if finish is _identity:         # no all-reduce after it: one call less per product
        def product(x: torch.Tensor) -> torch.Tensor:
            return LINEAR_PACKED(x, getattr(owner, packed_name), getattr(owner, bias_name), features)
        return product

    def product_reduced(x: torch.Tensor) -> torch.Tensor:
        return finish(LINEAR_PACKED(x, getattr(owner, packed_name), getattr(owner, bias_name), features))
    return product_reduced


def with_silu_mul(owner: nn.Module, name: str, product, features: int):
    """``x -> silu_mul(product(x))`` for the product ``fused_product(owner, name, ...)`` made (an MLP's
    gate | up, ``features`` in all): on panels one op, ``linear_silu_mul_packed`` (on the AMX tiles the
    product's rows are never stored); else the product, then ``silu_mul``."""
    packed_name, bias_name = f"{name}_packed", f"{name}_bias"
    if packed_name in owner._buffers:
        owner.product_kinds[name] += "; silu_mul in the same call"

        def product_silu_mul(x: torch.Tensor) -> torch.Tensor:
            return LINEAR_SILU_MUL_PACKED(x, getattr(owner, packed_name), getattr(owner, bias_name), features)
        return product_silu_mul

    return then_silu_mul(product)


def then_silu_mul(product):
    """``x -> silu_mul(product(x))``: the op after the product, where they cannot be one."""
    def product_then_silu_mul(x: torch.Tensor) -> torch.Tensor:
        return SILU_MUL(product(x))
    return product_then_silu_mul


def pack_linears(*linears: nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor], int, object]:
    """``(packed, bias, out_features, finish)`` of one product over ``linears`` concatenated by
    output features: ``host.pack_panels`` of their weights, their biases as one fp32 vector (None
    without any), and ``finish``, what follows the product: a row-parallel projection's
    ``reduce_partial`` (all-reduce, then its bias), else the identity."""
    finish = getattr(linears[0], "reduce_partial", None)
    if finish is not None and len(linears) != 1:
        raise ValueError("a row-parallel projection is packed on its own")
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
        bias = None
        if finish is None and any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias.detach().float() if m.bias is not None else
                              torch.zeros(m.out_features, device=m.weight.device) for m in linears]).contiguous()
        return host.pack_panels(weight), bias, weight.shape[0], finish or _identity


def panels_on_huge_pages(model: nn.Module) -> None:
    """Moves the fp32 / bf16 panels of every packed product of ``model`` (buffers ``*_packed`` on the CPU)
    into one ``host.HugePageArena`` (2 MB pages), in the order a step reads them (the layers, then the
    model's own: its LM head). A decode step streams every panel once; on 4 KB pages each 4 KB of it costs
    a TLB miss. Each buffer is replaced as soon as it is copied, and the arena's pages become resident as
    they are written, so the move costs one tensor's bytes at a time. The products read the buffers by
    name, so they find the moved ones."""
    owned = [(m, name) for m in model.modules() for name, t in m._buffers.items()
             if name.endswith("_packed") and t is not None and t.device.type == "cpu"
             and t.dtype in (torch.float32, torch.bfloat16)]
    owned.sort(key=lambda entry: entry[0] is model)     # stable: the model's own (its LM head) last
    if not owned:
        return
    arena = host.HugePageArena(sum(m._buffers[name].nbytes + 64 for m, name in owned))
    for m, name in owned:
        m._buffers[name] = arena.copy(m._buffers[name])


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero-filled KV cache tensor (``allocate_caches``): on the CPU on 2 MB pages
    (``host.huge_page_zeros``), since a step reads its blocks scattered over the whole cache."""
    if torch.device(device).type == "cpu":
        return host.huge_page_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, in fp32 (the part every Qwen norm variant shares)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``, the mean square taken in fp32 as in transformers' Qwen2RMSNorm.

    ``norm(x, residual)`` first adds: returns ``(norm(x + residual), x + residual)`` (one op on the
    CPU fast path, vLLM's fused_add_rms_norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.forward = self.forward_native

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self.weight * rms_normalize(x, self.eps).to(x.dtype)
        x = x + residual
        return self.weight * rms_normalize(x, self.eps).to(x.dtype), x

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return RMS_NORM(x, self.weight, self.eps)
        return ADD_RMS_NORM(x, residual, self.weight, self.eps)

    def process_weights_after_loading(self) -> None:
        self.forward = self.forward_cpu if uses_cpu_kernels(self.weight) else self.forward_native


class OffsetRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in fp32, cast to x's dtype at the end (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """``weight * (x / rms(x)) * silu(gate)`` with transformers' casts (Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.weight * rms_normalize(x, self.eps).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def rope_table(config: QwenConfig, device: torch.device, num_positions: Optional[int] = None) -> torch.Tensor:
    """fp32 ``[num_positions, rotary_dim]``: cos | sin of positions ``0 .. num_positions - 1``
    (default ``max_position_embeddings``), times the scaling, for the ``rotary_dim =
    config.rope.rotary_dim(head_dim)`` rotated channels of a head (all of them, except for
    Qwen3.5's partial rotary). The engine needs only its ``max_seq_len`` rows: a checkpoint's
    ``max_position_embeddings`` of 10**6 would otherwise cost 0.5 GB before anything runs."""
    rotary_dim = config.rope.rotary_dim(config.head_dim)
    rows = config.max_position_embeddings if num_positions is None else num_positions
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= config.max_position_embeddings:
        raise ValueError(f"num_positions = {rows!r}, expected an int in [1, max_position_embeddings = "
                         f"{config.max_position_embeddings}]")
    check_fits(2 * rows * rotary_dim * 4, device, f"the RoPE table of {rows} positions (max_position_embeddings = "
               f"{config.max_position_embeddings})", "load with a smaller max_model_len")
    inv_freq, scaling = config.rope.inv_freq_and_scaling(rotary_dim, config.max_position_embeddings)
    positions = torch.arange(rows, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]  # [max_pos, rotary_dim // 2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE as a precomputed fp32 table ``cos_sin [max_position_embeddings, rotary_dim]``.

    Row p holds ``cos(p * inv_freq) * s`` in its first half and ``sin(p * inv_freq) * s`` in its
    second (``s`` is yarn's attention factor, 1 otherwise), by the same fp32 operations that
    transformers runs at every step, so gathering rows by position reproduces its values.
    """

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.rotary_dim = config.rope.rotary_dim(config.head_dim)
        # On torch's default device. Under the loader's torch.device("meta") it stays an empty
        # meta tensor (meta arange would import torch's Python meta kernels, ~180 MB) and the
        # loader computes it on the target device: being non-persistent, it is not in checkpoints.
        table = torch.empty(config.max_position_embeddings, self.rotary_dim)
        self.register_buffer("cos_sin", table if table.is_meta else rope_table(config, table.device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, rotary_dim // 2]`` in ``dtype`` for int32 or int64 ``positions [T]``."""
        return rope_rows(self.cos_sin, positions, dtype)


def rope_rows(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, 1, rotary_dim // 2]`` in ``dtype``: the rows ``positions [T]`` of a table
    ``cos_sin [max_positions, rotary_dim]`` (:func:`rope_table`)."""
    table = torch.index_select(cos_sin, 0, positions).to(dtype)
    half = cos_sin.shape[1] // 2
    return table[:, None, :half], table[:, None, half:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x [T, heads, head_dim]`` (halves
    convention; same roundings as ``q*cos + rotate_half(q)*sin``) and pass the rest through."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if 2 * half == x.shape[-1]:      # static shapes: no data-dependent branch under torch.compile
        return rotated
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


class QwenMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``intermediate_size`` defaults to the config's
    (a MoE model's shared expert passes its own)."""

    def __init__(self, config: QwenConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.forward = self.forward_native

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if "_lora" in self.__dict__:     # LoRA enabled (once, models/lora.py): each token's adapter's deltas
            groups = self._lora_groups
            gate, up = add_delta_parts(self, self._lora, groups["gate_up"], (self.gate_proj(x), self.up_proj(x)), x)
            h = F.silu(gate) * up
            return add_delta_parts(self, self._lora, groups["down"], (self.down_proj(h),), h)[0]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def enable_lora(self, ctx) -> None:
        """LoRA slots for gate|up and down (models/lora.py ``enable_lora``)."""
        dtype = weight_like(self.gate_proj).dtype
        attach_group(self, ctx, "gate_up", (self.gate_proj, self.up_proj), dtype)
        attach_group(self, ctx, "down", (self.down_proj,), dtype)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if any(self._skipped_hooks) or _GLOBAL_FORWARD_HOOKS or _GLOBAL_FORWARD_PRE_HOOKS:   # a hook: call them
            return self.forward_native(x)
        if self._down_of_gate_up is not None:      # int8-activation panels: silu_mul inside the down product
            return self._down_of_gate_up(self._gate_up_product(x))
        return self._down_product(self._gate_up_silu_mul(x))

    def process_weights_after_loading(self) -> None:
        self.forward = self.forward_native
        if uses_cpu_kernels(weight_like(self.gate_proj)):
            gate_up = fused_product(self, "gate_up", self.gate_proj, self.up_proj)
            down = fused_product(self, "down", self.down_proj)
            if gate_up is not None and down is not None:
                lora = self.__dict__.get("_lora")
                self._down_of_gate_up = None
                if lora is not None:      # the deltas after each product (models/lora.py), silu_mul between
                    gate_up = with_delta(self, lora, self._lora_groups["gate_up"], gate_up)
                    down = with_delta(self, lora, self._lora_groups["down"], down)
                    self._gate_up_silu_mul = then_silu_mul(gate_up)
                elif isinstance(self.down_proj, QuantLinear) and self.down_proj.takes_gate_up():
                    # a down product on int8-activation panels takes the gate | up rows itself
                    self._gate_up_product = gate_up
                    self._down_of_gate_up = self.down_proj.forward_silu_mul
                    self.product_kinds["down"] += "; silu_mul in the same call"
                else:             # the gate | up product returns silu_mul's rows (one op on panels)
                    self._gate_up_silu_mul = with_silu_mul(self, "gate_up", gate_up,
                                                           self.gate_proj.out_features + self.up_proj.out_features)
                self._down_product = down
                self._skipped_hooks = forward_hooks(self.gate_proj, self.up_proj, self.down_proj)
                self.forward = self.forward_cpu


class SlotAttention(nn.Module):
    """q/k/v projections, optional per-head q/k norm, RoPE, then ``torch.ops.qwen.kv_write`` and
    ``torch.ops.qwen.slot_attention`` over the paged cache, then o_proj.

    ``output_gate``: q_proj also yields a per-channel gate, ``[query | gate]`` per head, that the
    attention op applies as ``sigmoid(gate)`` (Qwen3.5 / Qwen3-Next full-attention layers).
    ``qk_norm``: the norm class for q and k (RMSNorm in Qwen3, OffsetRMSNorm in Qwen3.5), or None.

    ``k_scale`` / ``v_scale`` (fp32 scalar buffers, 1.0 unless a checkpoint carries them or
    ``calculate_kv_scales`` measured them): the scales of an fp8 KV cache, passed to the ops on
    every call and read by them only when the cache is fp8 (vLLM's per-tensor ``k_scale`` /
    ``v_scale``). ``calculate_kv_scales = True`` makes the next forward set them from its own keys
    and values (amax / 200 and amax / 100, vLLM's constants) before it writes them, once.
    """

    def __init__(self, config: QwenConfig, *, qk_norm: type[nn.Module] | None, output_gate: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.output_gate = output_gate
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, 2 * q_dim if output_gate else q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_proj_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.eps = config.rms_norm_eps
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.calculate_kv_scales = False
        self.forward = self.forward_native

    def _measure_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        from qwen_ops.ops.kv_quant import K_SCALE_CONSTANT, V_SCALE_CONSTANT

        tiny = torch.finfo(torch.float32).tiny
        with torch.no_grad():
            self.k_scale.copy_((k.detach().abs().amax().float() / K_SCALE_CONSTANT).clamp_min(tiny))
            self.v_scale.copy_((v.detach().abs().amax().float() / V_SCALE_CONSTANT).clamp_min(tiny))
        self.calculate_kv_scales = False

    def process_weights_after_loading(self, rope_table: Optional[torch.Tensor] = None) -> None:
        """The CPU fast path (module comment above) when the layer is plain enough for it: no
        output gate, RMSNorm q/k norms or none, and ``rope_table`` (the model's fp32 cos | sin
        table) rotating the whole head; q|k|v become one packed product."""
        fits = (not self.output_gate and type(self.q_norm) in (RMSNorm, type(None)) and rope_table is not None
                and rope_table.shape[1] == self.head_dim and rope_table.dtype == torch.float32)
        self.forward = self.forward_native
        if fits and uses_cpu_kernels(weight_like(self.q_proj)):
            qkv = fused_product(self, "qkv", self.q_proj, self.k_proj, self.v_proj)
            o = fused_product(self, "o", self.o_proj)
            if qkv is not None and o is not None:
                lora = self.__dict__.get("_lora")
                if lora is not None:      # the deltas after each product (models/lora.py)
                    qkv = with_delta(self, lora, self._lora_groups["qkv"], qkv)
                    o = with_delta(self, lora, self._lora_groups["o"], o)
                self._qkv_product, self._o_product = qkv, o
                self.register_buffer("rope_cos_sin", rope_table, persistent=False)
                self._gather_block_weights()
                self._skipped_hooks = forward_hooks(self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                                                    self.q_norm, self.k_norm)
                self.forward = self.forward_cpu

    def enable_lora(self, ctx) -> None:
        """LoRA slots for q|k|v and o (models/lora.py ``enable_lora``)."""
        dtype = weight_like(self.q_proj).dtype
        attach_group(self, ctx, "qkv", (self.q_proj, self.k_proj, self.v_proj), dtype)
        attach_group(self, ctx, "o", (self.o_proj,), dtype)

    def reads_rope_table(self) -> bool:
        """Whether the forward reads its RoPE rows itself (the CPU fast path: the model passes no cos / sin)."""
        return self.forward == self.forward_cpu

    def _gather_block_weights(self) -> None:
        """attention_block's weights, gathered once (not three module lookups per call)."""
        self._block_weights = (None if self.q_norm is None else self.q_norm.weight,
                               None if self.k_norm is None else self.k_norm.weight, self.rope_cos_sin)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() give the buffers new tensors: the gathered weights follow them
        super()._apply(fn, recurse)
        if "_block_weights" in self.__dict__:
            self._gather_block_weights()
        for name in ("k_scale", "v_scale"):   # the ops take fp32 scales whatever the model's dtype
            t = self._buffers.get(name)
            if t is not None and t.dtype != torch.float32 and not t.is_meta:
                self._buffers[name] = t.float()
        return self

    def forward_cpu(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                    attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Three op calls: the q|k|v product; q/k norm + RoPE + kv write + attention in one op
        (``cos``/``sin`` unused: it reads the table by position); the o product. With a hook on a
        module that this stands in for, the plain forward, on the rows of the same table."""
        if any(self._skipped_hooks) or _GLOBAL_FORWARD_HOOKS or _GLOBAL_FORWARD_PRE_HOOKS:
            cos, sin = rope_rows(self.rope_cos_sin, positions32, x.dtype)
            return self.forward_native(x, cos, sin, positions32, attn, kv_cache)
        q_norm, k_norm, rope = self._block_weights
        key_cache, value_cache = kv_cache
        qkv = self._qkv_product(x)
        if self.calculate_kv_scales:      # once, on the first batch after it was asked for
            T, D, nh, nk = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
            q, k = QK_NORM_ROPE(qkv[:, :nh * D].view(T, nh, D), qkv[:, nh * D:(nh + nk) * D].view(T, nk, D), q_norm,
                                k_norm, self.eps, rope, positions32)
            self._measure_kv_scales(k, qkv[:, (nh + nk) * D:])
        o = ATTENTION_BLOCK(qkv, q_norm, k_norm, self.eps, rope, positions32, key_cache, value_cache,
                            attn.slot_ids, attn.block_table, attn.seq_slots, attn.query_start_loc, attn.seq_lens,
                            self.scale, attn.max_query_len, self.num_heads, self.k_scale, self.v_scale)
        return self._o_product(o)

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                       attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        gate = None
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if "_lora" in self.__dict__:     # LoRA enabled (once, models/lora.py): each token's adapter's deltas
            q, k, v = add_delta_parts(self, self._lora, self._lora_groups["qkv"], (q, k, v), x)
        if self.output_gate:   # module attributes, fixed at construction: not data-dependent
            qg = q.view(T, self.num_heads, 2 * self.head_dim)
            q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:]   # gate: a strided view, last dim contiguous
        else:
            q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.calculate_kv_scales:
            self._measure_kv_scales(k, v)
        key_cache, value_cache = kv_cache
        torch.ops.qwen.kv_write(k, v, key_cache, value_cache, attn.slot_ids, positions32, attn.block_table,
                                self.k_scale, self.v_scale)
        o = torch.ops.qwen.slot_attention(q, key_cache, value_cache, attn.block_table, attn.seq_slots,
                                          attn.query_start_loc, attn.seq_lens, self.scale, attn.max_query_len,
                                          gate, self.k_scale, self.v_scale)
        o = o.view(T, self.num_heads * self.head_dim)
        if "_lora" in self.__dict__:
            return add_delta(self, self._lora, self._lora_groups["o"], self.o_proj(o), o)
        return self.o_proj(o)
