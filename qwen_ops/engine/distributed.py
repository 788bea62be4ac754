"""Tensor-parallel execution across processes on ``torch.distributed`` (gloo on the CPU, NCCL on CUDA).

Two launch modes, one model slicing (``qwen_ops/models/parallel.py``):

**In-process** (``QwenEngine.from_pretrained(..., tensor_parallel_size=N)`` and ``LLM(...,
tensor_parallel_size=N)``): the caller becomes rank 0 and spawns N-1 worker processes
(``torch.multiprocessing``, spawn). Only rank 0 keeps slots, blocks, the scheduler and sampling.
Each of its runner's mutating calls is ``ModelRunner.call(method, *args)``: rank 0 sends the
method and its arguments, then every rank runs it (nano-vllm's ``ModelRunner.call``). A step is
one such message, its complete description (``IterationPlan``: tasks with their block ids, swap
copies, freed host copies), then the forward, whose collectives keep the ranks in step. Each
worker holds its own model slice, KV-cache slice and host swap copies (keyed by a handle).

**External** (``torchrun --nproc-per-node=N script.py``, every rank calling the same
``LLM(..., tensor_parallel_size=N)``): every rank runs the whole program (SPMD). Scheduling is
deterministic, every rank gets the full logits, and rank 0's sampled tokens are broadcast each
step so that random sampling cannot diverge. Multi-node runs use torchrun's rendezvous as is.

Scripts: the workers are spawned, so each imports the caller's main module again. A script that
creates ``LLM(tensor_parallel_size=N)`` at its top level, not under ``if __name__ == "__main__":``,
would do it again in every worker: the worker sees that it is still being bootstrapped
(``assert_not_bootstrapping``), says so and exits with ``MAIN_NOT_GUARDED_EXIT``, and rank 0, which
waits for every worker to report before it opens the process group, raises naming the guard.

Faults: the process group has a timeout (``QWEN_OPS_TP_TIMEOUT_S``, default 60 s), so a dead
worker makes the driver raise within it (gloo usually notices a closed socket at once). Workers
ignore SIGINT (Ctrl-C reaches the whole process group; the driver shuts them down), are daemon
processes (they die with the driver), and are stopped by ``shutdown()``, which ``LLM`` and the
engine also run when they are garbage collected. Under torchrun, a rank that cannot meet the
others at exit exits with status 1 at once (``_leave_external_group``).
"""

from __future__ import annotations

import atexit
import datetime
import mmap
import os
import signal
from pathlib import Path
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from qwen_ops.models.parallel import TPGroup
from qwen_ops.ops.shm_collectives import spin_until, timeout_s

# How long a rank waits for the others (QWEN_OPS_TP_TIMEOUT_S, default 60 s): one definition.
tp_timeout_s = timeout_s




class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed, died or did not start."""


# A worker's exit status when it found itself creating tensor-parallel workers of its own while
# importing the main module (``assert_not_bootstrapping``); rank 0 recognizes it.
MAIN_NOT_GUARDED_EXIT = 117

_GUARD_ADVICE = ("The tensor-parallel workers are started with the 'spawn' method, which imports the main module "
                 "({main}) again in each worker; code at its top level runs there again. Put the code that "
                 "creates the LLM (the script's top-level code) under `if __name__ == \"__main__\":`, as vLLM "
                 "asks too.")


def _main_module() -> str:
    main = sys.modules.get("__main__")
    return getattr(main, "__file__", None) or "the script"


def assert_not_bootstrapping() -> None:
    """In a spawned process still importing the main module (multiprocessing's bootstrap, when
    ``current_process()._inheriting`` is set: the state in which CPython itself refuses to start a
    process), starting workers means the script has no ``if __name__ == "__main__":`` guard: say so on
    stderr and exit with ``MAIN_NOT_GUARDED_EXIT`` at once, before loading anything."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"qwen_ops: a tensor-parallel worker, while importing the main module, reached code that starts "
              f"tensor-parallel workers again. {_GUARD_ADVICE.format(main=sys.argv[0] or 'the script')}",
              file=sys.stderr, flush=True)
        raise SystemExit(MAIN_NOT_GUARDED_EXIT)


def assert_main_guarded() -> None:
    """In the driver, before anything is spawned: when the main module is a file still running its
    top-level code (its ``<module>`` frame is on the stack) and the line it is at is not inside an
    ``if __name__ == "__main__":`` block, every spawned worker would run that line again: raise now,
    naming the guard (the workers' own check, ``assert_not_bootstrapping``, would say so only after
    each imported torch). A main module without a file (an interactive session, ``python -c``), or one
    whose source cannot be read, is left to the workers' check."""
    import ast
    import inspect

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return                      # the main module finished its top level (a callback, a thread): fine
    line = frame.f_lineno
    del frame
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return
    raise TensorParallelError(f"tensor_parallel_size > 1 from the top level of {path} (line {line}). "
                              + _GUARD_ADVICE.format(main=path))


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


def init_group(device: torch.device, init_method: str, **kwargs) -> None:
    """``torch.distributed.init_process_group`` with this module's backend and timeout.

    torch._dynamo is imported first: importing it after the group exists leaves references to the
    group in dynamo's tables (torch 2.13), and then ``destroy_process_group`` cannot free it (and
    join gloo's threads) at exit; see ``_leave_external_group``."""
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group(_backend(device), init_method=init_method,
                            timeout=datetime.timedelta(seconds=tp_timeout_s()), **kwargs)


class SharedSegment:
    """A named shared-memory segment (``/dev/shm``) mapped as a uint8 tensor. The creating rank
    unlinks the name at ``close``; the memory goes when the last mapping does."""

    def __init__(self, size: int, name: Optional[str] = None):
        self.owner = name is None
        self._unlinked = False
        if self.owner:
            from multiprocessing import shared_memory

            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self.name, buf = self._shm.name, self._shm.buf
        else:
            fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.name, buf = name, self._mm
        self.size = size
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)

    def close(self) -> None:
        """Unlink the name (creator only). The mapping stays (tensors may still view it; dropping
        the ``SharedMemory`` object would unmap it under them) until this object goes."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


def shm_supported() -> bool:
    return os.path.isdir("/dev/shm")


def workspace_slot_bytes(config, max_slots: int, chunk_size: int, size: int, elem: int) -> int:
    """A slot big enough for a chunk's hidden states and a decode batch's logits shard (the
    collectives fall back to torch.distributed past it), within [1 MiB, 64 MiB]."""
    hidden = chunk_size * config.hidden_size * elem
    logits = max_slots * -(-config.vocab_size // size) * elem
    return min(64 << 20, max(1 << 20, hidden, logits))


class ShmChannel:
    """Rank 0's step messages to the workers through shared memory: pickled bytes, a sequence
    number, and one acknowledgement per worker (about 0.1 ms a step here, against about 2 ms for
    gloo's ``broadcast_object_list``: benchmarks/bench_tp.py). A message too big for the segment
    goes by ``broadcast_object_list``."""

    HEADER = 4096

    def __init__(self, segment: SharedSegment, world_size: int):
        self.t = segment.tensor
        # [0] seq, [1] length, [8 r] worker r's ack; a numpy view (cheap reads while polling).
        self.h = self.t[:self.HEADER].numpy().view("int64")
        self.world_size = world_size
        self.capacity = self.t.numel() - self.HEADER

    def _wait(self, done, alive=None) -> None:
        spin_until(done, lambda: TensorParallelError(
            f"tensor-parallel channel: no progress within {tp_timeout_s():.0f} s"), alive)

    def send(self, message: tuple, alive=None) -> None:
        import pickle

        h = self.h
        seq = int(h[0])
        self._wait(lambda: all(int(h[8 * r]) == seq for r in range(1, self.world_size)), alive)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) <= self.capacity:
            self.t[self.HEADER:self.HEADER + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            h[1] = len(data)
        else:
            h[1] = -1
        h[0] = seq + 1                       # x86 keeps store order: the bytes are visible first
        if len(data) > self.capacity:
            import torch.distributed as dist

            dist.broadcast_object_list([message], src=0)

    def recv(self, rank: int) -> tuple:
        import pickle

        h = self.h
        last = int(h[8 * rank])
        self._wait(lambda: int(h[0]) > last)
        n = int(h[1])
        if n >= 0:
            message = pickle.loads(self.t[self.HEADER:self.HEADER + n].numpy().tobytes())
        else:
            import torch.distributed as dist

            box = [None]
            dist.broadcast_object_list(box, src=0)
            message = box[0]
        h[8 * rank] = last + 1
        return message


# ---------------------------------------------------------------------------------------- worker
@dataclass
class WorkerSpec:
    """What a worker needs to build the same runner slice as rank 0: ``build_runner(model, config,
    engine_kwargs)`` (a module-level function, pickled by name) returns the runner that serves the
    loaded slice, so this module knows nothing of the engine."""
    path: str
    dtype: Any
    device: str
    engine_kwargs: dict
    build_runner: Callable
    port: int
    size: int
    threads: int = 1
    workspace: Optional[tuple[str, int]] = None      # (shm name, bytes) of the collectives' workspace
    channel: Optional[tuple[str, int]] = None        # (shm name, bytes) of the step messages


def _worker_main(rank: int, spec: WorkerSpec, errors, started) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started.release()             # bootstrapped: the main module imported without incident
    try:
        import torch.distributed as dist

        from qwen_ops.models.loader import load_checkpoint

        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        init_group(device, f"tcp://127.0.0.1:{spec.port}", rank=rank, world_size=spec.size)
        segments = [SharedSegment(n, name) if name else None for name, n in (spec.workspace or (None, 0),
                                                                             spec.channel or (None, 0))]
        tp = TPGroup(rank, spec.size, dist.group.WORLD.group_name, segments[0].tensor if segments[0] else None,
                     segments)
        ckpt = load_checkpoint(spec.path, dtype=spec.dtype, device=device, tp=tp)
        runner = spec.build_runner(ckpt.model, ckpt.config, spec.engine_kwargs)
        channel = ShmChannel(segments[1], spec.size) if segments[1] else None
        serve_runner(runner, (lambda: channel.recv(rank)) if channel else None)
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


def _broadcast_recv() -> tuple:
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def serve_runner(runner, recv=None) -> None:
    """A worker's loop: run rank 0's runner calls (``ModelRunner.call``: a method name and its
    arguments, a step's complete description), in order, until told to stop. ``recv`` returns
    the next message (default: gloo's ``broadcast_object_list``)."""
    recv = recv or _broadcast_recv
    while True:
        method, args = recv()
        if method == "stop":
            return
        if method not in RUNNER_CALLS:
            raise TensorParallelError(f"unknown tensor-parallel command {method!r}")
        with torch.inference_mode():
            getattr(runner, method)(*args)


# The runner methods that change its state, each sent to every rank by ``ModelRunner.call``.
RUNNER_CALLS = frozenset({"step", "grow", "refresh_weights", "load_lora"})


class TPWorkers:
    """The worker processes of an in-process tensor-parallel group, and rank 0's side of it."""

    def __init__(self, spec: WorkerSpec, segments: Sequence[Optional[SharedSegment]] = (None, None)):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.spec = spec
        self.segments = [seg for seg in segments if seg is not None]
        self.channel = ShmChannel(segments[1], spec.size) if segments[1] is not None else None
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        started = ctx.Semaphore(0)
        self.procs = []
        self._closed = False
        for rank in range(1, spec.size):
            p = ctx.Process(target=_worker_main, args=(rank, spec, self._errors, started), daemon=True,
                            name=f"qwen-ops-tp-{rank}")
            p.start()
            self.procs.append(p)
        try:
            self._await_bootstrap(started)
            init_group(torch.device(spec.device), f"tcp://127.0.0.1:{spec.port}", rank=0, world_size=spec.size)
        except TensorParallelError:
            self.shutdown()
            raise
        except Exception as e:
            self.shutdown()
            raise TensorParallelError(f"tensor-parallel workers did not start: {self._first_error() or e}") from e
        self.group = TPGroup(0, spec.size, dist.group.WORLD.group_name,
                             segments[0].tensor if segments[0] is not None else None, list(segments))

    def _await_bootstrap(self, started) -> None:
        """Wait until every worker has imported the main module and entered ``_worker_main``, watching
        them: one that exits first (a script without the main guard, or whose import fails) is an
        error now, not after the process group's timeout."""
        deadline = time.monotonic() + tp_timeout_s()
        waiting = len(self.procs)
        while waiting:
            if started.acquire(timeout=0.05):
                waiting -= 1
                continue
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                p = dead[0]
                if p.exitcode == MAIN_NOT_GUARDED_EXIT:
                    raise TensorParallelError(
                        f"tensor-parallel worker {p.name} could not start: the main module creates the LLM when "
                        f"it is imported. {_GUARD_ADVICE.format(main=_main_module())}")
                raise TensorParallelError(
                    f"tensor-parallel worker {p.name} exited (exit code {p.exitcode}) before it started, while "
                    f"importing the main module ({_main_module()}) or its arguments: see its error above")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {tp_timeout_s():.0f} s "
                                          f"(QWEN_OPS_TP_TIMEOUT_S): {waiting} still importing the main module")

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
            if self.channel is not None:
                self.channel.send(message, alive=self.check_alive)
            else:
                dist.broadcast_object_list([message], src=0)
        except TensorParallelError:
            raise
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
                if self.channel is not None:
                    self.channel.send(("stop", []))
                else:
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
        for seg in self.segments:
            seg.close()


def start_workers(path, *, size: int, dtype, device: torch.device, engine_kwargs: dict, build_runner: Callable,
                  port: Optional[int] = None) -> TPWorkers:
    """Spawn ranks 1..size-1 and join them as rank 0 (the caller loads its own slice after)."""
    import torch.distributed as dist

    assert_not_bootstrapping()
    assert_main_guarded()
    if dist.is_initialized():
        raise ValueError("tensor_parallel_size > 1 in-process needs a fresh process: torch.distributed is "
                         "already initialized here (under torchrun, every rank calls the same LLM(...))")
    check_devices(size, device)
    if port is None:
        port = free_port()
    else:
        check_port_free(port)
    spec = WorkerSpec(str(path), dtype, str(device), dict(engine_kwargs), build_runner, port, size,
                      threads=torch.get_num_threads())
    segments: list[Optional[SharedSegment]] = [None, None]
    if device.type == "cpu" and shm_supported():
        from qwen_ops.models.config import QwenConfig
        from qwen_ops.ops.shm_collectives import workspace_bytes

        config = QwenConfig.from_pretrained(path)
        elem = max(4, torch.empty((), dtype=dtype).element_size())
        slot = workspace_slot_bytes(config, engine_kwargs.get("max_slots", 8), engine_kwargs.get("chunk_size", 512),
                                    size, elem)
        segments = [SharedSegment(workspace_bytes(size, slot)), SharedSegment(8 << 20)]
        spec.workspace = (segments[0].name, segments[0].size)
        spec.channel = (segments[1].name, segments[1].size)
    try:
        return TPWorkers(spec, segments)
    except BaseException:
        for seg in segments:
            if seg is not None:
                seg.close()
        raise


def init_external(device: torch.device, config=None, engine_kwargs: Optional[dict] = None,
                  dtype: torch.dtype = torch.float32) -> TPGroup:
    """Join the process group that torchrun set up (``env://``): this rank's ``TPGroup``. When
    every rank runs on this host (``LOCAL_WORLD_SIZE == WORLD_SIZE``) on the CPU, rank 0 makes
    the shared-memory workspace of the collectives and the others map it."""
    import torch.distributed as dist

    rank, size = external_launch()
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        init_group(device, "env://")
        atexit.register(_leave_external_group)
    workspace = None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == size
    if device.type == "cpu" and local and shm_supported() and config is not None:
        from qwen_ops.ops.shm_collectives import workspace_bytes

        kw = engine_kwargs or {}
        slot = workspace_slot_bytes(config, kw.get("max_slots", 8), kw.get("chunk_size", 512), size,
                                    max(4, torch.empty((), dtype=dtype).element_size()))
        nbytes = workspace_bytes(size, slot)
        segment = SharedSegment(nbytes) if rank == 0 else None
        box = [segment.name if segment is not None else None]
        dist.broadcast_object_list(box, src=0)
        if segment is None:
            segment = SharedSegment(nbytes, box[0])
        dist.barrier()
        if rank == 0:
            segment.close()            # every rank has it mapped: the name is no longer needed
        return TPGroup(rank, size, dist.group.WORLD.group_name, segment.tensor, segment)
    return TPGroup(rank, size, dist.group.WORLD.group_name, workspace)


def _leave_external_group() -> None:
    """At exit under torchrun: meet the other ranks, then free the process group.

    Freeing it here, while the interpreter still runs, joins gloo's worker threads. They release
    a finished collective's tensors after its caller has moved on, and on torch 2.13 dropping a
    tensor's last C++ reference takes the GIL (to release its Python object); a thread that asks
    for the GIL once the interpreter is finalizing is ended by ``pthread_exit``, whose unwinding
    through gloo's noexcept work destructor calls ``std::terminate`` (SIGABRT, "terminate called
    without an active exception"). ``TPGroup`` holds the group's name, not the group, and
    ``init_group`` imports dynamo first, so that ``destroy_process_group`` drops the last
    reference.

    If the meeting fails (a peer died, or did not come within ``tp_timeout_s()``), this rank exits
    with status 1 at once, naming the cause: had it exited 0, its torchrun agent would wait 300 s
    (the agent's exit barrier, which torchrun has no flag for) for the node whose rank failed. A
    rank whose script raised skips the meeting (its peers may be inside another collective) and
    closes its sockets, so that the others fail at once too."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    if getattr(sys, "last_value", None) is None:          # set when the script ended by an uncaught exception
        try:
            dist.barrier()
        except Exception as e:
            print(f"qwen_ops: rank {rank}: the other tensor-parallel ranks did not meet this one at exit "
                  f"({type(e).__name__}: {e}); a peer rank died or hangs. Exiting with status 1 now, so that "
                  "torchrun stops this node instead of waiting for the failed one.", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)        # the group cannot be left cleanly, and the status must say so
    dist.destroy_process_group()


def broadcast_tokens(tokens: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rank 0's sampled tokens on every rank (external launch: random sampling must not diverge)."""
    import torch.distributed._functional_collectives as funcol

    return tokens.copy_(funcol.broadcast(tokens, 0, tp.group))


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's ``cleanup_dist_env_and_memory`` (its examples call it between two ``LLM``s): leave this
    process's torch.distributed group if one is up, and collect what deleted engines left. An
    ``LLM``'s tensor-parallel workers stop with ``LLM.shutdown()`` (or when it is deleted). ``shutdown_ray``:
    accepted (no Ray here)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
