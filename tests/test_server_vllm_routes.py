"""What a vLLM deployment finds on this server (issue 62): ``VLLM_API_KEY``, completions' ``max_tokens``
absent (16) and null (the room left in the context), ``/ping``, the route aliases ``/score`` and ``/v2/rerank``, ``/pooling``
(also with chat ``messages``), ``/classify`` (also with the engine core in its own process), a chat message's
``tool_calls: []``, ``response_format`` of type ``structural_tag``, ``/v1/chat/completions/batch``, vLLM's demo
server (``/generate``, ``demo_api.py``) and vLLM's periodic stats line in the log.

Oracles: offline ``LLM.generate`` (greedy) for completions, and for the batch route of the conversations as
transformers' ``apply_chat_template`` renders them; offline ``LLM.beam_search`` for the demo server's beams;
the official ``openai`` client's parse of a chat message; the structural tag's own grammar (a regex);
transformers for pooled vectors and classifier probabilities (tests/test_server_embed.py's
and tests/test_embed.py's), with transformers' chat template for ``messages``; for the stats line, the tokens
and concurrency the test itself sent, and a server built with the line turned off.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch

import qwen_ops
from qwen_ops import LLM, SamplingParams
from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.beam_search import BeamSearchParams
from qwen_ops.serving.cli import main
from qwen_ops.serving.openai import ServerThread
from qwen_ops.serving.openai.demo_api import build_demo_app
from qwen_ops.serving.openai.server import _api_key
from test_embed import hf_class_logits, make_sequence_classifier
from test_server_embed import (COSINE_DISTANCE_FP32, ENGINE_KWARGS as POOL_KWARGS, NAME, NO, PROMPTS, SCORE_ATOL,
                               YES, _save_word_tokenizer, ckpt, cosine_distance, hf_lm, oracle_embedding,
                               oracle_yes_share, prompt, words)

from server_fixture import engine, offline  # noqa: F401  (fixtures)
from server_fixture import CLIENT_TIMEOUT_S, SERVED_NAME, cli_server_port, running_server, wait_for

__all__ = ["ckpt", "hf_lm"]          # fixtures shared with test_server_embed.py
API_KEY = "vllm-env-key"
STATS_LOGGER = "qwen_ops.serving.openai.stats"
STATS_LINE = re.compile(r"Engine 000: Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: "
                        r"(\d+\.\d) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: "
                        r"(\d+\.\d)%(, Prefix cache hit rate: \d+\.\d%)?$")


# ----------------------------------------------------------------------------- a generation server
@pytest.fixture(scope="module")
def server(engine):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QWEN_OPS_API_KEY", raising=False)
        mp.setenv("VLLM_API_KEY", API_KEY)
        key = _api_key(None)
    with running_server(engine, api_key=key, disable_log_stats=True) as srv:    # lines only from the stats tests
        yield srv


def post(url: str, body: dict, key: str = API_KEY) -> httpx.Response:
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=CLIENT_TIMEOUT_S)


def test_vllm_api_key_is_read_after_the_flag_and_qwen_ops_key(server, monkeypatch, capsys):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        assert [m.id for m in c.models.list().data] == [SERVED_NAME]
    with openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    monkeypatch.setenv("VLLM_API_KEY", "v")
    monkeypatch.setenv("QWEN_OPS_API_KEY", "q")
    assert (_api_key("f"), _api_key(None)) == ("f", "q")
    monkeypatch.delenv("QWEN_OPS_API_KEY")
    assert _api_key(None) == "v"
    monkeypatch.delenv("VLLM_API_KEY")
    assert _api_key(None) is None
    monkeypatch.setattr(AsyncLLM, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "  ")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: VLLM_API_KEY = '  ' is empty"), err


def test_completions_max_tokens_absent_is_16_and_null_is_the_room_left(server, offline):
    """Absent: 16 (OpenAI's and vLLM's default). Null: up to max_model_len, as vLLM's chat reads it (and issue 62
    asks; vLLM 0.32's completions read null as 16). Oracle: offline LLM.generate with the same max_tokens."""
    prompt = "def fibonacci(n):"
    n_prompt = len(offline.get_tokenizer().encode(prompt))
    room = offline.stats()["max_model_len"] - n_prompt
    for extra, most in (({}, 16), ({"max_tokens": None}, room)):
        (want,) = offline.generate([prompt], SamplingParams(max_tokens=most, temperature=0.0, ignore_eos=True),
                                   use_tqdm=False)
        r = post(server.base_url + "/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == most and body["choices"][0]["text"] == want.outputs[0].text


def test_ping_get_and_post(server):
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping", timeout=CLIENT_TIMEOUT_S).status_code == 200


@pytest.mark.parametrize("path, body, api", [
    ("/pooling", {"input": "hi"}, "Pooling"),
    ("/classify", {"input": "hi"}, "Classification"),
    ("/score", {"text_1": "a", "text_2": "b"}, "Score"),
    ("/v2/rerank", {"query": "a", "documents": ["b"]}, "Rerank"),
])
def test_pooling_routes_on_a_generation_model_are_400(server, path, body, api):
    r = post(server.url + path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"The model does not support the {api} API: it is a generation")


# ----------------------------------------------------------------------------- pooling servers
@pytest.fixture(scope="module")
def embed_server(ckpt):
    engine = AsyncLLM.from_pretrained(str(ckpt), **POOL_KWARGS)
    with running_server(engine, served_model_name=NAME, disable_log_stats=True) as srv:
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def rerank_server(ckpt):
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [NO, YES],
                 "is_original_qwen3_reranker": True}
    engine = AsyncLLM(LLM(str(ckpt), hf_overrides=overrides, **POOL_KWARGS))
    with running_server(engine, served_model_name=NAME, disable_log_stats=True) as srv:
        yield srv
    engine.shutdown()


LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("cls3")
    hf = make_sequence_classifier(path, num_labels=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "id2label": LABELS}))
    engine = AsyncLLM(LLM(str(path), **POOL_KWARGS))
    with running_server(engine, served_model_name=NAME, disable_log_stats=True) as srv:
        yield srv, hf
    engine.shutdown()


def test_score_and_v2_rerank_aliases(embed_server, rerank_server, hf_lm):
    query, docs = PROMPTS[1], PROMPTS[2:]
    body = post(embed_server.url + "/score", {"text_1": words(query), "text_2": [words(d) for d in docs]}).json()
    q = oracle_embedding(hf_lm, query)
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [torch.dot(q, oracle_embedding(hf_lm, d)).item() for d in docs], abs=SCORE_ATOL)
    query, docs = prompt(20, seed=8), [prompt(n, seed=30 + n) for n in (1, 6, 25)]
    refs = [oracle_yes_share(hf_lm, query + d) for d in docs]
    r = post(rerank_server.url + "/v2/rerank", {"query": words(query), "documents": [words(d) for d in docs]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda i: refs[i], reverse=True)
    assert [x["relevance_score"] for x in results] == pytest.approx([refs[x["index"]] for x in results],
                                                                    abs=SCORE_ATOL)


def test_pooling_on_an_embedding_model_is_the_embedding(embed_server, hf_lm):
    texts = [words(p) for p in PROMPTS]
    r = post(embed_server.url + "/pooling", {"model": NAME, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == NAME
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "pooling") for i in range(len(texts))]
    for ids, d in zip(PROMPTS, body["data"]):
        assert cosine_distance(d["data"], oracle_embedding(hf_lm, ids)) < COSINE_DISTANCE_FP32
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    raw = post(embed_server.url + "/pooling", {"input": PROMPTS[2], "encoding_format": "base64"}).json()["data"]
    decoded = np.frombuffer(base64.b64decode(raw[0]["data"]), dtype="<f4")
    assert cosine_distance(decoded, oracle_embedding(hf_lm, PROMPTS[2])) < COSINE_DISTANCE_FP32
    for body, param in (({"input": "w1", "task": "classify"}, "task"), ({"input": "w1", "dimensions": 8}, "dimensions"),
                        ({"input": 3.5}, "input"), ({"input": "w1", "encoding_format": "int8"}, "encoding_format")):
        r = post(embed_server.url + "/pooling", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(embed_server.url + "/classify", {"input": "w1"})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"], r.text
    r = post(embed_server.url + "/v1/responses", {"input": "w1"})
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"], r.text


def test_classify_and_pooling_on_a_sequence_classifier(classifier):
    srv, hf = classifier
    prompts = [prompt(n, seed=n) for n in (1, 7, 40)]
    r = post(srv.url + "/classify", {"model": NAME, "input": prompts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for i, (ids, d) in enumerate(zip(prompts, body["data"])):
        ref = torch.softmax(hf_class_logits(hf, ids), dim=0)
        assert d["index"] == i and d["num_classes"] == 3
        assert d["probs"] == pytest.approx(ref.tolist(), abs=1e-5)
        assert d["label"] == LABELS[str(int(ref.argmax()))]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    pooled = post(srv.url + "/pooling", {"input": prompts}).json()["data"]
    for ids, p in zip(prompts, pooled):
        assert p["data"] == pytest.approx(torch.softmax(hf_class_logits(hf, ids), dim=0).tolist(), abs=1e-5)
    r = post(srv.url + "/v1/embeddings", {"input": prompts[0]})
    assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]


# ------------------------------------------------- a classifier whose engine core runs in its own process
# A word-level chat template: each message "w1 <content> w2", the generation prompt "w3".
WORD_CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                      "{% if add_generation_prompt %}w3{% endif %}")


@pytest.fixture(scope="module")
def process_classifier(tmp_path_factory):
    """``serve``'s default: the engine core in a child process, which sends the classifier head over its pipe."""
    path = tmp_path_factory.mktemp("cls3proc")
    hf = make_sequence_classifier(path, num_labels=3)
    _save_word_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "chat_template": WORD_CHAT_TEMPLATE}))
    engine = AsyncLLM.from_pretrained(str(path), **POOL_KWARGS)
    assert engine.llm is None                        # no LLM here: the core is the child's
    with running_server(engine, served_model_name=NAME, disable_log_stats=True) as srv:
        yield srv, hf, path
    engine.shutdown()


def test_classify_with_the_engine_in_its_own_process(process_classifier):
    srv, hf, _ = process_classifier
    prompts = [prompt(n, seed=n) for n in (3, 11, 60)]
    r = post(srv.url + "/classify", {"model": NAME, "input": [words(p) for p in prompts]})
    assert r.status_code == 200, r.text
    for ids, d in zip(prompts, r.json()["data"]):
        assert d["probs"] == pytest.approx(torch.softmax(hf_class_logits(hf, ids), dim=0).tolist(), abs=1e-5)


def test_pooling_chat_messages_are_the_rendered_conversation(process_classifier):
    """vLLM's PoolingChatRequest: ``messages`` rendered by the chat template (no generation prompt unless
    asked), pooled as one prompt. Oracle: transformers' apply_chat_template, then its classifier."""
    from transformers import AutoTokenizer

    srv, hf, path = process_classifier
    tok = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "system", "content": words(prompt(4, seed=1))},
                {"role": "user", "content": [{"type": "text", "text": words(prompt(9, seed=2))}]}]
    for extra in ({}, {"add_generation_prompt": True}):
        hf_messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                        else m["content"][0]["text"]} for m in messages]
        ids = tok.apply_chat_template(hf_messages, tokenize=True, **extra)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        r = post(srv.url + "/pooling", {"model": NAME, "messages": messages, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        (d,) = body["data"]
        assert d["data"] == pytest.approx(torch.softmax(hf_class_logits(hf, ids), dim=0).tolist(), abs=1e-5)
    for bad, param in (({"messages": messages, "input": "w1"}, "messages"), ({"messages": []}, "messages"),
                       ({"messages": [{"role": "robot", "content": "w1"}]}, "messages[0].role")):
        r = post(srv.url + "/pooling", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ chat: tool_calls, structural tags
def test_chat_message_without_tool_calls_has_an_empty_list(server):
    """vLLM's ChatMessage (before 0.32 dropped an empty list): ``tool_calls`` is ``[]``, which vLLM's tools
    example iterates; the official client reads it as an empty list, not None."""
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        reply = c.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
        beams = c.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0, n=2, extra_body={"use_beam_search": True})
    assert reply.choices[0].message.tool_calls == []
    assert [ch.message.tool_calls for ch in beams.choices] == [[], []]


# xgrammar's structural tag: "<f>", one of two cities, "</f>". (A json_schema content takes free whitespace
# inside a structural tag, which the tiny model fills its budget with.)
STRUCTURAL_TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                       "content": {"type": "regex", "pattern": "(Paris|Rome)"}}}


def test_response_format_structural_tag_constrains_the_reply(server):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        reply = c.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Pick a city."}],
                                          max_tokens=40, temperature=0, response_format=STRUCTURAL_TAG)
    content = reply.choices[0].message.content
    assert re.fullmatch(r"<f>(Paris|Rome)</f>", content), content
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fmt", [
    {"type": "structural_tag"},
    {"type": "structural_tag", "format": "tag"},
    {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]},
    {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]},
    {"type": "structural_tag", "format": {"type": "no_such_format"}},             # shaped right; does not compile
], ids=["empty", "format-str", "no-schema", "no-triggers", "bad-format"])
def test_bad_structural_tag_is_400_naming_response_format(server, fmt):
    r = post(server.base_url + "/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 4, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


# ----------------------------------------------------------------------- /v1/chat/completions/batch
CONVERSATIONS = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}],
                 [{"role": "user", "content": "def fibonacci(n):"}]]


def test_batch_chat_answers_each_conversation(server, offline):
    """One choice per conversation, in order. Oracle: transformers' chat template of each conversation,
    generated offline (greedy)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_ops.default_model_path())
    texts = [tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) for conv in CONVERSATIONS]
    wants = offline.generate(texts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    r = post(server.base_url + "/chat/completions/batch", {"model": SERVED_NAME, "messages": CONVERSATIONS,
                                                           "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == SERVED_NAME
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [w.outputs[0].text for w in wants]
    assert [c["finish_reason"] for c in body["choices"]] == [w.outputs[0].finish_reason for w in wants]
    assert body["usage"]["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in wants)
    assert body["usage"]["completion_tokens"] == sum(len(w.outputs[0].token_ids) for w in wants)
    r = post(server.base_url + "/chat/completions/batch",
             {"messages": CONVERSATIONS[:2], "max_tokens": 8, "structured_outputs": {"regex": "(yes|no)"}})
    assert [c["message"]["content"] for c in r.json()["choices"]] in (
        [a, b] for a in ("yes", "no") for b in ("yes", "no")), r.text


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, param", [
    ({"messages": CONVERSATIONS, "stream": True}, "stream"),
    ({"messages": CONVERSATIONS, "n": 2}, "n"),
    ({"messages": CONVERSATIONS, "tools": [TOOL]}, "tools"),
    ({"messages": CONVERSATIONS, "use_beam_search": True}, "use_beam_search"),
    ({"messages": CONVERSATIONS[0]}, "messages"),                          # one conversation, not a list of them
    ({"messages": [CONVERSATIONS[0], [{"role": "robot", "content": "x"}]]}, "messages[1][0].role"),
    ({"messages": [CONVERSATIONS[0], []]}, "messages[1]"),
])
def test_batch_chat_bad_input_is_400_naming_the_field(server, body, param):
    r = post(server.base_url + "/chat/completions/batch", {"max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# --------------------------------------------------------------------- vLLM's demo server (/generate)
@pytest.fixture(scope="module")
def demo_server(engine):
    with ServerThread(build_demo_app(engine)) as srv:
        yield srv


def test_demo_generate_is_the_prompt_and_its_completion(demo_server, offline):
    text = "def fibonacci(n):"
    (want,) = offline.generate([text], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    whole = text + want.outputs[0].text
    r = httpx.post(demo_server.url + "/generate", json={"prompt": text, "max_tokens": 12, "temperature": 0},
                   timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200 and r.json() == {"text": [whole]}, r.text
    r = httpx.post(demo_server.url + "/generate", json={"prompt": text, "max_tokens": 12, "temperature": 0,
                                                        "stream": True}, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200 and r.content.endswith(b"\0"), r.content
    updates = [json.loads(chunk)["text"] for chunk in r.content.split(b"\0") if chunk]
    assert len(updates) > 1 and updates[-1] == [whole]
    assert all(u[0].startswith(text) and whole.startswith(u[0]) for u in updates)       # cumulative
    assert httpx.get(demo_server.url + "/health", timeout=CLIENT_TIMEOUT_S).status_code == 200


def test_demo_generate_beam_search(demo_server, offline):
    text = "The capital of France is"
    (want,) = offline.beam_search([{"prompt": text}], BeamSearchParams(beam_width=3, max_tokens=6))
    r = httpx.post(demo_server.url + "/generate", json={"prompt": text, "use_beam_search": True, "n": 3,
                                                        "temperature": 0.0, "max_tokens": 6}, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == [s.text for s in want.sequences]         # offline's text holds the prompt too


@pytest.mark.parametrize("body, param", [
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "no_such_field": 1}, "no_such_field"),
    ({"prompt": "x", "use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "use_beam_search": True, "n": 0}, "n"),
    ({"prompt": "x", "use_beam_search": "yes"}, "use_beam_search"),
])
def test_demo_generate_bad_input_is_400_naming_the_field(demo_server, body, param):
    r = httpx.post(demo_server.url + "/generate", json=body, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ----------------------------------------------------------------------------- the stats line
INTERVAL_S = 0.25
NUM_REQUESTS = 4
GEN_TOKENS = 160
LOAD_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self):"]


def _load(url: str) -> None:
    """NUM_REQUESTS completions at once, each exactly GEN_TOKENS tokens long."""
    errors = []

    def one(p: str) -> None:
        r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": GEN_TOKENS, "ignore_eos": True,
                                                       "temperature": 0}, timeout=CLIENT_TIMEOUT_S)
        if r.status_code != 200:
            errors.append(r.text)

    threads = [threading.Thread(target=one, args=(p,)) for p in LOAD_PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _stats_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == STATS_LOGGER]


def test_stats_line_under_load_counts_what_was_sent(engine, offline, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    with running_server(engine, log_stats_interval=INTERVAL_S) as srv:
        assert srv.server.config.app.state.stats_logger.interval_s == INTERVAL_S
        time.sleep(3 * INTERVAL_S)
        assert _stats_records(caplog) == []                 # idle: silent
        _load(srv.url)
        # A burst is followed by one more line (its last interval's tokens), then silence.
        assert wait_for(lambda: sum(r.generation_tokens for r in _stats_records(caplog))
                        == NUM_REQUESTS * GEN_TOKENS, timeout_s=20 * INTERVAL_S)
        time.sleep(3 * INTERVAL_S)
        records = _stats_records(caplog)
        time.sleep(3 * INTERVAL_S)
        assert len(_stats_records(caplog)) == len(records)
    lines = [STATS_LINE.match(r.getMessage()) for r in records]
    assert all(lines), [r.getMessage() for r in records]
    assert sum(r.prompt_tokens for r in records) == sum(len(offline.tokenizer.encode(p)) for p in LOAD_PROMPTS)
    running = [int(m.group(3)) for m in lines]
    assert max(running) == NUM_REQUESTS, [r.getMessage() for r in records]
    assert running[-1] == 0
    for r, m in zip(records, lines):           # the rates are the interval's counts over its length
        assert float(m.group(2)) == pytest.approx(r.generation_tokens / r.interval_s, abs=0.06)
        assert float(m.group(1)) == pytest.approx(r.prompt_tokens / r.interval_s, abs=0.06)


def test_disable_log_stats_writes_no_line(engine, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    with running_server(engine, log_stats_interval=INTERVAL_S, disable_log_stats=True) as srv:
        assert srv.server.config.app.state.stats_logger is None
        _load(srv.url)
        time.sleep(3 * INTERVAL_S)
    assert _stats_records(caplog) == []


@pytest.mark.parametrize("flags", [[], ["--disable-log-stats"]], ids=["on", "disabled"])
def test_serve_command_writes_the_line_unless_disabled(flags):
    """The real command: VLLM_API_KEY guards it, VLLM_LOG_STATS_INTERVAL sets the period, and the line
    reaches stderr, or nothing does with --disable-log-stats."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_API_KEY": API_KEY, "VLLM_LOG_STATS_INTERVAL": "0.3"}
    env.pop("QWEN_OPS_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", "--port", "0",
                             "--max-model-len", "128", "--max-num-seqs", "2", *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    try:
        port, _ = cli_server_port(proc)
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        url = f"http://127.0.0.1:{port}"
        assert post(url + "/v1/completions", {"prompt": "def f(x):"}, key="wrong").status_code == 401
        r = post(url + "/v1/completions", {"prompt": "def f(x):", "max_tokens": 40, "ignore_eos": True})
        assert r.status_code == 200, r.text
        seen = wait_for(lambda: any("Engine 000: Avg prompt throughput" in x for x in lines), timeout_s=5.0)
        assert seen == (not flags), lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
