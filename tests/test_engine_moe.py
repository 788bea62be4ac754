"""Mixture-of-experts models (qwen3_moe, qwen3_next, qwen3_5_moe) through the engine and LLM.generate.

Greedy tokens equal transformers' ``generate`` over 32 steps through the seed's engine API
(``prefill`` / ``decode_step``, ``batch_prefill`` / ``batch_decode_step``) and through
``LLM.generate``, also when a small KV pool forces preemption (recompute, and swap for the
hybrids' slot state). On the CPU, qwen3_moe's layers take the fast ops (the routed experts on
packed weights, ``moe_packed``); the hybrid MoE models keep their plain forward.
"""

from __future__ import annotations

import random

import pytest
import torch

from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.llm import LLM

from checkpoints import make_moe_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
MODEL_TYPES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe_text"]
# per architecture: top-k and tying vary between them
OVERRIDES = {
    "qwen3_moe": dict(num_experts_per_tok=3, norm_topk_prob=True),
    "qwen3_next": dict(tie_word_embeddings=True),
    "qwen3_5_moe_text": dict(num_experts_per_tok=4),
}


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model_case(request, tmp_path_factory):
    """(checkpoint path, prompts, transformers' greedy continuations)."""
    model_type = request.param
    path = make_moe_checkpoint(tmp_path_factory.mktemp(model_type), model_type, seed=21,
                               **OVERRIDES[model_type])
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 128) for _ in range(rng.randrange(2, 15))] for _ in range(5)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    assert len({tuple(e) for e in expected}) == len(expected)
    return path, prompts, expected


def single(engine, prompt, n, slot=0):
    toks = [engine.prefill(prompt, slot_id=slot).next_token]
    while len(toks) < n:
        toks.append(engine.decode_step(toks[-1], slot_id=slot).next_token)
    return toks


def test_engine_single_and_batched_match_transformers(model_case):
    path, prompts, expected = model_case
    eng = QwenEngine.from_pretrained(path, max_slots=6, max_seq_len=64, block_size=4)
    assert [single(eng, p, NEW_TOKENS) for p in prompts[:2]] == expected[:2]
    reqs = [QwenBatchedRequest(i, p, i, GREEDY) for i, p in enumerate(prompts)]
    eng.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        eng.batch_decode_step(reqs)
    assert [r.generated_tokens for r in reqs] == expected


def test_llm_generate_matches_transformers(model_case):
    path, prompts, expected = model_case
    llm = LLM(path, max_num_seqs=4, max_model_len=64, block_size=4)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_llm_preemption_matches_transformers(model_case, mode):
    path, prompts, expected = model_case
    llm = LLM(path, max_num_seqs=5, max_model_len=64, block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
              preemption_mode=mode, check_invariants=True)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]


def test_engine_executor_for_moe(model_case):
    """qwen3_moe's layers on the fast ops (experts packed; the tokens above equal transformers'),
    the hybrid MoE models on their plain forward."""
    from qwen_ops.models.layers import forward_choices

    path, _, _ = model_case
    eng = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=64, block_size=4)
    choices = forward_choices(eng.model)
    assert set(choices.values()) == ({"cpu"} if "qwen3_moe" in path.name else {"native"}), choices


def test_compiled_decode_has_no_graph_break(model_case):
    """The engine's compiled decode step (Inductor) traces the router and fused_moe whole."""
    import torch._dynamo

    path, prompts, expected = model_case
    if "qwen3_moe" not in path.name:
        pytest.skip("one architecture is enough for the compile check (the MoE block is shared)")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = QwenEngine.from_pretrained(path, max_slots=4, max_seq_len=64, block_size=4, compile=True,
                                     decode_buckets=[1, 4])
    reqs = [QwenBatchedRequest(i, p, i, GREEDY) for i, p in enumerate(prompts[:3])]
    eng.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        eng.batch_decode_step(reqs)
    assert [r.generated_tokens for r in reqs] == expected[:3]
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
