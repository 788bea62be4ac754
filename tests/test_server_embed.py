"""The pooling routes of the OpenAI-compatible server (qwen_ops/serving/openai/pooling.py), live on
127.0.0.1: ``/v1/embeddings`` through the official ``openai`` client, vLLM's ``/v1/score`` and
``/rerank``, and what a pooling server says to generation requests (and a generation server to
pooling ones).

Oracles, outside qwen_ops: transformers' decoder (``Qwen3ForCausalLM(...).model``), its last hidden
state at the last token, L2-normalized (Qwen3-Embedding's pooling), each prompt alone; for the
reranker, transformers' causal-LM logits at the last position, softmax over (no, yes), "yes"'s share.
The tiny checkpoint gets a word-level tokenizer (``w<id>`` per token), so served text maps to known
token ids.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.llm import LLM
from tests.checkpoints import make_qwen3_checkpoint

from server_fixture import CLIENT_TIMEOUT_S, cli_server_port, running_server, stop_cli_server, wait_for

COSINE_DISTANCE_FP32 = 1e-6        # tests/test_embed.py's bound
SCORE_ATOL = 1e-5
VOCAB = 128
NAME = "tiny-embed"
ENGINE_KWARGS = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
NO, YES = 5, 9                      # the reranker's classifier tokens (ids; the word tokenizer has w5, w9)


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def _save_word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _write_sentence_transformers(path: Path) -> None:
    """modules.json with last-token Pooling and Normalize, as sentence-transformers saves Qwen3-Embedding."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
         "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
         "include_prompt": True}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("server_embed") / "ckpt", max_position_embeddings=256)
    _save_word_tokenizer(path)
    _write_sentence_transformers(path)         # so the runner is chosen automatically: pooling
    return path


@pytest.fixture(scope="module")
def hf_lm(ckpt):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def oracle_embedding(hf_lm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_lm.model(torch.tensor([ids])).last_hidden_state[0, -1].double()
    return torch.nn.functional.normalize(hidden, dim=0)


def oracle_yes_share(hf_lm, ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf_lm(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits[[NO, YES]], dim=0)[1].item()


def cosine_distance(a, b) -> float:
    return 1.0 - torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                                                       torch.as_tensor(b, dtype=torch.float64), dim=0).item()


@pytest.fixture(scope="module")
def embed_server(ckpt):
    # The default: the engine core in a child process (runner chosen from modules.json).
    engine = AsyncLLM.from_pretrained(str(ckpt), **ENGINE_KWARGS)
    assert engine.runner == "pooling"
    with running_server(engine, served_model_name=NAME) as server:
        yield server, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def rerank_server(ckpt):
    # The engine loop on a thread of this process (the other core), as Qwen3-Reranker: vLLM's overrides.
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [NO, YES],
                 "is_original_qwen3_reranker": True}
    engine = AsyncLLM(LLM(str(ckpt), hf_overrides=overrides, **ENGINE_KWARGS))
    with running_server(engine, served_model_name=NAME) as server:
        yield server
    engine.shutdown()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=CLIENT_TIMEOUT_S, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=CLIENT_TIMEOUT_S)


PROMPTS = [prompt(n, seed=n) for n in (1, 7, 17, 40)]     # across blocks and prefill chunks


def test_embeddings_float_batch_match_transformers(embed_server, hf_lm):
    server, _ = embed_server
    resp = client(server).embeddings.create(model=NAME, input=[words(p) for p in PROMPTS], encoding_format="float")
    assert [d.index for d in resp.data] == list(range(len(PROMPTS)))
    assert all(d.object == "embedding" for d in resp.data)
    for ids, d in zip(PROMPTS, resp.data):
        assert len(d.embedding) == 64
        assert cosine_distance(d.embedding, oracle_embedding(hf_lm, ids)) < COSINE_DISTANCE_FP32
    n = sum(map(len, PROMPTS))
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)
    assert resp.model == NAME


def test_embeddings_base64_decodes_to_the_float_vectors(embed_server, hf_lm):
    server, _ = embed_server
    texts = [words(p) for p in PROMPTS[:2]]
    floats = post(server, "/v1/embeddings", {"model": NAME, "input": texts}).json()["data"]
    raw = post(server, "/v1/embeddings", {"model": NAME, "input": texts, "encoding_format": "base64"}).json()["data"]
    for f, r in zip(floats, raw):
        decoded = np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(f["embedding"], abs=1e-7)
    # The openai client asks for base64 by default and decodes it itself.
    resp = client(server).embeddings.create(model=NAME, input=texts)
    for ids, d in zip(PROMPTS[:2], resp.data):
        assert cosine_distance(d.embedding, oracle_embedding(hf_lm, ids)) < COSINE_DISTANCE_FP32


def test_embeddings_token_ids_and_dimensions(embed_server, hf_lm):
    server, _ = embed_server
    c = client(server)
    one = c.embeddings.create(model=NAME, input=PROMPTS[2], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(PROMPTS[2])
    assert cosine_distance(one.data[0].embedding, oracle_embedding(hf_lm, PROMPTS[2])) < COSINE_DISTANCE_FP32
    many = c.embeddings.create(model=NAME, input=PROMPTS, encoding_format="float", dimensions=24)
    for ids, d in zip(PROMPTS, many.data):
        with torch.no_grad():
            hidden = hf_lm.model(torch.tensor([ids])).last_hidden_state[0, -1].double()
        ref = torch.nn.functional.normalize(hidden[:24], dim=0)          # Matryoshka: truncate, then normalize
        assert len(d.embedding) == 24
        assert cosine_distance(d.embedding, ref) < COSINE_DISTANCE_FP32


def test_score_is_cosine_of_the_oracle_embeddings(embed_server, hf_lm):
    server, _ = embed_server
    query, docs = PROMPTS[1], PROMPTS[2:] + [PROMPTS[0]]
    body = post(server, "/v1/score", {"model": NAME, "text_1": words(query), "text_2": [words(d) for d in docs]}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(docs)))
    q = oracle_embedding(hf_lm, query)
    for d, item in zip(docs, body["data"]):
        assert item["score"] == pytest.approx(torch.dot(q, oracle_embedding(hf_lm, d)).item(), abs=SCORE_ATOL)
    n = sum(len(query) + len(d) for d in docs)
    assert body["usage"]["prompt_tokens"] == n
    pairwise = post(server, "/v1/score", {"text_1": [words(docs[0]), words(docs[1])],
                                          "text_2": [words(query), words(docs[1])]}).json()["data"]
    assert pairwise[0]["score"] == pytest.approx(torch.dot(oracle_embedding(hf_lm, docs[0]), q).item(), abs=SCORE_ATOL)
    assert pairwise[1]["score"] == pytest.approx(1.0, abs=SCORE_ATOL)       # a text against itself


def test_rerank_orders_by_the_reranker_oracle(rerank_server, hf_lm):
    query = prompt(20, seed=8)
    docs = [prompt(n, seed=30 + n) for n in (1, 6, 25, 50)]
    refs = [oracle_yes_share(hf_lm, query + d) for d in docs]
    for path in ("/rerank", "/v1/rerank"):
        body = post(rerank_server, path, {"model": NAME, "query": words(query), "documents": [words(d) for d in docs]})
        assert body.status_code == 200, body.text
        results = body.json()["results"]
        assert [r["index"] for r in results] == sorted(range(len(docs)), key=lambda i: refs[i], reverse=True)
        for r in results:
            assert r["relevance_score"] == pytest.approx(refs[r["index"]], abs=SCORE_ATOL)
            assert r["document"] == {"text": words(docs[r["index"]])}
        assert body.json()["usage"]["total_tokens"] == sum(len(query) + len(d) for d in docs)
    top = post(rerank_server, "/rerank", {"query": words(query), "documents": [words(d) for d in docs], "top_n": 2,
                                          "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results][:2]
    assert all("document" not in r for r in top)
    # /v1/score on the reranker: the joined pair's relevance, in request order.
    scores = post(rerank_server, "/v1/score", {"text_1": words(query), "text_2": [words(d) for d in docs]}).json()
    assert [s["score"] for s in scores["data"]] == pytest.approx(refs, abs=SCORE_ATOL)
    # A reranker has no embeddings.
    r = post(rerank_server, "/v1/embeddings", {"input": "w1 w2"})
    assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [["w1"]]}, "input"),
    ("/v1/embeddings", {"input": [3, VOCAB + 5]}, "input"),
    ("/v1/embeddings", {"input": "w1", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "w1", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "w1", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "w1", "dimensions": "8"}, "dimensions"),
    ("/v1/embeddings", {"input": " ".join(["w3"] * 129)}, "input"),
    ("/v1/score", {"text_1": "w1"}, "text_2"),
    ("/v1/score", {"text_1": ["w1", "w2"], "text_2": ["w1", "w2", "w3"]}, "text_1"),
    ("/rerank", {"query": ["w1"], "documents": ["w2"]}, "query"),
    ("/rerank", {"query": "w1", "documents": "w2 w3"}, "documents"),
    ("/rerank", {"query": "w1", "documents": ["w2"], "top_n": -1}, "top_n"),
])
def test_bad_inputs_are_400_naming_the_field(embed_server, path, body, param):
    server, _ = embed_server
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]


def test_generation_routes_on_a_pooling_server_are_400(embed_server):
    server, _ = embed_server
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        c.completions.create(model=NAME, prompt="w1 w2", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w1"}], max_tokens=2)
    models = c.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_blocks_are_free_after_the_requests(embed_server):
    _, engine = embed_server
    for _ in range(3):
        post(embed_server[0], "/v1/embeddings", {"input": [words(p) for p in PROMPTS]})
    assert wait_for(lambda: engine.stats()["free_blocks"] == engine.stats()["total_blocks"])


def test_pooling_routes_on_a_generation_server_are_400(ckpt):
    engine = AsyncLLM(LLM(str(ckpt), runner="generate", **ENGINE_KWARGS))
    try:
        with running_server(engine, served_model_name=NAME) as server:
            for path, body in (("/v1/embeddings", {"input": "w1"}), ("/v1/score", {"text_1": "w1", "text_2": "w2"}),
                               ("/rerank", {"query": "w1", "documents": ["w2"]})):
                r = post(server, path, body)
                assert r.status_code == 400 and "generation model" in r.json()["error"]["message"], r.text
            with pytest.raises(openai.BadRequestError, match="generation model"):
                client(server).embeddings.create(model=NAME, input="w1")
    finally:
        engine.shutdown()


def test_serve_runner_flag(capsys, monkeypatch):
    from qwen_ops_cli import build_parser, main

    args = build_parser().parse_args(["serve", "some/model", "--runner", "pooling"])
    assert args.runner == "pooling"
    assert build_parser().parse_args(["serve"]).runner == "auto"
    # EngineArgs.validate's words, as LLM(runner="embed") says them, before anything loads
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    assert main(["serve", "--runner", "embed"]) == 2
    assert capsys.readouterr().err.strip() == ("error: runner = 'embed', expected one of 'auto', 'generate', "
                                               "'pooling'")


def test_qwen_ops_serve_runner_pooling_end_to_end(tmp_path):
    """The real command on a checkpoint that does not say it pools: --runner pooling makes it an
    embedding server (its vectors transformers'), and a bad --runner value is refused naming the flag."""
    import os
    import subprocess
    import sys

    from transformers import Qwen3ForCausalLM

    ckpt = make_qwen3_checkpoint(tmp_path / "plain", max_position_embeddings=256)
    _save_word_tokenizer(ckpt)
    hf = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bad = subprocess.run([sys.executable, "-m", "qwen_ops.serving.cli", "serve", str(ckpt), "--runner", "embed"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "runner = 'embed', expected one of" in bad.stderr, bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", str(ckpt), "--runner", "pooling",
                             "--port", "0", "--max-model-len", "128", "--served-model-name", NAME],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        port, seen = cli_server_port(proc)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        resp = c.embeddings.create(model=NAME, input=[words(PROMPTS[1]), PROMPTS[3]])
        for ids, d in zip((PROMPTS[1], PROMPTS[3]), resp.data):
            assert cosine_distance(d.embedding, oracle_embedding(hf, ids)) < COSINE_DISTANCE_FP32
        with pytest.raises(openai.BadRequestError, match="pooling model"):
            c.completions.create(model=NAME, prompt="w1", max_tokens=1)
    finally:
        stop_cli_server(proc)


def test_cancelled_embed_aborts_its_pooling_requests(ckpt, hf_lm):
    """A caller that goes away (a cancelled AsyncLLM.embed, as a client disconnect cancels the route)
    leaves nothing behind: no pooling request kept, every block free; the engine then serves on."""
    import asyncio

    engine = AsyncLLM(LLM(str(ckpt), **ENGINE_KWARGS))
    core = engine.llm.core

    async def cancel_then_embed():
        task = asyncio.ensure_future(engine.embed([{"prompt_token_ids": prompt(120, seed=s)} for s in range(16)]))
        await asyncio.sleep(0)            # the task has queued its 16 requests (about 120 steps of work)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.embed([{"prompt_token_ids": PROMPTS[2]}])

    try:
        (out,) = asyncio.run(cancel_then_embed())
        assert cosine_distance(out.outputs.embedding, oracle_embedding(hf_lm, PROMPTS[2])) < COSINE_DISTANCE_FP32
        assert wait_for(lambda: not core._pooling and not core.has_work())
        stats = engine.stats()
        assert stats["free_blocks"] == stats["total_blocks"]
        # Aborted, not run out: all 16 prompts would take 16 * 120 / 16 = 120 steps.
        assert stats["num_iterations"] < 60, stats["num_iterations"]
    finally:
        engine.shutdown()


def test_pooling_requests_are_counted_in_the_metrics(embed_server, rerank_server):
    """Each embedded input, and each scored pair, is a request of /metrics (vLLM counts pooling
    requests too): finished "stop", its prompt tokens counted, none generated."""
    from server_fixture import scrape

    server, _ = embed_server
    key = "vllm:request_success_total{finished_reason=stop}"
    for srv, path, body, requests, tokens in (
            (server, "/v1/embeddings", {"model": NAME, "input": PROMPTS[:3]}, 3, sum(map(len, PROMPTS[:3]))),
            (rerank_server, "/v1/score", {"model": NAME, "text_1": words(PROMPTS[0]),
                                          "text_2": [words(PROMPTS[1]), words(PROMPTS[2])]}, 2, None)):
        before = scrape(srv.url)
        r = post(srv, path, body)
        assert r.status_code == 200, r.text
        after = scrape(srv.url)
        assert after[key] - before.get(key, 0.0) == requests
        added = after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0.0)
        assert added == (tokens if tokens is not None else r.json()["usage"]["prompt_tokens"])
        assert after.get("vllm:generation_tokens_total", 0.0) == before.get("vllm:generation_tokens_total", 0.0)

