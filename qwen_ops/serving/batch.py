"""What the scheduler plans each iteration (the seed's ``IterationPlan`` and ``TokenBudget``).

The plan's tasks are the engine's ``BatchedRequest`` items (``qwen_ops/engine/batch.py``), the
type the runner executes: prefill chunks and decodes, which ``to_scheduled_batch`` merges into
one forward pass, plus the requests preempted or swapped in this iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwen_ops.engine.batch import BatchedRequest, RequestId, ScheduledBatch


@dataclass
class IterationPlan:
    prefill_tasks: list[BatchedRequest] = field(default_factory=list)
    decode_tasks: list[BatchedRequest] = field(default_factory=list)
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
        return sum(len(t.token_ids) for t in self.prefill_tasks) + len(self.decode_tasks)

    def to_scheduled_batch(self, batch_id: int) -> ScheduledBatch:
        """Prefill chunks first, then decodes: one forward pass for both."""
        return ScheduledBatch(batch_id, self.prefill_tasks + self.decode_tasks)


@dataclass
class TokenBudget:
    """One iteration's token limits (a new budget each iteration)."""

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
