"""pytest-benchmark setup for benchmarks/: device and backend fixtures.

Run with ``OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_ops.py --benchmark-enable``
(pyproject's addopts disable benchmarks by default, and testpaths keeps them out of the normal test
run). Triton is benchmarked only on CUDA tensors: the CPU interpreter says nothing about speed.
"""

from __future__ import annotations

import pytest
import torch

from qwen_ops.ops.backend import why_unavailable

BACKENDS = ("reference", "cpu", "triton", "cuda")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(params=BACKENDS)
def backend(request, device) -> str:
    name = request.param
    if name == "triton" and device.type != "cuda":
        pytest.skip("triton is benchmarked on CUDA only (the CPU interpreter is a correctness tool)")
    try:
        reason = why_unavailable(name, device)
    except ImportError as exc:
        reason = f"cannot import the {name} backend: {exc}"
    if reason is not None:
        pytest.skip(f"backend {name!r} unavailable on {device}: {reason}")
    return name


@pytest.fixture(scope="session")
def synchronized(device):
    """``synchronized(fn)``: ``fn`` followed by a device sync, so a timer sees the kernel's whole run."""
    def wrap(fn):
        def run():
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out
        return run
    return wrap
