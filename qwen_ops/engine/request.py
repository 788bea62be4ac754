"""A sequence being generated: the one record of its tokens, sampling and seeded noise, the one
builder of its step's rows, and the one check that finishes it.

The scheduler owns every one (``engine/scheduler.py``): the requests it schedules, and the slot
API's sequences, pinned to the slots their caller chose (``Scheduler.pin``). A request's tokens
are ``prompt + output``; ``num_computed`` of them are in its slot's cache (the
``KVCacheManager``'s count, never a copy of it). ``task(n, ...)`` makes the ``BatchedRequest`` of
its next ``n`` tokens; ``append_token`` adds a sampled token and says whether it ends the sequence.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from qwen_ops.engine.batch import BatchedRequest, RequestId
from qwen_ops.engine.block_manager import SlotKV, SwappedSlot
from qwen_ops.engine.pooling import PoolingTask, finish_pooling, pooled_rows
from qwen_ops.engine.sampling import SamplingParams, SeededNoise


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)          # identity comparison: requests are looked up in queues often
class Request:
    request_id: Optional[RequestId]
    arrival: int                                # arrival order (FCFS key)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    generator: Optional[SeededNoise] = None     # its noise (its seed's, or LLM(seed=)'s derived one): owned here only
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: Optional[int] = None
    kv: Optional[SlotKV] = None               # its slot's blocks, from the KVCacheManager (running)
    swapped: Optional[SwappedSlot] = None     # its host copy (swapped)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: Optional[float] = None    # when it was first admitted (vLLM's queue time ends there)
    token_times: list[float] = field(default_factory=list)
    grammar: Any = None                       # xgrammar GrammarMatcher (structured outputs): its accepted tokens
    # sampling.prompt_logprobs: (logprob, rank, top ids, top logprobs) of prompt tokens 1, 2, ...
    prompt_logprobs: list[tuple] = field(default_factory=list)
    lora_request: Any = None                  # its LoRA adapter (engine/lora.py LoRARequest), or None
    lora_slot: Optional[int] = None           # the model's slot serving it while it holds a KV slot
    # A pooling request (engine/pooling.py): it only prefills; its chunks' pooled rows add up in
    # ``pool_sum`` (over ``pool_count`` rows) and its last chunk leaves ``embedding``.
    pooling: Optional[PoolingTask] = None
    pool_sum: Any = None
    pool_count: int = 0
    embedding: Any = None
    # The slot API's (``Scheduler.pin``): its caller chose the slot and steps it; it is never
    # preempted, and finishing leaves it its slot until ``free_slot``.
    pinned: bool = False
    # Prompt tokens its first admission mapped from the prefix cache (vLLM's RequestOutput.num_cached_tokens);
    # None until it is admitted.
    num_cached_tokens: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is held: in its slot's blocks, or in its host copy (the manager's count)."""
        if self.kv is not None:
            return self.kv.num_tokens
        return self.swapped.num_tokens if self.swapped is not None else 0

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of prompt + output, without joining the two (a decode's is O(1))."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def task(self, n: int, is_prefill: bool, drafts: Sequence[int] = (), sample: bool = True) -> BatchedRequest:
        """The rows of its next ``n`` tokens (then its ``drafts``), with its slot's block ids; when
        they reach the end of its tokens (and ``sample``), with what the runner needs to sample the
        next one (the one place a step's rows are made from a sequence)."""
        start = self.num_computed
        tokens = self.token_slice(start, start + n)
        sampling = self.sampling
        scored, k = (), None
        if sampling.prompt_logprobs is not None and self.scoring_prompt:
            # Row i predicts prompt token start + 1 + i: the rows of this chunk that have one.
            scored, k = tuple(self.prompt_token_ids[start + 1:start + n + 1]), sampling.prompt_logprobs
        lora = -1 if self.lora_slot is None else self.lora_slot
        if self.pooling is not None:              # prefill only: rows to pool, nothing sampled
            rows = pooled_rows(self.pooling.pooling_type, n, start, start + n == self.num_tokens)
            return BatchedRequest(self.slot, tokens, start, self.request_id, is_prefill, tuple(self.kv.block_ids),
                                  lora_slot=lora, pooling=self.pooling, pool_rows=tuple(rows))
        if start + n < self.num_tokens or not sample:
            return BatchedRequest(self.slot, tokens, start, self.request_id, is_prefill, tuple(self.kv.block_ids),
                                  prompt_logprob_ids=scored, prompt_logprobs=k, lora_slot=lora,
                                  needs_logits=bool(scored) or not sample)
        banned = self.stop_ids if self.stop_ids and len(self.output_token_ids) < sampling.min_tokens else ()
        if drafts:
            tokens = list(tokens) + list(drafts)
        history = (self.prompt_token_ids, self.output_token_ids) if sampling.processes_logits else None
        return BatchedRequest(self.slot, tokens, start, self.request_id, is_prefill, tuple(self.kv.block_ids),
                              sampling, self.generator, len(self.output_token_ids), tuple(banned), tuple(drafts),
                              history=history, grammar=self.grammar, prompt_logprob_ids=scored, prompt_logprobs=k,
                              lora_slot=lora)

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt logprobs are asked for and some are still missing (a recompute after
        they were all taken scores nothing again)."""
        return self.sampling.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def add_prompt_logprobs(self, start: int, entries: Sequence[tuple]) -> None:
        """Entries for prompt tokens ``start + 1, start + 2, ...`` (one chunk's rows); those held already are kept."""
        have = len(self.prompt_logprobs)
        if start <= have:
            self.prompt_logprobs.extend(entries[have - start:])

    def add_pooled(self, task: BatchedRequest, pooled: Any) -> bool:
        """Add a chunk's pooled rows (``reduce_rows``: their fp32 sum, or the one row; None: none);
        True when the chunk ends the prompt: ``embedding`` is then set (the pooling request's finish
        check). A chunk at position 0 starts over (a recompute after preemption)."""
        if task.position_offset == 0:
            self.pool_sum, self.pool_count = None, 0
        if pooled is not None:
            self.pool_sum = pooled if self.pool_sum is None else self.pool_sum + pooled
            self.pool_count += len(task.pool_rows)
        if task.seq_len < self.num_tokens:
            return False
        self.embedding = finish_pooling(self.pooling, self.pool_sum, self.pool_count)
        return True

    def append_token(self, token: int, max_len: Optional[int], now: Optional[float] = None) -> Optional[str]:
        """Add a sampled token and run the one finish check: "stop" (a stop token, or a completed
        grammar), "length" (``max_new_tokens``, or ``max_len`` tokens in all), or None."""
        out = self.output_token_ids
        out.append(token)
        if now is not None:
            self.token_times.append(now)
        reason = None
        if token in self.stop_ids:
            reason = "stop"
        elif len(out) >= self.sampling.max_new_tokens or (
                max_len is not None and len(self.prompt_token_ids) + len(out) >= max_len):
            reason = "length"
        if self.grammar is not None:
            # The mask allowed only this grammar's tokens; a completed grammar ends the request.
            self.grammar.accept_token(token)
            if reason is None and self.grammar.is_terminated():
                reason = "stop"
        return reason

    def feed(self, position: int, tokens: Sequence[int]) -> None:
        """Record that ``tokens`` were written to its cache from ``position`` on, in place of what it
        held there (the slot API's raw ``execute``, and a token fed back other than the sampled one):
        before its first sampled token they extend the prompt, after it the output."""
        n = len(self.prompt_token_ids)
        if position < n or (position == n and not self.output_token_ids):
            del self.output_token_ids[:]
            self.prompt_token_ids[position:] = list(tokens)
        else:
            self.output_token_ids[position - n:] = list(tokens)
