"""OpenAI's Responses API, ``POST /v1/responses``, as vLLM serves it for a (non-harmony) chat model.

A request is turned into a chat request and runs the chat completions path (``_Serving.
prepare_chat``: the chat template, the sampling fields, the tool-choice rules and the forced-call
grammar; then the same engine streams): ``instructions`` become a system turn, ``input`` (a string,
or items: messages with ``input_text`` / ``output_text`` parts, ``function_call`` and
``function_call_output``) the turns after it, flat function ``tools`` the chat's function tools,
``max_output_tokens`` the chat's ``max_completion_tokens``, ``text.format`` its ``response_format``.
Errors name the Responses field (``input``, ``max_output_tokens``, ``tools[1].type``).

The reply becomes ``output`` items: a ``message`` with one ``output_text`` part, and a
``function_call`` item per tool call parsed from it (hermes, tools.py; forced calls with
``tool_choice`` "required" or a named function always parse; "auto" is parsed when the server runs
with ``--enable-auto-tool-choice``, else the text is left as it is, as vLLM does). ``stream``
sends vLLM's SSE events (``event: <type>`` and ``data``, each with its ``sequence_number``):
response.created, response.in_progress, then per item output_item.added, content_part.added,
output_text.delta ..., output_text.done, content_part.done, output_item.done (a call:
output_item.added, function_call_arguments.delta, .done, output_item.done), then
response.completed with the whole response. Status "incomplete" (reason max_output_tokens)
when the reply was cut by the token limit.

Store (vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE``; off by default, as vLLM's): the latest
``MAX_STORED_RESPONSES`` responses with their conversations are kept, for ``previous_response_id``
(the earlier turns, less their instructions, then its output) and ``GET /v1/responses/{id}``.
Off, a ``previous_response_id`` is a 404, as vLLM's.
"""

from __future__ import annotations

import collections
import json
import os
import time
import uuid
from typing import Any, Optional

from pydantic import ValidationError

from qwen_ops.serving.openai import protocol as P
from qwen_ops.serving.openai import tools as T

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
# Stored responses are kept in memory, the oldest forgotten first (vLLM keeps every one).
MAX_STORED_RESPONSES = 1024
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Request fields whose chat names the chat path's errors use, and their Responses names.
_RENAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
            ("messages", "input"))


def responses_store_enabled() -> bool:
    return os.environ.get(STORE_ENV, "0").strip().lower() in ("1", "true", "yes")


class ResponsesRequest(P._Strict):
    model: Optional[str] = None
    input: Any = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    tools: Optional[list] = None
    tool_choice: Any = "auto"
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict] = None
    user: Optional[str] = None
    background: Optional[bool] = False
    # vLLM's extras, passed to the chat request as they are.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Any = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    chat_template_kwargs: Optional[dict] = None


# ----------------------------------------------------------------------------- request -> chat request
def _text_parts(content: Any, where: str) -> Any:
    """A message's content (a string, or text parts) in the chat's shape."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad_request(f"{where}.content = {P._show(content)}, expected a string or an array of input_text "
                            "parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise P.bad_request(f"{where}.content[{j}] = {P._show(part)}, expected {{\"type\": \"input_text\", "
                                "\"text\": \"...\"} (only text parts are supported)", f"{where}.content[{j}]")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def input_messages(value: Any) -> list[dict]:
    """``input`` as chat messages (module docstring); a 400 naming the item at fault."""
    if isinstance(value, str):
        return [{"role": "user", "content": P.check_text(value, "input")}]
    if not isinstance(value, list) or not value:
        raise P.bad_request(f"input = {P._show(value)}, expected a string or a non-empty array of input items "
                            "(messages, function_call, function_call_output)", "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.bad_request(f"{where} = {P._show(item)}, expected an input item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if item.get("role") not in MESSAGE_ROLES:
                raise P.bad_request(f"{where}.role = {P._show(item.get('role'))}, expected one of "
                                    f"{', '.join(MESSAGE_ROLES)}", f"{where}.role")
            messages.append({"role": item["role"], "content": _text_parts(item.get("content"), where)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise P.bad_request(f"{where}.{key} = {P._show(item.get(key))}, expected a string",
                                        f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":     # one assistant turn: its text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(output, str) or not isinstance(call_id, str):
                bad = "output" if not isinstance(output, str) else "call_id"
                raise P.bad_request(f"{where}.{bad} = {P._show(item.get(bad))}, expected a string", f"{where}.{bad}")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue                   # an earlier turn's reasoning: the chat templates drop it too
        else:
            raise P.bad_request(f"{where}.type = {P._show(kind)}, expected 'message', 'function_call' or "
                                "'function_call_output'", f"{where}.type")
    return messages


def chat_tools(tools: Any) -> Optional[list[dict]]:
    """Flat Responses function tools (``{"type": "function", "name", "parameters"}``) as chat tools."""
    if tools is None or tools == []:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise P.bad_request(f"tools[{i}].type = {P._show(kind)}, expected 'function' (the only tool type "
                                "this server runs)", f"tools[{i}].type")
        fn = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise P.bad_request(f"tools[{i}].name = {P._show(fn.get('name'))}, expected a function name",
                                f"tools[{i}].name")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any, has_tools: bool) -> Any:
    """Responses' ``tool_choice`` in the chat's shape (a named function nests its name)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if not has_tools and choice in ("auto", "none"):
        return None
    return choice


def response_format(text: Optional[dict]) -> Optional[dict]:
    """``text.format`` as the chat's ``response_format``."""
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise P.bad_request(f"text.format = {P._show(fmt)}, expected an object with a type", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema", {})}}
    return {"type": fmt.get("type")}


def _renamed(e: P.APIError) -> P.APIError:
    """An error of the chat path, its chat field names replaced by the Responses ones."""
    message, param = e.message, e.param
    for chat, ours in _RENAMES:
        message = message.replace(chat, ours)
        if param is not None and param.startswith(chat):
            param = ours
    return P.APIError(e.status, message, param, e.headers, e.err_type)


# ----------------------------------------------------------------------------- output items
def _split(text: str, mode: str, named: Optional[dict], parse_auto: bool, parallel: Optional[bool],
           final: bool, stream: bool) -> tuple[Optional[str], list[tuple[str, str]]]:
    """``(message text, calls)`` of the reply so far (``stream``: held back where a call may start)."""
    if mode == "auto" and parse_auto:
        content, calls = T.stream_split(text, final) if stream else T.parse_hermes(text)
        return content, T.first_call_only(calls, parallel)
    if mode in ("required", "named"):
        return ("" if stream else None), (T.forced_calls(mode, text, named) if final else [])
    return text, []


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)] if text else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class _Events:
    """The SSE events of one streamed response: ``event: <type>``, then its JSON with the next
    ``sequence_number``; the output items as they open and close."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []          # closed output items, in order
        self.message: Optional[dict] = None  # the open message item, while it takes deltas

    def event(self, kind: str, **fields) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def error(self, body: dict) -> str:
        err = body.get("error", {})
        return self.event("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))

    def open_message(self) -> list[str]:
        if self.message is not None:
            return []
        self.message = {"id": _new_id("msg"), "text": ""}
        index = len(self.items)
        return [self.event("response.output_item.added", output_index=index,
                           item=message_item(self.message["id"], "", "in_progress")),
                self.event("response.content_part.added", output_index=index, item_id=self.message["id"],
                           content_index=0, part=_text_part(""))]

    def text(self, delta: str) -> list[str]:
        events = self.open_message()
        self.message["text"] += delta
        events.append(self.event("response.output_text.delta", output_index=len(self.items),
                                 item_id=self.message["id"], content_index=0, delta=delta, logprobs=[]))
        return events

    def close_message(self) -> list[str]:
        if self.message is None:
            return []
        m, self.message = self.message, None
        index, item = len(self.items), message_item(m["id"], m["text"])
        self.items.append(item)
        return [self.event("response.output_text.done", output_index=index, item_id=m["id"], content_index=0,
                           text=m["text"], logprobs=[]),
                self.event("response.content_part.done", output_index=index, item_id=m["id"], content_index=0,
                           part=_text_part(m["text"])),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, name: str, arguments: str) -> list[str]:
        events = self.close_message()
        index, item_id, call_id = len(self.items), _new_id("fc"), _new_id("call")
        item = call_item(item_id, call_id, name, arguments)
        self.items.append(item)
        return events + [
            self.event("response.output_item.added", output_index=index,
                       item=call_item(item_id, call_id, name, "", "in_progress")),
            self.event("response.function_call_arguments.delta", output_index=index, item_id=item_id,
                       delta=arguments),
            self.event("response.function_call_arguments.done", output_index=index, item_id=item_id,
                       name=name, arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item)]


# ----------------------------------------------------------------------------- the route
class ResponsesRoutes:
    """``/v1/responses`` over ``serving`` (the server's ``_Serving``), with its store."""

    def __init__(self, serving, *, store: bool = False):
        self.s = serving
        self.store_enabled = store
        # response id -> (its conversation: the chat messages it ran, then its reply's; the response)
        self._store: collections.OrderedDict[str, tuple[list[dict], dict]] = collections.OrderedDict()

    def retrieve(self, response_id: str) -> dict:
        if response_id not in self._store:
            raise self._not_found(response_id)
        return self._store[response_id][1]

    @staticmethod
    def _not_found(response_id: str) -> P.APIError:
        return P.APIError(404, f"Response with id '{response_id}' not found.", "response_id")

    def _conversation(self, req: ResponsesRequest) -> list[dict]:
        messages = []
        if req.instructions is not None:
            messages.append({"role": "system", "content": P.check_text(req.instructions, "instructions")})
        if req.previous_response_id is not None:
            if req.previous_response_id not in self._store:
                raise self._not_found(req.previous_response_id)
            earlier, _ = self._store[req.previous_response_id]
            # Instructions do not carry over to the next response (OpenAI's rule, and vLLM's).
            messages += [m for m in earlier if m["role"] != "system"]
        return messages + input_messages(req.input)

    def _prepare(self, body: bytes):
        req = P.parse_request(ResponsesRequest, body)
        if req.background:
            raise P.bad_request("background = true is not supported by this server; expected false or no "
                                "background", "background")
        P.check_positive("max_output_tokens", req.max_output_tokens)
        messages = self._conversation(req)
        tools = chat_tools(req.tools)
        chat = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "tools": tools,
                "tool_choice": chat_tool_choice(req.tool_choice, tools is not None),
                "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text),
                "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed, "stop": req.stop,
                "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
                "chat_template_kwargs": req.chat_template_kwargs}
        try:
            chat_req = P.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
            prep = self.s.prepare_chat(chat_req, auto_tools_need_flag=False)
        except ValidationError as e:
            raise _renamed(P.validation_error(e.errors())) from None
        except P.APIError as e:
            raise _renamed(e) from None
        return req, messages, prep

    async def create(self, request, body: bytes):
        s = self.s
        deadline = s.deadline()
        s.check_engine()
        req, messages, prep = await s.prepare(self._prepare, body)
        mode, named = prep.tools
        parse_auto = s.auto_tool_choice
        (ids,), params = prep.prompts, prep.params
        rid = _new_id("resp")
        created = int(time.time())
        try:
            gen = await s.launch(prep, rid, "input", deadline)
        except P.APIError as e:
            raise _renamed(e) from None

        def response(output: list, status: str, generated: Optional[int]) -> dict:
            return {"id": rid, "object": "response", "created_at": created, "model": s.model_of(prep),
                    "status": status, "output": output, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "usage": None if generated is None else usage(len(ids), generated),
                    "instructions": req.instructions, "max_output_tokens": params.max_tokens,
                    "temperature": params.temperature, "top_p": params.top_p, "tool_choice": req.tool_choice,
                    "tools": req.tools or [], "parallel_tool_calls": req.parallel_tool_calls is not False,
                    "previous_response_id": req.previous_response_id, "metadata": req.metadata, "user": req.user,
                    "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
                    "background": False, "service_tier": "auto", "store": bool(req.store and self.store_enabled),
                    "reasoning": None}

        def finished(output: list, finish_reason: Optional[str], generated: int) -> dict:
            resp = response(output, "incomplete" if finish_reason == "length" else "completed", generated)
            if req.store and self.store_enabled:
                self._remember(resp, messages, output)
            return resp

        def full(outputs):
            (out,) = outputs
            c = out.outputs[0]
            content, calls = _split(c.text, mode, named, parse_auto, req.parallel_tool_calls, True, False)
            items = [message_item(_new_id("msg"), content or "")] if content or not calls else []
            items += [call_item(_new_id("fc"), _new_id("call"), name, args) for name, args in calls]
            return finished(items, c.finish_reason, len(c.token_ids))

        events = _Events()

        async def chunks(g):
            start = response([], "in_progress", None)
            yield events.event("response.created", response=start) + events.event("response.in_progress",
                                                                                  response=start)
            text, sent, calls_sent, finish = "", 0, 0, None
            async for batch in g.updates():
                out = []
                for c in batch[0].outputs:
                    text += c.text
                    final = c.finish_reason is not None
                    content, calls = _split(text, mode, named, parse_auto, req.parallel_tool_calls, final, True)
                    if len(content) > sent:
                        out += events.text(content[sent:])
                        sent = len(content)
                    for name, args in calls[calls_sent:]:
                        out += events.call(name, args)
                    calls_sent = max(calls_sent, len(calls))
                    finish = c.finish_reason or finish
                if out:
                    yield "".join(out)
            # An empty reply closes as an empty message, as the whole response gives it.
            closing = (events.open_message() if not events.items else []) + events.close_message()
            yield "".join(closing) + events.event("response.completed",
                                                  response=finished(events.items, finish, g.generated[0]))

        return await s.respond(request, gen, req.stream, full, chunks, deadline, error_event=events.error, done=None)

    def _remember(self, resp: dict, messages: list[dict], output: list[dict]) -> None:
        reply: dict = {"role": "assistant", "content": None}
        for item in output:
            if item["type"] == "message":
                reply["content"] = "".join(part["text"] for part in item["content"])
            else:
                reply.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        self._store[resp["id"]] = (messages + [reply], resp)
        while len(self._store) > MAX_STORED_RESPONSES:
            self._store.popitem(last=False)

