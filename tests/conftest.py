"""Shared pytest setup for qwen_ops: Triton interpreter on CPU-only machines, one intra-op thread,
device and backend fixtures.

``TRITON_INTERPRET=1`` must be set before triton (imported lazily by qwen_ops' triton backend)
builds its kernels, so it is set here, before any test module imports qwen_ops. It is only a
default: an explicit ``TRITON_INTERPRET=0`` in the environment wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread, as the README's test command sets with OMP_NUM_THREADS=1: the tests must not
# depend on how the suite was started (and two threads make these 2-core machines' timings erratic).
# A test wanting more threads sets them itself.
torch.set_num_threads(1)

import pytest  # noqa: E402

from qwen_ops.ops.backend import why_unavailable  # noqa: E402

# Every concrete backend. The cuda backend needs CUDA tensors: its cases carry the ``gpu`` marker,
# and a machine without a CUDA GPU deselects them (pytest_collection_modifyitems) instead of
# listing hundreds of skips for combinations that can never run there.
BACKENDS = ("reference", "cpu", "triton", "cuda")
BACKEND_PARAMS = [pytest.param(b, marks=pytest.mark.gpu) if b == "cuda" else b for b in BACKENDS]


def pytest_collection_modifyitems(config, items):
    """Without a CUDA GPU, tests marked ``gpu`` (and those taking the ``cuda_device`` fixture) are
    deselected: they are GPU work, run by ``benchmarks/device_check.py`` on a GPU machine."""
    if torch.cuda.is_available():
        return
    keep, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("gpu") or "cuda_device" in item.fixturenames else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def backend_unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None when it can)."""
    try:
        return why_unavailable(name, device)
    except ImportError as exc:  # e.g. the cuda backend's kernel module is not part of this build
        return f"{name} backend cannot be imported: {exc}"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device kernels are tested on: the CUDA GPU when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request, device) -> str:
    """A concrete backend name that can run on ``device``; skips (with the reason) otherwise."""
    reason = backend_unavailable_reason(request.param, device)
    if reason is not None:
        pytest.skip(f"backend {request.param!r} unavailable on {device}: {reason}")
    return request.param


@pytest.fixture
def cuda_device() -> torch.device:
    """For GPU-only tests."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none on this machine)")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def portable_library(tmp_path_factory):
    """The CPU library built without AVX-512 (``QWEN_OPS_CPU_CFLAGS=-mno-avx512f``: the portable loops),
    once per session into a directory of its own (each build takes about half a minute); the test is
    skipped where the kernels cannot be built. Tests swap it in with
    ``monkeypatch.setattr(cpu, "library", lambda: portable_library)``."""
    from qwen_ops.ops.kernels import cpu

    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path_factory.mktemp("portable")))
        mp.setenv("QWEN_OPS_CPU_CFLAGS", "-mno-avx512f")
        return cpu.library.__wrapped__()


@pytest.fixture
def cpu_fast_ops(monkeypatch):
    """The CPU backend's fast ops registered (the test is skipped where its kernels cannot be built),
    and the C++ kernels' own output allocations poisoned (``QWEN_OPS_POISON_OUTPUTS``)."""
    from qwen_ops.ops import registry
    from qwen_ops.ops.kernels import cpu

    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    registry.cpu_fast_ops()
    monkeypatch.setenv("QWEN_OPS_POISON_OUTPUTS", "1")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Fresh outputs are NaN-filled, so an element a kernel skips shows: Python's ``torch.empty``
    (the ctypes and Triton launchers allocate with it) and, through ``QWEN_OPS_POISON_OUTPUTS``, the
    C++ kernels' own allocations. Returns the monkeypatch (``.undo()`` ends the poisoning)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setenv("QWEN_OPS_POISON_OUTPUTS", "1")
    return monkeypatch
