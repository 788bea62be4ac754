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
``remove_lora`` go to every replica; pooling requests go whole to the least-loaded one.

Not yet (issue 63 item 2): a replica that dies takes the server down with it (``is_running`` is
False once any replica stops), as one engine's death does.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional, Sequence

from qwen_ops.engine.lora import LoRARequest
from qwen_ops.engine.sampling import RequestOutputKind, SamplingParams
from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.balancer import DEFAULT_MARGIN_TOKENS, Balancer
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.engine_core import EngineDeadError
from qwen_ops.serving.llm import Prompt, prepare_requests
from qwen_ops.serving.outputs import RequestOutput

__all__ = ["DataParallelAsyncLLM", "merge_stats", "replica_cpus"]

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
    """``replicas`` (started ``AsyncLLM``s of one model) behind one ``AsyncLLM``-like front."""

    def __init__(self, replicas: Sequence[AsyncLLM], *, margin_tokens: int = DEFAULT_MARGIN_TOKENS):
        if not replicas or not all(isinstance(r, AsyncLLM) for r in replicas):
            raise ValueError(f"replicas = {replicas!r}, expected a non-empty list of AsyncLLM")
        self.replicas = list(replicas)
        first = self.replicas[0]
        st = first.stats()
        self.balancer = Balancer(len(self.replicas), block_size=int(st["block_size"]),
                                 cache_blocks=max(1, int(st["total_blocks"])), margin_tokens=margin_tokens,
                                 prefix_affinity=bool(st.get("prefix_caching")))
        self._lock = threading.Lock()              # the balancer and _where (generate may run on several loops)
        self._where: dict[str, int] = {}           # request id -> replica, while it streams
        self._ids = itertools.count()
        for name in ("tokenizer", "tokenizer_path", "vocab_size", "max_model_len", "model_path", "weights",
                     "eos_token_ids", "sampling_overrides", "max_loras", "runner", "pooler", "hidden_size",
                     "classifier", "max_waiting_requests"):
            setattr(self, name, getattr(first, name))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, threads_per_replica: Optional[int] = None,
                         max_waiting_requests: Optional[int] = None,
                         margin_tokens: int = DEFAULT_MARGIN_TOKENS) -> "DataParallelAsyncLLM":
        """``engine_args.data_parallel_size`` replicas of ``engine_args``'s engine, started together,
        each with ``threads_per_replica`` torch threads (None: the usable cores divided among them,
        at least 1), pinned to cores of its own where the machine has enough.
        ``max_waiting_requests`` bounds each replica's queue."""
        engine_args.validate()
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
        with ThreadPoolExecutor(size, thread_name_prefix="qwen-ops-dp-start") as pool:
            futures = [pool.submit(AsyncLLM.from_engine_args, one, max_waiting_requests=max_waiting_requests,
                                   num_threads=threads_per_replica, cpus=cpus[i]) for i in range(size)]
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
        return cls(started, margin_tokens=margin_tokens)

    # ------------------------------------------------------------------ AsyncLLM's interface
    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def dead_reason(self) -> Optional[BaseException]:
        for i, r in enumerate(self.replicas):
            if r.dead_reason is not None:
                return EngineDeadError(f"replica {i}: {r.dead_reason}")
        return None

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    def heartbeat_age(self) -> float:
        return max(r.heartbeat_age() for r in self.replicas)

    def replica_health(self) -> list[dict]:
        """Each replica's state for ``/health``: running, seconds without an iteration while it has work,
        and the tokens the balancer counts in flight there."""
        with self._lock:
            loads = self.balancer.loads()
        return [{"engine": i, "running": r.is_running, "heartbeat_age_s": round(r.heartbeat_age(), 3),
                 "load_tokens": loads[i]} for i, r in enumerate(self.replicas)]

    def replica_of(self, request_id: str) -> Optional[int]:
        """The replica a streaming request runs on (None once it has ended)."""
        with self._lock:
            return self._where.get(request_id)

    async def generate(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate`` on the replica the balancer picks."""
        if not self.is_running:
            raise EngineDeadError("a data-parallel replica is not running" + (f" ({self.dead_reason})"
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
            ticket = self.balancer.assign(ids, checked.max_new_tokens, checked.n)
            self._where[request_id] = ticket.replica
        delta = checked.output_kind == RequestOutputKind.DELTA
        generated = 0
        try:
            async for out in self.replicas[ticket.replica].generate(prompt, params, request_id, lora_request):
                new = sum(len(c.token_ids) for c in out.outputs)
                generated = generated + new if delta else new
                with self._lock:
                    self.balancer.update(ticket, generated)
                yield out
        finally:
            with self._lock:
                self.balancer.release(ticket)
                self._where.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        replica = self.replica_of(request_id)
        if replica is not None:
            self.replicas[replica].abort(request_id)

    def _least_loaded(self) -> AsyncLLM:
        with self._lock:
            return self.replicas[self.balancer.choose(())[0]]

    async def encode(self, prompts, tasks):
        return await self._least_loaded().encode(prompts, tasks)

    async def embed(self, prompts, pooling_params=None):
        return await self._least_loaded().embed(prompts, pooling_params)

    async def score(self, text_1, text_2):
        return await self._least_loaded().score(text_1, text_2)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        results = [await r.add_lora(lora_request) for r in self.replicas]
        return all(results)

    async def remove_lora(self, lora_id: int) -> bool:
        results = [await r.remove_lora(lora_id) for r in self.replicas]
        return any(results)

    def stats(self) -> dict:
        return merge_stats([r.stats() for r in self.replicas])

    def shutdown(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    def __enter__(self) -> "DataParallelAsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
