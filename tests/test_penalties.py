"""Issue 30, offline API: penalties and logits filters with vLLM's semantics (``SamplingParams``),
``LLM.chat``, ``get_tokenizer`` and vLLM's dict prompts.

Oracles: transformers' own logits processors (repetition penalty, min-p) and ``generate`` with
them; for frequency / presence penalties, whose formula vLLM documents and transformers does not
ship, the formula written out in the test over transformers' logits, one token at a time.
"""

from __future__ import annotations

import random

import pytest
import torch

from qwen_ops.engine.sampling import SamplingParams, apply_logits_processing, filtered_probs
from qwen_ops.serving.llm import LLM

from checkpoints import make_qwen3_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("penalties"))
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def fresh_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def test_repetition_penalty_matches_transformers_processor():
    """Random logits and token histories: vLLM's repetition penalty (prompt and output tokens) is
    transformers' RepetitionPenaltyLogitsProcessor over prompt + output."""
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = random.Random(0)
    vocab = 50
    logits = fresh_logits(6, vocab, 1)
    params, hist = [], []
    for i in range(6):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        params.append(SamplingParams(repetition_penalty=[1.0, 1.3, 0.7, 2.0, 1.1, 1.5][i]))
        hist.append((prompt, output))
    got = apply_logits_processing(logits, params, hist)
    for i, (p, (prompt, output)) in enumerate(zip(params, hist)):
        proc = RepetitionPenaltyLogitsProcessor(p.repetition_penalty) if p.repetition_penalty != 1.0 else None
        want = logits[i:i + 1].clone() if proc is None else proc(torch.tensor([prompt + output]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=1e-6)
    assert got is not logits and torch.equal(got[0], logits[0])          # the 1.0 row untouched


def test_frequency_and_presence_penalties_follow_the_formula():
    """logit - frequency_penalty * count(output) - presence_penalty * [count > 0]; prompt tokens do
    not count (vLLM's definition); written out per token."""
    vocab = 20
    logits = fresh_logits(3, vocab, 2)
    hist = [([1, 2, 3], [4, 4, 4, 5]), ([4, 4], [6]), ([7], [])]
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(frequency_penalty=-1.0), SamplingParams(presence_penalty=2.0)]
    got = apply_logits_processing(logits, params, hist)
    for i, (p, (_, output)) in enumerate(zip(params, hist)):
        for t in range(vocab):
            c = output.count(t)
            want = float(logits[i, t]) - p.frequency_penalty * c - p.presence_penalty * (c > 0)
            assert abs(float(got[i, t]) - want) < 1e-5, (i, t)


def test_min_p_matches_transformers_warper():
    from transformers import MinPLogitsWarper

    logits = fresh_logits(4, 64, 3)
    for min_p in (0.05, 0.2, 0.6):
        got = filtered_probs(logits, [SamplingParams(temperature=1.0, min_p=min_p)] * 4)
        want = torch.softmax(MinPLogitsWarper(min_p)(None, logits.clone()), dim=-1)
        assert torch.equal(got > 0, want > 0), min_p                   # the same tokens kept
        torch.testing.assert_close(got / got.sum(-1, keepdim=True), want, rtol=1e-5, atol=1e-6)


def hf_loop(hf, prompt, n, step):
    """transformers' greedy continuation with ``step(logits, prompt, output)`` applied each token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            ids.append(int(step(logits, prompt, ids[len(prompt):]).argmax()))
    return ids[len(prompt):]


def test_engine_repetition_penalty_equals_transformers_generate(tiny):
    path, hf = tiny
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [30, 31]]
    llm = LLM(path, check_invariants=True)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8))
    for p, o in zip(prompts, got):
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, repetition_penalty=1.8, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in got]   # it did something


def test_slot_api_repetition_penalty_equals_transformers_generate(tiny):
    """The seed's slot API builds its steps from the same ``Request`` as the scheduler, so the
    penalties read the slot's prompt and the tokens it was fed: single-slot and batch API alike."""
    from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine

    path, hf = tiny
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [30, 31]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        want.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, repetition_penalty=1.8, pad_token_id=0)[0, len(p):].tolist())
    engine = QwenEngine.from_pretrained(path, max_slots=3, max_seq_len=64, block_size=4, chunk_size=3)
    reqs = [QwenBatchedRequest(i, p, i, sp) for i, p in enumerate(prompts)]
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        engine.batch_decode_step(reqs)
    assert [r.generated_tokens for r in reqs] == want
    assert [r.finish_reason for r in reqs] == ["length"] * 3
    assert [r.seq_len for r in reqs] == [len(p) + 11 for p in prompts]   # the last token is not fed
    tokens = [engine.prefill(prompts[1], slot_id=1, sampling=sp).next_token]
    while len(tokens) < 12:
        tokens.append(engine.decode_step(tokens[-1], slot_id=1, sampling=sp).next_token)
    assert tokens == want[1]


def test_slot_api_min_tokens_and_stop_tokens_as_transformers(tiny):
    """``min_tokens`` keeps a stop token out until then; the batch API finishes on it after."""
    from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine

    path, hf = tiny
    prompt = [12, 13, 14, 15]
    ids = torch.tensor([prompt])
    plain = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=64, block_size=4)
    reasons = []
    for stop in dict.fromkeys(plain):          # tokens greedy decoding reaches at once
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=5,
                           do_sample=False, eos_token_id=stop, pad_token_id=0)[0, len(prompt):].tolist()
        want = want[:want.index(stop) + 1] if stop in want else want
        req = QwenBatchedRequest(0, prompt, 1, SamplingParams(temperature=0, max_tokens=24, min_tokens=5,
                                                              stop_token_ids=[stop], ignore_eos=True))
        engine.batch_prefill([req])
        while not req.finished:
            engine.batch_decode_step([req])
        assert req.generated_tokens == want
        assert stop not in want[:5]
        reasons.append(req.finish_reason)
        assert req.finish_reason == ("stop" if want[-1] == stop else "length")
    assert "stop" in reasons, reasons          # the case is exercised


def test_engine_frequency_and_presence_penalties_equal_the_formula(tiny):
    path, hf = tiny
    prompts = [[5, 6, 7, 8, 5, 6, 7], [40, 41, 42]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    got = LLM(path, check_invariants=True).generate(prompts, sp)

    def penalize(logits, prompt, output):
        out = logits.clone()
        for t in set(output):
            out[t] -= 1.5 * output.count(t) + 0.5
        return out

    assert [o.outputs[0].token_ids for o in got] == [hf_loop(hf, p, 10, penalize) for p in prompts]


def test_logit_bias_and_allowed_token_ids(tiny):
    path, _ = tiny
    llm = LLM(path, check_invariants=True)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={17: 100.0}))[0].outputs[0].token_ids
    assert out == [17] * 6
    allowed = [20, 21, 22]
    for sp in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
               SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)):
        toks = llm.generate([[5, 6, 7], [40]], sp)
        assert all(t in allowed for o in toks for t in o.outputs[0].token_ids)


def test_bad_words_are_never_completed():
    """The embedded model says "function" in its greedy docstring; with bad_words=["function"]
    no output text contains it, and the first tokens before it are unchanged."""
    llm = LLM()
    plain = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    assert "function" in plain
    text = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=48,
                                                            bad_words=["function"]))[0].outputs[0].text
    assert "function" not in text
    cut = plain.index("function")
    assert text[:cut] == plain[:cut]


@pytest.mark.parametrize("kwargs,match", [
    (dict(repetition_penalty=0.0), r"repetition_penalty = 0.0, expected a number in \(0.0, inf\]"),
    (dict(presence_penalty=2.5), r"presence_penalty = 2.5, expected a number in \[-2.0, 2.0\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty = nan"),
    (dict(min_p=1.5), r"min_p = 1.5, expected a number in \[0.0, 1.0\]"),
    (dict(logit_bias={3: 200}), r"logit_bias\[3\] = 200, expected a number in \[-100.0, 100.0\]"),
    (dict(logit_bias={"x": 1}), r"logit_bias key 'x', expected a token id"),
    (dict(allowed_token_ids=[]), r"allowed_token_ids = \[\], expected a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), r"allowed_token_ids\[1\] = -2"),
    (dict(bad_words="no"), r"bad_words = 'no', expected a list of str"),
    (dict(bad_words=[" "]), r"bad_words\[0\] = ' ', expected a non-empty str"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_token_ids_past_the_vocabulary_are_refused(tiny):
    path, _ = tiny
    llm = LLM(path)
    with pytest.raises(ValueError, match=r"logit_bias key 500, expected a token id < vocab_size = 128"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={500: 1.0}))
    with pytest.raises(ValueError, match=r"allowed_token_ids has 128, expected token ids < vocab_size = 128"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[3, 128]))
    with pytest.raises(ValueError, match=r"bad_words = \['x'\], but the checkpoint has no tokenizer.json"):
        llm.generate([[1, 2]], SamplingParams(bad_words=["x"]))
    assert llm.stats()["num_running"] == 0


def test_chat_uses_the_servers_template_and_dict_prompts_work():
    """LLM.chat renders with the server's ChatTemplate and tokenizes without special tokens: the
    same tokens as generate on that rendering; vLLM's {'prompt_token_ids': ...} and {'prompt': ...}
    prompts are accepted; get_tokenizer is the checkpoint's tokenizer."""
    from qwen_ops.serving.openai.chat import ChatTemplate

    llm = LLM()
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer and tok is not None
    messages = [{"role": "user", "content": "Write a function that returns the sum of a list."}]
    sp = SamplingParams(temperature=0, max_tokens=24)
    chat = llm.chat(messages, sp)[0].outputs[0]
    text = ChatTemplate.for_checkpoint(llm.model_path).render(messages)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0].token_ids == chat.token_ids
    assert llm.generate({"prompt": "def f(x):"}, sp)[0].outputs[0].text == \
        llm.generate("def f(x):", sp)[0].outputs[0].text
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "def f(xs):"},
                                          {"role": "user", "content": "Shorter."}]], sp)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat.token_ids
    with pytest.raises(ValueError, match=r"prompts\[0\] is a dict with keys \['ids'\], expected exactly"):
        llm.generate({"ids": [1]}, sp)
    with pytest.raises(ValueError, match=r"messages = 'hi', expected a list of"):
        llm.chat("hi", sp)
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['messages'\]"):
        llm.chat(messages, sp, chat_template_kwargs={"messages": []})
