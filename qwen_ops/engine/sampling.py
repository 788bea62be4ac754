"""Sampling parameters (vLLM's vocabulary), a request's seeded noise, and the one implementation of
a row's distribution and its pick.

Greedy rows take the argmax. Sampled rows apply min-p and top-k, then temperature, softmax and
top-p, and draw by the inverse CDF: one uniform u per row, and the first token, in index order,
whose float64 running sum of kept weights passes u times their total (``cdf_pick``). A request
with a ``seed`` draws its u from its ``SeededNoise``, a pure function of the seed and the output
position, so its tokens do not depend on which other requests share the batch, on preemption or on
speculative decoding; an unseeded one from torch's default generator.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Union

import torch

from qwen_ops.ops import host


# Seeds are int64, as vLLM's and OpenAI's: [SEED_MIN, SEED_END). Each maps to its own noise stream
# (SeededNoise): the range is no wider than 64 bits, so no two seeds share one.
SEED_MIN = -2 ** 63
SEED_END = 2 ** 63
# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): logits / T would overflow fp32
# (T < ~1e-38 made every logit inf, softmax NaN and the "sample" token 0), and far above that
# the draw is already an argmax in all but name.
GREEDY_TEMPERATURE = 1e-5
# Bounds on what one request may ask for, so that no request makes every step slow for all.
MAX_LOGPROBS = 20              # vLLM's default max_logprobs (top-k log-probabilities per token)
LOGPROB_CHUNK_BYTES = 4 << 20  # fp32 logits token_logprobs scores at a time: a chunk's passes stay in cache
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024   # each stop string; the stream holds back up to this many characters
MAX_STOP_TOKEN_IDS = 1024
# Completions per prompt: each is a scheduler request with its own KV and detokenizer, so one
# SamplingParams must not ask for an unbounded number (the server's own cap is OpenAI's 128).
MAX_N = 1024


class RequestOutputKind(enum.IntEnum):
    """vLLM's ``RequestOutputKind``: what each output of a streamed request holds (``AsyncLLM.generate``;
    ``LLM.generate`` returns finished outputs whatever it is)."""
    CUMULATIVE = 0    # the whole of each completion so far (the default)
    DELTA = 1         # only what is new since the previous output, and only the completions that changed
    FINAL_ONLY = 2    # one output, when the request has finished (cumulative)


# ``SamplingParams``' checks, one per argument (the first bad one in its order is named).
def _max_tokens(max_new_tokens: Optional[int], max_tokens: Optional[int]) -> int:
    if max_new_tokens is not None and max_tokens is not None and max_new_tokens != max_tokens:
        raise ValueError(f"max_new_tokens = {max_new_tokens} and max_tokens = {max_tokens} disagree; "
                         "give one of them")
    n = max_new_tokens if max_new_tokens is not None else (max_tokens if max_tokens is not None else 16)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_new_tokens = {n!r}, expected an int >= 1")
    return n


def _flag(name: str, value, optional: bool = False):
    if not isinstance(value, bool) and not (optional and value is None):
        raise ValueError(f"{name} = {value!r}, expected True or False" + (" or None" if optional else ""))
    return value


def _extra_args(extra_args) -> Optional[dict]:
    """vLLM's ``extra_args``: a dict kept with the request for custom processors (none run here)."""
    if extra_args is not None and not isinstance(extra_args, dict):
        raise ValueError(f"extra_args = {extra_args!r}, expected a dict or None")
    return extra_args


def _temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature = {temperature!r}, expected a finite number >= 0 (0 = greedy)")
    return float(temperature)


def _top_k(top_k) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k = {top_k!r}, expected -1 or 0 (off) or an int >= 1")
    return top_k if top_k > 0 else -1


def _top_p(top_p) -> float:
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p = {top_p!r}, expected a number in (0, 1]")
    return float(top_p)


def _seed(seed) -> Optional[int]:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed < SEED_END):
        raise ValueError(f"seed = {seed!r}, expected an int in [-2**63, 2**63) or None")
    return seed


def _stop_token_ids(stop_token_ids) -> tuple[int, ...]:
    stops = tuple(stop_token_ids)
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(stops)} entries, expected at most {MAX_STOP_TOKEN_IDS}")
    for i, t in enumerate(stops):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids[{i}] = {t!r}, expected an int >= 0")
    return stops


def _n(num) -> int:
    if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= MAX_N:
        raise ValueError(f"n = {num!r}, expected an int in [1, {MAX_N}] (MAX_N)")
    return num


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        stop_strs: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stop_strs = (stop,)
    elif isinstance(stop, Sequence):
        stop_strs = tuple(stop)
    else:
        raise ValueError(f"stop = {stop!r}, expected a str, a list of str, or None")
    if len(stop_strs) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop_strs)} strings, expected at most {MAX_STOP_STRINGS}")
    for i, st in enumerate(stop_strs):
        if not isinstance(st, str) or not st:
            raise ValueError(f"stop[{i}] = {st!r}, expected a non-empty str")
        if len(st) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop[{i}] has {len(st)} characters, expected at most {MAX_STOP_STRING_CHARS}")
    return stop_strs


def _optional_count(name: str, value) -> Optional[int]:
    """``logprobs`` / ``prompt_logprobs``: None, or an int in [0, MAX_LOGPROBS]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} = {value!r}, expected an int in [0, {MAX_LOGPROBS}] or None")
    return value


def _min_tokens(min_tokens, max_tokens: int) -> int:
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        raise ValueError(f"min_tokens = {min_tokens!r}, expected an int in [0, max_tokens = {max_tokens}]")
    return min_tokens


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name} = {value!r}, expected a number in {bound}")
    return float(value)


def _logit_bias(logit_bias) -> Optional[tuple[tuple[int, float], ...]]:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias = {logit_bias!r}, expected a dict of token id -> bias or None")
    items = []
    for t, b in logit_bias.items():
        tid = int(t) if isinstance(t, str) and t.lstrip("-").isdigit() else t   # JSON keys are strings
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ValueError(f"logit_bias key {t!r}, expected a token id (an int >= 0)")
        items.append((tid, _number(f"logit_bias[{tid}]", b, -100.0, 100.0)))
    return tuple(sorted(items)) or None


def _allowed_token_ids(allowed_token_ids) -> Optional[tuple[int, ...]]:
    if allowed_token_ids is None:
        return None
    if isinstance(allowed_token_ids, (str, bytes)) or not isinstance(allowed_token_ids, Sequence) \
            or not allowed_token_ids:
        raise ValueError(f"allowed_token_ids = {allowed_token_ids!r}, expected a non-empty list of token ids "
                         "or None")
    for i, t in enumerate(allowed_token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"allowed_token_ids[{i}] = {t!r}, expected an int >= 0")
    return tuple(sorted(set(allowed_token_ids)))


def _bad_words(bad_words) -> tuple[str, ...]:
    if bad_words is None:
        return ()
    if isinstance(bad_words, str) or not isinstance(bad_words, Sequence):
        raise ValueError(f"bad_words = {bad_words!r}, expected a list of str or None")
    words = tuple(bad_words)
    for i, w in enumerate(words):
        if not isinstance(w, str) or not w.strip():
            raise ValueError(f"bad_words[{i}] = {w!r}, expected a non-empty str")
    return words


def _output_kind(output_kind) -> RequestOutputKind:
    if isinstance(output_kind, bool) or output_kind not in tuple(RequestOutputKind):
        raise ValueError(f"output_kind = {output_kind!r}, expected a RequestOutputKind (CUMULATIVE, DELTA or "
                         "FINAL_ONLY)")
    return RequestOutputKind(output_kind)


def _structured_outputs(structured_outputs, guided_decoding):
    """``structured_outputs`` (or its older name ``guided_decoding``, vLLM's) as a ``StructuredOutputsParams``."""
    if guided_decoding is not None:
        if structured_outputs is not None:
            raise ValueError("guided_decoding and structured_outputs are both set; they are one parameter "
                             "(guided_decoding is vLLM's older name), expected one of them")
        structured_outputs = guided_decoding
    if structured_outputs is not None:
        from qwen_ops.engine.structured import StructuredOutputsParams

        if isinstance(structured_outputs, dict):
            structured_outputs = StructuredOutputsParams(**structured_outputs)
        elif not isinstance(structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs = {structured_outputs!r}, expected a StructuredOutputsParams, "
                             "a dict of its fields, or None")
    return structured_outputs


@dataclass(init=False)
class SamplingParams:
    """How to pick tokens. Defaults follow vLLM (temperature 1.0, 16 new tokens).

    Mutable, as vLLM's: ``sp.temperature = 0.5`` (and ``sp.max_tokens = 100``) re-runs the
    constructor's checks on the whole, so a bad value raises the constructor's ``ValueError`` and
    leaves ``sp`` as it was; an unknown name is an ``AttributeError``. The engine never keeps the
    caller's object: every request takes its own ``clone()`` (``prepare_requests``), so changing
    ``sp`` after ``generate`` or ``add_request`` changes no request queued with it. Unhashable,
    as vLLM's. Shared constants (``GREEDY``) are ``read_only()`` copies, which refuse assignment.

    ``max_new_tokens`` is also accepted as vLLM's ``max_tokens``. ``temperature`` 0 (or anything
    below ``GREEDY_TEMPERATURE``, 1e-5, as vLLM) is greedy.
    ``top_k`` of -1 or 0 (stored as -1) and ``top_p == 1`` disable those filters; as in vLLM, a
    ``top_k`` below -1 is an error. ``seed`` is an int64, in [-2**63, 2**63), as vLLM's and OpenAI's;
    distinct seeds give distinct noise streams (``SeededNoise``).

    What the ``LLM`` layer adds on top of picking tokens (the engine's slot API ignores these and
    rejects ``n > 1``):

    - ``n``: completions per prompt; completion i draws with seed ``seed + i`` (wrapped into the
      seed range) when ``seed`` is set, so each is reproducible on its own.
    - ``stop``: strings that end a completion when they appear in its text; the text stops
      before the string unless ``include_stop_str_in_output``.
    - ``logprobs``: per generated token, the sampled token's log-probability and the ``logprobs``
      most likely ones (0: only the sampled token's), from the model's logits of that step
      (before temperature, top-k and top-p, as vLLM's default ``raw_logprobs``).
    - ``prompt_logprobs``: per prompt token after the first, its log-probability given the tokens
      before it and the ``prompt_logprobs`` most likely ones (vLLM's ``RequestOutput.prompt_logprobs``,
      ``None`` for the first token), from the prefill's own forward passes.
    - ``skip_special_tokens``: leave special tokens (EOS) out of the text, as vLLM does.
    - ``detokenize=False`` (vLLM's): token ids only, the text left empty (no stop strings then).
      ``spaces_between_special_tokens`` (a slow tokenizer's option in vLLM; the fast tokenizer here
      decodes as it always does), ``extra_args`` (kept with the request; no custom processors run
      here) and ``skip_reading_prefix_cache`` are accepted as vLLM's.
    - ``min_tokens``: stop tokens (``stop_token_ids`` and EOS) cannot be sampled, and stop strings
      do not match, before this many tokens are generated.

    Logits processing, vLLM's semantics, batched on the logits before sampling (greedy rows too,
    but ``min_p``), in vLLM's order: ``logit_bias`` (token id -> bias added, each in [-100, 100]),
    ``allowed_token_ids`` (every other token masked), ``bad_words`` (strings whose tokens may not
    be completed: a word's last token is masked where the text ends with the others), then
    ``repetition_penalty`` (> 0, 1 = off: a token seen in the prompt or the output has a positive
    logit divided by it, a negative one multiplied), ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2]: the logit less the penalty times the token's count in the
    output, or once if it occurs there); then temperature, ``min_p`` (in [0, 1]: tokens below
    ``min_p`` times the top token's probability masked), top-k and top-p.

    ``output_kind`` (vLLM's ``RequestOutputKind``): what each output of ``AsyncLLM.generate`` holds,
    the completions so far (``CUMULATIVE``), what is new (``DELTA``), or only the final output.

    ``structured_outputs`` (vLLM's ``StructuredOutputsParams``, or a dict of its fields; also
    accepted under vLLM's older name ``guided_decoding``, with ``GuidedDecodingParams``): the
    output follows a JSON schema, a regex, a choice or a grammar (``engine/structured.py``).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    n: int = 1
    stop: tuple[str, ...] = field(default=())
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    allowed_token_ids: Optional[tuple[int, ...]] = None
    bad_words: tuple[str, ...] = field(default=())
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=())   # set by prepare_requests
    structured_outputs: Any = None           # StructuredOutputsParams (engine/structured.py)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    extra_args: Optional[dict] = None
    skip_reading_prefix_cache: Optional[bool] = None

    def __init__(self, max_new_tokens: Optional[int] = None, temperature: float = 1.0, top_k: int = -1,
                 top_p: float = 1.0, seed: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, *, max_tokens: Optional[int] = None, n: int = 1,
                 stop: Union[str, Sequence[str], None] = None, logprobs: Optional[int] = None,
                 min_tokens: int = 0, include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 min_p: float = 0.0, logit_bias: Optional[dict] = None,
                 allowed_token_ids: Optional[Sequence[int]] = None, bad_words: Optional[Sequence[str]] = None,
                 structured_outputs=None, prompt_logprobs: Optional[int] = None, guided_decoding=None,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, detokenize: bool = True,
                 spaces_between_special_tokens: bool = True, extra_args: Optional[dict] = None,
                 skip_reading_prefix_cache: Optional[bool] = None):
        most = _max_tokens(max_new_tokens, max_tokens)
        # Checked in this order (the first bad one is named); stored as the dataclass's fields.
        values = dict(
            max_new_tokens=most, temperature=_temperature(temperature), top_k=_top_k(top_k), top_p=_top_p(top_p),
            seed=_seed(seed), stop_token_ids=_stop_token_ids(stop_token_ids), n=_n(n),
            stop=_stop_strings(stop), logprobs=_optional_count("logprobs", logprobs),
            prompt_logprobs=_optional_count("prompt_logprobs", prompt_logprobs),
            min_tokens=_min_tokens(min_tokens, most),
            repetition_penalty=_number("repetition_penalty", repetition_penalty, 0.0, float("inf"), low_open=True),
            presence_penalty=_number("presence_penalty", presence_penalty, -2.0, 2.0),
            frequency_penalty=_number("frequency_penalty", frequency_penalty, -2.0, 2.0),
            min_p=_number("min_p", min_p, 0.0, 1.0), logit_bias=_logit_bias(logit_bias),
            allowed_token_ids=_allowed_token_ids(allowed_token_ids), bad_words=_bad_words(bad_words),
            output_kind=_output_kind(output_kind),
            structured_outputs=_structured_outputs(structured_outputs, guided_decoding),
            ignore_eos=bool(ignore_eos), include_stop_str_in_output=bool(include_stop_str_in_output),
            skip_special_tokens=bool(skip_special_tokens), bad_words_token_ids=(),
            detokenize=_flag("detokenize", detokenize),
            spaces_between_special_tokens=_flag("spaces_between_special_tokens", spaces_between_special_tokens),
            extra_args=_extra_args(extra_args),
            skip_reading_prefix_cache=_flag("skip_reading_prefix_cache", skip_reading_prefix_cache, optional=True))
        if not values["detokenize"] and values["stop"]:
            raise ValueError(f"stop = {list(values['stop'])!r} with detokenize = False; stop strings need the text, "
                             "expected detokenize = True or stop_token_ids")
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        """vLLM's mutable fields, each assignment checked as the constructor checks it: the
        parameters are rebuilt with the new value (every cross-field rule too, min_tokens <=
        max_tokens, stop strings need detokenize) and take effect only when all pass."""
        if self.__dict__.get("_read_only"):
            raise AttributeError(f"cannot set {name} = {value!r}: this SamplingParams is a shared read-only "
                                 "constant (GREEDY); expected a copy of it, .clone()")
        if name == "max_tokens":                 # vLLM's name of max_new_tokens
            name = "max_new_tokens"
        if name not in _SETTABLE:
            raise AttributeError(f"SamplingParams has no settable field {name!r}; expected one of "
                                 f"{', '.join(sorted(_SETTABLE | {'max_tokens'}))}")
        checked = SamplingParams(**{**self._arguments(), name: value})
        if name != "bad_words":                  # the encoded words stay with the words they encode
            object.__setattr__(checked, "bad_words_token_ids", self.bad_words_token_ids)
        self.__dict__.update((f, checked.__dict__[f]) for f in _FIELDS)

    def _arguments(self) -> dict:
        """The constructor's keywords that rebuild these parameters (``__setattr__``)."""
        kwargs = {f: getattr(self, f) for f in _SETTABLE}
        if self.logit_bias is not None:
            kwargs["logit_bias"] = dict(self.logit_bias)
        return kwargs

    def clone(self) -> "SamplingParams":
        """A writable copy that shares nothing mutable with this one (vLLM's ``clone``): the one a
        request keeps, so its caller may change or reuse its own object afterwards."""
        out = copy.copy(self)
        out.__dict__.pop("_read_only", None)
        for name in ("extra_args", "structured_outputs"):     # may hold dicts (a JSON schema)
            if getattr(self, name) is not None:
                object.__setattr__(out, name, copy.deepcopy(getattr(self, name)))
        return out

    def read_only(self) -> "SamplingParams":
        """A copy that refuses assignment: for parameters shared by every caller (``GREEDY``)."""
        out = self.clone()
        object.__setattr__(out, "_read_only", True)
        return out

    @property
    def max_tokens(self) -> int:
        """vLLM's name of ``max_new_tokens`` (assignable: ``sp.max_tokens = 100``)."""
        return self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_completion(self, index: int) -> "SamplingParams":
        """The parameters of completion ``index`` of ``n``: ``n = 1``, and seed ``seed + index``;
        only completion 0 computes ``prompt_logprobs``."""
        if self.n == 1 and index == 0:
            return self
        child = copy.copy(self)
        object.__setattr__(child, "n", 1)
        if self.seed is not None:
            object.__setattr__(child, "seed", (self.seed + index - SEED_MIN) % (SEED_END - SEED_MIN) + SEED_MIN)
        if index:
            object.__setattr__(child, "prompt_logprobs", None)      # completion 0 scores the shared prompt
        return child

    def check_vocab(self, vocab_size: int) -> None:
        # stop_token_ids past the vocabulary are accepted, as vLLM accepts them (an adapter's added token in
        # its examples): never sampled, they never stop anything.
        for t, _ in self.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(f"logit_bias key {t}, expected a token id < vocab_size = {vocab_size}")
        for t in self.allowed_token_ids or ():
            if t >= vocab_size:
                raise ValueError(f"allowed_token_ids has {t}, expected token ids < vocab_size = {vocab_size}")

    def check_stop_ids(self, stop_ids: frozenset[int]) -> None:
        """Refuse parameters that can never sample a token: ``allowed_token_ids`` all stop tokens
        (``stop_ids``: ``stop_token_ids`` and the model's EOS) while ``min_tokens`` bans them."""
        if self.min_tokens > 0 and self.allowed_token_ids and set(self.allowed_token_ids) <= stop_ids:
            raise ValueError(f"allowed_token_ids = {list(self.allowed_token_ids)} are all stop tokens (EOS or "
                             f"stop_token_ids), which min_tokens = {self.min_tokens} bans from the first "
                             f"{self.min_tokens} tokens: nothing could be sampled; expected an allowed token that "
                             "does not stop, or min_tokens = 0")

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's tokens (repetition, frequency, presence)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything before temperature changes this request's logits (``apply_logits_processing``)."""
        return self.penalized or bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def with_bad_words_token_ids(self, tokenizer) -> "SamplingParams":
        """A copy whose ``bad_words`` are tokenized as vLLM does them: each word alone and after a
        space (a word mid-text starts with one), every distinct token sequence kept."""
        if not self.bad_words or self.bad_words_token_ids:
            return self                              # nothing to encode, or encoded already
        if tokenizer is None:
            raise ValueError(f"bad_words = {list(self.bad_words)!r}, but the checkpoint has no tokenizer.json "
                             "to encode them with; use logit_bias or allowed_token_ids")
        seqs = []
        for w in self.bad_words:
            for text in (w, " " + w.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        out = copy.copy(self)
        object.__setattr__(out, "bad_words_token_ids", tuple(seqs))
        return out

    def make_generator(self) -> Optional["SeededNoise"]:
        """Its seed's noise (None: no seed, or greedy: nothing to draw)."""
        if self.seed is None or self.greedy:
            return None
        return SeededNoise(self.seed)


# Every field of SamplingParams, and those an assignment may set (bad_words_token_ids is derived from
# bad_words by prepare_requests).
_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_SETTABLE = _FIELDS - {"bad_words_token_ids"}

GREEDY = SamplingParams(temperature=0.0).read_only()

# What a uniform is drawn for (``SeededNoise.uniform_at``): one stream each, so no two uses of a
# request's noise at one output position share a value.
PICK = 0         # the token at an output position: plain sampling, and verification's pick (race, bonus)
ACCEPT = 1       # rejection sampling's accept test of the draft for that position
RESIDUAL = 2     # rejection sampling's draw from the residual distribution there
DRAFT = 3        # a draft model's (or MTP's) sampled draft for that position
NUM_PURPOSES = 4

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15      # 2**64 / the golden ratio: splitmix64's counter step
_DERIVED = 0xD1B54A32D192ED03     # sets a derived seed's key apart from its LLM seed's own key


def _mix64(z: int) -> int:
    """splitmix64's finalizer (Steele, Lea and Flood 2014): a bijection of 64-bit integers in which
    every output bit depends on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


class SeededNoise:
    """A seeded request's sampling noise, counter-based: the uniform of an output position is a pure
    function of (seed, position, purpose), so a seed fixes the tokens whatever the batch, preemption,
    speculation or fork (vLLM's promise), and nothing is carried from one draw to the next.

    The seed's 64 bits are mixed into a key, one to one; the draw at counter c = position x
    NUM_PURPOSES + purpose + 1 is splitmix64's c-th output from that key, ``mix64(key + c x golden)``,
    whose top 53 bits make a float64 in [0, 1). At every counter the map from seed to output is a
    bijection, so distinct int64 seeds never draw the same 64 bits at the same place (a CPU
    ``torch.Generator`` keeps only a seed's low 32 bits: seed=1 and seed=2**32 + 1 drew alike).
    """

    __slots__ = ("seed", "_key")

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed < SEED_END:
            raise ValueError(f"seed = {seed!r}, expected an int in [-2**63, 2**63)")
        self.seed = seed
        self._key = _mix64(seed & _U64)          # int64 -> uint64 -> key: one to one

    @classmethod
    def derived(cls, seed: int, index: int) -> "SeededNoise":
        """The noise of the ``index``-th request (arrival order) that brings no seed to an engine
        seeded with ``seed`` (``LLM(seed=...)``): a seed of its own, mixed from both."""
        z = _mix64(((_mix64(seed & _U64) ^ _DERIVED) + _GOLDEN * (index + 1)) & _U64)
        return cls(z - (1 << 64) if z >> 63 else z)

    def uniform_at(self, position: int, purpose: int = PICK) -> float:
        """The uniform in [0, 1) of output ``position`` (0 = the first generated token) for ``purpose``."""
        z = _mix64((self._key + _GOLDEN * (position * NUM_PURPOSES + purpose + 1)) & _U64)
        return (z >> 11) * 2.0 ** -53

    def uniform(self, positions: Sequence[int], purpose: int = PICK) -> torch.Tensor:
        """float64 [len(positions)]: ``uniform_at`` of each."""
        return torch.tensor([self.uniform_at(p, purpose) for p in positions], dtype=torch.float64)


def uniforms(noises: Sequence[Optional[SeededNoise]], positions: Sequence[int], purpose: int = PICK) -> torch.Tensor:
    """float64 [N] on the host: row i's noise at ``positions[i]``, or where it has none (unseeded)
    a fresh draw of torch's default generator."""
    vals = [g.uniform_at(p, purpose) if g is not None else None for g, p in zip(noises, positions)]
    free = vals.count(None)
    if free:
        fresh = iter(torch.rand(free, dtype=torch.float64).tolist())
        vals = [next(fresh) if v is None else v for v in vals]
    return torch.tensor(vals, dtype=torch.float64)


# ----------------------------------------------------------------------------- a row's distribution
# Every consumer (plain sampling, speculative verification, draft proposals) goes through the same
# steps, each written once: ``logit_floors`` (min-p and top-k as the logit each row keeps down to,
# decided from its raw logits with its temperature folded in), then ``weights`` (the floor, then
# temperature, softmax and the top-p cut: the C kernel ``host.sampling_weights`` on the CPU, its
# torch reference ``weights_reference`` elsewhere), then an inverse-CDF pick (``cdf_pick``; on the CPU
# fused into the same C pass, ``host.sample_rows``). A row's steps read only its own parameters, so
# its tokens never depend on its batch (the torch top-p search once cut every row of a batch with a
# top-p row to that search's width: a row without top-p kept 512 of 8,192 tokens beside one).
# The C pass was kept over the torch top-p: 0.30 against 0.94 ms for one row of 151,936 tokens, 2.96
# against 11.3 ms for 8, 0.034 against 0.17 ms for one row of 8,192 (AMD EPYC, fp32, one thread;
# benchmarks/README.md, "One sampler").


def _host_ok(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0 and not torch.compiler.is_compiling()
            and host.why_unavailable() is None)


def _temperatures(params: Sequence[SamplingParams]) -> torch.Tensor:
    return torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)


def _top_ps(params: Sequence[SamplingParams]) -> torch.Tensor:
    return torch.tensor([1.0 if p.greedy else p.top_p for p in params], dtype=torch.float64)


def logit_floors(logits: torch.Tensor, params: Sequence[SamplingParams]) -> Optional[torch.Tensor]:
    """fp32 [N] on the host: the logit below which row i's min-p, then its top-k, drop a token (-inf
    for a row with neither); None when no row has either (greedy rows never do).

    Min-p keeps p_t >= min_p x max p over softmax(x / T), that is x_t >= max x + T ln(min_p); top-k
    then keeps the tokens at or above the k-th largest remaining logit (ties with it stay), which is
    the larger of that floor and the row's k-th largest logit."""
    vocab = logits.shape[1]
    mp = [i for i, p in enumerate(params) if p.min_p > 0 and not p.greedy]
    tk = [i for i, p in enumerate(params) if 0 < p.top_k < vocab and not p.greedy]
    if not mp and not tk:
        return None
    floor = torch.full((len(params),), float("-inf"), dtype=torch.float32)
    if mp:
        x = logits if len(mp) == len(params) else logits[mp]
        shift = torch.tensor([params[i].temperature * math.log(params[i].min_p) for i in mp], dtype=torch.float32)
        floor[mp] = x.amax(dim=1).float().cpu() + shift
    if tk:
        x = logits if len(tk) == len(params) else logits[tk]
        ks = torch.tensor([params[i].top_k for i in tk])
        kth = x.topk(int(ks.max()), dim=-1).values.cpu().gather(1, (ks - 1)[:, None])[:, 0]
        floor[tk] = torch.maximum(floor[tk], kth.float())
    return floor


def weights_reference(x: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor,
                      floor: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of ``host.sampling_weights``, in torch: fp32 ``exp(x / T - max)``, 0 where the logit is
    below ``floor`` or the exponent below -87, and where ``top_p < 1`` only the tokens, most likely
    first (ties: lower id first), whose float64 mass before them is at most p x the row's total; bool
    ``ok`` [N]: False where a row has no finite maximum or a NaN (its weights all 0)."""
    s = x / temps.to(x.device, torch.float32)[:, None]
    m = s.amax(dim=1, keepdim=True)
    ok = torch.isfinite(m[:, 0]) & ~torch.isnan(s).any(dim=1)
    d = s - torch.where(ok[:, None], m, torch.zeros_like(m))
    keep = ok[:, None] & (d >= -87.0)
    if floor is not None:
        keep &= x >= floor.to(x.device, torch.float32)[:, None]
    w = torch.where(keep, torch.exp(d), torch.zeros_like(d))
    cut = [i for i in range(x.shape[0]) if float(top_p[i]) < 1.0 and bool(ok[i])]
    if cut:
        rows = w[cut]
        ordered, order = rows.sort(dim=1, descending=True, stable=True)
        run = ordered.double().cumsum(dim=1)
        before = run - ordered.double()
        limit = top_p.to(x.device, torch.float64)[cut][:, None] * run[:, -1:]
        w[cut] = rows.scatter(1, order, ordered.masked_fill(before > limit, 0.0))
    return w, ok


def _rows_of(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def weights(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's distribution, unnormalized: fp32 [N, vocab] (min-p and top-k, then temperature,
    softmax and top-p: module comment), and bool [N], False where nothing can be sampled."""
    x = _rows_of(logits)
    floor, temps, top_ps = logit_floors(x, params), _temperatures(params), _top_ps(params)
    if _host_ok(x):
        return host.sampling_weights(x, temps, top_ps, floor)
    return weights_reference(x, temps, top_ps, floor)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, normalized: fp32 [N, vocab], zero where a filter drops
    a token (and a whole row of zeros where nothing can be sampled). Greedy rows: temperature 1, no
    filters. Speculative verification and draft proposals read these; plain sampling picks from the
    same weights (``weights``)."""
    w, ok = weights(logits, params)
    total = w.sum(dim=-1, keepdim=True, dtype=torch.float64)
    return w.div_(torch.where(total > 0, total, torch.ones_like(total)).float())


def cdf_pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row of ``weights`` [N, W] (non-negative, each row with a
    positive entry; not normalized) and uniform ``u`` [N] in [0, 1), the first index whose float64
    running sum exceeds ``u`` times the row's total. An index is picked with probability its weight
    over the total; a zero weight is never picked. Zeros do not change the running sum, so a row's
    pick is the same over its positive entries alone (in the same order)."""
    run = weights.cumsum(dim=-1, dtype=torch.float64)
    # u < 1 keeps u * total below the total in float64 (for u = 1 - 2**-53 too), so some running
    # sum exceeds it: the first is at a positive weight, at or before the last one
    u = u.to(device=run.device, dtype=torch.float64)
    return torch.searchsorted(run, u[:, None] * run[:, -1:], right=True).squeeze(1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], noises: Sequence[Optional[SeededNoise]],
           positions: Sequence[int], purpose: int = PICK) -> torch.Tensor:
    """One token per row of ``logits`` [N, vocab]: int64 [N] on the host, -1 where nothing can be
    sampled (every logit -inf, or a NaN). Greedy rows take the argmax; sampled rows an inverse-CDF
    pick from their distribution (``weights``) with the uniform of their noise at their output
    position (``positions[i]``: the tokens the request has generated so far) for ``purpose``."""
    x = _rows_of(logits)
    host_ok = _host_ok(x)
    n = x.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    if len(greedy) == n:             # every row greedy (the common decode step): no copies
        return _argmax_picks(x, host_ok)
    out = torch.full((n,), -1, dtype=torch.int64)
    if greedy:
        out[greedy] = _argmax_picks(x[greedy], host_ok)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    sub = [params[i] for i in rows]
    xs = x if len(rows) == n else x[rows]
    floor, temps, top_ps = logit_floors(xs, sub), _temperatures(sub), _top_ps(sub)
    u = uniforms([noises[i] for i in rows], [positions[i] for i in rows], purpose)
    if host_ok:
        picked = host.sample_rows(xs, temps, u, top_ps, floor)
    else:
        w, ok = weights_reference(xs, temps, top_ps, floor)
        picked = torch.where(ok, cdf_pick(w, u).clamp(max=w.shape[1] - 1), -1).cpu()
    out[rows] = picked
    return out


def _argmax_picks(x: torch.Tensor, host_ok: bool) -> torch.Tensor:
    """Each row's argmax (int64, on the host), -1 where the top value is a NaN or infinite (the argmax
    is then the row's first NaN, or every logit is -inf): nothing to sample. One finiteness check
    when every row is fine."""
    best = (host.argmax_rows(x) if host_ok else x.argmax(dim=-1)).to(x.device)
    top = x.gather(1, best[:, None])[:, 0]
    if not bool(torch.isfinite(top).all()):
        best = torch.where(torch.isfinite(top), best, -1)
    return best.cpu()


def _ends_with(prompt: Sequence[int], output: Sequence[int], suffix: Sequence[int]) -> bool:
    """Whether prompt + output ends with ``suffix`` (without joining them)."""
    n = len(suffix)
    if n == 0:
        return True
    if n > len(prompt) + len(output):
        return False
    if n <= len(output):
        return tuple(output[len(output) - n:]) == tuple(suffix)
    k = n - len(output)
    return tuple(prompt[len(prompt) - k:]) == tuple(suffix[:k]) and tuple(output) == tuple(suffix[k:])


def apply_logits_processing(logits: torch.Tensor, params: Sequence[SamplingParams],
                            histories: Sequence[Optional[tuple]]) -> torch.Tensor:
    """Logit bias, allowed tokens, bad words and the penalties (``SamplingParams``' docstring) on
    fp32 ``logits`` [N, vocab], one batched operation each; ``histories[i]`` is row i's
    ``(prompt token ids, output token ids)``. Returns ``logits`` itself when no row asks for any."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    n, vocab = out.shape
    device = out.device
    for i in rows:
        p = params[i]
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            out[i, list(ids)] += torch.tensor(bias, dtype=out.dtype, device=device)
        if p.allowed_token_ids:
            keep = torch.full((vocab,), float("-inf"), dtype=out.dtype, device=device)
            keep[list(p.allowed_token_ids)] = 0.0
            out[i] += keep
        if p.bad_words_token_ids:
            prompt, output = histories[i]
            banned = [w[-1] for w in p.bad_words_token_ids if _ends_with(prompt, output, w[:-1])]
            if banned:
                out[i, banned] = float("-inf")
    pen = [i for i in rows if params[i].penalized]
    if pen:
        hist = [histories[i] for i in pen]
        width_o = max(1, max(len(h[1]) for h in hist))
        width_p = max(1, max(len(h[0]) for h in hist))
        # Padding index vocab: one column past the vocabulary, dropped after the scatter.
        outs = torch.tensor([list(h[1]) + [vocab] * (width_o - len(h[1])) for h in hist], device=device)
        prompts = torch.tensor([list(h[0]) + [vocab] * (width_p - len(h[0])) for h in hist], device=device)
        counts = torch.zeros((len(pen), vocab + 1), dtype=out.dtype, device=device)
        counts.scatter_add_(1, outs, torch.ones_like(outs, dtype=out.dtype))
        counts = counts[:, :vocab]
        seen = torch.zeros((len(pen), vocab + 1), dtype=torch.bool, device=device)
        seen.scatter_(1, prompts, True)
        seen = seen[:, :vocab] | (counts > 0)
        col = lambda name: torch.tensor([getattr(params[i], name) for i in pen], dtype=out.dtype,  # noqa: E731
                                        device=device)[:, None]
        rep, freq, pres = col("repetition_penalty"), col("frequency_penalty"), col("presence_penalty")
        x = out[pen]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).to(out.dtype)
        out[pen] = x
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """Log-probabilities of the sampled ``tokens`` [N] under ``logits`` [N, vocab] (fp32
    log-softmax), their ranks (1 = the most likely), and the ``k`` most likely ids and their
    log-probabilities per row. Many rows (a scored prompt) go ``LOGPROB_CHUNK_BYTES`` of fp32
    logits at a time (128 rows of 8,192; 6 of 151,936), each chunk's passes staying in cache:
    2.2x the whole at 2,000 x 8,192, 1.5x at 1,000 x 151,936."""
    rows = max(1, LOGPROB_CHUNK_BYTES // (4 * max(1, logits.shape[-1])))
    if logits.shape[0] > rows:
        parts = [token_logprobs(logits[i:i + rows], tokens[i:i + rows], k) for i in range(0, logits.shape[0], rows)]
        return tuple([x for part in parts for x in part[j]] for j in range(4))
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1).long()).view(-1)
    ranks = (lp > chosen[:, None]).sum(dim=-1, dtype=torch.int32) + 1      # an int32 sum: 1.6x the int64 one
    if k > 0:
        top = lp.topk(min(k, lp.shape[1]), dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids, top_lps = [[] for _ in range(lp.shape[0])], [[] for _ in range(lp.shape[0])]
    return chosen.tolist(), ranks.tolist(), top_ids, top_lps
