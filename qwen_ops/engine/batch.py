"""What one step runs, in the seed's vocabulary (``batch.rs``): the scheduler builds it, the
runner executes it, nothing else is carried between them.

A ``BatchedRequest`` is one scheduled item: a request's ``token_ids`` at positions
``position_offset, position_offset + 1, ...`` of its slot ``kv_cache_slot``, whose KV lives in
the blocks ``block_table`` names. With ``sampling`` set the chunk reaches the end of the
request's tokens and the runner samples its next token, output position ``output_index``, with
the uniforms of ``generator`` at that position (a seeded request's; ``banned_token_ids`` cannot be
sampled: stop tokens before ``min_tokens``). A decode
with ``draft_token_ids`` (speculative decoding) carries them at the end of ``token_ids``, after
the last sampled token: the runner verifies them from the logits of those ``1 + k`` rows.

An ``IterationPlan`` is one step: its prefill chunks and decodes (one forward, prefills first),
the KV copies to host and back (``swap_out_requests`` / ``swap_in_requests``, ``BlockCopy``
each, applied before the forward), the host copies no longer needed (``freed_swaps``), and the
requests preempted by recompute (``evicted_requests``). ``TokenBudget`` is one iteration's
token limits, which the scheduler spends as it plans (overspending raises).

Unlike the seed, a prefill may start mid-prompt (chunked prefill, recompute, a cached prefix),
so ``position_offset`` (the tokens already in the slot's cache) is honoured for prefills too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence


@dataclass(frozen=True, order=True)
class RequestId:
    """A request identifier: the engine core numbers requests in arrival order (its own counter,
    no process-wide one)."""

    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class BatchedRequest:
    """One request's rows in a forward pass (module docstring). ``is_prefill`` is False for a
    decode (one sampled token fed back)."""

    kv_cache_slot: int
    token_ids: Sequence[int]
    position_offset: int
    request_id: Optional[RequestId] = None
    is_prefill: bool = True
    block_table: Sequence[int] = ()          # the slot's block ids, covering seq_len tokens
    sampling: Any = None                     # SamplingParams: sample this row's next token
    generator: Any = None                    # the request's SeededNoise (None: torch's default generator)
    output_index: int = 0                    # the output position of the token it samples (tokens generated so far)
    banned_token_ids: Sequence[int] = ()     # not sampleable this step (stop ids before min_tokens)
    draft_token_ids: Sequence[int] = ()      # speculative drafts: the last len() of token_ids
    draft_probs: Any = None                  # [k, vocab] the draft model's q of each draft (sampled rows)
    history: Any = None                      # (prompt ids, output ids): penalties and bad words read them
    grammar: Any = None                      # the request's xgrammar GrammarMatcher (structured outputs)
    # Prompt logprobs: the prompt tokens that follow this chunk's first rows (row i predicts
    # prompt_logprob_ids[i]), and how many top tokens to report with each (None: not asked).
    prompt_logprob_ids: Sequence[int] = ()
    prompt_logprobs: Optional[int] = None
    lora_slot: int = -1                      # the model's LoRA slot of the request's adapter; -1: none
    # Pooling (engine/pooling.py): the request's PoolingTask, and the rows of this chunk it reads.
    pooling: Any = None
    pool_rows: Sequence[int] = ()
    # False for a prompt chunk that neither ends its prompt nor scores it: nothing reads its row of
    # logits, so the LM head skips it (a 2,000-token prompt in chunks of 512: three LM heads of
    # 151,936 x 1,024 fewer, 65 ms of a 3 s prefill). Its row of RunnerOutput.logits is NaN.
    needs_logits: bool = True

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits this task needs: its last token's, and one per draft; every row of a
        chunk that scores its prompt tokens."""
        if self.prompt_logprob_ids:
            return len(self.token_ids)
        return 1 + len(self.draft_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the slot's cache after this pass."""
        return self.position_offset + len(self.token_ids)

    def rows(self, token_ids: Sequence[int], position_offset: int, is_prefill: bool = True) -> "BatchedRequest":
        """Other rows of the same request, slot and blocks, with nothing sampled: a proposer's feed
        of its own cache, the hybrid rollback's re-run of the kept tokens. Tasks are made from a
        ``Request`` (``Request.task``) or from another task here, nowhere else."""
        return BatchedRequest(self.kv_cache_slot, list(token_ids), position_offset, self.request_id, is_prefill,
                              self.block_table, lora_slot=self.lora_slot)


@dataclass(frozen=True)
class BlockCopy:
    """KV blocks of one sequence copied to host memory (swap out) or back (swap in): the copy
    is named by ``handle`` on every rank; ``slot`` is the row of linear-layer state."""

    request_id: Optional[RequestId]
    handle: int
    slot: int
    block_ids: tuple[int, ...]


@dataclass
class IterationPlan:
    prefill_tasks: list[BatchedRequest] = field(default_factory=list)
    decode_tasks: list[BatchedRequest] = field(default_factory=list)
    evicted_requests: list[RequestId] = field(default_factory=list)
    swap_out_requests: list[BlockCopy] = field(default_factory=list)
    swap_in_requests: list[BlockCopy] = field(default_factory=list)
    freed_swaps: list[int] = field(default_factory=list)       # host copies to drop (handles)

    @classmethod
    def empty(cls) -> "IterationPlan":
        return cls()

    def has_work(self) -> bool:
        return bool(self.prefill_tasks or self.decode_tasks)

    def tasks(self) -> list[BatchedRequest]:
        """Prefill chunks first, then decodes: the rows of one forward pass, in order."""
        return self.prefill_tasks + self.decode_tasks if self.prefill_tasks else self.decode_tasks

    def total_requests(self) -> int:
        return len(self.prefill_tasks) + len(self.decode_tasks)

    def total_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.prefill_tasks) + sum(len(t.token_ids) for t in self.decode_tasks)

    def without_sampling(self) -> "IterationPlan":
        """The plan as a rank that does not sample gets it (no generators: they do not travel)."""
        strip = [replace(t, sampling=None, generator=None, banned_token_ids=(), history=None, grammar=None,
                         prompt_logprobs=None) for t in self.tasks()]
        n = len(self.prefill_tasks)
        return IterationPlan(strip[:n], strip[n:], list(self.evicted_requests), list(self.swap_out_requests),
                             list(self.swap_in_requests), list(self.freed_swaps))


@dataclass
class TokenBudget:
    """One iteration's token limits (a new budget each iteration); the scheduler spends it with
    ``allocate_prefill`` / ``allocate_decode``, which refuse to overspend."""

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
                          self.max_total_tokens - self.prefill_tokens - self.decode_tokens))

    def allocate_prefill(self, tokens: int) -> None:
        if tokens > self.remaining_prefill():
            raise ValueError(f"tokens = {tokens}, but only {self.remaining_prefill()} prefill tokens remain "
                             f"in this iteration's budget")
        self.prefill_tokens += tokens

    def allocate_decode(self, tokens: int = 1) -> None:
        """One decode's tokens: its sampled token, and its drafts under speculative decoding."""
        if tokens > self.remaining_decode() or tokens < 1:
            left = self.remaining_decode()
            raise ValueError(f"tokens = {tokens} decode tokens were asked for, but "
                             + (f"only {left}" if left else "no decode tokens") + " remain in this iteration's budget")
        self.decode_tokens += tokens
