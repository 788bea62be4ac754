"""Data-parallel serving: N ``AsyncLLM`` replicas, each an engine core in its own process with its
own KV cache and threads, behind one object with ``AsyncLLM``'s interface (vLLM's
``--data-parallel-size``; the server cannot tell it from one engine).

    engine = DataParallelAsyncLLM.from_engine_args(EngineArgs(data_parallel_size=2), threads_per_replica=1)
    async for out in engine.generate("def f(x):", SamplingParams(max_tokens=16)):
        ...

Each request is tokenized and validated here (``prepare_requests``, as ``AsyncLLM`` does), then
``Balancer`` (balancer.py) picks its replica from the tokens in flight on each and the prompt
blocks each was sent; the request streams from that replica, and what comes back updates the
balancer's count. The replica re-tokenizes the prompt (same tokenizer, same ids): routing costs one
more tokenization on the server's side, and the outputs (prompt text included) are the replica's own.

``stats()`` sums the replicas' counters (ratios recomputed) and keeps each replica's own under
``"replicas"`` (``/metrics`` labels them ``engine="i"``, vLLM's label); ``replica_health()`` is
``/health``'s body. ``add_lora`` /
``remove_lora`` go to every replica (and are replayed on one that restarts); pooling requests go
whole to the least-loaded one.

Faults. A supervisor thread looks at every replica each ``check_interval_s`` (0.1 s): a replica
whose process died (its pipe closed: the reader sees it at once) or that has had work and finished
no iteration for ``hang_timeout_s`` (hung: its process is killed) is marked down in the balancer
(no new requests, its prefix set forgotten) and restarted on a thread of its own with the same
arguments and cores; once loaded it is marked up again. A request whose replica fails before the
request has yielded anything is sent again to another replica (seeded and greedy requests give
the same tokens there), so a caller that has received nothing never sees the failure; one that
has received outputs gets ``EngineDeadError`` (the server ends a stream with an error event). The
server asks non-streamed requests for their final output only (``retries_unsent``), so that none
of them has received anything before it finishes. With every replica down, a request waits up to
``restart_wait_s`` for one to come back.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Optional, Sequence

from qwen_ops.engine.lora import LoRARequest
from qwen_ops.engine.sampling import RequestOutputKind, SamplingParams
from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.balancer import DEFAULT_MARGIN_TOKENS, POLICIES, Balancer
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.engine_core import EngineDeadError
from qwen_ops.serving.llm import Prompt, prepare_requests
from qwen_ops.serving.outputs import RequestOutput

__all__ = ["DataParallelAsyncLLM", "merge_stats", "replica_cpus"]

logger = logging.getLogger("qwen_ops.serving")

DEFAULT_HANG_TIMEOUT_S = 60.0      # a replica with work that finishes no iteration for this long is hung
DEFAULT_RESTART_WAIT_S = 120.0     # how long a request waits for a replica when every one is down
CHECK_INTERVAL_S = 0.1             # the supervisor's look at each replica (a death is seen within this)

# stats() ratios, recomputed from the summed counters rather than summed
_RATIOS = ("mean_batch_size", "prefix_cache_hit_rate", "spec_acceptance_rate", "spec_mean_accepted_length")
# what every replica has alike: replica 0's value stands for all
_SHARED = ("block_size", "max_model_len", "dtype", "kv_cache_dtype", "prefix_caching", "speculative_method",
           "max_loras")


def merge_stats(replicas: Sequence[dict]) -> dict:
    """One ``stats()`` of several replicas': numbers summed (list of counts element-wise, lists of
    names joined), ratios recomputed, the rest from replica 0; ``"replicas"``: each one's own."""
    first = replicas[0]
    out: dict = {}
    for key, value in first.items():
        values = [r.get(key) for r in replicas]
        if key in _SHARED or key in _RATIOS:
            out[key] = value
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        elif all(isinstance(v, (list, tuple)) for v in values):
            if all(isinstance(x, (int, float)) for v in values for x in v) and len({len(v) for v in values}) == 1:
                out[key] = [sum(xs) for xs in zip(*values)]
            else:
                out[key] = [x for v in values for x in v]
        else:
            out[key] = value
    iters = out.get("num_iterations", 0)
    if "mean_batch_size" in out:
        out["mean_batch_size"] = (sum(r["mean_batch_size"] * r["num_iterations"] for r in replicas) / iters
                                  if iters else 0.0)
    if "prefix_cache_hit_rate" in out:
        q = out.get("prefix_cache_queries", 0)
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / q if q else 0.0
    if "spec_acceptance_rate" in out:
        d = out.get("spec_num_draft_tokens", 0)
        out["spec_acceptance_rate"] = out.get("spec_num_accepted_tokens", 0) / d if d else 0.0
        steps = out.get("spec_num_drafts", 0)
        out["spec_mean_accepted_length"] = out.get("spec_num_emitted_tokens", 0) / steps if steps else 0.0
    out["replicas"] = [dict(r) for r in replicas]
    return out


def replica_cpus(num_replicas: int, threads_per_replica: int,
                 usable: Optional[Sequence[int]] = None) -> list[Optional[list[int]]]:
    """The CPUs each replica is pinned to: distinct runs of ``threads_per_replica`` of the usable
    ones, or None each (not pinned) where there are too few to give every replica its own."""
    if usable is None:
        usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    usable = list(usable)
    if len(usable) < num_replicas * threads_per_replica:
        return [None] * num_replicas
    return [usable[i * threads_per_replica:(i + 1) * threads_per_replica] for i in range(num_replicas)]


class DataParallelAsyncLLM:
    """``replicas`` (started ``AsyncLLM``s of one model) behind one ``AsyncLLM``-like front.
    ``restart``: builds replica ``i`` again after it dies or hangs (None: a failed replica stays
    down; ``from_engine_args`` gives one that starts it with its arguments and cores)."""

    #: non-streamed requests may be retried on another replica if they ask for their final output only
    retries_unsent = True

    def __init__(self, replicas: Sequence[AsyncLLM], *, margin_tokens: int = DEFAULT_MARGIN_TOKENS,
                 policy: str = "cache_aware", restart: Optional[Callable[[int], AsyncLLM]] = None,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, restart_wait_s: float = DEFAULT_RESTART_WAIT_S):
        if not replicas or not all(isinstance(r, AsyncLLM) for r in replicas):
            raise ValueError(f"replicas = {replicas!r}, expected a non-empty list of AsyncLLM")
        for name, value in (("hang_timeout_s", hang_timeout_s), ("restart_wait_s", restart_wait_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} = {value!r}, expected a number of seconds > 0")
        self.replicas = list(replicas)
        first = self.replicas[0]
        st = first.stats()
        self.balancer = Balancer(len(self.replicas), block_size=int(st["block_size"]),
                                 cache_blocks=max(1, int(st["total_blocks"])), margin_tokens=margin_tokens,
                                 prefix_affinity=bool(st.get("prefix_caching")), policy=policy)
        self._lock = threading.Lock()              # the balancer, _where, _state (generate may run on several loops)
        self._where: dict[str, int] = {}           # request id -> replica, while it streams
        self._ids = itertools.count()
        self._restart = restart
        self.hang_timeout_s = float(hang_timeout_s)
        self.restart_wait_s = float(restart_wait_s)
        self._state = ["running"] * len(self.replicas)      # running | restarting | failed
        self._failure: list[Optional[str]] = [None] * len(self.replicas)   # why each last went down
        self.num_restarts = [0] * len(self.replicas)
        self.num_retried = 0                       # requests sent again after their replica failed
        self._loras: dict[int, LoRARequest] = {}   # adapters added, replayed on a restarted replica
        self._closed = threading.Event()
        # At interpreter exit the replicas' processes are stopped (their finalizers): no restarts then.
        # atexit runs this before weakref.finalize's own exit hook (registered earlier, run later).
        atexit.register(self._closed.set)
        for name in ("tokenizer", "tokenizer_path", "vocab_size", "max_model_len", "model_path", "weights",
                     "eos_token_ids", "sampling_overrides", "max_loras", "runner", "pooler", "hidden_size",
                     "classifier", "max_waiting_requests"):
            setattr(self, name, getattr(first, name))
        self._supervisor = threading.Thread(target=self._supervise, name="qwen-ops-dp-supervisor", daemon=True)
        self._supervisor.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, threads_per_replica: Optional[int] = None,
                         max_waiting_requests: Optional[int] = None,
                         margin_tokens: int = DEFAULT_MARGIN_TOKENS, policy: str = "cache_aware",
                         hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                         restart_wait_s: float = DEFAULT_RESTART_WAIT_S) -> "DataParallelAsyncLLM":
        """``engine_args.data_parallel_size`` replicas of ``engine_args``'s engine, started together,
        each with ``threads_per_replica`` torch threads (None: the usable cores divided among them,
        at least 1), pinned to cores of its own where the machine has enough.
        ``max_waiting_requests`` bounds each replica's queue. A replica that dies or hangs is
        restarted with the same arguments and cores. ``policy``: the balancer's (``POLICIES``)."""
        engine_args.validate()
        if policy not in POLICIES:                 # before any process starts
            raise ValueError(f"policy = {policy!r}, expected one of {', '.join(map(repr, POLICIES))}")
        size = engine_args.data_parallel_size
        usable = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else list(range(os.cpu_count() or 1)))
        if threads_per_replica is None:
            threads_per_replica = max(1, len(usable) // size)
        elif isinstance(threads_per_replica, bool) or not isinstance(threads_per_replica, int) \
                or threads_per_replica < 1:
            raise ValueError(f"threads_per_replica = {threads_per_replica!r}, expected an int >= 1 or None")
        one = EngineArgs(engine_args.model, **{**engine_args.llm_kwargs(), "data_parallel_size": 1})
        cpus = replica_cpus(size, threads_per_replica, usable)

        def start(i: int) -> AsyncLLM:
            return AsyncLLM.from_engine_args(one, max_waiting_requests=max_waiting_requests,
                                             num_threads=threads_per_replica, cpus=cpus[i])

        with ThreadPoolExecutor(size, thread_name_prefix="qwen-ops-dp-start") as pool:
            futures = [pool.submit(start, i) for i in range(size)]
            started, error = [], None
            for f in futures:
                try:
                    started.append(f.result())
                except BaseException as e:          # noqa: BLE001 - the first failure is raised below
                    error = error or e
        if error is not None:
            for r in started:
                r.shutdown()
            raise error
        return cls(started, margin_tokens=margin_tokens, policy=policy, restart=start, hang_timeout_s=hang_timeout_s,
                   restart_wait_s=restart_wait_s)

    # ------------------------------------------------------------------ faults
    def _supervise(self) -> None:
        """The supervisor thread: mark a dead or hung replica down and restart it (module docstring)."""
        while not self._closed.wait(CHECK_INTERVAL_S):
            for i, r in enumerate(list(self.replicas)):
                if self._state[i] != "running":
                    continue
                if not r.is_running:
                    why = f"died ({r.dead_reason})" if r.dead_reason else "stopped"
                elif r.heartbeat_age() > self.hang_timeout_s:
                    why = f"hung (no iteration for {r.heartbeat_age():.1f} s with work; hang_timeout_s = " \
                          f"{self.hang_timeout_s:g})"
                else:
                    continue
                self._fail(i, r, why)

    def _fail(self, i: int, replica: AsyncLLM, why: str) -> None:
        with self._lock:
            if self._state[i] != "running" or self.replicas[i] is not replica:
                return
            self.balancer.mark_down(i)
            self._state[i] = "restarting" if self._restart is not None else "failed"
            self._failure[i] = why
        logger.error("data-parallel replica %d %s; %s", i, why,
                     "restarting it" if self._restart is not None else "no restart was configured")
        threading.Thread(target=self._replace, args=(i, replica), name=f"qwen-ops-dp-restart-{i}",
                         daemon=True).start()

    def _replace(self, i: int, old: AsyncLLM) -> None:
        """Stop ``old`` (killing its process if it does not exit at once: its requests fail and are
        retried elsewhere), then start replica ``i`` again, retrying every few seconds until it loads
        or the front is shut down."""
        try:
            old.shutdown(timeout=1.0)
        except Exception:                          # noqa: BLE001 - it is being replaced either way
            logger.debug("shutting down replica %d failed", i, exc_info=True)
        if self._restart is None:
            return
        delay = 1.0
        while not self._closed.is_set():
            try:
                new = self._restart(i)
                for lora in list(self._loras.values()):
                    new._core.add_lora(lora).result()      # the adapters the others hold, before any request
            except BaseException as e:             # noqa: BLE001 - logged; tried again
                logger.error("restarting data-parallel replica %d failed: %s; trying again in %g s", i, e, delay)
                if self._closed.wait(delay):
                    return
                delay = min(delay * 2, 30.0)
                continue
            with self._lock:
                if self._closed.is_set():
                    new.shutdown()
                    return
                self.replicas[i] = new
                self._state[i] = "running"
                self.num_restarts[i] += 1
                self.balancer.mark_up(i)
            logger.warning("data-parallel replica %d is back (restart %d)", i, self.num_restarts[i])
            return

    # ------------------------------------------------------------------ AsyncLLM's interface
    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def is_running(self) -> bool:
        """True while any replica runs or is being restarted (requests wait for it)."""
        return not self._closed.is_set() and any(s != "failed" for s in self._state)

    @property
    def dead_reason(self) -> Optional[BaseException]:
        if self.is_running:
            return None
        if self._closed.is_set():
            return EngineDeadError("the data-parallel front was shut down")
        return EngineDeadError("every data-parallel replica failed: " + "; ".join(
            f"replica {i} {why}" for i, why in enumerate(self._failure)))

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    def heartbeat_age(self) -> float:
        """The smallest of the running replicas' (the server is stalled only if all of them are; a
        hung replica is restarted by the supervisor)."""
        ages = [r.heartbeat_age() for i, r in enumerate(self.replicas) if self._state[i] == "running"]
        return min(ages) if ages else 0.0

    def replica_health(self) -> list[dict]:
        """Each replica's state for ``/health``: running / restarting / failed, seconds without an
        iteration while it has work, the tokens the balancer counts in flight there, its restarts
        and why it last went down."""
        with self._lock:
            loads = self.balancer.loads()
            states = list(self._state)
        return [{"engine": i, "state": states[i], "running": states[i] == "running" and r.is_running, "pid": r.pid,
                 "heartbeat_age_s": round(r.heartbeat_age(), 3), "load_tokens": loads[i],
                 "restarts": self.num_restarts[i], "last_failure": self._failure[i]}
                for i, r in enumerate(self.replicas)]

    def replica_of(self, request_id: str) -> Optional[int]:
        """The replica a streaming request runs on (None once it has ended)."""
        with self._lock:
            return self._where.get(request_id)

    async def generate(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate`` on the replica the balancer picks; sent again to another one if its
        replica fails before it has yielded anything (module docstring)."""
        if not self.is_running:
            raise EngineDeadError("no data-parallel replica is running" + (f" ({self.dead_reason})"
                                                                           if self.dead_reason else ""))
        params = sampling_params or SamplingParams()
        ((_, ids, checked),) = prepare_requests([prompt], [params], tokenizer=self.tokenizer,
                                                vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if request_id is None:
            request_id = f"dp-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id = {request_id!r}, expected a non-empty str or None")
        with self._lock:
            if request_id in self._where:
                raise ValueError(f"request_id = {request_id!r} is already in flight; expected a new id")
            self._where[request_id] = -1
        delta = checked.output_kind == RequestOutputKind.DELTA
        failed: list[AsyncLLM] = []                # replicas this request failed on (not tried again)
        yielded = False
        try:
            while True:
                ticket, replica = await self._assign(ids, checked, failed)
                with self._lock:
                    self._where[request_id] = ticket.replica
                generated = 0
                try:
                    async for out in replica.generate(prompt, params, request_id, lora_request):
                        new = sum(len(c.token_ids) for c in out.outputs)
                        generated = generated + new if delta else new
                        with self._lock:
                            self.balancer.update(ticket, generated)
                        yielded = True
                        yield out
                    return
                except EngineDeadError as e:
                    if yielded or self._closed.is_set():
                        raise EngineDeadError(f"data-parallel replica {ticket.replica} failed while request "
                                              f"{request_id!r} ran ({e}); the request can be sent again") from e
                    failed.append(replica)
                    with self._lock:
                        self.num_retried += 1
                    logger.warning("request %s: replica %d failed before its first output (%s); sending it "
                                   "to another replica", request_id, ticket.replica, e)
                finally:
                    with self._lock:
                        self.balancer.release(ticket)
        finally:
            with self._lock:
                self._where.pop(request_id, None)

    async def _assign(self, ids: list[int], checked: SamplingParams, failed: Sequence[AsyncLLM]):
        """The balancer's ticket and replica for a request, among the replicas that are up and not
        one it ``failed`` on (``_when_up``)."""
        def pick(exclude: list[int]):
            ticket = self.balancer.assign(ids, checked.max_new_tokens, checked.n, exclude=exclude)
            return ticket, self.replicas[ticket.replica]

        return await self._when_up(pick, failed)

    async def _when_up(self, pick, failed: Sequence[AsyncLLM]):
        """``pick(exclude)`` under the lock, ``exclude`` the indices of the replicas in ``failed``;
        while it finds none up (``LookupError``), wait for a restart, up to ``restart_wait_s``."""
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            with self._lock:
                exclude = [i for i, r in enumerate(self.replicas) if any(r is f for f in failed)]
                try:
                    return pick(exclude)
                except LookupError:
                    pass
            if not self.is_running or time.monotonic() > deadline:
                raise EngineDeadError(f"no data-parallel replica came back within restart_wait_s = "
                                      f"{self.restart_wait_s:g} s" + (f" ({self.dead_reason})"
                                                                      if self.dead_reason else ""))
            await asyncio.sleep(CHECK_INTERVAL_S)

    def abort(self, request_id: str) -> None:
        replica = self.replica_of(request_id)
        if replica is not None and replica >= 0:
            self.replicas[replica].abort(request_id)

    async def _on_least_loaded(self, call):
        """``await call(replica)`` on the least-loaded replica that is up (pooling requests go whole to
        one); again on another if that one fails (a pooling request returns nothing until it is done)."""
        failed: list[AsyncLLM] = []
        while True:
            replica = await self._when_up(lambda exclude: self.replicas[self.balancer.choose((), exclude)[0]],
                                          failed)
            try:
                return await call(replica)
            except EngineDeadError:
                if self._closed.is_set():
                    raise
                failed.append(replica)
                with self._lock:
                    self.num_retried += 1

    async def encode(self, prompts, tasks):
        return await self._on_least_loaded(lambda r: r.encode(prompts, tasks))

    async def embed(self, prompts, pooling_params=None):
        return await self._on_least_loaded(lambda r: r.embed(prompts, pooling_params))

    async def score(self, text_1, text_2):
        return await self._on_least_loaded(lambda r: r.score(text_1, text_2))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """On every replica, or on none (a replica that fails it has it removed from those that took
        it); kept to be added again to a replica that restarts."""
        done: list[AsyncLLM] = []
        results = []
        try:
            for r in list(self.replicas):
                results.append(await r.add_lora(lora_request))
                done.append(r)
        except BaseException:
            for r in done:                         # all or none: take it back from those that took it
                try:
                    await r.remove_lora(lora_request.lora_int_id)
                except Exception:                  # noqa: BLE001 - the first error is the one raised
                    logger.debug("remove_lora after a failed add_lora failed", exc_info=True)
            raise
        self._loras[lora_request.lora_int_id] = lora_request
        return all(results)

    async def remove_lora(self, lora_id: int) -> bool:
        results = [await r.remove_lora(lora_id) for r in list(self.replicas)]
        self._loras.pop(lora_id, None)
        return any(results)

    def stats(self) -> dict:
        """The replicas' stats merged (``merge_stats``), each replica's with its ``restarts`` and
        ``up`` (1 while it takes requests), and ``requests_retried`` (sent again after a failure)."""
        with self._lock:
            faults = [{"restarts": self.num_restarts[i], "up": int(self._state[i] == "running")}
                      for i in range(len(self.replicas))]
            retried = self.num_retried
        out = merge_stats([{**r.stats(), **f} for r, f in zip(self.replicas, faults)])
        out["requests_retried"] = retried
        return out

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed.set()
        atexit.unregister(self._closed.set)
        for r in list(self.replicas):
            r.shutdown(timeout)

    def __enter__(self) -> "DataParallelAsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class OfflineDataParallel:
    """``LLM(data_parallel_size=N)``'s engines: a ``DataParallelAsyncLLM`` of N engine-core
    processes, driven from the caller's thread through an event loop on a thread of its own.
    ``generate`` sends every request at once and returns the final outputs in prompt order: the
    balancer spreads them (load and shared prefixes), and a replica that fails loses none of them
    (each yields only its final output, so every one can be sent again)."""

    def __init__(self, engine_args: EngineArgs):
        self.engine = DataParallelAsyncLLM.from_engine_args(engine_args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="qwen-ops-dp-offline", daemon=True)
        self._thread.start()

    def run(self, coro):
        """Run ``coro`` on the loop and wait for it (KeyboardInterrupt cancels it: its requests are aborted)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def generate(self, prepared: Sequence[tuple], loras: Optional[Sequence[Optional[LoRARequest]]],
                 use_tqdm) -> list[RequestOutput]:
        """The finished ``RequestOutput`` of each ``(prompt, ids, params)`` (validated by ``LLM``), in order."""
        bar = None
        if use_tqdm:
            factory = use_tqdm if callable(use_tqdm) and not isinstance(use_tqdm, bool) else None
            if factory is None:
                from tqdm.auto import tqdm as factory
            bar = factory(total=len(prepared), desc="Processed prompts", dynamic_ncols=True)

        async def one(prompt, ids, params, lora) -> RequestOutput:
            final = None
            # the ids LLM already made (the replica need not tokenize again); the prompt's text put back
            async for final in self.engine.generate({"prompt_token_ids": ids}, _final_only(params), lora_request=lora):
                pass
            final.prompt = prompt if isinstance(prompt, str) else (
                prompt.get("prompt") if isinstance(prompt, dict) else None)
            if bar is not None:
                bar.update(1)
            return final

        async def every() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(one(p, ids, params, None if loras is None else loras[i]))
                     for i, (p, ids, params) in enumerate(prepared)]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()

        try:
            return self.run(every())
        finally:
            if bar is not None:
                bar.close()

    def encode(self, ids: list[list[int]], tasks) -> list:
        return self.run(self.engine.encode(ids, tasks))

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _final_only(params: SamplingParams) -> SamplingParams:
    """A copy of ``params`` that yields only the final output."""
    out = params.clone()
    out.output_kind = RequestOutputKind.FINAL_ONLY
    return out
