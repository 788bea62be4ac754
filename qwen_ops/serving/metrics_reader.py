"""``LLM.get_metrics()``: the offline engine's metrics in vLLM's reader shapes (``vllm.v1.metrics.reader``:
``Counter``, ``Gauge``, ``Histogram``, ``Vector``), under vLLM's names (``vllm:prompt_tokens``,
``vllm:time_to_first_token_seconds``, ...) and labels (``model_name``, ``engine``).

Two sources: the engine core's ``stats()`` (requests running and waiting, KV-cache use, preemptions,
prefix-cache lookups, tokens per iteration, speculative decoding's counts), read when the snapshot is
taken; and ``RequestStats``, what the ``LLM`` measured of each request when it finished (tokens in and
out, finish reasons, latencies), as vLLM's stat logger records them. A histogram's ``buckets`` are
cumulative and keyed by the upper bound as Prometheus writes it (``"0.5"``, ``"1.0"``, ``"+Inf"``);
``count`` equals the ``"+Inf"`` bucket.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from qwen_ops.serving.engine_core import ITERATION_TOKEN_BUCKETS

PREFIX = "vllm:"
# The histograms' buckets, vLLM's (the server's Prometheus metrics, serving/openai/metrics.py, use the same;
# they live here because this module, offline LLM.get_metrics', needs no prometheus_client: the serve extra).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)
# Request token counts: vLLM's 1-2-5 series up to the longest request.
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))


def token_buckets(max_model_len: Optional[int]) -> tuple:
    return tuple(b for b in TOKEN_BUCKETS if max_model_len is None or b <= max_model_len) or (1,)


def _go_float(x: float) -> str:
    """A bucket bound as Prometheus' text format writes it (Go's float formatting): ``+Inf``, ``0.5``,
    ``40960.0``, and from a million up in exponent form, ``1e+06``, ``2.5e+06``."""
    x = float(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if abs(x) < 1e6:
        return repr(x)
    mantissa, exponent = f"{x:.15e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exponent[0]}{int(exponent[1:]):02d}"
# vLLM's buckets of request_params_n.
N_BUCKETS = (1, 2, 5, 10, 20)


@dataclass
class Metric:
    """One metric: its name and its ``key=value`` labels (vLLM's ``Metric``)."""
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""
    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's spec_decode_num_accepted_tokens_per_pos)."""
    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""
    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: ``buckets`` maps each upper bound to the number of observations at
    or below it (cumulative; ``"+Inf"`` always present and equal to ``count``); ``sum`` of the values."""
    count: int
    sum: float
    buckets: dict[str, int]


class _Buckets:
    """One histogram's counts per bucket (the last is +Inf) and the sum of what it observed."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1       # le: a value on a bound counts in it
        self.sum += value

    def metric(self, name: str, labels: dict) -> Histogram:
        return histogram(name, labels, self.bounds, self.counts, self.sum)


def histogram(name: str, labels: dict, bounds: Sequence[float], counts: Sequence[int], total: float) -> Histogram:
    """A ``Histogram`` from per-bucket (not cumulative) ``counts``, one per bound and a last for +Inf."""
    keys = [_go_float(b) for b in bounds] + ["+Inf"]
    cumulative, running = {}, 0
    for key, c in zip(keys, counts, strict=True):
        running += c
        cumulative[key] = running
    return Histogram(name, dict(labels), running, float(total), cumulative)


class RequestStats:
    """What an ``LLM`` measured of its finished requests (vLLM's request-level stats): ``record`` each
    finished ``RequestState`` once, ``metrics`` reads them. Times are the engine's (``perf_counter``):
    arrival, admission, each token."""

    def __init__(self, max_model_len: Optional[int] = None):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}            # completions by finish reason
        tokens = token_buckets(max_model_len)
        self.histograms = {
            "time_to_first_token_seconds": _Buckets(TTFT_BUCKETS),
            "inter_token_latency_seconds": _Buckets(ITL_BUCKETS),
            "e2e_request_latency_seconds": _Buckets(E2E_BUCKETS),
            "request_queue_time_seconds": _Buckets(E2E_BUCKETS),
            "request_prefill_time_seconds": _Buckets(E2E_BUCKETS),
            "request_decode_time_seconds": _Buckets(E2E_BUCKETS),
            "request_prompt_tokens": _Buckets(tokens),
            "request_generation_tokens": _Buckets(tokens),
            "request_params_n": _Buckets(N_BUCKETS),
            "request_params_max_tokens": _Buckets(tokens),
        }
        self._counted: weakref.WeakSet = weakref.WeakSet()     # states recorded already

    def record(self, states: Iterable) -> None:
        """Count each finished state of ``states`` (unfinished and already counted ones are skipped)."""
        for st in states:
            if st.num_unfinished == 0 and st not in self._counted:     # st.finished, without a call a step
                self._counted.add(st)
                self._record(st)

    def _record(self, st) -> None:
        h = self.histograms
        generated = 0
        for comp in st.completions:
            req = comp.request
            generated += len(req.output_token_ids)
            reason = req.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            for a, b in zip(req.token_times, req.token_times[1:]):
                h["inter_token_latency_seconds"].observe(b - a)
        self.prompt_tokens += len(st.prompt_token_ids)
        self.generation_tokens += generated
        h["request_prompt_tokens"].observe(len(st.prompt_token_ids))
        h["request_generation_tokens"].observe(generated)
        h["request_params_n"].observe(st.params.n)
        h["request_params_max_tokens"].observe(st.params.max_tokens)
        arrival, scheduled, first, last = (st.arrival_time, st.first_scheduled_time, st.first_token_time,
                                           st.last_token_time)
        for name, start, end in (("time_to_first_token_seconds", arrival, first),
                                 ("e2e_request_latency_seconds", arrival, last),
                                 ("request_queue_time_seconds", arrival, scheduled),
                                 ("request_prefill_time_seconds", scheduled, first),
                                 ("request_decode_time_seconds", first, last)):
            if start is not None and end is not None:
                h[name].observe(max(0.0, end - start))

    def metrics(self, labels: dict) -> list[Metric]:
        out: list[Metric] = [Counter(PREFIX + "prompt_tokens", dict(labels), self.prompt_tokens),
                             Counter(PREFIX + "generation_tokens", dict(labels), self.generation_tokens)]
        out += [Counter(PREFIX + "request_success", {**labels, "finished_reason": reason}, count)
                for reason, count in sorted(self.finished.items())]
        out += [b.metric(PREFIX + name, labels) for name, b in self.histograms.items()]
        return out


def engine_metrics(stats: dict, labels: dict) -> list[Metric]:
    """The engine core's figures (``EngineCore.stats()``) as vLLM's gauges, counters and histogram."""
    total = stats["total_blocks"]
    used = total - stats["free_blocks"]
    out: list[Metric] = [
        Gauge(PREFIX + "num_requests_running", dict(labels), float(stats["num_running"])),
        Gauge(PREFIX + "num_requests_waiting", dict(labels), float(stats["num_waiting"])),
        Gauge(PREFIX + "kv_cache_usage_perc", dict(labels), used / total if total else 0.0),
        Counter(PREFIX + "num_preemptions", dict(labels), int(stats["num_preemptions"])),
        Counter(PREFIX + "prefix_cache_queries", dict(labels), int(stats.get("prefix_cache_queries", 0))),
        Counter(PREFIX + "prefix_cache_hits", dict(labels), int(stats.get("prefix_cache_hits", 0))),
        histogram(PREFIX + "iteration_tokens_total", labels, ITERATION_TOKEN_BUCKETS,
                  stats["iteration_tokens_buckets"], stats["iteration_tokens_sum"]),
    ]
    if stats.get("speculative_method") is not None:
        out += [Counter(PREFIX + name, dict(labels), int(stats[key])) for name, key in (
            ("spec_decode_num_drafts", "spec_num_drafts"), ("spec_decode_num_draft_tokens", "spec_num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens"))]
    return out
