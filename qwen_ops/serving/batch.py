"""The batching vocabulary of the seed module (``batch.rs``): what one serving iteration runs.

``PrefillTask``/``DecodeTask`` are planned by the scheduler into an ``IterationPlan``, which
becomes a ``ScheduledBatch`` of ``BatchedRequest`` rows (prefill chunks first, then decodes)
executed in ONE forward pass. Unlike the seed, a prefill task may start mid-prompt (chunked
prefill), so ``position_offset``/``context_len`` are honoured for prefills too.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class RequestId:
    """A request identifier. ``RequestId.new()`` is random and unique (no process-wide counter);
    the scheduler numbers requests in arrival order itself."""

    value: int

    @staticmethod
    def new() -> "RequestId":
        return RequestId(uuid.uuid4().int >> 64)

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class BatchedRequest:
    """One request's rows in a batch: ``token_ids`` at positions ``position_offset, ...``."""

    request_id: RequestId
    token_ids: list[int]
    position_offset: int
    kv_cache_slot: int
    block_table: list[int]
    is_prefill: bool
    seq_len: int          # tokens in the cache after this batch
    context_len: int      # tokens in the cache before this batch

    @classmethod
    def prefill(cls, request_id: RequestId, token_ids: list[int], kv_cache_slot: int, block_table: list[int],
                position_offset: int = 0) -> "BatchedRequest":
        return cls(request_id, list(token_ids), position_offset, kv_cache_slot, list(block_table), True,
                   position_offset + len(token_ids), position_offset)

    @classmethod
    def decode(cls, request_id: RequestId, token_id: int, position_offset: int, kv_cache_slot: int,
               block_table: list[int], context_len: int) -> "BatchedRequest":
        return cls(request_id, [token_id], position_offset, kv_cache_slot, list(block_table), False,
                   context_len + 1, context_len)

    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class BatchStats:
    batch_id: int = 0
    total_requests: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    total_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_seq_len: int = 0


@dataclass
class ScheduledBatch:
    batch_id: int
    requests: list[BatchedRequest] = field(default_factory=list)
    total_tokens: int = 0
    has_prefill: bool = False
    has_decode: bool = False
    max_seq_len: int = 0

    def add(self, request: BatchedRequest) -> None:
        self.total_tokens += request.num_tokens()
        self.has_prefill |= request.is_prefill
        self.has_decode |= not request.is_prefill
        self.max_seq_len = max(self.max_seq_len, request.seq_len)
        self.requests.append(request)

    def is_empty(self) -> bool:
        return not self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def request_ids(self) -> list[RequestId]:
        return [r.request_id for r in self.requests]

    @classmethod
    def merge_prefill_decode(cls, prefill: list[BatchedRequest], decode: list[BatchedRequest],
                             batch_id: int) -> "ScheduledBatch":
        """Prefill rows first, then decode rows: one forward pass for both."""
        batch = cls(batch_id)
        for r in itertools.chain(prefill, decode):
            batch.add(r)
        return batch

    def split_by_type(self) -> tuple[list[BatchedRequest], list[BatchedRequest]]:
        return ([r for r in self.requests if r.is_prefill], [r for r in self.requests if not r.is_prefill])

    def collect_input_ids(self) -> list[list[int]]:
        return [list(r.token_ids) for r in self.requests]

    def collect_positions(self) -> list[int]:
        return [r.position_offset for r in self.requests]

    def collect_kv_slots(self) -> list[int]:
        return [r.kv_cache_slot for r in self.requests]

    def stats(self) -> BatchStats:
        prefill, decode = self.split_by_type()
        prefill_tokens = sum(r.num_tokens() for r in prefill)
        return BatchStats(self.batch_id, len(self.requests), len(prefill), len(decode), self.total_tokens,
                          prefill_tokens, self.total_tokens - prefill_tokens, self.max_seq_len)


@dataclass
class PrefillTask:
    request_id: RequestId
    tokens: list[int]
    start_position: int
    kv_cache_slot: int
    block_table: list[int]


@dataclass
class DecodeTask:
    request_id: RequestId
    input_token: int
    position: int
    kv_cache_slot: int
    block_table: list[int]
    context_len: int


@dataclass
class IterationPlan:
    prefill_tasks: list[PrefillTask] = field(default_factory=list)
    decode_tasks: list[DecodeTask] = field(default_factory=list)
    evicted_requests: list[RequestId] = field(default_factory=list)
    swap_out_requests: list[RequestId] = field(default_factory=list)
    swap_in_requests: list[RequestId] = field(default_factory=list)

    @classmethod
    def empty(cls) -> "IterationPlan":
        return cls()

    def has_work(self) -> bool:
        return bool(self.prefill_tasks or self.decode_tasks)

    def total_requests(self) -> int:
        return len(self.prefill_tasks) + len(self.decode_tasks)

    def total_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.prefill_tasks) + len(self.decode_tasks)

    def to_scheduled_batch(self, batch_id: int) -> ScheduledBatch:
        prefill = [BatchedRequest.prefill(t.request_id, t.tokens, t.kv_cache_slot, t.block_table, t.start_position)
                   for t in self.prefill_tasks]
        decode = [BatchedRequest.decode(t.request_id, t.input_token, t.position, t.kv_cache_slot, t.block_table,
                                        t.context_len) for t in self.decode_tasks]
        return ScheduledBatch.merge_prefill_decode(prefill, decode, batch_id)


@dataclass
class TokenBudget:
    """Per-iteration token limits; ``reset`` between iterations."""

    max_prefill_tokens: int
    max_decode_tokens: int
    max_total_tokens: int
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_prefill_tokens", "max_decode_tokens", "max_total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} = {v!r}, expected an int >= 1")

    def reset(self) -> None:
        self.prefill_tokens = 0
        self.decode_tokens = 0

    def total_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def remaining_prefill(self) -> int:
        return max(0, min(self.max_prefill_tokens - self.prefill_tokens,
                          self.max_total_tokens - self.total_tokens()))

    def remaining_decode(self) -> int:
        return max(0, min(self.max_decode_tokens - self.decode_tokens,
                          self.max_total_tokens - self.total_tokens()))

    def try_allocate_prefill(self, tokens: int) -> bool:
        if tokens <= self.remaining_prefill():
            self.prefill_tokens += tokens
            return True
        return False

    def try_allocate_decode(self) -> bool:
        if self.remaining_decode() > 0:
            self.decode_tokens += 1
            return True
        return False

    def is_exhausted(self) -> bool:
        return self.total_tokens() >= self.max_total_tokens
