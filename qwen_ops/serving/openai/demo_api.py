"""vLLM's demo server, ``python -m vllm.entrypoints.api_server`` (here ``python -m
qwen_ops.entrypoints.api_server``): ``POST /generate`` and ``GET /health`` over an ``AsyncLLM``. As
vLLM says of its own, it is for demonstrations and simple benchmarks; ``qwen-ops serve`` is the
server to deploy.

``/generate`` takes ``{"prompt": str, "stream": bool, **sampling parameters}`` (``SamplingParams``'
names; ``use_beam_search`` with ``n`` beams, ``temperature``, ``max_tokens``, ``length_penalty``,
``ignore_eos`` runs beam search, as vLLM's older ``SamplingParams`` did) and answers ``{"text":
[prompt + completion, ...]}``, one per completion (beam: best first). Streamed, each update is that
object with the texts so far, each followed by a NUL byte (what vLLM's ``api_client.py`` splits on).
A bad field is a 400 ``{"error": {"message", "param", ...}}`` naming it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.engine_core import EngineDeadError
from qwen_ops.serving.openai import protocol as P

DEFAULT_PORT = 8000                     # vLLM's
STREAM_DELIMITER = "\0"
# The beam search fields /generate reads (vLLM's SamplingParams before 0.6 had them); anything else with
# use_beam_search is a 400, not silently dropped.
BEAM_FIELDS = {"n": 1, "temperature": 0.0, "max_tokens": 16, "length_penalty": 1.0, "ignore_eos": False,
               "include_stop_str_in_output": False, "early_stopping": False, "best_of": None}


def _param_of(message: str, given: Sequence[str]) -> Optional[str]:
    """The request field a SamplingParams error names (its first word, or the unexpected keyword)."""
    m = re.search(r"unexpected keyword argument '(\w+)'", message)
    head = m.group(1) if m else message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    head = "max_tokens" if head == "max_new_tokens" else head
    return head if head in given else None


def _request(data: Any) -> tuple[str, bool, bool, dict[str, Any]]:
    """``(prompt, stream, use_beam_search, the sampling fields)`` of a ``/generate`` body, or a 400
    naming the field."""
    if not isinstance(data, dict):
        raise P.bad_request(f"the request body is a JSON {type(data).__name__}, expected an object")
    fields = dict(data)
    prompt = fields.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise P.bad_request(f"prompt = {P._show(prompt)}, expected a non-empty string", "prompt")
    P.check_text(prompt, "prompt")
    flags = []
    for name in ("stream", "use_beam_search"):
        value = fields.pop(name, False)
        if not isinstance(value, bool):
            raise P.bad_request(f"{name} = {P._show(value)}, expected true or false", name)
        flags.append(value)
    return prompt, flags[0], flags[1], fields


class DemoServer:
    """The routes' logic over ``engine`` (an ``AsyncLLM``)."""

    def __init__(self, engine):
        self.engine = engine

    def sampling_params(self, fields: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**fields)
        except (TypeError, ValueError) as e:
            raise P.bad_request(str(e), _param_of(str(e), list(fields))) from None

    def beam_params(self, fields: dict[str, Any]):
        from qwen_ops.serving.beam_search import BeamSearchParams

        extra = sorted(set(fields) - set(BEAM_FIELDS))
        if extra:
            raise P.bad_request(f"{extra[0]} is not a parameter of beam search; expected only "
                                f"{', '.join(sorted(BEAM_FIELDS))} with use_beam_search", extra[0])
        got = {**BEAM_FIELDS, **fields}
        if got["early_stopping"] is not False:
            raise P.bad_request("early_stopping is not supported: a beam search here runs until max_tokens or "
                                "every beam ends; expected false", "early_stopping")
        if got["best_of"] not in (None, got["n"]):
            raise P.bad_request(f"best_of = {P._show(got['best_of'])}, expected it left out or equal to n "
                                f"(the beam width) = {got['n']}", "best_of")
        try:
            return BeamSearchParams(beam_width=got["n"], max_tokens=got["max_tokens"], ignore_eos=got["ignore_eos"],
                                    temperature=got["temperature"], length_penalty=got["length_penalty"],
                                    include_stop_str_in_output=got["include_stop_str_in_output"])
        except ValueError as e:
            field = {"beam_width": "n"}.get(str(e).split(" ", 1)[0], str(e).split(" ", 1)[0])
            raise P.bad_request(str(e).replace("beam_width", "n (the beam width)", 1),
                                field if field in got else None) from None

    async def beam_texts(self, prompt: str, params) -> list[str]:
        """The ``params.beam_width`` best continuations of ``prompt`` (best first), each after the prompt."""
        from qwen_ops.serving.beam_search import beam_search_async

        ids = self.engine.tokenizer.encode(prompt)
        if len(ids) + params.max_tokens > self.engine.max_model_len:
            raise P.bad_request(f"the prompt has {len(ids)} tokens and max_tokens = {params.max_tokens}; this model's "
                                f"maximum context length is {self.engine.max_model_len} tokens", "max_tokens")
        try:
            out = await beam_search_async(self.engine, ids, params, frozenset(self.engine.eos_token_ids),
                                          f"demo-{uuid.uuid4().hex}")
        except ValueError as e:
            raise P.bad_request(str(e), "prompt") from None
        return [prompt + s.text for s in out.sequences]

    async def generate(self, request: Request) -> Response:
        from qwen_ops.serving.openai.server import _ClientGone, _until_disconnect

        try:
            data = json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise P.bad_request(f"the request body is not valid JSON ({type(e).__name__})") from None
        prompt, stream, use_beam_search, fields = _request(data)
        try:
            if use_beam_search:
                params = self.beam_params(fields)
                # one update, streamed or not: a beam search knows its best sequences only at the end
                texts = await _until_disconnect(request, self.beam_texts(prompt, params))
                if stream:
                    return StreamingResponse(_encoded(_once(texts)), media_type="application/octet-stream")
                return JSONResponse({"text": texts})
            updates = self.engine.generate(prompt, self.sampling_params(fields),
                                           request_id=f"demo-{uuid.uuid4().hex}")
            try:
                first = await updates.__anext__()       # a bad prompt (too long, ...) is a 400 before any byte
            except ValueError as e:
                field = "prompt" if str(e).startswith("prompt") else _param_of(str(e), list(fields))
                raise P.bad_request(str(e), field) from None
            if stream:
                return StreamingResponse(_encoded(_texts(prompt, first, updates)),
                                         media_type="application/octet-stream")
            try:
                last = await _until_disconnect(request, _last(first, updates))
            finally:
                await updates.aclose()              # aborts the request if the client went away first
            return JSONResponse({"text": [prompt + c.text for c in last.outputs]})
        except _ClientGone:
            return Response(status_code=499)
        except EngineDeadError as e:
            raise P.APIError(503, f"the engine is not running ({e}); restart the server") from None


async def _last(first, updates):
    last = first
    async for out in updates:
        last = out
    return last


async def _once(texts: list[str]) -> AsyncIterator[list[str]]:
    yield texts


async def _texts(prompt: str, first, updates) -> AsyncIterator[list[str]]:
    """Each cumulative update of ``updates`` (``first`` already taken) as prompt + text per completion."""
    out = first
    try:
        while True:
            yield [prompt + c.text for c in out.outputs]
            try:
                out = await updates.__anext__()
            except StopAsyncIteration:
                return
    finally:
        await updates.aclose()              # a stream closed early (the client went away) aborts the request


async def _encoded(texts: AsyncIterator[list[str]]) -> AsyncIterator[bytes]:
    try:
        async for t in texts:
            yield (json.dumps({"text": t}) + STREAM_DELIMITER).encode("utf-8")
    except EngineDeadError as e:            # the stream has started: say so in-band
        yield (json.dumps(P.APIError(503, f"the engine stopped: {e}").body()) + STREAM_DELIMITER).encode("utf-8")


def build_demo_app(engine) -> FastAPI:
    """vLLM's demo app over ``engine`` (an ``AsyncLLM``): ``/generate`` and ``/health``."""
    demo = DemoServer(engine)
    app = FastAPI(title="qwen-ops demo API server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await demo.generate(request)

    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qwen_ops.entrypoints.api_server",
                                     description="vLLM's demo API server: POST /generate, GET /health")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0: a free one)")
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default: info)")
    return EngineArgs.add_cli_args(parser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Load the model, then serve until interrupted; 2 (with one line on stderr) for a bad argument."""
    args = build_parser().parse_args(argv)
    try:
        return _serve(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    from qwen_ops.serving.async_llm import AsyncLLM
    from qwen_ops.serving.openai.server import _server_class, bind_socket, uvicorn_config

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port = {args.port}, expected 0..65535")
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.validate()
    sock = bind_socket(args.host, args.port)        # before the model load: a port in use fails at once
    try:
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            config = uvicorn_config(build_demo_app(engine), args.host, sock.getsockname()[1],
                                    log_level=args.log_level)
            _server_class()(config).run(sockets=[sock])
        finally:
            engine.shutdown()
    finally:
        sock.close()
    return 0
