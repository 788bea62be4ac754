"""Sampling filters and penalties against float64 computations written here from vLLM's definitions
(issue 43 item 4), and prefix caching on ordinary traffic with zero hash collisions.

* ``filtered_probs``: the set of tokens a row may sample is compared exactly with a float64 oracle
  (temperature, then min-p on the tempered distribution, top-k with ties kept, top-p keeping the
  smallest prefix of the sorted distribution whose mass reaches p: the token that crosses p stays),
  and the kept probabilities, renormalized, with the oracle's.
* ``apply_logits_processing``: repetition (divide positive logits, multiply negative ones, for every
  token seen in the prompt or the output), frequency (times the output count) and presence (once per
  token in the output) penalties, against a per-token float64 loop.
* Prefix caching on ordinary traffic (shared system prompts, multi-turn continuations, unrelated
  prompts): hits, and no collision (a block hash that matched a block with other tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from qwen_ops.engine.sampling import SamplingParams, apply_logits_processing, filtered_probs

VOCAB = 97


def oracle_keep(logits: torch.Tensor, p: SamplingParams) -> tuple[set[int], dict[int, float], float]:
    """(kept token ids, their renormalized float64 probabilities, the smallest distance of a top-p
    decision from its threshold) for one row, from the definitions, in float64."""
    x = logits.double().tolist()
    t = 1.0 if p.greedy else p.temperature
    scaled = [v / t for v in x]
    alive = list(range(len(x)))

    def softmax(ids):
        m = max(scaled[i] for i in ids)
        e = {i: math.exp(scaled[i] - m) for i in ids}
        s = sum(e.values())
        return {i: v / s for i, v in e.items()}

    if p.min_p > 0:
        pr = softmax(alive)
        top = max(pr.values())
        alive = [i for i in alive if pr[i] >= p.min_p * top]
    if 0 < p.top_k < len(x):
        kth = sorted((scaled[i] for i in alive), reverse=True)[p.top_k - 1] if p.top_k <= len(alive) else -math.inf
        alive = [i for i in alive if scaled[i] >= kth]
    margin = math.inf
    if p.top_p < 1.0:
        pr = softmax(alive)
        order = sorted(alive, key=lambda i: -pr[i])
        kept, mass = [], 0.0
        for i in order:
            if kept and mass >= p.top_p:     # the mass above this token already reaches p
                break
            kept.append(i)
            mass += pr[i]
        running = 0.0
        for i in order:                      # how close any token's "mass above" is to p
            margin = min(margin, abs(running - p.top_p))
            running += pr[i]
        alive = kept
    probs = softmax(alive)
    return set(alive), probs, margin


CASES = [
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.1, top_k=30, top_p=0.95),
    SamplingParams(temperature=0.5, top_p=0.3),
    SamplingParams(temperature=1.0, top_k=1),
]


@pytest.mark.parametrize("seed", range(6))
def test_filtered_probs_keep_exactly_the_oracles_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(CASES), VOCAB, generator=g) * (1.0 + seed)
    probs = filtered_probs(logits, CASES)
    checked = 0
    for row, p in enumerate(CASES):
        keep, want, margin = oracle_keep(logits[row], p)
        if margin < 1e-5:          # a decision within fp32's rounding of p: not decidable here
            continue
        got = set(torch.nonzero(probs[row] > 0).flatten().tolist())
        assert got == keep, (f"{p}: kept {sorted(got - keep)} the oracle drops, dropped {sorted(keep - got)} it keeps")
        total = float(probs[row].double().sum())
        for i in keep:
            assert float(probs[row, i]) / total == pytest.approx(want[i], rel=1e-4, abs=1e-7)
        checked += 1
    assert checked >= len(CASES) - 2


def test_top_p_keeps_the_token_that_crosses_p():
    """Probabilities 0.5, 0.3, 0.2 and top_p 0.6: the first two (0.5 < 0.6, 0.8 >= 0.6) stay, the third goes."""
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    probs = filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=0.6)])
    assert (probs[0] > 0).tolist() == [True, True, False]


def oracle_penalties(logits: torch.Tensor, prompt, output, p: SamplingParams) -> torch.Tensor:
    out = logits.double().clone()
    seen = set(prompt) | set(output)
    for tok in range(out.shape[0]):
        v = float(out[tok])
        if tok in seen:
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        count = output.count(tok)
        v -= p.frequency_penalty * count
        if count:
            v -= p.presence_penalty
        out[tok] = v
    return out


@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_the_float64_definitions(seed):
    g = torch.Generator().manual_seed(100 + seed)
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7),
              SamplingParams(temperature=1.0, repetition_penalty=0.8),
              SamplingParams(temperature=1.0, frequency_penalty=-0.5, presence_penalty=1.5),
              SamplingParams(temperature=1.0)]
    histories = []
    for _ in params:
        prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
        output = torch.randint(0, VOCAB // 3, (20,), generator=g).tolist()   # repeats
        histories.append((tuple(prompt), tuple(output)))
    logits = torch.randn(len(params), VOCAB, generator=g) * 3
    got = apply_logits_processing(logits, params, histories)
    for row, (p, (prompt, output)) in enumerate(zip(params, histories)):
        want = oracle_penalties(logits[row], list(prompt), list(output), p)
        torch.testing.assert_close(got[row].double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got[0], logits[0]), "no penalty applied: vacuous"


def test_prefix_caching_has_no_collisions_on_ordinary_traffic(tmp_path):
    from checkpoints import make_qwen3_checkpoint
    from qwen_ops.engine.sampling import SamplingParams as SP
    from qwen_ops.serving.llm import LLM

    path = make_qwen3_checkpoint(tmp_path / "ckpt", seed=5)
    llm = LLM(str(path), max_num_seqs=8, max_model_len=256, block_size=4)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(2, 128, (40,), generator=g).tolist()
    prompts = [system + torch.randint(2, 128, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 20, (12,), generator=g)]
    prompts += [torch.randint(2, 128, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (12,), generator=g)]
    sp = SP(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    turns = [p + list(o.outputs[0].token_ids) + [5, 6, 7] for p, o in zip(prompts, first)]
    llm.generate([{"prompt_token_ids": p} for p in turns], sp)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["prefix_cache_collisions"] == 0


def test_seeded_rows_draw_the_same_tokens_in_any_batch():
    """A seeded row picks with the uniform of its seed at its output position, from filters that read
    its own parameters only: the same tokens alone, beside an unbounded row, and beside bounded ones."""
    from qwen_ops.engine.sampling import sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g) * 3
    for mine in (SamplingParams(temperature=0.8, top_p=0.9, seed=11), SamplingParams(temperature=0.8, seed=11),
                 SamplingParams(temperature=0.9, top_k=7, seed=-5),
                 SamplingParams(temperature=0.9, min_p=0.05, seed=2)):
        def run(others):
            rows = torch.cat([logits[:1], logits[1:1 + len(others)]])
            return [int(sample(rows, [mine, *others], [mine.make_generator()] + [None] * len(others),
                               [pos] * (1 + len(others)))[0]) for pos in range(6)]
        alone = run([])
        assert run([SamplingParams(temperature=1.0)]) == alone
        assert run([SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.5)]) == alone


@pytest.mark.parametrize("seed", range(4))
def test_a_rows_distribution_does_not_depend_on_its_batch(seed):
    """Each row's kept tokens and weights are the same alone and beside rows with other filters: a row
    without top-p (min-p only, temperature only, top-k only) beside a top-p row once lost the tail
    tokens whose float32 mass before them rounded past 1.0 (seeded requests changed with the batch,
    under preemption)."""
    g = torch.Generator().manual_seed(40 + seed)
    logits = torch.randn(5, 8192, generator=g) * 3
    params = [SamplingParams(temperature=0.8, min_p=0.05), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.7)]
    together = filtered_probs(logits, params)
    for r, p in enumerate(params):
        assert torch.equal(filtered_probs(logits[r:r + 1], [p])[0], together[r]), p
