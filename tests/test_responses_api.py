"""OpenAI's Responses API on the server (qwen_ops/serving/openai/responses.py), live on 127.0.0.1,
through the official ``openai`` client. Oracles: offline ``LLM.chat`` (greedy) on the same
conversation, for the text, the token counts and the status; for tool calls, the JSON schema of
the forced function (jsonschema) and the call a stub engine wrote into the reply."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from qwen_ops import SamplingParams

from server_fixture import engine, offline  # noqa: F401  (fixtures)
from server_fixture import CLIENT_TIMEOUT_S, SERVED_NAME, RevealingEngine, running_server

MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_output_tokens": MAX_TOKENS}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
CALL_TEXT = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, enable_responses_store=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


def offline_reply(offline, messages, max_tokens=MAX_TOKENS):
    (out,) = offline.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return out


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event folded into one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_text_equals_offline_chat(client, offline):
    cases = [("def fibonacci(n):", None, [{"role": "user", "content": "def fibonacci(n):"}]),
             ([{"role": "user", "content": [{"type": "input_text", "text": "class Stack:"}]}], "Write Python.",
              [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "class Stack:"}]),
             ([{"type": "message", "role": "user", "content": "import os"}], None,
              [{"role": "user", "content": "import os"}])]
    for given, instructions, messages in cases:
        want = offline_reply(offline, messages)
        kw = {} if instructions is None else {"instructions": instructions}
        r = client.responses.create(model=SERVED_NAME, input=given, **kw, **GREEDY)
        assert r.object == "response" and r.id.startswith("resp_") and r.model == SERVED_NAME
        assert r.output_text == want.outputs[0].text
        (item,) = r.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        n_in, n_out = len(want.prompt_token_ids), len(want.outputs[0].token_ids)
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (n_in, n_out, n_in + n_out)
        cut = want.outputs[0].finish_reason == "length"
        assert r.status == ("incomplete" if cut else "completed")
        assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
        assert r.instructions == instructions and r.max_output_tokens == MAX_TOKENS


def test_stream_events_in_order_and_equal_the_whole_response(client):
    for given in ("def fibonacci(n):", "class Stack:"):
        whole = client.responses.create(model=SERVED_NAME, input=given, **GREEDY)
        events = list(client.responses.create(model=SERVED_NAME, input=given, stream=True, **GREEDY))
        types = [e.type for e in events]
        assert collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text
        (done,) = [e for e in events if e.type == "response.output_text.done"]
        (item_done,) = [e for e in events if e.type == "response.output_item.done"]
        assert done.text == deltas and item_done.item.content[0].text == deltas
        final = events[-1].response
        assert final.output_text == whole.output_text and final.status == whole.status
        assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id
        assert final.output[0].id == item_done.item.id


def test_forced_function_call_parses_and_streams(client):
    for seed in range(3):
        r = client.responses.create(model=SERVED_NAME, input="Weather in Paris?", tools=[WEATHER], temperature=1.0,
                                    extra_body={"seed": seed}, max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"})
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model=SERVED_NAME, input="Weather in Paris?", tools=[WEATHER],
                                          temperature=1.0, extra_body={"seed": 0}, max_output_tokens=120, stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"}))
    assert collapse([e.type for e in events])[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (args,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    assert events[-1].response.output[0].arguments == args
    # text.format (the chat's response_format): the message's text follows the schema.
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER["parameters"]}
    r = client.responses.create(model=SERVED_NAME, input="Weather in Paris?", text={"format": fmt}, temperature=1.0,
                                max_output_tokens=120)
    jsonschema.validate(json.loads(r.output_text), WEATHER["parameters"])


class _CallingEngine(RevealingEngine):
    """The real engine, its replies replaced by a hermes tool call revealed 6 characters per update."""

    def shown(self, n: int, finished: bool, text: str) -> str:
        return CALL_TEXT if finished else CALL_TEXT[:min(len(CALL_TEXT), 6 * n)]

    def finish_reason(self, c):
        return c.finish_reason and "stop"


def test_auto_tool_call_becomes_a_function_call_item(engine):
    fake = _CallingEngine(engine)
    with running_server(fake, enable_auto_tool_choice=True, tool_call_parser="hermes") as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
            ask = dict(model=SERVED_NAME, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                       max_output_tokens=40)
            r = c.responses.create(**ask)
            message, call = r.output
            assert message.type == "message" and message.content[0].text == "Let me check."
            assert call.type == "function_call" and call.name == "get_weather"
            assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
            events = list(c.responses.create(stream=True, **ask))
            types = collapse([e.type for e in events])
            assert types == ["response.created", "response.in_progress", *TEXT_EVENTS,
                             "response.output_item.added", "response.function_call_arguments.delta",
                             "response.function_call_arguments.done", "response.output_item.done",
                             "response.completed"]
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text.strip() == "Let me check." and "<tool" not in text
            (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris", "unit": "C"}
            assert [i.type for i in events[-1].response.output] == ["message", "function_call"]
    # Without --enable-auto-tool-choice (vLLM's Responses API): the tools are rendered, the reply left as text.
    with running_server(fake) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
            r = c.responses.create(model=SERVED_NAME, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=40)
            assert [i.type for i in r.output] == ["message"] and r.output_text == CALL_TEXT


def test_previous_response_id_continues_the_conversation(client, offline, server):
    first = client.responses.create(model=SERVED_NAME, input="def fibonacci(n):", instructions="Be brief.", **GREEDY)
    second = client.responses.create(model=SERVED_NAME, input="import os", previous_response_id=first.id, **GREEDY)
    # Instructions do not carry over; the earlier turn and its reply do.
    want = offline_reply(offline, [{"role": "user", "content": "def fibonacci(n):"},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "import os"}])
    assert second.output_text == want.outputs[0].text
    assert second.usage.input_tokens == len(want.prompt_token_ids)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    r = httpx.post(server.base_url + "/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_store_is_off_by_default_as_vllms(engine, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    with running_server(engine) as srv:
        first = httpx.post(srv.base_url + "/responses", json={"input": "x", **GREEDY}, timeout=CLIENT_TIMEOUT_S)
        assert first.status_code == 200 and first.json()["store"] is False
        r = httpx.post(srv.base_url + "/responses", json={"input": "y", "previous_response_id": first.json()["id"]},
                       timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 404 and "not found" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/responses", json=body, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and param.split("[")[0] in err["message"], err


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.type"):
        client.responses.create(model=SERVED_NAME, input="hi", tools=[{"type": "file_search", "vector_store_ids": []}])
