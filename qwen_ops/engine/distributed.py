"""Tensor-parallel execution across processes on ``torch.distributed`` (gloo on the CPU, NCCL on CUDA).

Two launch modes, one model slicing (``qwen_ops/models/parallel.py``):

**In-process** (``QwenEngine.from_pretrained(..., tensor_parallel_size=N)`` and ``LLM(...,
tensor_parallel_size=N)``): the caller becomes rank 0 and spawns N-1 worker processes
(``torch.multiprocessing``, spawn). Only rank 0 keeps slots, blocks, the scheduler and sampling.
Its runner is wrapped in ``TPRunnerProxy``, which forwards the runner's few mutating calls
(block-table rows, cache growth, swap copies, weight refresh, and ``execute``) to the workers:
the bookkeeping since the last step rides with the step, so one ``execute`` is one broadcast
(``broadcast_object_list``) and then the forward, whose collectives keep the ranks in step. Each
worker holds its own model slice, KV-cache slice and host swap copies (keyed by a handle).

**External** (``torchrun --nproc-per-node=N script.py``, every rank calling the same
``LLM(..., tensor_parallel_size=N)``): every rank runs the whole program (SPMD). Scheduling is
deterministic, every rank gets the full logits, and rank 0's sampled tokens are broadcast each
step so that random sampling cannot diverge. Multi-node runs use torchrun's rendezvous as is.

Faults: the process group has a timeout (``QWEN_OPS_TP_TIMEOUT_S``, default 60 s), so a dead
worker makes the driver raise within it (gloo usually notices a closed socket at once). Workers
ignore SIGINT (Ctrl-C reaches the whole process group; the driver shuts them down), are daemon
processes (they die with the driver), and are stopped by ``shutdown()``, which ``LLM`` and the
engine also run when they are garbage collected.
"""

from __future__ import annotations

import datetime
import itertools
import os
import signal
import socket
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from qwen_ops.models.parallel import TPGroup

DEFAULT_TIMEOUT_S = 60.0


def tp_timeout_s() -> float:
    return float(os.environ.get("QWEN_OPS_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed, died or did not start."""


def external_launch() -> Optional[tuple[int, int]]:
    """``(rank, world_size)`` when this process was started by torchrun (or another launcher
    that sets ``RANK`` and ``WORLD_SIZE``), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ValueError(f"tp_port = {port} is already in use on 127.0.0.1 ({e.strerror}); pick another "
                             "or leave it None") from e


def check_devices(size: int, device: torch.device) -> None:
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if size > n:
            raise ValueError(f"tensor_parallel_size = {size}, but only {n} CUDA devices are visible")
    else:
        n = os.cpu_count() or 1
        if size > n:
            raise ValueError(f"tensor_parallel_size = {size}, but this machine has {n} CPUs (one per rank)")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ---------------------------------------------------------------------------------------- worker
@dataclass
class WorkerSpec:
    """What a worker needs to build the same engine slice as rank 0."""
    path: str
    dtype: Any
    device: str
    engine_kwargs: dict
    port: int
    size: int
    threads: int = 1


def _worker_main(rank: int, spec: WorkerSpec, errors) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch.distributed as dist

        from qwen_ops.engine.engine import QwenEngine
        from qwen_ops.models.loader import load_checkpoint

        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                                world_size=spec.size, timeout=datetime.timedelta(seconds=tp_timeout_s()))
        tp = TPGroup(rank, spec.size, dist.group.WORLD)
        ckpt = load_checkpoint(spec.path, dtype=spec.dtype, device=device, tp=tp)
        engine = QwenEngine(ckpt.model, ckpt.config, **spec.engine_kwargs)
        serve_runner(engine.runner)
    except BaseException as e:   # report, then exit non-zero: the driver turns it into an error
        try:
            errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        except Exception:
            pass
        raise SystemExit(1)
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def serve_runner(runner) -> None:
    """A worker's loop: apply rank 0's runner calls, in order, until told to stop."""
    import torch.distributed as dist

    saved: dict[int, Any] = {}
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, pending, *args = box[0]
        _apply_pending(runner, pending, saved)
        if op == "stop":
            return
        if op == "execute":
            with torch.inference_mode():
                runner.execute(args[0])
        elif op == "copy_out":
            handle, slot, blocks = args
            saved[handle] = runner.copy_out(slot, blocks)
        elif op == "copy_in":
            handle, slot, blocks = args
            runner.copy_in(slot, blocks, saved.pop(handle))
        elif op == "refresh":
            runner.refresh_weights()
        elif op == "sync":
            pass
        else:
            raise TensorParallelError(f"unknown tensor-parallel command {op!r}")


def _apply_pending(runner, pending: Sequence[tuple], saved: dict) -> None:
    for item in pending:
        kind = item[0]
        if kind == "row":
            runner.set_block_row(item[1], item[2])
        elif kind == "grow_slots":
            runner.grow_slots(item[1])
        elif kind == "grow_blocks":
            runner.grow_blocks(item[1])
        elif kind == "drop":
            saved.pop(item[1], None)


# ---------------------------------------------------------------------------------------- driver
class _SwapCopy(list):
    """Rank 0's host copy of a slot (a list, as ``ModelRunner.copy_out`` returns), naming the
    workers' copies by ``handle``."""
    handle: int


@dataclass
class _Control:
    """State shared by the proxy and the finalizers: what to tell the workers next."""
    pending: list = field(default_factory=list)
    handles: Any = field(default_factory=lambda: itertools.count())


class TPRunnerProxy:
    """Rank 0's runner under in-process tensor parallelism (module docstring): the local runner,
    whose mutating calls are also posted to the workers."""

    def __init__(self, runner, workers: "TPWorkers"):
        self._runner = runner
        self._workers = workers
        self._control = _Control()

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def _post(self, op: str, *args) -> None:
        pending, self._control.pending = self._control.pending, []
        self._workers.broadcast((op, pending, *args))

    def set_block_row(self, slot: int, blocks: Sequence[int]) -> None:
        self._runner.set_block_row(slot, blocks)
        self._control.pending.append(("row", slot, list(blocks)))

    def grow_slots(self, max_slots: int) -> None:
        self._runner.grow_slots(max_slots)
        self._control.pending.append(("grow_slots", max_slots))

    def grow_blocks(self, num_blocks: int) -> None:
        self._runner.grow_blocks(num_blocks)
        self._control.pending.append(("grow_blocks", num_blocks))

    def execute(self, chunks) -> torch.Tensor:
        self._post("execute", list(chunks))
        return self._runner.execute(chunks)

    def copy_out(self, slot: int, blocks: Sequence[int]):
        handle = next(self._control.handles)
        self._post("copy_out", handle, slot, list(blocks))
        out = _SwapCopy(self._runner.copy_out(slot, blocks))
        out.handle = handle
        # When rank 0 drops its copy (swapped back in, or recomputed instead), the workers drop theirs.
        weakref.finalize(out, self._control.pending.append, ("drop", handle))
        return out

    def copy_in(self, slot: int, blocks: Sequence[int], saved) -> None:
        self._post("copy_in", saved.handle, slot, list(blocks))
        self._runner.copy_in(slot, blocks, saved)

    def refresh_weights(self) -> None:
        self._post("refresh")
        self._runner.refresh_weights()


class TPWorkers:
    """The worker processes of an in-process tensor-parallel group, and rank 0's side of it."""

    def __init__(self, spec: WorkerSpec):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.spec = spec
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        self.procs = []
        self._closed = False
        for rank in range(1, spec.size):
            p = ctx.Process(target=_worker_main, args=(rank, spec, self._errors), daemon=True,
                            name=f"qwen-ops-tp-{rank}")
            p.start()
            self.procs.append(p)
        try:
            dist.init_process_group(_backend(torch.device(spec.device)), init_method=f"tcp://127.0.0.1:{spec.port}",
                                    rank=0, world_size=spec.size, timeout=datetime.timedelta(seconds=tp_timeout_s()))
        except Exception as e:
            self.shutdown()
            raise TensorParallelError(f"tensor-parallel workers did not start: {self._first_error() or e}") from e
        self.group = TPGroup(0, spec.size, dist.group.WORLD)

    def _first_error(self) -> Optional[str]:
        try:
            return self._errors.get(timeout=0.5)
        except Exception:
            dead = [p.name for p in self.procs if not p.is_alive()]
            return f"{', '.join(dead)} exited" if dead else None

    def check_alive(self) -> None:
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]
        if dead:
            msg = self._first_error()
            raise TensorParallelError(f"tensor-parallel worker died: {', '.join(dead)}" + (f"; {msg}" if msg else ""))

    def broadcast(self, message: tuple) -> None:
        import torch.distributed as dist

        if self._closed:
            raise TensorParallelError("the tensor-parallel group was shut down")
        self.check_alive()
        try:
            dist.broadcast_object_list([message], src=0)
        except Exception as e:
            raise TensorParallelError(f"tensor-parallel broadcast failed: {e}; "
                                      f"{self._first_error() or 'a worker may have died'}") from e

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (politely, then by force), and leave the process group."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        if dist.is_initialized() and all(p.is_alive() for p in self.procs):
            try:
                dist.broadcast_object_list([("stop", [])], src=0)
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self._errors.close()


def start_workers(path, *, size: int, dtype, device: torch.device, engine_kwargs: dict,
                  port: Optional[int] = None) -> TPWorkers:
    """Spawn ranks 1..size-1 and join them as rank 0 (the caller loads its own slice after)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise ValueError("tensor_parallel_size > 1 in-process needs a fresh process: torch.distributed is "
                         "already initialized here (under torchrun, every rank calls the same LLM(...))")
    check_devices(size, device)
    if port is None:
        port = free_port()
    else:
        check_port_free(port)
    spec = WorkerSpec(str(path), dtype, str(device), dict(engine_kwargs), port, size,
                      threads=torch.get_num_threads())
    return TPWorkers(spec)


def init_external(device: torch.device) -> TPGroup:
    """Join the process group that torchrun set up (``env://``): this rank's ``TPGroup``."""
    import torch.distributed as dist

    rank, size = external_launch()
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(_backend(device), init_method="env://",
                                timeout=datetime.timedelta(seconds=tp_timeout_s()))
    return TPGroup(rank, size, dist.group.WORLD)


def broadcast_tokens(tokens: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rank 0's sampled tokens on every rank (external launch: random sampling must not diverge)."""
    import torch.distributed as dist

    dist.broadcast(tokens, src=0, group=tp.group)
    return tokens
