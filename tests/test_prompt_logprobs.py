"""Issue 44 item 1: a prompt's own tokens scored (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with
``logprobs``), offline and served.

Oracle: transformers' log-softmax (float64) over the same checkpoint's logits, position by position:
entry ``i`` of ``prompt_logprobs`` is the log-probability of prompt token ``i`` given the tokens
before it, its rank among all tokens, and the top ones.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from qwen_ops import LLM, SamplingParams
from qwen_ops.models.defaults import default_model_path

from checkpoints import make_qwen3_checkpoint
from server_fixture import CLIENT_TIMEOUT_S, SERVED_NAME, make_engine, running_server

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float64 log-softmax: row i scores prompt token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1)


def check_entries(entries, prompt: list[int], want: torch.Tensor, k: int, atol: float = 1e-4) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for i in range(1, len(prompt)):
        row, tok, e = want[i - 1], prompt[i], entries[i]
        assert abs(e[tok].logprob - row[tok].item()) < atol, (i, e[tok].logprob, row[tok].item())
        assert e[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(e) and len(e) <= k + 1, (i, top, list(e))
        for t in top:
            assert abs(e[t].logprob - row[t].item()) < atol


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("prompt_logprobs"))
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_prompt_logprobs_match_transformers_chunked_cached_and_n(tiny):
    """Chunked prefill (a budget of 8 tokens), two completions (the prompt is scored once), and a
    prefix the cache already holds: the scoring request still gets every position."""
    path, hf = tiny
    llm = LLM(path, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True, check_invariants=True)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [shared + [14, 15, 16], [3, 4, 5], shared + [20, 21], [40]]
    llm.generate([shared + [30, 31]], SamplingParams(temperature=0, max_tokens=2))     # caches the prefix
    hits = llm.engine.prefix_cache_hits
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, n=2))
    for p, o in zip(prompts, outs):
        check_entries(o.prompt_logprobs, p, hf_prompt_logprobs(hf, p), 3)
        assert all(len(c.token_ids) == 3 for c in o.outputs)
    assert llm.engine.prefix_cache_hits > hits        # the completions that do not score used the cache
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3))
    assert plain[0].prompt_logprobs is None
    assert plain[0].outputs[0].token_ids == outs[0].outputs[0].token_ids      # scoring changes no token


def test_long_prompt_scored_in_row_chunks_matches_transformers(tiny, monkeypatch):
    """300 rows: token_logprobs scores them a cache-sized chunk at a time; every row is still its own."""
    from qwen_ops.engine.sampling import LOGPROB_CHUNK_BYTES

    path, hf = tiny
    prompt = torch.randint(2, 128, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    monkeypatch.setattr("qwen_ops.engine.sampling.LOGPROB_CHUNK_BYTES", 4 * 128 * 64)      # 64 rows of 128
    assert len(prompt) > 4 * 64 and LOGPROB_CHUNK_BYTES > 4 * 128 * 64
    out = LLM(path).generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    check_entries(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 2)


def test_prompt_logprobs_beside_speculative_decodes(tiny):
    """A scored prompt chunked over steps whose other rows are decodes verifying n-gram drafts:
    its entries still come (the verify step scores them too), and its tokens stay transformers'."""
    path, hf = tiny
    llm = LLM(path, max_num_batched_tokens=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    loop = [7, 8, 9, 10] * 3                                  # repeats: n-gram lookup finds drafts
    scored = list(range(20, 50))                              # 30 tokens: 4+ steps at 8 a step
    outs = llm.generate([loop, scored], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                         SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)],
                        use_tqdm=False)
    assert llm.stats()["spec_num_drafts"] > 0
    check_entries(outs[1].prompt_logprobs, scored, hf_prompt_logprobs(hf, scored), 1)


def test_prompt_logprobs_zero_gives_the_prompt_token_only(tiny):
    path, hf = tiny
    out = LLM(path).generate([[7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    want = hf_prompt_logprobs(hf, [7, 8, 9, 10])
    for i, tok in enumerate([8, 9, 10], start=1):
        assert list(out.prompt_logprobs[i]) == [tok]
        assert abs(out.prompt_logprobs[i][tok].logprob - want[i - 1, tok].item()) < 1e-4


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "2"])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs = .*expected an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)


# ----------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def served():
    engine = make_engine()
    try:
        with running_server(engine) as srv:
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def hf_default():
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def _ids(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_echo_with_logprobs_scores_the_prompt_as_transformers(served, hf_default):
    """The official client, echo + logprobs (what lm-evaluation-harness sends), as token ids and text."""
    vocab = hf_default.config.vocab_size
    prompt = _ids(12, vocab)
    want = hf_prompt_logprobs(hf_default, prompt)
    with _client(served) as client:
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=2,
                                      temperature=0)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.token_logprobs) == len(prompt) + 1            # the prompt, then the generated token
        for i in range(1, len(prompt)):
            assert abs(lp.token_logprobs[i] - want[i - 1, prompt[i]].item()) < 1e-4
            assert max(lp.top_logprobs[i].values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        # max_tokens = 0: the prompt alone, scored, nothing generated
        r0 = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert r0.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
        assert r0.usage.completion_tokens == 0 and r0.choices[0].text == r.choices[0].text[:len(r0.choices[0].text)]
        # streamed: the first chunk carries the echoed prompt's logprobs
        chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=3, echo=True,
                                                logprobs=2, temperature=0, stream=True))
        streamed = [x for c in chunks for x in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
        assert streamed[:len(prompt)] == lp.token_logprobs[:len(prompt)]
        assert len(streamed) == len(prompt) + 3


def test_prompt_logprobs_field_in_vllm_shape(served, hf_default):
    vocab = hf_default.config.vocab_size
    prompt = _ids(9, vocab)
    want = hf_prompt_logprobs(hf_default, prompt)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0}
    r = httpx.post(served.base_url + "/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    for i in range(1, len(prompt)):
        entry = plp[i][str(prompt[i])]
        assert abs(entry["logprob"] - want[i - 1, prompt[i]].item()) < 1e-4
        assert entry["rank"] == int((want[i - 1] > want[i - 1, prompt[i]]).sum()) + 1
    chat = httpx.post(served.base_url + "/chat/completions", timeout=CLIENT_TIMEOUT_S, json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_logprobs"][0] is None and len(chat.json()["prompt_logprobs"]) > 1


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 0}, "max_tokens"),                         # no echo: nothing to return
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_bad_scoring_requests_are_400s_naming_the_field(served, body, field):
    r = httpx.post(served.base_url + "/completions", timeout=CLIENT_TIMEOUT_S,
                   json={"model": SERVED_NAME, "prompt": "def f(x):", **body})
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == field
