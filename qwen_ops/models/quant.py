"""Quantized linear layers: the checkpoint formats Qwen publishes, online quantization, and the
``QuantLinear`` module that the model's projections become.

Formats (``quantization_config`` in ``config.json``, laid out as Qwen's and vLLM's):

* ``fp8`` block-wise (Qwen3-*-FP8): ``<layer>.weight`` float8_e4m3fn ``[N, K]`` and
  ``<layer>.weight_scale_inv`` fp32 ``[ceil(N / bn), ceil(K / bk)]`` for ``weight_block_size: [bn, bk]``;
  ``w = weight * scale_inv[n // bn, k // bk]``. The weight is kept as is, its scales repeated to one row
  per output feature (so projections of any size stack into one product): ``torch.ops.qwen.linear_fp8``.
* ``awq`` (AutoAWQ's GEMM packing, ``bits: 4``, ``zero_point: true``): ``qweight`` int32 ``[K, N / 8]``,
  ``qzeros`` int32 ``[K / g, N / 8]``, ``scales`` fp16 ``[K / g, N]``; nibble i (bits 4i..4i+3) of
  word j holds column ``8 j + AWQ_ORDER[i]``. ``w = (q - z) * s``. Repacked to ``linear_int4``'s layout.
* ``gptq`` (AutoGPTQ / optimum, ``checkpoint_format: gptq``, ``bits`` 4 or 8):
  ``qweight`` int32 ``[K * bits / 32, N]`` packs 32 / bits consecutive k (lowest bits first),
  ``qzeros`` int32 ``[K / g, N * bits / 32]`` packs consecutive n the same way and stores ``z - 1``,
  ``scales`` fp16 ``[K / g, N]``, ``g_idx`` int32 ``[K]`` (the group of input k: ``k // g``, or any
  assignment of g inputs a group with ``desc_act: true``, whose k are then sorted by group and x
  gathered in that order). ``w = (q - z) * s`` with ``z = stored + 1`` (as AutoGPTQ's and vLLM's
  kernels read the format). 4 bits -> ``linear_int4``;
  8 bits with ``sym: true`` (z = 128) -> ``linear_int8`` on ``q - 128``.

Online (``LLM(..., quantization=...)`` on a full-precision checkpoint), each weight quantized as it is
read, so the full-precision model is never held:

* ``int8``: symmetric per output channel: ``s = max|w| / 127``, ``q = round(w / s)``; ``linear_int8``.
  The LM head too (as llama.cpp's Q8_0; vLLM leaves it in full precision): at Qwen3-0.6B's size it is a
  third of the bytes a decode step reads. The embedding lookup keeps the full-precision table.
* ``fp8``: vLLM's dynamic FP8 weights, one scale per tensor: ``s = max|w| / 448``,
  ``q = float8_e4m3fn(w / s)``; ``linear_fp8`` (the scale repeated per output feature).

Which layers: the decoder layers' projections (``LINEAR_NAMES``) and the routed experts of MoE layers
(:class:`QuantMoeExperts`, read from ``<layer>.mlp.experts.<e>.{gate,up,down}_proj.*`` in the format's
tensors, as Qwen3-30B-A3B-GPTQ-Int4 / -FP8 store them, or quantized online from either stacked or
per-expert full-precision tensors; online fp8 takes one scale per file tensor: per expert projection,
or per expert's gate|up rows of a stacked file). A checkpoint format quantizes the ones whose tensors
are quantized in the files (its ``modules_to_not_convert`` are simply stored in full precision); online
quantization takes them all. Embeddings, norms, the router and the LM head (but for online int8) stay
in the model dtype, as do the KV cache and activations. GPTQ act order is not supported in experts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.ops import host
from qwen_ops.ops.host import pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The decoder layers' projections that may be quantized (dense, MoE shared experts, hybrid layers).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
ONLINE_METHODS = ("int8", "int4", "fp8", "w8a8")
INT4_ONLINE_GROUP = 32      # online int4: groups of 32 inputs with a scale and a minimum each (llama.cpp's Q4_1)
CHECKPOINT_METHODS = ("fp8", "awq", "gptq")
# ``quantization`` values that load a checkpoint format with int8 activations (W4A8 / W8A8), as vLLM's
# ``awq_marlin`` names another kernel for an awq checkpoint.
A8_METHODS = {"awq_a8": "awq", "gptq_a8": "gptq"}
FP8_MAX = 448.0
INT8_MAX = 127


@dataclass(frozen=True)
class QuantConfig:
    """How a model's linear layers are quantized: ``method`` is the checkpoint's format
    (``fp8``, ``awq``, ``gptq``) or an online scheme (``int8``, ``fp8``; ``online`` True)."""

    method: str
    online: bool = False
    # "int8": the products quantize their input per row and block (the ``*_a8`` ops), None: x as is
    activations: Optional[str] = None
    bits: int = 8
    group_size: int = -1            # -1: one group per output channel (int8 / gptq)
    block: tuple[int, int] = (0, 0)  # fp8 checkpoints: weight_block_size
    source: str = "<config>"
    lm_head: bool = False           # gptq ``lm_head: true``: the checkpoint stores the LM head quantized
    # gguf: {tensor name: block type} of the tensors held as stored (models/gguf.py NATIVE_LAYOUT)
    types: Any = field(default=None, compare=False, hash=False)

    @property
    def kernel(self) -> str:
        """The op the layers run: ``scheme``, with ``_a8`` for int8 activations."""
        return self.scheme + ("_a8" if self.activations == "int8" else "")

    @property
    def scheme(self) -> str:
        """The weights' layout: ``int8``, ``int4`` or ``fp8``."""
        if self.method == "fp8":
            return "fp8"
        if self.method == "gguf":
            return "gguf"           # per tensor: int8 or int4 by its block type
        if self.method == "int4":
            return "int4"
        if self.method == "awq" or (self.method == "gptq" and self.bits == 4):
            return "int4"
        return "int8"


def _field(qc: dict, key: str, source: str, allowed: tuple, default: Any = None) -> Any:
    value = qc.get(key, default)
    if value not in allowed:
        raise ValueError(f"{source}: quantization_config.{key} = {value!r}; supported: "
                         f"{', '.join(repr(a) for a in allowed)}")
    return value


def _group_size(qc: dict, source: str, allow_channel: bool) -> int:
    g = qc.get("group_size", qc.get("q_group_size"))
    key = "group_size" if "group_size" in qc else "q_group_size"
    if allow_channel and g == -1:
        return -1
    if isinstance(g, bool) or not isinstance(g, int) or g < 16 or g % 16:
        raise ValueError(f"{source}: quantization_config.{key} = {g!r}, expected a positive multiple of 16"
                         + (" or -1 (per channel)" if allow_channel else ""))
    return g


def parse_quantization_config(qc: Any, source: str) -> QuantConfig:
    """A checkpoint's ``quantization_config`` as a :class:`QuantConfig`; unsupported combinations
    are errors naming the field."""
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config = {qc!r}, expected a JSON object")
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"{source}: quantization_config.quant_method = {method!r}; supported checkpoint formats: "
                         f"{', '.join(CHECKPOINT_METHODS)} (or load a full-precision checkpoint with "
                         f"quantization={ONLINE_METHODS})")
    if method == "fp8":
        _field(qc, "fmt", source, ("e4m3", None), "e4m3")
        _field(qc, "activation_scheme", source, ("dynamic",), "dynamic")
        block = qc.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 16 and b % 16 == 0 for b in block)):
            raise ValueError(f"{source}: quantization_config.weight_block_size = {block!r}, expected [block_n, "
                             "block_k], positive multiples of 16 (block-wise FP8 as in Qwen3-*-FP8)")
        return QuantConfig("fp8", bits=8, block=(block[0], block[1]), source=source)
    if method == "awq":
        bits = _field(qc, "bits", source, (4,), qc.get("w_bit", 4))
        _field(qc, "version", source, ("gemm", "GEMM"), "gemm")
        _field(qc, "zero_point", source, (True,), True)
        return QuantConfig("awq", bits=bits, group_size=_group_size(qc, source, allow_channel=False), source=source)
    bits = _field(qc, "bits", source, (4, 8))
    _field(qc, "desc_act", source, (False, True, None), False)
    _field(qc, "checkpoint_format", source, ("gptq", None), "gptq")
    if bits == 8:
        _field(qc, "sym", source, (True,), True)
    lm_head = _field(qc, "lm_head", source, (False, True, None), False)
    return QuantConfig("gptq", bits=bits, group_size=_group_size(qc, source, allow_channel=True), source=source,
                       lm_head=bool(lm_head))


def online_config(quantization: str, source: str = "quantization") -> QuantConfig:
    if quantization not in ONLINE_METHODS:
        hint = (f"; {quantization!r} loads a checkpoint in that format with int8 activations, and this checkpoint "
                "has no quantization_config" if quantization in A8_METHODS else "")
        raise ValueError(f"{source} = {quantization!r}; expected one of {', '.join(ONLINE_METHODS)} (online "
                         f"quantization of a full-precision checkpoint), or None{hint}")
    if quantization == "w8a8":      # int8 weights as "int8", and int8 activations
        return QuantConfig("int8", online=True, bits=8, activations="int8", source=source)
    if quantization == "int4":
        return QuantConfig("int4", online=True, bits=4, group_size=INT4_ONLINE_GROUP, source=source)
    return QuantConfig(quantization, online=True, bits=8, source=source)


GGUF_CHOICES = ("gguf", "gguf_a8", "dequantize")


def gguf_quant_config(file, quantization: Optional[str]) -> Optional[QuantConfig]:
    """A GGUF file's quantization: None or ``"gguf"`` (vLLM's name): the tensors a product serves exactly
    as stored (``models/gguf.py`` NATIVE) stay quantized, the rest are dequantized at load;
    ``"dequantize"``: every tensor dequantized to the model dtype; an online method (``int8``, ``w8a8``,
    ``fp8``): quantized afresh from the dequantized weights."""
    from qwen_ops.models.gguf import NATIVE

    if quantization == "dequantize":
        return None
    if quantization not in (None, "gguf", "gguf_a8"):
        if quantization in ONLINE_METHODS:
            return online_config(quantization)
        raise ValueError(f"quantization = {quantization!r} for the GGUF file {file.path}; expected None or 'gguf' "
                         f"(its quantized blocks as stored), 'dequantize', or one of {', '.join(ONLINE_METHODS)}")
    types = {name: file.type_of(name) for name in file.tensors if file.type_of(name) in NATIVE}
    if not types:
        return None
    return QuantConfig("gguf", bits=4, group_size=32, source=str(file.path), types=MappingProxyType(types),
                       activations="int8" if quantization == "gguf_a8" else None)


def read_quant_config(path: Path, quantization: Optional[str]) -> Optional[QuantConfig]:
    """The checkpoint's own quantization (config.json's ``quantization_config``; a GGUF file's blocks,
    ``gguf_quant_config``) or the online ``quantization`` asked for; both at once is an error unless
    they agree."""
    from qwen_ops.models.gguf import gguf_of

    gguf = gguf_of(path)
    if gguf is not None:
        return gguf_quant_config(gguf, quantization)
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        data = {}
    qc = data.get("quantization_config") if isinstance(data, dict) else None
    if qc is None and isinstance(data, dict) and isinstance(data.get("text_config"), dict):
        qc = data["text_config"].get("quantization_config")
    if qc is None:
        return None if quantization is None else online_config(quantization)
    parsed = parse_quantization_config(qc, str(file))
    a8 = parsed.method + "_a8" if parsed.method in A8_METHODS.values() else None
    if quantization is not None and quantization not in (parsed.method, a8):
        raise ValueError(f"quantization = {quantization!r}, but {file} holds a {parsed.method!r} checkpoint "
                         f"(quantization_config.quant_method); pass quantization=None or {parsed.method!r}"
                         + (f" (or {a8!r}: int8 activations)" if a8 else ""))
    return replace(parsed, activations="int8") if a8 is not None and quantization == a8 else parsed


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------

_OPS = {"int8": torch.ops.qwen.linear_int8.default, "int4": torch.ops.qwen.linear_int4.default,
        "fp8": torch.ops.qwen.linear_fp8.default, "int8_a8": torch.ops.qwen.linear_int8_a8.default,
        "int4_a8": torch.ops.qwen.linear_int4_a8.default}
LINEAR_A8_PANELS = torch.ops.qwen.linear_a8_panels.default
GROUP_MINS_ADD = torch.ops.qwen.group_mins_add.default
SILU_MUL_LINEAR_A8_PANELS = torch.ops.qwen.silu_mul_linear_a8_panels.default
# QuantLinear's attributes that its built op call (_make_call) holds.
_CALL_INPUTS = frozenset({"qweight", "scales", "zeros", "mins", "bias", "perm", "_bias32", "_op", "panels", "block"})


class QuantLinear(nn.Module):
    """``y = x w^T (+ bias)`` with w quantized: ``scheme`` int8 (``qweight`` int8 ``[N, K]``, ``scales``
    fp32 ``[N, G]``), int4 (``qweight`` uint8 ``[N, K / 2]``, ``scales`` fp32, ``zeros`` uint8 ``[N, G]``)
    or fp8 (``qweight`` float8_e4m3fn ``[N, K]``, ``scales`` fp32 ``[N, ceil(K / bk)]``: block ``(1, bk)``,
    a checkpoint's ``[bn, bk]`` blocks held one scale row per output feature).
    ``mins`` (fp32 ``[N, G]`` or None; GGUF's Q4_1, Q5_1, Q4_K, Q5_K): ``w = (q - z) * s + m`` per group, the
    ``m`` part added as ``(x summed per group) @ mins^T``, a product of K / g columns.
    The buffers are filled by the loader. ``dtype`` is the activations' (the model's) dtype. The
    forward is one op call, the same on every device (the op picks its kernel by device)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str, groups: int,
                 block: tuple[int, int], dtype: torch.dtype, device: Any = None,
                 activations: Optional[str] = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        if activations not in (None, "int8") or (activations == "int8" and scheme == "fp8"):
            raise ValueError(f"activations = {activations!r} for {scheme} weights; expected None, or 'int8' with "
                             "int8 / int4 weights")
        self.activations = activations
        # the op, chosen once: linear_<scheme>, or linear_<scheme>_a8 quantizing x to int8
        self.kernel = scheme + ("_a8" if activations == "int8" else "")
        self.block = block
        self.dtype = dtype
        n, k = out_features, in_features
        if scheme == "int8":
            self.register_buffer("qweight", torch.empty((n, k), dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty((n, groups), dtype=torch.float32, device=device))
            self.zeros = None
        elif scheme == "int4":
            self.register_buffer("qweight", torch.empty((n, k // 2), dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty((n, groups), dtype=torch.float32, device=device))
            self.register_buffer("zeros", torch.empty((n, groups), dtype=torch.uint8, device=device))
        elif scheme == "fp8":
            self.register_buffer("qweight", torch.empty((n, k), dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("scales", torch.empty((-(-n // block[0]), -(-k // block[1])), dtype=torch.float32,
                                                       device=device))
            self.zeros = None
        else:
            raise ValueError(f"scheme = {scheme!r}, expected int8, int4 or fp8")
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device)) if bias else None
        self.register_buffer("mins", None)
        self._mins_t: Optional[torch.Tensor] = None     # mins^T [G, N], contiguous (process_weights_after_loading)
        # GPTQ act order (desc_act): the input features' order that makes each group contiguous;
        # x is gathered by it before the product (None: natural order).
        self.register_buffer("perm", None)
        self._bias32: Optional[torch.Tensor] = None
        self._call: Optional[tuple] = None        # the forward's op call (_make_call), built once
        self._op = _OPS[self.kernel]
        # The int8-activation products' CPU layout (use_panels): qweight / scales / zeros then hold
        # linear_a8_panels' 64-feature panels, and the state dict gives them back in the rows' layout.
        self.panels = False
        self._silu_op = None      # forward_silu_mul's op, with the panels

    @classmethod
    def like(cls, linear: nn.Linear, quant: QuantConfig, dtype: torch.dtype, tensor: Optional[str] = None
             ) -> "QuantLinear":
        """A meta-device QuantLinear of ``linear``'s shape for ``quant`` (the loader fills it); ``tensor``:
        the file tensor it holds, for a GGUF file, whose block type sets the layout."""
        n, k = linear.out_features, linear.in_features
        scheme, mins = quant.scheme, False
        if quant.method == "gguf" or (quant.online and scheme == "int4"):
            # per group of g inputs: a GGUF block type's layout, or online int4's scale and minimum (mins)
            if quant.method == "gguf":
                from qwen_ops.models.gguf import NATIVE_LAYOUT

                scheme, g, mins = NATIVE_LAYOUT[quant.types[tensor]]
                what = f"{quant.types[tensor]}'s group of {g}"
            else:
                g, mins, what = quant.group_size, True, f"online int4's group of {quant.group_size}"
            if k % g:
                raise ValueError(f"in_features = {k} is not a multiple of {what}")
            groups, block = k // g, (0, 0)
        elif quant.online:
            groups, block = 1, (1, k)
        elif scheme == "fp8":       # block-wise scales are held one row per output feature (convert_layer)
            groups, block = 0, (1, quant.block[1])
        else:
            g = k if quant.group_size == -1 else quant.group_size
            if k % g:
                raise ValueError(f"{quant.source}: group_size = {g} does not divide in_features = {k}")
            groups, block = k // g, (0, 0)
        with torch.device("meta"):
            layer = cls(k, n, linear.bias is not None, scheme, groups, block, dtype, activations=quant.activations)
            if mins:
                layer.mins = torch.empty((n, groups), dtype=torch.float32)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}, "
                f"scales={list(self.scales.shape)}, bias={self.bias is not None}")

    def _op_bias(self) -> Optional[torch.Tensor]:
        """The bias as the ops take it: fp32 (``_bias32``, made once by ``process_weights_after_loading``)."""
        return self._bias32 if self._bias32 is not None else (None if self.bias is None else self.bias.float())

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _CALL_INPUTS:        # what the forward's call reads changed: build it again when next needed
            self.__dict__["_call"] = None
            if name == "bias":          # and its fp32 copy, made from the old bias
                self.__dict__["_bias32"] = None
            if name == "mins":
                self.__dict__["_mins_t"] = None

    def _make_call(self) -> tuple:
        """``(op, perm, args)``: the forward's op call, ``op(x[:, perm], *args)``, for this layer's scheme
        and layout. Built once (``process_weights_after_loading``) rather than read attribute by attribute
        at every call, which cost a one-request CPU decode step of the 0.6B shape (113 products) 0.4-0.5 ms;
        assigning any tensor or op it holds drops it (``__setattr__``), and in-place updates need nothing."""
        bias = self._op_bias()
        if self.panels:
            args = (self.qweight, self.scales, self.zeros, bias, self.out_features)
        elif self.scheme == "int4":
            args = (self.qweight, self.scales, self.zeros, bias)
        elif self.scheme == "int8":     # linear_int8 or linear_int8_a8
            args = (self.qweight, self.scales, bias)
        else:
            args = (self.qweight, self.scales, bias, self.block[0], self.block[1])
        return self._op, self.perm, args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op, perm, args = self._call if self._call is not None else self._make_call()
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if perm is not None:
            x2 = x2.index_select(1, perm)
        y = op(x2, *args)
        if self.mins is not None:       # + m per group: the inputs' sums over each group times the minimums
            GROUP_MINS_ADD(y, x2, self._mins_t if self._mins_t is not None else self.mins.t())
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def takes_gate_up(self) -> bool:
        """Whether ``forward_silu_mul`` runs as one op here: a product on panels (``use_panels``) in natural
        input order, computing in fp32 or bf16 (silu_mul's dtypes)."""
        return (self.panels and self._silu_op is not None and self.perm is None and self.mins is None
                and self.dtype in (torch.float32, torch.bfloat16))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu_mul(gate_up))`` as one op, ``silu_mul_linear_a8_panels`` (where ``takes_gate_up``): an
        MLP's down product on its gate | up rows (the args of the panels' call, ``_make_call``)."""
        args = (self._call if self._call is not None else self._make_call())[2]
        if gate_up.dim() == 2:
            return self._silu_op(gate_up, *args)
        y = self._silu_op(gate_up.reshape(-1, 2 * self.in_features), *args)
        return y.view(*gate_up.shape[:-1], self.out_features)

    def process_weights_after_loading(self) -> None:
        """The bias as the op takes it (fp32), and the forward's op call (``_make_call``), once."""
        self._bias32 = None if self.bias is None else self.bias.detach().float().contiguous()
        self._mins_t = None
        if self.mins is not None:       # held once, transposed: mins is a view of it
            if self.mins.stride(0) == 1:    # already a view of a transposed copy (this layer's, or a fused layer's rows)
                self._mins_t = self.mins.t()
            else:
                self._mins_t = self.mins.t().contiguous()
                self._buffers["mins"] = self._mins_t.t()
        self._call = self._make_call()

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() give the buffers new tensors without __setattr__: the built call and
        # the fp32 bias follow them.
        super()._apply(fn, recurse)
        if self._call is not None:
            self.process_weights_after_loading()
        return self

    def reference(self):
        """The reference of the op this layer's forward calls, taking the same arguments (the oracle that
        tests and benchmarks swap in for ``_op``)."""
        return host.quant_reference(self.kernel, self.panels)

    def use_references(self) -> None:
        """Runs this layer's products on their ops' references (``reference``): the oracle twin that tests
        and benchmarks build. ``forward_silu_mul`` then runs the ``silu_mul`` op and the reference product,
        as the unfused forward would: the twin checks the quantized products, and silu_mul's kernel and
        reference may differ in an ulp, which moves an int8 activation digit."""
        self._op = self.reference()
        if self.panels:
            product = self._op
            self._silu_op = lambda gate_up, *rest: product(torch.ops.qwen.silu_mul(gate_up), *rest)
        self._call = self._make_call()

    def panels_fit(self) -> bool:
        """Whether this layer's product runs best as ``linear_a8_panels`` here: int8 activations on a CPU
        whose kernels run VNNI dot products (the panels' reason: one-row products at the read bandwidth,
        and AMX B tiles as stored), the cpu backend selected, whole panels, and a group size the panels'
        blocks take."""
        if self.kernel not in ("int8_a8", "int4_a8") or self.qweight.device.type != "cpu" or self.out_features % PANEL:
            return False
        g = self.in_features // self.scales.shape[1]
        if g % 128 and g % (8 if self.scheme == "int4" else 4):
            return False
        from qwen_ops.ops.backend import resolve_backend

        if resolve_backend(self.qweight.device, "kv_write") != "cpu" or host.why_unavailable() is not None:
            return False
        return host.int8_dot_products()

    def use_panels(self, parts: tuple["QuantLinear", ...] = ()) -> bool:
        """Repacks the weights into ``linear_a8_panels``' layout where ``panels_fit`` (once: a layer already
        on panels stays); ``parts``: the layers whose tensors are slices of this one's (``concat``), which
        then read slices of the panels, so the rows' copy is freed. The panels come from the
        ``panel_arena`` the model gave this layer or its parts (``attach_panel_arena``), if any. Returns
        whether the layer runs on panels."""
        arenas = [m.__dict__.pop("panel_arena", None) for m in (self, *parts)]     # each layer drops its own
        arena = next((a for a in arenas if a is not None), None)
        if not self.panels:
            if not self.panels_fit() or any(m.out_features % PANEL for m in parts):
                return False
            with torch.no_grad():
                self.qweight, self.scales, self.zeros = pack_a8_panels(self.qweight, self.scales, self.zeros,
                                                                       arena=arena)
            self.panels, self._op, self._silu_op = True, LINEAR_A8_PANELS, SILU_MUL_LINEAR_A8_PANELS
        start = 0
        for m in parts:
            rows = slice(start // PANEL, (start + m.out_features) // PANEL)
            m.qweight, m.scales = self.qweight[rows], self.scales[rows]
            if self.zeros is not None:
                m.zeros = self.zeros[rows]
            m.panels, m._op, m._silu_op = True, self._op, self._silu_op
            start += m.out_features
        for m in (self, *parts):
            m._call = m._make_call()
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.panels and prefix + "qweight" in destination:     # the checkpoint's layout, not the panels
            q, s, z = host.unpack_a8_panels(self.qweight, self.scales, self.zeros, self.out_features)
            destination[prefix + "qweight"], destination[prefix + "scales"] = q, s
            if z is not None:
                destination[prefix + "zeros"] = z

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        names = ("qweight", "scales") + (("zeros",) if self.zeros is not None else ())
        if self.panels and all(prefix + n in state_dict for n in names):     # rows' layout in, panels kept
            state_dict = dict(state_dict)
            packed = pack_a8_panels(*(state_dict[prefix + n] for n in names), *(() if self.zeros is not None else (None,)))
            for n, t in zip(names, packed):
                state_dict[prefix + n] = t
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @staticmethod
    def can_concat(layers: list["QuantLinear"]) -> bool:
        """Whether ``layers`` (same input) fuse into one product by stacking output features."""
        first = layers[0]
        if any(not isinstance(m, QuantLinear) or m.kernel != first.kernel or m.in_features != first.in_features
               or m.scales.shape[1] != first.scales.shape[1] or m.block != first.block for m in layers):
            return False
        if any((m.mins is None) != (first.mins is None) for m in layers):
            return False
        if any((m.perm is None) != (first.perm is None) or (m.perm is not None and not torch.equal(m.perm, first.perm))
               for m in layers):
            return False                           # act-order layers fuse only with one order of x
        return first.scheme != "fp8" or first.block[0] == 1    # fp8: one scale row per output feature

    @classmethod
    def concat(cls, layers: list["QuantLinear"]) -> "QuantLinear":
        """One QuantLinear computing ``layers`` (``can_concat``) stacked by output features."""
        first = layers[0]
        n = sum(m.out_features for m in layers)
        has_bias = any(m.bias is not None for m in layers)
        with torch.device("meta"):      # its buffers are replaced below
            fused = cls(first.in_features, n, has_bias, first.scheme, first.scales.shape[1], first.block, first.dtype,
                        activations=first.activations)
        if first.panels and not all(m.panels and m.out_features % PANEL == 0 for m in layers):
            raise ValueError("layers on linear_a8_panels concatenate only with others on panels, whole panels each")
        with torch.no_grad():
            fused.qweight = torch.cat([m.qweight for m in layers]).contiguous()
            fused.scales = torch.cat([m.scales for m in layers]).contiguous()
            if first.zeros is not None:
                fused.zeros = torch.cat([m.zeros for m in layers]).contiguous()
            if first.mins is not None:
                fused.mins = torch.cat([m.mins for m in layers]).contiguous()
            if first.perm is not None:
                fused.perm = first.perm
            if has_bias:
                fused.bias = nn.Parameter(torch.cat([
                    m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=first.dtype,
                                                                           device=first.qweight.device)
                    for m in layers]), requires_grad=False)
        fused.process_weights_after_loading()
        # The layers now read slices of the fused tensors: no second copy of the weights.
        if first.panels:
            fused.panels, fused._op, fused._silu_op = True, first._op, first._silu_op
            fused.use_panels(tuple(layers))
        else:
            start = 0
            for m in layers:
                rows = slice(start, start + m.out_features)
                m.qweight = fused.qweight[rows]
                m.scales = fused.scales[rows]
                if first.zeros is not None:
                    m.zeros = fused.zeros[rows]
                if first.mins is not None:
                    m.mins = fused.mins[rows]
                start += m.out_features
        for key in fused._buffers:      # the layers' own buffers hold the state dict
            fused._non_persistent_buffers_set.add(key)
        return fused


class QuantMoeExperts(nn.Module):
    """A mixture-of-experts layer's routed experts with quantized weights (``MoeExperts``'s place):
    ``w13 [E, 2I, ...]`` (each expert's gate rows, then its up rows) and ``w2 [E, H, ...]``, each expert
    laid out as QuantLinear's ``qweight`` for ``scheme``, with ``*_scales`` (and int4's ``*_zeros``)
    ``[E, N, G]``. The forward is one ``torch.ops.qwen.fused_moe_quant`` call running the op ``kernel``
    chosen at construction (QuantLinear's: ``int8``, ``int4``, ``fp8``, ``int8_a8``, ``int4_a8``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, quant: QuantConfig, device: Any = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.scheme, self.kernel = quant.scheme, quant.kernel
        # fp8: one scale row per output feature and block_k inputs a column; int: K / G inputs a group
        self.block_k = 0
        if self.scheme == "fp8":
            self.block_k = max(hidden, inter) if quant.online else quant.block[1]
        for name, n, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            if self.scheme == "fp8":
                groups = -(-k // self.block_k)
            else:
                g = k if quant.online or quant.group_size == -1 else quant.group_size
                if k % g:
                    raise ValueError(f"{quant.source}: group_size = {g} does not divide the experts' in_features = {k}")
                groups = k // g
            dtype = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[self.scheme]
            cols = k // 2 if self.scheme == "int4" else k
            self.register_buffer(name, torch.empty((num_experts, n, cols), dtype=dtype, device=device))
            self.register_buffer(name + "_scales", torch.empty((num_experts, n, groups), dtype=torch.float32,
                                                               device=device))
            self.register_buffer(name + "_zeros", torch.empty((num_experts, n, groups), dtype=torch.uint8,
                                                              device=device) if self.scheme == "int4" else None)

    @classmethod
    def like(cls, experts: nn.Module, quant: QuantConfig) -> "QuantMoeExperts":
        """A meta-device QuantMoeExperts of ``experts``' (a ``MoeExperts``) shape for ``quant``."""
        if quant.online and quant.scheme == "int4":
            raise ValueError("quantization = 'int4' (online) does not cover mixture-of-experts layers yet; use "
                             "'int8' or 'fp8'")
        e, two_inter, hidden = experts.gate_up_proj.shape
        with torch.device("meta"):
            return cls(e, hidden, two_inter // 2, quant)

    def projections(self) -> dict[str, tuple[str, slice, int, int]]:
        """Each checkpoint projection of an expert: ``{name: (buffer, rows of it, out_features, in_features)}``."""
        i, h = self.inter, self.hidden
        return {"gate_proj": ("w13", slice(0, i), i, h), "up_proj": ("w13", slice(i, 2 * i), i, h),
                "down_proj": ("w2", slice(0, h), h, i)}

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, kernel={self.kernel}, "
                f"w13_scales={list(self.w13_scales.shape)}, w2_scales={list(self.w2_scales.shape)}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.qwen.fused_moe_quant(x, self.w13, self.w13_scales, self.w13_zeros, self.w2,
                                              self.w2_scales, self.w2_zeros, weights, ids, self.kernel,
                                              self.block_k)

    def process_weights_after_loading(self) -> None:
        """Nothing to prepare: the op reads the loader's buffers as they are."""


# ----------------------------------------------------------------------------------------------
# Reading each format into QuantLinear's buffers
# ----------------------------------------------------------------------------------------------

def checkpoint_tensors(quant: QuantConfig, prefix: str) -> tuple[str, ...]:
    """The file tensors that hold a quantized layer's weight (besides its bias)."""
    if quant.online or quant.method == "gguf":
        return (prefix + ".weight",)
    if quant.method == "fp8":
        return (prefix + ".weight", prefix + ".weight_scale_inv")
    if quant.method == "awq":
        return (prefix + ".qweight", prefix + ".qzeros", prefix + ".scales")
    return (prefix + ".qweight", prefix + ".qzeros", prefix + ".scales", prefix + ".g_idx")


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_tensors(quant: QuantConfig, prefix: str, num_experts: int, files: dict) -> tuple[str, ...]:
    """The file tensors of the routed experts ``prefix`` (``...mlp.experts``) of a quantized model:
    per expert and projection as the format stores them (``<prefix>.<e>.gate_proj.qweight`` ...), or,
    online, the stacked ``<prefix>.gate_up_proj`` / ``down_proj`` where the file holds them so."""
    if quant.online and prefix + ".gate_up_proj" in files:
        return (prefix + ".gate_up_proj", prefix + ".down_proj")
    return tuple(t for e in range(num_experts) for proj in EXPERT_PROJECTIONS
                 for t in checkpoint_tensors(quant, f"{prefix}.{e}.{proj}"))


def experts_quantized_in_files(quant: QuantConfig, prefix: str, files: dict) -> bool:
    """Whether the checkpoint stores the routed experts ``prefix`` quantized (online: always)."""
    if quant.online:
        return prefix + ".gate_up_proj" in files or prefix + ".0.gate_proj.weight" in files
    if quant.method == "gguf":     # a GGUF file's stacked experts are dequantized at load
        return False
    return is_quantized_in_files(quant, prefix + ".0.gate_proj", files)


def is_quantized_in_files(quant: QuantConfig, prefix: str, files: dict) -> bool:
    """Whether the checkpoint stores layer ``prefix`` quantized (online: every layer is quantized)."""
    if quant.online:
        return prefix + ".weight" in files
    if quant.method == "gguf":
        return prefix + ".weight" in quant.types
    if quant.method == "fp8":
        return prefix + ".weight_scale_inv" in files
    return prefix + ".qweight" in files


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        raise ValueError(f"tensor {name!r} has shape {list(t.shape)} and dtype {t.dtype}, expected {list(shape)} "
                         f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` holding ``32 / bits`` values a word along dim 0, lowest bits first -> int32 ``[R * 32 / bits, C]``."""
    per = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed[:, None, :] >> shifts[None, :, None]) & mask          # [R, per, C]
    return values.reshape(packed.shape[0] * per, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """int32 ``[R, C]`` holding ``32 / bits`` values a word along dim 1 -> ``[R, C * 32 / bits]``; value i of
    word j is column ``per * j + order[i]`` (order: identity unless given, AWQ's interleave)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts[None, None, :]) & mask          # [R, C, per]: value i of word j
    if order is not None:
        inverse = [order.index(c) for c in range(per)]                     # column c within the word <- value
        values = values[:, :, inverse]
    return values.reshape(packed.shape[0], packed.shape[1] * per)


def convert_layer(quant: QuantConfig, prefix: str, tensors: dict[str, torch.Tensor], n: int, k: int, groups: int
                  ) -> dict[str, torch.Tensor]:
    """QuantLinear buffers (``qweight``, ``scales``, ``zeros``) of layer ``prefix`` (``out_features`` n,
    ``in_features`` k, ``groups`` scale columns) from its file tensors (``checkpoint_tensors``), checked
    against that shape; errors name the tensor."""
    if quant.method == "gguf":      # (blocks [n, bytes], type) from gguf.GGUFHandle.raw
        return convert_gguf(prefix + ".weight", *tensors[prefix + ".weight"], n, k)
    if quant.online:
        (w,) = (tensors[prefix + ".weight"],)
        _expect(prefix + ".weight", w, (n, k), (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        return quantize_online(w, quant.method, quant.group_size)
    if quant.method == "fp8":
        bn, bk = quant.block
        w, s = tensors[prefix + ".weight"], tensors[prefix + ".weight_scale_inv"]
        _expect(prefix + ".weight", w, (n, k), (torch.float8_e4m3fn,))
        _expect(prefix + ".weight_scale_inv", s, (-(-n // bn), -(-k // bk)), (torch.float32, torch.bfloat16))
        # One scale row per output feature (block_n = 1): layers then stack into one product whatever
        # their sizes (q|k|v, gate|up), for n / 128 floats of memory more per layer.
        return {"qweight": w.contiguous(), "scales": s.to(torch.float32).repeat_interleave(bn, 0)[:n].contiguous()}
    g = k // groups
    for suffix, (shape, dtypes) in _packed_shapes(quant, n, k, groups).items():
        _expect(prefix + suffix, tensors[prefix + suffix], shape, dtypes)
    if n > CONVERT_COLUMNS:     # a large layer (an LM head): a block of output features at a time
        return _convert_in_blocks(quant, prefix, tensors, n, k, groups)
    if quant.method == "awq":
        qw, qz, sc = (tensors[prefix + s] for s in (".qweight", ".qzeros", ".scales"))
        q = _unpack_cols(qw, 4, AWQ_ORDER)                    # [K, N]
        z = _unpack_cols(qz, 4, AWQ_ORDER)                    # [G, N]
        return {"qweight": pack_int4(q.T.contiguous()), "scales": sc.float().T.contiguous(),
                "zeros": z.T.to(torch.uint8).contiguous()}
    bits = quant.bits
    qw, qz, sc, gi = (tensors[prefix + s] for s in (".qweight", ".qzeros", ".scales", ".g_idx"))
    q = _unpack_rows(qw, bits)                                 # [K, N]
    z = _unpack_cols(qz, bits) + 1                             # [G, N]: the format stores z - 1
    out: dict[str, torch.Tensor] = {}
    gi = gi.long()
    if not torch.equal(gi, torch.arange(k) // g):
        # Act order (desc_act): input k belongs to group g_idx[k]. Sorting k by group makes every
        # group contiguous; the layer then gathers x in that order (QuantLinear.perm).
        if int(gi.min()) < 0 or int(gi.max()) >= groups or not bool((torch.bincount(gi, minlength=groups) == g).all()):
            raise ValueError(f"tensor {prefix + '.g_idx'!r} does not assign {g} input features (group_size) to each "
                             f"of the {groups} groups")
        perm = torch.sort(gi, stable=True).indices
        q = q[perm]
        out["perm"] = perm
    if bits == 4:
        return {**out, "qweight": pack_int4(q.T.contiguous()), "scales": sc.float().T.contiguous(),
                "zeros": z.T.to(torch.uint8).contiguous()}
    if not bool((z == 128).all()):
        raise ValueError(f"tensor {prefix + '.qzeros'!r} holds zero points other than 128: an asymmetric 8-bit "
                         "GPTQ layer (quantization_config.sym false), which is not supported")
    return {**out, "qweight": (q - 128).T.to(torch.int8).contiguous(), "scales": sc.float().T.contiguous()}


def _packed_shapes(quant: QuantConfig, n: int, k: int, groups: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """The AWQ / GPTQ file tensors of an ``[n, k]`` layer of ``groups`` groups: ``{suffix: (shape, dtypes)}``."""
    scales = (torch.float16, torch.bfloat16, torch.float32)
    if quant.method == "awq":
        return {".qweight": ((k, n // 8), (torch.int32,)), ".qzeros": ((groups, n // 8), (torch.int32,)),
                ".scales": ((groups, n), scales)}
    per = 32 // quant.bits
    return {".qweight": ((k // per, n), (torch.int32,)), ".qzeros": ((groups, n // per), (torch.int32,)),
            ".scales": ((groups, n), scales), ".g_idx": ((k,), (torch.int32, torch.int64))}


# Output features converted at a time: unpacking makes int32 copies of the weight (four of them at
# most), which for a 151,936-row LM head would be gigabytes; a block keeps them to ~100 MB.
CONVERT_COLUMNS = 8192


def _convert_in_blocks(quant: QuantConfig, prefix: str, tensors: dict[str, torch.Tensor], n: int, k: int,
                       groups: int) -> dict[str, torch.Tensor]:
    """``convert_layer`` of an AWQ / GPTQ layer one block of ``CONVERT_COLUMNS`` output features at a
    time (the formats pack n in words of 32 / bits along the columns: blocks are whole words), each
    block's buffers copied into rows of the layer's."""
    per = 32 // quant.bits
    out: dict[str, torch.Tensor] = {}
    for n0 in range(0, n, CONVERT_COLUMNS):
        n1 = min(n, n0 + CONVERT_COLUMNS)
        part = {}
        for name, t in tensors.items():
            if name.endswith(".g_idx"):
                part[name] = t
            elif name.endswith(".scales") or (quant.method == "gptq" and name.endswith(".qweight")):
                part[name] = t[:, n0:n1]                     # columns are output features
            else:                                            # n packed per word: awq qweight, qzeros
                part[name] = t[:, n0 // per:-(-n1 // per)]
        got = convert_layer(quant, prefix, part, n1 - n0, k, groups)
        for key, value in got.items():
            if key == "perm":
                out.setdefault(key, value)
                continue
            if key not in out:
                out[key] = torch.empty((n, *value.shape[1:]), dtype=value.dtype)
            out[key][n0:n1] = value
    return out


PANEL = 64       # output features a panel of linear_a8_panels


def a8_panel_bytes(layer: "QuantLinear") -> int:
    """Bytes of ``layer``'s weights in ``linear_a8_panels``' layout (``pack_a8_panels``)."""
    return -(-layer.out_features // PANEL) * PANEL * layer.in_features // (2 if layer.scheme == "int4" else 1)


def pack_a8_panels(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   chunk: int = 8192, arena=None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``linear_int8_a8`` / ``linear_int4_a8`` operands (int8 ``[N, K]`` / uint8 ``[N, K / 2]``, ``scales``
    and int4's ``zeros`` ``[N, G]``) in ``linear_a8_panels``' layout (schema: 64 output features a panel,
    the features in the vector lanes; padding features zero). Converts ``chunk`` features at a time,
    so the copies in flight stay small next to the layer. ``arena``: a ``host.HugePageArena`` to take the
    weight's panels from (else a mapping of their own, ``host.huge_page_empty``)."""
    n = qweight.shape[0]
    panels = -(-n // PANEL)
    groups = scales.shape[1]
    int4 = zeros is not None
    k = qweight.shape[1] * (2 if int4 else 1)
    shape = (panels, k // (8 if int4 else 4), PANEL, 4)
    w = arena.take(shape, torch.uint8) if arena is not None else None
    if w is None:
        w = host.huge_page_empty(shape, torch.uint8)
    s = torch.zeros((panels, groups, PANEL), dtype=torch.float32)
    z = torch.zeros((panels, groups, PANEL), dtype=torch.uint8) if int4 else None
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        p0, p1 = start // PANEL, -(-stop // PANEL)
        rows = (p1 - p0) * PANEL
        q = qweight[start:stop]
        if int4:   # bytes k // 2 of a row: nibble pairs (k even, k odd); a panel byte takes k and k + 4
            u = torch.empty((rows, k), dtype=torch.uint8)
            u[:stop - start, 0::2] = q & 15
            u[:stop - start, 1::2] = q >> 4
            u[stop - start:] = 0
            octets = u.view(p1 - p0, PANEL, k // 8, 2, 4)
            w[p0:p1] = (octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)).permute(0, 2, 1, 3)
        else:      # q + 128 is q's bit pattern with the sign bit flipped
            u = torch.full((rows, k), 128, dtype=torch.uint8)
            u[:stop - start] = q.view(torch.uint8) ^ 128
            w[p0:p1] = u.view(p1 - p0, PANEL, k // 4, 4).permute(0, 2, 1, 3)
        sc = torch.zeros((rows, groups), dtype=torch.float32)
        sc[:stop - start] = scales[start:stop]
        s[p0:p1] = sc.view(p1 - p0, PANEL, groups).permute(0, 2, 1)
        if int4:
            zc = torch.zeros((rows, groups), dtype=torch.uint8)
            zc[:stop - start] = zeros[start:stop]
            z[p0:p1] = zc.view(p1 - p0, PANEL, groups).permute(0, 2, 1)
    return w, s, z


def attach_panel_arena(model: nn.Module) -> None:
    """Before a model's layers first choose their products: one ``host.HugePageArena`` for the panels of
    every QuantLinear that will take them (``panels_fit``), handed to those layers (``panel_arena``, used
    and dropped by ``use_panels``); the layers repack in the order a step runs them, so their panels lie
    in that order. Nothing when a layer is already on panels (a refresh) or none fits."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if any(m.panels for m in layers):
        return
    fits = [m for m in layers if m.panels_fit()]
    if not fits:
        return
    arena = host.HugePageArena(sum(a8_panel_bytes(m) + 64 for m in fits))
    for m in fits:
        m.__dict__["panel_arena"] = arena


def quantize_online(w: torch.Tensor, method: str, group_size: int = INT4_ONLINE_GROUP) -> dict[str, torch.Tensor]:
    """A full-precision weight ``[N, K]`` as QuantLinear buffers (module docstring: int8 per channel,
    fp8 per tensor; int4 per group of ``group_size`` inputs as llama.cpp's Q4_1: ``m = min``, ``s = (max - min) /
    15``, ``q = round((w - m) / s)`` in 0..15, ``w ~ q s + m``: zero points 0 and the minimums in ``mins``, so a
    group need not straddle 0, as an integer zero point needs). Computed in fp32."""
    w = w.float()
    if method == "int4":
        n, k = w.shape
        g = w.reshape(n, k // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
        q = torch.clamp(torch.round((g - lo[..., None]) / scales[..., None]), 0, 15).to(torch.uint8)
        return {"qweight": pack_int4(q.reshape(n, k).contiguous()), "scales": scales.contiguous(),
                "zeros": torch.zeros_like(scales, dtype=torch.uint8), "mins": lo.contiguous()}
    if method == "int8":
        amax = w.abs().amax(dim=1, keepdim=True)                       # [N, 1]
        scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        q = torch.clamp(torch.round(w / scales), -INT8_MAX, INT8_MAX).to(torch.int8)
        return {"qweight": q.contiguous(), "scales": scales.contiguous()}
    amax = float(w.abs().max()) if w.numel() else 0.0
    scale = amax / FP8_MAX if amax > 0 else 1.0
    q = torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"qweight": q.contiguous(), "scales": torch.full((w.shape[0], 1), scale, dtype=torch.float32)}


def describe(model: nn.Module) -> dict[str, str]:
    """``{layer name: kernel}`` of every quantized layer (the op chosen at construction: ``int8``,
    ``int4``, ``fp8``, or ``int8_a8`` / ``int4_a8`` with int8 activations)."""
    return {name: m.kernel for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantMoeExperts))}



# ----------------------------------------------------------------------------------------------
# GGUF blocks (models/gguf.py): QuantLinear / QuantEmbedding buffers, exactly the file's weights
# ----------------------------------------------------------------------------------------------

def convert_gguf(name: str, raw, kind: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """The buffers of a layer whose weight ``name`` a GGUF file stores in ``kind`` blocks (``raw``: ``[n,
    bytes a row]`` uint8): int8 ``qweight`` or packed int4 with ``zeros``, fp32 ``scales``, and ``mins``
    where the type has them (``gguf.unpack_blocks``)."""
    from qwen_ops.models.gguf import NATIVE_LAYOUT, unpack_blocks

    if tuple(raw.shape[:1]) != (n,):
        raise ValueError(f"tensor {name!r} ({kind}) has {raw.shape[0]} rows, expected {n}")
    parts = unpack_blocks(raw, kind, n, k)
    scheme = NATIVE_LAYOUT[kind][0]
    q = torch.from_numpy(parts["q"])
    out = {"scales": torch.from_numpy(parts["scales"]).float().contiguous()}
    if scheme == "int4":
        out["qweight"] = pack_int4(q.to(torch.uint8).contiguous())
        out["zeros"] = torch.from_numpy(parts["zeros"]).to(torch.uint8).contiguous()
    else:
        out["qweight"] = q.to(torch.int8).contiguous()
    if "mins" in parts:
        out["mins"] = torch.from_numpy(parts["mins"]).float().contiguous()
    return out


class QuantEmbedding(nn.Module):
    """An embedding table held as a GGUF file stores it (``qweight``, ``scales``, ``zeros`` / ``mins`` as
    QuantLinear's, one row a token): the lookup dequantizes the rows it gathers. A tied LM head is a
    QuantLinear over the same buffers (``tied_head``), as llama.cpp runs it: the table is held once."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: str, groups: int, mins: bool,
                 dtype: torch.dtype, device: Any = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme, self.dtype = num_embeddings, embedding_dim, scheme, dtype
        # QuantLinear's names, which the loader's conversion fills (rows: tokens)
        self.out_features, self.in_features = num_embeddings, embedding_dim
        n, k = num_embeddings, embedding_dim
        if scheme == "int4":
            self.register_buffer("qweight", torch.empty((n, k // 2), dtype=torch.uint8, device=device))
            self.register_buffer("zeros", torch.empty((n, groups), dtype=torch.uint8, device=device))
        else:
            self.register_buffer("qweight", torch.empty((n, k), dtype=torch.int8, device=device))
            self.register_buffer("zeros", None)
        self.register_buffer("scales", torch.empty((n, groups), dtype=torch.float32, device=device))
        self.register_buffer("mins", torch.empty((n, groups), dtype=torch.float32, device=device) if mins else None)

    @classmethod
    def like(cls, embedding: nn.Embedding, quant: QuantConfig, dtype: torch.dtype, tensor: str) -> "QuantEmbedding":
        from qwen_ops.models.gguf import NATIVE_LAYOUT

        scheme, g, mins = NATIVE_LAYOUT[quant.types[tensor]]
        n, k = embedding.num_embeddings, embedding.embedding_dim
        if k % g:
            raise ValueError(f"embedding_dim = {k} is not a multiple of {quant.types[tensor]}'s group of {g}")
        with torch.device("meta"):
            return cls(n, k, scheme, k // g, mins, dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}, scales={list(self.scales.shape)}, "
                f"mins={self.mins is not None}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        q = self.qweight.index_select(0, ids)
        if self.scheme == "int4":
            q = torch.stack([q & 15, q >> 4], dim=-1).reshape(ids.shape[0], self.embedding_dim)
        groups = self.scales.shape[1]
        w = q.float().view(ids.shape[0], groups, -1)
        if self.zeros is not None:
            w = w - self.zeros.index_select(0, ids).float()[..., None]
        w = w * self.scales.index_select(0, ids)[..., None]
        if self.mins is not None:
            w = w + self.mins.index_select(0, ids)[..., None]
        return w.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def tied_head(self, head: "QuantLinear") -> None:
        """Point the tied LM head ``head`` (built ``QuantLinear.like`` this table) at this table's buffers."""
        head.qweight, head.scales = self.qweight, self.scales
        if self.zeros is not None:
            head.zeros = self.zeros
        if self.mins is not None:
            head.mins = self.mins
        for key in ("qweight", "scales", "zeros", "mins"):   # the table's buffers hold the state dict
            head._non_persistent_buffers_set.add(key)
        head.process_weights_after_loading()
