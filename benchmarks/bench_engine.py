"""pytest-benchmark suites for the engine and end-to-end generation (CPU by default).

    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_engine.py --benchmark-enable -q

Compare rows of one run (``--benchmark-group-by=group``): decode eager vs compiled, batched vs
per-request loop, LLM.generate vs transformers generate. benchmarks/gate.py turns the same
comparisons into ratios with thresholds.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from qwen_ops.models.defaults import default_model_path
from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
from qwen_ops.serving.llm import LLM
from qwen_ops.engine.sampling import SamplingParams

MODEL = default_model_path()
BATCH = 32
PROMPT_LEN = 64
NEW_TOKENS = 64


def _prompts(n, length, vocab=4000):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "compiled"])
def decode_engine(request):
    eng = QwenEngine.from_pretrained(MODEL, max_slots=BATCH, max_seq_len=1024, compile=request.param)
    eng.prefill(_prompts(1, PROMPT_LEN)[0], slot_id=0)
    return eng


@pytest.mark.benchmark(group="decode-batch1")
def test_decode_step_batch1(benchmark, decode_engine):
    state = {"tok": 5}

    def step():
        state["tok"] = decode_engine.decode_step(state["tok"], slot_id=0).next_token
        if decode_engine.slot_seq_len(0) > 900:
            decode_engine.prefill(_prompts(1, PROMPT_LEN)[0], slot_id=0)

    benchmark(step)


@pytest.fixture(scope="module")
def batch_engine():
    eng = QwenEngine.from_pretrained(MODEL, max_slots=2 * BATCH, max_seq_len=1024, compile=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True)
    reqs = [QwenBatchedRequest(i, p, i, sp) for i, p in enumerate(_prompts(BATCH, PROMPT_LEN))]
    eng.batch_prefill(reqs)
    return eng, reqs


@pytest.mark.benchmark(group="decode-32-requests")
def test_batch_decode_step_32(benchmark, batch_engine):
    eng, reqs = batch_engine
    benchmark.pedantic(lambda: eng.batch_decode_step(reqs), rounds=20, iterations=1)


@pytest.mark.benchmark(group="decode-32-requests")
def test_decode_step_loop_32(benchmark, batch_engine):
    eng, reqs = batch_engine
    slots = list(range(BATCH, 2 * BATCH))
    last = [eng.prefill(r.prompt_tokens, slot_id=s).next_token for r, s in zip(reqs, slots)]

    def loop():
        for i, s in enumerate(slots):
            last[i] = eng.decode_step(last[i], slot_id=s).next_token

    benchmark.pedantic(loop, rounds=5, iterations=1)


@pytest.mark.benchmark(group="generate-32x64x64")
def test_llm_generate(benchmark):
    llm = LLM(MODEL, max_num_seqs=BATCH, max_model_len=512)   # the default token budget
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts(BATCH, PROMPT_LEN)
    benchmark.pedantic(lambda: llm.generate(prompts, sp, use_tqdm=False), rounds=2, iterations=1)


@pytest.mark.benchmark(group="generate-32x64x64")
def test_transformers_generate(benchmark):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(_prompts(BATCH, PROMPT_LEN))

    def run():
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

    benchmark.pedantic(run, rounds=2, iterations=1)


# The sampler alone on one decode step's logits: 16 rows of the embedded model's 8,192-token
# vocabulary (vLLM's `bench serve` samples at temperature 1 without top-p or top-k). Seeded rows,
# whose picks are checked after timing against a float64 loop over softmax's probabilities with each
# row's own uniform, so a fast wrong sampler fails here.
SAMPLE_KINDS = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0),
                "temperature 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9)}


@pytest.mark.benchmark(group="sample-16x8192")
@pytest.mark.parametrize("kind", list(SAMPLE_KINDS))
def test_sample_16_rows(benchmark, kind):
    from qwen_ops.engine.sampling import sample

    logits = torch.randn(16, 8192, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(seed=1000 + i, **SAMPLE_KINDS[kind]) for i in range(16)]
    gens = [p.make_generator() for p in params]
    benchmark.pedantic(lambda: sample(logits, params, gens, [0] * 16), rounds=30, iterations=1, warmup_rounds=2)
    got = sample(logits, params, gens, [0] * 16).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            assert got[i] == int(logits[i].argmax())
            continue
        probs = torch.softmax(logits[i].double() / p.temperature, dim=-1).tolist()
        order = sorted(range(len(probs)), key=lambda t: -probs[t])
        kept, mass = set(), 0.0
        for t in order:                          # top-p: the smallest head whose mass reaches p
            kept.add(t)
            mass += probs[t]
            if mass >= p.top_p:
                break
        weights = [q if t in kept else 0.0 for t, q in enumerate(probs)]
        u = p.make_generator().uniform_at(0)
        target = u * sum(weights)
        pick = next(t for t, w in enumerate(itertools.accumulate(weights)) if w > target)
        assert got[i] == pick, (kind, i, got[i], pick)
