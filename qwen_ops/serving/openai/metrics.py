"""Prometheus metrics of one server, in a registry of its own (never prometheus_client's global).

Names follow vLLM's, each exported twice: with the ``qwen_ops:`` prefix and with vLLM's own
``vllm:`` (so dashboards built for vLLM read this server unchanged; the KV usage gauge also as
vLLM's older ``vllm:gpu_cache_usage_perc``). Engine state (running, waiting, KV blocks,
preemptions, prefix-cache lookups) is read from ``engine.stats()`` when ``/metrics`` is scraped;
token counts and latencies are measured in the server around each engine stream (``RequestTiming``),
which also feeds ``interval_tokens``, the counts of the periodic stats line (stats_log.py).
With LoRA enabled, ``lora_requests_info`` (vLLM's, no model_name label) names the adapters of
running and of waiting requests in its labels (comma-joined), its value the scrape's time, as vLLM's.
``qwen_ops:engine_up`` is 1 while the engine runs; once it has died it is 0 and the engine's
figures are left out (its last report is not live state and must not read as such).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from qwen_ops.serving.metrics_reader import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, token_buckets
from qwen_ops.serving.openai.stats_log import TokenCounts

PREFIX = "qwen_ops:"
VLLM_PREFIX = "vllm:"
PREFIXES = (PREFIX, VLLM_PREFIX)
# vLLM's buckets (seconds).
class _EngineCollector(Collector):
    """Gauges and the preemption counter, read from ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict], model_name: str, is_up: Callable[[], bool], prefix: str = PREFIX):
        self._stats = stats
        self._model = model_name
        self._is_up = is_up
        self._prefix = prefix

    def _families(self, s: Optional[dict], up: Optional[bool] = None):
        PREFIX = self._prefix                  # noqa: N806 - this collector's prefix, qwen_ops: or vllm:
        g = GaugeMetricFamily(PREFIX + "engine_up", "1 while the engine runs, 0 once it has stopped.",
                              labels=["model_name"])
        if up is not None:
            g.add_metric([self._model], 1.0 if up else 0.0)
        yield g
        # One row of samples per engine: data-parallel replicas (stats' "replicas") carry vLLM's
        # engine label, one engine none (as before; a dashboard's sum() reads both alike).
        if s is not None and "replicas" in s:
            labels = ["model_name", "engine"]
            rows = [([self._model, str(i)], r) for i, r in enumerate(s["replicas"])]
        else:
            labels = ["model_name"]
            rows = [] if s is None else [([self._model], s)]

        def family(kind, name, doc, value, extra_labels=(), extra=lambda r: []):
            f = kind(PREFIX + name, doc, labels=labels + list(extra_labels))
            for values, r in rows:
                f.add_metric(values + extra(r), value(r))
            return f

        def blocks_used(r):
            return r.get("total_blocks", 0) - r.get("free_blocks", 0)

        def usage(r):
            total = r.get("total_blocks", 0)
            return blocks_used(r) / total if total else 0.0

        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
                     lambda r: r.get("num_running", 0))
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.",
                     lambda r: r.get("num_waiting", 0))
        yield family(GaugeMetricFamily, "num_requests_swapped", "Requests swapped out to host memory.",
                     lambda r: r.get("num_swapped", 0))
        yield family(GaugeMetricFamily, "kv_cache_blocks_in_use", "KV-cache blocks held by requests.", blocks_used)
        yield family(GaugeMetricFamily, "kv_cache_blocks_total", "KV-cache blocks in the pool.",
                     lambda r: r.get("total_blocks", 0))
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage)
        if PREFIX == VLLM_PREFIX:
            yield family(GaugeMetricFamily, "gpu_cache_usage_perc",
                         "Fraction of KV-cache blocks in use (vLLM's older name).", usage)
        yield family(GaugeMetricFamily, "cache_config_info", "The KV cache's configuration (labels; value 1).",
                     lambda r: 1.0, ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
                     lambda r: [str(r.get("block_size", 0)), str(r.get("total_blocks", 0)),
                                str(r.get("kv_cache_dtype", "")), str(bool(r.get("prefix_caching"))).lower()])
        if s is not None and "replicas" in s and PREFIX != VLLM_PREFIX:    # data-parallel faults (ours)
            yield family(GaugeMetricFamily, "replica_up", "1 while the replica takes requests, 0 while it restarts.",
                         lambda r: r.get("up", 1))
            yield family(CounterMetricFamily, "replica_restarts", "Times the replica died or hung and was restarted.",
                         lambda r: r.get("restarts", 0))
            retried = CounterMetricFamily(PREFIX + "requests_retried", "Requests sent to another replica after "
                                          "theirs failed before they had an output.", labels=["model_name"])
            retried.add_metric([self._model], s.get("requests_retried", 0))
            yield retried
        if s is not None and s.get("max_loras") is not None:
            lora = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests (labels; value: "
                                     "the time).", labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            lora.add_metric([",".join(s.get("lora_running", ())), ",".join(s.get("lora_waiting", ())),
                             str(s["max_loras"])], time.time())
            yield lora
        hist = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens per engine iteration.", labels=labels)
        for values, r in rows:
            counts = r.get("iteration_tokens_buckets")
            if counts:
                from qwen_ops.serving.engine_core import ITERATION_TOKEN_BUCKETS

                cumulative, running = [], 0
                for bound, c in zip([*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"], counts):
                    running += c
                    cumulative.append((bound, running))
                hist.add_metric(values, cumulative, r.get("iteration_tokens_sum", 0))
        yield hist
        for name, key, doc in (("num_preemptions", "num_preemptions", "Preemptions since start."),
                               ("prefix_cache_queries", "prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache."),
                               ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                               ("spec_decode_num_drafts", "spec_num_drafts",
                                "Decodes that verified speculative drafts."),
                               ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens verified."),
                               ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens",
                                "Draft tokens accepted."),
                               ("spec_decode_num_emitted_tokens", "spec_num_emitted_tokens",
                                "Tokens emitted by decodes that verified drafts (accepted drafts + 1 each).")):
            yield family(CounterMetricFamily, name, doc, lambda r, k=key: r.get(k, 0))

    def describe(self):
        return list(self._families(None))

    def collect(self):
        up = self._is_up()
        return list(self._families(self._stats() if up else None, up))


class _Fanout:
    """One metric under each prefix: every call goes to all of them."""

    def __init__(self, metrics: list):
        self._metrics = metrics

    def labels(self, *values) -> "_Fanout":
        return _Fanout([m.labels(*values) for m in self._metrics])

    def inc(self, amount: float = 1) -> None:
        for m in self._metrics:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self._metrics:
            m.observe(value)


class ServerMetrics:
    """The metrics of one app; ``render()`` is the ``/metrics`` body."""

    def __init__(self, stats: Callable[[], dict], model_name: str, is_up: Callable[[], bool] = lambda: True,
                 max_model_len: Optional[int] = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.interval_tokens = TokenCounts()        # since the last stats line (stats_log.py)
        reg, labels = self.registry, ["model_name"]
        for prefix in PREFIXES:
            self.registry.register(_EngineCollector(stats, model_name, is_up, prefix))

        def each(make):
            return _Fanout([make(prefix) for prefix in PREFIXES])

        self.prompt_tokens = each(lambda p: Counter(p + "prompt_tokens", "Prompt tokens of accepted requests.",
                                                    labels, registry=reg)).labels(model_name)
        self.generation_tokens = each(lambda p: Counter(p + "generation_tokens", "Generated tokens.",
                                                        labels, registry=reg)).labels(model_name)
        self._success = each(lambda p: Counter(p + "request_success",
                                               "Finished completions (one per choice) by finish reason.",
                                               labels + ["finished_reason"], registry=reg))
        self.ttft = each(lambda p: Histogram(p + "time_to_first_token_seconds", "Time to the first generated token.",
                                             labels, buckets=TTFT_BUCKETS, registry=reg)).labels(model_name)
        self.itl = each(lambda p: Histogram(p + "inter_token_latency_seconds", "Time between two updates of a stream.",
                                            labels, buckets=ITL_BUCKETS, registry=reg)).labels(model_name)
        self.e2e = each(lambda p: Histogram(p + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                                            labels, buckets=E2E_BUCKETS, registry=reg)).labels(model_name)

        def seconds(name: str, doc: str) -> _Fanout:
            return each(lambda p: Histogram(p + name, doc, labels, buckets=E2E_BUCKETS, registry=reg)).labels(model_name)

        def tokens(name: str, doc: str) -> _Fanout:
            return each(lambda p: Histogram(p + name, doc, labels, buckets=token_buckets(max_model_len),
                                            registry=reg)).labels(model_name)

        # The engine's own times of each request (its arrival, admission, first and last token).
        self.queue_time = seconds("request_queue_time_seconds", "Arrival to admission into the running batch.")
        self.prefill_time = seconds("request_prefill_time_seconds", "Admission to the first generated token.")
        self.decode_time = seconds("request_decode_time_seconds", "The first generated token to the last.")
        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens per request.")
        self.request_generation_tokens = tokens("request_generation_tokens", "Generated tokens per request.")

    def finished(self, reason: Optional[str]) -> None:
        self._success.labels(self.model_name, reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timing(self, num_prompt_tokens: int) -> "RequestTiming":
        return RequestTiming(self, num_prompt_tokens)


class RequestTiming:
    """The latencies of one engine stream (one prompt, all its ``n`` completions)."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int):
        self._m = metrics
        self._prompt_tokens = num_prompt_tokens
        self.start = time.perf_counter()
        self._last: Optional[float] = None
        self._counted = 0          # generated tokens already in the stats line's counts
        self._done = False

    def update(self, num_tokens: int, now: float) -> None:
        """An update arrived holding ``num_tokens`` tokens in all (cumulative)."""
        if num_tokens == 0:
            return
        counts = self._m.interval_tokens
        if self._last is None:
            self._m.prompt_tokens.inc(self._prompt_tokens)
            counts.prompt += self._prompt_tokens
            self._m.ttft.observe(now - self.start)
        else:
            self._m.itl.observe(now - self._last)
        counts.generation += num_tokens - self._counted
        self._counted = num_tokens
        self._last = now

    def finish(self, finish_reasons: Sequence[Optional[str]], num_generated: int, times=None) -> None:
        """Once per stream: at its last update, or when it is abandoned (reasons None = abort).
        ``times``: the engine's ``RequestMetrics`` of the request, when it finished there."""
        if self._done:
            return
        self._done = True
        m = self._m
        if self._last is None:
            m.prompt_tokens.inc(self._prompt_tokens)
            m.interval_tokens.prompt += self._prompt_tokens
        m.interval_tokens.generation += max(0, num_generated - self._counted)
        m.generation_tokens.inc(num_generated)
        m.e2e.observe(time.perf_counter() - self.start)
        m.request_prompt_tokens.observe(self._prompt_tokens)
        m.request_generation_tokens.observe(num_generated)
        if times is not None:
            for hist, value in ((m.queue_time, times.queue_time), (m.prefill_time, times.prefill_time),
                                (m.decode_time, times.decode_time)):
                if value is not None:
                    hist.observe(max(0.0, value))
        for reason in finish_reasons:
            self._m.finished(reason)
