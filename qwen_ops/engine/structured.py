"""Structured outputs (issue 30): vLLM's ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``
on xgrammar (vLLM's default grammar engine; the ``structured`` extra).

- ``StructuredOutputsParams``: vLLM's fields. One of ``json`` (a JSON schema, dict or str),
  ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF,
  xgrammar's GBNF dialect) or ``structural_tag`` (xgrammar's structural tag, a JSON str). JSON is
  compact unless ``any_whitespace`` or ``disable_any_whitespace=False`` (vLLM's default is free
  whitespace; here a caller asks for it: a small model given free whitespace can spend its whole
  budget on it). ``disable_additional_properties`` is what xgrammar's strict schemas do anyway (a
  property the schema does not list is never generated); ``disable_fallback`` is what happens anyway
  (xgrammar only, no fallback); ``backend`` may name xgrammar only; ``whitespace_pattern`` (an
  outlines option) is refused.
- ``GrammarBackend`` (one per engine, and one in the server for its 400s): the tokenizer's
  xgrammar vocabulary, and compiled grammars cached by ``(kind, canonical spec, whitespace)``
  (``cache_key``): a schema compiles once per process, whatever request brings it.
- Per request, a ``GrammarMatcher`` lives on its ``Request`` (``engine/request.py``; it advances with
  the request's accepted tokens, so preemption by recompute or swap leaves it right). Each step the
  runner fills one token bitmask row per constrained sequence, for the whole batch, and masks the
  logits in one call (``GrammarBackend.apply``), after the penalties and before temperature; a
  fill slower than ``sampler.GRAMMAR_OVERLAP_MIN_S`` moves to a worker thread beside the next
  forward pass (the matchers' state is known before it: it depends only on accepted tokens).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
BACKENDS = (None, "auto", "xgrammar")     # vLLM's backend names this engine runs
CACHE_SIZE = 256          # compiled grammars kept per backend (LRU)
MAX_CHOICES = 4096        # structured_outputs.choice items: a 10**5-item list took 68 s to compile
# Grammar compiles at once per backend, beside the engine loop (xgrammar drops the GIL): two, so that
# one slow compile does not make every other structured request wait behind it.
COMPILE_THREADS = 2


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured_outputs needs the xgrammar package (pip install 'qwen_ops[structured]')") from e
    return xgrammar


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams`` (its fields in its order, then this engine's
    ``any_whitespace`` and older vLLM's ``disable_fallback`` / ``backend``); module docstring."""
    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None      # None: any_whitespace decides
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    any_whitespace: bool = False
    disable_fallback: bool = False
    backend: Optional[str] = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'nothing'}; expected exactly one of {list(KINDS)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json = {self.json!r}, expected a JSON schema (a dict or a str)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex = {self.regex!r}, expected a non-empty str")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar = {self.grammar!r}, expected a non-empty EBNF str")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice = {self.choice!r}, expected a non-empty list of "
                                 "non-empty str")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(self.choice)} items, expected at most "
                                 f"{MAX_CHOICES} (MAX_CHOICES)")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.structural_tag is not None:
            if not isinstance(self.structural_tag, str):
                raise ValueError(f"structured_outputs.structural_tag = {self.structural_tag!r}, expected a JSON str")
            try:
                json.loads(self.structural_tag)
            except ValueError as e:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"structured_outputs.{name} = {getattr(self, name)!r}, expected True, False or None")
        for name in ("any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} = {getattr(self, name)!r}, expected True or False")
        if self.disable_any_whitespace is not None:
            if self.disable_any_whitespace and self.any_whitespace:
                raise ValueError("structured_outputs.any_whitespace = True and .disable_any_whitespace = True "
                                 "disagree; expected one of them")
            object.__setattr__(self, "any_whitespace", not self.disable_any_whitespace)
        if self.whitespace_pattern is not None:
            raise ValueError(f"structured_outputs.whitespace_pattern = {self.whitespace_pattern!r}: xgrammar takes "
                             "no whitespace pattern; expected None (any_whitespace / disable_any_whitespace choose "
                             "compact or free whitespace)")
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs.backend = {self.backend!r}: this engine runs xgrammar only; "
                             f"expected one of {list(BACKENDS)}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """What a compiled grammar depends on: the kind, the spec (a schema as compact JSON in its
        own key order: the order of its properties is the order of the output's) and the
        whitespace rule."""
        spec: Any = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"structured_outputs.{self.kind} is not valid JSON: {e}") from None
        if isinstance(spec, dict):
            spec = json.dumps(spec, separators=(",", ":"))
        return self.kind, spec, self.any_whitespace


# vLLM's older name for the same parameters (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``).
GuidedDecodingParams = StructuredOutputsParams


class GrammarBackend:
    """A tokenizer's xgrammar vocabulary and a cache of compiled grammars (module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info)
        self._cache: "OrderedDict[tuple, Any]" = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0                           # cache misses (benchmarks, tests)
        self._pool = None                           # compile_async's worker thread, made on first use
        self._inflight: dict[tuple, Future] = {}    # compiles running: one per spec, however many ask

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached); a bad schema, regex or grammar is a
        ValueError naming ``structured_outputs.<kind>``."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, spec, any_ws = key
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(spec, any_whitespace=any_ws)
            elif kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec)
            elif kind == "choice":
                alts = " | ".join(json.dumps(c) for c in spec)
                compiled = self.compiler.compile_grammar(f"root ::= {alts}")
            elif kind == "structural_tag":
                compiled = self._compile_structural_tag(json.loads(spec))
            else:
                compiled = self.compiler.compile_grammar(spec)
        except Exception as e:                       # noqa: BLE001 - xgrammar raises several types
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {type(e).__name__}: {e}") from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile_structural_tag(self, tag: dict):
        """xgrammar's structural tag; its older form (``structures`` of begin / schema / end, and
        ``triggers``) as vLLM still accepts it."""
        if isinstance(tag, dict) and "structures" in tag:
            items = [_xgrammar().StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self.compiler.compile_structural_tag(json.dumps(tag))

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """A future of ``compile(params)`` on this backend's worker thread (done at once on a cache
        hit; one compile per spec however many requests wait for it). Nothing waits for it here:
        the engine loop keeps running while it compiles (xgrammar releases the GIL)."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(hit)
                return done
            job = self._inflight.get(key)
            if job is not None:
                return job
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="qwen-ops-grammar-compile")
            job = self._inflight[key] = self._pool.submit(self.compile, params)
        job.add_done_callback(lambda _, key=key: self._forget(key))      # outside the lock: it may run here
        return job

    def _forget(self, key: tuple) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    @staticmethod
    def matcher_of(compiled):
        """A fresh matcher (one request's grammar state) of a compiled grammar."""
        return _xgrammar().GrammarMatcher(compiled)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def apply(logits, mask, rows: Sequence[int]) -> None:
        """Mask ``logits`` rows ``rows`` (in place) with ``mask``'s rows, one call for the batch: the
        package's C kernel on the CPU (``ops.host.apply_token_bitmask``, 8x xgrammar's CPU
        kernel at 32 x 8192: benchmarks/README.md), xgrammar's elsewhere."""
        from qwen_ops.ops import host

        if logits.device.type == "cpu" and logits.dtype.is_floating_point and logits.dtype.itemsize == 4 and \
                logits.stride(1) == 1 and host.why_unavailable() is None:
            host.apply_token_bitmask(logits, mask, rows)
            return
        xgr = _xgrammar()
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device))
        else:
            full = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
            full[list(rows)] = mask
            xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=list(rows))

def fill_bitmask(matchers: Sequence[Any], vocab_size: int):
    """One int32 bitmask row per matcher (``xgrammar.allocate_token_bitmask``): the tokens each
    sequence's grammar allows next."""
    xgr = _xgrammar()
    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(mask, i)
    return mask
