"""The MTP proposer of ``"method": "mtp"`` speculative decoding (issue 29): the checkpoint's own
multi-token-prediction layer (``models/mtp.py``) run by a ``ModelRunner`` of its own whose KV cache
has the target's block layout, so the target's slots and block ids address it too (swap copies both).

Row p of an MTP pass needs the target's final hidden state at p and the token at p + 1. The target
yields the hidden states of every row of its forward (``keep_hidden``); after each step the rows whose
tokens were kept (a prefill chunk's rows, a decode's row, a verification's row and its accepted
drafts' rows) are remembered per slot (``pending``: first position, hidden states, and the tokens
after each row but the last). The next step that schedules the request first runs those rows through
the MTP layer (its token after the last row is the token the target feeds now), which writes the MTP
KV of those positions; the last row's logits give draft 1, and k - 1 one-token passes, each on the
layer's own output, give drafts 2..k. Drafted positions of the MTP KV that the target rejects are
rewritten by the next catch-up before anything reads them (the catch-up starts where the target's
kept tokens start). Greedy drafts are the argmax; sampled ones are drawn from the MTP's filtered
distribution ``q`` and verified by rejection sampling, as a draft model's. A decode with draft
places but nothing remembered for its slot (never the case after a prefill; a preempted request
re-prefills) drafts its own last token (a point mass, verified like an n-gram draft).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.draft import RunnerProposer, pick_drafts, with_drafts
from qwen_ops.engine.runner import ModelRunner


class MTPRunner(RunnerProposer):
    def __init__(self, target_model: torch.nn.Module, target) -> None:
        from qwen_ops.models.mtp import MTPModel

        if target.compiled or target.cuda_graphs:
            raise ValueError("speculative_config.method = 'mtp' runs the target eagerly (it reads every row's hidden "
                             "state); expected compile=False and cuda_graphs=False")
        self.model = MTPModel(target_model)
        self.target_model, self.target = target_model, target
        target_model.keep_hidden = True
        rows, cols = target.block_table.shape
        self.runner = ModelRunner(self.model, num_blocks=target.num_blocks, block_size=target.block_size,
                                  max_slots=rows, max_blocks_per_slot=cols, dtype=target.dtype, device=target.device,
                                  native_cpu=target.native_cpu, kv_dtype=target.kv_dtype)
        # slot -> (request id, first position, tokens after each row but the last, hidden states [n, H])
        self.pending: dict[int, tuple] = {}

    def _pass(self, feed: list[BatchedRequest], hidden: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One MTP pass: logits of each feed task's last row and that row's normed output."""
        self.model.hidden_in = torch.cat(hidden)
        try:
            logits = self.runner.execute(feed)
            out = self.model.hidden_out
        finally:
            self.model.hidden_in = None
        ends = torch.tensor([len(t.token_ids) for t in feed]).cumsum(0) - 1
        return logits, [out[int(e)].unsqueeze(0) for e in ends]

    def _propose(self, tasks: Sequence[BatchedRequest]) -> list[BatchedRequest]:
        """Catch the MTP KV up with every task's remembered rows, then fill the draft places."""
        feed, hidden, fed = [], [], []
        for i, t in enumerate(tasks):
            got = self.pending.pop(t.kv_cache_slot, None)
            if got is None:
                continue
            rid, first, after, rows = got
            if rid != t.request_id or first + rows.shape[0] != t.position_offset:
                continue                 # stale (the slot changed hands or the request restarted)
            feed.append(t.rows(list(after) + [t.token_ids[0]], first))
            hidden.append(rows)
            fed.append(i)
        out = list(tasks)
        spec = [i for i, t in enumerate(tasks) if t.draft_token_ids]
        if not spec:
            if feed:
                self._pass(feed, hidden)
            return out
        drafts: dict[int, list[int]] = {i: [] for i in spec}
        probs: dict[int, list] = {i: [] for i in spec}
        live: list[int] = []
        last: dict[int, torch.Tensor] = {}
        if feed:
            logits, outs = self._pass(feed, hidden)
            rows_of = {i: j for j, i in enumerate(fed)}
            live = [i for i in spec if i in rows_of]
            if live:
                picked, qs = pick_drafts(logits[[rows_of[i] for i in live]], [tasks[i] for i in live], 0)
                for i, tok, q in zip(live, picked, qs):
                    drafts[i].append(tok)
                    probs[i].append(q)
                    last[i] = outs[rows_of[i]]
        for j in range(1, max(len(tasks[i].draft_token_ids) for i in spec)):
            live = [i for i in live if len(tasks[i].draft_token_ids) > j]
            if not live:
                break
            step = [tasks[i].rows([drafts[i][-1]], tasks[i].position_offset - 1 + j, False) for i in live]
            logits, outs = self._pass(step, [last[i] for i in live])
            picked, qs = pick_drafts(logits, [tasks[i] for i in live], j)
            for n, (i, tok, q) in enumerate(zip(live, picked, qs)):
                drafts[i].append(tok)
                probs[i].append(q)
                last[i] = outs[n]
        for i in spec:
            t = tasks[i]
            if drafts[i]:
                out[i] = with_drafts(t, drafts[i], probs[i])
            else:                        # nothing remembered for this slot: a point-mass draft
                k = len(t.draft_token_ids)
                ctx = list(t.token_ids[:len(t.token_ids) - k])
                out[i] = replace(t, token_ids=ctx + [ctx[-1]] * k, draft_token_ids=(ctx[-1],) * k, draft_probs=None)
        return out

    def kept(self, tasks: Sequence[BatchedRequest], emitted: Sequence[Optional[list[int]]],
             hidden: Optional[torch.Tensor], row_starts: Sequence[int]) -> None:
        """After the target's step: remember, per slot, the rows whose tokens were kept (their hidden
        states in ``hidden``, the target's forward rows, task i's from ``row_starts[i]``: the step's
        layout, not that of a rollback's re-run) for the next step's catch-up."""
        if hidden is None:
            return
        for t, e, start in zip(tasks, emitted, row_starts):
            k = len(t.draft_token_ids)
            n = len(t.token_ids) - k + (len(e) - 1 if k and e is not None else 0)
            self.pending[t.kv_cache_slot] = (t.request_id, t.position_offset, list(t.token_ids[1:n]),
                                             hidden[start:start + n].detach().clone())
