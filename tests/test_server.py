"""The OpenAI-compatible server (qwen_ops/serving/openai), live on 127.0.0.1, through the official
``openai`` client: greedy outputs equal offline ``LLM.generate``, streamed equals non-streamed,
every error maps to OpenAI's shape and status, disconnects free KV blocks, /metrics parses."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from qwen_ops.serving.engine_args import EngineArgs
import torch

from qwen_ops import SamplingParams
from qwen_ops.serving.async_llm import QueueFullError
from qwen_ops.serving.cli import build_parser, main
from qwen_ops.serving.openai import build_app
from qwen_ops.serving.openai.chat import CHATML_TEMPLATE, ChatTemplate

from server_fixture import engine, offline  # noqa: F401  (fixtures)
from server_fixture import (CLIENT_TIMEOUT_S, SERVED_NAME, PassThroughEngine, RevealingEngine,
                            blocks_in_use, cli_server_port, running_server, scrape, wait_for)

API_KEY = "test-key-123"
MAX_BODY_BYTES = 64 * 1024
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self):"]
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


def _offline_texts(offline, prompts, **kw) -> list[str]:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), temperature=0.0, **kw)
    return [o.outputs[0].text for o in offline.generate(list(prompts), params)]


def _chatml(messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- completions
def test_completions_greedy_equal_offline_streamed_or_not(client, offline):
    expected = _offline_texts(offline, PROMPTS)
    for prompt, want in zip(PROMPTS, expected):
        full = client.completions.create(model=SERVED_NAME, prompt=prompt, **GREEDY)
        assert full.choices[0].text == want
        assert full.choices[0].finish_reason == "length"
        n_prompt = len(offline.tokenizer.encode(prompt))
        assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == \
            (n_prompt, MAX_TOKENS, n_prompt + MAX_TOKENS)
        chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_completions_prompt_list_and_token_ids(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    expected = _offline_texts(offline, [PROMPTS[0], PROMPTS[1]])
    out = client.completions.create(model=SERVED_NAME, prompt=[PROMPTS[0], PROMPTS[1]], **GREEDY)
    assert [c.index for c in out.choices] == [0, 1] and [c.text for c in out.choices] == expected
    out = client.completions.create(model=SERVED_NAME, prompt=ids, **GREEDY)
    assert out.choices[0].text == expected[1] and out.usage.prompt_tokens == len(ids)
    out = client.completions.create(model=SERVED_NAME, prompt=[ids, ids], **GREEDY)
    assert [c.text for c in out.choices] == [expected[1]] * 2
    assert out.usage.prompt_tokens == 2 * len(ids) and out.usage.completion_tokens == 2 * MAX_TOKENS


def test_completions_echo(client, offline):
    (want,) = _offline_texts(offline, [PROMPTS[0]])
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], echo=True, **GREEDY)
    assert out.choices[0].text == PROMPTS[0] + want
    chunks = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + want


def test_n_choices_and_usage(client):
    for stream in (False, True):
        kw = dict(model=SERVED_NAME, prompt=PROMPTS[0], n=2, temperature=1.0, seed=7, max_tokens=8)
        if not stream:
            out = client.completions.create(**kw)
            texts = {c.index: c.text for c in out.choices}
            assert sorted(texts) == [0, 1]
            assert out.usage.completion_tokens == 16      # summed over choices
        else:
            chunks = list(client.completions.create(stream=True, **kw))
            streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)}
            assert streamed == texts                      # same seed: same completions


def test_stop_string_ends_before_it(client, offline):
    (text,) = _offline_texts(offline, [PROMPTS[0]], max_tokens=16)
    word = next(w for w in text.split() if len(w) >= 3 and text.index(w) > 0)
    expected = text[:text.index(word)]
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], stop=[word], temperature=0, max_tokens=16)
    assert out.choices[0].text == expected and word not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], stop=word, temperature=0,
                                            max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    k = 3
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], logprobs=k, **GREEDY)
    c = out.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX_TOKENS
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_TOKENS)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == k                   # greedy: the sampled token is the top one
        assert top[token] == pytest.approx(max(top.values()))
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], logprobs=k, stream=True, **GREEDY))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)
    offsets = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


# ----------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": "def fibonacci(n):"}]}]


def test_chat_equals_offline_on_the_chatml_prompt(client, offline, engine):
    flat = [MESSAGES[0], {"role": "user", "content": "def fibonacci(n):"}]
    assert ChatTemplate.for_checkpoint(engine.model_path).source == CHATML_TEMPLATE   # no template shipped
    (want,) = _offline_texts(offline, [_chatml(flat)])
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **GREEDY)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(offline.tokenizer.encode(_chatml(flat)))
    assert out.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens
    assert chunks.index(with_reason[0]) == len(chunks) - 2     # finish, then usage


def test_chat_max_completion_tokens_and_n(client):
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=5, n=2,
                                         temperature=0)
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content
    assert out.usage.completion_tokens == 10


def test_chat_logprobs(client):
    k = 2
    out = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, logprobs=True, top_logprobs=k,
                                         **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == k and e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, logprobs=True,
                                                 top_logprobs=k, stream=True, **GREEDY))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content])


def test_chat_template_from_the_checkpoint(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>"},
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    t = ChatTemplate.for_checkpoint(tmp_path)
    assert t.render([{"role": "user", "content": "hi"}]) == "[user]hi</s>[assistant]"
    # Sandboxed: a template cannot reach Python internals.
    with pytest.raises(ValueError, match="cannot render"):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])


# ----------------------------------------------------------------------------- models, health, auth
def test_models_health_and_auth(client, server):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200      # open, as in vLLM
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    for key in ("wrong-key", API_KEY + "x"):
        with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=10) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
    r = httpx.post(server.base_url + "/completions", json={"prompt": "hi"}, timeout=10)     # no header at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


# ----------------------------------------------------------------------------- errors
LONG_PROMPT = "hello " * 600
COMPLETION_ERRORS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"prompt": LONG_PROMPT}, "prompt"),
    ({"max_tokens": 600}, "max_tokens"),                    # prompt + max_tokens over max_model_len = 512
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], "x", [3, 99999]]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"presence_penalty": 5.0}, "presence_penalty"),
    ({"logit_bias": {"3": 500}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"extra_body": {"allowed_token_ids": [99999]}}, "allowed_token_ids"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"min_tokens": 99}}, "min_tokens"),
    ({"extra_body": {"stop_token_ids": [-3]}}, "stop_token_ids"),     # past the vocabulary is accepted, as vLLM
]


@pytest.mark.parametrize("override,param", COMPLETION_ERRORS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_ERRORS)])
def test_completion_errors_name_the_field(client, override, param):
    kw = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4, **override}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw)
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "BadRequestError" and err["param"] == param, err
    assert param.split("[")[0] in err["message"] and "Traceback" not in err["message"]


CHAT_ERRORS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
]


@pytest.mark.parametrize("override,param", CHAT_ERRORS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_ERRORS)])
def test_chat_errors_name_the_field(client, override, param):
    kw = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **override}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw)
    assert info.value.body["param"] == param, info.value.body


def test_unknown_model_is_404(client):
    for call in (lambda: client.completions.create(model="gpt-9", prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["param"] == "model" and "gpt-9" in info.value.body["message"]


def _post(server, path, content, headers=None):
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(server.base_url + path, content=content, headers=h, timeout=10)


@pytest.mark.parametrize("content,fragment", [
    (b'{"prompt": "hi", ', "not valid JSON"),
    (b'["prompt"]', "expected an object"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_bad_json_is_400_in_openai_shape(server, content, fragment):
    r = _post(server, "/completions", content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and fragment in err["message"]
    assert err["type"] == "BadRequestError" and err["code"] == 400


def test_unknown_route_is_404_in_openai_shape(server):
    r = httpx.get(server.base_url + "/nothing", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_body_over_the_limit_is_413(client, server):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x" * (MAX_BODY_BYTES + 1), max_tokens=2)
    assert info.value.status_code == 413 and info.value.body["type"] == "RequestTooLargeError"

    def chunks():                       # no Content-Length: counted while read
        body = json.dumps({"model": SERVED_NAME, "prompt": "y" * (2 * MAX_BODY_BYTES)}).encode()
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    r = _post(server, "/completions", chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


class _FaultyEngine(PassThroughEngine):
    """The real engine, except prompts saying 'queue-full', 'boom' or 'late-boom'."""

    async def generate(self, prompt, params, request_id=None):
        text = self.tokenizer.decode(prompt)
        if "queue-full" in text:
            raise QueueFullError("9 requests are waiting (max_waiting_requests = 9); retry later")
        if "late-boom" in text:
            n = 0
            async for out in self.real.generate(prompt, params, request_id):
                yield out
                n += 1
                if n == 2:
                    raise RuntimeError("secret internal detail")
        elif "boom" in text:
            raise RuntimeError("secret internal detail")
        else:
            async for out in self.real.generate(prompt, params, request_id):
                yield out


@pytest.fixture(scope="module")
def faulty(engine):
    with running_server(_FaultyEngine(engine)) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
            yield srv, c


def test_queue_full_is_503_with_retry_after(faulty):
    srv, c = faulty
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=SERVED_NAME, prompt="queue-full", max_tokens=2)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert info.value.body["type"] == "ServiceUnavailableError"


def test_server_side_waiting_bound_and_health_of_a_stopped_engine(engine):
    class Stopped:
        is_running = False
        tokenizer, vocab_size, max_model_len, model_path = (engine.tokenizer, engine.vocab_size,
                                                            engine.max_model_len, engine.model_path)
        stats, abort, generate = engine.stats, engine.abort, engine.generate

    with running_server(engine, max_waiting=0) as srv:         # nothing may wait: every request is turned away
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
            with pytest.raises(openai.APIStatusError) as info:
                c.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    with running_server(Stopped()) as srv:
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is not running"


def test_a_failing_request_fails_alone_without_a_traceback(faulty, client, offline):
    srv, c = faulty
    with pytest.raises(openai.InternalServerError) as info:
        c.completions.create(model=SERVED_NAME, prompt="boom", max_tokens=2)
    raw = info.value.response.text
    assert info.value.status_code == 500 and "secret" not in raw and "Traceback" not in raw
    with pytest.raises(openai.APIError) as info:          # mid-stream: reported in-band
        list(c.completions.create(model=SERVED_NAME, prompt="late-boom", max_tokens=8, stream=True))
    assert "secret" not in str(info.value)
    # Both servers keep serving; the failed requests left no blocks behind.
    (want,) = _offline_texts(offline, [PROMPTS[0]])
    assert c.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], **GREEDY).choices[0].text == want
    assert client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], **GREEDY).choices[0].text == want
    assert wait_for(lambda: blocks_in_use(srv.url) == 0)


# ----------------------------------------------------------------------------- disconnects, load, metrics
def _aborts(url) -> float:
    return scrape(url).get('qwen_ops:request_success_total{finished_reason=abort}', 0.0)


def test_streaming_client_disconnect_frees_blocks(client, server):
    aborts = _aborts(server.url)
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert blocks_in_use(server.url) > 0
    stream.close()                                 # drop the connection mid-stream
    assert wait_for(lambda: blocks_in_use(server.url) == 0), scrape(server.url)
    assert wait_for(lambda: _aborts(server.url) == aborts + 1)     # aborted, not run to the end
    assert scrape(server.url)["qwen_ops:num_requests_running"] == 0


def test_non_streaming_client_timeout_frees_blocks(server):
    aborts = _aborts(server.url)
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=0.05) as hasty:
        with pytest.raises(openai.APITimeoutError):
            hasty.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=480, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert wait_for(lambda: blocks_in_use(server.url) == 0)
    assert wait_for(lambda: _aborts(server.url) == aborts + 1)


def test_64_concurrent_streams_match_offline_and_leak_nothing(server, offline):
    prompts = [f"def function_{i}(x):" for i in range(64)]
    expected = _offline_texts(offline, prompts, max_tokens=8)

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=SERVED_NAME, prompt=prompt, temperature=0, max_tokens=8,
                                            stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                                      timeout=CLIENT_TIMEOUT_S,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), CLIENT_TIMEOUT_S)

    assert asyncio.run(all_of_them()) == expected
    assert wait_for(lambda: blocks_in_use(server.url) == 0)
    m = scrape(server.url)
    assert m["qwen_ops:num_requests_running"] == 0 and m["qwen_ops:num_requests_waiting"] == 0


def test_metrics_parse_and_count(client, server):
    before = scrape(server.url)
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], **GREEDY)
    after = scrape(server.url)
    for name in ("qwen_ops:num_requests_running", "qwen_ops:num_requests_waiting", "qwen_ops:kv_cache_blocks_in_use",
                 "qwen_ops:kv_cache_usage_perc", "qwen_ops:num_preemptions_total",
                 "qwen_ops:time_to_first_token_seconds_count", "qwen_ops:inter_token_latency_seconds_count",
                 "qwen_ops:e2e_request_latency_seconds_count"):
        assert name in after, name
    assert after["qwen_ops:prompt_tokens_total"] - before["qwen_ops:prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["qwen_ops:generation_tokens_total"] - before["qwen_ops:generation_tokens_total"] == MAX_TOKENS
    assert after["qwen_ops:request_success_total{finished_reason=length}"] - \
        before.get("qwen_ops:request_success_total{finished_reason=length}", 0) == 1
    grew = {name: after[f"qwen_ops:{name}_count"] - before[f"qwen_ops:{name}_count"]
            for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds")}
    assert grew["time_to_first_token_seconds"] == grew["e2e_request_latency_seconds"] == 1
    assert grew["inter_token_latency_seconds"] >= 1


def test_penalties_and_logit_bias_reach_the_engine(client):
    """OpenAI's penalties and logit_bias and vLLM's extras are honoured, not refused (issue 30)."""
    from qwen_ops.models.defaults import default_model_path
    from qwen_ops.models.loader import load_tokenizer

    tok = load_tokenizer(default_model_path())
    (word,) = tok.encode(" return", add_special_tokens=False)
    plain = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], **GREEDY).choices[0].text
    biased = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], logit_bias={str(word): 100}, **GREEDY)
    assert biased.choices[0].text == " return" * MAX_TOKENS
    banned = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], **GREEDY,
                                       extra_body={"bad_words": [plain.split()[0]]}).choices[0].text
    assert plain.split()[0] not in banned.split()
    rep = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], frequency_penalty=2.0, presence_penalty=2.0,
                                    **GREEDY).choices[0].text
    assert isinstance(rep, str)


def test_each_app_has_its_own_registry(engine):
    a = build_app(engine, served_model_name="a")
    b = build_app(engine, served_model_name="b")          # the global registry would refuse a second app
    assert a.state.metrics.registry is not b.state.metrics.registry


@pytest.mark.parametrize("kwargs,fragment", [
    ({"served_model_name": ""}, "served_model_name"),
    ({"served_model_name": "m", "api_key": ""}, "api_key"),
    ({"served_model_name": "m", "max_body_bytes": 0}, "max_body_bytes"),
    ({"served_model_name": "m", "max_waiting": -1}, "max_waiting"),
])
def test_build_app_validates_its_arguments(engine, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_app(engine, **kwargs)


# ----------------------------------------------------------------------------- the command
def test_serve_flags_and_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.api_key, args.served_model_name) == (None, "127.0.0.1", 8000,
                                                                                        None, None)
    args = build_parser().parse_args(["serve", "/ckpt", "--port", "0", "--api-key", "k", "--served-model-name", "a",
                                      "b", "--max-num-seqs", "4", "--max-model-len", "256", "--dtype", "bfloat16",
                                      "--device", "cpu", "--compile", "--max-waiting-requests", "3",
                                      "--max-body-bytes", "1000"])
    assert args.model_tag == "/ckpt" and args.served_model_name == ["a", "b"] and args.compile is True
    assert EngineArgs.from_cli_args(args).model == args.model == "/ckpt"      # MODEL, or --model (vLLM's)
    assert (args.max_waiting_requests, args.max_body_bytes) == (3, 1000)


@pytest.mark.parametrize("argv,message", [
    (["serve", "--port", "70000"], "--port = 70000, expected 0..65535"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes = 0, expected >= 1"),
    (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests = 0, expected >= 1"),
    (["serve", "--engine-heartbeat-timeout", "0"], "--engine-heartbeat-timeout = 0.0, expected a number of seconds > 0"),
    (["serve", "--request-timeout", "-1"], "--request-timeout = -1.0, expected a number of seconds > 0"),
    (["serve", "--timeout-keep-alive", "inf"], "--timeout-keep-alive = inf, expected a number of seconds > 0"),
    (["serve", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (hermes), as vLLM's"),
])
def test_serve_rejects_bad_flags_before_loading(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_qwen_ops_serve_end_to_end(tmp_path):
    """The real command in a subprocess on a free port: it serves, needs its key, and stops on Ctrl-C."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", "--port", "0",
                             "--api-key", "k", "--max-model-len", "128", "--max-num-seqs", "2"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        port, seen = cli_server_port(proc)
        # One start-up line says what is served (vLLM prints its config too).
        (summary,) = [line for line in seen if line.startswith("qwen-ops serve: ")]
        assert f"as {SERVED_NAME} | float32" in summary and "max_model_len 128" in summary, summary
        assert re.search(r"KV cache \d+ blocks = \d+ tokens \| 1 thread \| http://127\.0\.0\.1:\d+$", summary.strip())
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=30) as c:
            assert [m.id for m in c.models.list().data] == [SERVED_NAME]
            out = c.completions.create(model=SERVED_NAME, prompt="def f(x):", max_tokens=3)
            assert out.usage.completion_tokens == 3
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0, timeout=30) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and err.strip().endswith("interrupted"), err     # the command's Ctrl-C exit


# ----------------------------------------------------------------- issue 30: routes, vLLM metric names, reasoning
def test_tokenize_detokenize_and_version(server, client):
    """vLLM's /tokenize (a prompt, or messages through the chat template), /detokenize, /version."""
    from qwen_ops.serving.openai.chat import ChatTemplate

    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = server.url
    r = httpx.post(f"{base}/tokenize", json={"prompt": "def fibonacci(n):"}, headers=headers).json()
    ids = r["tokens"]
    assert r["count"] == len(ids) > 0 and r["max_model_len"] == 512
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}, headers=headers).json() == {"prompt": "def fibonacci(n):"}
    messages = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}, headers=headers).json()
    from qwen_ops.models.defaults import default_model_path
    from qwen_ops.models.loader import load_tokenizer

    text = ChatTemplate.for_checkpoint(default_model_path()).render(messages)
    assert chat["tokens"] == load_tokenizer(default_model_path()).encode(text, add_special_tokens=False)
    import qwen_ops

    assert httpx.get(f"{base}/version").json() == {"version": qwen_ops.__version__}
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "messages"),
                              ("/detokenize", {"tokens": [1 << 30]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"messages": messages, "chat_template_kwargs": {"messages": 1}},
                               "chat_template_kwargs")):
        resp = httpx.post(f"{base}{path}", json=body, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, body, resp.text)
    # Outside the key, as vLLM's; the /v1 routes stay behind it.
    assert httpx.post(f"{base}/tokenize", json={"prompt": "a"}).status_code == 200
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).status_code == 200
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "a"}).status_code == 401


def test_vllm_metric_names(server, client):
    """Dashboards built for vLLM read vllm:* names: the same values as qwen_ops:*."""
    client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], **GREEDY)
    m = scrape(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert m[f"vllm:{name}"] == m[f"qwen_ops:{name}"], name
    assert m["vllm:gpu_cache_usage_perc"] == m["vllm:kv_cache_usage_perc"]
    assert m["vllm:generation_tokens_total"] >= MAX_TOKENS


THOUGHT = "<think>\nThe user wants code.\n</think>\n\n"


class _ThinkingEngine(RevealingEngine):
    """The real engine, its chat replies prefixed with a think block revealed 5 characters per
    update (so tags arrive split across stream chunks), as a thinking Qwen3 writes them."""

    def shown(self, n: int, finished: bool, text: str) -> str:
        full = THOUGHT + text
        return full if finished else full[:min(len(full), 5 * n)]


def test_reasoning_parser_splits_and_streams(engine):
    with running_server(_ThinkingEngine(engine), reasoning_parser="qwen3") as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
            kw = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "Write a function."}], **GREEDY)
            full = c.chat.completions.create(**kw).choices[0].message
            assert full.reasoning_content == "\nThe user wants code.\n"
            assert full.content and not full.content.startswith("\n") and "<think>" not in full.content
            reasoning, content = "", ""
            for chunk in c.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    d = chunk.choices[0].delta
                    reasoning += getattr(d, "reasoning_content", None) or ""
                    content += d.content or ""
            assert (reasoning, content) == (full.reasoning_content, full.content)
    with pytest.raises(ValueError, match=r"reasoning_parser = 'deepseek', expected one of \['qwen3'\]"):
        build_app(engine, served_model_name="x", reasoning_parser="deepseek")


def test_developer_role_is_system_and_surrogates_are_400s(server, client):
    """OpenAI's ``developer`` role renders as ``system`` (the same prompt, so the same greedy reply);
    a lone UTF-16 surrogate is a 400 naming the field on /tokenize as on /v1."""
    def reply(role):
        r = client.chat.completions.create(model=SERVED_NAME, max_tokens=6, temperature=0, messages=[
            {"role": role, "content": "You write Python."}, {"role": "user", "content": "def f(x):"}])
        return r.choices[0].message.content, r.usage.prompt_tokens

    assert reply("developer") == reply("system")
    bad = '{"prompt": "a\\ud800b"}'
    r = httpx.post(f"{server.url}/tokenize", content=bad, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{server.url}/v1/completions", content='{"model": "%s", "prompt": "a\\ud800b"}' % SERVED_NAME,
                   headers={"content-type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    import qwen_ops

    assert capsys.readouterr().out.strip() == f"qwen-ops {qwen_ops.__version__}"


def test_vllm_request_metrics(server, client):
    """vLLM's per-request histograms and engine gauges: counts and sums move by exactly what one
    request of known size adds (a fresh prompt, so no prefix-cache hit shortens its prefill)."""
    prompt = torch.randint(10, 8000, (37,), generator=torch.Generator().manual_seed(4407)).tolist()
    before = scrape(server.url)
    client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def delta(name):
        return after[f"vllm:{name}"] - before.get(f"vllm:{name}", 0.0)

    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"{name}_count") == 1, name
        assert after[f"vllm:{name}_count"] == after[f"qwen_ops:{name}_count"], name
    assert delta("request_prompt_tokens_sum") == 37 and delta("request_generation_tokens_sum") == 5
    assert 0 <= delta("request_prefill_time_seconds_sum") <= delta("e2e_request_latency_seconds_sum")
    # The engine computed the 37 prompt tokens and 4 decodes (the 5th token is sampled, never fed).
    assert delta("iteration_tokens_total_sum") == 37 + 4
    assert delta("iteration_tokens_total_count") >= 5
    (info,) = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert "block_size=16" in info and "enable_prefix_caching=true" in info and after[info] == 1.0
    assert f"num_gpu_blocks={int(after['vllm:kv_cache_blocks_total'])}" in info
