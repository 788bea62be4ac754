"""The one output path of ``LLM`` and ``AsyncLLM``: what they hand back and the state that builds it.

``RequestOutput`` is vLLM's: one per prompt, with ``n`` ``CompletionOutput``s whose text,
token ids and logprobs are cumulative (the whole completion so far).

- ``OutputProcessor`` (in the engine core) holds one ``RequestState`` per prompt; each step it
  folds the sampled tokens into each completion's ``CompletionState`` (incremental
  detokenization with ``tokenizers``' ``DecodeStream``, stop strings, logprobs) and marks what
  changed.
- ``RequestState.delta()`` is what changed since the previous delta (``RequestDelta``), which
  ``AsyncLLM``'s core sends over its pipe.
- ``RequestAccumulator`` folds deltas into ``RequestOutput``s: the one builder of outputs, on the
  caller's side of ``AsyncLLM`` and inside ``LLM`` alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from qwen_ops.engine.sampling import RequestOutputKind, SamplingParams
from qwen_ops.models.tokenizer import QwenTokenizer


@dataclass
class Logprob:
    """One token's log-probability, its rank among all tokens (1 = the most likely) and its text."""
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None     # "stop", "length", "abort" or "error"
    stop_reason: Union[int, str, None] = None   # the stop token id or stop string that ended it
    cumulative_logprob: Optional[float] = None  # with SamplingParams.logprobs set
    logprobs: Optional[list[dict[int, Logprob]]] = None   # per generated token: sampled + top-k


@dataclass
class RequestMetrics:
    """When a request arrived, got its first token and its latest one (``time.perf_counter()``)."""
    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    first_scheduled_time: Optional[float] = None     # when its first completion was admitted

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        """Arrival to admission (vLLM's ``request_queue_time_seconds``)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> Optional[float]:
        """Admission to the first token (vLLM's ``request_prefill_time_seconds``)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> Optional[float]:
        """The first token to the last (vLLM's ``request_decode_time_seconds``)."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Tokens added since the previous update of this request (``LLM.stream``), over all its
    # completions in index order.
    new_token_ids: list[int] = field(default_factory=list)
    error: Optional[str] = None
    metrics: Optional[RequestMetrics] = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # its own entry and the top ones (vLLM's shape).
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    # vLLM's: prompt tokens whose KV came from the prefix cache (full blocks a previous request
    # computed); 0 with enable_prefix_caching=False.
    num_cached_tokens: int = 0
    lora_request: Any = None             # vLLM's: the adapter the request ran with (LoRARequest or None)


def num_cached_tokens(request) -> int:
    """The prompt tokens of scheduler ``Request`` ``request`` that its first admission mapped from the
    prefix cache (``KVCacheManager.begin``'s count; the scheduler records it, once)."""
    return request.num_cached_tokens or 0


def merge_delta_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive ``DELTA`` outputs of one request as one (a consumer that took neither yet)."""
    by_index = {c.index: c for c in first.outputs}
    for c in then.outputs:
        a = by_index.get(c.index)
        if a is None:
            by_index[c.index] = c
            continue
        lps = None if a.logprobs is None or c.logprobs is None else a.logprobs + c.logprobs
        by_index[c.index] = CompletionOutput(c.index, a.text + c.text, a.token_ids + c.token_ids, c.finish_reason,
                                             c.stop_reason, c.cumulative_logprob, lps)
    return RequestOutput(then.request_id, then.prompt, then.prompt_token_ids, [by_index[i] for i in sorted(by_index)],
                         then.finished, first.new_token_ids + then.new_token_ids, then.error, then.metrics,
                         first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
                         max(first.num_cached_tokens, then.num_cached_tokens))


class CompletionDelta(NamedTuple):
    """What one completion gained in an engine iteration (``AsyncLLM``'s engine core sends these)."""
    index: int
    token_ids: list[int]                     # new tokens
    text: str                                # new characters of the visible text
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]   # new entries, with logprobs asked for


class RequestDelta(NamedTuple):
    """What one request gained in an engine iteration, or why it failed (``error``)."""
    request_id: str
    finished: bool
    completions: list[CompletionDelta]
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    error: Optional[str] = None
    prompt_logprobs: Optional[list] = None     # once, in the first delta after the prompt is scored
    first_scheduled_time: Optional[float] = None
    bad_request: bool = False                  # the error is the request's own (a grammar that fails to compile)
    embedding: Optional[list[float]] = None    # a pooling request's result (EngineCore.add_pooling), once, finished
    num_cached_tokens: int = 0                 # prompt tokens served from the prefix cache (RequestOutput's)


def logprob_entry(token: int, logprob: tuple[float, int, list[int], list[float]],
                  text: Callable[[int], Optional[str]]) -> dict[int, Logprob]:
    """vLLM's logprobs entry of one position: ``token`` (sampled, or the prompt's own) first, then
    the top ones, each with its rank and text."""
    lp, rank, top_ids, top_lps = logprob
    entry = {token: Logprob(lp, rank, text(token))}
    for i, (tid, tlp) in enumerate(zip(top_ids, top_lps)):
        if tid not in entry:
            entry[tid] = Logprob(tlp, i + 1, text(tid))
    return entry


class RequestAccumulator:
    """The caller's side of one request: folds ``RequestDelta``s into ``RequestOutput``s, cumulative
    by default (``params.output_kind``; ``DELTA``: each output holds only what its deltas added).

    An update costs what its deltas changed: a completion a delta names gets a fresh
    ``CompletionOutput`` (so an output handed out earlier never changes under its holder), the
    others keep the object they had, and ``output()`` only copies the list of ``n`` references.
    A caller can tell an unchanged completion by identity (``is``). In ``DELTA`` mode nothing of
    the past is kept: an output lists the completions that changed, each with its new text, token
    ids and logprobs (the server's streams send these as they are)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "outputs", "_token_ids", "_logprobs",
                 "_dirty", "finished", "times", "prompt_logprobs", "delta", "_new_prompt_logprobs",
                 "num_cached_tokens")

    def __init__(self, request_id: str, prompt, prompt_token_ids: list[int], params: SamplingParams,
                 cumulative: bool = False):
        n = params.n
        self.delta = not cumulative and params.output_kind == RequestOutputKind.DELTA
        self._new_prompt_logprobs = False
        self.request_id = request_id
        self.prompt = prompt if isinstance(prompt, str) else None
        self.prompt_token_ids = prompt_token_ids
        want_lps = params.logprobs is not None
        self.outputs = [CompletionOutput(i, "", [], logprobs=[] if want_lps else None) for i in range(n)]
        # Growing lists per completion, copied into a fresh CompletionOutput when it changes.
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[Optional[list]] = [[] if want_lps else None for _ in range(n)]
        self._dirty: dict[int, None] = {}
        self.finished = False
        self.times: tuple = (0.0, None, None, None)
        self.prompt_logprobs: Optional[list] = None
        self.num_cached_tokens = 0

    def apply(self, delta: RequestDelta) -> list[int]:
        """Fold in one delta; returns its new token ids over its completions in index order."""
        if self.delta:
            return self._apply_delta(delta)
        new: list[int] = []
        for c in delta.completions:
            i = c.index
            self._token_ids[i].extend(c.token_ids)
            new.extend(c.token_ids)
            lps = self._logprobs[i]
            if c.logprobs is not None and lps is not None:
                lps.extend(c.logprobs)
            old = self.outputs[i]
            # A fresh object per change (never mutate one a caller may hold); the lists are copied
            # once per fold, not once per delta, by output().
            self.outputs[i] = CompletionOutput(i, old.text + c.text, old.token_ids, c.finish_reason, c.stop_reason,
                                               c.cumulative_logprob, old.logprobs)
            self._dirty[i] = None
        self.finished = delta.finished
        self.times = (delta.arrival_time, delta.first_token_time, delta.last_token_time, delta.first_scheduled_time)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return new

    def _apply_delta(self, delta: RequestDelta) -> list[int]:
        """DELTA mode: pending outputs of what changed since the last ``output()``, merged."""
        new: list[int] = []
        for c in delta.completions:
            i = c.index
            new.extend(c.token_ids)
            lps = None if c.logprobs is None else list(c.logprobs)
            old = self.outputs[i] if i in self._dirty else None
            if old is None:
                self.outputs[i] = CompletionOutput(i, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                                   c.cumulative_logprob, lps)
            else:
                old.text += c.text
                old.token_ids.extend(c.token_ids)
                if lps is not None and old.logprobs is not None:
                    old.logprobs.extend(lps)
                old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
                old.cumulative_logprob = c.cumulative_logprob
            self._dirty[i] = None
        self.finished = delta.finished
        self.times = (delta.arrival_time, delta.first_token_time, delta.last_token_time, delta.first_scheduled_time)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self._new_prompt_logprobs = delta.prompt_logprobs, True
        return new

    def output(self, new_token_ids: list[int]) -> RequestOutput:
        if self.delta:
            outs = [self.outputs[i] for i in sorted(self._dirty)]
            self._dirty.clear()
            prompt_lps, self._new_prompt_logprobs = (self.prompt_logprobs if self._new_prompt_logprobs else None), False
            return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outs, self.finished,
                                 new_token_ids, metrics=RequestMetrics(*self.times), prompt_logprobs=prompt_lps,
                                 num_cached_tokens=self.num_cached_tokens)
        for i in self._dirty:
            out = self.outputs[i]
            out.token_ids = list(self._token_ids[i])
            if self._logprobs[i] is not None:
                out.logprobs = list(self._logprobs[i])
        self._dirty.clear()
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), list(self.outputs),
                             self.finished, new_token_ids, metrics=RequestMetrics(*self.times),
                             prompt_logprobs=self.prompt_logprobs, num_cached_tokens=self.num_cached_tokens)


class CompletionState:
    """The text and logprobs of one completion, fed its tokens as they are sampled.

    Text comes from a ``DecodeStream`` (one step per token, a multi-byte character appears when
    complete), so a long completion costs O(1) per token, not a full decode. A stop string ends
    the completion where it first appears (searching only the newly decoded tail); the text is
    cut before it (after it with ``include_stop_str_in_output``). While a completion runs, the
    last ``len(longest stop) - 1`` characters are held back from ``visible_text`` so that a
    stream never shows the start of a stop string that then completes (vLLM does the same).
    """

    def __init__(self, index: int, params: SamplingParams, tokenizer: Optional[QwenTokenizer]):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.text = ""
        # detokenize=False (vLLM's): token ids only, the text stays empty
        self._stream = (tokenizer.decode_stream(params.skip_special_tokens)
                        if tokenizer is not None and params.detokenize else None)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._hold = 0 if params.include_stop_str_in_output else max(0, self._longest_stop - 1)
        self.num_tokens = 0
        self.stop_string: Optional[str] = None
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None

    def add_token(self, token: int, logprob: Optional[tuple[float, int, list[int], list[float]]]) -> Optional[str]:
        """Fold in the next sampled token (with its ``(logprob, rank, top ids, top logprobs)`` when
        logprobs were asked for). Returns the stop string it completed, if any."""
        self.num_tokens += 1
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob_entry(token, logprob, self._token_text))
            self.cumulative_logprob += logprob[0]
        if self._stream is None or self.stop_string is not None:
            return None
        piece = self._stream.step(self.tokenizer.backend, token)
        if not piece:
            return None
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += piece
        if not self.params.stop or self.num_tokens < self.params.min_tokens:
            return None
        best = None
        for stop in self.params.stop:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.stop_string = stop
        return stop

    def _token_text(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def visible_text(self, finished: bool) -> str:
        return self.text[:self.visible_len(finished)]

    def visible_len(self, finished: bool) -> int:
        """How many characters of ``text`` may be shown (a delta slices only what is new)."""
        if finished or not self._hold:
            return len(self.text)
        return max(0, len(self.text) - self._hold)


@dataclass(eq=False)
class _Completion:
    """One of a prompt's ``n`` completions: its scheduler request and its output state."""
    request: Any                     # engine.request.Request
    state: CompletionState
    done: bool = False               # counted out of its group's ``num_unfinished``
    sent_tokens: int = 0             # what earlier ``delta()``s carried: tokens, visible characters, logprobs
    sent_chars: int = 0
    sent_logprobs: int = 0


@dataclass(eq=False)
class RequestState:
    """One prompt's request as the caller sees it: ``n`` completions under one id.

    An iteration costs what it changed, not ``n``: the processor marks the completions it
    touched (``touch``), ``delta()`` visits only those, and the state keeps its unfinished count
    and its times as running figures."""
    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    params: Any                      # the caller's SamplingParams (n completions)
    completions: list[_Completion] = field(default_factory=list)
    num_unfinished: int = 0
    aborted: bool = False
    # Completions touched since the last delta(), by index (a dict: ordered, no repeats).
    dirty: dict[int, None] = field(default_factory=dict)
    arrival_time: float = float("inf")
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    first_scheduled_time: Optional[float] = None
    accumulator: Optional["RequestAccumulator"] = None    # LLM's fold of this state's deltas
    lora_request: Any = None         # its adapter, named in its outputs (vLLM's RequestOutput.lora_request)
    sent_prompt_logprobs: bool = False
    # Why it failed (a completion's token could not be sampled: EngineCore._fail_requests), and
    # whether its own parameters were the cause.
    error: Optional[str] = None
    bad_request: bool = False

    def add(self, comp: _Completion) -> None:
        self.completions.append(comp)
        self.num_unfinished += 1
        self.arrival_time = min(self.arrival_time, comp.request.arrival_time)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def touch(self, comp: _Completion) -> None:
        """``comp`` gained a token (and may have finished) in this iteration."""
        self.dirty[comp.state.index] = None
        if self.first_scheduled_time is None:   # it was admitted no later than its first token
            self.first_scheduled_time = comp.request.scheduled_time
        times = comp.request.token_times
        if times:
            if self.first_token_time is None:   # iterations run in time order: the first seen is the earliest
                self.first_token_time = times[0]
            self.last_token_time = times[-1]
        self.mark_done(comp)

    def mark_done(self, comp: _Completion) -> None:
        if comp.request.finished and not comp.done:
            comp.done = True
            self.num_unfinished -= 1

    def delta(self) -> RequestDelta:
        """What changed since the previous ``delta()``: new tokens, new visible characters and new
        logprobs of each completion touched since then, in index order. The visible text only
        grows: stop strings are held back until they cannot start earlier."""
        comps = []
        indices = sorted(self.dirty)
        self.dirty.clear()
        for i in indices:
            c = self.completions[i]
            req, st = c.request, c.state
            ids = req.output_token_ids
            visible = st.visible_len(req.finished)
            lps = None if st.logprobs is None else st.logprobs[c.sent_logprobs:]
            comps.append(CompletionDelta(st.index, ids[c.sent_tokens:], st.text[c.sent_chars:visible],
                                         req.finish_reason, req.stop_reason, st.cumulative_logprob, lps))
            c.sent_tokens, c.sent_chars = len(ids), max(c.sent_chars, visible)
            c.sent_logprobs += len(lps) if lps is not None else 0
        prompt_lps = None
        if self.params.prompt_logprobs is not None and not self.sent_prompt_logprobs and self.completions:
            first = self.completions[0]
            scored = first.request.prompt_logprobs
            if len(scored) >= len(self.prompt_token_ids) - 1:
                ids, text = self.prompt_token_ids, first.state._token_text
                prompt_lps = [None] + [logprob_entry(t, e, text) for t, e in zip(ids[1:], scored)]
                self.sent_prompt_logprobs = True
        cached = (self.completions[0].request.num_cached_tokens or 0) if self.completions else 0
        return RequestDelta(self.request_id, self.finished, comps, self.arrival_time, self.first_token_time,
                            self.last_token_time, self.error, prompt_lps, self.first_scheduled_time, self.bad_request,
                            num_cached_tokens=cached)

    def output(self) -> tuple[RequestOutput, list[int]]:
        """Fold what changed into this state's accumulator: the cumulative output, and the tokens
        new since the previous call (over all completions, in index order). ``LLM``'s outputs are
        cumulative whatever ``output_kind`` says (it applies to ``AsyncLLM.generate``)."""
        if self.accumulator is None:
            self.accumulator = RequestAccumulator(self.request_id, self.prompt, self.prompt_token_ids, self.params,
                                                  cumulative=True)
        new = self.accumulator.apply(self.delta())
        out = self.accumulator.output(new)
        out.error = self.error
        out.lora_request = self.lora_request
        return out, new


class OutputProcessor:
    """Every unfinished ``RequestState`` of one engine core, and the step's one output stage."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.completions: dict[Any, tuple[RequestState, _Completion]] = {}   # scheduler RequestId -> ...

    def add(self, state: RequestState, request, params) -> None:
        """Track ``request`` (a scheduler ``Request``) as completion ``len(state.completions)``."""
        comp = _Completion(request, CompletionState(len(state.completions), params, self.tokenizer))
        state.add(comp)
        self.completions[request.request_id] = (state, comp)

    def process(self, gained: Sequence[tuple[Any, int, Optional[tuple]]],
                finish: Callable[[Any, str, int], None]) -> list[RequestState]:
        """Fold each request's new tokens (with their logprobs) into its text, in order; a stop
        string ends it: ``finish(request, stop, kept)`` (the scheduler's ``finish_on_stop_string``,
        the one writer of a request's tokens and finish state) keeps its first ``kept`` output
        tokens, and the tokens after it in the same step (speculative decoding emits several) are
        not read. Returns the states touched, in first-touched order."""
        touched: dict[str, RequestState] = {}
        completions = self.completions
        stopped: set = set()                   # requests ended by a stop string in this step
        for req, token, lp in gained:
            if req in stopped:
                continue
            entry = completions.get(req.request_id)
            if entry is None:
                continue
            state, comp = entry
            stop = comp.state.add_token(token, lp)
            if stop is not None:
                stopped.add(req)
                finish(req, stop, comp.state.num_tokens)
            state.touch(comp)
            touched[state.request_id] = state
        for state in touched.values():
            if state.finished:
                self.forget(state)
        return list(touched.values())

    def forget(self, state: RequestState) -> None:
        self.states.pop(state.request_id, None)
        for c in state.completions:
            self.completions.pop(c.request.request_id, None)
