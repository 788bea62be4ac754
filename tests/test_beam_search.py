"""Issue 44 item 2: ``LLM.beam_search`` as vLLM's, on the paged cache.

Oracles: transformers' ``generate(num_beams=k, num_return_sequences=k)`` where its search and
vLLM's agree (no EOS: a beam never stops early), and, for EOS and the length penalty, a float64
beam search over transformers' logits written out here (vLLM's rule: the ``k`` best extensions by
cumulative log-probability over ``len(tokens) ** length_penalty``; a beam ending in EOS is complete).
"""

from __future__ import annotations

import pytest
import torch

from qwen_ops import LLM, BeamSearchParams, SamplingParams

from checkpoints import make_qwen3_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")

PROMPTS = [[5, 6, 7, 8], [30, 31, 32], [100, 3, 17, 44, 9, 61, 2, 77, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("beam"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], block_size=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_equals_transformers_without_eos(tiny, llm, width):
    _, hf = tiny
    hf.generation_config.eos_token_id = None          # its beams never stop early, nor do ours (ignore_eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        ids = torch.tensor([p])
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                        max_new_tokens=10, do_sample=False, length_penalty=0.0, early_stopping=False,
                        output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        assert [s.tokens[len(p):] for s in o.sequences] == [s[len(p):].tolist() for s in g.sequences]
        if width > 1:
            torch.testing.assert_close(torch.tensor([s.cum_logprob for s in o.sequences]), g.sequences_scores,
                                       atol=1e-4, rtol=0)
        for s in o.sequences:
            assert s.tokens[:len(p)] == p and s.finish_reason == "length"
            assert abs(sum(e[t].logprob for e, t in zip(s.logprobs, s.tokens[len(p):])) - s.cum_logprob) < 1e-6


def reference_beam_search(hf, prompt, width, max_tokens, eos, length_penalty):
    """vLLM's beam search in float64 over transformers' logits: each live beam's ``2 * width`` most
    likely extensions; every one ending in EOS is complete, the ``width`` best of the others live on."""
    def key(seq):
        tokens, cum = seq
        n = len(tokens) - (1 if tokens[-1] in eos else 0)
        return cum / n ** length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        cands = []
        for tokens, cum in live:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].double(), -1)
            for t in lp.topk(2 * width).indices.tolist():
                (done if t in eos else cands).append((tokens + [t], cum + lp[t].item()))
        live = sorted(cands, key=key, reverse=True)[:width]
    return sorted(done + live, key=key, reverse=True)[:width]


def test_beam_search_with_eos_and_length_penalty_equals_a_float64_search(tiny, llm):
    path, hf = tiny
    eos = frozenset(llm.engine.eos_token_ids)
    assert eos == {1}
    # A prompt whose beams do reach EOS within 12 tokens (found by the reference, so the case is real).
    g = torch.Generator().manual_seed(11)
    candidates = [PROMPTS[2]] + [torch.randint(2, 128, (9,), generator=g).tolist() for _ in range(30)]
    prompts = [p for p in candidates if any(s[0][-1] in eos for s in reference_beam_search(hf, p, 3, 12, eos, 0.0))]
    prompts = prompts[:2]
    assert prompts, "no prompt reaches EOS: the case is not exercised"
    for lp in (1.0, 0.0, 2.0):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=lp))
        for p, o in zip(prompts, outs):
            want = reference_beam_search(hf, p, 3, 12, eos, lp)
            assert [s.tokens for s in o.sequences] == [w[0] for w in want], lp
            for s, (_, cum) in zip(o.sequences, want):
                assert abs(s.cum_logprob - cum) < 1e-4
                assert s.finish_reason == ("stop" if s.tokens[-1] in eos else "length")


def test_fork_slot_shares_full_blocks_and_copies_the_partial_one(tiny):
    """What beams stand on: a forked slot shares its source's full blocks (one more reference,
    no copy) and gets its own copy of the partial block; both then continue apart, each giving
    transformers' logits for its own tokens."""
    from qwen_ops import QwenEngine
    from qwen_ops.engine.batch import BatchedRequest

    path, hf = tiny
    engine = QwenEngine.from_pretrained(path, max_slots=3, max_seq_len=64, block_size=4)
    prompt = list(range(40, 50))                               # 10 tokens: 2 full blocks and 2 in a third
    engine.prefill(prompt, slot_id=0)
    engine.fork_slot(0, 1)
    src, dst = engine.slot_blocks(0), engine.slot_blocks(1)
    assert dst[:2] == src[:2] and dst[2] != src[2]             # full blocks shared, the partial one copied
    assert [engine.allocator.ref_count(b) for b in src[:3]] == [2, 2, 1]
    for slot, token in ((0, 7), (1, 9)):                       # they go on apart
        engine.reserve(slot, 11)
        logits = engine.execute([BatchedRequest(slot, [token], 10, is_prefill=False)])[0]
        with torch.no_grad():
            want = hf(torch.tensor([prompt + [token]])).logits[0, -1]
        torch.testing.assert_close(logits, want, atol=2e-5, rtol=0)
    engine.free_slot(0)
    assert [engine.allocator.ref_count(b) for b in dst[:2]] == [1, 1]
    engine.check_block_accounting()
    with pytest.raises(ValueError, match="dst_slot = 1 is src_slot"):
        engine.fork_slot(1, 1)
    with pytest.raises(ValueError, match="src_slot = 2 holds no sequence"):
        engine.fork_slot(2, 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width = 0"), ({"beam_width": 11, "max_tokens": 4}, "beam_width = 11"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens = 0"), ({"beam_width": 2, "max_tokens": 4, "temperature": -1},
                                                               "temperature = -1"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty = nan"),
])
def test_bad_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_text_is_the_whole_sequence_decoded():
    """On the embedded model (it has a tokenizer): each sequence's text is vLLM's offline one, all its
    tokens decoded, prompt included (transformers' tokenizer is the oracle), special tokens (a
    final EOS) skipped unless skip_special_tokens=False."""
    from qwen_ops.models.defaults import default_model_path

    hf_tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    llm = LLM(None, max_model_len=256)
    prompt = "def add(a, b):"
    for skip in (True, False):
        (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=24, skip_special_tokens=skip))
        for s in out.sequences:
            assert s.tokens[:len(hf_tok(prompt).input_ids)] == hf_tok(prompt).input_ids
            assert s.text == hf_tok.decode(s.tokens, skip_special_tokens=skip)
            assert s.text.startswith(prompt)


def test_served_use_beam_search_equals_transformers():
    """vLLM's ``use_beam_search`` on /v1/completions (n = the beam width), the embedded model,
    through the server's engine: the n sequences transformers' beam search finds, best first."""
    import httpx

    from qwen_ops.models.defaults import default_model_path
    from server_fixture import SERVED_NAME, make_engine, running_server

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    engine = make_engine()
    try:
        with running_server(engine) as srv:
            prompt = engine.tokenizer.encode("def fibonacci(n):")
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 12, "n": 3, "use_beam_search": True,
                    "ignore_eos": True, "length_penalty": 0.0}
            r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            assert r.json()["usage"]["completion_tokens"] == 36
            ids = torch.tensor([prompt])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                            max_new_tokens=12, do_sample=False, length_penalty=0.0, early_stopping=False, pad_token_id=0)
            assert texts == [engine.tokenizer.decode(s[len(prompt):].tolist()) for s in g]
            bad = httpx.post(srv.base_url + "/completions", json={**body, "stream": True}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"
            bad = httpx.post(srv.base_url + "/completions", json={**body, "n": 11}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "n", bad.text
            # Chat: the rendered prompt (the server's own /tokenize), searched the same way.
            messages = [{"role": "user", "content": "Write a function."}]
            chat_ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
            r = httpx.post(srv.base_url + "/chat/completions", timeout=120, json={
                "model": SERVED_NAME, "messages": messages, "max_tokens": 8, "n": 2, "use_beam_search": True,
                "ignore_eos": True, "length_penalty": 0.0})
            assert r.status_code == 200, r.text
            ids = torch.tensor([chat_ids])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, num_return_sequences=2,
                            max_new_tokens=8, do_sample=False, length_penalty=0.0, early_stopping=False, pad_token_id=0)
            assert [c["message"]["content"] for c in r.json()["choices"]] == \
                [engine.tokenizer.decode(s[len(chat_ids):].tolist()) for s in g]
            bad = httpx.post(srv.base_url + "/chat/completions", timeout=30, json={
                "model": SERVED_NAME, "messages": messages, "n": 2, "use_beam_search": True,
                "response_format": {"type": "json_object"}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"
    finally:
        engine.shutdown()


def test_a_prompt_never_holds_more_than_beam_width_slots(tiny):
    """Slots are freed before forks: with exactly beam_width free slots the search still runs
    (a fork before the frees would need up to 2 * width - 1)."""
    llm = LLM(tiny[0], block_size=4, max_num_seqs=4)
    (out,) = llm.beam_search([{"prompt_token_ids": PROMPTS[2]}],
                             BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    assert len(out.sequences) == 4
    assert all(not s.active and s.owner is None for s in llm.engine.kv.slots)
    llm.engine.check_block_accounting()


def test_out_of_blocks_is_a_clear_error_and_frees_the_slots(tiny):
    llm = LLM(tiny[0], block_size=4, max_model_len=64, num_kv_blocks=16, max_num_seqs=8)
    prompt = list(range(10, 50))                           # 10 of the 16 blocks
    with pytest.raises(RuntimeError, match="out of KV blocks for beam search"):
        llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True))
    assert all(not s.active and s.owner is None for s in llm.engine.kv.slots)
    llm.engine.check_block_accounting()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)   # it still serves
    assert len(out[0].outputs[0].token_ids) == 4


def test_hybrid_model_beam_search_equals_transformers(tmp_path):
    """A model with linear-attention layers (its per-slot state cannot be forked) searches through
    one-token requests: the same sequences as transformers' beam search."""
    from checkpoints import make_qwen3_5_checkpoint

    path = make_qwen3_5_checkpoint(tmp_path / "hybrid")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(path, block_size=4)
    assert "linear" in llm.engine.runner.layer_kinds
    prompt = [5, 6, 7, 8, 9]
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}],
                             BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True, length_penalty=0.0))
    ids = torch.tensor([prompt])
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, num_return_sequences=2, max_new_tokens=6,
                    do_sample=False, length_penalty=0.0, early_stopping=False, pad_token_id=0)
    assert [s.tokens[len(prompt):] for s in out.sequences] == [s[len(prompt):].tolist() for s in g]
