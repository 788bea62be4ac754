"""vLLM's periodic engine line in the server's log, every ``interval_s`` (10 s) while requests run:

    Engine 000: Avg prompt throughput: 41.2 tokens/s, Avg generation throughput: 88.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 50.0%

The token counts are the server's (``TokenCounts``, fed by each request's ``RequestTiming`` in
metrics.py: a prompt's tokens at its first output, generated tokens as they arrive), as vLLM's
front end counts them; running, waiting, KV usage and the prefix-cache figures are the engine's
``stats()`` at the moment of the line. The hit rate is over every lookup since the start (vLLM's
is over its last 1000 requests). As vLLM's, a line is written only when this interval or the one
before had tokens (so one line follows the end of a burst, and an idle server says nothing); the
"GPU" of vLLM's "GPU KV cache usage" is left out: this engine's cache is in host memory.
``serve --disable-log-stats`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable, Optional

logger = logging.getLogger("qwen_ops.serving.openai.stats")

DEFAULT_INTERVAL_S = 10.0
INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"        # vLLM's variable, read when the app is built


def interval_from_env() -> float:
    """``VLLM_LOG_STATS_INTERVAL`` seconds, else 10 (vLLM's rule: a value <= 0 means the default)."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV} = {raw!r}, expected a number of seconds") from None
    return value if 0 < value < float("inf") else DEFAULT_INTERVAL_S


class TokenCounts:
    """Prompt and generated tokens since the last ``take()`` (one line's interval). Written and
    read on the server's event loop only."""
    __slots__ = ("prompt", "generation")

    def __init__(self) -> None:
        self.prompt = self.generation = 0

    def take(self) -> tuple[int, int]:
        counts = (self.prompt, self.generation)
        self.prompt = self.generation = 0
        return counts


class StatsLogger:
    """Writes the line every ``interval_s`` seconds (``run``, a task of the server's event loop)."""

    def __init__(self, stats: Callable[[], dict], counts: TokenCounts, is_up: Callable[[], bool],
                 interval_s: float = DEFAULT_INTERVAL_S):
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or \
                not 0 < interval_s < float("inf"):
            raise ValueError(f"log_stats_interval = {interval_s!r}, expected a finite number of seconds > 0")
        self.interval_s = float(interval_s)
        self._stats = stats
        self._counts = counts
        self._is_up = is_up
        self._last_time = time.monotonic()
        self._last_rates = (0.0, 0.0)
        self._last_preemptions = 0

    def log(self) -> Optional[str]:
        """Close the interval; write its line (and return it) unless the engine was idle or is down."""
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        prompt, generation = self._counts.take()
        rates = (prompt / elapsed, generation / elapsed)
        idle = not any(rates) and not any(self._last_rates)
        self._last_time, self._last_rates = now, rates
        if idle or not self._is_up():
            return None
        s = self._stats()
        preempted = s.get("num_preemptions", 0)
        new_preemptions, self._last_preemptions = preempted - self._last_preemptions, preempted
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        args: list = [rates[0], rates[1], s.get("num_running", 0), s.get("num_waiting", 0)]
        if new_preemptions > 0:
            parts.append("Preemptions: %d")
            args.append(new_preemptions)
        total = s.get("total_blocks", 0)
        parts.append("KV cache usage: %.1f%%")
        args.append(100.0 * (total - s.get("free_blocks", 0)) / total if total else 0.0)
        if s.get("prefix_caching") and s.get("prefix_cache_queries"):
            parts.append("Prefix cache hit rate: %.1f%%")
            args.append(100.0 * s["prefix_cache_hits"] / s["prefix_cache_queries"])
        fmt = "Engine 000: " + ", ".join(parts)
        # The interval's raw counts ride along on the record, for whoever reads it programmatically.
        logger.info(fmt, *args, extra={"prompt_tokens": prompt, "generation_tokens": generation,
                                       "interval_s": elapsed})
        return fmt % tuple(args)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log()
            except Exception:                  # noqa: BLE001 - a failed line must not stop the next
                logger.debug("the stats line failed", exc_info=True)
