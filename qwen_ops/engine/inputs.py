"""The one builder of a step's tensors: ``InputBuilder.build(chunks)`` turns a step's tasks into
what the model's forward takes, and records the step's row layout, for every kind of step:

- "decode" (one token per sequence, at most the largest bucket of sequences) and "verify" (decodes
  with drafts, ``verify_rows`` rows per sequence): copied into static buffers sized for the
  largest bucket, so a compiled step sees a handful of shapes and a CUDA graph replays the same
  addresses. A padded step (compiled or graph) fills the buffers up to its bucket with slot -1
  rows, which read and write nothing; an eager one uses the first rows as they are.
- "eager" (prefill, mixed and oversized batches) and "pool" (the pooling runner's chunks): flat
  tensors of the step's exact size.

The layout (``StepInputs``): where each task's rows start in the forward (``row_starts``) and which
forward rows hold the logits ``ModelRunner.execute`` returns (``num_logit_rows`` per task, in task
order); ``finish`` cuts the forward's output to it. Executors (``engine/executors.py``) only run
what is built here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.ops.metadata import AttentionMetadata


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 8 up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    sizes += list(range(24, max_batch, 8))
    return sizes + [max_batch]


def spread_rows(logits: torch.Tensor, keep: Sequence[int], n: int) -> torch.Tensor:
    """fp32 ``[n, vocab]`` whose row ``keep[j]`` is ``logits[j]``; the other rows (chunks whose logits
    nobody reads: ``BatchedRequest.needs_logits``) NaN. Runs of consecutive rows are copied (and
    widened) in one go."""
    out = torch.empty((n, logits.shape[-1]), dtype=torch.float32, device=logits.device)
    kept = set(keep)
    out[[i for i in range(n) if i not in kept]] = float("nan")
    j = 0
    while j < len(keep):
        e = j + 1
        while e < len(keep) and keep[e] == keep[e - 1] + 1:
            e += 1
        out[keep[j]:keep[j] + e - j].copy_(logits[j:e])
        j = e
    return out


@dataclass
class StepInputs:
    """One step's forward inputs and its row layout.

    ``kind``: "decode", "verify", "eager" or "pool". ``bucket``: the sequences the static buffers
    hold this step (padded to a bucket for compiled and captured steps). ``args``: the forward's
    inputs (static: the buffers' views, ``(input_ids, positions, ..., logits_indices)``; eager and
    pool: ``(input_ids, positions, AttentionMetadata, logits_indices)``). ``row_starts``: the
    forward row where each task starts. ``n``: tasks. ``keep``: eager steps, the tasks that have a
    logits row (None: all). ``out_rows``: verify steps, the output rows of ``execute``'s layout.
    ``wide``: eager steps whose rows stay in the model's dtype (a scored prompt's). ``logit_starts``
    and ``num_rows``: the logits-row layout of ``finish``'s output (``logit_rows``)."""

    kind: str
    bucket: int
    args: tuple
    row_starts: list[int]
    n: int
    keep: Optional[list[int]] = None
    out_rows: Optional[torch.Tensor] = None
    wide: bool = False
    logit_starts: Optional[list[int]] = None    # set by build: each task's first row in finish's output
    num_rows: int = 0

    def logit_rows(self) -> tuple[list[int], list[int]]:
        """``(first, last)`` row of each task in ``finish``'s output (``num_logit_rows`` each): the one
        place that says which logits rows are a request's; the sampler, verification and prompt
        logprobs read it from here."""
        starts = self.logit_starts
        ends = starts[1:] + [self.num_rows]
        return starts, [e - 1 for e in ends]

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """The forward's output cut to ``ModelRunner.execute``'s layout: fp32 logits, ``num_logit_rows``
        per task (NaN rows for tasks whose logits nobody reads); the pooling runner's hidden rows as
        they are."""
        if self.kind == "pool":
            return out
        if self.kind == "decode":
            return out[:self.n].float()
        if self.kind == "verify":
            return out[self.out_rows].float()
        if self.wide:
            return out
        if self.keep is None or len(self.keep) == self.n:
            return out.float()
        return spread_rows(out, self.keep, self.n)


class InputBuilder:
    """The static decode and verify buffers of ``runner`` and the builder of every step's inputs."""

    def __init__(self, runner, buckets: Optional[Sequence[int]]):
        self.runner = runner
        self.device = runner.device
        self.buckets = sorted(set(buckets)) if buckets else decode_buckets(runner.block_table.shape[0])
        if self.buckets[0] < 1:
            raise ValueError(f"buckets = {list(buckets)}, expected sizes >= 1")
        n, dev = self.buckets[-1], self.device
        # Static decode inputs for the largest bucket; a batch of B uses the first B rows.
        self.buf_input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.buf_positions = torch.zeros(n, dtype=torch.int32, device=dev)
        self.buf_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)   # slot_ids == seq_slots in decode
        self.buf_seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.buf_query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # never changes
        self.buf_logits_indices = torch.arange(n, dtype=torch.long, device=dev)        # never changes
        self.verify_rows: Optional[int] = None       # set_verify_rows

    def set_verify_rows(self, rows: int) -> None:
        """Static buffers for verify steps: ``rows`` rows per sequence (``num_speculative_tokens + 1``),
        for the largest bucket of sequences (B sequences are B x rows query rows; rows a sequence
        does not fill carry slot -1)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
            raise ValueError(f"rows = {rows!r}, expected an int >= 2 (num_speculative_tokens + 1)")
        self.verify_rows = rows
        # A sequence's R rows take positions offset .. offset + R - 1 even where it has fewer tokens:
        # they must stay inside its block-table row and the model's RoPE table (else: eager).
        runner = self.runner
        rope = getattr(getattr(getattr(runner.model, "model", None), "rotary_emb", None), "cos_sin", None)
        self._verify_max_len = runner.block_table.shape[1] * runner.block_size
        if rope is not None:
            self._verify_max_len = min(self._verify_max_len, rope.shape[0])
        n, dev = self.buckets[-1], self.device
        self.vbuf_input_ids = torch.zeros(n * rows, dtype=torch.long, device=dev)
        self.vbuf_positions = torch.zeros(n * rows, dtype=torch.int32, device=dev)
        self.vbuf_slot_ids = torch.full((n * rows,), -1, dtype=torch.int32, device=dev)
        self.vbuf_seq_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.vbuf_seq_lens = torch.full((n,), rows, dtype=torch.int32, device=dev)
        self.vbuf_query_start_loc = torch.arange(0, n * rows + 1, rows, dtype=torch.int32, device=dev)
        self.vbuf_logits_indices = torch.arange(n * rows, dtype=torch.long, device=dev)

    # ------------------------------------------------------------------ which kind of step
    def bucket_for(self, n: int) -> Optional[int]:
        """The smallest bucket holding ``n`` sequences, or None above the largest."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def is_static_decode(self, chunks: Sequence[BatchedRequest]) -> bool:
        """One token per sequence and no more sequences than the largest bucket: a step that the
        static decode buffers (and so the compiled step and the CUDA graphs) can take."""
        for c in chunks:               # a loop, not all(...): this runs on every step (no generator frames)
            if len(c.token_ids) != 1:
                return False
        return len(chunks) <= self.buckets[-1]

    def is_static_verify(self, chunks: Sequence[BatchedRequest]) -> bool:
        """Decodes only, some with drafts, each within ``verify_rows`` rows, no more sequences than the
        largest bucket. Hybrid models only when every decode fills its rows (a padding row would
        advance its linear-layer state, which the rollback restores only after a rejection)."""
        rows = self.verify_rows
        if rows is None or len(chunks) > self.buckets[-1] or any(c.is_prefill or len(c.token_ids) > rows
                                                                 or c.position_offset + rows > self._verify_max_len
                                                                 for c in chunks):
            return False
        if not any(c.draft_token_ids for c in chunks):
            return False
        return "linear" not in self.runner.layer_kinds or all(len(c.token_ids) == rows for c in chunks)

    def kind_of(self, chunks: Sequence[BatchedRequest]) -> str:
        if self.runner.pooling:              # the pooling runner's steps are all eager prefill chunks
            return "pool"
        if self.is_static_decode(chunks):
            return "decode"
        return "verify" if self.is_static_verify(chunks) else "eager"

    # ------------------------------------------------------------------ building
    def build(self, chunks: Sequence[BatchedRequest], kind: str, padded: bool) -> StepInputs:
        """The inputs of a step of ``kind`` (``kind_of``); ``padded``: static buffers filled up to the
        bucket (compiled and captured steps), else to the batch's exact size."""
        step = self._build(chunks, kind, padded)
        if kind == "decode":             # one row each
            step.logit_starts, step.num_rows = list(range(len(chunks))), len(chunks)
            return step
        starts, at = [], 0
        for c in chunks:
            starts.append(at)
            at += c.num_logit_rows if kind != "pool" else len(c.pool_rows)
        step.logit_starts, step.num_rows = starts, at
        return step

    def _build(self, chunks: Sequence[BatchedRequest], kind: str, padded: bool) -> StepInputs:
        n = len(chunks)
        if kind == "decode":
            bucket = self.bucket_for(n) if padded else n
            self.fill_decode(chunks, bucket)
            return StepInputs(kind, bucket, self.decode_args(bucket), list(range(n)), n)
        if kind == "verify":
            bucket = self.bucket_for(n) if padded else n
            self.fill_verify(chunks, bucket)
            R = self.verify_rows
            rows = torch.tensor([i * R + j for i, c in enumerate(chunks) for j in range(c.num_logit_rows)],
                                device=self.device)
            return StepInputs(kind, bucket, self.verify_args(bucket), [i * R for i in range(n)], n, out_rows=rows)
        return self.eager(chunks, kind)

    def fill_decode(self, chunks: Sequence[BatchedRequest], bucket: int) -> None:
        """Copy a decode batch into the static buffers; rows n..bucket-1 become slot -1 padding."""
        n = len(chunks)
        host = torch.tensor([[c.token_ids[0], c.position_offset, c.kv_cache_slot, c.position_offset + 1] for c in chunks]
                            + [[0, 0, -1, 1]] * (bucket - n), dtype=torch.long)
        host = host.to(self.device, non_blocking=True)
        self.buf_input_ids[:bucket].copy_(host[:, 0])
        self.buf_positions[:bucket].copy_(host[:, 1])
        self.buf_slots[:bucket].copy_(host[:, 2])
        self.buf_seq_lens[:bucket].copy_(host[:, 3])
        lora = self.runner.lora_context
        if lora is not None:       # its buffer is a static input of the compiled step and graphs
            lora.set_indices(torch.tensor([c.lora_slot for c in chunks] + [-1] * (bucket - n), dtype=torch.int32))

    def decode_args(self, bucket: int) -> tuple[torch.Tensor, ...]:
        return (self.buf_input_ids[:bucket], self.buf_positions[:bucket], self.buf_slots[:bucket],
                self.buf_query_start_loc[:bucket + 1], self.buf_seq_lens[:bucket], self.buf_logits_indices[:bucket])

    def fill_verify(self, chunks: Sequence[BatchedRequest], bucket: int) -> None:
        """Copy a verify batch into the static buffers: sequence i owns rows i*R .. i*R+R-1 at
        positions offset.., the rows past its tokens and the sequences past the batch slot -1."""
        R, n = self.verify_rows, len(chunks)
        rows: list[list[int]] = []                      # (token, position, slot) per row
        for c in chunks:
            m, p0, slot = len(c.token_ids), c.position_offset, c.kv_cache_slot
            rows += [[t, p0 + j, slot] for j, t in enumerate(c.token_ids)]
            rows += [[0, p0 + j, -1] for j in range(m, R)]
        rows += [[0, 0, -1]] * ((bucket - n) * R)
        host = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        seq = torch.tensor([[c.kv_cache_slot, c.position_offset + R] for c in chunks] + [[-1, R]] * (bucket - n),
                           dtype=torch.long).to(self.device, non_blocking=True)
        total = bucket * R
        lora = self.runner.lora_context
        if lora is not None:
            lora.set_indices(torch.tensor([c.lora_slot for c in chunks for _ in range(R)] + [-1] * ((bucket - n) * R),
                                          dtype=torch.int32))
        self.vbuf_input_ids[:total].copy_(host[:, 0])
        self.vbuf_positions[:total].copy_(host[:, 1])
        self.vbuf_slot_ids[:total].copy_(host[:, 2])
        self.vbuf_seq_slots[:bucket].copy_(seq[:, 0])
        self.vbuf_seq_lens[:bucket].copy_(seq[:, 1])

    def verify_args(self, bucket: int) -> tuple[torch.Tensor, ...]:
        rows = bucket * self.verify_rows
        return (self.vbuf_input_ids[:rows], self.vbuf_positions[:rows], self.vbuf_slot_ids[:rows],
                self.vbuf_seq_slots[:bucket], self.vbuf_query_start_loc[:bucket + 1], self.vbuf_seq_lens[:bucket],
                self.vbuf_logits_indices[:rows])

    def eager(self, chunks: Sequence[BatchedRequest], kind: str = "eager") -> StepInputs:
        """Flat inputs of the step's exact size. Its logits rows: every row of a task that scores its
        prompt or carries drafts (``num_logit_rows``), else each task's last row, for the tasks whose
        logits someone reads (``needs_logits``); the pooling runner's: each task's ``pool_rows``."""
        token_ids: list[int] = []
        positions: list[int] = []
        slot_ids: list[int] = []
        seq_slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        lora: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            lora.extend([c.lora_slot] * n)
            token_ids.extend(c.token_ids)
            positions.extend(range(c.position_offset, c.position_offset + n))
            slot_ids.extend([c.kv_cache_slot] * n)
            seq_slots.append(c.kv_cache_slot)
            seq_lens.append(c.position_offset + n)
            query_start_loc.append(query_start_loc[-1] + n)
        dev = self.device

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(dev, non_blocking=True)

        attn = AttentionMetadata(
            slot_ids=i32(slot_ids), seq_slots=i32(seq_slots), block_table=self.runner.block_table,
            query_start_loc=i32(query_start_loc), seq_lens=i32(seq_lens),
            max_query_len=max(len(c.token_ids) for c in chunks))
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(dev, non_blocking=True)
        if self.runner.lora_context is not None:
            self.runner.lora_context.set_indices(torch.tensor(lora, dtype=torch.int32))
        keep, wide = None, False
        if kind == "pool":
            rows = [start + r for c, start in zip(chunks, query_start_loc) for r in c.pool_rows]
        elif any(c.prompt_logprob_ids or c.draft_token_ids for c in chunks):
            rows = [end - c.num_logit_rows + j for c, end in zip(chunks, query_start_loc[1:])
                    for j in range(c.num_logit_rows)]
            # A scored prompt's rows stay in the model's dtype: the runner widens the rows it samples
            # from, and prompt_logprobs a chunk at a time (all of them at once: 1.2 GB at 2,000 x 151,936).
            wide = any(c.prompt_logprob_ids for c in chunks)
        else:
            keep = [i for i, c in enumerate(chunks) if c.needs_logits]
            rows = [query_start_loc[i + 1] - 1 for i in keep]
        logits_indices = torch.tensor(rows, dtype=torch.long).to(dev)
        return StepInputs(kind, len(chunks), (input_ids, i32(positions), attn, logits_indices), query_start_loc[:-1],
                          len(chunks), keep=keep, wide=wide)
