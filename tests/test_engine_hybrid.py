"""Qwen3.5 hybrid models through the engine and the scheduler: slots own their linear-layer state.

prefill restarts it, chunked prefill continues it, recompute preemption rebuilds it, swap moves
it to host memory and back, and compiled decode traces it with no graph break.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo

from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
from qwen_ops.serving.llm import LLM
from qwen_ops.engine.sampling import SamplingParams

from checkpoints import make_qwen3_5_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5_engine"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(2, 128) for _ in range(rng.randrange(2, 15))] for _ in range(6)]


def single(engine, prompt, n, slot=0):
    toks = [engine.prefill(prompt, slot_id=slot).next_token]
    while len(toks) < n:
        toks.append(engine.decode_step(toks[-1], slot_id=slot).next_token)
    return toks


@pytest.fixture(scope="module")
def expected(ckpt, prompts):
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_new_tokens,
                              min_new_tokens=GREEDY.max_new_tokens, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def test_engine_matches_transformers_and_restarts_state(ckpt, prompts, expected):
    eng = QwenEngine.from_pretrained(ckpt, max_slots=4, max_seq_len=64, block_size=4)
    assert [single(eng, p, GREEDY.max_new_tokens) for p in prompts] == expected   # slot 0 reused: prefill restarts
    assert single(eng, prompts[0], 12, slot=3) == expected[0]


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_chunked_prefill_continues_state(ckpt, prompts, expected, chunk_size):
    eng = QwenEngine.from_pretrained(ckpt, max_slots=4, max_seq_len=64, block_size=4, chunk_size=chunk_size)
    assert [single(eng, p, GREEDY.max_new_tokens) for p in prompts[:3]] == expected[:3]


def test_batched_equals_single_and_freed_slot_is_fresh(ckpt, prompts, expected):
    eng = QwenEngine.from_pretrained(ckpt, max_slots=6, max_seq_len=64, block_size=4)
    reqs = [QwenBatchedRequest(i, p, i, GREEDY) for i, p in enumerate(prompts)]
    eng.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        eng.batch_decode_step(reqs[::-1])
    assert [r.generated_tokens for r in reqs] == expected
    eng.free_slot(2)
    assert single(eng, prompts[5], 12, slot=2) == expected[5]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_equal_uninterrupted(ckpt, prompts, expected, mode):
    llm = LLM(ckpt, max_num_seqs=6, max_model_len=64, block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
              preemption_mode=mode, check_invariants=True)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swaps_out"] > 0) == (mode == "swap")
    assert stats["free_blocks"] == stats["total_blocks"]


def test_compiled_decode_has_no_graph_break(ckpt, prompts, expected):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = QwenEngine.from_pretrained(ckpt, max_slots=4, max_seq_len=64, block_size=4, compile=True,
                                     decode_buckets=[1, 4])
    reqs = [QwenBatchedRequest(i, p, i, GREEDY) for i, p in enumerate(prompts[:3])]
    eng.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        eng.batch_decode_step(reqs)
    assert [r.generated_tokens for r in reqs] == expected[:3]
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_allocate_batch_slots_grows_linear_state(ckpt, prompts, expected):
    eng = QwenEngine.from_pretrained(ckpt, max_slots=1, max_seq_len=64, block_size=4)
    eng.allocate_batch_slots(3)
    assert single(eng, prompts[1], 12, slot=2) == expected[1]
