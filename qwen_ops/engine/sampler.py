"""A step's sampling, for the model runner: the tokens of the rows that end a request's tokens
(``sample_rows``: ``min_tokens``' banned stop tokens, logits processing, grammar masks, the pick and
logprobs), speculative verification (``verify``), prompt logprobs, and the grammars' token
bitmasks (filled beside the forward pass when that pays).

Every pick goes through ``sampling.sample`` (one implementation of each filter and of the pick) with
the request's noise at the output position it decides, so plain decoding, verification and draft
proposals draw alike. A row that cannot be sampled (every logit -inf after its masks, or NaN) fails
its own request, never its batch: its task gets a ``SamplingError`` in ``RunnerOutput.errors``; and
if sampling a batch raises, the rows are sampled again one by one and only those that raise fail.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from functools import partial
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.sampling import apply_logits_processing, filtered_probs, sample, token_logprobs
from qwen_ops.engine.speculative import accept_picks, rejection_sample

logger = logging.getLogger(__name__)

# Structured outputs: a bitmask fill that took longer than this runs beside the next forward pass,
# on a worker thread; a cheaper one costs less inline than the handoff (benchmarks/README.md).
GRAMMAR_OVERLAP_MIN_S = 0.5e-3


@dataclass(frozen=True)
class SamplingError:
    """Why a task's token could not be sampled: ``bad_request`` when its own parameters leave nothing
    to sample (a client error, 400 when served), else a failure of the sampler on that row."""

    message: str
    bad_request: bool = False


def _unsatisfiable(task: BatchedRequest) -> SamplingError:
    sp = task.sampling
    causes = [name for name, on in (("allowed_token_ids", sp.allowed_token_ids), ("bad_words", sp.bad_words),
                                    ("logit_bias", sp.logit_bias), ("structured_outputs", task.grammar is not None),
                                    ("min_tokens (its stop tokens are banned)", task.banned_token_ids)) if on]
    if not causes:
        return SamplingError("no token can be sampled: the model's logits are all -inf or NaN")
    return SamplingError(f"no token can be sampled: {', '.join(causes)} leave every token masked "
                         f"(output token {task.output_index}); expected sampling parameters that allow at least "
                         "one token", bad_request=True)


def _row_by_row(rows: Sequence[int], run: Callable[[Sequence[int]], list], errors: list, what: str) -> list:
    """``run(rows)`` (one result per row), or where it raises, ``run([i])`` for each row: a row that
    raises alone gets its error in ``errors`` and None as its result."""
    try:
        return run(rows)
    except Exception:                    # noqa: BLE001 - isolated below, row by row
        logger.exception("%s of %d rows failed; retrying them one by one", what, len(rows))
    out = []
    for i in rows:
        try:
            out += run([i])
        except Exception as e:           # noqa: BLE001 - this row's request fails alone
            errors[i] = SamplingError(f"{what} failed: {type(e).__name__}: {e}")
            out.append(None)
    return out


class Sampler:
    """What the runner's step asks of sampling (module docstring); one per runner."""

    def __init__(self, vocab_size: Optional[int]):
        self.vocab_size = vocab_size
        self._grammar_pool = None    # structured outputs: the thread that fills token bitmasks
        self.grammar_overlap_min_s = GRAMMAR_OVERLAP_MIN_S   # fills slower than this go beside the forward
        self.grammar_fill_s = 0.0    # the last fill's seconds
        self.share_tokens = None     # under torchrun: broadcast rank 0's sampled tokens to every rank

    # ------------------------------------------------------------------ structured outputs
    def start_grammar_masks(self, tasks: Sequence[BatchedRequest]
                            ) -> Optional[tuple[list[int], concurrent.futures.Future]]:
        """Start filling the token bitmask of the tasks with a grammar (it depends only on tokens already
        accepted): on a worker thread, beside the forward pass, once a fill costs more than the thread
        handoff (``grammar_overlap_min_s``, judged by the last fill); a cheaper fill runs here
        (benchmarks/README.md: handing 0.04 ms of work to a thread cost 6% of the step). Returns
        ``(task indices, future of their bitmask rows)``, or None."""
        constrained = [i for i, t in enumerate(tasks) if t.grammar is not None and t.sampling is not None]
        if not constrained:
            return None
        args = ([tasks[i].grammar for i in constrained], self.vocab_size)
        if self.grammar_fill_s > self.grammar_overlap_min_s:
            if self._grammar_pool is None:
                self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qwen-ops-grammar")
            return constrained, self._grammar_pool.submit(self._fill_bitmask, *args)
        job: concurrent.futures.Future = concurrent.futures.Future()
        job.set_result(self._fill_bitmask(*args))
        return constrained, job

    def _fill_bitmask(self, matchers, vocab_size: int) -> torch.Tensor:
        """``structured.fill_bitmask``, timed (``grammar_fill_s``: the last fill's seconds)."""
        from qwen_ops.engine.structured import fill_bitmask

        t0 = time.perf_counter()
        mask = fill_bitmask(matchers, vocab_size)
        self.grammar_fill_s = time.perf_counter() - t0
        return mask

    # ------------------------------------------------------------------ plain sampling
    def sample_rows(self, tasks: Sequence[BatchedRequest], logits: torch.Tensor, grammar_mask=None
                    ) -> tuple[list[Optional[int]], list[Optional[tuple]], list[Optional[SamplingError]]]:
        """The next token of every task with ``sampling`` set, row i of fp32 ``logits`` [len(tasks),
        vocab] being task i's; its ``(logprob, rank, top ids, top logprobs)`` when its request asked for
        logprobs; and per task the ``SamplingError`` that left it without a token (else None).
        ``grammar_mask``: ``(task indices, bitmask rows)`` of the structured-output tasks."""
        n = len(tasks)
        sampled: list[Optional[int]] = [None] * n
        logprobs: list[Optional[tuple]] = [None] * n
        errors: list[Optional[SamplingError]] = [None] * n
        rows = [i for i, t in enumerate(tasks) if t.sampling is not None]
        if not rows:
            return sampled, logprobs, errors
        # partial, not a lambda: no Python frame of its own on this every-step path
        picks = _row_by_row(rows, partial(self._pick, tasks, logits=logits, grammar_mask=grammar_mask), errors,
                            "sampling")
        tokens_t = torch.tensor(picks if None not in picks else [-1 if t is None else t for t in picks],
                                dtype=torch.int64)
        if self.share_tokens is not None:
            self.share_tokens(tokens_t)
        tokens = tokens_t.tolist()
        for i, t in zip(rows, tokens):
            if t >= 0:
                sampled[i] = t
            elif errors[i] is None:
                errors[i] = _unsatisfiable(tasks[i])
        want = [i for i in rows if sampled[i] is not None and tasks[i].sampling.logprobs is not None]
        if want:
            entries = _row_by_row(want, partial(self._logprobs, tasks, logits=logits, sampled=sampled), errors,
                                  "logprobs")
            for i, e in zip(want, entries):
                if e is None:            # its logprobs failed: so does the request (it asked for them)
                    sampled[i] = None
                logprobs[i] = e
        return sampled, logprobs, errors

    @staticmethod
    def _masked(tasks: Sequence[BatchedRequest], rows: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """The rows' logits with ``min_tokens``' banned stop tokens at -inf (a copy only if some are)."""
        picked = logits if len(rows) == logits.shape[0] else logits[list(rows)]   # every row: no gather copy
        banned = [(j, tasks[i].banned_token_ids) for j, i in enumerate(rows) if tasks[i].banned_token_ids]
        if banned:
            picked = picked.clone()
            for j, ids in banned:
                picked[j, list(ids)] = float("-inf")
        return picked

    def _pick(self, tasks: Sequence[BatchedRequest], rows: Sequence[int], logits: torch.Tensor,
              grammar_mask) -> list[int]:
        """The tokens of ``rows`` (-1: nothing can be sampled), after their logits processing."""
        picked = self._masked(tasks, rows, logits)
        params, histories, noises, positions = [], [], [], []
        for i in rows:                   # one loop (this runs every step): no comprehension per list
            t = tasks[i]
            params.append(t.sampling)
            histories.append(t.history)
            noises.append(t.generator)
            positions.append(t.output_index)
        # Penalties, bias, allowed tokens, bad words (vLLM's order); logprobs stay the raw logits'. A
        # task has a history only when its request processes logits (``Request.task``).
        processed = picked
        if histories.count(None) != len(histories):
            processed = apply_logits_processing(picked, params, histories)
        if grammar_mask is not None:
            from qwen_ops.engine.structured import GrammarBackend

            where = {task: j for j, task in enumerate(rows)}
            keep = [k for k, task in enumerate(grammar_mask[0]) if task in where]
            if keep:
                if processed is picked:
                    processed = picked.clone()
                GrammarBackend.apply(processed, grammar_mask[1][keep], [where[grammar_mask[0][k]] for k in keep])
        return sample(processed, params, noises, positions).tolist()

    def _logprobs(self, tasks: Sequence[BatchedRequest], rows: Sequence[int], logits: torch.Tensor,
                  sampled: Sequence[Optional[int]]) -> list[tuple]:
        picked = self._masked(tasks, rows, logits)
        k = max(tasks[i].sampling.logprobs for i in rows)
        lp, rank, top_ids, top_lps = token_logprobs(picked, torch.tensor([sampled[i] for i in rows],
                                                                         device=picked.device), k)
        out = []
        for m, i in enumerate(rows):
            n_top = tasks[i].sampling.logprobs
            out.append((lp[m], rank[m], top_ids[m][:n_top], top_lps[m][:n_top]))
        return out

    # ------------------------------------------------------------------ speculative decoding
    def verify(self, tasks: Sequence[BatchedRequest], logits: torch.Tensor, starts: Sequence[int]
               ) -> tuple[list[Optional[list[int]]], list[Optional[SamplingError]]]:
        """The tokens each task with drafts emits (``speculative.py``), from its ``num_logit_rows`` rows
        of ``logits`` (fp32: the last token's, then one per draft), and per task the error that left it
        none. Greedy requests and deterministic drafts (n-gram's) keep the drafts that equal the plain
        sampler's pick at their row (``accept_picks``: the argmax, or the request's uniform at that
        output position: the same tokens as without speculation); a draft model's (or MTP's) sampled
        drafts go through rejection sampling with their ``q``, its bonus token the plain pick."""
        n = len(tasks)
        out: list[Optional[list[int]]] = [None] * n
        errors: list[Optional[SamplingError]] = [None] * n
        spec = [i for i, t in enumerate(tasks) if t.draft_token_ids]
        if not spec:
            return out, errors

        def picked_rows(i: int) -> tuple[int, int]:
            """(first, count) of task i's rows that get a plain pick: all k + 1 for a race, the bonus row
            alone for rejection sampling."""
            t = tasks[i]
            k = len(t.draft_token_ids)
            race = t.sampling.greedy or t.draft_probs is None
            return (0, k + 1) if race else (k, 1)

        def verify_some(some: Sequence[int]) -> list[list[int]]:
            # Every pick of every task in one batched call.
            spans = [picked_rows(i) for i in some]
            rows = torch.cat([logits[starts[i] + a:starts[i] + a + m] for i, (a, m) in zip(some, spans)])
            params = [tasks[i].sampling for i, (_, m) in zip(some, spans) for _ in range(m)]
            noises = [tasks[i].generator for i, (_, m) in zip(some, spans) for _ in range(m)]
            positions = [tasks[i].output_index + a + j for i, (a, m) in zip(some, spans) for j in range(m)]
            picks = sample(rows, params, noises, positions).tolist()
            res, at = [], 0
            for i, (_, m) in zip(some, spans):
                t, mine = tasks[i], picks[at:at + m]
                at += m
                if min(mine) < 0:
                    raise RuntimeError(f"request {t.request_id}: the target's logits are NaN (or all -inf) at a "
                                       "verified row")
                drafts = list(t.draft_token_ids)
                if m == len(drafts) + 1:
                    res.append(accept_picks(mine, drafts))
                else:
                    target = logits[starts[i]:starts[i] + len(drafts) + 1]
                    res.append(rejection_sample(filtered_probs(target, [t.sampling] * (len(drafts) + 1)), drafts,
                                                t.draft_probs, t.generator, t.output_index, bonus=mine[0]))
            return res

        for i, e in zip(spec, _row_by_row(spec, verify_some, errors, "verification")):
            out[i] = e
        return out, errors

    # ------------------------------------------------------------------ prompt logprobs
    @staticmethod
    def prompt_logprobs(tasks: Sequence[BatchedRequest], logits: torch.Tensor, starts: Sequence[int]
                        ) -> list[Optional[list[tuple]]]:
        """Each scoring task's prompt-token logprobs from its rows of ``logits`` (raw log-softmax,
        as vLLM's), one batched log-softmax for all of them."""
        out: list[Optional[list[tuple]]] = [None] * len(tasks)
        rows, ids, owners = [], [], []
        for i, (t, first) in enumerate(zip(tasks, starts)):
            if t.prompt_logprobs is not None and t.prompt_logprob_ids:
                rows.extend(range(first, first + len(t.prompt_logprob_ids)))
                ids.extend(t.prompt_logprob_ids)
                owners.append((i, len(t.prompt_logprob_ids)))
        if not rows:
            return out
        k = max(tasks[i].prompt_logprobs for i, _ in owners)
        if rows[-1] - rows[0] + 1 == len(rows):          # one run of rows (one scoring chunk): a view, no copy
            picked = logits[rows[0]:rows[-1] + 1]
        else:
            picked = logits[torch.tensor(rows, device=logits.device)]
        lp, rank, top_ids, top_lps = token_logprobs(picked, torch.tensor(ids, device=logits.device), k)
        at = 0
        for i, m in owners:
            n_top = tasks[i].prompt_logprobs
            out[i] = [(lp[j], rank[j], top_ids[j][:n_top], top_lps[j][:n_top]) for j in range(at, at + m)]
            at += m
        return out
