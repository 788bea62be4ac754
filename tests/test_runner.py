"""Compiled decode: no graph breaks, no recompiles across buckets, the same greedy tokens as eager
and as transformers (the outside oracle)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
from qwen_ops.serving.llm import LLM
from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.inputs import decode_buckets
from qwen_ops.engine.sampling import SamplingParams

from checkpoints import make_qwen3_checkpoint
from oracles import TransformersGreedy

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38], [2, 71], [82, 81, 28, 30, 33, 27], [5, 9, 100],
           [44, 45, 46, 47], [120, 7]]


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_runner"))


@pytest.fixture(scope="module")
def oracle(ckpt):
    return TransformersGreedy(ckpt)


@pytest.fixture(scope="module")
def engines(ckpt):
    kw = dict(max_slots=8, max_seq_len=64, block_size=4, decode_buckets=[1, 2, 4, 8])
    return QwenEngine.from_pretrained(ckpt, compile=False, **kw), QwenEngine.from_pretrained(ckpt, compile=True, **kw)


def batch_tokens(engine, prompts):
    reqs = [QwenBatchedRequest(request_id=i, prompt_tokens=p, slot_id=i, sampling=GREEDY) for i, p in enumerate(prompts)]
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        engine.batch_decode_step(reqs)
    return [r.generated_tokens for r in reqs]


def test_compiled_equals_eager_without_breaks_or_recompiles(engines, oracle):
    eager, compiled = engines
    expected = [oracle(p, GREEDY.max_new_tokens) for p in PROMPTS]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    # Warm-up: batch 1 and one bucket above 1 compile the two graphs.
    assert batch_tokens(compiled, PROMPTS[:1]) == batch_tokens(eager, PROMPTS[:1]) == expected[:1]
    assert batch_tokens(compiled, PROMPTS[:3]) == batch_tokens(eager, PROMPTS[:3]) == expected[:3]
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2
    # Every other size within the buckets reuses them: no recompilation, no graph break.
    for n in (2, 5, 7, 4, 1, 6):
        assert batch_tokens(compiled, PROMPTS[:n]) == batch_tokens(eager, PROMPTS[:n]) == expected[:n], n
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0


def test_padding_rows_write_nothing(engines):
    _, compiled = engines
    for s in range(2):
        compiled.prefill(PROMPTS[s], slot_id=s)
        compiled.reserve(s, len(PROMPTS[s]) + 1)
    # Three sequences padded to bucket 4: the padding row (slot -1) must not touch any block.
    compiled.prefill(PROMPTS[2], slot_id=2)
    compiled.reserve(2, len(PROMPTS[2]) + 1)
    before = [(k.clone(), v.clone()) for k, v in compiled.runner.kv_caches]
    free = set(range(compiled.num_total_blocks)) - {b for s in range(3) for b in compiled.slot_blocks(s)}
    compiled.execute([BatchedRequest(s, [7], compiled.slot_seq_len(s)) for s in range(3)])
    idx = torch.tensor(sorted(free))
    for (k0, v0), (k1, v1) in zip(before, compiled.runner.kv_caches):
        assert torch.equal(k0[idx], k1[idx]) and torch.equal(v0[idx], v1[idx])


def test_llm_generate_compiled_equals_eager(ckpt, oracle):
    kw = dict(max_num_seqs=4, max_model_len=64, block_size=4)
    eager = LLM(ckpt, compile=False, **kw).generate(PROMPTS, GREEDY)
    compiled = LLM(ckpt, compile=True, **kw).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    assert [o.outputs[0].token_ids for o in eager] == [oracle(p, GREEDY.max_new_tokens) for p in PROMPTS]


def test_eager_decode_runs_at_the_exact_batch_size(engines, monkeypatch):
    """Padding to buckets is for compiled / captured steps; eager steps do not pay for it."""
    eager, compiled = engines
    seen = []
    forward = eager.runner._run_uncompiled        # the model's forward
    monkeypatch.setattr(eager.runner, "_run_uncompiled",
                        lambda ids, *a, **k: seen.append(ids.shape[0]) or forward(ids, *a, **k))
    for engine in (eager, compiled):
        for s in range(3):
            engine.prefill(PROMPTS[s], slot_id=s)
            engine.reserve(s, len(PROMPTS[s]) + 1)
        engine.runner.inputs.buf_slots.fill_(5)                 # stale rows from an earlier, larger batch
        engine.execute([BatchedRequest(s, [7], engine.slot_seq_len(s)) for s in range(3)])
    assert seen[-1] == 3, "eager: the model sees the 3 decode rows, no padding"
    assert eager.runner.inputs.buf_slots[:3].tolist() == [0, 1, 2]
    assert compiled.runner.inputs.buf_slots[:4].tolist() == [0, 1, 2, -1], "compiled: padded to bucket 4"


def test_compiled_step_reads_current_weights(engines):
    """The compiled step skips Dynamo's module guards; parameter values (and the CPU fast path's
    packed buffers) are graph inputs, so a weight written after compilation, and repacked by
    ``refresh_weights()``, is used by the next compiled step (never a stale copy)."""
    eager, compiled = engines
    for engine in (eager, compiled):
        engine.prefill(PROMPTS[0], slot_id=0)
    before = [e.decode_step(7, slot_id=0).logits for e in (eager, compiled)]
    torch.testing.assert_close(before[1], before[0], rtol=1e-4, atol=1e-4)
    for engine in (eager, compiled):                  # separate models: scale both lm_heads
        with torch.no_grad():
            engine.model.lm_head.weight.mul_(-2.0)
        engine.refresh_weights()
    after = [e.decode_step(9, slot_id=0).logits for e in (eager, compiled)]
    try:
        torch.testing.assert_close(after[1], after[0], rtol=1e-4, atol=1e-4)
        plain = [e.decode_step(11, slot_id=0).logits for e in (eager, compiled)]
        torch.testing.assert_close(plain[1], plain[0], rtol=1e-4, atol=1e-4)
    finally:
        for engine in (eager, compiled):
            with torch.no_grad():
                engine.model.lm_head.weight.div_(-2.0)
            engine.refresh_weights()
