"""How many intra-op threads a CPU engine runs with, decided once, when the engine is built.

One, unless the user chose: ``QWEN_OPS_CPU_THREADS=N`` sets N, and an ``OMP_NUM_THREADS`` in the
environment is left as torch read it. Why not torch's default (one per core): a step is
hundreds of small parallel regions, and each waits at a barrier for every thread of the pool.
When another process holds one of the cores (a build, a test run, a second server), the thread
on it is descheduled and every region waits for the OS to run it again; with OpenMP's spinning
waits on top, the embedded model's main job fell from about 830 to 4-20 tokens/s on a 2-core
machine, 40-200x slower than one thread. One thread costs at most what the other cores would
add on a quiet machine (the CPU executor's C kernels are single-threaded anyway), and it never
collapses. ``benchmarks/bench_threads.py`` measures both under a competing busy process;
docs/design.md has the figures.
"""

from __future__ import annotations

import logging
import os

import torch

THREADS_ENV = "QWEN_OPS_CPU_THREADS"
logger = logging.getLogger(__name__)


def cpu_threads_setting() -> int | None:
    """The thread count the environment asks for: ``QWEN_OPS_CPU_THREADS``, else None when
    ``OMP_NUM_THREADS`` is set (torch already read it), else 1."""
    value = os.environ.get(THREADS_ENV)
    if value is not None:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{THREADS_ENV} = {value!r}, expected an int >= 1")
        return n
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1


def configure_cpu_threads() -> int:
    """Apply ``cpu_threads_setting()`` to torch's intra-op pool; returns the thread count in use."""
    n = cpu_threads_setting()
    if n is not None and torch.get_num_threads() != n:
        logger.info("qwen_ops: using %d intra-op thread(s) (was %d); set %s or OMP_NUM_THREADS to choose",
                    n, torch.get_num_threads(), THREADS_ENV)
        torch.set_num_threads(n)
    return torch.get_num_threads()
