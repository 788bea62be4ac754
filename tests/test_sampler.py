"""engine/sampler.py and the promise of a seed, end to end on the embedded model (issue 61 items 4, 5):

- a seed fixes the tokens whatever the batch, preemption (recompute, swap, prefix caching) or
  n-gram speculation: each run is compared with another run that differs only in that (the oracle
  that cannot share the bug: a roomy cache, speculation off, a fresh ``LLM`` of the same seed);
- a forked seeded slot draws what its source draws at each output position;
- isolation: a request whose parameters leave nothing to sample fails alone (offline, and served
  through the official ``openai`` client beside a request that succeeds), and a sampler failure on
  one row is retried row by row.
"""

from __future__ import annotations

import itertools
import threading

import openai
import pytest
import torch

from qwen_ops import LLM, QwenEngine, SamplingParams, default_model_path
from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.sampler import Sampler
from qwen_ops.engine.sampling import SeededNoise, sample

from server_fixture import CLIENT_TIMEOUT_S, SERVED_NAME, make_engine, running_server

MAX_MODEL_LEN = 256
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    """Prompts of the embedded model's own text, repetitive enough for n-gram drafts."""
    texts = ["The cat sat on the mat. The cat sat on the", "Once upon a time there was a little girl who",
             "One, two, three, four, one, two, three,", "She said hello and he said hello and they",
             "The sun rose over the hills and the birds sang", "A dog ran to the park and the dog ran"]
    return [llm.tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts)), add_special_tokens=False)
            for i in range(n)]


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


# ----------------------------------------------------------------------------- a seed fixes the tokens
def test_llm_seed_repeats_sampled_outputs_under_ngram_speculation():
    """Two fresh ``LLM(seed=S)`` with n-gram speculation give the same sampled tokens for requests
    without a seed (each gets a seed derived from S and its arrival), and they are the tokens of
    ``LLM(seed=S)`` without speculation: verification picks with the plain sampler's uniforms."""
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)

    def run(**kw):
        llm = LLM(max_model_len=MAX_MODEL_LEN, seed=1234, **kw)
        outs = _tokens(llm.generate(_prompts(llm, 6), params, use_tqdm=False))
        return outs, llm.stats()

    first, stats = run(speculative_config=SPEC)
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    again, _ = run(speculative_config=SPEC)
    plain, _ = run()
    assert again == first
    assert plain == first
    other = LLM(max_model_len=MAX_MODEL_LEN, seed=1235)
    assert _tokens(other.generate(_prompts(other, 6), params, use_tqdm=False)) != first


def test_a_forked_seeded_slot_draws_what_its_source_draws():
    """The slot API: a seeded sequence decodes a few tokens, is forked, and both are fed the same
    tokens: at every output position the fork samples the source's token (the noise is a function of
    the seed and the position; a fork once started its seed's stream over, then shared one stream)."""
    engine = QwenEngine.from_pretrained(default_model_path(), max_slots=2, max_seq_len=MAX_MODEL_LEN)
    sp = SamplingParams(temperature=1.0, seed=99, max_new_tokens=64)
    prompt = engine.tokenizer.encode("Once upon a time", add_special_tokens=False)
    token = engine.prefill(prompt, slot_id=0, sampling=sp).next_token
    for _ in range(3):
        token = engine.decode_step(token, slot_id=0, sampling=sp).next_token
    engine.fork_slot(0, 1)
    src, fork = [], []
    for _ in range(8):
        src.append(engine.decode_step(token, slot_id=0, sampling=sp).next_token)
        fork.append(engine.decode_step(token, slot_id=1, sampling=sp).next_token)
        token = src[-1]
    assert fork == src
    assert len(set(src)) > 1                      # sampled, not a constant


def _preemption_workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """12 prompts: greedy ones, seeded ones at temperature 0.8 (some n = 2) under each filter (top-p,
    top-k, min-p, none) so that rows with different filters share batches, and unseeded ones (seeded
    by ``LLM(seed=...)``). A min-p row beside a top-p row once kept only the tokens of the top-p
    row's search width (its tokens changed with its batch)."""
    prompts = _prompts(llm, 12)
    filters = itertools.cycle([dict(top_p=0.9), dict(min_p=0.02), dict(top_k=40), dict(min_p=0.01), {},
                               dict(top_k=50, top_p=0.95)])
    params = []
    for i in range(12):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        elif i % 4 == 3:
            params.append(SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, **next(filters)))
        else:
            params.append(SamplingParams(temperature=0.8, seed=100 + i, max_tokens=48, ignore_eos=True,
                                         n=2 if i % 3 == 1 else 1, **next(filters)))
    return prompts, params


@pytest.fixture(scope="module")
def roomy_outputs():
    llm = LLM(max_model_len=128, seed=7, num_kv_blocks=512, enable_prefix_caching=False)
    return _tokens(llm.generate(*_preemption_workload(llm), use_tqdm=False))


@pytest.mark.parametrize("mode, prefix_caching", [("recompute", False), ("recompute", True), ("swap", False),
                                                  ("swap", True)])
def test_seeded_requests_keep_their_tokens_under_preemption(roomy_outputs, mode, prefix_caching):
    """On a KV cache too small for the 12 requests at once (preempted again and again, batches of
    other shapes), every request's tokens equal the roomy run's."""
    llm = LLM(max_model_len=128, seed=7, num_kv_blocks=10, block_size=16, max_num_batched_tokens=128,
              preemption_mode=mode, enable_prefix_caching=prefix_caching, check_invariants=True)
    got = _tokens(llm.generate(*_preemption_workload(llm), use_tqdm=False))
    assert llm.stats()["num_preemptions"] > 0
    for i, (want, have) in enumerate(zip(roomy_outputs, got)):
        assert have == want, f"request {i}"


# ----------------------------------------------------------------------------- isolation
# Allowed tokens that bad_words then bans: nothing is left to sample, which only a step can see.
def _unsatisfiable(llm_tokenizer) -> SamplingParams:
    ids = llm_tokenizer.encode("world", add_special_tokens=False) + llm_tokenizer.encode(" world",
                                                                                         add_special_tokens=False)
    assert len(ids) == 2, ids                    # one token each: bad_words bans exactly these
    return SamplingParams(top_k=5, temperature=0.8, allowed_token_ids=ids, bad_words=["world"], max_tokens=8)


def test_a_request_with_nothing_to_sample_fails_alone_offline():
    """It finishes with "error" and a message naming its parameters; a request of the same step
    gets the tokens of its solo run (the whole step once failed: top-k indexed past the candidates
    of an all -inf row)."""
    llm = LLM(max_model_len=MAX_MODEL_LEN)
    ordinary = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    prompt = _prompts(llm, 1)[0]
    solo = llm.generate([prompt], ordinary, use_tqdm=False)[0].outputs[0].token_ids
    bad, good = llm.generate([prompt, prompt], [_unsatisfiable(llm.tokenizer), ordinary], use_tqdm=False)
    assert good.outputs[0].token_ids == solo and good.error is None
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "allowed_token_ids" in bad.error and "bad_words" in bad.error
    assert not llm.has_unfinished_requests() and llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_allowed_tokens_that_all_stop_under_min_tokens_are_refused():
    llm = LLM(max_model_len=MAX_MODEL_LEN)
    eos = sorted(llm.engine.eos_token_ids)
    with pytest.raises(ValueError, match=r"allowed_token_ids = \[0\] are all stop tokens .* min_tokens = 3"):
        llm.generate(["Hello"], SamplingParams(top_k=5, min_tokens=3, allowed_token_ids=[eos[0]]), use_tqdm=False)
    ok = llm.generate(["Hello"], SamplingParams(min_tokens=3, allowed_token_ids=[eos[0], 5], max_tokens=4,
                                                 temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert ok.token_ids[:3] == [5, 5, 5]


def test_a_failing_row_is_sampled_again_alone(monkeypatch):
    """If sampling a batch raises, its rows are sampled one by one: only the row that raises alone
    fails (a SamplingError for its task), the others get the tokens they get without the failure."""
    import qwen_ops.engine.sampler as S

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [SamplingParams(temperature=0.9, seed=s) for s in (1, 666, 3, 4)]
    tasks = [BatchedRequest(i, [1], 0, None, False, sampling=p, generator=p.make_generator(), output_index=2)
             for i, p in enumerate(params)]
    want = sample(logits, params, [p.make_generator() for p in params], [2] * 4).tolist()

    def poisoned(x, ps, noises, positions, purpose=0):
        if any(p.seed == 666 for p in ps):
            raise RuntimeError("poisoned row")
        return sample(x, ps, noises, positions, purpose)

    monkeypatch.setattr(S, "sample", poisoned)
    sampled, _, errors = Sampler(50).sample_rows(tasks, logits)
    assert sampled == [want[0], None, want[2], want[3]]
    assert errors[1] is not None and "poisoned row" in errors[1].message and not errors[1].bad_request
    assert errors[0] is errors[2] is errors[3] is None


def test_served_request_with_nothing_to_sample_is_a_400_beside_one_that_succeeds():
    """Served: the bad request gets a 400 naming its parameters, while a streamed request running in
    the same steps finishes with its tokens; so does a request refused up front (allowed tokens all
    EOS under min_tokens)."""
    engine = make_engine()
    try:
        with running_server(engine) as srv, openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0,
                                                         timeout=CLIENT_TIMEOUT_S) as client:
            bad = _unsatisfiable(engine.tokenizer)
            started = threading.Event()
            texts: list[str] = []

            def ordinary():
                stream = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=48,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                for chunk in stream:
                    started.set()
                    texts.append(chunk.choices[0].text)

            worker = threading.Thread(target=ordinary)
            worker.start()
            assert started.wait(CLIENT_TIMEOUT_S)
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=8, temperature=0.8, top_p=1.0,
                                          extra_body={"top_k": 5, "allowed_token_ids": list(bad.allowed_token_ids),
                                                      "bad_words": ["world"]})
            assert "no token can be sampled" in str(info.value) and "allowed_token_ids" in str(info.value)
            with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
                client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=8,
                                          extra_body={"top_k": 5, "min_tokens": 3, "allowed_token_ids": [0]})
            worker.join(CLIENT_TIMEOUT_S)
            offline = LLM(max_model_len=512)
            greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            want = offline.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].text
            assert "".join(texts) == want
    finally:
        engine.shutdown()
