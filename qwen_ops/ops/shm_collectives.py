"""Shared-memory all-reduce and all-gather for tensor-parallel ranks on one host:
``torch.ops.qwen.shm_all_reduce`` and ``torch.ops.qwen.shm_all_gather``.

gloo over loopback costs about 2 ms per all-reduce on these 2-core VMs (benchmarks/bench_tp.py),
and a decode step has two per layer. Ranks on one host can meet in shared memory instead (vLLM's
and SGLang's CPU backends do the same). The ops are custom ops with fakes, so a compiled step
traces them with no graph break; the workspace is an ordinary uint8 tensor over a
``multiprocessing.shared_memory`` segment that every rank maps.

Workspace layout (``workspace_bytes``): one 64-byte header line per rank holding that rank's call
counter, then two parity halves of ``world_size`` slots of ``slot_bytes`` each. Call ``seq`` of
rank r: copy x into slot r of half ``seq % 2``, publish ``seq``, wait until every counter reaches
``seq``, then combine the slots in rank order (so every rank gets bitwise the same sum). A rank
can run at most one call ahead of the slowest, so it never overwrites a half still being read.
A message larger than a slot goes through ``torch.distributed`` instead (the same on every rank).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

import os

HEADER_LINE = 64                      # bytes per rank's counter (one cache line)
DEFAULT_SLOT_BYTES = 32 << 20


def timeout_s() -> float:
    """How long a rank waits for the others (``QWEN_OPS_TP_TIMEOUT_S``, default 60 s)."""
    return float(os.environ.get("QWEN_OPS_TP_TIMEOUT_S", 60.0))


def spin_until(done: Callable[[], bool], timed_out: Callable[[], BaseException],
               alive: Optional[Callable[[], None]] = None, max_pause: float = 0.001) -> None:
    """Poll ``done()`` until it is true: spin first (the other side is usually a few microseconds
    away), then sleep between polls, backing off to ``max_pause``, so that a rank that waits long
    stops burning the core the other needs. ``alive()`` (may raise) runs at each sleep; past
    ``timeout_s()`` of sleeping, ``timed_out()`` is raised."""
    spins, deadline, pause = 0, None, min(0.00002, max_pause)
    while not done():
        spins += 1
        if spins < 20000:
            continue
        if deadline is None:
            deadline = time.monotonic() + timeout_s()
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise timed_out()
        time.sleep(pause)
        pause = min(max_pause, pause * 2)


def workspace_bytes(world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return HEADER_LINE * world_size + 2 * world_size * slot_bytes


def slot_bytes_of(workspace: torch.Tensor, world_size: int) -> int:
    return (workspace.numel() - HEADER_LINE * world_size) // (2 * world_size)


def _check(x: torch.Tensor, workspace: torch.Tensor, rank: int, world_size: int) -> None:
    if workspace.dtype != torch.uint8 or workspace.dim() != 1:
        raise ValueError(f"workspace has dtype {workspace.dtype} and shape {tuple(workspace.shape)}, "
                         "expected a 1-D uint8 tensor (workspace_bytes)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank}, expected 0 <= rank < world_size = {world_size}")
    if workspace.numel() < workspace_bytes(world_size, 1):
        raise ValueError(f"workspace has {workspace.numel()} bytes, too few for world_size = {world_size}")
    if x.device.type != "cpu" or workspace.device.type != "cpu":
        raise ValueError(f"x is on {x.device} and workspace on {workspace.device}; expected both on the CPU")


def _exchange(x: torch.Tensor, workspace: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    """Publish ``x`` and return every rank's copy (views of the workspace), in rank order."""
    # A numpy view for the counters: reading one costs ~0.1 us there, ~20 us as a torch op.
    counters = workspace[:HEADER_LINE * world_size].numpy().view("int64")[::HEADER_LINE // 8]
    seq = int(counters[rank]) + 1
    slot = slot_bytes_of(workspace, world_size)
    base = HEADER_LINE * world_size + (seq % 2) * world_size * slot
    src = x.contiguous().view(-1).view(torch.uint8)
    n = src.numel()
    workspace[base + rank * slot:base + rank * slot + n].copy_(src)
    counters[rank] = seq                           # x86 keeps store order: the data is visible first
    spin_until(lambda: counters.min() >= seq, lambda: RuntimeError(
        f"shm collective: rank(s) {[r for r in range(world_size) if int(counters[r]) < seq]} did not arrive "
        f"within {timeout_s():.0f} s (a tensor-parallel worker died or hangs)"), max_pause=0.00005)
    return [workspace[base + r * slot:base + r * slot + n].view(x.dtype).view(x.shape) for r in range(world_size)]


def _fits(x: torch.Tensor, workspace: torch.Tensor, world_size: int) -> bool:
    return x.numel() * x.element_size() <= slot_bytes_of(workspace, world_size)


@torch.library.custom_op("qwen::shm_all_reduce", mutates_args=("workspace",))
def shm_all_reduce(x: torch.Tensor, workspace: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The sum of ``x`` over the ranks, through shared memory (module docstring)."""
    _check(x, workspace, rank, world_size)
    if not _fits(x, workspace, world_size):
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out)
        return out
    parts = _exchange(x, workspace, rank, world_size)
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


@shm_all_reduce.register_fake
def _(x, workspace, rank, world_size):
    return torch.empty_like(x)


@torch.library.custom_op("qwen::shm_all_gather", mutates_args=("workspace",))
def shm_all_gather(x: torch.Tensor, workspace: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Every rank's ``x [N, ...]`` concatenated along dim 0: ``[world_size * N, ...]``."""
    _check(x, workspace, rank, world_size)
    if not _fits(x, workspace, world_size):
        import torch.distributed as dist

        out = x.new_empty((world_size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out
    return torch.cat(_exchange(x, workspace, rank, world_size), dim=0)


@shm_all_gather.register_fake
def _(x, workspace, rank, world_size):
    return x.new_empty((world_size * x.shape[0],) + tuple(x.shape[1:]))
