"""LLM.generate / stream over the scheduler: greedy tokens equal transformers' (batched, preempted,
swapped, threaded), abort, stops, validation."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from qwen_ops.serving.llm import LLM
from qwen_ops.engine.sampling import SamplingParams

from checkpoints import make_qwen3_checkpoint
from oracles import TransformersGreedy

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_llm"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(2, 128) for _ in range(rng.randrange(3, 20))] for _ in range(10)]


@pytest.fixture(scope="module")
def oracle(ckpt):
    return TransformersGreedy(ckpt)


@pytest.fixture(scope="module")
def expected(oracle, prompts):
    """Each prompt's greedy tokens by transformers (the outside oracle: not this engine)."""
    return [oracle(p, GREEDY.max_new_tokens) for p in prompts]


def make_llm(ckpt, **kw):
    kw.setdefault("max_model_len", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("check_invariants", True)
    return LLM(ckpt, **kw)


def test_generate_matches_transformers(ckpt, prompts, expected):
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
    assert not llm.scheduler.requests          # finished requests are not kept (a server would grow forever)


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


@pytest.mark.parametrize("method", ["generate", "stream"])
@pytest.mark.parametrize("prompts, params, match", [
    ([[1], [2], [3]], [GREEDY], r"sampling_params has 1 entries, expected one per prompt \(3\)"),
    ([[5], []], GREEDY, r"prompts\[1\] is empty"),
    ([[5], None], GREEDY, r"prompts\[1\] = None"),
    (None, GREEDY, r"prompts = None"),
    ([[5], [6]], [GREEDY, "greedy"], r"sampling_params\[1\]"),
    ([[5]], "greedy", r"sampling_params = 'greedy'"),
    (torch.ones(2, 2, 2, dtype=torch.long), GREEDY, r"shape \(2, 2, 2\)"),
    ([torch.tensor([1.0, 2.0])], GREEDY, r"prompts\[0\] is a torch.float32 tensor"),
])
def test_generate_and_stream_validate_identically(ckpt, method, prompts, params, match):
    """One validation for both: a bad request raises before anything is queued (stream: at the call)."""
    llm = make_llm(ckpt, max_num_seqs=4)
    with pytest.raises(ValueError, match=match):
        getattr(llm, method)(prompts, params)
    s = llm.stats()
    assert s["num_waiting"] == s["num_running"] == 0 and s["free_blocks"] == s["total_blocks"]


def test_adding_a_batch_is_all_or_nothing(ckpt, prompts, expected, monkeypatch):
    """A failure while queueing request 3 of 4 leaves none of them queued; later calls are clean."""
    llm = make_llm(ckpt, max_num_seqs=4)
    real_add = llm.scheduler.add_request
    calls = []

    def failing_add(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_add(*args, **kw)

    monkeypatch.setattr(llm.scheduler, "add_request", failing_add)
    for method in ("generate", "stream"):
        calls.clear()
        with pytest.raises(RuntimeError, match="injected"):
            list(getattr(llm, method)(prompts[:4], GREEDY))
        s = llm.stats()
        assert s["num_waiting"] == s["num_running"] == 0 and s["free_blocks"] == s["total_blocks"]
    monkeypatch.undo()
    outs = llm.generate(prompts[4:6], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[4:6]
    assert llm.stats()["num_waiting"] == 0


def test_tensor_prompts(ckpt, prompts, expected):
    """A 1-D tensor is one prompt; a list of tensors, or a 2-D tensor's rows, are several."""
    llm = make_llm(ckpt, max_num_seqs=4)
    one = llm.generate(torch.tensor(prompts[0]), GREEDY)
    assert len(one) == 1 and one[0].outputs[0].token_ids == expected[0]
    many = llm.generate([torch.tensor(p) for p in prompts[:2]], GREEDY)
    assert [o.outputs[0].token_ids for o in many] == expected[:2]
    same_len = [p for p in prompts if len(p) == len(prompts[0])][:2]
    rows = llm.generate(torch.tensor(same_len), GREEDY)
    assert [o.prompt_token_ids for o in rows] == same_len


def test_stream_with_a_bad_request_runs_nothing(ckpt, prompts):
    llm = make_llm(ckpt, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llm.stream([prompts[0], [], prompts[1]], GREEDY)
    assert llm.stats()["num_waiting"] == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), r"block_size = 0, expected an int >= 1"),
    (dict(max_num_seqs=0), r"max_num_seqs = 0, expected an int >= 1"),
    (dict(max_num_seqs=2.5), r"max_num_seqs = 2.5"),
    (dict(max_model_len=1), r"max_model_len = 1, expected an int >= 2"),
    (dict(num_kv_blocks=0), r"num_kv_blocks = 0"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens = 0"),
    (dict(kv_cache_bytes=-1), r"kv_cache_bytes = -1"),
    (dict(swap_space=-5), r"swap_space = -5, expected a number of GiB >= 0"),
    (dict(swap_space="4"), r"swap_space = '4', expected a number of GiB"),
    (dict(preemption_mode="evict"), r"preemption_mode = 'evict'"),
    (dict(check_invariants="yes"), r"check_invariants = 'yes'"),
    (dict(compile="no"), r"compile = 'no'"),
    (dict(decode_buckets=[1, 0]), r"decode_buckets\[1\] = 0"),
    (dict(compile_backend="xla"), r"compile_backend = 'xla'"),
    (dict(backend="xla"), r"compile_backend = 'xla'"),
    (dict(device="tpu"), r"device = 'tpu'"),
    (dict(device="cuda"), r"device = 'cuda', but"),
    (dict(dtype="float64"), r"dtype = 'float64'"),
    (dict(model=3), r"model = 3"),
])
def test_constructor_arguments_are_validated_by_name(ckpt, kwargs, match):
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is available here")
    kwargs = dict(kwargs)
    model = kwargs.pop("model", ckpt)
    with pytest.raises(ValueError, match=match):
        LLM(model, max_model_len=kwargs.pop("max_model_len", 64), **kwargs)


def test_swap_space_full_falls_back_to_recompute(ckpt, prompts, expected):
    llm = make_llm(ckpt, max_num_seqs=8, num_kv_blocks=16, max_num_batched_tokens=32, preemption_mode="swap",
                   swap_space=0)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["num_swaps_out"] == 0
    assert s["num_swap_full_recomputes"] == s["num_preemptions"] and s["swap_space_bytes"] == 0


def test_swap_space_is_bounded(ckpt, prompts, expected):
    """Room for one swapped request's copy at a time: some swaps, some recomputes, same tokens."""
    probe = make_llm(ckpt, max_num_seqs=8, num_kv_blocks=16, max_num_batched_tokens=32)
    one_block = probe.engine.runner.host_copy_nbytes(1)
    llm = make_llm(ckpt, max_num_seqs=8, num_kv_blocks=16, max_num_batched_tokens=32, preemption_mode="swap",
                   swap_space=4 * one_block / (1 << 30))             # GiB, as vLLM's
    peak = 0
    from qwen_ops.engine.batch import RequestId

    reqs = [llm.add_request(p, GREEDY) for p in prompts]
    held = {r: llm.scheduler.requests[RequestId(int(r))] for r in reqs}
    while llm.has_unfinished_requests():
        llm.step()
        peak = max(peak, llm.stats()["swap_bytes_used"])
    assert 0 < peak <= 4 * one_block
    s = llm.stats()
    assert s["num_swaps_out"] > 0 and s["num_swap_full_recomputes"] > 0 and s["swap_bytes_used"] == 0
    assert [held[r].output_token_ids for r in reqs] == expected
    assert not llm.scheduler.requests


def test_default_swap_space_is_a_share_of_host_memory(ckpt):
    from qwen_ops.serving.llm import default_swap_space_bytes

    llm = make_llm(ckpt, preemption_mode="swap")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert llm.stats()["swap_space_bytes"] == default_swap_space_bytes() == min(4 << 30, host // 4)


def test_threads_share_one_llm(ckpt, prompts, expected):
    """4 threads calling one LLM at once (generate and stream) each get their own, correct outputs."""
    llm = make_llm(ckpt, max_num_seqs=4, num_kv_blocks=24, max_num_batched_tokens=16)
    jobs = [prompts[0:3], prompts[3:5], prompts[5:8], prompts[8:10]]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def worker(k: int) -> None:
        try:
            start.wait()
            if k % 2:
                final = {}
                for u in llm.stream(jobs[k], GREEDY):
                    final[u.request_id] = u.outputs[0].token_ids
                results[k] = list(final.values())
            else:
                results[k] = [o.outputs[0].token_ids for o in llm.generate(jobs[k], GREEDY)]
        except BaseException as e:          # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    sequential = [expected[0:3], expected[3:5], expected[5:8], expected[8:10]]
    assert [sorted(results[k]) for k in range(len(jobs))] == [sorted(x) for x in sequential]
    assert [results[k] for k in (0, 2)] == [sequential[0], sequential[2]]     # generate keeps prompt order
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["num_running"] == s["num_waiting"] == 0


def test_kv_budget_too_small_for_one_sequence(ckpt):
    with pytest.raises(ValueError, match="num_kv_blocks = 3"):
        make_llm(ckpt, num_kv_blocks=3)


# ----------------------------------------------------------------------------- sizes checked before allocating
def test_a_huge_max_position_embeddings_costs_only_max_model_len_rows(tmp_path):
    # 2**22 positions: the whole RoPE table would be 256 MB here (1e9 positions was 8 GB); the LLM
    # builds the rows its max_model_len can reach: the default one is what the KV cache holds (issue 62; it was
    # capped at 4096), here 64 blocks of 16.
    ckpt = make_qwen3_checkpoint(tmp_path / "long", max_position_embeddings=1 << 22)
    llm = LLM(ckpt, max_model_len=96, max_num_seqs=2, num_kv_blocks=64)
    assert llm.engine.model.model.rotary_emb.cos_sin.shape[0] == 96
    assert LLM(ckpt, max_num_seqs=1, num_kv_blocks=64).engine.model.model.rotary_emb.cos_sin.shape[0] == 1024
    with pytest.raises(ValueError, match=r"max_model_len = 4194305, but the model supports max_position_embeddings"):
        LLM(ckpt, max_model_len=(1 << 22) + 1)


@pytest.mark.parametrize("kwargs, named", [(dict(num_kv_blocks=10 ** 12), "num_kv_blocks = 1000000000000"),
                                           (dict(block_size=10 ** 9), "block_size = 1000000000")])
def test_kv_sizes_beyond_memory_are_refused_by_name(ckpt, kwargs, named):
    with pytest.raises(ValueError) as info:
        LLM(ckpt, max_model_len=64, **kwargs)
    assert named in str(info.value) and "is available" in str(info.value)


def test_chunked_prefill_runs_the_lm_head_only_on_rows_that_are_sampled(ckpt, prompts, expected):
    """A prompt chunk that does not reach its prompt's end has no token to sample: the LM head skips
    its row (a hook on ``lm_head`` counts the rows it sees), and greedy tokens still equal transformers'.
    Prompts of up to 19 tokens under a budget of 7 take up to three chunks; three sequences share
    steps, so a skipped row can sit between rows that are sampled."""
    llm = make_llm(ckpt, max_num_seqs=3, max_num_batched_tokens=7)
    rows = []
    handle = llm.engine.model.lm_head.register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        handle.remove()
    assert [o.outputs[0].token_ids for o in outs] == expected
    # one row per sampled token: each prompt's last chunk, then each decode step's rows
    assert sum(rows) == len(prompts) * GREEDY.max_new_tokens
    assert 0 in rows                   # a step of partial chunks only: no row for the LM head
