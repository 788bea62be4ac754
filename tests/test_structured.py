"""Structured outputs (issue 30) on xgrammar: offline through ``SamplingParams(structured_outputs=...)``
and served through ``response_format`` / vLLM's fields, with the official ``openai`` client.

The oracle is a library's validator (``jsonschema``), never hand-written checks; outputs are drawn
at temperature 1.0 with different seeds, so the grammar, not the model's habits, makes them valid.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen_ops import LLM, SamplingParams
from qwen_ops.engine.structured import StructuredOutputsParams

from server_fixture import RevealingEngine, make_engine, running_server

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")
jsonschema = pytest.importorskip("jsonschema", reason="the schema validator is the oracle")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                      "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16)


def test_json_schema_outputs_always_validate(llm):
    """24 seeded requests at temperature 1.0: every output is JSON that validates, with nested
    objects, enums, arrays, bounds and required fields; the schema compiles once."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_outputs={"json": SCHEMA})
              for s in range(24)]
    outs = llm.generate(["A person as JSON: "] * 24, params)
    seen = set()
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMA)
        seen.add(c.text)
    assert len(seen) > 12                                   # sampled, not one fixed string
    assert llm.core.grammar_backend().compiles == 1


def test_regex_choice_grammar_and_json_object(llm):
    sp = lambda **so: SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=so)  # noqa: E731
    date = llm.generate("Date: ", sp(regex=r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d"))[0].outputs[0].text
    assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d", date), date
    pick = [llm.generate("Pick: ", SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                                                  structured_outputs={"choice": ["yes", "no", "maybe"]}))[0]
            .outputs[0].text for s in range(6)]
    assert set(pick) <= {"yes", "no", "maybe"} and len(set(pick)) > 1
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    expr = llm.generate("Sum: ", sp(grammar=ebnf))[0].outputs[0].text
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", expr), expr
    obj = llm.generate("JSON: ", SamplingParams(temperature=1.0, seed=5, max_tokens=200,
                                                structured_outputs={"json_object": True}))[0].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:                                                   # cut by max_tokens: still a JSON prefix
        assert obj.text.startswith("{")


def test_with_preemption_prefix_caching_and_speculation():
    """A cache too small for all requests (preemption by recompute and swap), prefix caching on,
    and n-gram speculation configured (constrained requests do not draft): outputs still validate."""
    for mode in ("recompute", "swap"):
        llm = LLM(max_num_seqs=8, max_model_len=256, num_kv_blocks=20, block_size=16, preemption_mode=mode,
                  check_invariants=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        prompt = "A person as JSON, for the records of the city office: "
        outs = llm.generate([prompt] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=160,
                                                          structured_outputs={"json": SCHEMA}) for s in range(8)])
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["spec_num_drafts"] == 0, s


@pytest.mark.parametrize("spec,match", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, r"structured_outputs.json cannot be compiled"),
    ({"regex": "(unclosed"}, r"structured_outputs.regex cannot be compiled"),
    ({"grammar": "root ::= undefined_rule"}, r"structured_outputs.grammar cannot be compiled"),
])
def test_bad_specs_name_the_field(llm, spec, match):
    """A bad spec in a batch fails the whole call before anything is queued; the engine then
    serves the same good request as before, valid."""
    good = SamplingParams(temperature=1.0, seed=4, max_tokens=160, structured_outputs={"json": SCHEMA})
    with pytest.raises(ValueError, match=match):
        llm.generate(["ok", "x"], [good, SamplingParams(structured_outputs=spec)])
    assert llm.stats()["num_running"] == 0 and llm.stats()["num_waiting"] == 0
    out = llm.generate("A person as JSON: ", good)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("kwargs,match", [
    (dict(), r"structured_outputs sets nothing; expected exactly one of"),
    (dict(json={}, regex="a"), r"structured_outputs sets \['json', 'regex'\]"),
    (dict(choice=[]), r"structured_outputs.choice = \[\], expected a non-empty list"),
    (dict(json=5), r"structured_outputs.json = 5, expected a JSON schema"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=r"structured_outputs = 3, expected a StructuredOutputsParams"):
        SamplingParams(structured_outputs=3)


# ----------------------------------------------------------------- served, with the openai client
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client():
    engine = make_engine()
    try:
        with running_server(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as srv:
            with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
                yield c
    finally:
        engine.shutdown()


def chat(client, **kw):
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model="qwen-ops-default", messages=[{"role": "user", "content": "A person."}],
                                          **kw)


def test_served_json_schema_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(8):
        text = chat(client, temperature=1.0, seed=seed, response_format=fmt).choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = chat(client, temperature=0, response_format={"type": "json_object"}, max_tokens=400)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       chat(client, temperature=1.0, seed=1, response_format=fmt, stream=True) if ch.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    pick = client.completions.create(model="qwen-ops-default", prompt="Answer: ", max_tokens=8, temperature=1.0,
                                     extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert pick.choices[0].text in ("alpha", "beta")
    legacy = client.completions.create(model="qwen-ops-default", prompt="Answer: ", max_tokens=8, temperature=1.0,
                                       extra_body={"guided_choice": ["gamma", "delta"]})
    assert legacy.choices[0].text in ("gamma", "delta")


def test_parse_with_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int
        kind: Literal["town", "city"]

    done = client.chat.completions.parse(model="qwen-ops-default", messages=[{"role": "user", "content": "A city."}],
                                         response_format=City, temperature=1.0, seed=2, max_tokens=120)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.kind in ("town", "city")


@pytest.mark.parametrize("kw,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "(oops"}}), "structured_outputs"),
    (dict(extra_body={"guided_json": "{not json"}), "guided_json"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex"),
])
def test_served_errors_name_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kw)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


# ----------------------------------------------------------------- tool calls (hermes), served
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def ask(client, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model="qwen-ops-default",
                                          messages=[{"role": "user", "content": "Weather in Paris?"}], **kw)


def test_forced_tool_calls_always_parse(client):
    """tool_choice naming a function, and "required": the reply is forced to the call's JSON, so
    at temperature 1.0 every call parses and its arguments validate; streamed calls equal them."""
    for seed in range(4):
        r = ask(client, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert r.choices[0].finish_reason == "tool_calls"
        req = ask(client, tools=[WEATHER, TIME], temperature=1.0, seed=seed, tool_choice="required", max_tokens=200)
        calls = req.choices[0].message.tool_calls or []
        # A cut array still returns the calls it completed; a closed one has at least one.
        assert calls or req.choices[0].finish_reason == "length", req
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        # parallel_tool_calls = false: the grammar closes the array after one call, so it always ends.
        one = ask(client, tools=[WEATHER, TIME], temperature=1.0, seed=seed, tool_choice="required",
                  max_tokens=120, parallel_tool_calls=False).choices[0]
        (call,) = one.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert one.finish_reason == "tool_calls", one
    named = {"type": "function", "function": {"name": "get_time"}}
    full = ask(client, tools=[WEATHER, TIME], temperature=1.0, seed=9, tool_choice=named).choices[0].message.tool_calls
    got = {}
    for chunk in ask(client, tools=[WEATHER, TIME], temperature=1.0, seed=9, tool_choice=named, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = got.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(got.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full]


CALL_TEXT = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


class _CallingEngine(RevealingEngine):
    """The real engine, its chat replies replaced by a hermes tool call revealed 6 characters per
    update (so the tags arrive split across stream chunks), as a tool-using Qwen writes them."""

    def shown(self, n: int, finished: bool, text: str) -> str:
        return CALL_TEXT if finished else CALL_TEXT[:min(len(CALL_TEXT), 6 * n)]

    def finish_reason(self, c):
        return c.finish_reason and "stop"


def test_auto_tool_calls_parse_and_stream():
    engine = make_engine()
    try:
        with running_server(_CallingEngine(engine), enable_auto_tool_choice=True, tool_call_parser="hermes") as srv:
            with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
                r = ask(c, tools=[WEATHER], temperature=0, max_tokens=40).choices[0]
                assert r.finish_reason == "tool_calls" and r.message.content == "Let me check."
                (call,) = r.message.tool_calls
                assert call.function.name == "get_weather"
                assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
                content, calls, finish = "", {}, None
                for chunk in ask(c, tools=[WEATHER], temperature=0, max_tokens=40, stream=True):
                    if not chunk.choices:
                        continue
                    ch = chunk.choices[0]
                    content += ch.delta.content or ""
                    for d in ch.delta.tool_calls or []:
                        calls[d.index] = (d.function.name, json.loads(d.function.arguments))
                    finish = ch.finish_reason or finish
                assert content.strip() == "Let me check." and "<tool" not in content
                assert calls == {0: ("get_weather", {"city": "Paris", "unit": "C"})} and finish == "tool_calls"
                plain = ask(c, temperature=0, max_tokens=40).choices[0].message       # no tools: text as is
                assert plain.content == CALL_TEXT and not plain.tool_calls
    finally:
        engine.shutdown()


def test_tool_turns_render_and_errors_name_the_field(client):
    from qwen_ops.serving.openai.chat import ChatTemplate

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    r = client.chat.completions.create(model="qwen-ops-default", messages=history, tools=[WEATHER], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    from qwen_ops.serving.openai import protocol as P

    text = ChatTemplate().render(P.chat_messages(history), tools=[WEATHER])
    assert ChatTemplate().render(history, tools=[WEATHER]) == text      # LLM.chat passes OpenAI's shape as is
    assert '"name": "get_weather"' in text and "<tools>" in text and "<tool_response>\n21 C and sunny" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    for kw, param in ((dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                       "tool_choice")):
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, **kw)
        assert info.value.body["param"] == param, info.value.body


def _random_mask(rows: int, vocab: int, density: float, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(rows, vocab, generator=g) < density
    words = (bits.view(rows, -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@pytest.mark.parametrize("density", [0.0, 0.002, 0.3, 1.0])
def test_cpu_bitmask_kernel_matches_xgrammar(density):
    """The C masking kernel against xgrammar's own apply_token_bitmask_inplace (the reference), on
    fresh random logits and masks, all rows and a subset of rows; tokens past the mask are -inf."""
    import torch
    import xgrammar as xgr

    from qwen_ops.ops.kernels import cpu as cpu_kernels

    if cpu_kernels.why_unavailable() is not None:
        pytest.skip(cpu_kernels.why_unavailable())
    n, vocab = 7, 8192 + 96
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=g) * 4
    mask = _random_mask(n, vocab, density, 5)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask)
    got = logits.clone()
    cpu_kernels.apply_token_bitmask(got, mask, range(n))
    assert torch.equal(got, want)
    rows = [5, 1, 3]
    want = logits.clone()
    full = xgr.allocate_token_bitmask(n, vocab)
    full[rows] = mask[:3]
    xgr.apply_token_bitmask_inplace(want, full, indices=rows)
    got = logits.clone()
    cpu_kernels.apply_token_bitmask(got, mask[:3], rows)
    assert torch.equal(got, want)
    narrow = logits.clone()
    cpu_kernels.apply_token_bitmask(narrow, torch.full((1, 8192 // 32), -1, dtype=torch.int32), [0])
    assert torch.equal(narrow[0, :8192], logits[0, :8192]) and bool((narrow[0, 8192:] == float("-inf")).all())
    with pytest.raises(ValueError, match=r"rows = \[9\], expected row indices in \[0, 7\)"):
        cpu_kernels.apply_token_bitmask(logits.clone(), mask[:1], [9])
    with pytest.raises(ValueError, match=r"mask has dtype torch.int64"):
        cpu_kernels.apply_token_bitmask(logits.clone(), mask[:1].long(), [0])


def test_bitmask_filled_beside_the_forward_pass_gives_the_same_tokens(llm):
    """The worker-thread fill (used for fills slower than GRAMMAR_OVERLAP_MIN_S) and the inline
    one produce the same seeded tokens."""
    sampler = llm.engine.runner.sampler
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs={"json": SCHEMA})
              for s in range(6)]
    inline = [o.outputs[0].text for o in llm.generate(["A person as JSON: "] * 6, params)]
    sampler.grammar_overlap_min_s = -1.0
    try:
        beside = [o.outputs[0].text for o in llm.generate(["A person as JSON: "] * 6, params)]
    finally:
        from qwen_ops.engine.sampler import GRAMMAR_OVERLAP_MIN_S

        sampler.grammar_overlap_min_s = GRAMMAR_OVERLAP_MIN_S
    assert beside == inline and sampler._grammar_pool is not None


def test_auto_tool_choice_needs_the_servers_flags():
    """vLLM's rule: tool_choice "auto" (also implied by tools alone) needs --enable-auto-tool-choice
    and --tool-call-parser; forced calls do not. The flags without a parser are refused at start."""
    engine = make_engine()
    try:
        with running_server(engine) as srv:
            with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
                for kw in (dict(tools=[WEATHER]), dict(tools=[WEATHER], tool_choice="auto")):
                    with pytest.raises(openai.BadRequestError) as e:
                        ask(c, max_tokens=4, **kw)
                    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in str(e.value)
                named = {"type": "function", "function": {"name": "get_weather"}}
                call = ask(c, tools=[WEATHER], tool_choice=named, max_tokens=60, temperature=0).choices[0]
                assert call.message.tool_calls[0].function.name == "get_weather"
        from qwen_ops.serving.openai import build_app

        with pytest.raises(ValueError, match="needs tool_call_parser"):
            build_app(engine, served_model_name="x", enable_auto_tool_choice=True)
        with pytest.raises(ValueError, match="tool_call_parser = 'mistral'"):
            build_app(engine, served_model_name="x", tool_call_parser="mistral")
    finally:
        engine.shutdown()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["name", "parameters", "x"]),
                                st.one_of(st.text(max_size=5), st.integers(), st.lists(st.integers(), max_size=3)),
                                max_size=3), max_size=4), st.data())
def test_a_cut_array_gives_its_complete_items(items, data):
    """Oracle: ``json`` itself on each item; the cut keeps exactly the items that end before it."""
    from qwen_ops.serving.openai.tools import _complete_items

    text = json.dumps(items)
    cut = data.draw(st.integers(0, len(text)))
    ends, at = [], 1
    for item in items:
        at = text.index(json.dumps(item), at) + len(json.dumps(item))
        ends.append(at)
    want = [item for item, end in zip(items, ends) if end <= cut]
    assert _complete_items(text[:cut]) == want


def test_grammars_compile_beside_the_engine_and_are_bounded(monkeypatch):
    """Issue 44 item 4. A grammar that compiles for long stalls no one: while it compiles (here
    held by an event, so the order is certain), a plain request runs to the end and /health
    answers; one compile per spec (the server compiles nothing); past max_grammar_compile_seconds
    the request fails alone with a 400 naming its field, and once the compile lands the cache serves
    the next request with that spec at once."""
    import threading

    import httpx

    from qwen_ops.engine import structured
    from qwen_ops.serving.async_llm import AsyncLLM

    gate, calls = threading.Event(), []
    real = structured.GrammarBackend.compile

    def slow(self, params):
        if params.kind == "regex" and params.regex.startswith("slow"):
            calls.append(params.regex)
            assert gate.wait(60), "the test never opened the gate"
        return real(self, params)

    monkeypatch.setattr(structured.GrammarBackend, "compile", slow)
    llm = LLM(None, max_num_seqs=4, max_model_len=256, max_grammar_compile_seconds=0.5)
    engine = AsyncLLM(llm)
    try:
        with running_server(engine) as srv, \
                openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            held = {}

            def constrained(key, pattern):
                try:
                    held[key] = c.completions.create(model="qwen-ops-default", prompt="x = ", max_tokens=4,
                                                     temperature=0, extra_body={"structured_outputs": {"regex": pattern}})
                except openai.BadRequestError as e:
                    held[key] = e

            first = threading.Thread(target=constrained, args=("slow", "slow[0-9]{3}"))
            first.start()
            assert wait_until(lambda: calls)                          # its grammar is compiling, held
            plain = c.completions.create(model="qwen-ops-default", prompt="def f(x):", max_tokens=3, temperature=0)
            assert len(plain.choices[0].text) > 0 and httpx.get(srv.url + "/health").status_code == 200
            assert not gate.is_set() and "slow" not in held           # ...and it still is: no one waited for it
            first.join(30)
            err = held["slow"]                                        # past 0.5 s: its own 400, naming its field
            assert isinstance(err, openai.BadRequestError) and err.body["param"] == "structured_outputs"
            assert "took longer than 0.5 s to compile" in str(err)
            gate.set()                                                # the compile lands in the cache
            assert wait_until(lambda: llm.core.grammar_backend().compiles >= 1)
            again = c.completions.create(model="qwen-ops-default", prompt="x = ", max_tokens=4, temperature=0,
                                         extra_body={"structured_outputs": {"regex": "slow[0-9]{3}"}})
            assert re.fullmatch(r"slow[0-9]{0,3}", again.choices[0].text), again.choices[0].text
            assert calls == ["slow[0-9]{3}"]                          # compiled once, for both requests
            with pytest.raises(openai.BadRequestError) as e:          # a bad spec is still a 400 naming the field
                c.chat.completions.create(model="qwen-ops-default", messages=[{"role": "user", "content": "hi"}],
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "x", "schema": {"type": "nonsense"}}}, max_tokens=4)
            assert e.value.body["param"] == "response_format", e.value.body
            assert llm.stats()["num_running"] == 0 and llm.stats()["num_waiting"] == 0
    finally:
        gate.set()
        engine.shutdown()


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
