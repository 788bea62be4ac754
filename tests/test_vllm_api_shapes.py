"""vLLM's API shapes the examples use (issue 62): a mutable, validated ``SamplingParams`` no request
shares with its caller; ``LLMEngine`` stepped by hand; ``LLM.reset_prefix_cache``; ``LLM.get_metrics``
in ``vllm.v1.metrics.reader``'s shapes; ``LLM.start_profile`` / ``stop_profile``; ``AsyncLLM`` at
``vllm.v1.engine.async_llm``.

Oracles: the constructor's own error for a bad assignment; transformers' greedy tokens for what
``LLMEngine`` generates; the prompts' token ids and ``max_tokens`` (ignore_eos) for the token counters;
a plain loop for the histogram buckets; the test's own clock for latencies; prefix-cache hits
(``num_cached_tokens``) for a reset; the Chrome trace's JSON for the profile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

import qwen_ops
from qwen_ops import EngineArgs, LLMEngine, SamplingParams
from qwen_ops.engine.sampling import GREEDY
from qwen_ops.serving.llm import LLM, profiler_dir
from qwen_ops.v1.metrics.reader import Counter, Gauge, Histogram, Vector

from oracles import TransformersGreedy

MODEL = qwen_ops.default_model_path()
# Prompts as token ids: the counters' oracle is their length, with no tokenizer in between.
PROMPT_IDS = [[35, 820, 68, 346, 1352, 426, 300, 76], [310, 275, 408], [16, 17, 18, 19, 20, 21]]
MAX_TOKENS = 5
GREEDY_FIXED = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LONG_PROMPT = list(range(100, 150))           # 50 tokens: 3 full blocks of 16 to cache


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL)


@pytest.fixture(scope="module")
def oracle():
    return TransformersGreedy(MODEL)


# ------------------------------------------------------------------------------ SamplingParams
# (field, a good value, a bad value): each assignment as the constructor would take it.
ASSIGNMENTS = [("temperature", 0.5, -1.0), ("top_p", 0.9, 0.0), ("top_k", 5, -2), ("max_new_tokens", 100, 0),
               ("min_tokens", 3, -1), ("stop", ["\n"], [""]), ("n", 2, 0), ("seed", 7, 2 ** 63),
               ("logit_bias", {3: 1.5}, {3: 500.0}), ("presence_penalty", 0.5, 3.0)]


@pytest.mark.parametrize("name,good,bad", ASSIGNMENTS, ids=[a[0] for a in ASSIGNMENTS])
def test_assignment_is_checked_as_the_constructor_checks(name, good, bad):
    base = {"max_new_tokens": 10, "temperature": 0.8}
    sp = SamplingParams(**base)
    setattr(sp, name, good)
    assert sp == SamplingParams(**{**base, name: good})
    before = sp.clone()
    with pytest.raises(ValueError) as constructor:
        SamplingParams(**{**base, name: bad})
    with pytest.raises(ValueError) as assigned:
        setattr(sp, name, bad)
    assert str(assigned.value) == str(constructor.value)
    assert sp == before, "a refused assignment leaves the parameters as they were"


def test_max_tokens_assignable_and_cross_field_rules_hold():
    sp = SamplingParams(min_tokens=4)
    sp.max_tokens = 100
    assert sp.max_new_tokens == sp.max_tokens == 100
    with pytest.raises(ValueError, match=r"^min_tokens = 4, expected an int in \[0, max_tokens = 2\]$"):
        sp.max_tokens = 2
    sp.stop = "END"
    with pytest.raises(ValueError, match="detokenize = False"):
        sp.detokenize = False
    with pytest.raises(AttributeError, match="'temprature'"):
        sp.temprature = 0.5
    with pytest.raises(TypeError, match="unhashable"):         # mutable, as vLLM's
        hash(sp)


def test_shared_constants_refuse_assignment_and_clones_are_independent():
    with pytest.raises(AttributeError, match="read-only"):
        GREEDY.temperature = 1.0
    mine = GREEDY.clone()
    mine.temperature = 1.0
    assert GREEDY.temperature == 0.0 and mine.temperature == 1.0
    a = SamplingParams(extra_args={"k": [1]})
    b = a.clone()
    b.extra_args["k"].append(2)
    assert a.extra_args == {"k": [1]}


def test_default_sampling_params_are_a_fresh_copy(llm):
    first = llm.get_default_sampling_params()
    first.max_tokens, first.temperature = 3, 0.25
    second = llm.get_default_sampling_params()
    assert second is not first and second == SamplingParams(**llm.sampling_overrides)


def test_changing_params_after_add_request_changes_no_request(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rid = llm.add_request(PROMPT_IDS[0], sp)
    sp.max_tokens, sp.temperature = 1, 1.0             # the caller reuses its object
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert len(done[rid].outputs[0].token_ids) == 6


# ------------------------------------------------------------------------------------- LLMEngine
def test_llm_engine_steps_requests_by_id(oracle):
    from qwen_ops.engine.llm_engine import LLMEngine as at_vllms_path

    assert at_vllms_path is LLMEngine
    engine = LLMEngine.from_engine_args(EngineArgs(model=MODEL))
    for i, ids in enumerate(PROMPT_IDS):
        engine.add_request(f"req-{i}", ids, GREEDY_FIXED)
    engine.add_request("two", PROMPT_IDS[1], SamplingParams(n=2, max_tokens=3, seed=1))
    engine.add_request("gone", PROMPT_IDS[2], GREEDY_FIXED)
    engine.abort_request(["gone"])
    assert engine.get_num_unfinished_requests() == 4
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished, "a finished request is reported once"
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["req-0", "req-1", "req-2", "two"]
    for i, ids in enumerate(PROMPT_IDS):
        assert finished[f"req-{i}"].outputs[0].token_ids == oracle(ids, MAX_TOKENS)
    assert [len(c.token_ids) for c in finished["two"].outputs] == [3, 3]
    with pytest.raises(TypeError, match="request_id = 3, expected a str"):
        engine.add_request(3, PROMPT_IDS[0], GREEDY_FIXED)
    with pytest.raises(ValueError, match="priority = 1"):
        engine.add_request("p", PROMPT_IDS[0], GREEDY_FIXED, priority=1)
    assert engine.get_tokenizer() is engine.llm.tokenizer


# ----------------------------------------------------------------------------- reset_prefix_cache
def _cached(llm, prompt) -> int:
    (out,) = llm.generate([prompt], GREEDY_FIXED, use_tqdm=False)
    return out.num_cached_tokens


def test_reset_prefix_cache(llm, oracle):
    assert llm.reset_prefix_cache()
    assert _cached(llm, LONG_PROMPT) == 0
    assert _cached(llm, LONG_PROMPT) == 48, "the three full blocks hit"
    assert llm.reset_prefix_cache() is True
    assert _cached(llm, LONG_PROMPT) == 0, "after a reset nothing hits"
    # While a request holds blocks: refused (vLLM's rule) unless reset_running_requests.
    rid = llm.add_request(LONG_PROMPT, GREEDY_FIXED)
    llm.step()
    assert llm.reset_prefix_cache() is False
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert outs[rid].outputs[0].token_ids == oracle(LONG_PROMPT, MAX_TOKENS), "the running request is unharmed"
    assert _cached(llm, LONG_PROMPT) == 0
    with pytest.raises(ValueError, match="reset_running_requests = 'yes', expected True or False"):
        llm.reset_prefix_cache("yes")


# ------------------------------------------------------------------------------------ get_metrics
def _by_name(metrics) -> dict:
    out = {}
    for m in metrics:
        out.setdefault(m.name, []).append(m)
    return out


def test_metric_shapes_are_vllms():
    names = {cls.__name__: [f.name for f in dataclasses.fields(cls)] for cls in (Counter, Gauge, Histogram, Vector)}
    assert names == {"Counter": ["name", "labels", "value"], "Gauge": ["name", "labels", "value"],
                     "Histogram": ["name", "labels", "count", "sum", "buckets"],
                     "Vector": ["name", "labels", "values"]}


def test_get_metrics_counts_what_ran():
    llm = LLM(MODEL, enable_prefix_caching=False, disable_log_stats=False)     # LLM keeps none by default (vLLM)
    start = time.perf_counter()
    llm.generate(PROMPT_IDS, GREEDY_FIXED, use_tqdm=False)
    wall = time.perf_counter() - start
    metrics = _by_name(llm.get_metrics())
    one = {name: ms[0] for name, ms in metrics.items() if len(ms) == 1}
    n, prompt_tokens = len(PROMPT_IDS), sum(map(len, PROMPT_IDS))
    assert isinstance(one["vllm:prompt_tokens"], Counter) and one["vllm:prompt_tokens"].value == prompt_tokens
    assert one["vllm:generation_tokens"].value == n * MAX_TOKENS
    assert [(m.labels["finished_reason"], m.value) for m in metrics["vllm:request_success"]] == [("length", n)]
    assert isinstance(one["vllm:num_requests_running"], Gauge) and one["vllm:num_requests_running"].value == 0
    assert one["vllm:kv_cache_usage_perc"].value == 0.0
    # every prompt token is computed once and every sampled token but the last is fed back
    assert one["vllm:iteration_tokens_total"].sum == prompt_tokens + n * (MAX_TOKENS - 1)
    gen = one["vllm:request_generation_tokens"]
    assert isinstance(gen, Histogram) and (gen.count, gen.sum) == (n, n * MAX_TOKENS)
    for bound, count in gen.buckets.items():           # each request generated MAX_TOKENS
        assert count == (n if MAX_TOKENS <= float(bound) else 0), (bound, count)
    ptok = one["vllm:request_prompt_tokens"]
    for bound, count in ptok.buckets.items():
        assert count == sum(len(p) <= float(bound) for p in PROMPT_IDS), (bound, count)
    ttft, e2e = one["vllm:time_to_first_token_seconds"], one["vllm:e2e_request_latency_seconds"]
    assert ttft.count == e2e.count == n and ttft.buckets["+Inf"] == n
    assert 0 < ttft.sum <= e2e.sum <= n * wall
    assert one["vllm:inter_token_latency_seconds"].count == n * (MAX_TOKENS - 1)
    assert all(m.labels["model_name"] == str(llm.model_path) for ms in metrics.values() for m in ms)


def test_get_metrics_needs_stats():
    llm = LLM(MODEL)                       # disable_log_stats=True: LLM's default, as vLLM's
    with pytest.raises(ValueError, match="disable_log_stats = True"):
        llm.get_metrics()


# -------------------------------------------------------------------------------------- profiling
def test_profile_writes_a_chrome_trace(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm.start_profile("run1")
    with pytest.raises(RuntimeError, match="running already"):
        llm.start_profile()
    llm.generate([PROMPT_IDS[0]], GREEDY_FIXED, use_tqdm=False)
    path = llm.stop_profile()
    assert path.parent == tmp_path / "traces" and path.name.startswith("run1_")
    events = json.loads(path.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events), "the model's ops are in the trace"


def test_profiler_dir_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    assert profiler_dir({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "cfg")}) == tmp_path / "cfg"
    assert profiler_dir(None) == tmp_path / "env"
    with pytest.raises(ValueError, match="profiler_config.profiler = 'cuda'"):
        profiler_dir({"profiler": "cuda"})


# ------------------------------------------------------------------------------------- AsyncLLM
def test_async_llm_at_vllms_path_streams_deltas(llm):
    from qwen_ops.sampling_params import RequestOutputKind
    from qwen_ops.v1.engine.async_llm import AsyncLLM

    assert AsyncLLM is qwen_ops.AsyncLLM
    (whole,) = llm.generate([PROMPT_IDS[0]], GREEDY_FIXED, use_tqdm=False)
    engine = AsyncLLM(llm)

    async def deltas():
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        return [out async for out in engine.generate(request_id="d", prompt=PROMPT_IDS[0], sampling_params=sp)]

    try:
        outs = asyncio.run(deltas())
    finally:
        engine.shutdown()
    assert [t for o in outs for t in o.outputs[0].token_ids] == whole.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in outs) == whole.outputs[0].text and outs[-1].finished


def test_the_offline_api_needs_no_serve_extra(tmp_path):
    """``pip install -e .`` has no serve extra (prometheus_client, fastapi): LLM.generate, LLM.chat's path
    (``stream``) and get_metrics run without them. Blocked in a subprocess (None in sys.modules makes the
    import fail); the README's main command broke this way once."""
    import subprocess
    import sys

    script = tmp_path / "offline.py"
    script.write_text(
        "import sys\n"
        "for name in ('prometheus_client', 'fastapi', 'uvicorn'):\n"
        "    sys.modules[name] = None\n"
        "from qwen_ops import LLM, SamplingParams\n"
        "llm = LLM(max_model_len=256)\n"
        "sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)\n"
        "print(len(llm.generate('def f():', sp, use_tqdm=False)[0].outputs[0].token_ids))\n"
        "print(len(list(llm.stream(['def g():'], sp))) > 0)\n"
        "llm = LLM(max_model_len=256, disable_log_stats=False)\n"
        "llm.generate('def f():', sp, use_tqdm=False)\n"
        "print(sorted(m.name for m in llm.get_metrics())[:1])\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["4", "True"], done.stdout
