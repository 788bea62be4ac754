"""``nn.Linear`` whose fp32 CPU products skip the BLAS ``mm`` where something faster exists.

``F.linear`` on fp32 CPU tensors calls the BLAS sgemm that torch was built with (MKL on x86).
On the AMD EPYC machines this project runs on, that is slow: at 1 row its sgemv streams a weight
at about 25 GB/s (the cpu backend's packed-panel product: about 70), and for batched decode and
prefill shapes oneDNN's JIT kernels are about 2x faster (measured with ``OMP_NUM_THREADS=1``,
Qwen3 shapes hidden 256 .. vocab 4096, medians: 32 rows 0.54-0.77x of the sgemm time, 2048 rows
0.43-0.59x). So eager fp32 CPU calls without autograd take the cpu backend's packed product
when that backend is selected and built, else (and under ``torch.compile``) oneDNN from
``ONEDNN_MIN_ROWS`` rows. Results agree with sgemm to fp32 rounding (different summation order,
same accumulation precision).

Parameter names and the state dict are those of ``nn.Linear``, so checkpoints load unchanged.
Under ``torch.compile`` the oneDNN call goes through the opaque custom op
``torch.ops.qwen_ops.onednn_linear`` (a private helper, not one of the ``torch.ops.qwen.*`` kernel
ops): Inductor lowers ``mkldnn._linear_pointwise`` itself only for frozen (constant) weights.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from qwen_ops.ops.kernels import cpu as cpu_kernels

# Row count from which oneDNN beats sgemm for every Qwen3 projection shape measured (below it,
# for the small square projections, sgemm is as fast or faster).
ONEDNN_MIN_ROWS = 16


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@torch.library.custom_op("qwen_ops::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D fp32 CPU ``x``, computed by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


# The batch size oneDNN is told to lay the prepacked weight out for (a decode batch; the packed
# weight serves every row count, measured best around here for 32-row decode and 2048-row prefill).
PACK_BATCH_HINT = 32


def tensor_identity(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, version counter): changes when the tensor is replaced or written in place."""
    try:
        version = t._version
    except RuntimeError:   # an inference tensor has no version counter (and stays as made)
        version = -1
    return t.data_ptr(), version


class Linear(nn.Linear):
    """``nn.Linear`` with faster routes for fp32 CPU inputs without autograd.

    Eager, when the ``cpu`` backend is selected and built and torch runs one intra-op thread (the
    C code is single-threaded; with more threads, torch's threaded products run): the packed-panel
    product (``cpu.linear_packed``) on a copy of the weight packed on first use (``panels()``), for
    any row count: 2.7x MKL's sgemv at 1 row on the CPUs measured here, oneDNN's speed from 16 rows.
    The dense model's one-call forward reads the same packed copy. Otherwise (the cpu backend off,
    or under ``torch.compile``) inputs of at least ``ONEDNN_MIN_ROWS`` rows go to oneDNN, eager on
    its own prepacked copy (a 32-request decode step measured 3.08 vs 3.58 ms with it). Packed
    copies are remade when the weight is replaced or written in place (tracked by its data pointer
    and version counter; writes through ``.data`` are not seen). Each costs one more copy of the
    weight in memory; ``prepack = False`` on a module does without (sgemm / unpacked oneDNN).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.onednn = _onednn_linear_available()
        self.prepack = True
        self._packed: Optional[tuple[int, int, torch.Tensor]] = None   # (data_ptr, version, packed weight)
        self._group_packed: Optional[tuple] = None   # see linear_group: (key, packed weights, biases)
        self._panels: Optional[tuple[tuple[int, int], torch.Tensor]] = None   # (weight identity, panels)

    def __getstate__(self) -> dict:
        # The oneDNN copy is an opaque tensor that neither pickles nor deep-copies; the copies of a
        # module repack on first use (their weights live elsewhere anyway).
        state = dict(super().__getstate__())
        state["_packed"] = state["_group_packed"] = state["_panels"] = None
        return state

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half() ...: the packed copies belong to the old tensors; drop them now
        # rather than keep their memory until the next call notices the new weight.
        self._packed = self._group_packed = self._panels = None
        return super()._apply(fn, recurse)

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = tensor_identity(w)
        if self._packed is None or self._packed[:2] != key:
            self._packed = key + (torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT),)
        return self._packed[2]

    def panels(self) -> torch.Tensor:
        """The weight packed for ``cpu.linear_packed`` (made on first use, remade when it changes)."""
        key = tensor_identity(self.weight)
        if self._panels is None or self._panels[0] != key:
            self._panels = (key, cpu_kernels.pack_panels(self.weight.detach()))
        return self._panels[1]

    def takes_packed(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs ``cpu.linear_packed``: eager, fp32 CPU, 2-D with contiguous rows,
        no autograd, a contiguous fp32 weight and bias, prepacking on, the cpu backend selected, one
        intra-op thread (``cpu.packed_products_enabled``)."""
        b = self.bias
        return (self.prepack and x.dim() == 2 and x.stride(-1) == 1 and not torch.is_grad_enabled()
                and self.weight.dtype == torch.float32 and self.weight.is_contiguous()
                and (b is None or (b.dtype == torch.float32 and b.is_contiguous())) and cpu_kernels.usable_for(x)
                and cpu_kernels.packed_products_enabled())

    def takes_onednn(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs on oneDNN (fp32 CPU, 2-D, at least ONEDNN_MIN_ROWS rows, no autograd)."""
        return (self.onednn and x.dim() == 2 and x.shape[0] >= ONEDNN_MIN_ROWS and x.dtype == torch.float32
                and x.device.type == "cpu" and self.weight.dtype == torch.float32
                and not (self.weight.requires_grad and torch.is_grad_enabled()))   # no oneDNN backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_packed(x):
            return cpu_kernels.linear_packed(x, self.panels(), self.bias, self.out_features)
        if self.takes_onednn(x):
            if torch.compiler.is_compiling():
                return onednn_linear(x, self.weight, self.bias)
            weight = self._packed_weight() if self.prepack else self.weight
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def linear_group(x: torch.Tensor, linears: tuple[Linear, ...]) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]`` for projections of one input (q/k/v, gate/up).

    On the eager oneDNN route (the cpu backend off; every member takes the route, prepacking on)
    it runs ONE matrix product against the weights concatenated and prepacked together (kept on
    ``linears[0]``, remade when any weight or bias changes) and returns column views of its
    output: fewer, wider products run faster (32 rows, q/k/v of the embedded model: 38 vs 64 us).
    The modules and the state dict stay separate, as in the checkpoint. Elsewhere (the packed
    route, few rows, other dtypes, autograd, ``torch.compile``) it calls the modules one by one.
    """
    if (torch.compiler.is_compiling() or linears[0].takes_packed(x)
            or not all(lin.prepack and lin.takes_onednn(x) for lin in linears)
            or len({lin.bias is None for lin in linears}) != 1):
        return [lin(x) for lin in linears]
    head = linears[0]
    key = tuple(tensor_identity(t) for lin in linears for t in (lin.weight, lin.bias) if t is not None)
    if head._group_packed is None or head._group_packed[0] != key:
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None if head.bias is None else torch.cat([lin.bias.detach() for lin in linears])
        head._group_packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT), bias)
    _, packed, bias = head._group_packed
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return list(y.split([lin.out_features for lin in linears], dim=1))
