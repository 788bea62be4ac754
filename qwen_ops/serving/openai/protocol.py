"""The OpenAI wire format: request models and their validation, errors, and response pieces.

Requests are pydantic models in strict mode, so a wrong JSON type (``"max_tokens": "5"``,
``"stream": 1``) is a 400 naming the field rather than a silent conversion. Fields whose shape
is a union (``prompt``, ``stop``, ``messages``) are checked by hand, so their errors say what
was expected in one sentence. Every error leaves as OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with ``param`` naming the request field.

Unknown fields are ignored (as vLLM does); known OpenAI fields this server cannot honour
(``suffix``) are a 400 unless they hold their no-op value. Penalties, ``logit_bias``, and vLLM's
``min_p``, ``allowed_token_ids`` and ``bad_words`` go to ``SamplingParams``, which names a bad
value's field; ``response_format`` / ``structured_outputs`` / ``guided_*`` become its
``structured_outputs``; ``tools`` / ``tool_choice`` are ``chat_tools`` and ``tools.py``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from qwen_ops.engine.sampling import MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

MAX_TOP_LOGPROBS = MAX_LOGPROBS   # vLLM's default max_logprobs: the engine's own bound
# Bounds on what one request may ask for. Each completion is a scheduler request, and the server
# and engine do work per completion, so one request must not be able to ask for an unbounded
# number of them (an n = 10**6 request stalled every other client for minutes).
MAX_N = 128                    # OpenAI's own cap on n (and best_of)
MAX_PROMPTS = 128              # prompts in one /v1/completions request
MAX_CHOICES = 1024             # completions in one request: prompts x n
COMPLETIONS_DEFAULT_MAX_TOKENS = 16    # vLLM's and OpenAI's, for an absent max_tokens
# Stop strings (searched for in every completion's new text at every token) are bounded by the
# engine's MAX_STOP_STRINGS and MAX_STOP_STRING_CHARS (64 and 1024; OpenAI allows 4, vLLM any),
# checked here first so the 400 names the request field.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")   # developer: OpenAI's newer name of system

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
                500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


class APIError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None, err_type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.err_type = err_type or _ERROR_TYPES.get(status, "APIError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param)


# ----------------------------------------------------------------------------- request models
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras)."""
    model: Optional[str] = None
    prompt_logprobs: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Any = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    # vLLM extras.
    use_beam_search: bool = False          # n is the beam width; the n best sequences come back
    length_penalty: float = 1.0
    top_k: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    structured_outputs: Optional[dict] = None
    guided_json: Any = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(_SamplingFields):
    prompt: Any = None
    # absent: 16 (OpenAI's and vLLM's default); null: the room left in the context, as chat's None
    # (``_Serving.max_tokens_for``; issue 62 asks for it, as vLLM's chat and its completions before 0.10 do;
    # vLLM 0.32's completions read null as 16)
    max_tokens: Optional[int] = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (text), or chat ``messages`` rendered by the template."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Any = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class ChatCompletionRequest(_SamplingFields):
    messages: Any = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None      # OpenAI's default: true (False: at most one call)
    chat_template_kwargs: Optional[dict] = None
    response_format: Optional[dict] = None
    add_generation_prompt: bool = True


_TYPE_WORDS = {"int_type": "an integer", "int_parsing": "an integer", "float_type": "a number",
               "bool_type": "true or false", "string_type": "a string", "list_type": "an array",
               "dict_type": "an object", "model_type": "an object"}


def _param_of(loc: Sequence[Union[str, int]]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_request(model_cls: type[_Strict], body: bytes) -> Any:
    """The request ``body`` (JSON bytes) as ``model_cls``, or an ``APIError`` 400 naming the field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    except RecursionError:           # json's C parser refuses nesting past the interpreter's limit
        raise bad_request("the request body nests arrays or objects too deeply to parse; expected a flat "
                          "OpenAI request") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body is a JSON {type(data).__name__}, expected an object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: Sequence[dict]) -> APIError:
    """One 400 from pydantic/FastAPI validation ``errors`` (the first names the field)."""
    if not errors:
        return bad_request("the request is invalid")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    param = _param_of(loc) or None
    expected = _TYPE_WORDS.get(err.get("type", ""))
    if param and "input" in err and expected:
        message = f"{param} = {_show(err['input'])}, expected {expected}"
    else:
        message = f"{param}: {err.get('msg', 'invalid')}" if param else str(err.get("msg", "invalid request"))
    return bad_request(message, param)


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, bytearray)) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ----------------------------------------------------------------------------- field checks
PromptInput = Union[str, list[int]]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


def check_text(value: str, where: str, param: Optional[str] = None) -> str:
    """A 400 for text that is not Unicode (JSON lets a lone UTF-16 surrogate, ``"\\ud800"``, through;
    the tokenizer cannot encode it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{where} holds a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}); "
                          "expected valid Unicode text", param or where) from None
    return value


def completion_prompts(value: Any) -> list[PromptInput]:
    """``prompt`` as a list of prompts: a str, a list of str, token ids, or a list of token-id lists."""
    expected = "expected a string, an array of strings, an array of token ids or an array of token-id arrays"
    if isinstance(value, str):
        return [check_text(value, "prompt")]
    if value is None:
        raise bad_request(f"prompt is missing; {expected}", "prompt")
    if not isinstance(value, list) or not value:
        raise bad_request(f"prompt = {_show(value)}, {expected}", "prompt")
    if _is_token_ids(value):
        return [value]
    if len(value) > MAX_PROMPTS:
        raise bad_request(f"prompt has {len(value)} prompts, expected at most {MAX_PROMPTS} per request", "prompt")
    out: list[PromptInput] = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            out.append(check_text(p, f"prompt[{i}]", "prompt"))
        elif _is_token_ids(p):
            out.append(p)
        else:
            raise bad_request(f"prompt[{i}] = {_show(p)}, {expected}", "prompt")
    return out


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(f"{num_prompts} prompts x n = {n} is {num_prompts * n} completions, expected at most "
                          f"{MAX_CHOICES} per request", "n")


def stop_strings(value: Any) -> Optional[list[str]]:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request(f"stop = {_show(value)}, expected a non-empty string or an array of them", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(items)} strings, expected at most {MAX_STOP_STRINGS}", "stop")
    for i, s in enumerate(items):
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"stop[{i}] has {len(s)} characters, expected at most {MAX_STOP_STRING_CHARS}", "stop")
        check_text(s, f"stop[{i}]", "stop")
    return items or None


def chat_messages(value: Any) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with text content (parts joined by newlines)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"messages = {_show(value)}, expected a non-empty array of message objects", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} = {_show(m)}, expected an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role = {_show(role)}, expected one of {', '.join(CHAT_ROLES)}",
                              f"{where}.role")
        if role == "developer":
            role = "system"                  # the templates know system; OpenAI's o-series renamed it
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""                     # an assistant turn that only called tools
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad_request(f"{where}.content[{j}] = {_show(part)}, expected "
                                      '{"type": "text", "text": "..."} (only text parts are supported)',
                                      f"{where}.content[{j}]")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content = {_show(content)}, expected a string or an array of text parts",
                              f"{where}.content")
        check_text(content, f"{where}.content")
        msg = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = check_text(m[key], f"{where}.{key}")
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls = {_show(calls)}, expected an array", f"{where}.tool_calls")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                        not isinstance(fn.get("arguments", "{}"), (str, dict)):
                    raise bad_request(f"{where}.tool_calls[{j}] = {_show(call)}, expected {{\"type\": \"function\", "
                                      '"function": {"name": str, "arguments": str}}', f"{where}.tool_calls[{j}]")
                args = fn.get("arguments", "{}")
                msg["tool_calls"].append({"name": fn["name"],
                                          "arguments": args if isinstance(args, str) else json.dumps(args)})
        out.append(msg)
    return out


def chat_tools(tools: Any, tool_choice: Any) -> tuple[Optional[list], str, Optional[dict]]:
    """``(tools for the template, mode, forced function)``: mode is "none", "auto", "required" or
    "named" (the forced function's object then). OpenAI's defaults: "auto" with tools, else "none"."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request(f"tool_choice = {_show(tool_choice)} needs tools", "tool_choice")
        return None, "none", None
    if not isinstance(tools, list) or not tools:
        raise bad_request(f"tools = {_show(tools)}, expected a non-empty array of function tools", "tools")
    names = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] = {_show(t)}, expected {{\"type\": \"function\", \"function\": "
                              '{"name": str, "parameters": {...}}}', f"tools[{i}]")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters = {_show(params)}, expected a JSON schema object",
                              f"tools[{i}].function.parameters")
        names[fn["name"]] = fn
    if tool_choice is None or tool_choice == "auto":
        return tools, "auto", None
    if tool_choice == "none":
        return None, "none", None
    if tool_choice == "required":
        return tools, "required", None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(fn, dict) and fn.get("name") in names:
        return tools, "named", names[fn["name"]]
    raise bad_request(f"tool_choice = {_show(tool_choice)}, expected \"none\", \"auto\", \"required\" or "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": one of {sorted(names)}}}}}", "tool_choice")


def tool_call_schema(mode: str, tools: list, named: Optional[dict], parallel: bool = True) -> dict:
    """The JSON schema a forced tool choice constrains the output to (vLLM's approach): a named
    function's arguments, or for "required" an array of at least one ``{"name", "parameters"}``
    (exactly one without ``parallel``: the grammar then closes the array after it)."""
    if mode == "named":
        return named.get("parameters", {"type": "object"})
    items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                               "parameters": t["function"].get("parameters", {"type": "object"})},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_unsupported(req: _SamplingFields) -> None:
    """A 400 for fields this server cannot honour unless they hold their no-op value."""
    noop = {"suffix": (None, "")}
    for name, allowed in noop.items():
        if name in type(req).model_fields and getattr(req, name) not in allowed:
            raise bad_request(f"{name} = {_show(getattr(req, name))} is not supported by this server; "
                              f"leave it out (or {allowed[1]!r})", name)
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n = {req.n}, expected an integer in [1, {MAX_N}]", "n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and not 1 <= best_of <= MAX_N:
        raise bad_request(f"best_of = {best_of}, expected an integer in [1, {MAX_N}]", "best_of")
    if best_of is not None and best_of != req.n:
        raise bad_request(f"best_of = {best_of} is not supported; leave it out or set it equal to n = {req.n}",
                          "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream = true", "stream_options")


def check_positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise bad_request(f"{name} = {value}, expected an integer >= 1", name)


def check_logprobs(name: str, value: Optional[int]) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} = {value}, expected an integer in [0, {MAX_TOP_LOGPROBS}]", name)


def sampling_kwargs(req: _SamplingFields, *, max_tokens: int, logprobs: Optional[int],
                    defaults: Optional[dict] = None) -> dict[str, Any]:
    """The ``qwen_ops.SamplingParams`` keyword arguments of a request: its fields, else the model's
    ``generation_config`` ``defaults`` (temperature, top_p, top_k, min_p, repetition_penalty, as
    vLLM's server), else left out."""
    defaults = defaults or {}
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    kw["temperature"] = defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is None and name in defaults:
            kw[name] = defaults[name]
    for name in ("top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        kw["ignore_eos"] = True
    stops = stop_strings(req.stop)
    if stops:
        kw["stop"] = stops
    if req.n != 1:
        kw["n"] = req.n
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if req.prompt_logprobs is not None:
        kw["prompt_logprobs"] = req.prompt_logprobs
    if req.min_tokens:
        kw["min_tokens"] = req.min_tokens
    if req.include_stop_str_in_output:
        kw["include_stop_str_in_output"] = True
    if not req.skip_special_tokens:
        kw["skip_special_tokens"] = False
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                 "allowed_token_ids", "bad_words"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    return kw


def structured_outputs(req: _SamplingFields):
    """``(field, StructuredOutputsParams)`` of the request (or None), from OpenAI's ``response_format``
    (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` object, or its older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one of them.
    Errors are 400s naming the field."""
    from qwen_ops.engine.structured import StructuredOutputsParams

    found = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format.json_schema must be an object with a \"schema\" object",
                                  "response_format")
            found.append(("response_format", {"json": spec.get("schema", {})}))
        elif kind == "structural_tag":
            found.append(("response_format", {"structural_tag": structural_tag_format(fmt)}))
        elif kind != "text":
            raise bad_request(f"response_format.type = {_show(kind)}, expected \"text\", \"json_object\", "
                              "\"json_schema\" or \"structural_tag\"", "response_format")
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            if name == "guided_json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise bad_request(f"guided_json is not valid JSON: {e}", name) from None
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output; give one", found[1][0])
    field, spec = found[0]
    unknown = sorted(set(spec) - {"json", "json_object", "regex", "choice", "grammar", "structural_tag",
                                  "any_whitespace", "disable_any_whitespace"})
    if unknown:
        raise bad_request(f"{field}.{unknown[0]} is not a structured output this server supports; expected json, "
                          "json_object, regex, choice, grammar or structural_tag", field)
    if "disable_any_whitespace" in spec:
        spec["any_whitespace"] = not spec.pop("disable_any_whitespace")
    try:
        return field, StructuredOutputsParams(**spec)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e).replace("structured_outputs", field, 1), field) from None


def structural_tag_format(fmt: dict) -> str:
    """``response_format`` of type ``"structural_tag"`` as ``StructuredOutputsParams.structural_tag`` (the
    whole object as JSON, as vLLM passes it). Its two shapes, as vLLM's protocol takes them: xgrammar's
    ``{"type", "format": {...}}``, or the older ``{"type", "structures": [{"begin", "schema", "end"}],
    "triggers": [str]}``. Only the shape is checked here; the engine compiles it (a 400 if it cannot)."""
    if "format" in fmt:
        if not isinstance(fmt["format"], dict):
            raise bad_request(f"response_format.format = {_show(fmt['format'])}, expected an object (xgrammar's "
                              "structural tag format)", "response_format")
    else:
        structures, triggers = fmt.get("structures"), fmt.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise bad_request(f"response_format.structures = {_show(structures)}, expected a non-empty array of "
                              '{"begin": str, "schema": object, "end": str} (or a "format" object)', "response_format")
        for i, item in enumerate(structures):
            if not (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
                    and isinstance(item.get("schema"), dict)):
                raise bad_request(f"response_format.structures[{i}] = {_show(item)}, expected "
                                  '{"begin": str, "schema": object, "end": str}', "response_format")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise bad_request(f"response_format.triggers = {_show(triggers)}, expected a non-empty array of "
                              "non-empty strings", "response_format")
    return json.dumps(fmt)


def check_params(params, vocab_size: int, tokenizer):
    """A request's token ids against the vocabulary and its ``bad_words`` tokenized (as
    ``prepare_requests`` does offline); a ValueError becomes a 400 naming the field."""
    try:
        params.check_vocab(vocab_size)
        return params.with_bad_words_token_ids(tokenizer)
    except ValueError as e:
        message = str(e)
        field = next((f for f in ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words")
                      if message.startswith(f)), None)
        raise bad_request(message, field) from None


def sampling_params(kwargs: dict[str, Any], *, max_tokens_field: str, logprobs_field: str = "logprobs"):
    """``SamplingParams(**kwargs)``; its ValueError becomes a 400 naming the request field."""
    from qwen_ops.engine.sampling import SamplingParams

    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        name = message.split(" ", 1)[0].split("[", 1)[0]
        renames = {"max_new_tokens": max_tokens_field, "max_tokens": max_tokens_field, "logprobs": logprobs_field}
        param = renames.get(name, name if name in kwargs else None)
        if param and name in renames:
            message = param + message[len(name):]
        raise bad_request(message, param) from None


# ----------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top_entries(entry: dict, k: int) -> list:
    """The ``k`` most likely (token id, Logprob) of one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return ranked[:k]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict], k: int, offset: int,
                        decode) -> tuple[dict, int]:
    """OpenAI's legacy ``logprobs`` object for ``token_ids`` (one ``{id: Logprob}`` per token), text
    offsets counted from ``offset``. Returns it and the offset after the last token.

    ``top_logprobs[i]`` holds the ``k`` most likely tokens plus the sampled one (as vLLM)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = _token_text(tid, chosen, decode)
        tokens.append(text)
        token_lps.append(_finite(chosen.logprob) if chosen is not None else None)
        top = {_token_text(i, lp, decode): _finite(lp.logprob) for i, lp in _top_entries(entry, k)} if k > 0 else {}
        if chosen is not None:
            top.setdefault(text, _finite(chosen.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def echo_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[Optional[dict]], k: int,
                  decode) -> tuple[dict, int]:
    """The legacy ``logprobs`` object of an echoed prompt (``echo`` with ``logprobs``): the first
    token has no logprob (``None``, as OpenAI and vLLM), every later one its own and the top ``k``.
    Returns it and the text offset after the prompt, where the completion's tokens continue."""
    first = decode([prompt_token_ids[0]]) if prompt_token_ids else ""
    rest, offset = completion_logprobs(prompt_token_ids[1:], entries[1:], k, len(first), decode)
    head = [first] if prompt_token_ids else []
    return {"tokens": head + rest["tokens"], "token_logprobs": [None] * len(head) + rest["token_logprobs"],
            "top_logprobs": [None] * len(head) + rest["top_logprobs"],
            "text_offset": [0] * len(head) + rest["text_offset"]}, offset


def join_logprobs(a: dict, b: dict) -> dict:
    """Two legacy ``logprobs`` objects one after the other (the echoed prompt, then the completion)."""
    return {key: a[key] + b[key] for key in a}


def vllm_prompt_logprobs(entries: Optional[Sequence[Optional[dict]]]) -> Optional[list]:
    """vLLM's ``prompt_logprobs`` field: ``None`` for the first token, then per prompt token
    ``{token id: {"logprob", "rank", "decoded_token"}}`` (its own and the top ones)."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict], k: int, decode) -> list[dict]:
    """The chat ``logprobs.content`` list: per token its text, logprob, UTF-8 bytes and top ``k``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        text = _token_text(tid, chosen, decode)
        top = [{"token": (t := _token_text(i, lp, decode)), "logprob": _finite(lp.logprob), "bytes": list(t.encode())}
               for i, lp in _top_entries(entry, k)] if k > 0 else []
        content.append({"token": text, "logprob": _finite(chosen.logprob) if chosen is not None else None,
                        "bytes": list(text.encode()), "top_logprobs": top})
    return content


def _finite(logprob: float) -> float:
    # JSON has no -inf: a token the model gives no mass to gets vLLM's -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0


def _token_text(token_id: int, lp, decode) -> str:
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else decode([token_id])

