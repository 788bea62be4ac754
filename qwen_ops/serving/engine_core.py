"""The engine core (``EngineCore``: one step = schedule, execute + sample, update, outputs) and
the loops that drive it for ``AsyncLLM`` with messages (add, abort, step), which report each
iteration as compact per-request deltas. ``LLM`` is the other client of the same core.

The loop runs in one of two places, behind the same interface (``add``, ``abort``, ``stats``,
``shutdown``; deltas go to a ``deliver`` callback):

- ``ThreadCore``: a thread of the caller's process (``AsyncLLM(llm)``, an ``LLM`` you built).
- ``ProcessCore``: a child process of its own (``AsyncLLM.from_pretrained``, the default, as
  vLLM's V1 engine core). The model's steps then hold no GIL that the server's event loop
  wants, and the event loop's HTTP and JSON work takes none from the steps: on a 2-core
  machine the two run side by side instead of taking turns (a GIL handoff after each torch op
  can wait for a whole switch interval, 5 ms, while the other thread runs Python).

The child is a fresh interpreter (``subprocess``, not fork: the parent has threads), loads the
model itself, and talks over one socket pair (``multiprocessing.connection``): requests go in as ``(id, token ids, SamplingParams, LoRARequest or None)`` (the
caller validated and tokenized them), ``RequestDelta`` lists come out, one message per
iteration, with the engine's ``stats()``; ``add_lora`` / ``remove_lora`` go in with a call id
and come back as a ``reply`` of that id. Text is detokenized in the core, where stop strings
must be found. The child exits when the pipe closes (the parent shut down or died), ignores
SIGINT (the parent decides when to stop), and a child that dies fails every open stream with
``EngineDeadError`` within one read.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from qwen_ops.engine.batch import RequestId
from qwen_ops.engine.engine import QwenEngine
from qwen_ops.engine.sampling import MAX_LOGPROBS, SamplingParams
from qwen_ops.engine.speculative import SpeculativeConfig
from qwen_ops.engine.structured import GrammarBackend
from qwen_ops.serving.outputs import OutputProcessor, RequestDelta, RequestState
from qwen_ops.engine.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

Deliver = Callable[[Sequence[RequestDelta]], None]
# How often an idle engine loop looks at the grammars compiling beside it (seconds).
GRAMMAR_POLL_S = 0.005
# vLLM's buckets of iteration_tokens_total (tokens per engine step); the last bucket is +Inf.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Seconds the parent waits for the child to load its model, and for it to exit on shutdown.
DEFAULT_START_TIMEOUT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 10.0
# A pooling request's sampling (never used: it samples nothing; Request wants one).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0).read_only()


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (``shutdown`` or a failure it cannot recover from)."""


class EngineCore:
    """The engine core: one step is schedule, then execute and sample (the runner), then update
    (the scheduler: KV counts, tokens, the finish check), then the output processor (text, stop
    strings, what changed). ``LLM`` drives it directly; ``AsyncLLM``'s loop (a thread, or a
    child process) drives it with messages (``add``, ``abort``, ``step_deltas``).

    Every public method holds one lock, so threads may share a core: their requests share steps,
    and each caller gets exactly its own outputs."""

    def __init__(self, engine: QwenEngine, config: SchedulerConfig,
                 speculative_config: Optional[SpeculativeConfig] = None):
        self.engine = engine
        self.speculative_config = speculative_config
        # The engine's scheduler (it owns the KV-cache manager), given this core's serving policy.
        self.scheduler = engine.scheduler
        self.scheduler.configure(config, proposer=speculative_config.proposer() if speculative_config else None,
                                 disable_by_batch_size=speculative_config.disable_by_batch_size
                                 if speculative_config else None, lora=engine.lora)
        self.outputs = OutputProcessor(engine.tokenizer)
        self.lock = threading.RLock()
        self._next_id = 0                # scheduler request ids
        self._next_state = 0             # default caller ids
        self.owned: set[str] = set()     # ids added by messages (add) and not yet finished or aborted
        self.num_added = 0               # completions added by messages: what a parent's waiting count holds
        self._grammars = None            # structured outputs' GrammarBackend (grammar_backend)
        # Requests whose grammar compiles on the backend's thread (``add``): (state, its scheduler
        # requests, the compile's future, deadline); they wait held while every other request runs.
        self._compiling: list[tuple] = []
        self._failed: list[RequestDelta] = []       # their error deltas, for the next step_deltas
        self._backend_lock = threading.Lock()       # the backend is built once, by whichever thread asks first
        self._backend_job: Optional[Future] = None  # its building, off the engine loop (_grammar_job)
        self.max_grammar_compile_s: Optional[float] = None   # past it a compile fails its request
        self._lora_pool: Optional[ThreadPoolExecutor] = None    # parses LoRA adapters off the loop (_lora_job)
        # Tokens per iteration (vLLM's iteration_tokens_total histogram): counts per bucket, and the sum.
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        # Pooling requests added by messages (add_pooling), by caller id, until their embedding is delivered.
        self._pooling: dict[str, object] = {}
        self.max_logprobs = MAX_LOGPROBS        # LLM(max_logprobs=...) lowers it (vLLM's engine argument)

    # ------------------------------------------------------------------ requests
    def add_requests(self, prepared: Sequence[tuple], request_ids: Optional[Sequence[Optional[str]]] = None,
                     compile_async: bool = False, lora_requests: Optional[Sequence] = None) -> list[RequestState]:
        """Queue every prepared ``(prompt, ids, params)`` (``n`` scheduler requests each), or none: a
        failure part-way aborts the ones already queued. ``request_ids``: the callers' ids
        (default: counters). ``lora_requests``: each one's LoRA adapter (``LoRARequest`` or None),
        parsed like a grammar compiles: here, or on a thread of its own while the request waits held.

        Structured outputs' grammars are compiled outside the core's lock: here, in the caller's
        thread, before anything is queued (``LLM``: a bad spec raises ValueError), or with
        ``compile_async`` on the grammar backend's thread while the request waits held (the
        engine loop's ``add``: every other request keeps running; a failure or a compile past
        ``max_grammar_compile_s`` fails this request alone, ``_release_grammars``)."""
        if self.engine.runner.pooling:
            raise ValueError("this engine runs the pooling runner (an embedding model); it generates nothing, "
                             "expected a generation model (runner='generate')")
        for i, (_, _, sp) in enumerate(prepared):       # vLLM's engine argument max_logprobs bounds every request
            for name in ("logprobs", "prompt_logprobs"):
                asked = getattr(sp, name)
                if asked is not None and asked > self.max_logprobs:
                    raise ValueError(f"{name} = {asked} (request {i}), but this engine's max_logprobs = "
                                     f"{self.max_logprobs}; expected at most that")
        loras = list(lora_requests) if lora_requests is not None else [None] * len(prepared)   # one each (LLM._loras)
        if any(lr is not None for lr in loras) and self.engine.lora is None:
            raise ValueError("lora_request was given, but LoRA is not enabled; expected LLM(enable_lora=True) "
                             "(served: --enable-lora) or no lora_request")
        if not compile_async:
            for _, _, sp in prepared:
                if sp.structured_outputs is not None:
                    self.grammar_backend().compile(sp.structured_outputs)      # cached: the matchers below hit
            for lr in loras:
                if lr is not None:
                    self.engine.lora.prepare(lr)      # a bad adapter raises here (LoRAError: a ValueError)
        states: list[RequestState] = []
        with self.lock:
            try:
                for k, (prompt, ids, sp) in enumerate(prepared):
                    sid = request_ids[k] if request_ids is not None and request_ids[k] is not None else None
                    if sid is None:
                        sid = str(self._next_state)
                        self._next_state += 1
                    if sid in self.outputs.states:
                        raise ValueError(f"request_id = {sid!r} is already running; expected a new id")
                    state = RequestState(sid, prompt, ids, sp, lora_request=loras[k])
                    self.outputs.states[sid] = state
                    states.append(state)
                    job = None
                    if sp.structured_outputs is not None:
                        job = self._grammar_job(sp.structured_outputs)
                        if job.done() and job.exception() is not None:
                            raise ValueError(str(job.exception()))
                    if compile_async and loras[k] is not None:
                        job = self._lora_job(loras[k], job)
                    held = job is not None and not job.done()
                    sp.check_stop_ids(self.engine.stop_ids(sp))
                    reqs = []
                    for i in range(sp.n):
                        child = sp.for_completion(i)
                        grammar = (GrammarBackend.matcher_of(job.result()) if job is not None and not held
                                   and sp.structured_outputs is not None else None)
                        rid = RequestId(self._next_id)
                        self._next_id += 1
                        req = self.scheduler.add_request(rid, ids, child, self.engine.stop_ids(child), grammar, held,
                                                         lora_request=loras[k])
                        self.outputs.add(state, req, child)
                        reqs.append(req)
                    if held:
                        limit = self.max_grammar_compile_s if sp.structured_outputs is not None else None
                        self._compiling.append((state, reqs, job, None if limit is None else time.monotonic() + limit))
            except BaseException:
                for st in states:
                    self._abort_state(st)
                raise
        return states

    def add_pooling_requests(self, prompts: Sequence[list[int]], tasks: Sequence) -> list:
        """Queue pooling requests (token ids, and an ``engine/pooling.py`` ``PoolingTask`` each) on
        the pooling runner's scheduler; returns their scheduler ``Request``s, whose ``embedding`` is
        set when they finish (no ``RequestState``: nothing is detokenized or streamed)."""
        if not self.engine.runner.pooling:
            raise ValueError("this engine runs a generation model; embeddings need LLM(..., runner='pooling')")
        with self.lock:
            reqs = []
            for ids, task in zip(prompts, tasks, strict=True):
                rid = RequestId(self._next_id)
                self._next_id += 1
                reqs.append(self.scheduler.add_request(rid, ids, POOLING_SAMPLING, frozenset(), pooling=task))
            return reqs

    def add_pooling(self, request_id: str, ids: list[int], task) -> Optional[RequestDelta]:
        """Queue one pooling request from a message (``AsyncLLM.encode``); ``step_deltas`` reports
        it once, finished, with its ``embedding``. A failure comes back as its error delta."""
        with self.lock:
            self.num_added += 1
            if request_id in self._pooling or request_id in self.outputs.states:
                return RequestDelta(request_id, True, [], error=f"request_id = {request_id!r} is already running; "
                                    "expected a new id")
            try:
                (req,) = self.add_pooling_requests([ids], [task])
            except ValueError as e:
                return RequestDelta(request_id, True, [], error=str(e), bad_request=True)
            self._pooling[request_id] = req
            self.owned.add(request_id)
            return None

    def _pooled_deltas(self) -> list[RequestDelta]:
        """The message-added pooling requests that finished: one delta each with the embedding."""
        done = [(rid, req) for rid, req in self._pooling.items() if req.finished]
        out = []
        for rid, req in done:
            del self._pooling[rid]
            self.owned.discard(rid)
            emb = req.embedding
            if emb is None:                    # aborted in the scheduler (never by its caller: that drops it)
                out.append(RequestDelta(rid, True, [], error="the pooling request was aborted"))
            else:
                out.append(RequestDelta(rid, True, [], embedding=emb.tolist()))
        return out

    def abort_requests(self, requests: Sequence) -> None:
        """Abort scheduler requests that have not finished (pooling requests a caller gave up on)."""
        with self.lock:
            for req in requests:
                if not req.finished:
                    self.scheduler.abort(req.request_id)

    def _release_grammars(self) -> None:
        """Queue the held requests whose grammar has compiled; fail those whose compile failed or
        ran past ``max_grammar_compile_s`` (the compile finishes on its thread and is cached)."""
        now, waiting = time.monotonic(), []
        for entry in self._compiling:
            state, reqs, job, deadline = entry
            if state.aborted or state.finished:
                continue
            if job.done():
                error = job.exception()
                if error is None:
                    for req in reqs:
                        if not req.finished:
                            if state.params.structured_outputs is not None:
                                req.grammar = GrammarBackend.matcher_of(job.result())
                            self.scheduler.release(req)
                    continue
                message = str(error)
            elif deadline is not None and now > deadline:
                kind = state.params.structured_outputs.kind
                message = (f"structured_outputs.{kind} took longer than {self.max_grammar_compile_s:g} s to compile "
                           "(max_grammar_compile_seconds); expected a smaller schema, regex, choice or grammar")
            else:
                waiting.append(entry)
                continue
            self._abort_state(state)
            self.owned.discard(state.request_id)
            self._failed.append(RequestDelta(state.request_id, True, [], error=message, bad_request=True))
        self._compiling = waiting

    def runnable(self) -> bool:
        """Whether a step would do anything now: requests to schedule, or held ones to release or fail."""
        with self.lock:
            s = self.scheduler
            if s.waiting or s.running or s.swapped or self._failed:
                return True
            now = time.monotonic()
            return any(job.done() or (deadline is not None and now > deadline) or state.aborted
                       for state, _, job, deadline in self._compiling)

    def idle_timeout(self) -> Optional[float]:
        """How long an idle loop may sleep: forever (None), or a few ms while grammars compile."""
        return GRAMMAR_POLL_S if self._compiling else None

    def _grammar_job(self, so) -> Future:
        """A future of ``so``'s compiled grammar, compiled on the backend's threads; the backend
        itself (xgrammar's import and the tokenizer's vocabulary: about a second) is built on a
        thread of its own the first time, so that nothing of it runs on the engine loop."""
        backend = self._grammars
        if backend is not None:
            return backend.compile_async(so)
        if self._backend_job is None:
            setup = ThreadPoolExecutor(1, thread_name_prefix="qwen-ops-grammar-setup")
            self._backend_job = setup.submit(self.grammar_backend)
            setup.shutdown(wait=False)
        out: Future = Future()

        def chain(built: Future) -> None:
            try:
                inner = built.result().compile_async(so)
            except BaseException as e:     # noqa: BLE001 - handed to the request that waits
                out.set_exception(e)
                return
            inner.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() is not None
                                    else out.set_result(f.result()))

        self._backend_job.add_done_callback(chain)
        return out

    def _lora_job(self, lora_request, grammar_job: Optional[Future]) -> Future:
        """A future done when ``lora_request``'s adapter is parsed (on a thread of its own, off the
        engine loop) and ``grammar_job`` (if any) has compiled: the grammar's result, or the first error."""
        parsed = self._lora_executor().submit(self.engine.lora.prepare, lora_request)
        if grammar_job is None:
            return parsed
        out: Future = Future()

        def both(_: Future) -> None:
            if not (parsed.done() and grammar_job.done()) or out.done():
                return
            error = parsed.exception() or grammar_job.exception()
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(grammar_job.result())

        parsed.add_done_callback(both)
        grammar_job.add_done_callback(both)
        return out

    def grammar_backend(self):
        """The engine's xgrammar backend (``engine/structured.py``), built on first use (any thread)."""
        with self._backend_lock:
            return self._build_grammar_backend()

    def _build_grammar_backend(self):
        if self._grammars is None:
            if self.engine.tokenizer is None:
                raise ValueError("structured_outputs needs the checkpoint's tokenizer.json, which it does not have")
            self._grammars = GrammarBackend(self.engine.tokenizer, self.engine.vocab_size, self.engine.eos_token_ids)
        return self._grammars

    def add(self, request_id: str, ids: list[int], params: SamplingParams,
            lora_request=None) -> Optional[RequestDelta]:
        """Queue one request from a message; a failure comes back as its (finished) error delta."""
        with self.lock:
            self.num_added += params.n
            try:
                self.add_requests([(None, ids, params)], [request_id], compile_async=True,
                                  lora_requests=[lora_request])
            except ValueError as e:         # a bad grammar the backend knew at once
                return RequestDelta(request_id, True, [], error=str(e), bad_request=True)
            except Exception as e:          # e.g. an id clash with an offline request on the same core
                return RequestDelta(request_id, True, [], error=f"{type(e).__name__}: {e}")
            self.owned.add(request_id)
            return None

    def abort(self, request_id) -> None:
        """Abort a request by its caller id (all its completions), or one completion by its
        scheduler ``RequestId``."""
        with self.lock:
            self.owned.discard(request_id)
            pooled = self._pooling.pop(request_id, None) if isinstance(request_id, str) else None
            if pooled is not None:
                if not pooled.finished:
                    self.scheduler.abort(pooled.request_id)
                return
            state = self.outputs.states.get(str(request_id))
            if state is not None:
                self._abort_state(state)
            elif isinstance(request_id, RequestId):
                self.scheduler.abort(request_id)
                entry = self.outputs.completions.get(request_id)
                if entry is not None:         # one completion of a state: the state counts it out
                    state, comp = entry
                    state.mark_done(comp)
                    state.dirty[comp.state.index] = None
                    if state.finished:
                        self.outputs.forget(state)

    def _abort_state(self, state: RequestState) -> None:
        for c in state.completions:
            if not c.request.finished:
                self.scheduler.abort(c.request.request_id)
            state.mark_done(c)
        state.aborted = True
        self.outputs.forget(state)

    def abort_unfinished(self, states: Sequence[RequestState]) -> None:
        with self.lock:
            for st in states:
                if not st.finished:
                    self._abort_state(st)

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ LoRA adapters (vLLM's add/remove_lora)
    def add_lora_async(self, lora_request) -> Future:
        """A future done when ``lora_request``'s adapter is parsed into host memory, on the LoRA
        thread (never the engine loop): its result True, or the ``LoRAError`` naming the file or field."""
        manager = self.engine.lora
        if manager is None:
            failed: Future = Future()
            failed.set_exception(ValueError("LoRA is not enabled; expected LLM(enable_lora=True) "
                                            "(served: --enable-lora)"))
            return failed
        return self._lora_executor().submit(lambda: manager.prepare(lora_request) is not None)

    def _lora_executor(self) -> ThreadPoolExecutor:
        """The one thread that parses adapters (requests' adapters and ``add_lora``'s), made on first use."""
        if self._lora_pool is None:
            self._lora_pool = ThreadPoolExecutor(1, thread_name_prefix="qwen-ops-lora")
        return self._lora_pool

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (on the engine loop's thread: its slot is cleared). ValueError while any
        unfinished request (running, waiting, held or swapped) names it (the manager's count, kept by
        the scheduler: ``LoRAManager.hold``); False if it was not loaded."""
        with self.lock:
            if self.engine.lora is None:
                raise ValueError("LoRA is not enabled; expected LLM(enable_lora=True) (served: --enable-lora)")
            return self.engine.lora.remove(lora_int_id)

    def _lora_stats(self) -> dict:
        """vLLM's lora_requests_info: the adapters of running and of waiting requests (names, sorted)."""
        if self.engine.lora is None:
            return {"max_loras": None}
        s = self.scheduler
        running = {r.lora_request.lora_name for r in s.running if r.lora_request is not None}
        waiting = {r.lora_request.lora_name for q in (s.waiting, s.held, s.swapped) for r in q
                   if r.lora_request is not None}
        return {"max_loras": self.engine.lora.config.max_loras, "lora_running": sorted(running),
                "lora_waiting": sorted(waiting)}

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestState]:
        """One iteration; returns the states that gained tokens or finished, in first-touched order.

        Raises ``SchedulerStuckError`` when requests are pending and none can ever run."""
        with self.lock:
            if self._compiling:
                self._release_grammars()
            sched = self.scheduler
            plan = sched.schedule()
            if not plan.has_work():
                return []
            n = sched.last_iteration_tokens
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, n)] += 1
            self.iteration_tokens_sum += n
            out, gained = self.engine.step(plan)
            states = self.outputs.process(gained, sched.finish_on_stop_string)
            if out.errors is not None and any(e is not None for e in out.errors):
                states += [st for st in self._fail_requests(plan, out.errors) if st not in states]
            return states

    def _fail_requests(self, plan, errors) -> list[RequestState]:
        """The requests whose token could not be sampled (the scheduler finished that completion with
        "error"): each fails alone, its other completions aborted, the error on its outputs (served:
        an error for that request only, a 400 when its parameters were the cause)."""
        failed = []
        for task, error in zip(plan.tasks(), errors):
            entry = self.outputs.completions.get(task.request_id) if error is not None else None
            if entry is None:
                continue
            state, comp = entry
            if state.error is None:
                state.error, state.bad_request = error.message, error.bad_request
                failed.append(state)
            state.touch(comp)
            for c in state.completions:
                if not c.request.finished:
                    self.scheduler.abort(c.request.request_id)
                    state.touch(c)
            self.outputs.forget(state)
        return failed

    def step_deltas(self) -> list[RequestDelta]:
        """One iteration as deltas. A failure fails the requests of this iteration (error deltas)
        and leaves the core serving: nothing of theirs survives."""
        with self.lock:
            running = list(self.outputs.states) + list(self._pooling)
            try:
                states = self.step()
            except Exception as e:
                logger.exception("qwen_ops engine iteration failed; failing its %d requests", len(running))
                for rid in running:
                    self.abort(rid)
                message = f"generation failed: {type(e).__name__}: {e}"
                return [RequestDelta(rid, True, [], error=message) for rid in running]
            deltas = [st.delta() for st in states]
            if self._pooling:
                deltas += self._pooled_deltas()
            if self._failed:
                deltas += self._failed
                self._failed = []
            for d in deltas:
                if d.finished:
                    self.owned.discard(d.request_id)
            return deltas

    def stats(self) -> dict:
        with self.lock:
            s, kv = self.scheduler, self.engine.kv
            return {
                "num_preemptions": s.num_preemptions,
                "num_swaps_out": s.num_swaps_out,
                "num_swaps_in": s.num_swaps_in,
                "free_blocks": kv.num_free_blocks,
                "total_blocks": kv.num_total_blocks,
                "num_iterations": s.num_iterations,
                "mean_batch_size": s.num_scheduled_seqs / s.num_iterations if s.num_iterations else 0.0,
                "num_running": len(s.running),
                "num_waiting": len(s.waiting) + len(s.held),     # held: waiting for their grammar
                "num_swapped": len(s.swapped),
                "swap_space_bytes": s.config.swap_space_bytes,
                "swap_bytes_used": s.swap_bytes_used,
                "num_swap_full_recomputes": s.num_swap_full_recomputes,
                "num_swap_in_recomputes": s.num_swap_in_recomputes,
                "kv_cache_dtype": str(self.engine.kv_cache_dtype).removeprefix("torch."),
                "dtype": str(self.engine.dtype).removeprefix("torch."),
                "block_size": kv.block_size,
                "max_model_len": s.config.max_model_len,
                "num_threads": torch.get_num_threads(),
                "iteration_tokens_buckets": list(self.iteration_tokens),
                "iteration_tokens_sum": self.iteration_tokens_sum,
                **self._spec_stats(),
                **self._lora_stats(),
                **kv.stats(),
            }

    def _spec_stats(self) -> dict:
        """Speculative decoding's counts (vLLM's spec_decode metrics): decodes that verified drafts,
        drafts, accepted drafts, tokens those decodes emitted; acceptance rate (accepted / drafted)
        and mean tokens emitted per verifying decode (1 + accepted drafts)."""
        s = self.scheduler
        return {
            "speculative_method": self.speculative_config.method if self.speculative_config else None,
            "spec_num_drafts": s.num_spec_steps,
            "spec_num_draft_tokens": s.num_draft_tokens,
            "spec_num_accepted_tokens": s.num_accepted_tokens,
            "spec_num_emitted_tokens": s.num_spec_emitted_tokens,
            "spec_acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0,
            "spec_mean_accepted_length": s.num_spec_emitted_tokens / s.num_spec_steps if s.num_spec_steps else 0.0,
        }

    def close(self) -> None:
        """Abort everything admitted by messages (its slots, blocks and swap copies are freed)."""
        for rid in list(self.owned):
            self.abort(rid)
        if self._grammars is not None:
            self._grammars.close()
        if self._lora_pool is not None:
            self._lora_pool.shutdown(wait=False)


class ThreadCore:
    """The core on a thread of this process (``qwen-ops-engine``), fed through an inbox."""

    def __init__(self, llm, deliver: Deliver, on_exit: Callable[[BaseException], None]):
        self.core: EngineCore = llm.core
        self._deliver = deliver
        self._on_exit = on_exit
        self._inbox: collections.deque = collections.deque()
        self._inbox_completions = 0        # completions (n per request) of the adds in the inbox
        self._wake = threading.Event()
        self._stopping = False
        self._last_beat = time.monotonic()   # the loop's latest sign of progress (heartbeat_age)
        self.thread = threading.Thread(target=self._run, name="qwen-ops-engine", daemon=True)
        self.thread.start()

    @property
    def is_alive(self) -> bool:
        return self.thread.is_alive() and not self._stopping

    def add(self, request_id: str, ids: list[int], params: SamplingParams, lora_request=None) -> None:
        if not self._busy():
            self._last_beat = time.monotonic()   # the clock of a stall starts when work does
        self._inbox_completions += params.n
        self._inbox.append(("add", request_id, ids, params, lora_request))
        self._wake.set()

    def add_pooling(self, request_id: str, ids: list[int], task) -> None:
        """Queue a pooling request (an ``engine/pooling.py`` ``PoolingTask``); its embedding comes
        back as a finished delta."""
        if not self._busy():
            self._last_beat = time.monotonic()
        self._inbox_completions += 1
        self._inbox.append(("pool", request_id, ids, task))
        self._wake.set()

    def add_lora(self, lora_request) -> Future:
        """Parse an adapter into host memory (on the core's LoRA thread); a future of True."""
        return self.core.add_lora_async(lora_request)

    def remove_lora(self, lora_int_id: int) -> Future:
        """Forget an adapter, on the loop's thread between steps; a future of ``EngineCore.remove_lora``."""
        done: Future = Future()
        if not self.is_alive:
            done.set_exception(EngineDeadError("the engine loop is not running"))
            return done
        self._inbox.append(("remove_lora", lora_int_id, done))
        self._wake.set()
        return done

    def abort(self, request_id: str) -> None:
        if not self.thread.is_alive():
            self.core.abort(request_id)              # no loop to hand it to
            return
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def num_waiting(self) -> int:
        """Completions queued in the scheduler or still in the inbox (read without waiting for a step)."""
        s = self.core.scheduler
        return len(s.waiting) + len(s.held) + max(0, self._inbox_completions)

    def _busy(self) -> bool:
        return bool(self._inbox) or self.core.has_work()

    def heartbeat_age(self) -> float:
        """Seconds since the loop last showed progress while it has work; 0 when it has none."""
        return time.monotonic() - self._last_beat if self._busy() else 0.0

    def stats(self) -> dict:
        s = self.core.stats()
        s["num_waiting"] = self.num_waiting()
        return s

    def shutdown(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _run(self) -> None:
        core = self.core
        reason: BaseException = EngineDeadError("the engine loop stopped (AsyncLLM.shutdown)")
        try:
            while not self._stopping:
                errors = []
                while self._inbox:
                    msg = self._inbox.popleft()
                    if msg[0] == "abort":
                        core.abort(msg[1])
                    elif msg[0] == "remove_lora":
                        _settle(msg[2], core.remove_lora, msg[1])
                    elif msg[0] == "pool":
                        self._inbox_completions -= 1
                        err = core.add_pooling(*msg[1:])
                        if err is not None:
                            errors.append(err)
                    else:
                        self._inbox_completions -= msg[3].n
                        err = core.add(*msg[1:])
                        if err is not None:
                            errors.append(err)
                if errors:
                    self._deliver(errors)
                if not core.runnable():
                    self._last_beat = time.monotonic()
                    self._wake.wait(core.idle_timeout())
                    self._wake.clear()
                    continue
                self._deliver(core.step_deltas())
                self._last_beat = time.monotonic()
        except BaseException as e:       # never leave callers waiting on a dead loop
            logger.exception("qwen_ops engine loop failed")
            reason = EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}")
            raise
        finally:
            self._stopping = True
            for msg in self._inbox:
                if msg[0] == "remove_lora":
                    msg[2].set_exception(EngineDeadError("the engine loop stopped"))
            self._inbox.clear()          # nothing of ours may outlive the loop
            self._inbox_completions = 0
            core.close()
            self._on_exit(reason)


class ProcessCore:
    """The core in a child process (``python -m qwen_ops.serving.core_process``), fed over a pipe.

    The child is a fresh interpreter started with ``subprocess`` and one end of a socket pair,
    not a ``multiprocessing`` child: it never re-imports the caller's ``__main__`` (so scripts
    need no ``if __name__ == "__main__"`` guard, and notebooks work), and it may start
    tensor-parallel workers of its own. Construction blocks until the child has loaded the
    model (raising what the child's ``LLM`` raised, e.g. a ``ValueError`` naming a bad argument)
    and sets ``info``: the vocabulary size, ``max_model_len`` and checkpoint path that callers
    validate against.
    """

    def __init__(self, model, llm_kwargs: dict, deliver: Deliver, on_exit: Callable[[BaseException], None],
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, *, num_threads: Optional[int] = None,
                 cpus: Optional[Sequence[int]] = None):
        """``num_threads``: the child's torch threads (None: this process's count); ``cpus``: the CPU
        ids the child is pinned to (None: not pinned), as data-parallel replicas are."""
        import torch

        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._deliver = deliver
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self._stopping = False
        self._num_sent = 0                  # completions (n per add) sent; the child reports how many it took
        self._calls: dict[int, Future] = {}  # add_lora / remove_lora sent, by call id, until the child replies
        self._call_ids = itertools.count()
        self._last_beat = time.monotonic()  # when the child's latest message came (heartbeat_age)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])     # this qwen_ops, wherever it is
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.core_process",
                                             str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self._finalizer = weakref.finalize(self, _stop_child, self._conn, self.process, self._send_lock,
                                           DEFAULT_STOP_TIMEOUT_S)
        try:
            self._conn.send(("start", None if model is None else str(model), llm_kwargs,
                             torch.get_num_threads() if num_threads is None else num_threads,
                             None if cpus is None else list(cpus)))
            self.info = self._wait_ready(start_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        self._stats = self.info.pop("stats")
        self._num_taken = 0
        self.thread = threading.Thread(target=self._read, name="qwen-ops-core-reader", daemon=True)
        self.thread.start()

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.05):
            if self.process.poll() is not None:
                break                               # the pipe says EOF below
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core process did not load the model within {timeout_s} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise EngineDeadError(f"the engine core process exited (code {self.process.wait()}) "
                                  "before loading the model") from None
        if kind == "failed":
            raise payload
        return payload

    @property
    def is_alive(self) -> bool:
        return not self._stopping and self.thread.is_alive()

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):          # closed, or the child is gone: the reader reports it
            raise EngineDeadError("the engine core process is not running") from None

    def add(self, request_id: str, ids: list[int], params: SamplingParams, lora_request=None) -> None:
        if not self._busy():
            self._last_beat = time.monotonic()   # an idle child sends nothing: a stall starts with the work
        self._num_sent += params.n
        try:
            self._send(("add", request_id, ids, params, lora_request))
        except EngineDeadError:
            self._num_sent -= params.n
            raise

    def add_pooling(self, request_id: str, ids: list[int], task) -> None:
        """Send a pooling request to the child; its embedding comes back as a finished delta."""
        if not self._busy():
            self._last_beat = time.monotonic()
        self._num_sent += 1
        try:
            self._send(("pool", request_id, ids, task))
        except EngineDeadError:
            self._num_sent -= 1
            raise

    def add_lora(self, lora_request) -> Future:
        """Parse an adapter into the child's host memory (off its loop); a future of True."""
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> Future:
        """Forget an adapter in the child (between its steps); a future of ``EngineCore.remove_lora``."""
        return self._call("remove_lora", lora_int_id)

    def _call(self, kind: str, arg) -> Future:
        """Send ``(kind, call id, arg)``; the child answers ``("reply", call id, error, value)``."""
        done: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = done
        try:
            self._send((kind, call_id, arg))
        except EngineDeadError as e:
            self._calls.pop(call_id, None)
            done.set_exception(e)
        if self._stopping and self._calls.pop(call_id, None) is not None:   # the reader is gone: no reply comes
            done.set_exception(EngineDeadError("the engine core process is not running"))
        return done

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass                                # nothing left to abort

    def num_waiting(self) -> int:
        """Completions queued in the scheduler at the child's latest report, or still in the pipe."""
        return self._stats["num_waiting"] + max(0, self._num_sent - self._num_taken)

    def _busy(self) -> bool:
        s = self._stats
        return self._num_sent > self._num_taken or bool(s["num_running"] or s["num_waiting"] or s["num_swapped"])

    def heartbeat_age(self) -> float:
        """Seconds since the child's latest message while it has work, 0 when it has none.

        A busy child sends one message per iteration (its deltas and stats), so a large age means
        no iteration has finished for that long: the child is stopped, hung or in one huge step."""
        return time.monotonic() - self._last_beat if self._busy() else 0.0

    def stats(self) -> dict:
        """The child's ``stats()`` as of its latest message (one per iteration)."""
        return {**self._stats, "num_waiting": self.num_waiting()}

    def _read(self) -> None:
        reason: BaseException = EngineDeadError("the engine loop stopped (AsyncLLM.shutdown)")
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "reply":
                    _, call_id, error, value = msg
                    done = self._calls.pop(call_id, None)
                    if done is not None:
                        if error is None:
                            done.set_result(value)
                        else:             # "bad": the caller's mistake (a bad adapter), a 400; else the engine's
                            done.set_exception((ValueError if error == "bad" else RuntimeError)(value))
                    continue
                _, deltas, stats, taken = msg
                self._stats, self._num_taken = stats, taken
                self._last_beat = time.monotonic()
                if deltas:
                    self._deliver(deltas)
        except (EOFError, OSError):
            if not self._stopping:
                code = self.process.poll()
                reason = EngineDeadError("the engine core process died" + (f" (exit code {code})" if code else ""))
                logger.error("%s", reason)
        except BaseException as e:               # noqa: BLE001 - a message we cannot read
            logger.exception("qwen_ops engine core reader failed")
            reason = EngineDeadError(f"the engine core reader failed: {type(e).__name__}: {e}")
        finally:
            self._stopping = True
            for call_id in list(self._calls):
                done = self._calls.pop(call_id, None)
                if done is not None:
                    done.set_exception(reason)
            self._on_exit(reason)

    def shutdown(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        self._stopping = True
        self._finalizer()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)


def _settle(done: Future, fn, *args) -> None:
    """Run ``fn(*args)`` into the future ``done`` (its result, or what it raised)."""
    try:
        done.set_result(fn(*args))
    except Exception as e:            # noqa: BLE001 - handed to whoever waits on ``done``
        done.set_exception(e)


def _stop_child(conn, process: subprocess.Popen, lock: threading.Lock, timeout: float) -> None:
    """Ask the child to stop and wait for it (its exit ends the reader's ``recv`` with EOF);
    kill it if it does not exit in ``timeout``; then close the pipe."""
    try:
        with lock:
            conn.send(("shutdown",))
    except Exception:                 # noqa: BLE001 - already closed or gone
        pass
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("the engine core process did not exit within %s s; killing it", timeout)
        process.kill()
        process.wait(timeout)
    try:
        conn.close()
    except OSError:
        pass
