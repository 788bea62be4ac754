"""AsyncLLM's engine core in a child process (``from_pretrained``'s default): the same outputs as
the core on a thread, errors from the child raised here, and no process left behind however the
parent ends (shutdown, a dead child, the parent exiting or killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from qwen_ops import LLM, SamplingParams
from qwen_ops.models.defaults import default_model_path
from qwen_ops.serving.async_llm import AsyncLLM, EngineDeadError

from oracles import TransformersGreedy

KWARGS = {"max_num_seqs": 8, "max_model_len": 512}
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "class Stack:"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def proc_engine():
    eng = AsyncLLM.from_pretrained(None, **KWARGS)
    assert eng.llm is None and eng._core.process.poll() is None
    yield eng
    eng.shutdown()
    assert eng._core.process.poll() is not None and not eng._core.thread.is_alive()


@pytest.fixture(scope="module")
def thread_engine():
    eng = AsyncLLM(LLM(None, **KWARGS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def oracle():
    """transformers on the same (default) checkpoint, fp32 eager: the outside oracle."""
    oracle = TransformersGreedy(default_model_path())
    return oracle


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=24, temperature=0.0),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=2, logprobs=2),
            SamplingParams(max_tokens=40, temperature=0.0, stop=["\n\n", "return"], logprobs=0),
            SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=11, min_tokens=8)]


async def _run(engine, prompt, sp):
    updates = []
    async for out in engine.generate(prompt, sp):
        updates.append(out)
    return updates


def _collect(engine):
    async def main():
        return await asyncio.wait_for(asyncio.gather(*[_run(engine, p, sp) for p, sp in zip(PROMPTS, _params())]), 120)
    return asyncio.run(main())


def _summary(out):
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
                                              for e in c.logprobs])
            for c in out.outputs]


@pytest.fixture(scope="module")
def collected(proc_engine, thread_engine):
    """Every update of ``_params()``'s requests, from the process core and from the thread core."""
    return _collect(proc_engine), _collect(thread_engine)


def test_process_core_outputs_equal_thread_core(proc_engine, thread_engine, collected):
    got, want = collected
    for g, w in zip(got, want):
        assert g[-1].finished and w[-1].finished
        assert not any(u.finished for u in g[:-1])
        assert _summary(g[-1]) == _summary(w[-1])
        assert g[-1].prompt_token_ids == w[-1].prompt_token_ids and g[-1].prompt == w[-1].prompt
        # The updates' new tokens add up to the completions' tokens, in order.
        new = [t for u in g for t in u.new_token_ids]
        assert sorted(new) == sorted(t for c in g[-1].outputs for t in c.token_ids)
        m = g[-1].metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time
    assert got[2][-1].outputs[0].finish_reason in ("stop", "length")
    assert len(got[1][-1].outputs) == 2 and got[1][-1].outputs[0].logprobs is not None
    s = proc_engine.stats()
    assert s["num_running"] == 0 and s["free_blocks"] == s["total_blocks"]


def _oracle_completion(oracle, llm, prompt_ids, sp):
    """transformers' greedy completion of a request with ``sp``, ended as the engine ends it: after
    ``max_tokens``, at the first stop token (EOS unless ``ignore_eos``), or at the first token whose
    text completes a stop string. Returns (token_ids, text, finish_reason, stop_reason)."""
    assert sp.temperature == 0.0 and sp.n == 1 and not sp.min_tokens and not sp.include_stop_str_in_output
    stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(llm.engine.eos_token_ids))
    tokens = oracle(prompt_ids, sp.max_tokens, eos=sorted(stop_ids) or None)
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)  # noqa: E731
    for k in range(1, len(tokens) + 1):
        text = decode(tokens[:k])
        found = sorted((text.find(s), s) for s in sp.stop if s in text)
        if found:
            at, stop = found[0]
            return tokens[:k], text[:at], "stop", stop
    if tokens[-1] in stop_ids:
        return tokens, decode(tokens), "stop", tokens[-1]
    return tokens, decode(tokens), "length", None


def test_greedy_outputs_equal_transformers(thread_engine, collected, oracle):
    """The greedy requests' completions (tokens, text, why they ended), from both cores, are
    transformers' greedy ones: the two cores agreeing is not enough (a wrong kernel agrees too)."""
    llm = thread_engine.llm
    checked = 0
    for sp, g, w in zip(_params(), *collected):
        if sp.temperature != 0.0:
            continue
        tokens, text, finish, stop = _oracle_completion(oracle, llm, g[-1].prompt_token_ids, sp)
        for out in (g[-1], w[-1]):
            c = out.outputs[0]
            assert c.token_ids == tokens, out.prompt
            assert (c.text, c.finish_reason, c.stop_reason) == (text, finish, stop), out.prompt
        checked += 1
    assert checked == 2


@torch.no_grad()
def test_logprobs_equal_transformers(collected, oracle):
    """Every returned logprob (the chosen token's, with its rank, and the top ones), sampled or
    greedy, is transformers' fp32 log_softmax at that position given the tokens before it."""
    checked = 0
    for sp, g, w in zip(_params(), *collected):
        if sp.logprobs is None:
            continue
        for out in (g[-1], w[-1]):
            prompt = list(out.prompt_token_ids)
            for c in out.outputs:
                ids = prompt + list(c.token_ids)
                logits = oracle.model(torch.tensor([ids])).logits[0, len(prompt) - 1:len(ids) - 1]
                ref = torch.log_softmax(logits.float(), dim=-1)
                assert len(c.logprobs) == len(c.token_ids) == len(ref)
                for tok, entry, lp in zip(c.token_ids, c.logprobs, ref):
                    assert abs(entry[tok].logprob - float(lp[tok])) < 1e-4
                    assert entry[tok].rank == int((lp > lp[tok]).sum()) + 1
                    top = lp.topk(sp.logprobs) if sp.logprobs else None
                    if top is not None:
                        for rank, (tid, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                            assert abs(entry[tid].logprob - v) < 1e-4
                            assert tid == tok or entry[tid].rank == rank
                    assert len(entry) in (max(sp.logprobs, 1), sp.logprobs + 1)
                assert abs(c.cumulative_logprob - float(sum(lp[t] for t, lp in zip(c.token_ids, ref)))) < 1e-3
                checked += 1
    assert checked == 2 * 3          # the n = 2 sampled request and the greedy one, from each core


def test_validation_happens_in_the_caller(proc_engine):
    async def main():
        with pytest.raises(ValueError, match=r"prompts\[0\] has 600 tokens; max_model_len = 512"):
            await _run(proc_engine, list(range(3, 603)), SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] = 99999"):
            await _run(proc_engine, [5, 99999], SamplingParams(max_tokens=2))
    asyncio.run(main())
    assert proc_engine.is_running


def test_consumer_leaving_aborts_in_the_child(proc_engine):
    async def main():
        agen = proc_engine.generate(PROMPTS[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        first = await asyncio.wait_for(agen.__anext__(), 30)
        assert not first.finished
        await agen.aclose()
        for _ in range(300):                          # bounded: 3 s
            s = proc_engine.stats()
            if s["num_running"] == 0 and s["free_blocks"] == s["total_blocks"]:
                return s
            await asyncio.sleep(0.01)
        return proc_engine.stats()

    s = asyncio.run(main())
    assert s["num_running"] == 0 and s["free_blocks"] == s["total_blocks"], s


def test_a_bad_argument_is_raised_from_the_child():
    with pytest.raises(ValueError, match="block_size = 0"):
        AsyncLLM.from_pretrained(None, block_size=0)
    with pytest.raises(ValueError, match="engine_process = 'yes'"):
        AsyncLLM.from_pretrained(None, engine_process="yes")
    with pytest.raises(ValueError, match="model = 5"):
        AsyncLLM.from_pretrained(5)


def test_a_dead_child_fails_every_stream_and_new_requests():
    eng = AsyncLLM.from_pretrained(None, **KWARGS)
    try:
        async def main():
            agen = eng.generate(PROMPTS[0], SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True))
            await asyncio.wait_for(agen.__anext__(), 30)
            eng._core.process.kill()
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="died"):
                async with asyncio.timeout(10):
                    async for _ in agen:
                        pass
            assert time.monotonic() - start < 10
            assert not eng.is_running
            with pytest.raises(EngineDeadError):
                await _run(eng, PROMPTS[1], SamplingParams(max_tokens=2))
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_shutdown_fails_open_streams():
    eng = AsyncLLM.from_pretrained(None, **KWARGS)

    async def main():
        agen = eng.generate(PROMPTS[0], SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True))
        await asyncio.wait_for(agen.__anext__(), 30)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(10):
                async for _ in agen:
                    pass
    asyncio.run(main())
    assert eng._core.process.poll() is not None


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie (exited, parent gone and not yet reaped by init) counts as gone.
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_no_orphan_when_the_parent_ends(ending, tmp_path):
    """No ``shutdown()``: a parent that simply exits, or is killed, leaves no engine process."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        from qwen_ops.serving.async_llm import AsyncLLM
        eng = AsyncLLM.from_pretrained(None, max_num_seqs=2, max_model_len=128)
        print(eng._core.process.pid, flush=True)
        if {ending!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == (-signal.SIGKILL if ending == "sigkill" else 0), proc.stderr
    child = int(proc.stdout.split()[0])
    assert _gone(child), f"engine core process {child} outlived its parent ({ending})"


def test_serve_cli_end_to_end_and_ctrl_c():
    """``qwen-ops serve`` as a user runs it: answers an ``openai`` client, then SIGINT stops the
    server and its engine core process."""
    import socket

    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", "--port", str(port),
                             "--max-num-seqs", "4", "--max-model-len", "256", "--api-key", "k",
                             "--uvicorn-log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "qwen-ops serve did not come up within 90 s"
            time.sleep(0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1                    # the engine core
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60) as c:
            chunks = list(c.chat.completions.create(model="qwen-ops-default", max_tokens=8, temperature=0,
                                                    messages=[{"role": "user", "content": "hi"}], stream=True))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) in (0, 130)             # 130: the CLI's "interrupted"
        assert _gone(int(children[0]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _with_kind(sp: SamplingParams, kind) -> SamplingParams:
    import dataclasses

    fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)
              if f.name not in ("max_new_tokens", "top_k", "logit_bias", "bad_words_token_ids")}
    return SamplingParams(max_tokens=sp.max_new_tokens, top_k=sp.top_k, **{**fields, "output_kind": kind})


def _fold(deltas):
    """DELTA outputs concatenated per completion: text, token ids, logprobs; the last finish fields."""
    by = {}
    for out in deltas:
        for c in out.outputs:
            t, ids, lps, _ = by.get(c.index, ("", [], None if c.logprobs is None else [], None))
            by[c.index] = (t + c.text, ids + list(c.token_ids), None if lps is None else lps + list(c.logprobs),
                           (c.finish_reason, c.stop_reason, c.cumulative_logprob))
    return [(i, t, ids, *fin[:2], fin[2],
             None if lps is None else [{k: (v.logprob, v.rank, v.decoded_token) for k, v in e.items()} for e in lps])
            for i, (t, ids, lps, fin) in sorted(by.items())]


@pytest.mark.parametrize("core", ["proc", "thread"])
def test_output_kinds_delta_and_final_only(core, proc_engine, thread_engine, collected):
    """vLLM's ``output_kind``: DELTA outputs hold only what is new (each token once, only the
    completions that changed), and folded they are the cumulative final output (the feature turned
    off, from the same core: greedy and seeded requests repeat); FINAL_ONLY yields one finished
    output equal to it. The cumulative outputs' greedy tokens are checked against transformers above."""
    from qwen_ops import RequestOutputKind

    engine, cumulative = (proc_engine, collected[0]) if core == "proc" else (thread_engine, collected[1])

    async def run(kind):
        return await asyncio.wait_for(asyncio.gather(*[_run(engine, p, _with_kind(sp, kind))
                                                       for p, sp in zip(PROMPTS, _params())]), 120)

    deltas, finals = asyncio.run(run(RequestOutputKind.DELTA)), asyncio.run(run(RequestOutputKind.FINAL_ONLY))
    for sp, d, f, want in zip(_params(), deltas, finals, cumulative):
        assert _fold(d) == _summary(want[-1]), want[-1].prompt
        assert d[-1].finished and not any(o.finished for o in d[:-1])
        assert sum(len(o.new_token_ids) for o in d) == sum(len(c.token_ids) for c in want[-1].outputs)
        for o in d:             # each output names only completions with something new (or their end)
            assert all(c.text or c.token_ids or c.finish_reason for c in o.outputs)
        assert len(f) == 1 and f[0].finished and _summary(f[0]) == _summary(want[-1])
        assert f[0].new_token_ids == [t for c in want[-1].outputs for t in c.token_ids] or sp.n > 1


def test_output_kind_is_checked():
    for bad in (3, "delta", None, True):
        with pytest.raises(ValueError, match="output_kind = .*expected a RequestOutputKind"):
            SamplingParams(output_kind=bad)
