"""What LLM hands back beyond token ids: stop strings, logprobs, n > 1, min_tokens, streamed text;
and the AsyncLLM that the server runs on. The embedded model (it has a tokenizer)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from qwen_ops import LLM, RequestOutput, SamplingParams
from qwen_ops.models.defaults import default_model_path
from qwen_ops.serving.async_llm import AsyncLLM, EngineDeadError, QueueFullError

from oracles import TransformersGreedy

PROMPTS = ["def fibonacci(n):", "import os\n", "class Foo:", "    return"]
EOS_PROMPT = "def f():\n    return 1\n<|endoftext|>"     # greedy reaches an EOS id within 24 tokens


def greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8, max_model_len=256, check_invariants=True)


@pytest.fixture(scope="module")
def oracle():
    """transformers on the same checkpoint (fp32, eager attention): the outside oracle."""
    oracle = TransformersGreedy(default_model_path())
    return oracle


@pytest.fixture(scope="module")
def plain(llm):
    """Greedy outputs with no stop strings: what the stop-string tests cut."""
    return llm.generate(PROMPTS, greedy())


def _oracle_tokens(oracle, llm, prompt_ids, sp: SamplingParams) -> list[int]:
    """transformers' greedy completion for a request with ``sp`` (no stop strings): ``max_tokens``
    tokens, cut after the first stop token (EOS unless ``ignore_eos``, and ``stop_token_ids``)."""
    assert sp.temperature == 0.0 and not sp.stop and not sp.min_tokens
    stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(llm.engine.eos_token_ids))
    return oracle(prompt_ids, sp.max_tokens, eos=sorted(stops) or None)


def test_plain_is_transformers_greedy(llm, plain, oracle):
    """The greedy outputs every other test here builds on are transformers' greedy tokens."""
    sp = greedy()
    for o in plain:
        c = o.outputs[0]
        assert c.token_ids == _oracle_tokens(oracle, llm, o.prompt_token_ids, sp), o.prompt
        assert len(c.token_ids) == sp.max_tokens and c.finish_reason == "length"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_greedy_at_eos_is_transformers_greedy(llm, oracle, ignore_eos):
    """A greedy completion that reaches an EOS id is transformers' greedy tokens up to it, where
    it ends unless ``ignore_eos`` (then it goes on, as transformers' does, to ``max_tokens``)."""
    sp = greedy(ignore_eos=ignore_eos)
    out = llm.generate(EOS_PROMPT, sp)[0]
    c = out.outputs[0]
    want = _oracle_tokens(oracle, llm, out.prompt_token_ids, sp)
    assert c.token_ids == want
    eos_at = [i for i, t in enumerate(want) if t in llm.engine.eos_token_ids]
    assert eos_at and eos_at[0] < sp.max_tokens - 1, "EOS_PROMPT's greedy completion no longer reaches an EOS"
    if ignore_eos:
        assert len(want) == sp.max_tokens and c.finish_reason == "length"
    else:
        assert len(want) == eos_at[0] + 1 and c.finish_reason == "stop" and c.stop_reason == want[-1]
    _assert_no_leak(llm)


def test_greedy_at_a_stop_token_is_transformers_greedy(llm, plain, oracle):
    """A stop token that greedy picks mid-completion ends it where transformers' greedy picks it."""
    for o in plain[:2]:
        stop = o.outputs[0].token_ids[5]
        sp = greedy(stop_token_ids=[stop])
        c = llm.generate(o.prompt, sp)[0].outputs[0]
        want = _oracle_tokens(oracle, llm, o.prompt_token_ids, sp)
        assert c.token_ids == want and want[-1] == stop and len(want) <= 6
        assert c.finish_reason == "stop" and c.stop_reason == stop
    _assert_no_leak(llm)


def _assert_no_leak(llm):
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0
    assert not llm.core.outputs.states and not llm.core.outputs.completions


def test_text_is_the_decoded_tokens(llm, plain):
    for o in plain:
        c = o.outputs[0]
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def _a_stop_string(text: str) -> str:
    """A substring of the completion that starts past its first few characters."""
    for start in range(3, len(text) - 2):
        piece = text[start:start + 2]
        if piece.strip():
            return piece
    pytest.skip("completion too short to pick a stop string from")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(llm, plain, include):
    for o in plain[:3]:
        full = o.outputs[0].text
        stop = _a_stop_string(full)
        at = full.find(stop)
        out = llm.generate(o.prompt, greedy(stop=["\x00never", stop], include_stop_str_in_output=include))[0]
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == full[:at + (len(stop) if include else 0)]
        # Generation stopped at the token that completed the string, not later.
        assert len(c.token_ids) < len(o.outputs[0].token_ids)
        assert c.token_ids == o.outputs[0].token_ids[:len(c.token_ids)]
        assert stop in llm.tokenizer.decode(c.token_ids)
        assert stop not in llm.tokenizer.decode(c.token_ids[:-1])
    _assert_no_leak(llm)


def test_min_tokens_delays_stop_strings(llm, plain):
    full = plain[0].outputs[0]
    stop = _a_stop_string(full.text)
    first = llm.generate(PROMPTS[0], greedy(stop=stop))[0].outputs[0]
    later = llm.generate(PROMPTS[0], greedy(stop=stop, min_tokens=len(first.token_ids) + 1))[0].outputs[0]
    assert len(later.token_ids) > len(first.token_ids)


def test_min_tokens_masks_stop_tokens(llm, plain):
    """A stop token that greedy picks first cannot be picked before min_tokens tokens."""
    tokens = plain[1].outputs[0].token_ids
    stop_token = tokens[0]
    early = llm.generate(PROMPTS[1], greedy(stop_token_ids=[stop_token]))[0].outputs[0]
    assert early.token_ids == [stop_token] and early.finish_reason == "stop" and early.stop_reason == stop_token
    held = llm.generate(PROMPTS[1], greedy(stop_token_ids=[stop_token], min_tokens=5))[0].outputs[0]
    assert len(held.token_ids) >= 5 and stop_token not in held.token_ids[:5]


def test_streamed_text_is_the_final_text_and_never_shows_a_partial_stop(llm, plain):
    full = plain[0].outputs[0].text
    stop = _a_stop_string(full)
    longer = stop + "\x01\x02"            # never completes: only its first characters could ever show
    seen = []
    for out in llm.stream(PROMPTS[0], greedy(stop=[longer, stop])):
        seen.append(out.outputs[0].text)
    final = seen[-1]
    assert final == full[:full.find(stop)]
    for text in seen:
        assert final.startswith(text) or text.startswith(final)
        assert stop not in text


@torch.no_grad()
def _reference_logprobs(oracle, prompt_ids, token_ids):
    """transformers' log_softmax (fp32) of its logits for each generated position: one forward of
    prompt + completion, the row before each generated token."""
    ids = list(prompt_ids) + list(token_ids)
    logits = oracle.model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:len(ids) - 1]
    return list(torch.log_softmax(logits.float(), dim=-1))


def test_logprobs_match_the_model(llm, oracle):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    ref = _reference_logprobs(oracle, out.prompt_token_ids, c.token_ids)
    total = 0.0
    for tok, entry, lp in zip(c.token_ids, c.logprobs, ref):
        assert tok in entry and len(entry) in (3, 4)          # the sampled token, plus the top 3
        assert math.isclose(entry[tok].logprob, float(lp[tok]), abs_tol=1e-4)
        assert entry[tok].rank == int((lp > lp[tok]).sum()) + 1
        top = lp.topk(3)
        for rank, (tid, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert math.isclose(entry[tid].logprob, v, abs_tol=1e-4)
            if tid != tok:
                assert entry[tid].rank == rank
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok])
        total += entry[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)
    zero = llm.generate(PROMPTS[0], greedy(max_tokens=3, logprobs=0))[0].outputs[0]
    assert all(list(e) == [t] for e, t in zip(zero.logprobs, zero.token_ids))
    assert all(e[t].rank == 1 for e, t in zip(zero.logprobs, zero.token_ids))   # greedy: the top token
    assert zero.token_ids == oracle(out.prompt_token_ids, 3)
    for tok, entry, lp in zip(zero.token_ids, zero.logprobs, _reference_logprobs(oracle, out.prompt_token_ids,
                                                                                   zero.token_ids)):
        assert math.isclose(entry[tok].logprob, float(lp.max()), abs_tol=1e-4)
    assert llm.generate(PROMPTS[0], greedy(max_tokens=3))[0].outputs[0].logprobs is None


def test_n_completions_use_derived_seeds(llm):
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3, ignore_eos=True)
    out = llm.generate(PROMPTS[2], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        alone = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i,
                                                        ignore_eos=True))[0].outputs[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three seeds, three different samples"
    streamed = list(llm.stream(PROMPTS[2], sp))
    assert [c.token_ids for c in streamed[-1].outputs] == [c.token_ids for c in out.outputs]
    assert sum(len(o.new_token_ids) for o in streamed) == 30
    _assert_no_leak(llm)


def test_abort_by_id_aborts_every_completion(llm):
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=50, n=2, seed=1, ignore_eos=True))
    llm.step()
    llm.abort(rid)
    _assert_no_leak(llm)


def test_bad_new_fields_name_themselves():
    for kw, msg in ((dict(n=0), "n = 0"), (dict(stop=[""]), r"stop\[0\]"), (dict(logprobs=-2), "logprobs = -2"),
                    (dict(min_tokens=-1), "min_tokens = -1"), (dict(stop=3), "stop = 3")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)


def test_engine_slot_api_rejects_n():
    from qwen_ops.engine.engine import QwenEngine
    from qwen_ops.models.defaults import default_model_path

    eng = QwenEngine.from_pretrained(default_model_path(), max_slots=1, max_seq_len=64)
    with pytest.raises(ValueError, match="n = 2"):
        eng.prefill([1, 2, 3], sampling=SamplingParams(n=2))
    assert eng.prefill([1, 2, 3]).next_token >= 0


# ---------------------------------------------------------------------------------- AsyncLLM
@pytest.fixture(scope="module")
def engine(llm):
    eng = AsyncLLM(llm, max_waiting_requests=40)
    yield eng
    eng.shutdown()
    assert not eng._core.thread.is_alive()


async def _final(engine, prompt, sp, **kw):
    last = None
    async for out in engine.generate(prompt, sp, **kw):
        assert last is None or not last.finished
        last = out
    return last


def test_async_outputs_equal_offline(engine, llm, plain):
    async def main():
        return await asyncio.wait_for(asyncio.gather(*[_final(engine, p, greedy()) for p in PROMPTS * 4]), 60)

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain] * 4
    assert all(o.finished for o in outs)
    _assert_no_leak(llm)


def test_async_consumer_leaving_aborts_and_frees(engine, llm):
    async def main():
        agen = engine.generate(PROMPTS[0], greedy(max_tokens=200))
        first = await asyncio.wait_for(agen.__anext__(), 30)
        assert not first.finished
        await agen.aclose()

        async def consume():
            async for _ in engine.generate(PROMPTS[1], greedy(max_tokens=200)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):                        # bounded: 2 s
            s = engine.stats()
            if s["free_blocks"] == s["total_blocks"] and s["num_running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main()), engine.stats()
    _assert_no_leak(llm)


def test_async_errors(engine, llm):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await _final(engine, list(range(3, 400)), greedy())
        with pytest.raises(ValueError, match="top_p"):
            await _final(engine, "x", {"top_p": 2})          # not a SamplingParams
        agen = engine.generate("a", greedy(max_tokens=100), request_id="dup")
        await agen.__anext__()
        with pytest.raises(ValueError, match="'dup' is already in flight"):
            await _final(engine, "b", greedy(), request_id="dup")
        await agen.aclose()

    asyncio.run(main())


def test_async_queue_is_bounded(llm):
    eng = AsyncLLM(llm, max_waiting_requests=1)
    try:
        async def main():
            gens = [eng.generate(PROMPTS[0], greedy(max_tokens=200)) for _ in range(50)]
            firsts = await asyncio.wait_for(asyncio.gather(*[g.__anext__() for g in gens], return_exceptions=True), 60)
            for g in gens:
                await g.aclose()
            full = [f for f in firsts if isinstance(f, QueueFullError)]
            assert full and "max_waiting_requests = 1" in str(full[0])
            assert all(isinstance(f, (QueueFullError, RequestOutput)) for f in firsts)
            assert any(isinstance(f, RequestOutput) for f in firsts)

        asyncio.run(main())
    finally:
        eng.shutdown()
    _assert_no_leak(llm)          # shutdown aborts whatever the loop had admitted


def test_async_failure_fails_only_that_iteration(engine, llm, plain, monkeypatch):
    real = llm.engine.runner.step
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real(plan)

    monkeypatch.setattr(llm.engine.runner, "step", flaky)

    async def main():
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            await _final(engine, PROMPTS[0], greedy())
        return await _final(engine, PROMPTS[0], greedy())        # the loop still serves

    out = asyncio.run(main())
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    _assert_no_leak(llm)


def test_async_after_shutdown(llm):
    eng = AsyncLLM(llm)
    eng.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            await _final(eng, "x", greedy())

    asyncio.run(main())


def _random_deltas(n: int, steps: int, seed: int):
    """Hand-made engine deltas of one request with ``n`` completions: random new tokens, text and
    logprobs per step, completions finishing at different steps, prompt logprobs once."""
    import random

    from qwen_ops.serving.outputs import CompletionDelta, Logprob, RequestDelta

    rng = random.Random(seed)
    ends = [rng.randrange(1, steps + 1) for _ in range(n)]
    cum = [0.0] * n
    deltas = []
    for step in range(1, steps + 1):
        comps = []
        for i in range(n):
            if step > ends[i] or rng.random() < 0.3 and step < ends[i]:
                continue                    # finished earlier, or nothing new this step
            ids = [rng.randrange(100) for _ in range(rng.randrange(1, 3))]
            lps = [{t: Logprob(-rng.random(), 1, str(t))} for t in ids]
            cum[i] += sum(next(iter(e.values())).logprob for e in lps)
            done = step == ends[i]
            comps.append(CompletionDelta(i, ids, "".join(chr(97 + t % 26) for t in ids), "stop" if done else None,
                                         None, cum[i], lps))
        deltas.append(RequestDelta("r", step == steps, comps, 1.0, 2.0, 3.0 + step,
                                   prompt_logprobs=[None, {5: Logprob(-1.0, 1, "x")}] if step == 2 else None))
    return deltas


@pytest.mark.parametrize("seed", range(6))
def test_delta_accumulator_against_the_cumulative_one(seed):
    """``RequestOutputKind.DELTA`` folding (several engine deltas per output, as a slow consumer
    gets them), and ``merge_delta_outputs`` of two unconsumed outputs, against the cumulative
    accumulator (the feature off) fed the same deltas: concatenated, the deltas are its outputs."""
    import random

    from qwen_ops import RequestOutputKind
    from qwen_ops.serving.outputs import RequestAccumulator, merge_delta_outputs

    n = 1 + seed % 3
    deltas = _random_deltas(n, 12, seed)
    params = SamplingParams(n=n, logprobs=1, output_kind=RequestOutputKind.DELTA)
    cum_acc = RequestAccumulator("r", None, [1, 2], params, cumulative=True)
    delta_acc = RequestAccumulator("r", None, [1, 2], params)
    rng = random.Random(seed)
    outs, i = [], 0
    while i < len(deltas):                      # fold 1-3 deltas per output
        k = rng.randrange(1, 4)
        new = []
        for d in deltas[i:i + k]:
            cum_new = cum_acc.apply(d)
            new += delta_acc.apply(d)
            assert cum_new == [t for c in d.completions for t in c.token_ids]
        i += k
        outs.append(delta_acc.output(new))
        cum_out = cum_acc.output(new)
    merged = outs[0]
    for o in outs[1:]:                          # a consumer that took none of them merges them all
        merged = merge_delta_outputs(merged, o)
    for got in (merged, _concat(outs, n)):
        assert got.finished and cum_out.finished
        assert [(c.index, c.text, c.token_ids, c.finish_reason, c.cumulative_logprob,
                 [list(e) for e in c.logprobs]) for c in got.outputs] == \
               [(c.index, c.text, c.token_ids, c.finish_reason, c.cumulative_logprob,
                 [list(e) for e in c.logprobs]) for c in cum_out.outputs if c.token_ids or c.finish_reason]
    assert sum(o.prompt_logprobs is not None for o in outs) == 1, "prompt logprobs once, in one delta output"
    assert merged.prompt_logprobs == cum_out.prompt_logprobs
    for o in outs:                              # only completions with something new
        assert all(c.text or c.token_ids or c.finish_reason for c in o.outputs)


def _concat(outs, n):
    """The deltas concatenated per completion, by hand (no merge_delta_outputs)."""
    from qwen_ops.serving.outputs import CompletionOutput

    by = {}
    for o in outs:
        for c in o.outputs:
            a = by.get(c.index)
            by[c.index] = c if a is None else CompletionOutput(
                c.index, a.text + c.text, a.token_ids + c.token_ids, c.finish_reason, c.stop_reason,
                c.cumulative_logprob, a.logprobs + c.logprobs)
    return RequestOutput("r", None, [1, 2], [by[i] for i in sorted(by)], outs[-1].finished)
