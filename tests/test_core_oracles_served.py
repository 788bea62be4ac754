"""Issue 61 item 7, served: tests/test_core_oracles.py's oracles through the OpenAI-compatible server
(``qwen_ops.serving.openai``, live on 127.0.0.1, the official ``openai`` client), on the routes that
reach each path: top-p on both sampler paths, prompt_logprobs and beam search with a length penalty
on ``/v1/completions``, and mean pooling on ``/v1/embeddings`` against transformers' mean of the last
hidden states over every token.

The tiny checkpoints get a word-level tokenizer (token i is ``w<i>``), so a reply's text maps back to
token ids.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.llm import LLM

from checkpoints import make_qwen3_checkpoint, save_word_tokenizer
from server_fixture import CLIENT_TIMEOUT_S, running_server
from test_core_oracles import (BEAM_TOKENS, BEAM_WIDTH, EOS, LENGTH_PENALTIES, LOGPROB_ATOL, NUM_SAMPLES, PROMPT_TOP,
                               TEMPERATURE, TOP_P_PATHS, VOCAB, assert_top_p_samples, pick_top_p_prompt)
from test_core_oracles import beam_cases, ckpt, eos_ckpt  # noqa: F401  (the fixtures, instantiated here again)

NAME = "tiny"
ENGINE_KWARGS = dict(max_model_len=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=16)
PER_REQUEST = 125             # completions per request (the server caps n at OpenAI's 128)


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=CLIENT_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def served(eos_ckpt):
    """A generation server over the EOS-heavy tiny checkpoint (the engine loop on a thread of this process)."""
    path, _ = eos_ckpt
    save_word_tokenizer(path, VOCAB)
    engine = AsyncLLM(LLM(str(path), **ENGINE_KWARGS))
    with running_server(engine, served_model_name=NAME) as server:
        yield client_of(server)
    engine.shutdown()


@pytest.fixture(scope="module")
def eos_oracle(eos_ckpt):
    from oracles import TransformersGreedy

    return TransformersGreedy(eos_ckpt[0])


@pytest.mark.parametrize("path", ["c_kernel", "torch_top_k"])
def test_top_p_served_keeps_the_crossing_token(served, eos_oracle, path):
    """``/v1/completions`` with top_p (and top_k, vLLM's extra field) samples transformers' float64
    top-p set, the token crossing p included, at its renormalized frequencies."""
    filters = TOP_P_PATHS[path]
    prompt, (p, kept, q) = pick_top_p_prompt(eos_oracle, **filters)
    tokens = []
    for r in range(NUM_SAMPLES // PER_REQUEST):
        # completion i of a request draws with seed + i: requests PER_REQUEST seeds apart share none
        resp = served.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=TEMPERATURE, top_p=p,
                                         n=PER_REQUEST, seed=1234 + r * PER_REQUEST, extra_body=filters)
        tokens += [ids_of(c.text)[0] for c in resp.choices]
    assert len(tokens) == NUM_SAMPLES
    assert_top_p_samples(tokens, kept, q)


def test_prompt_logprobs_served_equal_transformers(served, eos_oracle):
    """vLLM's ``prompt_logprobs`` field of a completion: transformers' float64 log-softmax, position by position."""
    prompts = [[5, 17, 99, 3, 42, 42, 8, 61, 70, 12, 33, 2, 90, 14, 27, 6, 55, 101, 19], [40, 41]]
    for prompt in prompts:
        resp = served.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0.0,
                                         extra_body={"prompt_logprobs": PROMPT_TOP})
        entries = resp.choices[0].prompt_logprobs
        with torch.no_grad():
            want = torch.log_softmax(eos_oracle.model(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)
        assert entries[0] is None and len(entries) == len(prompt)
        for i in range(1, len(prompt)):
            row, e = want[i - 1], {int(t): v for t, v in entries[i].items()}
            top = row.topk(PROMPT_TOP).indices.tolist()
            assert set(top) | {prompt[i]} == set(e), (i, top, sorted(e))
            for t in e:
                assert abs(e[t]["logprob"] - row[t].item()) < LOGPROB_ATOL, (i, t)
                assert e[t]["rank"] == int((row > row[t]).sum()) + 1


def test_beam_search_served_length_penalty_equals_transformers(served, beam_cases):
    """``use_beam_search`` with ``length_penalty`` (vLLM's extra fields; n is the beam width): where
    transformers' beam search and both float64 rules agree (tests/test_core_oracles.py), the first
    choice is transformers' best sequence, and a penalty that decides the answer is among them."""
    _, cases = beam_cases
    for lp in LENGTH_PENALTIES:
        agreed = [p for (p, l), (h, v, d) in cases.items() if l == lp and h == v == d]
        assert any(cases[p, lp][0] != cases[p, 1.0][0] for p in agreed), lp
        for p in agreed:
            resp = served.completions.create(model=NAME, prompt=list(p), max_tokens=BEAM_TOKENS, temperature=0.0,
                                             n=BEAM_WIDTH, extra_body={"use_beam_search": True, "length_penalty": lp})
            best = resp.choices[0]
            tokens = ids_of(best.text) + ([EOS] if best.finish_reason == "stop" else [])
            assert tokens == cases[p, lp][0], (p, lp, best)


# ------------------------------------------------------------------------------------------------
# mean pooling on /v1/embeddings
# ------------------------------------------------------------------------------------------------

MEAN_ATOL_FP32 = 1e-5         # an unnormalized mean of fp32 hidden states of order 1 (tests/test_embed.py's)


@pytest.fixture(scope="module")
def mean_pooling_server(tmp_path_factory):
    """A tiny checkpoint with sentence-transformers files asking for mean pooling and no Normalize
    module (so the served vector is the raw mean), served as a pooling model."""
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("core_oracles_mean"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
        "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "include_prompt": True}))
    engine = AsyncLLM(LLM(str(path), **ENGINE_KWARGS))
    assert engine.runner == "pooling"
    with running_server(engine, served_model_name=NAME) as server:
        yield path, client_of(server)
    engine.shutdown()


def test_mean_pooling_served_is_the_mean_over_every_token(mean_pooling_server):
    """Prompts of 1 token, inside a block, across prefill chunks (16 tokens a step) and a block boundary:
    each embedding is transformers' final-norm hidden states averaged over all the prompt's rows, in
    float64, the last row included."""
    from transformers import Qwen3ForCausalLM

    path, client = mean_pooling_server
    decoder = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").model.eval()
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (1, 2, 7, 16, 17, 40)]
    resp = client.embeddings.create(model=NAME, input=prompts, encoding_format="float")
    assert [d.index for d in resp.data] == list(range(len(prompts)))
    for ids, d in zip(prompts, resp.data):
        with torch.no_grad():
            want = decoder(torch.tensor([ids])).last_hidden_state[0].double().mean(dim=0)
        torch.testing.assert_close(torch.tensor(d.embedding, dtype=torch.float64), want, atol=MEAN_ATOL_FP32, rtol=0)
