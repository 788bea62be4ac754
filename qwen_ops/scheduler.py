"""Continuous-batching scheduler: plans each serving iteration under a token budget.

Policy (vLLM-like):
- running requests first, in admission order: a decode token each, or their next prefill chunk;
- then swapped requests (swap mode), then waiting requests, first come first served: the head
  of a queue that does not fit blocks everything behind it, so order holds among equals;
- prefill is chunked to the budget and mixes with decodes in the same forward pass;
- when KV blocks run out, the most recently admitted running request is preempted: by
  recompute (blocks freed, its prompt + generated tokens are prefilled again later) or by
  swap (blocks copied to host memory and back).

A request's tokens are ``prompt + output``; ``num_computed`` of them are in its slot's cache.
It needs ``num_tokens - num_computed`` more rows: one is a decode, more is a prefill chunk.
A token is sampled when a request's chunk reaches the end of its tokens.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from qwen_ops.batch import DecodeTask, IterationPlan, PrefillTask, RequestId, TokenBudget
from qwen_ops.engine import QwenEngine, SwappedSlot
from qwen_ops.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)          # identity comparison: requests are looked up in queues often
class Request:
    request_id: RequestId
    arrival: int                                # arrival order (FCFS key)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    generator: Optional[torch.Generator] = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: Optional[int] = None
    num_computed: int = 0
    swapped: Optional[SwappedSlot] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:stop] if stop <= n
                else (self.prompt_token_ids + self.output_token_ids)[start:stop])

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"      # or "swap"
    check_invariants: bool = False           # assert the invariants every iteration (tests)


class Scheduler:
    def __init__(self, engine: QwenEngine, config: SchedulerConfig):
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode = {config.preemption_mode!r}, expected 'recompute' or 'swap'")
        self.engine = engine
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order
        self.swapped: deque[Request] = deque()
        self.requests: dict[RequestId, Request] = {}
        self._arrivals = itertools.count()
        self._batch_ids = itertools.count()
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        self.num_iterations = 0
        self.num_scheduled_seqs = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: RequestId, prompt_token_ids: list[int], sampling: SamplingParams,
                    stop_ids: frozenset[int]) -> Request:
        req = Request(request_id, next(self._arrivals), list(prompt_token_ids), sampling, stop_ids,
                      generator=sampling.make_generator(self.engine.device))
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def next_batch_id(self) -> int:
        return next(self._batch_ids)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.engine.free_slot(req.slot)
            req.slot = None
        req.swapped = None

    def abort(self, request_id: RequestId) -> None:
        """Stop the request and free its slot, blocks and host copies."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        for queue in (self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.ABORTED
        req.finish_reason = "abort"

    def finish(self, req: Request, reason: str, stop_reason: Optional[int] = None) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason

    # ------------------------------------------------------------------ preemption
    def _preempt(self, victim: Request, plan: IterationPlan) -> None:
        self.running.remove(victim)
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and victim.num_computed > 0:
            victim.swapped = self.engine.swap_out(victim.slot)
            self.engine.free_slot(victim.slot)
            victim.slot = None
            victim.status = RequestStatus.SWAPPED
            self.num_swaps_out += 1
            plan.swap_out_requests.append(victim.request_id)
            _insert_by_arrival(self.swapped, victim)
        else:
            self._release(victim)
            victim.num_computed = 0
            victim.status = RequestStatus.WAITING
            plan.evicted_requests.append(victim.request_id)
            _insert_by_arrival(self.waiting, victim)

    def _reserve_or_preempt(self, req: Request, n_tokens: int, plan: IterationPlan) -> bool:
        """Reserve blocks for ``n_tokens`` in ``req``'s slot, preempting the newest running requests.

        Returns False if ``req`` itself had to be preempted.
        """
        while not self.engine.reserve(req.slot, n_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    # ------------------------------------------------------------------ planning
    def _schedule_running(self, req: Request, budget: TokenBudget, plan: IterationPlan) -> None:
        """Give a running request its decode token or next prefill chunk, if budget and blocks allow."""
        remaining = req.num_tokens - req.num_computed
        if remaining == 1 and req.output_token_ids:
            if budget.remaining_decode() == 0 or not self._reserve_or_preempt(req, req.num_computed + 1, plan):
                return
            budget.try_allocate_decode()
            plan.decode_tasks.append(self._decode_task(req))
        else:
            chunk = min(remaining, budget.remaining_prefill())
            if chunk == 0 or not self._reserve_or_preempt(req, req.num_computed + chunk, plan):
                return
            budget.try_allocate_prefill(chunk)
            plan.prefill_tasks.append(self._prefill_task(req, chunk))

    def schedule(self) -> IterationPlan:
        cfg = self.config
        plan = IterationPlan.empty()
        budget = TokenBudget(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_num_batched_tokens)

        # 1. Running requests, oldest admission first; preemption takes the newest.
        for req in list(self.running):
            if req in self.running:              # not preempted while making room for an older one
                self._schedule_running(req, budget, plan)
        preempted_now = bool(plan.evicted_requests or plan.swap_out_requests)

        # 2. Swapped requests come back first come first served (not in an iteration that preempts).
        while self.swapped and not preempted_now and len(self.running) < cfg.max_num_seqs:
            req = self.swapped[0]
            slot = self.engine.allocate_slot(req.request_id)
            if not self.engine.swap_in(slot, req.swapped):
                self.engine.free_slot(slot)
                break
            self.swapped.popleft()
            req.slot, req.swapped, req.status = slot, None, RequestStatus.RUNNING
            self.running.append(req)
            self.num_swaps_in += 1
            plan.swap_in_requests.append(req.request_id)
            self._schedule_running(req, budget, plan)

        # 3. Waiting requests, first come first served: the head blocks everyone behind it.
        admitted = []
        while self.waiting and not self.swapped and not preempted_now and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            chunk = min(req.num_tokens - req.num_computed, budget.remaining_prefill())
            if chunk == 0:
                break
            slot = self.engine.allocate_slot(req.request_id)
            self.engine.begin_sequence(slot)
            if not self.engine.reserve(slot, chunk):
                self.engine.free_slot(slot)
                break
            self.waiting.popleft()
            req.slot, req.status = slot, RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            budget.try_allocate_prefill(chunk)
            plan.prefill_tasks.append(self._prefill_task(req, chunk))

        if cfg.check_invariants:
            self._check_invariants(plan, budget, admitted)
        self.num_iterations += plan.has_work()
        self.num_scheduled_seqs += plan.total_requests()
        return plan

    def _slot_blocks(self, req: Request) -> list[int]:
        return self.engine.slot_blocks(req.slot)

    def _prefill_task(self, req: Request, chunk: int) -> PrefillTask:
        return PrefillTask(req.request_id, req.token_slice(req.num_computed, req.num_computed + chunk),
                           req.num_computed, req.slot, self._slot_blocks(req))

    def _decode_task(self, req: Request) -> DecodeTask:
        return DecodeTask(req.request_id, req.token_slice(req.num_computed, req.num_computed + 1)[0],
                          req.num_computed, req.slot, self._slot_blocks(req), req.num_computed)

    def _check_invariants(self, plan: IterationPlan, budget: TokenBudget, admitted: list[Request]) -> None:
        cfg = self.config
        if plan.total_tokens() > cfg.max_num_batched_tokens:
            raise AssertionError(f"token budget exceeded: {plan.total_tokens()} > {cfg.max_num_batched_tokens}")
        if budget.total_tokens() != plan.total_tokens() or len(plan.decode_tasks) > cfg.max_num_seqs:
            raise AssertionError("plan and budget disagree")
        owned: dict[int, int] = {}
        for slot_id in range(self.engine.num_slots):
            for b in self.engine.slot_blocks(slot_id):
                if b in owned:
                    raise AssertionError(f"block {b} is owned by slots {owned[b]} and {slot_id}")
                owned[b] = slot_id
        if len(owned) + self.engine.num_free_blocks != self.engine.num_total_blocks:
            raise AssertionError(f"blocks leaked: {len(owned)} owned + {self.engine.num_free_blocks} free "
                                 f"!= {self.engine.num_total_blocks}")
        for name, queue in (("waiting", self.waiting), ("swapped", self.swapped)):
            arrivals = [r.arrival for r in queue]
            if arrivals != sorted(arrivals):
                raise AssertionError(f"{name} queue out of arrival order: {arrivals}")
        for a in admitted:
            for w in self.waiting:
                if w.arrival < a.arrival:
                    raise AssertionError(f"FCFS broken: request {a.arrival} admitted before waiting {w.arrival}")

    # ------------------------------------------------------------------ results
    def update(self, plan: IterationPlan, sampled: dict[RequestId, int]) -> list[Request]:
        """Advance computed lengths, append sampled tokens, finish requests; returns touched requests."""
        now = time.perf_counter()
        touched = []
        for task in plan.prefill_tasks:
            req = self.requests[task.request_id]
            req.num_computed += len(task.tokens)
            touched.append(req)
        for task in plan.decode_tasks:
            req = self.requests[task.request_id]
            req.num_computed += 1
            touched.append(req)
        for req in touched:
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            req.token_times.append(now)
            if token in req.stop_ids:
                self.finish(req, "stop", token)
            elif len(req.output_token_ids) >= req.sampling.max_new_tokens or req.num_tokens >= self.config.max_model_len:
                self.finish(req, "length")
        return touched


def _insert_by_arrival(queue: deque, req: Request) -> None:
    """Put a preempted request back in arrival order (it is usually older than the rest)."""
    for i, other in enumerate(queue):
        if other.arrival > req.arrival:
            queue.insert(i, req)
            return
    queue.append(req)
