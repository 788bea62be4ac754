"""The FastAPI app of ``qwen-ops serve``: OpenAI's completions, chat completions, Responses
(responses.py) and models routes over an ``AsyncLLM``, vLLM's batched chat completions
(batch_chat.py), the pooling routes (pooling.py), plus
``/health`` (and ``/ping``), ``/metrics`` and vLLM's periodic stats line (stats_log.py), as vLLM's
server does.

    app = build_app(AsyncLLM.from_pretrained(), served_model_name="qwen-ops-default", api_key="k")
    with ServerThread(app) as server:          # a free port on 127.0.0.1
        openai.OpenAI(base_url=server.base_url, api_key="k").completions.create(...)

Each HTTP request becomes one engine request per prompt (``_Generation``); their streams are
consumed by tasks that keep only each one's latest (cumulative) output, so a slow client gets
fewer, larger deltas instead of a backlog. Whatever ends a response (done, an error, the client
going away) aborts the engine requests it still holds, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.engine_core import EngineDeadError
from qwen_ops.serving.openai import protocol as P
from qwen_ops.serving.openai.batch_chat import BatchChatRoutes
from qwen_ops.serving.openai.chat import ChatTemplate, ChatTemplateError
from qwen_ops.serving.openai.lora import (LoadLoRAAdapterRequest, LoRAAdapters, LoRAModulePath,
                                          UnloadLoRAAdapterRequest, runtime_updating_allowed)
from qwen_ops.serving.openai.reasoning import make_parser
from qwen_ops.serving.openai import tools as T
from qwen_ops.engine.sampling import RequestOutputKind
from qwen_ops.engine.structured import StructuredOutputsParams
from qwen_ops.serving.openai.metrics import ServerMetrics
from qwen_ops.serving.outputs import CompletionOutput, merge_delta_outputs
from qwen_ops.serving.openai.pooling import PoolingRoutes
from qwen_ops.serving.openai.responses import ResponsesRoutes, responses_store_enabled
from qwen_ops.serving.openai.stats_log import StatsLogger, interval_from_env

logger = logging.getLogger("qwen_ops.serving.openai")

DEFAULT_MAX_BODY_BYTES = 4 << 20
EMBEDDED_MODEL_NAME = "qwen-ops-default"
RETRY_AFTER_SECONDS = 1
API_KEY_ENVS = ("QWEN_OPS_API_KEY", "VLLM_API_KEY")     # in order of precedence, after --api-key
# /health says 503 when the engine has work and has finished no iteration for this long (a
# stopped or hung engine process). One step of a big prefill, or a first step that compiles,
# can take seconds: the default leaves a wide margin.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5          # uvicorn's default
# Request preparation (JSON parse, chat template, tokenize) of a body above this size runs on a
# thread pool, at most PREPARE_THREADS at once, so that one huge prompt does not stall the event
# loop (and every other stream and /health with it). A small body costs less than the thread hop.
INLINE_PREPARE_BYTES = 32 << 10
PREPARE_THREADS = 2
# A token stands for at most max_token_chars characters of (normalized) text: the longest vocabulary
# entry (byte-level BPE: one character per byte, and a character is at least one byte). NFC/NFD
# normalization can merge a character's canonical decomposition, at most 4 code points, into one.
_NORMALIZER_SHRINK = {"None": 1, "NFC": 4, "NFD": 1}


def default_served_model_name(model: Union[str, Path, None]) -> str:
    """The name ``/v1/models`` reports: the checkpoint directory's name, or the embedded model's."""
    return EMBEDDED_MODEL_NAME if model is None else (Path(model).resolve().name or str(model))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

_json_str = json.encoder.encode_basestring      # a JSON string literal, non-ASCII kept (C speed)


def _opt(value: Any) -> str:
    return "null" if value is None else _dumps(value)


class _ChunkHead:
    """SSE events of one streamed response with one choice each. What never changes in a chunk
    (id, object, created, model) is rendered once: a stream sends a chunk per engine step."""

    def __init__(self, meta: dict):
        self._head = "data: " + _dumps(meta)[:-1] + ',"choices":[{"index":'

    def event(self, index: int, fields: str) -> str:
        return f"{self._head}{index},{fields}}}]}}\n\n"


# ----------------------------------------------------------------------------- engine streams
class _Generation:
    """The engine requests of one HTTP request (one per prompt, each with ``n`` completions).

    ``start()`` submits them, so validation errors and a full queue surface before any response
    is sent. With ``wait_first`` (or several prompts) it also waits for each one's first output;
    without, a single stream's response headers go out while the engine runs its first step, and
    a failure from the engine after submission is reported in-band, as vLLM does.
    ``close()`` (synchronous, idempotent) aborts every engine request that has not finished.
    A stream's engine outputs are deltas (``RequestOutputKind.DELTA``: what is new, which the SSE
    chunks send as it is); a response sent whole takes cumulative ones.
    """

    def __init__(self, serving: "_Serving", prompts: list[list[int]], params, base_id: str, lora_request=None):
        self._s = serving
        self.prompts = prompts
        self.params = params
        # The adapter's keyword only when there is one: engines without LoRA keep their signature.
        self._lora = {} if lora_request is None else {"lora_request": lora_request}
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.latest: dict[int, Any] = {}           # stream index -> newest output (deltas: merged) not yet consumed
        self.last: list[Any] = [None] * len(prompts)
        self._delta = params.output_kind == RequestOutputKind.DELTA
        self._final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self._reasons: list[dict[int, Optional[str]]] = [{} for _ in prompts]   # completion -> finish reason
        self.finished = [False] * len(prompts)
        self.generated = [0] * len(prompts)       # tokens over all n completions, summed from the updates
        self._timings = [serving.metrics.timing(len(p)) for p in prompts]
        self._tasks: list[asyncio.Task] = []
        self._opened: list[asyncio.Future] = []
        self._error: Optional[BaseException] = None
        self._wake = asyncio.Event()
        self._gen = None                           # the engine stream, when there is one prompt
        self._first: Optional[asyncio.Future] = None   # its first output, while not yet consumed
        self._closed = False

    def _record(self, i: int, out) -> None:
        # new_token_ids, not the n completions' lengths: an update costs what changed, not n.
        self.generated[i] += len(out.new_token_ids)
        generated = self.generated[i]
        first = getattr(getattr(out, "metrics", None), "first_token_time", None)
        # a final-only output is the first update: its time to first token is the engine's
        self._timings[i].update(generated, first if self._final_only and first is not None else time.perf_counter())
        if getattr(out, "error", None):
            raise RuntimeError(f"engine request {self.ids[i]} failed: {out.error}")
        for c in out.outputs:
            self._reasons[i][c.index] = c.finish_reason
        pending = self.latest.get(i)
        self.latest[i] = self.last[i] = out if pending is None or not self._delta else merge_delta_outputs(pending, out)
        if out.finished:
            self.finished[i] = True
            reasons = [self._reasons[i].get(j) for j in range(self.params.n)]
            self._timings[i].finish(reasons, generated, out.metrics)

    async def _pump(self, i: int) -> None:
        opened = self._opened[i]
        try:
            async for out in self._s.engine.generate(self.prompts[i], self.params, request_id=self.ids[i],
                                                     **self._lora):
                self._record(i, out)
                if not opened.done():
                    opened.set_result(None)
                self._wake.set()
            if not self.finished[i]:
                raise RuntimeError(f"engine stream {self.ids[i]} ended without a finished output")
        except asyncio.CancelledError:
            raise
        except BaseException as e:          # noqa: BLE001 - handed to the consumer
            if not opened.done():
                opened.set_exception(e)
            else:
                self._error = self._error or e
                self._wake.set()

    async def _next(self) -> None:
        """One prompt: the next output of its stream, consumed here (no task in between)."""
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"engine stream {self.ids[0]} ended without a finished output") from None
        self._record(0, out)

    async def start(self, waiting_limit: Optional[int], wait_first: bool = True) -> None:
        s = self._s
        cost = len(self.prompts) * self.params.n        # completions: each is a scheduler request
        if waiting_limit is not None and s.num_starting + cost > waiting_limit:
            raise P.APIError(503, f"the server is at its limit of {waiting_limit} waiting completions "
                                  f"({s.num_starting} waiting, this request adds {cost}); retry later",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        s.num_starting += cost
        try:
            if len(self.prompts) == 1:
                self._gen = s.engine.generate(self.prompts[0], self.params, request_id=self.ids[0], **self._lora)
                if wait_first:
                    await self._next()
                    return
                # Run the stream up to its submission (its first await): what it rejects is raised here.
                self._first = asyncio.ensure_future(self._next())
                await asyncio.sleep(0)
                if self._first.done():
                    first, self._first = self._first, None
                    first.result()
                return
            loop = asyncio.get_running_loop()
            for i in range(len(self.prompts)):
                self._opened.append(loop.create_future())
                self._tasks.append(loop.create_task(self._pump(i)))
            for fut in self._opened:
                await asyncio.shield(fut)
        finally:
            s.num_starting -= cost

    async def updates(self) -> AsyncIterator[dict[int, Any]]:
        """Batches of ``{stream index: newest output}``, until every stream has finished."""
        if self._first is not None:
            await self._first
            self._first = None
        while True:
            if self._error is not None:
                raise self._error
            if self.latest:
                batch, self.latest = self.latest, {}
                yield batch
                continue
            if all(self.finished):
                return
            if self._gen is not None:
                await self._next()
                continue
            self._wake.clear()
            await self._wake.wait()

    async def final(self) -> list[Any]:
        async for _ in self.updates():
            pass
        return list(self.last)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i, rid in enumerate(self.ids):
            if not self.finished[i]:
                try:
                    self._s.engine.abort(rid)
                except Exception:            # noqa: BLE001 - already gone is fine
                    logger.debug("abort(%s) failed", rid, exc_info=True)
                self._timings[i].finish([None] * self.params.n, self.generated[i])
        for task in self._tasks:
            task.cancel()
        if self._first is not None:
            self._first.cancel()
        for fut in self._opened:             # mark failures as seen (no "never retrieved" warnings)
            if fut.done() and not fut.cancelled():
                fut.exception()


class _Cursor:
    """What one choice's stream has sent so far."""
    __slots__ = ("offset", "started", "done", "held", "text", "reasoning_chars", "content_chars", "calls")

    def __init__(self) -> None:
        self.offset = self.reasoning_chars = self.content_chars = self.calls = 0
        self.started = self.done = False
        self.held = None          # deltas waiting for the prompt's logprobs (the first part carries them)
        self.text = ""            # a chat choice's text so far: the reasoning and tool parsers read all of it

    def take(self, c):
        """``c`` (a delta of this choice) after what was held, as one delta."""
        h, self.held = self.held, None
        if h is None:
            return c
        lps = None if h.logprobs is None or c.logprobs is None else h.logprobs + c.logprobs
        return CompletionOutput(c.index, h.text + c.text, h.token_ids + c.token_ids, c.finish_reason, c.stop_reason,
                                c.cumulative_logprob, lps)


class _StreamResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends (done, error, client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, awaitable) -> Any:
    """Await ``awaitable``; raise ``_ClientGone`` (cancelling it) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise _ClientGone


async def _by(deadline: Optional[float], awaitable):
    """Await ``awaitable``; with a ``deadline`` (``time.monotonic()``), ``asyncio.TimeoutError`` past it."""
    if deadline is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))


# ----------------------------------------------------------------------------- the routes' logic
def max_prompt_chars(tokenizer, max_model_len: int) -> Optional[int]:
    """The most characters a text prompt can have and still fit ``max_model_len`` tokens, or None
    when the tokenizer gives no sound bound. Longer text is refused before it is tokenized."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    try:
        longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    except Exception:                  # noqa: BLE001 - not a tokenizers.Tokenizer: no bound
        return None
    normalizer = backend.normalizer
    shrink = _NORMALIZER_SHRINK.get("None" if normalizer is None else type(normalizer).__name__)
    return None if shrink is None else max_model_len * longest * shrink


class _Prepared:
    """One request, parsed and tokenized (off the event loop for a big body)."""
    __slots__ = ("req", "prompts", "params", "echoes", "k", "field", "reasoning", "tools", "score", "echo_only",
                 "so_field", "lora")

    def __init__(self, req, prompts, params, echoes=None, k=None, field=None):
        self.req, self.prompts, self.params, self.echoes, self.k, self.field = req, prompts, params, echoes, k, field
        self.score = self.echo_only = False      # completions: echo with logprobs; max_tokens = 0 (echo only)
        self.so_field: Optional[str] = None      # the field that set a structured output (its 400s name it)
        self.reasoning = None          # a chat request's reasoning parser (reasoning.py), or None
        self.tools = ("none", None)    # a chat request's tool mode and forced function (tools.py)
        self.lora = None               # the LoRARequest its model names (lora.py), None for the base model


class _Serving:
    def __init__(self, engine, served_names: list[str], max_waiting: Optional[int], *,
                 heartbeat_timeout: Optional[float] = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 request_timeout: Optional[float] = None, reasoning_parser: Optional[str] = None,
                 auto_tool_choice: bool = False):
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.auto_tool_choice = auto_tool_choice
        # The checkpoint's generation_config sampling defaults, for the fields a request leaves unset.
        self.sampling_defaults = dict(getattr(engine, "sampling_overrides", {}) or {})
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.vocab_size)
        self.names = served_names
        self.lora = LoRAAdapters(engine, served_names)
        self.max_waiting = max_waiting
        self.num_starting = 0
        self.heartbeat_timeout = heartbeat_timeout
        self.request_timeout = request_timeout
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        self.chat_template = ChatTemplate.for_checkpoint(getattr(engine, "tokenizer_path", None) or engine.model_path)
        self.metrics = ServerMetrics(engine.stats, served_names[0], is_up=self.engine_up,
                                     max_model_len=getattr(engine, "max_model_len", None))
        self.created = int(time.time())
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS,
                                                                   thread_name_prefix="qwen-ops-prepare")
        self._prepare_slots: Optional[asyncio.Semaphore] = None     # made on the serving event loop

    # -- engine state
    def engine_up(self) -> bool:
        return bool(getattr(self.engine, "is_running", True))

    def stalled_for(self) -> float:
        """Seconds the engine has had work and finished no iteration (0 if it is idle or keeps up)."""
        age = getattr(self.engine, "heartbeat_age", None)
        return float(age()) if age is not None else 0.0

    def engine_down_error(self) -> P.APIError:
        # No Retry-After: a dead engine does not restart; the server must be restarted (by its supervisor).
        reason = getattr(self.engine, "dead_reason", None)
        return P.APIError(503, "the engine is not running" + (f" ({reason})" if reason else "")
                          + "; this server cannot serve requests until it is restarted")

    def output_kind(self, stream: bool) -> RequestOutputKind:
        """A stream's engine outputs are deltas. A response sent whole takes cumulative ones, or only
        the final one where the engine sends again to another replica a request whose replica failed
        before it yielded anything (data-parallel's ``retries_unsent``): then no non-streamed
        request has received anything before it finishes, and every one of them can be retried."""
        if stream:
            return RequestOutputKind.DELTA
        return RequestOutputKind.FINAL_ONLY if getattr(self.engine, "retries_unsent", False) \
            else RequestOutputKind.CUMULATIVE

    def dead_error(self, e: BaseException) -> P.APIError:
        """The 503 of an ``EngineDeadError`` ``e``: the engine's own state if it is down, else ``e``
        itself (a data-parallel replica failed under this request; the others serve)."""
        return P.APIError(503, str(e)) if self.engine_up() else self.engine_down_error()

    def check_engine(self) -> None:
        if not self.engine_up():
            raise self.engine_down_error()

    def deadline(self) -> Optional[float]:
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout

    def timeout_error(self) -> P.APIError:
        return P.APIError(504, f"the request did not finish within the server's --request-timeout of "
                               f"{self.request_timeout:g} s; it was aborted")

    async def prepare(self, fn, body: bytes) -> "_Prepared":
        """``fn(body)``: inline for a small body, else on the preparation pool (at most
        PREPARE_THREADS at once; the rest wait here, without holding the event loop)."""
        if len(body) <= INLINE_PREPARE_BYTES:
            return fn(body)
        if self._prepare_slots is None:
            self._prepare_slots = asyncio.Semaphore(PREPARE_THREADS)
        async with self._prepare_slots:
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, body)

    # -- shared checks
    def check_model(self, name: Optional[str]):
        """The LoRA adapter ``name`` runs with (None: the base model); a 404 for a name not served."""
        return self.lora.resolve(name)

    def check_beam_lora(self, req, lora) -> None:
        if req.use_beam_search and lora is not None:
            raise P.bad_request(f"use_beam_search runs the base model only; model = {req.model!r} is a LoRA "
                                "adapter", "use_beam_search")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise P.bad_request(f"{param} is text, but this model has no tokenizer; send token ids", param)
        bound = self.max_prompt_chars
        if bound is not None and len(text) > bound:
            raise P.bad_request(f"{param} has {len(text)} characters; this model's maximum context length is "
                                f"{self.max_model_len} tokens, which no text over {bound} characters fits", param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:      # a lone UTF-16 surrogate ("\ud800") is no text to tokenize
            raise P.bad_request(f"{param} holds an unpaired UTF-16 surrogate at character {e.start}; expected "
                                "valid Unicode text", param) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def constrained(self, req, kwargs: dict) -> tuple[dict, Optional[str]]:
        """``kwargs`` with the request's structured output, and the request field that set it. Not
        compiled here: the engine compiles it once, beside its loop, and a spec that fails comes
        back before the response starts, a 400 naming the field (``start``)."""
        found = P.structured_outputs(req)
        if found is None:
            return kwargs, None
        field, so = found
        return {**kwargs, "structured_outputs": self.check_spec(field, so)}, field

    def check_spec(self, field: str, so):
        """What can be known of ``so`` without compiling it (or importing xgrammar here: 0.6 s on
        the event loop): that this model can constrain output."""
        import importlib.util

        if self.tokenizer is None:
            raise P.bad_request("structured outputs need a tokenizer, and this model has none", field)
        if importlib.util.find_spec("xgrammar") is None:
            raise P.bad_request("structured outputs need the xgrammar package (pip install 'qwen_ops[structured]')",
                                field)
        return so

    def render_chat(self, messages, add_generation_prompt: bool, template_kwargs: Optional[dict],
                    tools: Optional[list] = None) -> str:
        """The chat template's text of ``messages`` (a 400 naming the field it cannot render)."""
        try:
            self.chat_template.check_kwargs(template_kwargs)    # before the ** below collides with its keywords
            return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **(template_kwargs or {}))
        except ChatTemplateError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise P.bad_request(str(e), param) from None

    def tokenize(self, body: bytes) -> dict:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens"}``."""
        req = P.parse_request(P.TokenizeRequest, body)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.bad_request("give exactly one of prompt (text) and messages (a chat)",
                                "prompt" if req.prompt is None else "messages")
        if req.prompt is not None:
            ids = self.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens is not False)
        else:
            text = self.render_chat(P.chat_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs)
            ids = self.encode(text, "messages", add_special_tokens=bool(req.add_special_tokens))
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(self, body: bytes) -> dict:
        """vLLM's ``/detokenize``: ``{"prompt": text}``."""
        req = P.parse_request(P.DetokenizeRequest, body)
        self.check_model(req.model)
        if self.tokenizer is None:
            raise P.bad_request("this model has no tokenizer to decode with", "tokens")
        for j, t in enumerate(req.tokens):
            if not 0 <= t < self.vocab_size:
                raise P.bad_request(f"tokens[{j}] = {t}, expected a token id in [0, {self.vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def check_ids(self, ids: list[int], where: str, param: str) -> None:
        if not ids:
            raise P.bad_request(f"{where} is empty; expected at least one token", param)
        for j, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise P.bad_request(f"{where}[{j}] = {t}, expected a token id in [0, {self.vocab_size})", param)

    def max_tokens_for(self, prompts: list[list[int]], requested: Optional[int], field: str, param: str) -> int:
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise P.bad_request(f"This model's maximum context length is {self.max_model_len} tokens, and the "
                                f"prompt has {longest}; no room is left to generate", param)
        if requested is None:            # generation_config's max_new_tokens, if it fits (vLLM's default)
            room = self.max_model_len - longest
            return min(room, self.sampling_defaults.get("max_tokens", room))
        if longest + requested > self.max_model_len:
            raise P.bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {longest + requested} tokens ({longest} in the {param}, {requested} "
                                f"in the completion). Please reduce the {param} or {field}.", field)
        return requested

    async def launch(self, prep: _Prepared, rid: str, param: str, deadline: Optional[float]) -> _Generation:
        """The engine requests of ``prep``, submitted (``start``)."""
        gen = _Generation(self, prep.prompts, prep.params, rid, prep.lora)
        await self.start(gen, param, prep.req.stream, deadline, prep.so_field)
        return gen

    async def start(self, gen: _Generation, param: str, stream: bool, deadline: Optional[float],
                    so_field: Optional[str] = None) -> None:
        """Submit ``gen``; a non-streamed request, and any with a structured output (its grammar
        compiles in the engine: a bad one is a 400 before the response starts), wait here for
        their first output."""
        from qwen_ops.serving.async_llm import QueueFullError

        try:
            await _by(deadline, gen.start(self.max_waiting, wait_first=not stream or so_field is not None))
        except BaseException as e:
            gen.close()
            if isinstance(e, QueueFullError):
                raise P.APIError(503, str(e) or "too many waiting requests; retry later",
                                 headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
            if isinstance(e, EngineDeadError):
                raise self.dead_error(e) from None
            if isinstance(e, asyncio.TimeoutError) and deadline is not None:
                raise self.timeout_error() from None
            if isinstance(e, ValueError):
                message = str(e)
                if so_field is not None and message.startswith("structured_outputs"):
                    raise P.bad_request(message.replace("structured_outputs", so_field, 1), so_field) from None
                head = message.split(" ", 1)[0].split("[", 1)[0]
                raise P.bad_request(message, param if head in ("prompts", "prompt") else head) from None
            raise

    async def respond(self, request: Request, gen: _Generation, stream: bool, render_full, render_stream,
                      deadline: Optional[float], *, error_event: Callable[[dict], str] = _sse,
                      done: Optional[str] = SSE_DONE):
        """The response: ``render_full(outputs)`` as JSON, or the SSE events ``render_stream(gen)``
        yields; an error after the stream has started is sent as ``error_event(body)``, and ``done``
        ends the stream (the completions APIs' ``[DONE]``; the Responses API sends none)."""
        if stream:
            return _StreamResponse(self._guard_stream(render_stream(gen), deadline, error_event, done), gen.close)
        got = await self.final_outputs(request, [gen], deadline)
        return Response(status_code=499) if got is None else JSONResponse(render_full(got[0]))

    async def final_outputs(self, request: Request, gens: Sequence[_Generation],
                            deadline: Optional[float]) -> Optional[list[list[Any]]]:
        """Each of ``gens``' final outputs (``_Generation.final``), awaited together; None when the
        client went away first. Every one of them is closed however this ends."""
        try:
            return await _until_disconnect(request, _by(deadline, asyncio.gather(*(g.final() for g in gens))))
        except _ClientGone:
            return None
        except EngineDeadError as e:
            raise self.dead_error(e) from None
        except asyncio.TimeoutError:
            if deadline is None:
                raise
            raise self.timeout_error() from None
        finally:
            for g in gens:
                g.close()

    async def _guard_stream(self, chunks: AsyncIterator[str], deadline: Optional[float],
                            error_event: Callable[[dict], str], done: Optional[str]) -> AsyncIterator[str]:
        try:
            while True:
                try:
                    chunk = await _by(deadline, chunks.__anext__())
                except StopAsyncIteration:
                    break
                yield chunk
        except EngineDeadError as e:           # the stream has started: report in-band, no traceback
            logger.warning("a streaming request ended: %s", getattr(self.engine, "dead_reason", None) or e)
            # the engine still runs (a data-parallel replica failed under this stream): that is the error
            yield error_event(self.dead_error(e).body())
        except asyncio.TimeoutError:
            if deadline is None:
                raise
            yield error_event(self.timeout_error().body())
        except Exception:                     # noqa: BLE001 - the stream has started: report in-band
            logger.exception("a streaming request failed")
            yield error_event(P.APIError(500, "internal server error").body())
        if done is not None:
            yield done

    # -- /v1/completions
    def _prepare_completion(self, body: bytes) -> _Prepared:
        req = P.parse_request(P.CompletionRequest, body)
        lora = self.check_model(req.model)
        P.check_unsupported(req)
        self.check_beam_lora(req, lora)
        echo_only = req.max_tokens == 0         # score the prompt, generate nothing (vLLM: with echo)
        if echo_only and not req.echo:
            raise P.bad_request("max_tokens = 0 returns only the prompt, so it needs echo = true; "
                                "expected max_tokens >= 1 or echo = true", "max_tokens")
        if not echo_only:
            P.check_positive("max_tokens", req.max_tokens)
        P.check_logprobs("logprobs", req.logprobs)
        P.check_logprobs("prompt_logprobs", req.prompt_logprobs)
        if req.use_beam_search and req.stream:
            raise P.bad_request("use_beam_search returns the n best sequences once, at the end; expected "
                                "stream = false", "use_beam_search")
        score = req.echo and req.logprobs is not None    # the echoed prompt's tokens get logprobs too
        raw = P.completion_prompts(req.prompt)
        P.check_choices(len(raw), req.n)
        P.stop_strings(req.stop)
        prompts = []
        for i, p in enumerate(raw):
            where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            ids = self.encode(p, "prompt") if isinstance(p, str) else p
            self.check_ids(ids, where, "prompt")
            prompts.append(ids)
        max_tokens = self.max_tokens_for(prompts, 1 if echo_only else req.max_tokens, "max_tokens", "prompt")
        kwargs, so_field = self.constrained(req, P.sampling_kwargs(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                                                   defaults=self.sampling_defaults))
        if score:
            kwargs["prompt_logprobs"] = max(req.prompt_logprobs or 0, req.logprobs)
        kwargs["output_kind"] = self.output_kind(req.stream)
        params = P.check_params(P.sampling_params(kwargs, max_tokens_field="max_tokens"), self.vocab_size,
                                self.tokenizer)
        echoes = [(p if isinstance(p, str) else self.decode(p)) if req.echo else "" for p in raw]
        prep = _Prepared(req, prompts, params, echoes, req.logprobs)
        prep.score, prep.echo_only, prep.so_field, prep.lora = score, echo_only, so_field, lora
        return prep

    async def completions(self, request: Request, body: bytes):
        deadline = self.deadline()
        self.check_engine()
        prep = await self.prepare(self._prepare_completion, body)
        req, prompts, params, echoes, k = prep.req, prep.prompts, prep.params, prep.echoes, prep.k
        rid = f"cmpl-{uuid.uuid4().hex}"
        meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_of(prep)}
        if req.use_beam_search:
            outs = await _by(deadline, self.beam_search(prompts, req, params, rid))
            choices = [{"index": i * req.n + j, "text": echoes[i] + s.text, "logprobs": None,
                        "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
                       for i, o in enumerate(outs) for j, s in enumerate(o.sequences)]
            generated = sum(len(s.tokens) - len(p) for p, o in zip(prompts, outs) for s in o.sequences)
            return JSONResponse({**meta, "choices": choices, "usage": P.usage(sum(map(len, prompts)), generated)})
        gen = await self.launch(prep, rid, "prompt", deadline)

        score, echo_only, show_prompt = prep.score, prep.echo_only, req.prompt_logprobs is not None

        def logprobs_of(i: int, prompt_lps, c, new_ids, entries, offset: int, first: bool):
            """The legacy logprobs of a choice's new tokens (after its echoed prompt's, in its first part)."""
            head = lp = None
            if first and score and prompt_lps is not None:
                head, offset = P.echo_logprobs(prompts[i], prompt_lps, k, self.decode)
            if k is not None and c.logprobs is not None and not echo_only:
                lp, offset = P.completion_logprobs(new_ids, entries, k, offset, self.decode)
            if head is not None:
                lp = head if lp is None else P.join_logprobs(head, lp)
            return lp, offset

        def choice_text(i: int, c) -> str:
            return echoes[i] if echo_only else echoes[i] + c.text

        def full(outputs):
            choices, generated = [], 0
            for i, out in enumerate(outputs):
                for c in out.outputs:
                    generated += 0 if echo_only else len(c.token_ids)
                    lp, _ = logprobs_of(i, out.prompt_logprobs, c, c.token_ids, c.logprobs, len(echoes[i]), True)
                    choice = {"index": i * params.n + c.index, "text": choice_text(i, c), "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if show_prompt:
                        choice["prompt_logprobs"] = P.vllm_prompt_logprobs(out.prompt_logprobs)
                    choices.append(choice)
            return {**meta, "choices": choices, "usage": P.usage(sum(map(len, prompts)), generated)}

        head = _ChunkHead(meta)

        async def chunks(g: _Generation):
            cursors: dict[tuple[int, int], _Cursor] = {}
            prompt_lps: dict[int, Any] = {}
            async for batch in g.updates():
                events = []
                for i, out in sorted(batch.items()):
                    if out.prompt_logprobs is not None:   # deltas carry them once
                        prompt_lps[i] = out.prompt_logprobs
                    todo = {c.index: c for c in out.outputs}       # deltas: only the completions that changed
                    if i in prompt_lps:                   # and those held for the prompt's logprobs
                        todo.update({j: None for (ii, j), cur in cursors.items()
                                     if ii == i and cur.held is not None and j not in todo})
                    for j in sorted(todo):
                        cur = cursors.setdefault((i, j), _Cursor())
                        if todo[j] is None:
                            c, cur.held = cur.held, None
                        else:
                            c = cur.take(todo[j])
                        if cur.done:
                            continue
                        if not cur.started and (score or show_prompt) and i not in prompt_lps:
                            cur.held = c                  # its first part waits for the prompt's logprobs
                            continue
                        text, new_ids = c.text, c.token_ids
                        if not (text or new_ids or c.finish_reason or not cur.started):
                            continue
                        if echo_only:
                            text, new_ids = "", []
                        prefix = "" if cur.started else echoes[i]
                        lp, cur.offset = logprobs_of(i, prompt_lps.get(i), c, new_ids, c.logprobs or [],
                                                     cur.offset + len(prefix), not cur.started)
                        extra = ""
                        if show_prompt and not cur.started:
                            extra = f',"prompt_logprobs":{_dumps(P.vllm_prompt_logprobs(prompt_lps.get(i)))}'
                        cur.started = True
                        cur.done = c.finish_reason is not None
                        events.append(head.event(i * params.n + c.index, (
                            f'"text":{_json_str(prefix + text)},"logprobs":{_opt(lp)},'
                            f'"finish_reason":{_opt(c.finish_reason)},"stop_reason":{_opt(c.stop_reason)}{extra}')))
                if events:
                    yield "".join(events)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse({**meta, "choices": [], "usage": P.usage(sum(map(len, prompts)),
                                                                    0 if echo_only else sum(g.generated))})

        return await self.respond(request, gen, req.stream, full, chunks, deadline)

    async def beam_search(self, prompts: list[list[int]], req, params, rid: str) -> list:
        """vLLM's ``use_beam_search``: the ``n`` best sequences of each prompt (``beam_search_async``)."""
        from qwen_ops.serving.beam_search import BeamSearchParams, beam_search_async

        try:
            bp = BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                  temperature=params.temperature, length_penalty=req.length_penalty,
                                  include_stop_str_in_output=params.include_stop_str_in_output)
        except ValueError as e:
            field = "n" if str(e).startswith("beam_width") else str(e).split(" ", 1)[0]
            raise P.bad_request(str(e).replace("beam_width", "n (the beam width)", 1), field) from None
        eos = frozenset(getattr(self.engine, "eos_token_ids", ()))
        return await asyncio.gather(*(beam_search_async(self.engine, p, bp, eos, f"{rid}-{i}")
                                      for i, p in enumerate(prompts)))

    # -- /v1/chat/completions
    def _prepare_chat(self, body: bytes) -> _Prepared:
        return self.prepare_chat(P.parse_request(P.ChatCompletionRequest, body))

    def prepare_chat(self, req: P.ChatCompletionRequest, *, auto_tools_need_flag: bool = True) -> _Prepared:
        """A chat request rendered, tokenized and turned into sampling parameters (also the
        Responses API's, responses.py). ``auto_tools_need_flag``: "auto" tool choice without
        ``--enable-auto-tool-choice`` is a 400 (vLLM's chat rule); False lets it through (vLLM's
        Responses API: the tools are rendered, the reply is left unparsed)."""
        lora = self.check_model(req.model)
        P.check_unsupported(req)
        self.check_beam_lora(req, lora)
        messages = P.chat_messages(req.messages)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        P.check_positive(field, requested)
        if req.top_logprobs is not None and not req.logprobs:
            raise P.bad_request("top_logprobs needs logprobs = true", "top_logprobs")
        P.check_logprobs("top_logprobs", req.top_logprobs)
        P.check_logprobs("prompt_logprobs", req.prompt_logprobs)
        P.stop_strings(req.stop)
        tools, mode, named = P.chat_tools(req.tools, req.tool_choice)
        if req.use_beam_search and (req.stream or mode != "none" or P.structured_outputs(req) is not None):
            raise P.bad_request("use_beam_search returns the n best replies once, at the end, unconstrained; expected "
                                "stream = false, no tools and no structured output", "use_beam_search")
        if mode == "auto" and not self.auto_tool_choice and auto_tools_need_flag:   # tools alone mean "auto"
            raise P.bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                'be set; expected tool_choice "none", "required" or a named function, or a server '
                                "started with them", "tool_choice")
        text = self.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs, tools)
        ids = self.encode(text, "messages", add_special_tokens=False)
        self.check_ids(ids, "messages (rendered)", "messages")
        max_tokens = self.max_tokens_for([ids], requested, field, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        kwargs, so_field = self.constrained(req, P.sampling_kwargs(req, max_tokens=max_tokens, logprobs=k,
                                                                   defaults=self.sampling_defaults))
        if mode in ("required", "named"):          # forced: the reply is the call's JSON (tools.py)
            if "structured_outputs" in kwargs:
                raise P.bad_request(f"tool_choice = {mode!r} and a structured output both constrain the reply; "
                                    "give one", "tool_choice")
            so_field = "tool_choice"
            kwargs["structured_outputs"] = self.check_spec(so_field, StructuredOutputsParams(json=P.tool_call_schema(
                mode, tools, named, parallel=req.parallel_tool_calls is not False)))
        kwargs["output_kind"] = self.output_kind(req.stream)
        params = P.check_params(P.sampling_params(kwargs, max_tokens_field=field, logprobs_field="top_logprobs"),
                                self.vocab_size, self.tokenizer)
        prep = _Prepared(req, [ids], params, None, k, field)
        prep.so_field = so_field
        prep.reasoning = make_parser(self.reasoning_parser, text) if mode == "none" else None
        prep.tools = (mode, named)
        prep.lora = lora
        return prep

    async def chat(self, request: Request, body: bytes):
        deadline = self.deadline()
        self.check_engine()
        prep = await self.prepare(self._prepare_chat, body)
        req, (ids,), params, k = prep.req, prep.prompts, prep.params, prep.k
        parser = prep.reasoning
        mode, named = prep.tools
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        meta = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_of(prep)}
        if req.use_beam_search:
            (out,) = await _by(deadline, self.beam_search([ids], req, params, rid))
            choices = [{"index": j, "message": {"role": "assistant", "content": s.text, "tool_calls": []},
                        "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
                       for j, s in enumerate(out.sequences)]
            generated = sum(len(s.tokens) - len(ids) for s in out.sequences)
            return JSONResponse({**meta, "choices": choices, "usage": P.usage(len(ids), generated)})
        gen = await self.launch(prep, rid, "messages", deadline)

        def full(outputs):
            (out,) = outputs
            choices = [self.chat_choice(prep, c, c.index) for c in out.outputs]
            generated = sum(len(c.token_ids) for c in out.outputs)
            resp = {**meta, "choices": choices, "usage": P.usage(len(ids), generated)}
            if req.prompt_logprobs is not None:      # vLLM's extra field, beside the choices
                resp["prompt_logprobs"] = P.vllm_prompt_logprobs(out.prompt_logprobs)
            return resp

        chunk_meta = {**meta, "object": "chat.completion.chunk"}

        head = _ChunkHead(chunk_meta)

        def event(index: int, delta: str, logprobs=None, finish=None, stop_reason=None) -> str:
            return head.event(index, f'"delta":{delta},"logprobs":{_opt(logprobs)},"finish_reason":{_opt(finish)},'
                                     f'"stop_reason":{_opt(stop_reason)}')

        async def chunks(g: _Generation):
            yield "".join(event(j, '{"role":"assistant","content":""}') for j in range(params.n))
            cursors = [_Cursor() for _ in range(params.n)]
            async for batch in g.updates():
                events = []
                for c in batch[0].outputs:                # deltas: only the choices that changed
                    cur = cursors[c.index]
                    if cur.done:
                        continue
                    text, new_ids = c.text, c.token_ids
                    cur.text += text
                    finish = c.finish_reason
                    if mode != "none":
                        final = c.finish_reason is not None
                        if mode == "auto":
                            content, calls = T.stream_split(cur.text, final)
                            calls = T.first_call_only(calls, req.parallel_tool_calls)
                        else:
                            content, calls = "", (T.forced_calls(mode, cur.text, named) if final else [])
                        if len(content) > cur.content_chars:
                            events.append(event(c.index, f'{{"content":{_json_str(content[cur.content_chars:])}}}'))
                            cur.content_chars = len(content)
                        if len(calls) > cur.calls:
                            deltas = T.openai_calls(calls[cur.calls:], with_index=True, start=cur.calls)
                            events.append(event(c.index, _dumps({"tool_calls": deltas})))
                            cur.calls = len(calls)
                        if final and cur.calls and finish == "stop":
                            finish = "tool_calls"
                    elif parser is not None:
                        reasoning, content = parser.split(cur.text, final=c.finish_reason is not None)
                        parts = []
                        if reasoning is not None and len(reasoning) > cur.reasoning_chars:
                            parts.append(f'"reasoning_content":{_json_str(reasoning[cur.reasoning_chars:])}')
                            cur.reasoning_chars = len(reasoning)
                        if len(content) > cur.content_chars:
                            parts.append(f'"content":{_json_str(content[cur.content_chars:])}')
                            cur.content_chars = len(content)
                        if parts:
                            events.append(event(c.index, "{" + ",".join(parts) + "}"))
                    elif text or (new_ids and k is not None):
                        lp = None
                        if k is not None and c.logprobs is not None:
                            lp = {"content": P.chat_logprobs(new_ids, c.logprobs, k, self.decode)}
                        events.append(event(c.index, f'{{"content":{_json_str(text)}}}', lp))
                    if c.finish_reason is not None:
                        cur.done = True
                        events.append(event(c.index, "{}", None, finish, c.stop_reason))
                if events:
                    yield "".join(events)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse({**chunk_meta, "choices": [], "usage": P.usage(len(ids), g.generated[0])})

        return await self.respond(request, gen, req.stream, full, chunks, deadline)

    def chat_choice(self, prep: _Prepared, c, index: int) -> dict:
        """One choice of a chat reply sent whole: the finished completion ``c`` split by ``prep``'s
        reasoning and tool parsers. ``message.tool_calls`` is always there, ``[]`` when the reply
        calls none: vLLM's ``ChatMessage`` sent it so until 0.32 (which drops an empty list), and its
        tools example iterates it unguarded (``for call in message.tool_calls``)."""
        req, k, parser = prep.req, prep.k, prep.reasoning
        mode, named = prep.tools
        lp = None
        if k is not None and c.logprobs is not None:
            lp = {"content": P.chat_logprobs(c.token_ids, c.logprobs, k, self.decode)}
        message = {"role": "assistant", "content": c.text, "tool_calls": []}
        finish = c.finish_reason
        if parser is not None:
            message["reasoning_content"], message["content"] = parser.split(c.text)
        if mode != "none":
            if mode == "auto":
                content, calls = T.parse_hermes(c.text)
                calls = T.first_call_only(calls, req.parallel_tool_calls)
            else:
                content, calls = None, T.forced_calls(mode, c.text, named)
            if calls:
                message["content"], message["tool_calls"] = content, T.openai_calls(calls)
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def model_of(self, prep: _Prepared) -> str:
        """A response's ``model``: the adapter's name, or the (first) served name (vLLM's)."""
        return self.names[0] if prep.lora is None else prep.lora.lora_name

    def models(self) -> dict:
        base = [{"id": name, "object": "model", "created": self.created, "owned_by": "qwen-ops",
                 "root": self.names[0], "parent": None, "max_model_len": self.max_model_len} for name in self.names]
        return {"object": "list", "data": base + self.lora.cards(self.created)}

    # -- LoRA adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    async def load_lora_adapter(self, body: bytes) -> Response:
        req = P.parse_request(LoadLoRAAdapterRequest, body)
        await self.lora.load(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, body: bytes) -> Response:
        req = P.parse_request(UnloadLoRAAdapterRequest, body)
        await self.lora.unload(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")


# ----------------------------------------------------------------------------- ASGI plumbing
def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _BodyLimit:
    """413 for a body over ``max_bytes``: from Content-Length up front, else while it is read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = P.APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return await _error_response(P.bad_request(f"Content-Length = {value!r} is not an integer"))(
                        scope, receive, send)
                if length > self.max_bytes:
                    return await _error_response(too_big)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_big
            return message

        await self.app(scope, limited_receive, send)


class _CatchAll:
    """The last line: an exception no handler took becomes a generic 500 (traceback to the log only)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:                      # noqa: BLE001
            logger.exception("request %s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await _error_response(P.APIError(500, "internal server error"))(scope, receive, send)


def _check_seconds(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not value > 0 or value == float("inf")):
        raise ValueError(f"{name} = {value!r}, expected a finite number of seconds > 0 or None")


def build_app(engine, *, served_model_name: Union[str, Sequence[str]], api_key: Optional[str] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_waiting: Optional[int] = None,
              heartbeat_timeout: Optional[float] = DEFAULT_HEARTBEAT_TIMEOUT_S,
              request_timeout: Optional[float] = None, reasoning_parser: Optional[str] = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None,
              lora_modules: Sequence[LoRAModulePath] = (),
              allow_runtime_lora_updating: Optional[bool] = None, disable_log_stats: bool = False,
              log_stats_interval: Optional[float] = None,
              enable_responses_store: Optional[bool] = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``AsyncLLM``).

    ``served_model_name``: the name (or names; the first is reported) requests must use.
    ``api_key``: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``; an empty
    or blank key is an error, never "no authentication" (leave it None for that).
    ``max_body_bytes``: larger request bodies get 413. ``max_waiting``: the most completions
    (``n`` per prompt) this app lets wait for their first output at once before answering 503
    (None: no bound here; the engine's own ``max_waiting_requests`` still applies).
    ``heartbeat_timeout``: ``/health`` answers 503 while the engine has work and has finished no
    iteration for this many seconds (None: never). ``request_timeout``: a request still running
    after this many seconds is aborted and answered 504 (in-band once a stream has started).
    ``reasoning_parser``: ``"qwen3"`` splits chat replies into ``reasoning_content`` and
    ``content`` (``reasoning.py``), streamed too; None leaves the text whole.
    ``enable_auto_tool_choice`` with ``tool_call_parser="hermes"`` (vLLM's flags): ``tool_choice``
    ``"auto"`` (the default when a request has tools) parses the reply's tool calls; without them
    such a request is a 400, as vLLM's. Forced (``"required"``, named) calls work either way.
    ``lora_modules`` (vLLM's ``--lora-modules``; the engine built with ``enable_lora=True``): the
    adapters served under their own names, each parsed here (a bad one raises ValueError). Call
    this outside a running event loop when there are any. ``allow_runtime_lora_updating`` (None:
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): add ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
    Unless ``disable_log_stats``, vLLM's engine line (stats_log.py) is logged every
    ``log_stats_interval`` seconds while requests run (None: ``VLLM_LOG_STATS_INTERVAL``, else 10).
    ``enable_responses_store`` (None: ``VLLM_ENABLE_RESPONSES_API_STORE``): keep the latest
    responses for ``previous_response_id`` and ``GET /v1/responses/{id}`` (responses.py).
    """
    names = _check_app_args(served_model_name, api_key, max_body_bytes, max_waiting, heartbeat_timeout,
                            request_timeout, reasoning_parser, enable_auto_tool_choice, tool_call_parser)
    serving = _Serving(engine, names, max_waiting, heartbeat_timeout=heartbeat_timeout,
                       request_timeout=request_timeout, reasoning_parser=reasoning_parser,
                       auto_tool_choice=bool(enable_auto_tool_choice))
    if lora_modules:
        asyncio.run(serving.lora.load_static(list(lora_modules)))
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_updating_allowed()
    stats_logger = None
    if not disable_log_stats:
        stats_logger = StatsLogger(engine.stats, serving.metrics.interval_tokens, serving.engine_up,
                                   interval_from_env() if log_stats_interval is None else log_stats_interval)
    responses = ResponsesRoutes(serving, store=responses_store_enabled() if enable_responses_store is None
                                else bool(enable_responses_store))
    app = FastAPI(title="qwen-ops OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(stats_logger))
    app.state.serving = serving
    app.state.metrics = serving.metrics
    app.state.stats_logger = stats_logger
    _add_error_handlers(app)
    keyed = [Depends(_api_key_check(api_key))]
    _add_health_routes(app, serving, heartbeat_timeout)
    _add_model_routes(app, serving, keyed, allow_runtime_lora_updating, responses)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(_CatchAll)
    return app


def _lifespan(stats_logger: Optional[StatsLogger]):
    """The app's lifespan: the stats line's task runs on the server's event loop while it serves."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.ensure_future(stats_logger.run()) if stats_logger is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    return lifespan


def _check_app_args(served_model_name, api_key, max_body_bytes, max_waiting, heartbeat_timeout, request_timeout,
                    reasoning_parser, enable_auto_tool_choice, tool_call_parser) -> list[str]:
    """``build_app``'s arguments checked, before anything is built; the served names."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name = {served_model_name!r}, expected a non-empty str or list of them")
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError(f"api_key = {api_key!r} is empty or blank; expected a non-empty key, or None for "
                         "no authentication")
    _check_seconds("heartbeat_timeout", heartbeat_timeout)
    _check_seconds("request_timeout", request_timeout)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes = {max_body_bytes!r}, expected an int >= 1")
    if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                    or max_waiting < 0):
        raise ValueError(f"max_waiting = {max_waiting!r}, expected an int >= 0 or None")
    make_parser(reasoning_parser, "")                  # a bad name fails here, not per request
    if tool_call_parser not in (None, "hermes"):
        raise ValueError(f"tool_call_parser = {tool_call_parser!r}, expected 'hermes' (Qwen's format) or None")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser hermes), as vLLM's")
    return names


def _api_key_check(api_key: Optional[str]):
    """The dependency of the ``/v1`` routes: ``Authorization: Bearer <api_key>`` when a key is set."""
    expected_key = api_key.encode() if api_key is not None else None

    async def check_api_key(request: Request) -> None:
        # async: FastAPI runs a plain def dependency on its thread pool, a thread hop per request.
        if expected_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected_key):
            raise P.APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'")

    return check_api_key


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body (``_error_response``)."""
    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(P.validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error_response(P.APIError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)))


def _add_health_routes(app: FastAPI, serving: "_Serving", heartbeat_timeout: Optional[float]) -> None:
    """``/health`` (and vLLM's ``/ping``, GET or POST, its SageMaker alias), ``/metrics``, and,
    outside the key as vLLM's (its bench client aligns prompts with them), ``/tokenize``,
    ``/detokenize`` and ``/version``."""
    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        replicas = getattr(serving.engine, "replica_health", None)     # data-parallel: each replica's state
        if not serving.engine_up():       # AsyncLLM's loop has stopped
            reason = getattr(serving.engine, "dead_reason", None) if replicas is not None else None
            return _error_response(P.APIError(503, "the engine is not running" + (f" ({reason})" if reason else "")))
        stalled = serving.stalled_for()
        if heartbeat_timeout is not None and stalled > heartbeat_timeout:
            return _error_response(P.APIError(503, f"the engine has requests to run and has finished no "
                                                   f"iteration for {stalled:.1f} s (heartbeat timeout "
                                                   f"{heartbeat_timeout:g} s)"))
        if replicas is not None:
            return JSONResponse({"replicas": replicas()})
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await run_in_threadpool(serving.metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return serving.tokenize(await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return serving.detokenize(await request.body())

    @app.get("/version")
    async def version():
        import qwen_ops

        return {"version": qwen_ops.__version__}


def _add_model_routes(app: FastAPI, serving: "_Serving", keyed: list, lora_updating: bool,
                      responses: ResponsesRoutes) -> None:
    """The model routes, under the API key: models, completions, chat, the Responses API, the
    pooling routes (a generation server answers them 400, as vLLM's) and, when allowed, vLLM's
    LoRA routes."""
    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return serving.models()

    pooling = PoolingRoutes(serving)
    batch_chat = BatchChatRoutes(serving)

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request):
        pooling.refuse_generation("Completions")
        return await serving.completions(request, await request.body())

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request):
        pooling.refuse_generation("Chat Completions")
        return await serving.chat(request, await request.body())

    @app.post("/v1/chat/completions/batch", dependencies=keyed)
    async def batch_chat_completions(request: Request):
        pooling.refuse_generation("Chat Completions")
        return await batch_chat.create(request, await request.body())

    @app.post("/v1/responses", dependencies=keyed)
    async def create_response(request: Request):
        pooling.refuse_generation("Responses")
        return await responses.create(request, await request.body())

    @app.get("/v1/responses/{response_id}", dependencies=keyed)
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    # The pooling routes (openai/pooling.py). A client that goes away cancels the work, which aborts
    # its pooling requests (AsyncLLM.encode).
    async def pooled(request: Request, route):
        try:
            return await _until_disconnect(request, route(await request.body()))
        except _ClientGone:
            return Response(status_code=499)

    @app.post("/v1/embeddings", dependencies=keyed)
    async def embeddings(request: Request):
        return await pooled(request, pooling.embeddings)

    @app.post("/score", dependencies=keyed)
    @app.post("/v1/score", dependencies=keyed)
    async def score(request: Request):
        return await pooled(request, pooling.score)

    @app.post("/rerank", dependencies=keyed)
    @app.post("/v1/rerank", dependencies=keyed)
    @app.post("/v2/rerank", dependencies=keyed)
    async def rerank(request: Request):
        return await pooled(request, pooling.rerank)

    @app.post("/pooling", dependencies=keyed)
    async def pooling_route(request: Request):
        return await pooled(request, pooling.pool)

    @app.post("/classify", dependencies=keyed)
    async def classify(request: Request):
        return await pooled(request, pooling.classify)

    if lora_updating:
        @app.post("/v1/load_lora_adapter", dependencies=keyed)
        async def load_lora_adapter(request: Request):
            return await serving.load_lora_adapter(await request.body())

        @app.post("/v1/unload_lora_adapter", dependencies=keyed)
        async def unload_lora_adapter(request: Request):
            return await serving.unload_lora_adapter(await request.body())


# ----------------------------------------------------------------------------- running it
def _idle_guarded(base: type) -> type:
    """``base`` (uvicorn's HTTP protocol) that also closes a connection which sends no complete
    request head within ``timeout_keep_alive`` seconds of opening, or of its previous response.

    uvicorn arms its keep-alive timer only after a response, and the first byte of a new request
    cancels it: a connection that never sends a request, or sends half a request line and stops,
    would stay open forever (a handful of idle sockets could hold every file descriptor)."""

    class IdleGuardedProtocol(base):
        _idle_timer = None

        def _arm_idle(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_timeout)

        def _idle_timeout(self) -> None:
            self._idle_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return                         # its head arrived: a request is being served
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_idle()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_idle()

        def connection_lost(self, exc) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            super().connection_lost(exc)

    IdleGuardedProtocol.__name__ = IdleGuardedProtocol.__qualname__ = f"IdleGuarded{base.__name__}"
    return IdleGuardedProtocol


def _http_protocol() -> type:
    # The class uvicorn's http="auto" picks: httptools when installed (the serve extra), else h11.
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return _idle_guarded(base)


def uvicorn_config(app, host: str, port: int, *, log_level: str = "info",
                   timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S, **options):
    """uvicorn's Config for this app, with the idle-connection guard (``_idle_guarded``)."""
    import uvicorn

    _check_seconds("timeout_keep_alive", timeout_keep_alive)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          timeout_keep_alive=timeout_keep_alive, http=_http_protocol(), **options)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (as uvicorn would bind it), or a RuntimeError naming them.

    ``serve`` binds before it loads the model, so a port in use is one line at once, not a model
    load followed by uvicorn's log, and the port stays ours while the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn (and asyncio) do
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        reason = (e.strerror or str(e)).lower()
        raise RuntimeError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(False)
    return sock


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server on a socket we bound; it logs where it listens, as it does when it binds."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if sockets is not None and self.started:
                self._log_started_message(sockets)

    return Server


class ServerThread:
    """Run ``app`` with uvicorn in a background thread on ``host:port`` (port 0: a free one).

    A context manager: entering waits (at most ``start_timeout`` s) until the socket listens;
    leaving asks uvicorn to exit and joins the thread. ``uvicorn_options`` go to ``uvicorn.Config``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout: float = 30.0, **uvicorn_options):
        import uvicorn

        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level, **uvicorn_options))
        self.host = host
        self.port: Optional[int] = None
        self._start_timeout = start_timeout
        self.thread = threading.Thread(target=self.server.run, name="qwen-ops-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self._start_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.host} did not start (see its log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.host} did not start within {self._start_timeout} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(args) -> int:
    """``qwen-ops serve``: load the model, then serve until interrupted."""
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port = {args.port}, expected 0..65535")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes = {args.max_body_bytes}, expected >= 1")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests = {args.max_waiting_requests}, expected >= 1")
    for flag, value in (("--engine-heartbeat-timeout", args.engine_heartbeat_timeout),
                        ("--request-timeout", args.request_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{flag} = {value}, expected a number of seconds > 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes), as vLLM's")
    api_key = _api_key(args.api_key)
    lora_modules = _lora_modules(args)
    disable_log_stats = bool(getattr(args, "disable_log_stats", False))    # an EngineArgs field (vLLM's flag)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.validate()                          # LLM(...)'s check, word for word, before the port and the load
    names = args.served_model_name or [default_served_model_name(args.model)]
    sock = bind_socket(args.host, args.port)        # before the model load: a port in use fails at once
    try:
        engine = _start_engine(engine_args, args)
        try:
            app = build_app(engine, served_model_name=names, api_key=api_key, max_body_bytes=args.max_body_bytes,
                            heartbeat_timeout=args.engine_heartbeat_timeout, request_timeout=args.request_timeout,
                            reasoning_parser=args.reasoning_parser,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser, lora_modules=lora_modules,
                            disable_log_stats=disable_log_stats)
            port = sock.getsockname()[1]
            print(startup_line(engine, names, args.host, port), file=sys.stderr, flush=True)
            if not disable_log_stats:
                _show_stats_lines()
            server = _server_class()(uvicorn_config(app, args.host, port, log_level=args.uvicorn_log_level,
                                                    timeout_keep_alive=args.timeout_keep_alive,
                                                    access_log=not getattr(args, "disable_uvicorn_access_log",
                                                                           False)))
            server.run(sockets=[sock])
            # uvicorn re-raises a captured Ctrl-C after its shutdown, but under asyncio's runner that
            # becomes a cancel of a task that may already have ended (seen once: exit 0 instead of 130)
            if signal.SIGINT in getattr(server, "_captured_signals", ()):
                raise KeyboardInterrupt
        finally:
            engine.shutdown()
    finally:
        sock.close()
    return 0


def _start_engine(engine_args: EngineArgs, args):
    """``serve``'s engine: one ``AsyncLLM``, or with ``--data-parallel-size N > 1`` N of them behind a
    ``DataParallelAsyncLLM`` (each in its own process, ``--threads-per-replica`` threads each)."""
    from qwen_ops.serving.async_llm import AsyncLLM

    threads = getattr(args, "threads_per_replica", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads-per-replica = {threads}, expected >= 1")
    if engine_args.data_parallel_size > 1:
        if not args.engine_process:
            raise ValueError(f"--data-parallel-size = {engine_args.data_parallel_size} with --no-engine-process; "
                             "replicas are engine processes, expected --engine-process (the default)")
        from qwen_ops.serving.data_parallel import DataParallelAsyncLLM

        hang = getattr(args, "replica_hang_timeout", None)
        if hang is not None and not hang > 0:
            raise ValueError(f"--replica-hang-timeout = {hang}, expected seconds > 0")
        return DataParallelAsyncLLM.from_engine_args(engine_args, threads_per_replica=threads,
                                                     max_waiting_requests=args.max_waiting_requests,
                                                     policy=getattr(args, "data_parallel_policy", "cache_aware"),
                                                     **({} if hang is None else {"hang_timeout_s": hang}))
    if threads is not None and not args.engine_process:
        raise ValueError(f"--threads-per-replica = {threads} with --no-engine-process; it sets the engine "
                         "process's threads, expected --engine-process (the default) or no --threads-per-replica")
    return AsyncLLM.from_engine_args(engine_args, max_waiting_requests=args.max_waiting_requests,
                                     engine_process=args.engine_process, num_threads=threads)


def _show_stats_lines() -> None:
    """``serve`` writes the stats line (stats_log.py) to stderr, as vLLM's log does (no other
    handler is set up for it: a library must leave logging to its application)."""
    from qwen_ops.serving.openai.stats_log import logger as stats_logger

    if not stats_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("INFO %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        stats_logger.addHandler(handler)
        stats_logger.setLevel(logging.INFO)


def _lora_modules(args) -> list[LoRAModulePath]:
    """``serve``'s ``--lora-modules`` (vLLM's), checked: they need ``--enable-lora``, one path a name.
    The LoRA sizes (``--max-loras`` ...) are the engine's arguments, checked by ``EngineArgs.validate``."""
    modules = [LoRAModulePath(**m) for m in args.lora_modules or ()]
    if modules and not args.enable_lora:
        raise ValueError(f"--lora-modules {modules[0].name}={modules[0].path} needs --enable-lora")
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"--lora-modules names {m.name!r} twice; expected one path per name")
        seen.add(m.name)
    return modules


def startup_line(engine, names: Sequence[str], host: str, port: int) -> str:
    """One line saying what is served: model, dtype, context length, KV capacity, threads, address."""
    st = engine.stats()
    tokens = st["total_blocks"] * st["block_size"]
    return (f"qwen-ops serve: {engine.model_path} as {', '.join(names)} | {st['dtype']}, KV {st['kv_cache_dtype']} | "
            f"max_model_len {st['max_model_len']} | KV cache {st['total_blocks']} blocks = {tokens} tokens | "
            f"{st['num_threads']} thread{'s' if st['num_threads'] != 1 else ''}"
            + (f" in {len(st['replicas'])} data-parallel replicas" if "replicas" in st else "")
            + f" | http://{host}:{port}"
            + (f" | {engine.weights}" if getattr(engine, "weights", None) else ""))


def _api_key(flag: Optional[str]) -> Optional[str]:
    """The key from --api-key, else QWEN_OPS_API_KEY, else VLLM_API_KEY (vLLM's name, so a vLLM
    deployment's environment works unchanged); None when none is given. A given but empty or blank
    key (``--api-key "$KEY"`` with KEY unset) is an error, never "no authentication"."""
    if flag is not None:
        if not flag.strip():
            raise ValueError(f"--api-key = {flag!r} is empty or blank; give a key, or leave out --api-key "
                             f"(and {' and '.join(API_KEY_ENVS)}) to serve without authentication")
        return flag
    for name in API_KEY_ENVS:
        env = os.environ.get(name)
        if env is not None:
            if not env.strip():
                raise ValueError(f"{name} = {env!r} is empty or blank; give a key, or unset it "
                                 "to serve without authentication")
            return env
    return None
