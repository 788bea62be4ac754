"""What one forward pass runs, in the seed's vocabulary (``batch.rs``).

A ``BatchedRequest`` is one scheduled item: a request's ``token_ids`` at positions
``position_offset, position_offset + 1, ...`` of its slot ``kv_cache_slot``. It is what the
runner executes; a ``ScheduledBatch`` is one forward pass's worth of them (prefill chunks and
decodes together). The slot's blocks are not carried: the runner keeps the block table.

Unlike the seed, a prefill may start mid-prompt (chunked prefill, recompute), so
``position_offset`` / ``context_len`` are honoured for prefills too.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence


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


@dataclass(frozen=True)
class BatchedRequest:
    """One request's rows in a forward pass: ``token_ids`` at ``position_offset, ...`` of slot
    ``kv_cache_slot``. ``is_prefill`` is False for a decode (one sampled token fed back)."""

    kv_cache_slot: int
    token_ids: Sequence[int]
    position_offset: int
    request_id: Optional[RequestId] = None
    is_prefill: bool = True

    @property
    def context_len(self) -> int:
        """Tokens in the slot's cache before this pass."""
        return self.position_offset

    @property
    def seq_len(self) -> int:
        """Tokens in the slot's cache after this pass."""
        return self.position_offset + len(self.token_ids)

    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class ScheduledBatch:
    """One forward pass: prefill chunks first, then decodes."""

    batch_id: int
    requests: list[BatchedRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)
