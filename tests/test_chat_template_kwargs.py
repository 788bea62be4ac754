"""``chat_template_kwargs`` that set a variable the server passes to the chat template itself
(``messages``, ``add_generation_prompt``, ``tools``, the checkpoint's ``bos_token`` / ``eos_token``)
are the client's mistake: a 400 in OpenAI's error shape naming ``chat_template_kwargs`` and the key
(offline ``LLM.chat``: a ValueError saying the same), never a 500 from a duplicated Python keyword.
The server keeps serving after one."""

from __future__ import annotations

import httpx
import pytest

from qwen_ops import LLM, SamplingParams

from server_fixture import ENGINE_KWARGS, SERVED_NAME, make_engine, running_server

MESSAGES = [{"role": "user", "content": "Hello"}]
# Every variable ChatTemplate.render passes explicitly (the checkpoint's template has bos/eos tokens).
RESERVED = ["add_generation_prompt", "tools", "messages", "bos_token", "eos_token"]


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as srv:
        yield srv


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _assert_names_key(resp: httpx.Response, key: str) -> None:
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == "chat_template_kwargs", err
    assert "chat_template_kwargs" in err["message"] and repr(key) in err["message"], err["message"]


@pytest.mark.parametrize("key", RESERVED)
def test_reserved_chat_template_kwarg_is_a_400_then_the_server_still_serves(server, key):
    value = {"add_generation_prompt": False, "tools": [], "messages": []}.get(key, "<x>")
    chat = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    _assert_names_key(_post(server.url, "/v1/chat/completions", {**chat, "chat_template_kwargs": {key: value}}), key)
    _assert_names_key(_post(server.url, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {key: value}}),
                      key)
    # An ordinary request right after it is served (a kwarg the template does read included).
    ok = _post(server.url, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text[:300]
    body = ok.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    assert body["usage"]["completion_tokens"] >= 1
    assert _post(server.url, "/tokenize", {"messages": MESSAGES}).status_code == 200


def test_reserved_keys_among_ordinary_ones_are_all_named(server):
    resp = _post(server.url, "/v1/chat/completions",
                 {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 2,
                  "chat_template_kwargs": {"enable_thinking": False, "tools": [], "add_generation_prompt": True}})
    _assert_names_key(resp, "tools")
    assert "'add_generation_prompt'" in resp.json()["error"]["message"]
    assert "'enable_thinking'" not in resp.json()["error"]["message"]


@pytest.fixture(scope="module")
def offline():
    return LLM(None, **ENGINE_KWARGS)


@pytest.mark.parametrize("key", ["add_generation_prompt", "tools", "messages"])
def test_offline_chat_reserved_kwarg_is_a_value_error(offline, key):
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError) as info:      # not the TypeError of a duplicated keyword
        offline.chat(MESSAGES, sp, chat_template_kwargs={key: False})
    msg = str(info.value)
    assert "chat_template_kwargs" in msg and repr(key) in msg, msg
    assert len(offline.chat(MESSAGES, sp, chat_template_kwargs={"enable_thinking": False})[0].outputs[0].token_ids) >= 1
