"""LLM.generate / stream over the scheduler: equality with the engine, preemption, abort, stops."""

from __future__ import annotations

import random

import pytest

from qwen_ops.engine import QwenEngine
from qwen_ops.llm import LLM
from qwen_ops.sampling import SamplingParams

from checkpoints import make_qwen3_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_llm"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(2, 128) for _ in range(rng.randrange(3, 20))] for _ in range(10)]


@pytest.fixture(scope="module")
def expected(ckpt, prompts):
    """Each prompt generated alone, one slot, through the engine's single-session API."""
    engine = QwenEngine.from_pretrained(ckpt, max_slots=1, max_seq_len=64, block_size=4)
    out = []
    for p in prompts:
        toks = [engine.prefill(p).next_token]
        while len(toks) < GREEDY.max_new_tokens:
            toks.append(engine.decode_step(toks[-1]).next_token)
        out.append(toks)
    return out


def make_llm(ckpt, **kw):
    kw.setdefault("max_model_len", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("check_invariants", True)
    return LLM(ckpt, **kw)


def test_generate_matches_engine(ckpt, prompts, expected):
    llm = make_llm(ckpt, max_num_seqs=4, max_num_batched_tokens=24)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.outputs[0].text == "" for o in outs)          # no tokenizer.json in this checkpoint
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"]
    assert s["mean_batch_size"] > 1.5                           # requests really were batched


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_outputs(ckpt, prompts, expected, mode):
    # 16 blocks of 4 tokens for 10 requests needing up to 8 blocks each: preemption is forced.
    llm = make_llm(ckpt, max_num_seqs=8, num_kv_blocks=16, max_num_batched_tokens=32, preemption_mode=mode)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.stats()
    assert s["num_preemptions"] > 0
    if mode == "swap":
        assert s["num_swaps_out"] > 0 and s["num_swaps_in"] == s["num_swaps_out"]
    else:
        assert s["num_swaps_out"] == 0
    assert s["free_blocks"] == s["total_blocks"]


def test_thousand_short_requests_free_everything(ckpt):
    llm = make_llm(ckpt, max_num_seqs=64, num_kv_blocks=64, max_num_batched_tokens=128, check_invariants=False)
    rng = random.Random(1)
    many = [[rng.randrange(2, 128) for _ in range(rng.randrange(1, 6))] for _ in range(1000)]
    outs = llm.generate(many, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["num_running"] == s["num_waiting"] == 0


def test_abort_mid_generation_frees_everything(ckpt, prompts):
    llm = make_llm(ckpt, max_num_seqs=4)
    stream = llm.stream(prompts[:4], SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True))
    first = next(stream)
    assert first.new_token_ids and not first.finished
    llm.abort(first.request_id)
    rest = list(stream)
    assert all(u.request_id != first.request_id for u in rest)
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"]
    # Breaking out of a stream aborts what is left.
    stream = llm.stream(prompts[:4], SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_stop_and_length_reasons(ckpt, prompts, expected):
    llm = make_llm(ckpt, max_num_seqs=4)
    stop_at = expected[0][3]
    outs = llm.generate([prompts[0], prompts[1]],
                        [SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_at]), GREEDY])
    a, b = outs[0].outputs[0], outs[1].outputs[0]
    assert a.finish_reason == "stop" and a.stop_reason == stop_at
    assert a.token_ids == expected[0][:expected[0].index(stop_at) + 1]
    assert b.finish_reason == "length" and b.token_ids == expected[1]


def test_seeded_request_is_batch_independent(ckpt, prompts):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=8, ignore_eos=True)
    alone = make_llm(ckpt, max_num_seqs=4).generate([prompts[0]], sp)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    crowd = make_llm(ckpt, max_num_seqs=4).generate(prompts[1:4] + [prompts[0]], [noisy] * 3 + [sp])
    assert crowd[-1].outputs[0].token_ids == alone


@pytest.mark.parametrize("bad, match", [
    ([[]], r"prompts\[0\] is empty"),
    ([[1, 2], [3] * 64], r"prompts\[1\] has 64 tokens"),
    ([[1, 2], [1, 500]], r"prompts\[1\]\[1\] = 500"),
    (["text"], r"prompts\[0\] is text"),
])
def test_generate_rejects_before_any_work(ckpt, bad, match):
    llm = make_llm(ckpt, max_num_seqs=4)
    with pytest.raises(ValueError, match=match):
        llm.generate(bad, GREEDY)
    s = llm.stats()
    assert s["num_iterations"] == 0 and s["free_blocks"] == s["total_blocks"] and s["num_waiting"] == 0


def test_generate_rejects_bad_sampling_lists(ckpt):
    llm = make_llm(ckpt, max_num_seqs=4)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1], [2]], [GREEDY])
    with pytest.raises(ValueError, match=r"sampling_params\[1\]"):
        llm.generate([[1], [2]], [GREEDY, "greedy"])


def test_stream_reports_a_bad_request_alone(ckpt, prompts, expected):
    llm = make_llm(ckpt, max_num_seqs=4)
    updates = list(llm.stream([prompts[0], [], prompts[1]], GREEDY))
    errors = [u for u in updates if u.error]
    assert len(errors) == 1 and "prompts[1]" in errors[0].error and errors[0].outputs[0].finish_reason == "error"
    final = {u.request_id: u for u in updates if u.finished and not u.error}
    assert sorted(o.outputs[0].token_ids for o in final.values()) == sorted([expected[0], expected[1]])
    streamed: dict[str, list[int]] = {}
    for u in updates:
        streamed.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert all(streamed[rid] == u.outputs[0].token_ids for rid, u in final.items())


def test_kv_budget_too_small_for_one_sequence(ckpt):
    with pytest.raises(ValueError, match="num_kv_blocks = 3"):
        make_llm(ckpt, num_kv_blocks=3)
