"""qwen_ops.engine.speculative (issue 29 groundwork): the n-gram proposer against a brute-force search,
greedy acceptance, and sampled verification (the plain sampler's picks, rejection sampling) drawing from
the target distribution (an exact Markov chain's two-token joint against many seeded speculative steps,
chi-square and total variation)."""

from __future__ import annotations

import random

import pytest
import torch

from qwen_ops.engine.sampling import SamplingParams, SeededNoise, sample
from qwen_ops.engine.speculative import NgramProposer, accept_picks, greedy_accept, rejection_sample


def brute_force(tokens, k, min_n, max_n):
    """The proposer's contract written as loops: longest n first, latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_cases():
    p = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.propose([1, 2, 3, 9, 2, 3, 4, 1, 2, 3]) == [9, 2]        # the 3-gram wins over the later 2-gram
    assert p.propose([7, 8, 1, 7, 8, 2, 7, 8]) == [2, 7]              # the latest earlier occurrence
    assert p.propose([1, 2, 3, 4]) == []                              # nothing repeats
    assert NgramProposer(5).propose([1, 2, 1]) == [2, 1]              # cut at the end of the tokens
    assert p.propose([4]) == [] and p.propose([]) == []
    assert NgramProposer(3, prompt_lookup_min=2).propose([5, 6, 5]) == []   # only a 1-gram repeats


def test_ngram_proposer_matches_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 3)
        assert NgramProposer(k, lo, hi).propose(tokens) == brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_speculative_tokens=0), r"num_speculative_tokens = 0, expected an int >= 1"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=0), r"prompt_lookup_min = 0"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), r"prompt_lookup_max = 2 < "),
    (dict(num_speculative_tokens=True), r"num_speculative_tokens = True"),
])
def test_ngram_proposer_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramProposer(**kwargs)


def test_greedy_accept_emits_what_greedy_steps_would():
    probs = torch.zeros(4, 6)
    for row, best in enumerate([3, 1, 4, 2]):
        probs[row, best] = 1.0
        probs[row, (best + 1) % 6] = 0.5
    assert greedy_accept(probs, [3, 1, 4]) == [3, 1, 4, 2]     # all kept, then the bonus
    assert greedy_accept(probs, [3, 5, 4]) == [3, 1]           # the second is replaced by the argmax
    assert greedy_accept(probs, [0, 1, 4]) == [3]
    assert greedy_accept(probs[:1], []) == [3]
    assert accept_picks([3, 1, 4, 2], [3, 1, 4]) == [3, 1, 4, 2] and accept_picks([0, 5], [0]) == [0, 5]
    with pytest.raises(ValueError, match=r"picks has 2 tokens, expected k \+ 1 = 4"):
        accept_picks([3, 1], [3, 1, 4])


def _chain(seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(vocab, vocab, generator=g) ** 2 + 0.02
    return m / m.sum(1, keepdim=True)                           # row t: p(next | previous t)


@pytest.mark.parametrize("proposer", ["sampled draft", "deterministic draft", "deterministic draft, race"])
def test_rejection_sampling_draws_from_the_target(proposer):
    """A target Markov chain P over 5 tokens; drafts of k = 3 from another chain Q (sampled, with its
    probabilities) or from a fixed map (a point mass, as n-gram's), verified by rejection sampling or
    by the plain sampler's own picks (the race: ``sample`` over log P with each draw's seed at the
    output positions the rows decide). Speculative steps are repeated until two tokens are emitted;
    their joint must be P's, p(a | c) p(b | a): chi-square over the 25 outcomes below its 0.1%
    critical value and total variation under 0.02 with 20,000 draws."""
    vocab, k, context, draws = 5, 3, 2, 20_000
    P, Q = _chain(1, vocab), _chain(2, vocab)
    fixed = [(3 * t + 1) % vocab for t in range(vocab)]
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros(vocab, vocab)
    plain = [SamplingParams(temperature=1.0)] * (k + 1)
    for draw in range(draws):
        noise = SeededNoise(draw)
        emitted, prev = [], context
        while len(emitted) < 2:
            drafts, draft_probs, d_prev = [], [], prev
            for _ in range(k):
                if proposer == "sampled draft":
                    d = int(torch.multinomial(Q[d_prev], 1, generator=g))
                    draft_probs.append(Q[d_prev])
                else:
                    d = fixed[d_prev]
                drafts.append(d)
                d_prev = d
            rows = [prev] + drafts                              # the target after each prefix
            target = P[torch.tensor(rows)]
            at = len(emitted)                                   # the output position of the first row
            if proposer.endswith("race"):
                picks = sample(target.log(), plain, [noise] * (k + 1), range(at, at + k + 1)).tolist()
                out = accept_picks(picks, drafts)
            else:
                out = rejection_sample(target, drafts, torch.stack(draft_probs) if draft_probs else None, noise, at)
            assert 1 <= len(out) <= k + 1
            emitted += out
            prev = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    exact = P[context][:, None] * P                             # p(a | c) p(b | a)
    expected = exact * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 51.2, chi2                                    # 24 degrees of freedom, p = 0.001
    tv = 0.5 * float((counts / draws - exact).abs().sum())
    assert tv < 0.02, tv


def test_rejection_sample_argument_errors():
    with pytest.raises(ValueError, match=r"target_probs has shape \(2, 5\), expected \[k \+ 1 = 3, vocab\]"):
        rejection_sample(torch.full((2, 5), 0.2), [1, 2], None, SeededNoise(0), 0)
    with pytest.raises(ValueError, match=r"draft_probs has shape \(1, 5\), expected \[2, 5\]"):
        rejection_sample(torch.full((3, 5), 0.2), [1, 2], torch.full((1, 5), 0.2), SeededNoise(0), 0)
