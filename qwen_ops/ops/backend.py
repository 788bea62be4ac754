"""Kernel backend selection for torch.ops.qwen.* (DESIGN.md section 4).

Backends: ``reference`` (plain torch, the specification and test oracle), ``cpu`` (native C
kernels for CPU tensors, compiled on first use; qwen_ops/ops/kernels/cpu.py), ``triton`` (GPU
default; runs on CPU tensors under ``TRITON_INTERPRET=1``), ``cuda`` (the csrc/ extension).
``auto`` picks the best available one for the tensors' device and falls back quietly;
an explicit choice that cannot run raises.

The choice comes from ``QWEN_OPS_BACKEND`` or from :func:`set_backend` /
:func:`use_backend`. Like ``torch.backends`` flags it is process configuration, kept in a
``ContextVar`` so that a ``use_backend`` block in one thread does not leak into another.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Iterator, Mapping, Optional

import torch

from qwen_ops.ops.kernels import triton_interpret

BACKENDS = ("auto", "reference", "cpu", "triton", "cuda")
_KERNEL_MODULES = {
    "reference": "qwen_ops.ops.kernels.reference",
    "cpu": "qwen_ops.ops.kernels.cpu",
    "triton": "qwen_ops.ops.kernels.triton",
    "cuda": "qwen_ops.ops.kernels.cuda",
}
# Backends that run on the host and check index values on every untrusted call.
HOST_BACKENDS = ("reference", "cpu")
# The ops the cpu backend implements itself (C kernels; fused_moe: grouped torch GEMMs).
CPU_NATIVE_OPS = ("kv_write", "slot_attention", "fused_moe")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("qwen_ops_backend", default=None)
_trusted: contextvars.ContextVar[bool] = contextvars.ContextVar("qwen_ops_trusted_metadata", default=False)
# The backends a runner chose for its model's op calls, once, when it was built (bound_backends).
_bound: contextvars.ContextVar[Optional[Mapping[tuple[str, str], str]]] = contextvars.ContextVar(
    "qwen_ops_bound_backends", default=None)
# Every (op, phase) whose backend is resolved (resolve_backend's phase: slot_attention only).
OP_PHASES = (("kv_write", ""), ("slot_attention", "decode"), ("slot_attention", "prefill"), ("causal_conv1d", ""),
             ("gated_delta_rule", ""), ("fused_moe", ""))


def _check_name(name: str, source: str) -> str:
    name = name.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{source} = {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def get_backend() -> str:
    """The requested backend name (may be ``auto``)."""
    chosen = _override.get()
    if chosen is not None:
        return chosen
    return _check_name(os.environ.get("QWEN_OPS_BACKEND", "auto"), "QWEN_OPS_BACKEND")


def set_backend(name: str | None) -> None:
    """Select a backend for this context (``None`` returns to ``QWEN_OPS_BACKEND``)."""
    _override.set(None if name is None else _check_name(name, "backend"))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    token = _override.set(_check_name(name, "backend"))
    try:
        yield
    finally:
        _override.reset(token)


@contextlib.contextmanager
def trusted_metadata() -> Iterator[None]:
    """Skip the reference backend's per-call value checks inside this block.

    For callers that build the index tensors themselves from validated state (the engine's
    runner): the model calls the ops once per layer with the same metadata, and re-reading it
    every time would dominate a CPU decode step. Shape/dtype/device checks still run, and
    ``QWEN_OPS_DEBUG=1`` still forces the value checks.
    """
    token = _trusted.set(True)
    try:
        yield
    finally:
        _trusted.reset(token)


def value_checks_enabled(backend: str) -> bool:
    """Whether an op call must read and check its index values on ``backend``.

    Host backends (reference, cpu) check them on every untrusted call: reading them is cheap
    there, and the cpu kernels index memory with them directly.
    """
    return debug_checks_enabled() or (backend in HOST_BACKENDS and not _trusted.get())


def debug_checks_enabled() -> bool:
    """``QWEN_OPS_DEBUG=1`` makes every backend check index values (this syncs the device)."""
    return os.environ.get("QWEN_OPS_DEBUG", "0") not in ("", "0")


def why_unavailable(name: str, device: torch.device) -> str | None:
    """None when backend ``name`` can run on ``device``, otherwise the reason."""
    if name == "reference":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"the cpu backend needs CPU tensors, got {device}"
        from qwen_ops.ops.kernels import cpu as cpu_kernels
        return cpu_kernels.why_unavailable()
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret():
            return None
        return f"triton needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors), got {device}"
    if name == "cuda":
        if device.type != "cuda":
            return f"the cuda backend needs CUDA tensors, got {device}"
        from qwen_ops.ops.kernels import cuda as cuda_kernels
        return cuda_kernels.why_unavailable()
    raise ValueError(f"backend = {name!r}; expected one of {', '.join(BACKENDS[1:])}")


BACKEND_CHOICE_FILE = Path(__file__).with_name("backend_choice.json")


@functools.lru_cache(maxsize=None)
def measured_choices(path: Path = BACKEND_CHOICE_FILE) -> dict[str, str]:
    """``{"<op>/<phase>": backend}`` measured on a GPU by benchmarks/device_check.py (read once)."""
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()).get("choices", {}))


def resolve_backend(device: torch.device, op: str = "", phase: str = "") -> str:
    """The concrete backend that runs ``op`` (``phase`` "decode" or "prefill") on ``device``.

    ``auto`` on CUDA takes the faster of triton and cuda as measured for that op and phase
    (``backend_choice.json``), else triton, else cuda. On the CPU it takes the cpu backend for
    kv_write, slot_attention and fused_moe when its C kernels build here, else (and for the state
    ops, which have no cpu kernel) the reference.
    """
    name = get_backend()
    if name == "auto":
        if device.type == "cuda":
            measured = measured_choices().get(f"{op}/{phase}" if phase else op)
            for candidate in ((measured,) if measured else ()) + ("triton", "cuda"):
                if why_unavailable(candidate, device) is None:
                    return candidate
        elif device.type == "cpu" and op in CPU_NATIVE_OPS and why_unavailable("cpu", device) is None:
            return "cpu"
        return "reference"
    reason = why_unavailable(name, device)
    if reason is not None:
        raise RuntimeError(f"qwen_ops backend {name!r} is unavailable: {reason}")
    return name


def resolve_backends(device: torch.device) -> dict[tuple[str, str], str]:
    """Every op's backend on ``device`` (``OP_PHASES``), resolved now from the current setting:
    what a runner binds for all its steps (``bound_backends``)."""
    return {(op, phase): resolve_backend(device, op, phase) for op, phase in OP_PHASES}


@contextlib.contextmanager
def bound_backends(choices: Mapping[tuple[str, str], str]) -> Iterator[None]:
    """Op calls inside this block run on ``choices`` (``resolve_backends``' result) instead of
    resolving their backend per call: the engine decides once, when its runner is built, and a
    later change of ``QWEN_OPS_BACKEND`` or ``use_backend`` does not reach its steps. Direct op
    calls outside such a block resolve per call, as documented for ``torch.ops.qwen.*``."""
    token = _bound.set(choices)
    try:
        yield
    finally:
        _bound.reset(token)


def backend_for(device: torch.device, op: str, phase: str = "") -> str:
    """The backend of one op call: the bound choice (``bound_backends``), else ``resolve_backend``."""
    chosen = _bound.get()
    if chosen is not None:
        name = chosen.get((op, phase))
        if name is not None:
            return name
    return resolve_backend(device, op, phase)


def kernels(name: str) -> ModuleType:
    """The kernel module of a concrete backend (imported on first use)."""
    return importlib.import_module(_KERNEL_MODULES[name])
