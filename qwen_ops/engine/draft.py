"""The draft model of ``"method": "draft_model"`` speculative decoding (issue 29): a smaller
checkpoint with the target's vocabulary, run by a ``ModelRunner`` of its own whose KV cache has the
target's block layout, so the target's slots and block ids address it too (the scheduler's blocks
hold both models' KV for the same tokens; swap copies both).

Every step the draft first sees what the target sees: one forward pass over each task's tokens (a
prefill chunk, a plain decode, a verifying decode's last token), so its KV never falls behind. For
a decode with k draft places (the scheduler reserved budget and blocks for them), the logits of its
last token give draft 1, and k - 1 more one-token passes give drafts 2..k; sampled requests draw
them from the draft's filtered distribution ``q`` (kept for rejection sampling) with the request's
own noise (its uniform for a draft at that output position). The draft has then fed the last token
and drafts 1..k-1. After verification the target keeps the last token and m accepted drafts; when
m = k the draft has not fed draft k, which is remembered (``pending``, per slot, carried through
swap) and fed first in the request's next step.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional, Sequence

import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.runner import ModelRunner
from qwen_ops.engine.sampling import DRAFT, cdf_pick, filtered_probs, uniforms


def pick_drafts(logits: torch.Tensor, tasks: Sequence[BatchedRequest], index: int) -> tuple[list[int], list]:
    """Draft ``index`` (0 = the first) of each task from a proposer's logits rows: greedy, the argmax;
    sampled, a draw from the proposer's filtered distribution ``q`` (``sampling.filtered_probs``, the
    plain sampler's filters) with the request's uniform for a draft at its output position; and ``q``
    per sampled row (None for greedy rows): rejection sampling against ``q`` keeps the target's
    distribution. A row with nothing to draw from (NaN logits) drafts its argmax as a point mass."""
    params = [t.sampling for t in tasks]
    x = logits.float()
    tokens = x.nan_to_num(nan=float("-inf")).argmax(dim=-1).tolist()
    qs: list[Optional[torch.Tensor]] = [None] * len(tasks)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        probs = filtered_probs(x[sampled], [params[i] for i in sampled])
        u = uniforms([tasks[i].generator for i in sampled], [tasks[i].output_index + index for i in sampled], DRAFT)
        picks = cdf_pick(probs, u).tolist()
        for j, i in enumerate(sampled):
            if float(probs[j].sum()) > 0:
                tokens[i], qs[i] = picks[j], probs[j]
            else:
                qs[i] = torch.zeros_like(probs[j]).index_fill_(0, torch.tensor([tokens[i]], device=probs.device), 1.0)
    return tokens, qs


def with_drafts(task: BatchedRequest, drafts: list[int], probs: list) -> BatchedRequest:
    """``task`` with its draft places filled: ``drafts`` after its context, and for a sampled request
    the proposer's ``q`` of each (``probs``) for rejection sampling."""
    ctx = list(task.token_ids[:len(task.token_ids) - len(task.draft_token_ids)])
    q = None if task.sampling.greedy else torch.stack(probs)
    return replace(task, token_ids=ctx + drafts, draft_token_ids=tuple(drafts), draft_probs=q)


class RunnerProposer:
    """A proposer that fills the draft places in the runner (a draft model, the MTP layer):
    ``propose(tasks)`` runs the subclass's ``_propose`` and adds its wall time to ``seconds``
    (benchmarks: the proposer's share of a step)."""

    seconds = 0.0

    def propose(self, tasks: Sequence[BatchedRequest]) -> list[BatchedRequest]:
        """The tasks with their draft places filled (and ``draft_probs``); see the module docstring."""
        t0 = time.perf_counter()
        try:
            return self._propose(tasks)
        finally:
            self.seconds += time.perf_counter() - t0


class DraftRunner(RunnerProposer):
    def __init__(self, model: torch.nn.Module, target) -> None:
        if "linear" in getattr(model, "layer_kinds", ()):
            raise ValueError("speculative_config.model has linear-attention (Gated DeltaNet) layers; expected a "
                             "draft model with attention layers only (its state could not follow rejections)")
        rows, cols = target.block_table.shape
        self.runner = ModelRunner(model, num_blocks=target.num_blocks, block_size=target.block_size, max_slots=rows,
                                  max_blocks_per_slot=cols, dtype=target.dtype, device=target.device,
                                  native_cpu=target.native_cpu, kv_dtype=target.kv_dtype)
        # slot -> (request id, position, token): a kept draft the draft model has not fed yet.
        self.pending: dict[int, tuple] = {}

    def _propose(self, tasks: Sequence[BatchedRequest]) -> list[BatchedRequest]:
        feed = []
        for t in tasks:
            ctx = list(t.token_ids[:len(t.token_ids) - len(t.draft_token_ids)])
            start = t.position_offset
            lag = self.pending.pop(t.kv_cache_slot, None)
            if lag is not None and lag[0] == t.request_id and lag[1] == start - 1:
                ctx, start = [lag[2]] + ctx, start - 1
            feed.append(t.rows(ctx, start))
        logits = self.runner.execute(feed)
        spec = [i for i, t in enumerate(tasks) if t.draft_token_ids]
        if not spec:
            return list(tasks)
        drafts: dict[int, list[int]] = {i: [] for i in spec}
        probs: dict[int, list] = {i: [] for i in spec}
        tokens, qs = pick_drafts(logits[spec], [tasks[i] for i in spec], 0)
        for i, tok, q in zip(spec, tokens, qs):
            drafts[i].append(tok)
            probs[i].append(q)
        for j in range(1, max(len(tasks[i].draft_token_ids) for i in spec)):
            live = [i for i in spec if len(tasks[i].draft_token_ids) > j]
            step = [tasks[i].rows([drafts[i][-1]], tasks[i].seq_len - len(tasks[i].draft_token_ids) - 1 + j, False)
                    for i in live]
            logits = self.runner.execute(step)
            tokens, qs = pick_drafts(logits, [tasks[i] for i in live], j)
            for i, tok, q in zip(live, tokens, qs):
                drafts[i].append(tok)
                probs[i].append(q)
        out = list(tasks)
        for i in spec:
            out[i] = with_drafts(tasks[i], drafts[i], probs[i])
        return out

    def kept(self, tasks: Sequence[BatchedRequest], emitted: Sequence[Optional[list[int]]], hidden=None,
             row_starts=None) -> None:
        """After verification: remember draft k of every decode that kept all k (fed next step)."""
        for t, e in zip(tasks, emitted):
            k = len(t.draft_token_ids)
            if e is not None and k and len(e) - 1 == k:
                self.pending[t.kv_cache_slot] = (t.request_id, t.seq_len - 1, t.draft_token_ids[-1])
