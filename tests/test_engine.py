"""QwenEngine: the seed's slot tests, batch invariance, chunking, slot reuse, threads, bad input."""

from __future__ import annotations

import threading

import pytest
import torch

import qwen_ops
from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
from qwen_ops.engine.sampling import SamplingParams

from checkpoints import make_qwen3_checkpoint
from oracles import TransformersGreedy

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
EOS = (1,)          # make_qwen3_checkpoint's eos_token_id
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43], [2, 71], [82, 81, 28, 30, 33, 27, 95, 2, 88, 41, 97]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_engine"))


@pytest.fixture(scope="module")
def oracle(ckpt):
    """transformers' greedy tokens and logits of the checkpoint: the outside oracle."""
    return TransformersGreedy(ckpt)


@pytest.fixture()
def engine(ckpt):
    return QwenEngine.from_pretrained(ckpt, max_slots=4, max_seq_len=64, block_size=4, dtype="float32")


def run_single(engine: QwenEngine, prompt, n: int, slot: int = 0) -> list[int]:
    tokens = [engine.prefill(prompt, slot_id=slot).next_token]
    while len(tokens) < n:
        tokens.append(engine.decode_step(tokens[-1], slot_id=slot).next_token)
    return tokens


# ---------------------------------------------------------------- the seed's three tests
def test_single_session_parity(engine, oracle):
    prompt = [1, 2, 3, 4, 5]
    r1 = engine.prefill(prompt)
    r2 = engine.prefill(prompt, 0)
    assert r1.next_token == r2.next_token
    assert torch.equal(r1.logits, r2.logits)
    assert r1.logits.shape == (engine.vocab_size,)
    torch.testing.assert_close(r1.logits, oracle.logits(prompt), atol=2e-5, rtol=0)
    assert r1.next_token == oracle(prompt, 1)[0]


def test_slot_isolation(engine, oracle):
    engine.allocate_batch_slots(2)
    ra = engine.prefill(PROMPTS[0], slot_id=0)
    a1 = engine.decode_step(ra.next_token, slot_id=0).next_token
    rb = engine.prefill(PROMPTS[1], slot_id=1)
    b1 = engine.decode_step(rb.next_token, slot_id=1).next_token
    a2 = engine.decode_step(a1, slot_id=0).next_token
    assert [ra.next_token, a1] != [rb.next_token, b1]
    # Slot 0 continued as if slot 1 never ran.
    assert [ra.next_token, a1, a2] == oracle(PROMPTS[0], 3) == run_single(engine, PROMPTS[0], 3, slot=2)
    assert [rb.next_token, b1] == oracle(PROMPTS[1], 2)
    assert engine.slot_seq_len(0) == len(PROMPTS[0]) + 2


def test_batch_api_with_slots(engine, oracle):
    engine.allocate_batch_slots(2)
    req1 = QwenBatchedRequest(request_id=1, prompt_tokens=[1, 2, 3], slot_id=0, sampling=GREEDY)
    req2 = QwenBatchedRequest(request_id=2, prompt_tokens=[4, 5, 6], slot_id=1, sampling=GREEDY)
    res = engine.batch_prefill([req1, req2])
    assert len(res.last_tokens) == 2 and res.prompt_lengths == [3, 3]
    for _ in range(10):
        res = engine.batch_decode_step([req1, req2])
        assert len(res.next_tokens) == 2
    assert len(req1.generated_tokens) == 11 and req1.seq_len == 13
    assert req1.generated_tokens == oracle([1, 2, 3], 11)
    assert req2.generated_tokens == oracle([4, 5, 6], 11)


# ---------------------------------------------------------------- batching behaviour
def test_batch_decode_equals_transformers(engine, oracle):
    reqs = [QwenBatchedRequest(request_id=i, prompt_tokens=p, slot_id=i, sampling=GREEDY) for i, p in enumerate(PROMPTS)]
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        res = engine.batch_decode_step(reqs)
    assert res.finished == [True] * 4
    expected = [oracle(p, GREEDY.max_new_tokens, eos=EOS) for p in PROMPTS]
    assert [r.generated_tokens for r in reqs] == expected
    # Finished requests are skipped and report their last token.
    again = engine.batch_decode_step(reqs)
    assert again.next_tokens == [r.generated_tokens[-1] for r in reqs] and all(again.finished)


def test_batch_decode_runs_one_forward(engine, monkeypatch):
    reqs = [QwenBatchedRequest(request_id=i, prompt_tokens=p, slot_id=i, sampling=GREEDY) for i, p in enumerate(PROMPTS)]
    calls = []
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda chunks: calls.append(len(chunks)) or real(chunks))
    engine.batch_prefill(reqs)
    engine.batch_decode_step(reqs)
    assert calls == [4, 4]


def test_stop_token_finishes_request(engine, oracle):
    first = oracle(PROMPTS[0], 4)
    req = QwenBatchedRequest(request_id=9, prompt_tokens=PROMPTS[0], slot_id=1,
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=50, stop_token_ids=[first[2]]))
    engine.batch_prefill([req])
    while not req.finished:
        engine.batch_decode_step([req])
    assert req.generated_tokens == first[:3]


@pytest.mark.parametrize("chunk_size", [1, 3, 4])
def test_chunked_prefill_equals_unchunked(ckpt, oracle, chunk_size):
    whole = QwenEngine.from_pretrained(ckpt, max_slots=2, max_seq_len=64, block_size=4)
    chunked = QwenEngine.from_pretrained(ckpt, max_slots=2, max_seq_len=64, block_size=4, chunk_size=chunk_size)
    prompt = PROMPTS[3] + PROMPTS[1]
    a, b = whole.prefill(prompt), chunked.prefill(prompt)
    assert a.next_token == b.next_token
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.logits, oracle.logits(prompt), rtol=0, atol=2e-5)
    assert run_single(whole, prompt, 8) == run_single(chunked, prompt, 8) == oracle(prompt, 8)
    reqs = [QwenBatchedRequest(request_id=i, prompt_tokens=p, slot_id=i, sampling=GREEDY)
            for i, p in enumerate([prompt, PROMPTS[2]])]
    chunked.batch_prefill(reqs)
    assert [r.generated_tokens[0] for r in reqs] == [a.next_token, whole.prefill(PROMPTS[2]).next_token]


def test_freed_slot_is_fresh(engine, oracle):
    expected = oracle(PROMPTS[1], 6)
    assert run_single(engine, PROMPTS[1], 6, slot=0) == expected
    run_single(engine, PROMPTS[0], 9, slot=1)
    engine.free_slot(1)
    assert engine.num_free_blocks == engine.num_total_blocks - len(engine.slot_blocks(0))
    assert run_single(engine, PROMPTS[1], 6, slot=1) == expected
    with pytest.raises(ValueError, match="holds no sequence"):
        engine.free_slot(1) or engine.decode_step(5, slot_id=1)


def test_allocate_slot_and_grow(engine, oracle):
    got = [engine.allocate_slot(f"r{i}") for i in range(engine.num_slots)]
    assert got == list(range(4))
    with pytest.raises(ValueError, match="no free slot"):
        engine.allocate_slot("one too many")
    engine.free_slot(2)
    assert engine.allocate_slot("again") == 2
    engine.allocate_batch_slots(6)
    assert engine.num_slots == 6
    assert run_single(engine, PROMPTS[0], 4, slot=5) == oracle(PROMPTS[0], 4)


def test_threads_match_transformers(ckpt, oracle):
    engine = QwenEngine.from_pretrained(ckpt, max_slots=4, max_seq_len=64, block_size=4)
    expected = [oracle(p, 8) for p in PROMPTS]
    results: dict[int, list[int]] = {}
    errors = []

    def work(i):
        try:
            results[i] = run_single(engine, PROMPTS[i], 8, slot=i)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[i] for i in range(4)] == expected


def test_seeded_sampling_is_batch_independent(engine):
    sp = SamplingParams(temperature=0.8, top_k=20, seed=1234, max_new_tokens=8)
    alone = QwenBatchedRequest(request_id=0, prompt_tokens=PROMPTS[0], slot_id=0, sampling=sp)
    engine.batch_prefill([alone])
    while not alone.finished:
        engine.batch_decode_step([alone])
    others = [QwenBatchedRequest(request_id=i, prompt_tokens=p, slot_id=i,
                                 sampling=SamplingParams(temperature=1.0, max_new_tokens=8))
              for i, p in enumerate(PROMPTS[1:], start=1)]
    again = QwenBatchedRequest(request_id=0, prompt_tokens=PROMPTS[0], slot_id=0, sampling=sp)
    batch = others[:1] + [again] + others[1:]
    engine.batch_prefill(batch)
    while not all(r.finished for r in batch):
        engine.batch_decode_step(batch)
    assert again.generated_tokens == alone.generated_tokens


# ---------------------------------------------------------------- bad input
BAD_CALLS = [
    ("slot_id", lambda e: e.prefill([1, 2], slot_id=4)),
    ("slot_id", lambda e: e.prefill([1, 2], slot_id=-1)),
    ("empty", lambda e: e.prefill([], slot_id=1)),
    ("max_seq_len", lambda e: e.prefill([1] * 65, slot_id=1)),
    (r"tokens\[1\] = 128", lambda e: e.prefill([1, 128], slot_id=1)),
    (r"tokens\[0\] = -1", lambda e: e.prefill([-1], slot_id=1)),
    ("holds no sequence", lambda e: e.decode_step(3, slot_id=2)),
    ("token = 999", lambda e: e.decode_step(999, slot_id=0)),
    ("max_new_tokens", lambda e: QwenBatchedRequest(1, [1], 1, SamplingParams(max_new_tokens=0))),
    ("temperature", lambda e: e.prefill([1], slot_id=1, sampling=SamplingParams(temperature=-1))),
    ("top_p", lambda e: e.prefill([1], slot_id=1, sampling=SamplingParams(top_p=0.0))),
    # (a stop id past the vocabulary is accepted since issue 62, as vLLM's; a logit_bias key past it is not)
    ("logit_bias key 500", lambda e: e.prefill([1], slot_id=1, sampling=SamplingParams(logit_bias={500: 1.0}))),
    ("also used by", lambda e: e.batch_prefill([QwenBatchedRequest(1, [1], 1), QwenBatchedRequest(2, [2], 1)])),
    (r"requests\[1\].prompt_tokens", lambda e: e.batch_prefill([QwenBatchedRequest(1, [1], 1),
                                                                 QwenBatchedRequest(2, [], 2)])),
    (r"requests\[0\].slot_id", lambda e: e.batch_decode_step([QwenBatchedRequest(1, [1], 2, last_token=2)])),
    ("prompt_logprobs", lambda e: e.prefill([1], slot_id=1, sampling=SamplingParams(prompt_logprobs=1))),
]


@pytest.mark.parametrize("match, call", BAD_CALLS, ids=[f"{i}-{m[:20]}" for i, (m, _) in enumerate(BAD_CALLS)])
def test_bad_input_leaves_other_slots_untouched(engine, match, call):
    expected = run_single(engine, PROMPTS[1], 8, slot=3)
    first = run_single(engine, PROMPTS[1], 4, slot=0)
    free_before = engine.num_free_blocks
    with pytest.raises(ValueError, match=match):
        call(engine)
    assert engine.num_free_blocks == free_before
    rest = first[-1:]
    for _ in range(4):
        rest.append(engine.decode_step(rest[-1], slot_id=0).next_token)
    assert first + rest[1:] == expected


def test_out_of_blocks_is_an_error_and_harmless(ckpt):
    engine = QwenEngine.from_pretrained(ckpt, max_slots=2, max_seq_len=64, block_size=4, num_kv_blocks=5)
    first = run_single(engine, PROMPTS[0], 3, slot=0)          # 5 + 2 tokens -> 2 blocks
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        engine.prefill(list(range(1, 20)), slot_id=1)           # needs 5 blocks, 3 free
    assert engine.num_free_blocks == 3
    assert engine.decode_step(first[-1], slot_id=0).next_token == run_single(engine, PROMPTS[0], 4, slot=1)[-1]


def test_constructor_rejects_bad_sizes(ckpt):
    with pytest.raises(ValueError, match="block_size"):
        QwenEngine.from_pretrained(ckpt, block_size=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        QwenEngine.from_pretrained(ckpt, max_seq_len=10_000)
    with pytest.raises(ValueError, match="dtype"):
        QwenEngine.from_pretrained(ckpt, dtype="int8")


def test_exports():
    for name in ("QwenEngine", "QwenBatchedRequest", "SamplingParams", "QwenForwardResult",
                 "QwenBatchPrefillResult", "QwenBatchDecodeResult", "LLM"):
        assert hasattr(qwen_ops, name), name


def test_execute_rejects_unreserved_or_stale_chunks(engine):
    from qwen_ops.engine.batch import BatchedRequest

    expected = run_single(engine, PROMPTS[0], 5, slot=3)
    first = run_single(engine, PROMPTS[0], 3, slot=0)
    engine.begin_sequence(1)
    with pytest.raises(ValueError, match=r"reserve\(\) them first"):
        engine.execute([BatchedRequest(1, [5, 6, 7], 0)])              # no blocks reserved for slot 1
    with pytest.raises(ValueError, match=r"chunks\[0\].position_offset = 2"):
        engine.execute([BatchedRequest(0, [5], 2)])
    with pytest.raises(ValueError, match="holds no sequence"):
        engine.execute([BatchedRequest(2, [5], 0)])
    with pytest.raises(ValueError, match="appears twice"):
        engine.execute([BatchedRequest(0, [5], 7), BatchedRequest(0, [6], 7)])
    rest = first[-1:]
    for _ in range(2):
        rest.append(engine.decode_step(rest[-1], slot_id=0).next_token)
    assert first + rest[1:] == expected


# ----------------------------------------------------------------------------- sizes checked before allocating
@pytest.mark.parametrize("kwargs, named", [
    (dict(num_kv_blocks=10 ** 12, max_seq_len=64), "num_kv_blocks = 1000000000000"),
    (dict(block_size=10 ** 9, max_seq_len=64), "block_size = 1000000000"),
    (dict(max_slots=10 ** 9, max_seq_len=64), "max_slots = 1000000000"),
])
def test_a_cache_that_cannot_fit_is_refused_by_name(ckpt, kwargs, named):
    with pytest.raises(ValueError) as info:
        QwenEngine.from_pretrained(ckpt, **kwargs)
    message = str(info.value)
    assert named in message and "needs" in message and "but only" in message and "is available" in message


def test_allocate_batch_slots_beyond_memory_is_refused_and_harmless(engine):
    before = run_single(engine, [3, 4, 5], 4)
    with pytest.raises(ValueError, match=r"allocate_batch_slots\(n = 10000000\).* needs .* but only"):
        engine.allocate_batch_slots(10 ** 7)
    assert engine.num_slots == 4
    engine.free_slot(0)
    assert run_single(engine, [3, 4, 5], 4) == before


def test_from_pretrained_builds_rope_rows_for_max_seq_len_only(ckpt):
    eng = QwenEngine.from_pretrained(ckpt, max_slots=2, max_seq_len=40, block_size=4)
    assert eng.model.model.rotary_emb.cos_sin.shape[0] == 40


# ----------------------------------------------------------------------------- the ops' backends, chosen once
def test_the_ops_backends_are_chosen_once_when_the_engine_is_built(engine, monkeypatch):
    from qwen_ops.ops import backend as B

    before = run_single(engine, [3, 4, 5], 4)
    assert engine.runner.op_backends[("kv_write", "")] == B.resolve_backend(torch.device("cpu"), "kv_write")

    def per_call(*args, **kwargs):
        raise AssertionError("an op call resolved its backend during an engine step")

    # A later setting (here one that cannot run on CPU tensors) and the resolver itself are out
    # of the steps' reach: they run on what the runner bound at construction.
    monkeypatch.setenv("QWEN_OPS_BACKEND", "cuda")
    monkeypatch.setattr(B, "resolve_backend", per_call)
    engine.free_slot(0)
    assert run_single(engine, [3, 4, 5], 4) == before
    # A direct op call outside an engine still resolves per call, as documented.
    monkeypatch.undo()
    monkeypatch.setenv("QWEN_OPS_BACKEND", "cuda")
    k = torch.randn(1, 2, 16)
    cache = torch.zeros(4, 4, 2, 16)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="backend 'cuda' is unavailable"):
        torch.ops.qwen.kv_write(k, k, cache, cache.clone(), one, one, torch.zeros(1, 1, dtype=torch.int32))
