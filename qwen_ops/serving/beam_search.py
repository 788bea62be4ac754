"""Beam search, vLLM's way: ``LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))``.

Each step extends every live beam of every prompt by its ``2 * beam_width`` most likely next tokens
(the model's raw log-probabilities, in fp32), and keeps the ``beam_width`` best of a prompt's
candidates by cumulative log-probability, length-normalized by ``length_penalty``; a beam that
ends in EOS (unless ``ignore_eos``) is complete and stops. The result is every prompt's
``beam_width`` best sequences, finished or not. As vLLM's, a sequence's ``tokens`` are the prompt's
then the generated ones, and offline its ``text`` decodes all of them (prompt included, special
tokens skipped with ``skip_special_tokens``); the server's replies carry the continuation only.

One loop (``_beam_loop``) runs every search; what runs its steps differs. Offline, beams live in the
engine's slots (``QwenEngine``'s slot API, pinned sequences of the one scheduler, the core's lock held):
a step is one decode forward of one row per live beam; a beam kept with several children forks
its slot for each (``fork_slot``: its full KV blocks shared by reference count, only a partial last
block copied), a beam with none frees its slot. Models with linear-attention layers (their state
is per slot, and cannot be shared) run each step as one-token requests through the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from qwen_ops.engine.sampling import MAX_LOGPROBS, SamplingParams
from qwen_ops.serving.outputs import Logprob


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: ``beam_width`` beams, ``max_tokens`` new tokens at most; ``length_penalty``: a
    sequence's score is ``cum_logprob / len(tokens) ** length_penalty`` (its tokens count the
    prompt, and not a final EOS, as vLLM's, unless ``ignore_eos``, where EOS ends nothing);
    ``temperature``: the sampling temperature of the steps, which does not change the scores
    (raw log-probabilities, vLLM's default); ``skip_special_tokens``: left out of ``LLM.beam_search``'s
    texts. ``structured_outputs`` and ``watermarking`` are vLLM's and accepted unset only."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[object] = None
    skip_special_tokens: bool = True
    watermarking: Optional[bool] = None

    def __post_init__(self) -> None:
        for name, low, high in (("beam_width", 1, MAX_LOGPROBS // 2), ("max_tokens", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                raise ValueError(f"{name} = {v!r}, expected an int >= {low}" + (f" and <= {high}" if high else ""))
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
                raise ValueError(f"{name} = {v!r}, expected a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature!r}, expected >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r}, expected True or False")
        if self.structured_outputs is not None:
            raise ValueError(f"structured_outputs = {self.structured_outputs!r}: beam search runs unconstrained here; "
                             "expected None")
        if self.watermarking:
            raise ValueError(f"watermarking = {self.watermarking!r}: not supported; expected None or False")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (the prompt's, then the generated ones), the logprobs entry of each
    generated token, their sum, and (when returned) its text (``LLM.beam_search``: of all its
    tokens, prompt included, as vLLM's) and why it ended."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def score(seq: BeamSearchSequence, eos_ids: frozenset[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_ids else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


def beam_search(llm, prompts: Sequence, params: BeamSearchParams,
                concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
    """``LLM.beam_search`` (module docstring): the prompts' searches advance in the same steps, as
    many at once as the free slots hold (and ``concurrency_limit`` allows)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params = {params!r}, expected a qwen_ops.BeamSearchParams")
    prepared = llm._prepare(prompts, SamplingParams(max_tokens=1))        # validation and token ids
    ending, key = _ranking(params, frozenset(llm.engine.eos_token_ids))
    ids = [p[1] for p in prepared]
    if "linear" in llm.engine.runner.layer_kinds:
        searches = _search_by_requests(llm, ids, params, key, ending)
    else:
        with llm.core.lock:                    # the engine's slots are this search's until it ends
            free = sum(1 for s in llm.engine.kv.slots if not s.active and s.owner is None)
            group = max(1, free // params.beam_width)
            if concurrency_limit is not None:
                group = min(group, concurrency_limit)
            if free < params.beam_width:
                raise RuntimeError(f"beam search needs beam_width = {params.beam_width} free slots, "
                                   f"{free} are free (max_num_seqs)")
            searches = []
            for start in range(0, len(ids), group):
                searches += _search_by_slots(llm.engine, ids[start:start + group], params, key, ending)
    return [_finish(prompt, beams, completed, params, key, llm.tokenizer, whole=True)
            for prompt, (beams, completed) in zip(ids, searches)]


def _ranking(params: BeamSearchParams, eos_ids: frozenset[int]):
    """``(ending, key)``: the tokens that complete a beam, and the sort key of sequences. A final
    EOS is not counted in the length (vLLM's rule); under ignore_eos it ends nothing, so it counts."""
    ending = frozenset() if params.ignore_eos else eos_ids
    return ending, (lambda s: score(s, ending, params.length_penalty))


def _step_params(params: BeamSearchParams) -> SamplingParams:
    """A step of the request paths: one token, with the ``2 * beam_width`` most likely as logprobs."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)


def _extend(beam: BeamSearchSequence, entry: dict[int, Logprob]) -> list[BeamSearchSequence]:
    """``beam`` extended by each token of ``entry`` (the step's logprobs of its next token)."""
    return [BeamSearchSequence(beam.tokens + [t], beam.logprobs + [entry], beam.cum_logprob + lp.logprob)
            for t, lp in entry.items()]


def _top_entries(logits, k: int) -> list[dict[int, Logprob]]:
    """Per row of ``logits`` [rows, vocab], its ``k`` most likely tokens and their raw log-probabilities."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k)
    return [{t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids, values))}
            for ids, values in zip(top.indices.tolist(), top.values.tolist())]


def _finish(prompt: list[int], beams, completed, params: BeamSearchParams, key, tokenizer,
            whole: bool = False) -> BeamSearchOutput:
    """A prompt's ``beam_width`` best sequences, finished or not, with their text: ``whole`` (offline,
    vLLM's ``LLM.beam_search``) every token decoded, prompt included, with ``skip_special_tokens``;
    else (the server's replies) the continuation, a final EOS left out unless
    ``include_stop_str_in_output``."""
    for seq in beams:
        seq.finish_reason = seq.finish_reason or "length"
    best = sorted(completed + beams, key=key, reverse=True)[:params.beam_width]
    for seq in best:
        if tokenizer is None:
            seq.text = None
        elif whole:
            seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=params.skip_special_tokens)
        else:
            out = seq.tokens[len(prompt):]
            if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
                out = out[:-1]
            seq.text = tokenizer.decode(out)
    return BeamSearchOutput(best)


def _select(candidates, width, key, ending, completed) -> list:
    """vLLM's rule: every candidate ending in EOS is complete (``completed``); the ``width`` best of
    the others live on. (Keeping the ``width`` best of all and completing the EOS ones among them
    dropped an early EOS that vLLM and transformers keep: its length leaves the EOS out.)"""
    live = []
    for cand in candidates:
        seq = cand[0]
        if seq.tokens[-1] in ending:
            seq.finish_reason, seq.stop_reason = "stop", seq.tokens[-1]
            completed.append(seq)
        else:
            live.append(cand)
    return sorted(live, key=lambda c: key(c[0]), reverse=True)[:width]


def _beam_loop(prompts: list[list[int]], params: BeamSearchParams, key, ending, max_len: int):
    """The one beam-search loop, whatever runs the steps (slots, one-token requests, the server's
    ``AsyncLLM``): a generator. Each step it yields the live beams ``[(prompt index, beam, parent)]``,
    ``parent`` being the index in the previous step's list of the beam it extends (None at first),
    and is sent back each one's ``2 * beam_width`` most likely next tokens (``{token: Logprob}``).
    A beam that reaches ``max_len`` tokens ends there. Returns ``(beams, completed)`` per prompt:
    the ones that ended by length, and those that ended in EOS."""
    width = params.beam_width
    ended: list[list] = [[] for _ in prompts]
    completed: list[list] = [[] for _ in prompts]
    live = [(i, BeamSearchSequence(list(p)), None) for i, p in enumerate(prompts)]
    for _ in range(params.max_tokens):
        entries = yield live
        candidates: list[list] = [[] for _ in prompts]
        for j, ((i, beam, _), entry) in enumerate(zip(live, entries, strict=True)):
            candidates[i] += [(child, j) for child in _extend(beam, entry)]
        live = []
        for i in range(len(prompts)):
            for seq, parent in _select(candidates[i], width, key, ending, completed[i]):
                if len(seq.tokens) >= max_len:
                    ended[i].append(seq)                 # its slot is full: this beam ends here
                else:
                    live.append((i, seq, parent))
        if not live:
            break
    for i, seq, _ in live:
        ended[i].append(seq)
    return list(zip(ended, completed))


def _search_by_slots(engine, prompts: list[list[int]], params: BeamSearchParams, key, ending) -> list:
    """``_beam_loop`` with beams as engine slots: a step feeds each live beam its newest token, all
    in one forward of one row per beam (a decode). A parent left without children frees its slot
    first; then every parent's slot goes to its first child and each further child forks it
    (``fork_slot``: full blocks shared, a partial last block copied), so a prompt never holds more
    than ``beam_width`` slots."""
    from qwen_ops.engine.batch import BatchedRequest
    from qwen_ops.engine.sampling import GREEDY

    loop = _beam_loop(prompts, params, key, ending, engine.max_seq_len)
    held: list[int] = []
    try:
        live = next(loop)
        slot_of = []                      # the slot of each beam in ``live``
        for i, prompt in enumerate(prompts):
            slot = engine.allocate_slot(("beam_search", i))
            held.append(slot)
            engine.begin_sequence(slot, GREEDY, tokens=prompt)       # a cached prefix of the prompt is mapped
            _reserve(engine, slot, len(prompt))
            slot_of.append(slot)
        logits = engine.execute([BatchedRequest(slot, prompt[m:], m) for slot, prompt, m in
                                 zip(slot_of, prompts, [engine.slot_seq_len(s) for s in slot_of])])
        while True:
            try:
                live = loop.send(_top_entries(logits, 2 * params.beam_width))
            except StopIteration as done:
                return done.value
            parents = {parent for _, _, parent in live}
            for j, slot in enumerate(slot_of):
                if j not in parents:
                    engine.free_slot(slot)
                    held.remove(slot)
            taken, nxt = set(), []
            for i, _, parent in live:
                if parent not in taken:
                    taken.add(parent)
                    nxt.append(slot_of[parent])
                else:
                    slot = engine.allocate_slot(("beam_search", i))
                    held.append(slot)
                    engine.fork_slot(slot_of[parent], slot)
                    nxt.append(slot)
            slot_of, chunks = nxt, []
            for (_, seq, _), slot in zip(live, slot_of):
                n = engine.slot_seq_len(slot)
                _reserve(engine, slot, n + 1)
                chunks.append(BatchedRequest(slot, [seq.tokens[-1]], n, is_prefill=False))
            logits = engine.execute(chunks)
    finally:
        for slot in held:
            engine.free_slot(slot)


def _reserve(engine, slot: int, n_tokens: int) -> None:
    if not engine.reserve(slot, n_tokens):
        raise RuntimeError(f"out of KV blocks for beam search: a beam needs room for {n_tokens} tokens, "
                           f"{engine.num_free_blocks} blocks are free of {engine.num_total_blocks}; "
                           "lower beam_width or the prompts in one call, or raise the KV cache")


def _search_by_requests(llm, prompts: list[list[int]], params: BeamSearchParams, key, ending) -> list:
    """``_beam_loop`` with beams as one-token requests through the scheduler (models with
    linear-attention layers, whose per-slot state a fork cannot share): prefix caching is off for
    them, so each step prefills each beam again."""
    loop = _beam_loop(prompts, params, key, ending, llm.scheduler.config.max_model_len)
    step_params = _step_params(params)
    live = next(loop)
    while True:
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b, _ in live], [step_params] * len(live),
                            use_tqdm=False)
        try:
            live = loop.send([out.outputs[0].logprobs[0] for out in outs])
        except StopIteration as done:
            return done.value


async def beam_search_async(engine, prompt: list[int], params: BeamSearchParams, eos_ids: frozenset[int],
                            request_id: str) -> BeamSearchOutput:
    """``_beam_loop`` through an ``AsyncLLM`` (the server's ``use_beam_search``, as vLLM's serves
    it): each step the live beams go in as one-token requests at once, and share the steps of every
    other request; prefix caching keeps their common full blocks one set of blocks."""
    import asyncio

    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params = {params!r}, expected a qwen_ops.BeamSearchParams")
    ending, key = _ranking(params, eos_ids)
    step_params = _step_params(params)

    async def one(beam: BeamSearchSequence, j: int):
        last = None
        async for out in engine.generate({"prompt_token_ids": beam.tokens}, step_params,
                                         request_id=f"{request_id}-{j}"):
            last = out
        return last

    loop = _beam_loop([prompt], params, key, ending, engine.max_model_len)
    live, step = next(loop), 0
    while True:
        outs = await asyncio.gather(*(one(b, step * params.beam_width + j) for j, (_, b, _) in enumerate(live)))
        step += 1
        try:
            live = loop.send([out.outputs[0].logprobs[0] for out in outs])
        except StopIteration as done:
            ((beams, completed),) = done.value
            return _finish(prompt, beams, completed, params, key, engine.tokenizer)
