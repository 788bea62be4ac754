"""``qwen-ops router``: one OpenAI-compatible endpoint in front of worker servers on other ports or machines.

    qwen-ops router --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 --port 8000

Any OpenAI-compatible server is a worker (``qwen-ops serve``, vLLM, ...): the router never tokenizes
and never reads a worker's internals, only its HTTP answers. Every request is forwarded as it came;
the answer comes back as the worker sent it (SSE bytes passed on as they arrive), with an
``x-qwen-ops-worker`` header naming the worker. The router's own routes are ``/health`` and
``/metrics``; everything else (``/v1/models`` too) goes to a worker.

Policies (``--policy``):

- ``cache_aware`` (default): the data-parallel server's ``Balancer`` over text instead of tokens. A
  request's prompt text (a completion's ``prompt``, a chat's tools and messages, each serialized
  canonically, so turn 2 starts with the text of turn 1) is cut into units of ``CHARS_PER_TOKEN``
  characters, an estimate of a token each; blocks of ``BLOCK_UNITS`` units (64 characters) give the
  chained prefix keys. A request goes to the worker believed to hold the longest prefix of it, unless
  that worker's load exceeds the least-loaded one's by more than the balancer's margin.
- ``least_load``: the worker with the fewest tokens still to prefill or generate, by the router's count.
- ``round_robin``: each worker in turn.
- ``consistent_hash``: sticky sessions. The session key is the first of ``session_headers``
  (``X-Session-ID``, then ``X-User-ID``) the request carries, else its body's ``user``; keys are
  hashed onto a ring of workers (``HashRing``), and a key whose worker is down moves to the next one
  on the ring (only those keys move). A request with no key goes to the least-loaded worker.

Load is the router's own count of what it sent and what came back (as the balancer counts it): a
request adds its prompt's estimated tokens and ``max_tokens`` x ``n`` to its worker, each streamed
event counts as a token back, and the rest leaves when the answer ends. To it each health round adds
what the worker reports of work the router did not send (``read_worker_load``: its ``/metrics``
running and waiting requests, less the router's own in flight there, at the mean request's cost),
so clients that bypass the router, or a second router, are seen too (``--no-worker-metrics``: not).

Faults: every ``health_interval`` seconds each worker's ``/health`` is asked; a failed check (not 200,
or no answer) marks the worker down (no new requests, its prefix set forgotten), a passing one marks
it up again. A request that fails before any byte of its answer went to the client (no connection,
the connection lost before the answer was complete, a 503) is tried on another worker, at most
``max_retries`` times; a transport failure also marks that worker down at once. A 4xx (or any answer
but a 503) is handed on unchanged. Non-streamed answers are read whole before they are sent, so they
are never half-sent; a streamed answer whose worker goes away after its first bytes ends with an
OpenAI-shaped error event (``data: {"error": {...}}``, then ``[DONE]``), as the server's own streams do.

This module and those it imports need no torch: the router is a light process of its own
(``qwen_ops_cli`` loads it without running the package's root, which registers the ops).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import sys
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence
from urllib.parse import urlsplit

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from qwen_ops.serving.balancer import Balancer, Ticket
from qwen_ops.serving.hash_ring import HashRing

__all__ = ["Router", "RouterConfig", "RequestInfo", "POLICIES", "request_info", "prompt_text", "text_units",
           "run_router"]

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "least_load", "round_robin", "consistent_hash")
CHARS_PER_TOKEN = 4           # the router cannot tokenize for its workers: ~4 characters of English per token
BLOCK_UNITS = 16              # prefix blocks of 16 units = 64 characters
CACHE_BLOCKS = 4096           # prefix blocks remembered per worker (the balancer's LRU bound)
DEFAULT_SESSION_HEADERS = ("X-Session-ID", "X-User-ID")
# max_tokens a request may generate when it names none: OpenAI's completions default; a chat's
# default is the rest of the worker's context, unknown here, so a guess of a typical reply.
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": 256}
WORKER_QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
DEFAULT_REQUEST_TOKENS = 512      # a request's cost in tokens before the router has seen any
HEALTH_TIMEOUT_S = 5.0        # a /health slower than this (or than the interval, if longer) is a failed check
# Idle connections to workers are dropped after this, below uvicorn's 5 s keep-alive: the router never
# sends on a connection the worker is closing (which would read as the worker failing).
KEEPALIVE_EXPIRY_S = 2.0
DONE_EVENT = b"data: [DONE]\n\n"
# Not forwarded either way: connection-level headers, and those the next hop sets itself.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                          "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
_SKIP_RESPONSE_HEADERS = _HOP_HEADERS | {"date", "server"}
WORKER_HEADER = "x-qwen-ops-worker"


def _worker_url(index: int, url: object) -> str:
    """``url`` checked and without its trailing slash: the root of an HTTP(S) server."""
    expected = "expected a server's root such as http://127.0.0.1:8001"
    if not isinstance(url, str):
        raise ValueError(f"workers[{index}] (--worker) = {url!r}, {expected}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"workers[{index}] (--worker) = {url!r}, {expected}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"workers[{index}] (--worker) = {url!r} has a path or query; {expected} (the router adds "
                         "/v1/... itself)")
    try:
        parts.port                                       # noqa: B018 - raises on a port out of range
    except ValueError:
        raise ValueError(f"workers[{index}] (--worker) = {url!r} has a bad port; {expected}") from None
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class RouterConfig:
    """What ``qwen-ops router`` was asked for; checked on construction (errors name the field and its flag)."""

    workers: tuple[str, ...]
    policy: str = "cache_aware"
    health_interval: float = 1.0          # seconds between two rounds of /health checks
    max_retries: int = 2                  # further workers a request that failed before its first byte is tried on
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS
    connect_timeout: float = 5.0          # seconds to open a connection to a worker
    worker_metrics: bool = True           # read each worker's /metrics for work sent to it by others

    def __post_init__(self):
        if isinstance(self.workers, str) or not isinstance(self.workers, Sequence) or not self.workers:
            raise ValueError(f"workers (--worker) = {self.workers!r}, expected at least one worker URL")
        urls = tuple(_worker_url(i, url) for i, url in enumerate(self.workers))
        for i, url in enumerate(urls):
            if url in urls[:i]:
                raise ValueError(f"workers[{i}] (--worker) = {self.workers[i]!r} repeats workers[{urls.index(url)}], "
                                 "expected each worker once")
        object.__setattr__(self, "workers", urls)
        if self.policy not in POLICIES:
            raise ValueError(f"policy (--policy) = {self.policy!r}, expected one of {', '.join(POLICIES)}")
        for name, value in (("health_interval", self.health_interval), ("connect_timeout", self.connect_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) = {value!r}, expected a number of seconds > 0")
        if not isinstance(self.worker_metrics, bool):
            raise ValueError(f"worker_metrics (--no-worker-metrics) = {self.worker_metrics!r}, expected True or False")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries (--max-retries) = {self.max_retries!r}, expected an int >= 0")
        headers = self.session_headers
        if isinstance(headers, str) or not all(isinstance(h, str) and h.strip() for h in headers):
            raise ValueError(f"session_headers (--session-header) = {headers!r}, expected header names")
        object.__setattr__(self, "session_headers", tuple(h.strip().lower() for h in headers))


# ----------------------------------------------------------------------------- what a request asks for
@dataclass(frozen=True)
class RequestInfo:
    """What the policies read from a request: its prompt as text ('' for a route without one), the
    tokens it may generate in each completion, how many completions, and its session key."""

    text: str = ""
    max_tokens: int = 0
    n: int = 1
    session: Optional[str] = None


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def prompt_text(payload: dict) -> str:
    """The text a request's prefix is keyed by: a chat's tools, then each message serialized on its own
    (so a conversation's next turn starts with the text of the turn before), or a completion's
    ``prompt`` (an embedding's ``input``) as it is when a string, else serialized."""
    parts = []
    if payload.get("tools") is not None:
        parts.append(_canonical(payload["tools"]))
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts.extend(_canonical(m) for m in messages)
    else:
        for name in ("prompt", "input"):
            value = payload.get(name)
            if value is not None:
                parts.append(value if isinstance(value, str) else _canonical(value))
                break
    return "".join(parts)


def text_units(text: str) -> list[str]:
    """``text`` in pieces of ``CHARS_PER_TOKEN`` characters: the balancer's "tokens"."""
    return [text[i:i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def worker_requests(metrics_text: str) -> Optional[int]:
    """Running plus waiting requests in a worker's Prometheus text (``WORKER_QUEUE_METRICS``, every
    sample summed: a data-parallel worker has one per engine); None if it has neither."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in WORKER_QUEUE_METRICS:
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return int(total) if seen else None


def _count(value: object, low: int) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= low else None


def request_info(path: str, body: bytes, headers, session_headers: Sequence[str]) -> RequestInfo:
    """What ``body`` (JSON or not) sent to ``path`` with ``headers`` asks for. A body the router cannot
    read is still forwarded: the worker answers it (a 400, usually)."""
    session = next((headers[h] for h in session_headers if headers.get(h)), None)
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return RequestInfo(session=session)
    if session is None and isinstance(payload.get("user"), str) and payload["user"]:
        session = payload["user"]
    max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
    max_tokens = _count(max_tokens, 0)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS.get(path, 0)
    return RequestInfo(prompt_text(payload), max_tokens, _count(payload.get("n"), 1) or 1, session)


# ----------------------------------------------------------------------------- metrics
class _StateCollector(Collector):
    """The workers' state, read from the router when ``/metrics`` is scraped."""

    def __init__(self, router: "Router"):
        self._router = router

    def collect(self):
        r = self._router
        up = GaugeMetricFamily("qwen_ops_router:worker_up", "1 while the worker passes its health checks.",
                               labels=["worker"])
        in_flight = GaugeMetricFamily("qwen_ops_router:worker_in_flight", "Requests the worker is answering.",
                                      labels=["worker"])
        load = GaugeMetricFamily("qwen_ops_router:worker_load_tokens",
                                 "Tokens the worker may still prefill or generate, by the router's estimate.",
                                 labels=["worker"])
        for i, url in enumerate(r.config.workers):
            up.add_metric([url], 1.0 if r.balancer.is_up(i) else 0.0)
            in_flight.add_metric([url], r.in_flight[i])
            load.add_metric([url], r.balancer.load(i))
        total = GaugeMetricFamily("qwen_ops_router:workers_up", "Workers passing their health checks.")
        total.add_metric([], sum(r.balancer.is_up(i) for i in range(len(r.config.workers))))
        return [up, in_flight, load, total]


@dataclass
class _Metrics:
    """The router's counters, in a registry of its own (never prometheus_client's global one)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self):
        self.requests = Counter("qwen_ops_router:requests", "Requests answered by each worker (any status).",
                                ["worker"], registry=self.registry)
        self.failed_attempts = Counter("qwen_ops_router:failed_attempts", "Attempts that failed at the worker "
                                       "before the client got a byte (no connection, lost, or a 503).", ["worker"],
                                       registry=self.registry)
        self.retries = Counter("qwen_ops_router:retries", "Attempts after a request's first, each on another worker.",
                               registry=self.registry)
        self.cut_streams = Counter("qwen_ops_router:cut_streams", "Streams whose worker went away after their "
                                   "first bytes (ended with an error event).", ["worker"], registry=self.registry)
        self.unanswered = Counter("qwen_ops_router:unanswered", "Requests no worker answered (the router's own "
                                  "502 or 503).", registry=self.registry)


# ----------------------------------------------------------------------------- the router
def _error(status: int, message: str, err_type: str) -> dict:
    # OpenAI's error shape, as the workers answer it.
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


class _AttemptFailed(Exception):
    """One worker could not answer (before the client got any byte): try another."""

    def __init__(self, reason: str, mark_down: bool, response: Optional[Response] = None):
        super().__init__(reason)
        self.reason = reason
        self.mark_down = mark_down
        self.response = response           # the worker's own answer (its 503), handed on if no retry is left


class Router:
    """The routing state of one ``qwen-ops router`` (workers' health and load, policy, counters) and its
    FastAPI ``app``. All of it lives on this instance and is touched only from the app's event loop."""

    def __init__(self, config: RouterConfig):
        self.config = config
        n = len(config.workers)
        self.balancer = Balancer(n, block_size=BLOCK_UNITS, cache_blocks=CACHE_BLOCKS,
                                 prefix_affinity=config.policy == "cache_aware")
        self.ring = HashRing(config.workers)
        self.in_flight = [0] * n
        self.errors: list[Optional[str]] = [None] * n     # why each worker is down
        self._next_turn = 0                               # round_robin: the worker whose turn is next
        self.metrics = _Metrics()
        self.metrics.registry.register(_StateCollector(self))
        for url in config.workers:                       # every worker's row from the start, at 0
            for counter in (self.metrics.requests, self.metrics.failed_attempts, self.metrics.cut_streams):
                counter.labels(url)
        self._client: Optional[httpx.AsyncClient] = None
        self.mean_request_tokens = DEFAULT_REQUEST_TOKENS   # running mean of what one request costs, in tokens
        self.reported = [0] * n                            # requests each worker last reported (running + waiting)
        self.app = self._build_app()

    # -- policy
    def _round_robin(self, live: Sequence[int]) -> int:
        n = len(self.config.workers)
        for step in range(n):
            i = (self._next_turn + step) % n
            if i in live:
                self._next_turn = i + 1
                return i
        raise AssertionError("unreachable: live is not empty")

    def assign(self, info: RequestInfo, exclude: Sequence[int] = ()) -> Ticket:
        """The worker for a request (up, not in ``exclude``), by the policy; its load counted there.
        ``LookupError`` when no worker is left."""
        n = len(self.config.workers)
        live = [i for i in range(n) if self.balancer.is_up(i) and i not in exclude]
        if not live:
            raise LookupError(f"no worker is up (of {n}" + (f", {len(exclude)} tried" if exclude else "") + ")")
        chosen = None
        if self.config.policy == "round_robin":
            chosen = self._round_robin(live)
        elif self.config.policy == "consistent_hash" and info.session is not None:
            chosen = self.ring.lookup(info.session, live)
        if chosen is not None:                # the balancer counts the load where the policy chose
            exclude = [i for i in range(n) if i != chosen]
        ticket = self.balancer.assign(text_units(info.text), info.max_tokens, info.n, exclude=exclude)
        self.mean_request_tokens += (ticket.load - self.mean_request_tokens) / 32      # a slow running mean
        return ticket

    # -- health
    def mark_down(self, worker: int, reason: str) -> None:
        if self.balancer.is_up(worker):
            logger.warning("worker %s is down: %s", self.config.workers[worker], reason)
        self.balancer.mark_down(worker)
        self.errors[worker] = reason

    def mark_up(self, worker: int) -> None:
        if not self.balancer.is_up(worker):
            logger.info("worker %s is up again", self.config.workers[worker])
        self.balancer.mark_up(worker)
        self.errors[worker] = None

    async def check_worker(self, worker: int) -> bool:
        """Ask ``worker``'s ``/health``; mark it up or down by the answer."""
        timeout = max(HEALTH_TIMEOUT_S, self.config.health_interval)
        try:
            r = await self._client.get(self.config.workers[worker] + "/health", timeout=timeout)
            reason = None if r.status_code == 200 else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            reason = f"/health failed: {type(e).__name__}: {e}"
        if reason is None:
            self.mark_up(worker)
            if self.config.worker_metrics:
                await self.read_worker_load(worker)
        else:
            self.mark_down(worker, reason)
        return reason is None

    async def read_worker_load(self, worker: int) -> None:
        """The work ``worker`` has that this router did not send it (other routers, direct clients):
        its ``/metrics`` count of running and waiting requests (vLLM's ``vllm:num_requests_running``
        and ``vllm:num_requests_waiting``, summed over engines) less this router's requests in flight
        there, each weighed as the mean request this router has seen, handed to the balancer. A
        worker without those metrics (or without ``/metrics``) counts as having none."""
        requests = None
        try:
            r = await self._client.get(self.config.workers[worker] + "/metrics", timeout=HEALTH_TIMEOUT_S)
            if r.status_code == 200:
                requests = worker_requests(r.text)
        except httpx.HTTPError:
            pass
        self.reported[worker] = requests or 0
        others = max(0, (requests or 0) - self.in_flight[worker])
        self.balancer.set_external_load(worker, int(others * self.mean_request_tokens))

    async def check_health(self) -> None:
        await asyncio.gather(*(self.check_worker(i) for i in range(len(self.config.workers))))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_health()
            except Exception:                   # noqa: BLE001 - the loop must outlive one bad round
                logger.exception("a round of health checks failed")

    def health(self) -> tuple[int, dict]:
        """``/health``: 200 while any worker is up, else 503; the body lists every worker's state."""
        workers = [{"url": url, "state": "up" if self.balancer.is_up(i) else "down", "in_flight": self.in_flight[i],
                    "load_tokens": self.balancer.load(i), "error": self.errors[i]}
                   for i, url in enumerate(self.config.workers)]
        if any(w["state"] == "up" for w in workers):
            return 200, {"workers": workers}
        return 503, {**_error(503, "no worker is up", "ServiceUnavailableError"), "workers": workers}

    # -- forwarding
    async def forward(self, request: Request) -> Response:
        """``request`` answered by a worker: tried on up to ``1 + max_retries`` workers until one answers
        with anything but a 503 (or a failure before its answer's first byte)."""
        path = request.url.path
        body = await request.body()
        info = request_info(path, body, request.headers, self.config.session_headers)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        tried: list[int] = []
        failures: list[str] = []
        last_answer: Optional[Response] = None
        for _ in range(self.config.max_retries + 1):
            try:
                ticket = self.assign(info, exclude=tried)
            except LookupError as e:
                failures.append(str(e))
                break
            worker = ticket.replica
            if tried:
                self.metrics.retries.inc()
            url = self.config.workers[worker] + path + (f"?{request.url.query}" if request.url.query else "")
            self.in_flight[worker] += 1
            try:
                return await self._attempt(worker, ticket, request.method, url, headers, body, path)
            except _AttemptFailed as e:
                self._finish(worker, ticket)
                tried.append(worker)
                failures.append(f"{self.config.workers[worker]}: {e.reason}")
                self.metrics.failed_attempts.labels(self.config.workers[worker]).inc()
                last_answer = e.response or last_answer
                if e.mark_down:
                    self.mark_down(worker, e.reason)
            except BaseException:
                self._finish(worker, ticket)
                raise
        self.metrics.unanswered.inc()
        if last_answer is not None:                       # every worker tried said 503: hand on the last one's
            return last_answer
        status = 503 if not tried else 502
        return JSONResponse(_error(status, "no worker answered: " + "; ".join(failures),
                                   "ServiceUnavailableError" if status == 503 else "BadGatewayError"),
                            status_code=status)

    def _finish(self, worker: int, ticket: Ticket) -> None:
        self.balancer.release(ticket)
        self.in_flight[worker] -= 1

    async def _attempt(self, worker: int, ticket: Ticket, method: str, url: str, headers, body: bytes,
                       path: str) -> Response:
        """One worker's answer; ``_AttemptFailed`` if it fails before anything can go to the client."""
        try:
            upstream = await self._client.send(self._client.build_request(method, url, headers=headers, content=body),
                                               stream=True)
        except httpx.HTTPError as e:
            raise _AttemptFailed(f"{type(e).__name__}: {e}", mark_down=True) from None
        out_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in upstream.headers.multi_items()
                       if k.lower() not in _SKIP_RESPONSE_HEADERS]
        out_headers.append((WORKER_HEADER.encode(), self.config.workers[worker].encode("latin-1")))
        streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
        try:
            chunks = upstream.aiter_raw()
            if streamed and upstream.status_code != 503:
                first = await anext(chunks, b"")          # the worker may still die before its first byte
            else:
                content = b"".join([chunk async for chunk in chunks])
        except httpx.HTTPError as e:
            await upstream.aclose()
            raise _AttemptFailed(f"lost before the answer was complete: {type(e).__name__}: {e}",
                                 mark_down=True) from None
        except BaseException:                             # cancelled (the router stopping): close, then go
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            raise
        if upstream.status_code == 503:
            await upstream.aclose()
            answer = Response(content, status_code=503)
            answer.raw_headers.extend(out_headers)
            raise _AttemptFailed("answered 503", mark_down=False, response=answer)
        self.metrics.requests.labels(self.config.workers[worker]).inc()
        if not streamed:
            await upstream.aclose()
            self._finish(worker, ticket)
            answer = Response(content, status_code=upstream.status_code)
            answer.raw_headers.extend(out_headers)       # the worker's content-type and the rest, as sent
            return answer
        relay = _Relay(self, worker, ticket, upstream, chunks, first, path)
        answer = _RelayResponse(relay)
        answer.status_code = upstream.status_code
        answer.raw_headers[:] = [(k, v) for k, v in answer.raw_headers if k != b"content-type"] + out_headers
        return answer

    # -- the app
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        timeout = httpx.Timeout(connect=self.config.connect_timeout, read=None, write=None, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        # trust_env=False: an HTTP(S)_PROXY meant for the outside world must not sit between router and workers.
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            self._client = client
            await self.check_health()                  # the first round before the first request
            checks = asyncio.create_task(self._health_loop())
            try:
                yield
            finally:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks
                self._client = None

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="qwen-ops router", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.get("/health")
        async def health() -> Response:
            status, body = self.health()
            return JSONResponse(body, status_code=status)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
        async def forward(request: Request) -> Response:
            return await self.forward(request)

        return app


class _Relay:
    """One streamed answer on its way from a worker to the client. ``close`` (once, however the stream
    ends: finished, cut, or the client gone, even before it started) gives the request's load back and
    closes the worker's answer, so a client that leaves stops the worker's generation too."""

    def __init__(self, router: Router, worker: int, ticket: Ticket, upstream: httpx.Response,
                 chunks: AsyncIterator[bytes], first: bytes, path: str):
        self.router, self.worker, self.ticket = router, worker, ticket
        self.upstream, self.chunks, self.first, self.path = upstream, chunks, first, path
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        """The answer's bytes as they come; if the worker goes away now, an error event ends them."""
        r, url = self.router, self.router.config.workers[self.worker]
        tail, events = self.first[-2:], self.first.count(b"data:")
        try:
            if self.first:
                yield self.first
            async for chunk in self.chunks:
                yield chunk
                tail = (tail + chunk)[-2:]
                events += chunk.count(b"data:")
                r.balancer.update(self.ticket, events)   # an event is about one token back
        except httpx.HTTPError as e:                    # the client has bytes already: report in-band
            reason = f"{type(e).__name__}: {e}"
            r.metrics.cut_streams.labels(url).inc()
            r.mark_down(self.worker, f"lost mid-stream: {reason}")
            event = _error(502, f"the worker {url} went away mid-stream ({reason})", "BadGatewayError")
            # a whole event of its own, even if the worker stopped half-way through one
            yield (b"" if tail in (b"", b"\n\n") else b"\n\n") + b"data: " + _canonical(event).encode() + b"\n\n"
            if self.path in DEFAULT_MAX_TOKENS:         # the completions APIs end their streams with [DONE]
                yield DONE_EVENT
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.router._finish(self.worker, self.ticket)
        with anyio.CancelScope(shield=True):           # the close must finish, even in a cancelled task
            await self.upstream.aclose()


class _RelayResponse(StreamingResponse):
    """A ``StreamingResponse`` of a ``_Relay`` that closes the relay whichever way the response ends."""

    def __init__(self, relay: _Relay):
        super().__init__(relay.events())
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


# ----------------------------------------------------------------------------- qwen-ops router
def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (bound before uvicorn starts, so the start-up line can name
    the port, 0 included), or a RuntimeError naming them."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}") from None
    return sock


def run_router(args) -> int:
    """``qwen-ops router``: check the flags, listen, route until interrupted."""
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port = {args.port}, expected 0..65535")
    config = RouterConfig(workers=tuple(args.worker), policy=args.policy, health_interval=args.health_interval,
                          max_retries=args.max_retries,
                          session_headers=tuple(args.session_header or DEFAULT_SESSION_HEADERS),
                          worker_metrics=not args.no_worker_metrics)
    router = Router(config)
    sock = _listen(args.host, args.port)
    port = sock.getsockname()[1]
    print(f"qwen-ops router: {len(config.workers)} workers ({', '.join(config.workers)}) | policy {config.policy} | "
          f"health every {config.health_interval:g} s | up to {config.max_retries} retries | "
          f"http://{args.host}:{port}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(router.app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
