"""What a vLLM deployment finds on this server (issue 62): ``VLLM_API_KEY``, completions' ``max_tokens``
absent (16) and null (the room left in the context), ``/ping``, the route aliases ``/score`` and ``/v2/rerank``, ``/pooling``,
``/classify``, and vLLM's periodic stats line in the log.

Oracles: offline ``LLM.generate`` (greedy) for completions; transformers for pooled vectors and
classifier probabilities (tests/test_server_embed.py's and tests/test_embed.py's); for the stats
line, the tokens and concurrency the test itself sent, and a server built with the line turned off.
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

from qwen_ops import LLM, SamplingParams
from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.cli import main
from qwen_ops.serving.openai.server import _api_key
from test_embed import hf_class_logits, make_sequence_classifier
from test_server_embed import (COSINE_DISTANCE_FP32, ENGINE_KWARGS as POOL_KWARGS, NAME, NO, PROMPTS, SCORE_ATOL,
                               YES, ckpt, cosine_distance, hf_lm, oracle_embedding, oracle_yes_share, prompt,
                               words)

from server_fixture import (CLIENT_TIMEOUT_S, ENGINE_KWARGS, SERVED_NAME, cli_server_port, make_engine,
                            running_server, wait_for)

__all__ = ["ckpt", "hf_lm"]          # fixtures shared with test_server_embed.py
API_KEY = "vllm-env-key"
STATS_LOGGER = "qwen_ops.serving.openai.stats"
STATS_LINE = re.compile(r"Engine 000: Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: "
                        r"(\d+\.\d) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: "
                        r"(\d+\.\d)%(, Prefix cache hit rate: \d+\.\d%)?$")


# ----------------------------------------------------------------------------- a generation server
@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline():
    return LLM(None, **ENGINE_KWARGS)


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
