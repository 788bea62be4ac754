"""Automatic prefix caching: content-addressed, reference-counted full KV blocks.

Every test compares with caching off: the same greedy tokens (and, through the engine, the same
logits), with the hits counted, nothing leaked, and no shared block ever written. The greedy tokens
(and the logits) are also transformers' on the same checkpoint: caching on and off agreeing is not
enough, a wrong attention kernel makes both agree."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from qwen_ops.engine.block_manager import BlockPool
from qwen_ops.engine.engine import QwenEngine
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.llm import LLM

from checkpoints import make_qwen3_5_checkpoint, make_qwen3_checkpoint
from oracles import TransformersGreedy

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_prefix"))


@pytest.fixture(scope="module")
def oracle(ckpt):
    """transformers on the same checkpoint (fp32, eager attention): the outside oracle."""
    oracle = TransformersGreedy(ckpt)
    return oracle


def _oracle_greedy(oracle, llm, prompts, params=GREEDY):
    """transformers' greedy completions of ``prompts`` as requests with ``params`` end: after
    ``max_tokens``, or at the first stop token (EOS unless ``ignore_eos``)."""
    assert params.temperature == 0.0 and not params.stop and not params.min_tokens
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(llm.engine.eos_token_ids))
    return [oracle(p, params.max_tokens, eos=sorted(stops) or None) for p in prompts]


def rand_tokens(rng, n):
    return [rng.randrange(2, 128) for _ in range(n)]


# ------------------------------------------------------------------------------ the allocator
def test_allocator_refcounts_lru_and_eviction():
    pc = BlockPool(4, prefix_caching=True)
    a, b = pc.allocate(2)
    ka = pc.key_of(b"", [1, 2])
    assert pc.register(a, ka, b"", [1, 2])
    kb = pc.key_of(ka, [3, 4])
    assert pc.register(b, kb, ka, [3, 4])
    assert not pc.register(b, kb, ka, [3, 4]), "a registered block is not registered twice"
    pc.free([a, b])                     # b (the tail) is freed first: it is evicted first
    assert pc.num_free == 4 and pc.num_cached == 2
    assert pc.lookup(b"", [1, 2]) == (ka, a) and pc.lookup(ka, [3, 4]) == (kb, b)
    assert pc.lookup(b"", [3, 4])[1] is None and pc.lookup(kb, [3, 4])[1] is None
    pc.acquire(a)                       # a hit takes it off the free list
    assert pc.num_free == 3 and pc.ref_count(a) == 1
    got = pc.allocate(2)                # the two never-used blocks go first
    assert a not in got and b not in got and pc.num_cached == 2
    (c,) = pc.allocate(1)               # then the least recently freed cached one: b
    assert c == b and pc.num_cached == 1 and pc.num_evictions == 1
    assert pc.lookup(ka, [3, 4])[1] is None
    pc.check([[a], got, [c]])
    with pytest.raises(AssertionError, match="ref count"):
        pc.check([[a], got])
    pc.free([a])
    with pytest.raises(RuntimeError, match="freed twice"):
        pc.free([a])


def test_allocator_never_serves_a_colliding_block():
    pc = BlockPool(2, prefix_caching=True, hash_fn=lambda parent, salt, tokens: b"same")
    (a,) = pc.allocate(1)
    pc.register(a, pc.key_of(b"", [1, 2]), b"", [1, 2])
    key, block = pc.lookup(b"", [9, 9])
    assert block is None and pc.num_collisions == 1
    assert pc.lookup(b"", [1, 2])[1] == a


def test_reset_cache_forgets_content():
    pc = BlockPool(2, prefix_caching=True)
    (a,) = pc.allocate(1)
    pc.register(a, pc.key_of(b"", [1]), b"", [1])
    pc.reset_cache()
    assert pc.num_cached == 0 and pc.lookup(b"", [1])[1] is None and pc.ref_count(a) == 1


# ------------------------------------------------------------------------------ the engine
def _engines(ckpt, **kw):
    kw = dict(max_slots=4, max_seq_len=64, block_size=BS, **kw)
    return (QwenEngine.from_pretrained(ckpt, enable_prefix_caching=True, **kw),
            QwenEngine.from_pretrained(ckpt, enable_prefix_caching=False, **kw))


@pytest.mark.parametrize("shared_blocks", [0, 1, 3, "all", "boundary"])
def test_engine_prefill_hits_equal_a_full_prefill(ckpt, oracle, shared_blocks):
    rng = random.Random(hash(str(shared_blocks)) % 1000)
    cached, plain = _engines(ckpt)
    first = rand_tokens(rng, 14)
    if shared_blocks == "all":
        second = list(first)                         # the whole prompt cached: the last token still runs
        expect_hit = (len(first) - 1) // BS * BS
    elif shared_blocks == "boundary":
        first = first[:12]
        second = list(first)                         # ends exactly on a block boundary
        expect_hit = 8                               # not the third block: its last token must be computed
    else:
        second = first[:shared_blocks * BS] + rand_tokens(rng, 9)
        expect_hit = shared_blocks * BS
    r1 = cached.prefill(first, slot_id=0)
    cached.free_slot(0)                             # content stays cached
    assert cached.num_free_blocks == cached.num_total_blocks
    r2 = cached.prefill(second, slot_id=1)
    assert cached.prefix_cache_hits == expect_hit
    assert cached.slot_seq_len(1) == len(second)
    ref = plain.prefill(second, slot_id=1)
    assert r2.next_token == ref.next_token
    torch.testing.assert_close(r2.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r2.logits.float(), oracle.logits(second), rtol=1e-4, atol=1e-4)
    assert plain.prefill(first, slot_id=0).next_token == r1.next_token == oracle(first, 1)[0]
    # Decoding on from the mapped prefix stays equal too.
    t_c, t_p = r2.next_token, ref.next_token
    tokens = [t_c]
    for _ in range(5):
        t_c, t_p = cached.decode_step(t_c, slot_id=1).next_token, plain.decode_step(t_p, slot_id=1).next_token
        assert t_c == t_p
        tokens.append(t_c)
    assert tokens == oracle(second, 6)
    cached.check_block_accounting()


def test_shared_blocks_are_never_written(ckpt, oracle):
    cached, _ = _engines(ckpt)
    rng = random.Random(1)
    prefix = rand_tokens(rng, 8)
    p0, p1 = prefix + rand_tokens(rng, 3), prefix + rand_tokens(rng, 5)
    cached.prefill(p0, slot_id=0)
    cached.prefill(p1, slot_id=1)
    shared = set(cached.slot_blocks(0)) & set(cached.slot_blocks(1))
    assert len(shared) == 2 and all(cached.allocator.ref_count(b) == 2 for b in shared)
    k0, v0 = cached.runner.kv_caches[0]
    before = {b: (k0[b].clone(), v0[b].clone()) for b in shared}
    t0, t1 = 5, 6
    out0, out1 = [], []
    for _ in range(10):
        t0 = cached.decode_step(t0, slot_id=0).next_token
        t1 = cached.decode_step(t1, slot_id=1).next_token
        out0.append(t0)
        out1.append(t1)
    for b, (k, v) in before.items():
        assert torch.equal(k0[b], k) and torch.equal(v0[b], v)
    # Each slot's decodes (fed 5 and 6 after its prompt) read the shared prefix right.
    assert out0 == oracle(p0 + [5], 10) and out1 == oracle(p1 + [6], 10)
    cached.free_slot(0)
    assert all(cached.allocator.ref_count(b) == 1 for b in shared)
    cached.free_slot(1)
    cached.check_block_accounting()
    assert cached.num_free_blocks == cached.num_total_blocks


def test_batch_prefill_with_prefix_caching(ckpt, oracle):
    from qwen_ops.engine.engine import QwenBatchedRequest

    cached, plain = _engines(ckpt)
    rng = random.Random(2)
    system = rand_tokens(rng, 9)
    cached.prefill(system + [7], slot_id=3)
    prompts = [system + rand_tokens(rng, k) for k in (1, 4, 6)]
    outs = []
    for eng in (cached, plain):
        reqs = [QwenBatchedRequest(i, p, i, GREEDY) for i, p in enumerate(prompts)]
        eng.batch_prefill(reqs)
        for _ in range(4):
            eng.batch_decode_step(reqs)
        outs.append([r.generated_tokens for r in reqs])
    assert outs[0] == outs[1]
    assert outs[0] == [oracle(p, 5) for p in prompts]
    assert cached.prefix_cache_hits == 3 * 8


def test_weight_refresh_drops_the_cache(ckpt):
    cached, _ = _engines(ckpt)
    cached.prefill(list(range(2, 15)), slot_id=0)
    cached.free_slot(0)
    assert cached.allocator.num_cached > 0
    cached.refresh_weights()
    assert cached.allocator.num_cached == 0


def test_hybrid_models_turn_it_off_loudly(tmp_path, caplog):
    path = make_qwen3_5_checkpoint(tmp_path / "hybrid")
    with caplog.at_level(logging.WARNING):
        llm = LLM(path, max_model_len=64, block_size=4, enable_prefix_caching=True)
    assert "prefix caching is off" in caplog.text and "linear-attention" in caplog.text
    assert llm.stats()["prefix_caching"] is False
    p = list(range(3, 20))
    a = llm.generate([p, p], GREEDY)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids
    assert llm.stats()["prefix_cache_hits"] == 0


# ------------------------------------------------------------------------------ LLM and scheduler
def _both(ckpt, prompts, params=GREEDY, **kw):
    kw.setdefault("max_model_len", 64)
    kw.setdefault("block_size", BS)
    on = LLM(ckpt, enable_prefix_caching=True, check_invariants=True, **kw)
    off = LLM(ckpt, enable_prefix_caching=False, check_invariants=True, **kw)
    return on, [o.outputs[0].token_ids for o in on.generate(prompts, params)], \
        [o.outputs[0].token_ids for o in off.generate(prompts, params)]


def _assert_clean(llm):
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"]
    llm.engine.check_block_accounting()
    assert all(llm.engine.allocator.ref_count(b) == 0 for b in range(s["total_blocks"]))


def test_shared_system_prompt_concurrent_and_later(ckpt, oracle):
    rng = random.Random(3)
    system = rand_tokens(rng, 17)
    prompts = [system + rand_tokens(rng, rng.randint(1, 6)) for _ in range(6)]
    on, got, want = _both(ckpt, prompts, max_num_seqs=8)
    assert got == want
    assert want == _oracle_greedy(oracle, on, prompts)
    first_hits = on.stats()["prefix_cache_hits"]        # admitted in one step: little to share yet
    again = on.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want
    s = on.stats()
    assert s["prefix_cache_hits"] - first_hits >= 6 * 16 and s["prefix_cache_hit_rate"] > 0.3
    _assert_clean(on)


def test_multi_turn_chat(ckpt, oracle):
    rng = random.Random(4)
    on = LLM(ckpt, max_model_len=96, block_size=BS, check_invariants=True)
    off = LLM(ckpt, max_model_len=96, block_size=BS, enable_prefix_caching=False)
    convo_on = convo_off = rand_tokens(rng, 10)
    for turn in range(4):
        a = on.generate([convo_on], GREEDY)[0].outputs[0].token_ids
        b = off.generate([convo_off], GREEDY)[0].outputs[0].token_ids
        assert a == b, f"turn {turn}"
        assert a == _oracle_greedy(oracle, on, [convo_on])[0], f"turn {turn}"
        user = rand_tokens(rng, 5)
        convo_on = convo_on + a + user
        convo_off = convo_off + b + user
    s = on.stats()
    # Each later turn finds the earlier turns (prompt and answer) cached, up to its last full block.
    assert s["prefix_cache_hits"] >= 3 * 12
    _assert_clean(on)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_pressure(ckpt, oracle, mode):
    rng = random.Random(5)
    system = rand_tokens(rng, 12)
    prompts = [system + rand_tokens(rng, rng.randint(1, 10)) for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    on, got, want = _both(ckpt, prompts, params, max_num_seqs=6, num_kv_blocks=24, preemption_mode=mode,
                          max_num_batched_tokens=16)
    assert got == want
    assert want == _oracle_greedy(oracle, on, prompts, params)
    s = on.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0
    _assert_clean(on)


def test_abort_releases_references(ckpt):
    rng = random.Random(6)
    system = rand_tokens(rng, 16)
    llm = LLM(ckpt, max_model_len=64, block_size=BS, check_invariants=True)
    llm.generate([system + [5]], GREEDY)
    ids = [llm.add_request(system + rand_tokens(rng, 3), GREEDY) for _ in range(3)]
    llm.step()
    assert max(llm.engine.allocator.ref_count(b) for b in range(llm.stats()["total_blocks"])) >= 3
    for rid in ids:
        llm.abort(rid)
    _assert_clean(llm)


def test_forced_hash_collisions_are_never_served(ckpt, oracle):
    rng = random.Random(7)
    prompts = [rand_tokens(rng, 13) for _ in range(5)]
    on = LLM(ckpt, max_model_len=64, block_size=BS, check_invariants=True)
    on.engine.allocator.hash_fn = lambda parent, salt, tokens: b"\x00" * 32    # every block collides
    off = LLM(ckpt, max_model_len=64, block_size=BS, enable_prefix_caching=False)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in on.generate(prompts, GREEDY)]
        assert got == [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY)]
        assert got == _oracle_greedy(oracle, on, prompts)
    assert on.stats()["prefix_cache_collisions"] > 0
    _assert_clean(on)


def test_unrelated_prompts_behave_as_without(ckpt, oracle):
    rng = random.Random(8)
    prompts = [rand_tokens(rng, rng.randint(3, 30)) for _ in range(10)]
    on, got, want = _both(ckpt, prompts, max_num_seqs=4)
    assert got == want
    assert want == _oracle_greedy(oracle, on, prompts)
    _assert_clean(on)
