"""Sampling parameters (vLLM's vocabulary) and batched sampling on the device.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p, then draw by the
inverse CDF: one uniform u per row, and the first token, in index order, whose float64 running
sum of kept probabilities passes u times their total (``cdf_pick``). A request with a ``seed``
draws its u from its own ``SeededNoise`` (all 64 bits of the seed, on every device), so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
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


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to pick tokens. Defaults follow vLLM (temperature 1.0, 16 new tokens).

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

    def __init__(self, max_new_tokens: Optional[int] = None, temperature: float = 1.0, top_k: int = -1,
                 top_p: float = 1.0, seed: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, *, max_tokens: Optional[int] = None, n: int = 1,
                 stop: Union[str, Sequence[str], None] = None, logprobs: Optional[int] = None,
                 min_tokens: int = 0, include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 min_p: float = 0.0, logit_bias: Optional[dict] = None,
                 allowed_token_ids: Optional[Sequence[int]] = None, bad_words: Optional[Sequence[str]] = None,
                 structured_outputs=None, prompt_logprobs: Optional[int] = None, guided_decoding=None,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        if max_new_tokens is not None and max_tokens is not None and max_new_tokens != max_tokens:
            raise ValueError(f"max_new_tokens = {max_new_tokens} and max_tokens = {max_tokens} disagree; "
                             "give one of them")
        num = n
        n = max_new_tokens if max_new_tokens is not None else (max_tokens if max_tokens is not None else 16)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens = {n!r}, expected an int >= 1")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature = {temperature!r}, expected a finite number >= 0 (0 = greedy)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"top_k = {top_k!r}, expected -1 or 0 (off) or an int >= 1")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p = {top_p!r}, expected a number in (0, 1]")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not SEED_MIN <= seed < SEED_END):
            raise ValueError(f"seed = {seed!r}, expected an int in [-2**63, 2**63) or None")
        stops = tuple(stop_token_ids)
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(stops)} entries, expected at most {MAX_STOP_TOKEN_IDS}")
        for i, t in enumerate(stops):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids[{i}] = {t!r}, expected an int >= 0")
        if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= MAX_N:
            raise ValueError(f"n = {num!r}, expected an int in [1, {MAX_N}] (MAX_N)")
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
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs = {logprobs!r}, expected an int in [0, {MAX_LOGPROBS}] or None")
        if prompt_logprobs is not None and (isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int)
                                            or not 0 <= prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs = {prompt_logprobs!r}, expected an int in [0, {MAX_LOGPROBS}] or None")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= n:
            raise ValueError(f"min_tokens = {min_tokens!r}, expected an int in [0, max_tokens = {n}]")
        def number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < low or value > high or (low_open and value == low):
                bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
                raise ValueError(f"{name} = {value!r}, expected a number in {bound}")
            return float(value)

        repetition_penalty = number("repetition_penalty", repetition_penalty, 0.0, float("inf"), low_open=True)
        presence_penalty = number("presence_penalty", presence_penalty, -2.0, 2.0)
        frequency_penalty = number("frequency_penalty", frequency_penalty, -2.0, 2.0)
        min_p = number("min_p", min_p, 0.0, 1.0)
        bias = None
        if logit_bias is not None:
            if not isinstance(logit_bias, dict):
                raise ValueError(f"logit_bias = {logit_bias!r}, expected a dict of token id -> bias or None")
            items = []
            for t, b in logit_bias.items():
                tid = int(t) if isinstance(t, str) and t.lstrip("-").isdigit() else t   # JSON keys are strings
                if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                    raise ValueError(f"logit_bias key {t!r}, expected a token id (an int >= 0)")
                items.append((tid, number(f"logit_bias[{tid}]", b, -100.0, 100.0)))
            bias = tuple(sorted(items)) or None
        allowed = None
        if allowed_token_ids is not None:
            if isinstance(allowed_token_ids, (str, bytes)) or not isinstance(allowed_token_ids, Sequence) \
                    or not allowed_token_ids:
                raise ValueError(f"allowed_token_ids = {allowed_token_ids!r}, expected a non-empty list of token ids "
                                 "or None")
            for i, t in enumerate(allowed_token_ids):
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids[{i}] = {t!r}, expected an int >= 0")
            allowed = tuple(sorted(set(allowed_token_ids)))
        if bad_words is None:
            words: tuple[str, ...] = ()
        elif isinstance(bad_words, str) or not isinstance(bad_words, Sequence):
            raise ValueError(f"bad_words = {bad_words!r}, expected a list of str or None")
        else:
            words = tuple(bad_words)
            for i, w in enumerate(words):
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words[{i}] = {w!r}, expected a non-empty str")
        if isinstance(output_kind, bool) or output_kind not in tuple(RequestOutputKind):
            raise ValueError(f"output_kind = {output_kind!r}, expected a RequestOutputKind (CUMULATIVE, DELTA or "
                             "FINAL_ONLY)")
        output_kind = RequestOutputKind(output_kind)
        if guided_decoding is not None:          # vLLM's older name of structured_outputs
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
        for name, value in (("max_new_tokens", n), ("temperature", float(temperature)),
                            ("top_k", top_k if top_k > 0 else -1), ("top_p", float(top_p)), ("seed", seed),
                            ("stop_token_ids", stops), ("ignore_eos", bool(ignore_eos)), ("n", num),
                            ("stop", stop_strs), ("logprobs", logprobs), ("min_tokens", min_tokens),
                            ("include_stop_str_in_output", bool(include_stop_str_in_output)),
                            ("skip_special_tokens", bool(skip_special_tokens)),
                            ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                            ("frequency_penalty", frequency_penalty), ("min_p", min_p), ("logit_bias", bias),
                            ("allowed_token_ids", allowed), ("bad_words", words), ("bad_words_token_ids", ()),
                            ("structured_outputs", structured_outputs), ("prompt_logprobs", prompt_logprobs),
                            ("output_kind", output_kind)):
            object.__setattr__(self, name, value)

    @property
    def max_tokens(self) -> int:
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
        for i, t in enumerate(self.stop_token_ids):
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids[{i}] = {t}, expected < vocab_size = {vocab_size}")
        for t, _ in self.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(f"logit_bias key {t}, expected a token id < vocab_size = {vocab_size}")
        for t in self.allowed_token_ids or ():
            if t >= vocab_size:
                raise ValueError(f"allowed_token_ids has {t}, expected token ids < vocab_size = {vocab_size}")

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

    def make_generator(self, device: torch.device) -> Optional["SeededNoise"]:
        if self.seed is None or self.greedy:
            return None
        return SeededNoise(self.seed, device)


class SeededNoise:
    """A seeded request's own source of sampling noise, distinct for every int64 seed.

    One ``torch.Generator`` is not enough on the CPU: its Mersenne Twister is seeded from the
    low 32 bits only, so ``seed=1`` and ``seed=2**32 + 1`` drew the same tokens. Here the seed's
    two 32-bit halves seed two generators, and a uniform draw is ``frac(a + 2 b)`` of one float64
    draw ``a``, ``b`` of each: uniform whenever ``a`` is (so sampling stays exact), and a function
    of both halves in which they cannot trade places. A sampled token costs one draw.
    """

    __slots__ = ("seed", "_low", "_high")

    def __init__(self, seed: int, device: torch.device):
        if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed < SEED_END:
            raise ValueError(f"seed = {seed!r}, expected an int in [-2**63, 2**63)")
        self.seed = seed
        bits = seed % 2 ** 64                      # int64 -> uint64, one to one
        self._low = torch.Generator(device=device).manual_seed(bits & 0xFFFFFFFF)
        self._high = torch.Generator(device=device).manual_seed(bits >> 32)

    def uniform(self, n: int) -> torch.Tensor:
        """``n`` float64 uniform draws in [0, 1) from this stream."""
        device = self._low.device
        u = torch.rand(n, generator=self._low, device=device, dtype=torch.float64)
        return u.add_(torch.rand(n, generator=self._high, device=device, dtype=torch.float64), alpha=2.0).frac_()


GREEDY = SamplingParams(temperature=0.0)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[SeededNoise]],
           default_generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` [N, vocab]; returns int64 [N] on the same device."""
    logits = logits.float()
    host_ok = (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
               and not torch.compiler.is_compiling() and host.why_unavailable() is None)
    greedy_tokens = host.argmax_rows(logits) if host_ok else logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_tokens
    # One uniform per row; seeded rows draw theirs from their own stream.
    u = torch.rand(len(params), generator=default_generator, dtype=torch.float64, device=logits.device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = g.uniform(1)[0]
    vocab = logits.shape[1]
    # Rows with no top-k or min-p (top-p or none): softmax, the top-p cut, running sum and pick in
    # one C pass per row, without a sort (a -1 row: NaN logits, which takes the argmax). The path a
    # row takes depends on its own parameters only, so a seeded row draws the same token in any batch.
    in_c = [host_ok and not p.greedy and p.min_p <= 0 and not 0 < p.top_k < vocab for p in params]
    rest = [i for i, (c, p) in enumerate(zip(in_c, params)) if not c and not p.greedy]
    sampled = greedy_tokens.clone()
    if any(in_c):
        rows = [i for i, c in enumerate(in_c) if c]
        picked = host.sample_rows(logits if len(rows) == len(params) else logits[rows],
                                  torch.tensor([params[i].temperature for i in rows], dtype=torch.float32),
                                  u[rows], torch.tensor([params[i].top_p for i in rows], dtype=torch.float64))
        sampled[rows] = torch.where(picked < 0, greedy_tokens[rows], picked)
    if rest:
        whole = len(rest) == len(params)
        sampled[rest] = _sample_filtered(logits if whole else logits[rest], [params[i] for i in rest],
                                         u if whole else u[rest])
    return sampled


def _sample_filtered(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """``sample``'s torch path (no row greedy): the rows' filters (min-p, top-k, top-p) as
    ``filtered_probs``, then ``cdf_pick`` with each row's uniform ``u``."""
    probs, cand = _filter(logits, params, full=False)
    if cand is None:
        return cdf_pick(probs, u)
    # Every row bounded (top-k, top-p): the pick runs over its kept tokens in index order (the
    # others after them, probability 0), which is the same pick as over the whole masked row.
    cand_i, cand_p = cand
    key = torch.where(cand_p > 0, cand_i, probs.shape[1])
    cand_i, perm = key.sort(dim=-1)
    return cand_i.gather(1, cdf_pick(cand_p.gather(1, perm), u)[:, None]).squeeze(1)


def cdf_pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row of ``weights`` [N, W] (non-negative, each row with a
    positive entry; not normalized) and uniform ``u`` [N] in [0, 1), the first index whose float64
    running sum exceeds ``u`` times the row's total. An index is picked with probability its weight
    over the total; a zero weight is never picked. Zeros do not change the running sum, so a row's
    pick is the same over its positive entries alone (in the same order)."""
    run = weights.cumsum(dim=-1, dtype=torch.float64)
    # u < 1 keeps u * total below the total in float64 (for u = 1 - 2**-53 too), so some running
    # sum exceeds it: the first is at a positive weight, at or before the last one
    return torch.searchsorted(run, u.to(torch.float64)[:, None] * run[:, -1:], right=True).squeeze(1)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: fp32 ``logits`` [N, vocab] over the row's temperature
    (1 for greedy rows), then its min-p, top-k and top-p filters (the plain sampler and speculative
    verification both draw from these). Zero where a filter drops a token; not renormalized."""
    return _filter(logits, params)[0]


# The first width of the top-p search: the most likely tokens a topk takes before it widens (x 8).
TOP_P_FIRST_WIDTH = 64


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams], full: bool = True
            ) -> tuple[Optional[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """``filtered_probs`` and, where every row keeps a bounded set (top-k or top-p), the candidates:
    ``(indices [N, W], probabilities [N, W])``, most likely first, zero past a row's kept tokens.
    ``full=False``: where there are candidates, the vocabulary-wide probabilities are not masked
    (``sample`` races over the candidates alone; three full-vocabulary passes fewer).

    No full-vocabulary sort: top-k's k-th value comes from a topk, and top-p's cut from a topk that
    widens (64, 512, ...) until its mass reaches every row's p: the token crossing p lies in it."""
    device = logits.device
    n, vocab = logits.shape
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    if any(p.min_p > 0 for p in params):
        mp = torch.tensor([p.min_p for p in params], device=device)
        pr = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(pr < mp[:, None] * pr.amax(dim=-1, keepdim=True), float("-inf"))
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    cand = None
    if any(k < vocab for k in top_ks):
        # the k-th largest value of each row (ties with it are kept)
        k_t = torch.tensor(top_ks, device=device)
        top = scaled.topk(max(top_ks), dim=-1)
        scaled = scaled.masked_fill(scaled < top.values.gather(1, (k_t - 1)[:, None]), float("-inf"))
        if all(k < vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
            cand = top.indices
    probs = torch.softmax(scaled, dim=-1)
    if cand is not None:
        return probs, (cand, probs.gather(1, cand))
    if all(p >= 1.0 for p in top_ps):
        return probs, None
    p_t = torch.tensor(top_ps, device=device)
    bounded = (p_t < 1.0) | torch.tensor([k < vocab for k in top_ks], device=device)
    if all(k < vocab for k in top_ks):      # top-k kept these, most likely first: top-p cuts among them
        order = top.indices
        sorted_probs = probs.gather(1, order)
    else:
        width = min(vocab, max(TOP_P_FIRST_WIDTH, max(k for k in top_ks if k < vocab) if min(top_ks) < vocab else 0))
        while True:
            sorted_probs, order = probs.topk(width, dim=-1)
            covered = (sorted_probs.sum(dim=-1) >= p_t) | ((probs > 0).sum(dim=-1) <= width) | ~bounded
            if width == vocab or bool(covered.all()):
                break
            width = min(vocab, width * 8)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs   # mass strictly above each token
    keep_sorted = ~(before > p_t[:, None])                # the top token is always kept
    if not full and bool(bounded.all()):
        return probs, (order, sorted_probs.masked_fill(~keep_sorted, 0.0))
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, keep_sorted)
    probs = probs.masked_fill(~keep, 0.0)
    if bool(bounded.all()):
        cand = (order, sorted_probs.masked_fill(~keep_sorted, 0.0))
    return probs, cand


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
