"""Continuous-batching scheduler: plans each serving iteration under a token budget.

A request's tokens are ``prompt + output``; ``num_computed`` of them are in its slot's cache.
It needs ``num_tokens - num_computed`` more rows: one is a decode, more is a prefill chunk.
A token is sampled when a request's chunk reaches the end of its tokens.

Scheduling policy (one ``schedule()`` call is one iteration; vLLM's V0 policy, made total):

1. **Running** requests, in admission order, each get their decode token or next prefill chunk
   (chunked to what is left of the token budget; prefill chunks and decodes share one forward).
   When KV blocks run out, the most recently admitted running request is preempted, repeatedly,
   until the request being scheduled fits; a request that is itself the newest preempts itself.
   The first running request (the *head*) is therefore never preempted: once the others are gone
   it fits alone, because ``num_kv_blocks`` holds one sequence of ``max_model_len``.
   With speculative decoding the planned decodes then get their drafts (``_add_drafts``), oldest
   first, from what budget and free blocks remain: drafts never preempt.
2. **Swapped** requests come back first come first served, but never in an iteration that
   preempted. A swapped request comes back only with blocks for its whole cache *and* its next
   step, and only if the budget has room for that step, so it is never a victim in the iteration
   that brought it back. When it cannot come back it waits while the running requests drain; if
   nothing is running (nothing will ever drain) and it still does not fit, it falls back to
   recompute: its host copy is dropped and it goes to the waiting queue.
3. **Waiting** requests are admitted first come first served, only when nothing is swapped and
   nothing was preempted in this iteration. The head of the queue blocks everyone behind it,
   so order holds among equals.

Preemption is by recompute (blocks freed; prompt + generated tokens prefilled again later) or by
swap (blocks copied to host memory and back). Swap is bounded by ``swap_space_bytes``: a victim
whose copy would not fit is recomputed instead, and counted in ``num_swap_full_recomputes``.

**Progress guarantee.** Every iteration that has unfinished requests schedules at least one
token of the head, or raises ``SchedulerStuckError`` naming why nothing can run (only a cache
too small for one request's next step). So a run of requests with prompt ``P_r`` and at most
``M_r`` new tokens, under a budget of ``B`` tokens, ends within
``sum_r(ceil((P_r + M_r) / B) + M_r)`` iterations (``iteration_bound``): each request is the
head once, for at most that many iterations of its own, whatever it lost to preemption before.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from qwen_ops.engine.batch import IterationPlan, RequestId, TokenBudget
from qwen_ops.engine.block_manager import KVCacheManager
from qwen_ops.engine.request import Request, RequestStatus
from qwen_ops.engine.runner import RunnerOutput
from qwen_ops.engine.sampling import SamplingParams, SeededNoise


class SchedulerStuckError(RuntimeError):
    """No request can run this iteration, and none ever will: the configuration cannot serve them."""


def iteration_bound(requests: Iterable[tuple[int, int]], max_num_batched_tokens: int) -> int:
    """Most iterations that requests of ``(prompt_len, max_new_tokens)`` can take (module docstring)."""
    b = max_num_batched_tokens
    return sum(-(-(p + m) // b) + m for p, m in requests)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"      # or "swap"
    swap_space_bytes: int = 4 << 30          # host memory for swapped KV; beyond it, recompute
    check_invariants: bool = False           # assert the invariants every iteration (tests)
    # LLM(seed=...): a sampled request without a seed of its own gets one from this and its arrival
    # (SeededNoise.derived), so a run repeats, speculation and preemption included; None: torch's RNG.
    seed: Optional[int] = None


class Scheduler:
    """Owns every unfinished ``Request`` and the one ``KVCacheManager`` their blocks come from:
    nothing else mutates it (the slot API's pinned sequences go through ``pin``, ``extend``,
    ``fork``, ``free_slot``). It never touches the device: ``schedule()`` (or ``plan_pinned`` for
    the slot API) returns the step's complete description for the runner, and ``update`` takes
    its result back (``QwenEngine.step``, the one driver of the runner, calls both)."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, device: torch.device = torch.device("cpu"),
                 proposer=None, disable_by_batch_size: Optional[int] = None, lora=None):
        self.kv = kv
        self.device = device
        self.configure(config, proposer, disable_by_batch_size, lora)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order
        self.swapped: deque[Request] = deque()
        # Requests waiting for something outside the scheduler (their grammar's compile): not queued
        # until ``release``, so they block no one (vLLM's WAITING_FOR_FSM).
        self.held: list[Request] = []
        self.requests: dict[RequestId, Request] = {}   # unfinished requests only (finished ones are dropped)
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        self.num_iterations = 0
        self.num_scheduled_seqs = 0
        self.num_swap_full_recomputes = 0         # swap preemptions recomputed: swap space full
        self.num_swap_in_recomputes = 0           # swapped requests that could never come back
        self.num_spec_steps = 0                   # decodes that verified drafts
        self.num_draft_tokens = 0                 # drafts verified
        self.num_accepted_tokens = 0              # drafts kept
        self.num_spec_emitted_tokens = 0          # tokens those decodes added (kept drafts + the target's)
        self.last_iteration_tokens = 0            # tokens the last schedule() planned
        # The seed's slot API (``QwenEngine.prefill`` ...): the sequence each pinned slot holds, by
        # slot. The caller chooses their slots and steps; they are never preempted, and a finished
        # one keeps its slot (and KV) until ``free_slot``.
        self.pinned: dict[int, Request] = {}

    def configure(self, config: SchedulerConfig, proposer=None, disable_by_batch_size: Optional[int] = None,
                  lora=None) -> None:
        """The serving policy: ``config``, the speculative proposer and the LoRA manager (an
        ``EngineCore`` gives its engine's scheduler its own; ``QwenEngine`` makes the scheduler with
        the slot API's defaults). Queues, counters and pinned sequences are left as they are."""
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode = {config.preemption_mode!r}, expected 'recompute' or 'swap'")
        if not isinstance(config.swap_space_bytes, int) or config.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes = {config.swap_space_bytes!r}, expected an int >= 0")
        self.config = config
        # LoRA (engine/lora.py LoRAManager): a request holds one of the model's adapter slots while it
        # holds a KV slot; one whose adapter finds no slot waits without blocking the others.
        self.lora = lora
        # Speculative decoding (engine/speculative.py): drafts per decode from ``proposer.propose``.
        self.proposer = proposer
        self.spec_disable_by_batch_size = disable_by_batch_size   # no drafts from this many decodes on

    # ------------------------------------------------------------------ the slot API's pinned sequences
    def allocate_slot(self, owner) -> int:
        """A slot that holds no sequence and no owner, now owned by ``owner``."""
        return self.kv.allocate_slot(owner)

    def free_slot(self, slot: int) -> None:
        """Release a slot, its pinned sequence (if any) and its KV blocks."""
        self.kv.free_slot(slot)
        self.pinned.pop(slot, None)

    def pin(self, slot: int, tokens: Optional[list[int]], sampling: SamplingParams, stop_ids: frozenset[int],
            n_tokens: int, prompt: bool = True) -> Request:
        """Start a fresh sequence in ``slot`` with blocks for ``n_tokens`` (the caller checked that they
        are free), mapping the cached prefix of ``tokens`` when given. Its prompt is ``tokens`` (or,
        ``prompt=False``, only the mapped prefix: ``QwenEngine.execute`` feeds the rest)."""
        mapped = self.kv.begin(slot, tokens)
        ok = self.kv.reserve(slot, n_tokens)
        assert ok, "blocks were checked before the sequence was pinned"
        tokens = list(tokens or ())
        req = Request(None, next(self._arrivals), tokens if prompt else tokens[:mapped], sampling, stop_ids,
                      generator=sampling.make_generator(), status=RequestStatus.RUNNING, slot=slot,
                      kv=self.kv.slots[slot], pinned=True)
        self.pinned[slot] = req
        return req

    def extend(self, slot: int, n_tokens: int) -> bool:
        """Blocks for ``n_tokens`` in all in a pinned slot; False (and no change) if too few are free."""
        return self.kv.reserve(slot, n_tokens)

    def fork(self, src: int, dst: int) -> Optional[tuple[int, int]]:
        """``dst`` continues as a copy of ``src``'s pinned sequence (beam search's beams): its full
        blocks shared (``KVCacheManager.fork``), its tokens copied, and the same seeded noise, so the
        fork draws what ``src`` would at each position. Returns the block pair the runner copies, if any."""
        copy = self.kv.fork(src, dst)
        seq = self.pinned[src]
        self.pinned[dst] = Request(None, next(self._arrivals), list(seq.prompt_token_ids), seq.sampling,
                                   seq.stop_ids, generator=seq.generator, output_token_ids=list(seq.output_token_ids),
                                   status=RequestStatus.RUNNING, slot=dst, kv=self.kv.slots[dst], pinned=True)
        return copy

    def grow(self, max_slots: int, num_blocks: int) -> None:
        """More slots and blocks (the slot API's ``allocate_batch_slots``)."""
        self.kv.grow(max_slots, num_blocks)

    def reset_cache(self) -> None:
        """Forget every cached block (the weights changed)."""
        self.kv.reset_cache()

    @property
    def swap_bytes_used(self) -> int:
        """Host bytes held by swapped requests (the KV-cache manager's count)."""
        return self.kv.swap_bytes_used

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: RequestId, prompt_token_ids: list[int], sampling: SamplingParams,
                    stop_ids: frozenset[int], grammar=None, held: bool = False, lora_request=None,
                    pooling=None) -> Request:
        """Queue a request (``held``: keep it aside until ``release``; it keeps its arrival order).
        ``pooling`` (an ``engine/pooling.py`` ``PoolingTask``): it only prefills its prompt, and
        finishes with its ``embedding`` when the last chunk is done (the pooling runner's steps)."""
        if lora_request is not None and self.lora is None:
            raise ValueError(f"lora_request = {lora_request!r}, but LoRA is not enabled; expected "
                             "LLM(enable_lora=True) or no lora_request")
        arrival = next(self._arrivals)
        noise = sampling.make_generator()
        if noise is None and self.config.seed is not None and not sampling.greedy:
            noise = SeededNoise.derived(self.config.seed, arrival)
        req = Request(request_id, arrival, list(prompt_token_ids), sampling, stop_ids, generator=noise,
                      grammar=grammar, lora_request=lora_request, pooling=pooling)
        if lora_request is not None:      # its parsed adapter stays in host memory until it ends
            self.lora.hold(lora_request.lora_int_id)
        self.requests[request_id] = req
        (self.held if held else self.waiting).append(req)
        return req

    def release(self, req: Request) -> None:
        """A held request joins the waiting queue, in arrival order."""
        self.held.remove(req)
        _insert_by_arrival(self.waiting, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.held)

    def _drop_host_copy(self, req: Request) -> None:
        if req.swapped is not None:
            self.kv.drop_swap(req.swapped)
            req.swapped = None

    def _free_slot(self, req: Request) -> None:
        if req.slot is not None:
            self.kv.free_slot(req.slot)
            req.slot, req.kv = None, None
        self._release_lora(req)

    def _release_lora(self, req: Request) -> None:
        """Give back the model's LoRA slot that ``req`` holds (if any)."""
        if req.lora_slot is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = None

    def _unhold_lora(self, req: Request) -> None:
        if req.lora_request is not None:
            self.lora.unhold(req.lora_request.lora_int_id)

    def _take_lora(self, req: Request) -> bool:
        """Give ``req`` its adapter's slot (a request without one needs none); False: every slot serves
        other adapters' running requests, so it waits."""
        if req.lora_request is None or req.lora_slot is not None:
            return True
        req.lora_slot = self.lora.acquire(req.lora_request)
        return req.lora_slot is not None

    def _release(self, req: Request) -> None:
        self._free_slot(req)
        self._drop_host_copy(req)

    def abort(self, request_id: RequestId) -> None:
        """Stop the request and free its slot, blocks and host copies."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        for queue in (self.waiting, self.swapped, self.held):
            if req in queue:
                queue.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self._unhold_lora(req)
        req.status = RequestStatus.ABORTED
        req.finish_reason = "abort"
        del self.requests[request_id]

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        if req.pinned:                        # the slot API's: it keeps its slot until free_slot
            req.status = RequestStatus.FINISHED
            req.finish_reason, req.stop_reason = reason, stop_reason
            return
        self.running.remove(req)
        self._release(req)
        self._unhold_lora(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        del self.requests[req.request_id]     # a long-running server must not keep every request

    def finish_on_stop_string(self, req: Request, stop: str, kept: int) -> None:
        """A stop string ended ``req`` after its first ``kept`` output tokens (the output processor
        found it in the text): its tokens are cut there, nothing past the string, and it finishes
        with ``"stop"``. If a stop token or its length also ended it in this step, the string wins."""
        del req.output_token_ids[kept:]
        if req.finished:
            req.finish_reason, req.stop_reason = "stop", stop
        else:
            self.finish(req, "stop", stop)

    # ------------------------------------------------------------------ preemption
    def _preempt(self, victim: Request, plan: IterationPlan) -> None:
        self.running.remove(victim)
        self.num_preemptions += 1
        swap = self.config.preemption_mode == "swap" and victim.num_computed > 0
        if swap and self.kv.swap_bytes_used + self.kv.swap_out_nbytes(victim.slot) > self.config.swap_space_bytes:
            swap = False
            self.num_swap_full_recomputes += 1
        if swap:
            victim.swapped, copy = self.kv.swap_out(victim.slot, victim.request_id)
            self._free_slot(victim)
            victim.status = RequestStatus.SWAPPED
            self.num_swaps_out += 1
            plan.swap_out_requests.append(copy)
            _insert_by_arrival(self.swapped, victim)
        else:
            self._release(victim)
            self._requeue_for_recompute(victim)
            plan.evicted_requests.append(victim.request_id)

    def _requeue_for_recompute(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        _insert_by_arrival(self.waiting, req)

    def _reserve_or_preempt(self, req: Request, n_tokens: int, plan: IterationPlan) -> bool:
        """Reserve blocks for ``n_tokens`` in ``req``'s slot, preempting the newest running requests.

        Returns False if ``req`` itself had to be preempted.
        """
        while not self.kv.reserve(req.slot, n_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    # ------------------------------------------------------------------ planning
    @staticmethod
    def _next_step(req: Request, budget: TokenBudget) -> tuple[bool, int]:
        """``(is_decode, tokens)`` of the request's next step under ``budget`` (0 tokens: no room)."""
        remaining = req.num_tokens - req.num_computed
        if remaining == 1 and req.output_token_ids:
            return True, min(1, budget.remaining_decode())
        return False, min(remaining, budget.remaining_prefill())

    def _add_step(self, req: Request, is_decode: bool, n: int, budget: TokenBudget, plan: IterationPlan) -> None:
        if is_decode:
            budget.allocate_decode()
            plan.decode_tasks.append(req.task(1, is_prefill=False))
        else:
            budget.allocate_prefill(n)
            plan.prefill_tasks.append(req.task(n, is_prefill=True))

    def _drafts(self, req: Request, budget: TokenBudget) -> list[int]:
        """The proposer's drafts for the request's decode, cut to what the step may emit: the
        budget's decode tokens, ``max_tokens`` and ``max_model_len`` (k drafts emit up to k + 1
        tokens). None while ``min_tokens`` bans stop tokens, and for requests with logprobs,
        processed logits (penalties, bias, bad words) or a grammar: those decode one token a step."""
        sp = req.sampling
        n_out = len(req.output_token_ids)
        if sp.logprobs is not None or n_out < sp.min_tokens or sp.processes_logits or req.grammar is not None:
            return []
        room = min(budget.remaining_decode() + 1, sp.max_new_tokens - n_out, self.config.max_model_len - req.num_tokens) - 1
        if room <= 0:
            return []
        # a draft model's or MTP's places are filled in the runner: no token list to build for them
        return self.proposer.propose(req.all_token_ids() if getattr(self.proposer, "reads_tokens", True) else ())[:room]

    def _schedule_running(self, req: Request, budget: TokenBudget, plan: IterationPlan) -> None:
        """Give a running request its decode token or next prefill chunk, if budget and blocks allow."""
        is_decode, n = self._next_step(req, budget)
        if n and self._reserve_or_preempt(req, req.num_computed + n, plan):
            self._add_step(req, is_decode, n, budget, plan)

    def _add_drafts(self, budget: TokenBudget, plan: IterationPlan) -> None:
        """Give the planned decodes their drafts, oldest first, while the budget and free blocks
        last: after every running request has its step, so drafts never preempt one (they do take
        budget and blocks before swapped and waiting requests, as vLLM's scheduler does)."""
        requests = self.requests
        if self.spec_disable_by_batch_size is not None and len(plan.decode_tasks) >= self.spec_disable_by_batch_size:
            return
        for j, task in enumerate(plan.decode_tasks):
            req = requests[task.request_id]
            drafts = self._drafts(req, budget)
            if drafts and self.kv.reserve(req.slot, req.num_computed + 1 + len(drafts)):
                budget.allocate_decode(len(drafts))
                plan.decode_tasks[j] = req.task(1, is_prefill=False, drafts=drafts)

    def _schedule_swapped(self, budget: TokenBudget, plan: IterationPlan) -> None:
        """Bring swapped requests back, first come first served, each with room for its next step."""
        cfg, kv = self.config, self.kv
        while self.swapped and len(self.running) < cfg.max_num_seqs:
            req = self.swapped[0]
            is_decode, n = self._next_step(req, budget)
            if n == 0:
                return                                   # no budget left: it would only hold blocks
            if not self._take_lora(req):
                return                                   # its adapter waits for a slot
            slot = kv.allocate_slot(req.request_id)
            copy = kv.swap_in(slot, req.swapped, req.num_computed + n, req.request_id)
            if copy is None:
                kv.free_slot(slot)
                self._release_lora(req)
                if self.running:
                    return                               # wait while the running requests drain
                # Nothing runs, so nothing will ever free blocks for it: recompute instead.
                self.swapped.popleft()
                self._drop_host_copy(req)
                self._requeue_for_recompute(req)
                self.num_swap_in_recomputes += 1
                plan.evicted_requests.append(req.request_id)
                continue
            self.swapped.popleft()
            req.swapped = None                           # the runner takes the host copy back in
            req.slot, req.kv, req.status = slot, kv.slots[slot], RequestStatus.RUNNING
            self.running.append(req)
            self.num_swaps_in += 1
            plan.swap_in_requests.append(copy)
            self._add_step(req, is_decode, n, budget, plan)

    def schedule(self) -> IterationPlan:
        """Plan one iteration (module docstring): the step's tasks, each with its block ids."""
        cfg, kv = self.config, self.kv
        plan = IterationPlan.empty()
        budget = TokenBudget(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_num_batched_tokens)

        # 1. Running requests, oldest admission first; preemption takes the newest.
        for req in list(self.running):
            if req in self.running:              # not preempted while making room for an older one
                self._schedule_running(req, budget, plan)
        preempted_now = bool(plan.evicted_requests or plan.swap_out_requests)
        if self.proposer is not None:
            self._add_drafts(budget, plan)

        # 2. Swapped requests come back first come first served (not in an iteration that preempts).
        if not preempted_now:
            self._schedule_swapped(budget, plan)

        # 3. Waiting requests, first come first served: the head blocks everyone behind it, except
        #    a request whose LoRA adapter finds no slot (every slot serves other adapters' running
        #    requests): it keeps its place and the ones behind it go ahead.
        admitted = []
        passed = 0
        while len(self.waiting) > passed and not self.swapped and not preempted_now \
                and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[passed]
            if budget.remaining_prefill() == 0:
                break
            if not self._take_lora(req):
                passed += 1
                continue
            slot = kv.allocate_slot(req.request_id)
            req.slot, req.kv = slot, kv.slots[slot]
            # With prefix caching the slot starts with the cached full blocks of the request's
            # tokens: they count as computed, and the budget buys only the rest. A request that
            # scores its prompt computes all of it (vLLM's choice too: the logits are needed).
            # Blocks computed with an adapter are keyed by it too: never shared across adapters.
            # So does a pooling request that reads rows before its last (mean, CLS).
            reads_prefix = req.scoring_prompt or (req.pooling is not None and req.pooling.reads_prefix)
            cached = kv.begin(slot, None if reads_prefix else req.all_token_ids(),
                              b"" if req.lora_request is None else req.lora_request.cache_key)
            chunk = min(req.num_tokens - req.num_computed, budget.remaining_prefill())
            if not kv.reserve(slot, req.num_computed + chunk):
                self._free_slot(req)
                if not self.running:
                    need = -(-chunk // kv.block_size)
                    raise SchedulerStuckError(
                        f"request {req.request_id} needs {need} KV blocks of {kv.block_size} tokens for its "
                        f"next {chunk} tokens, but the cache has only {kv.num_total_blocks} "
                        "(num_kv_blocks) and nothing else is running; raise num_kv_blocks")
                break
            del self.waiting[passed]
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens is None:
                req.num_cached_tokens = cached
            if req.scheduled_time is None:
                req.scheduled_time = time.perf_counter()
            self.running.append(req)
            admitted.append(req)
            self._add_step(req, False, chunk, budget, plan)

        plan.freed_swaps = kv.take_freed_swaps()
        if cfg.check_invariants:
            self._check_invariants(plan, budget, admitted)
        work = plan.has_work()
        if not work and (self.waiting or self.running or self.swapped):
            raise SchedulerStuckError(
                f"no request can run: {len(self.running)} running, {len(self.swapped)} swapped, "
                f"{len(self.waiting)} waiting, {kv.num_free_blocks} of {kv.num_total_blocks} "
                f"KV blocks free, token budget {cfg.max_num_batched_tokens}")
        self.num_iterations += work
        self.num_scheduled_seqs += plan.total_requests()
        self.last_iteration_tokens = budget.prefill_tokens + budget.decode_tokens
        return plan

    def _check_invariants(self, plan: IterationPlan, budget: TokenBudget, admitted: list[Request]) -> None:
        cfg = self.config
        if plan.total_tokens() > cfg.max_num_batched_tokens:
            raise AssertionError(f"token budget exceeded: {plan.total_tokens()} > {cfg.max_num_batched_tokens}")
        if budget.total_tokens() != plan.total_tokens() or len(plan.decode_tasks) > cfg.max_num_seqs:
            raise AssertionError("plan and budget disagree")
        self.kv.check()                          # reference counts, free list, shared blocks
        for name, queue in (("waiting", self.waiting), ("swapped", self.swapped)):
            arrivals = [r.arrival for r in queue]
            if arrivals != sorted(arrivals):
                raise AssertionError(f"{name} queue out of arrival order: {arrivals}")
        if len(self.running) > cfg.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running requests > max_num_seqs = {cfg.max_num_seqs}")
        running_slots = [r.slot for r in self.running]
        holding = {s for s, slot in enumerate(self.kv.slots) if slot.block_ids}
        if None in running_slots or len(set(running_slots)) != len(running_slots) or \
                set(running_slots) != holding:
            raise AssertionError(f"running requests' slots {running_slots} do not match the slots holding blocks")
        if any(r.slot is not None or r.swapped is not None for r in self.waiting):
            raise AssertionError("a waiting request holds a slot or a host copy")
        if any(r.slot is not None or r.swapped is None for r in self.swapped):
            raise AssertionError("a swapped request holds a slot or has no host copy")
        held = sum(r.swapped.nbytes for r in self.swapped)
        if held != self.kv.swap_bytes_used or held > cfg.swap_space_bytes:
            raise AssertionError(f"swap accounting: {held} bytes held, {self.swap_bytes_used} counted, "
                                 f"swap_space_bytes = {cfg.swap_space_bytes}")
        swapped_in = {c.request_id for c in plan.swap_in_requests}
        for rid in plan.evicted_requests + [c.request_id for c in plan.swap_out_requests]:
            if rid in swapped_in:
                raise AssertionError(f"request {rid} was swapped in and preempted in the same iteration")
        scheduled = {t.request_id for t in plan.prefill_tasks + plan.decode_tasks}
        if self.running and self.running[0].request_id not in scheduled:
            raise AssertionError(f"the head request {self.running[0].request_id} was not scheduled: no progress")
        for a in admitted:
            for w in self.waiting:
                if w.arrival < a.arrival:
                    raise AssertionError(f"FCFS broken: request {a.arrival} admitted before waiting {w.arrival}")

    # ------------------------------------------------------------------ results
    def update(self, plan: IterationPlan, out: RunnerOutput) -> list[tuple[Request, int, Optional[tuple]]]:
        """Count the KV each task wrote, append the sampled tokens, finish requests on a stop token
        or length (``Request.append_token``: the one finish check). Returns ``(request, token, logprobs
        entry)`` for every token gained, in task order.

        A task with drafts keeps the KV of its last token and its accepted drafts only (the
        rejected rows are past the slot's count: never read, overwritten later) and gains every
        emitted token up to the first that finishes the request."""
        now = time.perf_counter()
        kv, requests, max_len = self.kv, self.requests, self.config.max_model_len
        emitted_all, prompt_lps, errors = out.emitted, out.prompt_logprobs, out.errors
        gained = []
        for i, (task, token, lp) in enumerate(zip(plan.tasks(), out.sampled, out.logprobs)):
            if task.pooling is not None:        # a pooling request: its KV, its rows; done after its last chunk
                kv.commit(task.kv_cache_slot, task.token_ids)
                req = requests[task.request_id]
                if req.add_pooled(task, out.pooled[i]):
                    self.finish(req, "stop")
                continue
            req = requests[task.request_id] if task.request_id is not None else self.pinned[task.kv_cache_slot]
            if prompt_lps is not None and prompt_lps[i] is not None:
                req.add_prompt_logprobs(task.position_offset, prompt_lps[i])
            emitted = emitted_all[i] if emitted_all is not None else None
            if errors is not None and errors[i] is not None:
                # Nothing could be sampled for it (engine/sampler.py): it fails alone, with the error
                # (the engine core reports it); its drafts' rows are not kept.
                kv.commit(task.kv_cache_slot, task.token_ids[:len(task.token_ids) - len(task.draft_token_ids)])
                self.finish(req, "error")
                continue
            if emitted is None:
                kv.commit(task.kv_cache_slot, task.token_ids)
                if token is None:
                    continue
                emitted = (token,)
            else:
                k, kept = len(task.draft_token_ids), len(emitted) - 1
                # The accepted drafts are emitted[:kept] (a draft model's are written in the runner).
                kv.commit(task.kv_cache_slot, list(task.token_ids[:len(task.token_ids) - k]) + list(emitted[:kept]))
                self.num_spec_steps += 1
                self.num_draft_tokens += k
                self.num_accepted_tokens += kept
            for token in emitted:
                gained.append((req, token, lp))
                if task.draft_token_ids:
                    self.num_spec_emitted_tokens += 1
                reason = req.append_token(token, max_len, now)
                if reason is not None:
                    self.finish(req, reason, token if reason == "stop" else None)
                    break
        return gained


def _insert_by_arrival(queue: deque, req: Request) -> None:
    """Put a preempted request back in arrival order (it is usually older than the rest)."""
    for i, other in enumerate(queue):
        if other.arrival > req.arrival:
            queue.insert(i, req)
            return
    queue.append(req)
