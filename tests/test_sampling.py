"""SamplingParams validation (vLLM's conventions), the counter-based seeded noise and the batched
``sample`` function (its C pass against the torch reference and float64 oracles)."""

from __future__ import annotations

import math

import pytest
import torch

from qwen_ops.engine.sampling import (ACCEPT, DRAFT, MAX_LOGPROBS, PICK, RESIDUAL, SamplingParams, SeededNoise,
                                     sample, weights_reference)

SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1      # int64, as vLLM's and OpenAI's seed, inclusive


# ----------------------------------------------------------------------------- top_k
@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_minus_one_and_zero_mean_off(top_k):
    assert SamplingParams(top_k=top_k).top_k == -1


@pytest.mark.parametrize("top_k", [1, 5, 10 ** 6])
def test_top_k_positive_is_kept(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


@pytest.mark.parametrize("top_k", [-2, -3, -(2 ** 40)])
def test_top_k_below_minus_one_is_rejected(top_k):
    with pytest.raises(ValueError, match=rf"^top_k = {top_k}, expected -1 or 0 \(off\) or an int >= 1$"):
        SamplingParams(top_k=top_k)


@pytest.mark.parametrize("top_k", [1.0, "5", True, None])
def test_top_k_must_be_an_int(top_k):
    with pytest.raises(ValueError, match=r"^top_k = .*, expected -1 or 0 \(off\) or an int >= 1$"):
        SamplingParams(top_k=top_k)


# ----------------------------------------------------------------------------- seed
@pytest.mark.parametrize("seed", [2 ** 70, 2 ** 64, 2 ** 64 - 1, 2 ** 63, SEED_MIN - 1, -(2 ** 70)])
def test_seed_out_of_range_is_rejected_at_construction(seed):
    with pytest.raises(ValueError) as info:
        SamplingParams(seed=seed, temperature=1.0)
    assert str(info.value) == f"seed = {seed}, expected an int in [-2**63, 2**63) or None"


def test_seed_2_pow_70_message_names_the_value():
    with pytest.raises(ValueError, match=r"^seed = 1180591620717411303424, expected an int in \[-2\*\*63, 2\*\*63\)"):
        SamplingParams(seed=2 ** 70)


@pytest.mark.parametrize("seed", ["1", 1.0, True])
def test_seed_must_be_an_int(seed):
    with pytest.raises(ValueError, match=r"^seed = .*, expected an int in \[-2\*\*63, 2\*\*63\) or None$"):
        SamplingParams(seed=seed)


def _noise(seed: int, n: int = 64) -> torch.Tensor:
    return SamplingParams(seed=seed, temperature=1.0).make_generator().uniform(range(n))


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 2 ** 32, SEED_MAX])
def test_seed_boundaries_construct_and_reproduce_their_noise(seed):
    params = SamplingParams(seed=seed, temperature=1.0)
    assert params.seed == seed
    assert isinstance(params.make_generator(), SeededNoise)
    assert torch.equal(_noise(seed), _noise(seed))          # the same seed draws the same noise


@pytest.mark.parametrize("a, b", [(1, 2 ** 32 + 1),          # the same low 32 bits (torch's CPU generator keeps only those)
                                  (-1, 2 ** 32 - 1),          # the same low 32 bits again
                                  (2 ** 32, 1),               # halves swapped: (lo, hi) = (0, 1) vs (1, 0)
                                  (SEED_MIN, 0)])             # the same low 32 bits, sign bit apart
def test_distinct_seeds_draw_distinct_noise(a, b):
    assert a != b and not torch.equal(_noise(a), _noise(b))


def test_seeded_noise_samples_the_distribution():
    # The oracle: float64 softmax probabilities, computed apart from sample(); the picks at 6,000
    # output positions of one seed land within a total-variation distance of 0.03 of them (about 4 sigma).
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = torch.softmax(logits.double(), dim=-1)[0]
    params = SamplingParams(temperature=1.0, seed=2 ** 40 + 7)
    g = params.make_generator()
    counts = torch.zeros(5, dtype=torch.float64)
    for pos in range(6000):
        counts[sample(logits, [params], [g], [pos]).item()] += 1
    assert 0.5 * (counts / counts.sum() - probs).abs().sum().item() < 0.03


def test_seeded_noise_is_uniform_and_a_pure_function_of_seed_position_and_purpose():
    """Counter-based: the same (seed, position, purpose) always gives the same value, in any order of
    asking; the purposes of one position differ; 20,000 values of one seed (positions x purposes)
    pass a Kolmogorov-Smirnov test against U[0, 1) (critical value 1.63 / sqrt(n), p = 0.01); a value
    is uncorrelated with the next position's, and with seed + 1's (n completions' seeds) at its position."""
    g = SeededNoise(12345)
    again = SeededNoise(12345)
    assert [again.uniform_at(p, k) for p in reversed(range(50)) for k in (DRAFT, PICK)] == \
        [g.uniform_at(p, k) for p in reversed(range(50)) for k in (DRAFT, PICK)]
    assert len({g.uniform_at(7, k) for k in (PICK, ACCEPT, RESIDUAL, DRAFT)}) == 4
    u = torch.cat([g.uniform(range(5000), k) for k in (PICK, ACCEPT, RESIDUAL, DRAFT)]).sort().values
    n = u.numel()
    ks = float(torch.maximum(torch.arange(1, n + 1, dtype=torch.float64) / n - u, u - torch.arange(n) / n).max())
    assert ks < 1.63 / math.sqrt(n), ks
    assert 0.0 <= float(u[0]) and float(u[-1]) < 1.0
    a = g.uniform(range(40_000))                  # correlations within 4 standard errors of 0
    assert abs(float(torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1])) < 4 / math.sqrt(40_000)
    b = SeededNoise(12346).uniform(range(40_000))
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 4 / math.sqrt(40_000)


def test_derived_seeds_are_distinct_per_request_and_per_llm_seed():
    seeds = {SeededNoise.derived(s, i).seed for s in (0, 1, 2 ** 32) for i in range(1000)}
    assert len(seeds) == 3000 and all(-2 ** 63 <= x < 2 ** 63 for x in seeds)
    assert SeededNoise.derived(7, 3).uniform_at(0) == SeededNoise.derived(7, 3).uniform_at(0)


def _first_past(weights: list[float], u: float) -> int:
    """The oracle of an inverse-CDF pick: a plain float64 loop over the row (index order)."""
    total = 0.0
    for w in weights:
        total += w
    target, run = u * total, 0.0
    for i, w in enumerate(weights):
        run += w
        if run > target:
            return i
    raise AssertionError("u * total reached the total")


def test_cdf_pick_matches_a_float64_loop():
    from qwen_ops.engine.sampling import cdf_pick

    g = torch.Generator().manual_seed(11)
    w = torch.rand(6, 300, generator=g) ** 4
    w[w < 0.05] = 0.0                                    # zeros are never picked
    w[5, :] = 0.0
    w[5, 123] = 0.25                                     # one positive entry
    w[1, 250:] = 0.0                                     # trailing zeros, with u just below 1
    u = torch.rand(6, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53                   # both ends of [0, 1)
    got = cdf_pick(w, u).tolist()
    want = [_first_past(w[i].double().tolist(), float(u[i])) for i in range(6)]
    assert got == want and got[5] == 123 and got[1] < 250
    assert all(w[i, t] > 0 for i, t in enumerate(got))


def test_sampled_rows_pick_by_their_seeded_uniform():
    # Unbounded rows (temperature only) and bounded ones (top-k) against the loop above, fed the
    # float32 probabilities softmax gives and the uniform each row's own seed draws.
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 500, generator=g) * 2
    for params in ([SamplingParams(temperature=t, seed=s) for t, s in ((1.0, 3), (0.7, -9), (1.3, 2 ** 40), (1.0, 0))],
                   [SamplingParams(temperature=0.9, top_k=40, seed=s) for s in (5, 6, 7, 8)]):
        gens = [p.make_generator() for p in params]
        got = sample(logits, params, gens, [3] * 4).tolist()
        for i, p in enumerate(params):
            probs = torch.softmax(logits[i] / p.temperature, dim=-1)
            if p.top_k > 0:
                probs = probs.masked_fill(probs < probs.topk(p.top_k).values[-1], 0.0)
            u = SeededNoise(p.seed).uniform_at(3)
            assert got[i] == _first_past(probs.double().tolist(), u), (params[i], i)


def test_host_sample_rows_matches_a_float64_oracle():
    # The C pass (softmax, running sum and pick without a probability tensor) against the loop
    # above over float64 softmax probabilities: fresh random logits, temperatures, -inf entries,
    # and uniforms at both ends. A pick may differ only where u * total lies within rounding of a
    # boundary of the running sum, which none of these inputs does.
    from qwen_ops.ops import host

    if host.why_unavailable() is not None:
        pytest.skip(host.why_unavailable())
    g = torch.Generator().manual_seed(21)
    rows, vocab = 12, 1000
    x = torch.randn(rows, vocab, generator=g) * 4
    x[x > 7] = -math.inf                                 # masked tokens (bad words, logit bias, grammars)
    x[3, :] = -math.inf
    x[3, 517] = 2.0                                      # one finite logit: always that token
    temps = torch.rand(rows, generator=g) * 1.5 + 0.2
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53
    got = host.sample_rows(x, temps, u).tolist()
    for r in range(rows):
        probs = torch.softmax(x[r].double() / float(temps[r]), dim=-1).tolist()
        want = _first_past(probs, float(u[r]))
        assert got[r] == want, (r, got[r], want)
        assert x[r, got[r]] > -math.inf
    assert got[3] == 517
    nan_row = x[:2].clone()
    nan_row[1, 5] = math.nan
    assert host.sample_rows(nan_row, temps[:2], u[:2]).tolist()[1] == -1


def _top_p_kept(probs: list[float], p: float) -> list[float]:
    """Top-p from its definition in float64: tokens by probability (ties: lower id first) are kept
    while the mass strictly before them is at most p; the others' weights become 0."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, before = [0.0] * len(probs), 0.0
    for i in order:
        if before > p:
            break
        kept[i] = probs[i]
        before += probs[i]
    return kept


def test_host_sample_rows_top_p_matches_a_float64_oracle():
    # The C pass's top-p (three levels of mass histograms over the weights' bits find the cut's exact
    # value; no sort) against the definition in float64, then the same float64 inverse-CDF loop: fresh random
    # logits, temperatures and p (the crossing token kept), -inf entries, a row whose cut falls in a
    # bucket of many tokens, ties broken by token id, 40 uniforms a row.
    from qwen_ops.ops import host

    if host.why_unavailable() is not None:
        pytest.skip(host.why_unavailable())
    g = torch.Generator().manual_seed(22)
    rows, vocab = 10, 1000
    x = torch.randn(rows, vocab, generator=g) * 3
    x[x > 6.5] = -math.inf
    x[4] = torch.randn(vocab, generator=g) * 0.01               # nearly flat: the cut's bucket holds hundreds
    x[5] = 0.0                                                  # all tied: the lowest ids are kept
    x[5, 700:] = -math.inf
    temps = torch.rand(rows, generator=g) * 1.5 + 0.3
    top_p = torch.rand(rows, generator=g, dtype=torch.float64) * 0.9 + 0.05
    top_p[5] = 0.4507                                           # 0.4507 x 700 = 315.5 tied tokens: ids 0 .. 315 kept
    checked = 0
    for k in range(40):
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        if k == 0:
            u[:] = 0.0
        got = host.sample_rows(x, temps, u, top_p).tolist()
        for r in range(rows):
            probs = torch.softmax(x[r].double() / float(temps[r]), dim=-1).tolist()
            kept = _top_p_kept(probs, float(top_p[r]))
            assert got[r] == _first_past(kept, float(u[r])), (r, k, got[r])
            checked += 1
    assert checked == 400
    assert max(host.sample_rows(x[5:6].expand(50, vocab).contiguous(), temps[5:6].expand(50), torch.rand(50, generator=g,
               dtype=torch.float64), top_p[5:6].expand(50)).tolist()) <= 315


def test_no_generator_without_seed_or_when_greedy():
    assert SamplingParams(temperature=1.0).make_generator() is None
    assert SamplingParams(seed=3, temperature=0.0).make_generator() is None


# ----------------------------------------------------------------------------- temperature
@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-6, 0.0])
def test_temperature_below_the_greedy_threshold_is_greedy(temperature):
    # logits / 1e-39 overflows fp32 (every logit inf, softmax NaN): such a row used to "sample"
    # token 0. Below 1e-5 (vLLM's threshold) a row is greedy; its oracle is the argmax.
    logits = _logits(n=2)
    logits[:, 0] = logits.min() - 1.0                         # token 0 is never the argmax
    params = SamplingParams(temperature=temperature, seed=5)
    assert params.greedy
    out = sample(logits, [params, SamplingParams(temperature=1.0)], [None, None], [0, 0])
    assert out[0].item() == logits[0].argmax().item() != 0


def test_temperature_at_the_threshold_samples():
    assert not SamplingParams(temperature=1e-5).greedy


# ----------------------------------------------------------------------------- other fields
@pytest.mark.parametrize("temperature", [-0.1, math.inf, math.nan, "1", True])
def test_bad_temperature_is_rejected(temperature):
    with pytest.raises(ValueError, match=r"^temperature = .*, expected a finite number >= 0"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01, math.nan, "0.9", True])
def test_bad_top_p_is_rejected(top_p):
    with pytest.raises(ValueError, match=r"^top_p = .*, expected a number in \(0, 1\]$"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("top_p", [1e-6, 0.5, 1, 1.0])
def test_top_p_in_range_is_kept(top_p):
    assert SamplingParams(top_p=top_p).top_p == float(top_p)


def test_max_tokens_and_max_new_tokens_must_agree():
    with pytest.raises(ValueError, match=r"^max_new_tokens = 8 and max_tokens = 9 disagree"):
        SamplingParams(max_new_tokens=8, max_tokens=9)
    assert SamplingParams(max_new_tokens=8, max_tokens=8).max_tokens == 8
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams().max_new_tokens == 16           # vLLM's default


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_bad_max_tokens_is_rejected(n):
    with pytest.raises(ValueError, match=r"^max_new_tokens = .*, expected an int >= 1$"):
        SamplingParams(max_tokens=n)


def test_logprobs_are_bounded():
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS
    with pytest.raises(ValueError, match=rf"^logprobs = 21, expected an int in \[0, {MAX_LOGPROBS}\] or None$"):
        SamplingParams(logprobs=21)


def test_stop_lists_are_bounded():
    SamplingParams(stop=["x"] * 64, stop_token_ids=list(range(1024)))
    with pytest.raises(ValueError, match=r"^stop has 65 strings, expected at most 64$"):
        SamplingParams(stop=["x"] * 65)
    with pytest.raises(ValueError, match=r"^stop\[1\] has 1025 characters, expected at most 1024$"):
        SamplingParams(stop=["a", "b" * 1025])
    with pytest.raises(ValueError, match=r"^stop_token_ids has 1025 entries, expected at most 1024$"):
        SamplingParams(stop_token_ids=list(range(1025)))


def test_bad_stop_token_ids_are_rejected_with_their_index():
    with pytest.raises(ValueError, match=r"^stop_token_ids\[1\] = -4, expected an int >= 0$"):
        SamplingParams(stop_token_ids=[3, -4])
    SamplingParams(stop_token_ids=[40]).check_vocab(32)       # past the vocabulary: accepted, as vLLM's (issue 62)


# ----------------------------------------------------------------------------- sample()
def _logits(n=3, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax():
    logits = _logits()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3, [0] * 3)
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_and_tiny_top_p_always_pick_the_top_token():
    logits = _logits(n=2)
    params = [SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)]
    for trial in range(20):
        assert torch.equal(sample(logits, params, [None, None], [trial] * 2), logits.argmax(dim=-1))


def test_top_k_keeps_only_the_k_best_tokens():
    logits = _logits(n=1, vocab=40)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=50.0, top_k=3)]     # near-uniform over what survives
    drawn = {sample(logits, params, [SeededNoise(t)], [0]).item() for t in range(200)}
    assert drawn <= allowed and len(drawn) == 3


@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_off_samples_like_no_top_k(off):
    logits = _logits(n=1, vocab=40)
    ref = [sample(logits, [SamplingParams(temperature=50.0)], [SeededNoise(t)], [0]).item() for t in range(50)]
    got = [sample(logits, [SamplingParams(temperature=50.0, top_k=off)], [SeededNoise(t)], [0]).item()
           for t in range(50)]
    assert got == ref and len(set(got)) > 3           # off really is off: many tokens drawn


def test_a_seeded_row_does_not_depend_on_its_batch():
    logits = _logits(n=3)
    seeded = SamplingParams(temperature=2.0, seed=SEED_MAX)
    other = SamplingParams(temperature=2.0)
    alone = sample(logits[1:2], [seeded], [seeded.make_generator()], [4])
    batch = sample(logits, [other, seeded, other], [None, seeded.make_generator(), None], [9, 4, 0])
    assert batch[1] == alone[0]


# ----------------------------------------------------------------------------- the C pass against its reference
@pytest.fixture(params=["host", "reference"])
def sampler_path(request, monkeypatch):
    """``sample`` on the CPU's C pass, or on its torch reference (the path of other devices)."""
    from qwen_ops.engine import sampling
    from qwen_ops.ops import host

    if request.param == "host":
        if host.why_unavailable() is not None:
            pytest.skip(host.why_unavailable())
    else:
        monkeypatch.setattr(sampling.host, "why_unavailable", lambda: "the reference path, forced")
    return request.param


def test_host_sampling_weights_match_the_reference():
    # host.sampling_weights (floor, temperature, exp, top-p cut in C) against weights_reference (torch,
    # the spec) on fresh logits with -inf entries, a NaN row and an all -inf row: the same kept tokens
    # wherever the top-p decision is not within rounding of p, weights within the C exp's 2e-7.
    from qwen_ops.ops import host

    if host.why_unavailable() is not None:
        pytest.skip(host.why_unavailable())
    g = torch.Generator().manual_seed(31)
    rows, vocab = 12, 3000
    x = torch.randn(rows, vocab, generator=g) * 3
    x[x > 6.0] = -math.inf
    x[3] = -math.inf
    x[7, 11] = math.nan
    temps = torch.rand(rows, generator=g) * 1.5 + 0.2
    top_p = torch.rand(rows, generator=g, dtype=torch.float64) * 0.9 + 0.05
    top_p[::3] = 1.0
    floor = torch.full((rows,), -math.inf)
    floor[1::2] = x[1::2].nan_to_num(0.0).quantile(0.9, dim=1)   # min-p / top-k's floor: a tenth of the tokens left
    w, ok = host.sampling_weights(x, temps, top_p, floor)
    want, want_ok = weights_reference(x, temps, top_p, floor)
    assert ok.tolist() == want_ok.tolist() and not ok[3] and not ok[7] and int(ok.sum()) == rows - 2
    assert float(w[~ok].abs().sum()) == 0.0
    torch.testing.assert_close(w[ok & (top_p >= 1.0)], want[ok & (top_p >= 1.0)], rtol=1e-6, atol=1e-30)
    for r in range(rows):
        if not ok[r] or top_p[r] >= 1.0:
            continue
        kept, kept_ref = w[r] > 0, want[r] > 0
        torch.testing.assert_close(w[r][kept & kept_ref], want[r][kept & kept_ref], rtol=1e-6, atol=1e-30)
        if not torch.equal(kept, kept_ref):          # only a token whose mass-before sits at p, within rounding
            probs = want[r].double() / want[r].double().sum()
            assert float((probs[kept != kept_ref]).sum()) < 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=0.8, top_p=0.9),
                                    SamplingParams(temperature=0.8, top_k=5),
                                    SamplingParams(temperature=0.8, min_p=0.1, top_k=5, top_p=0.5)])
def test_rows_with_nothing_to_sample_pick_minus_one_alone(params, sampler_path):
    # Every logit -inf (allowed tokens all banned) or a NaN: -1 for that row, never an exception,
    # and the rows beside it pick what they pick alone (top-k once indexed past its candidates here).
    logits = _logits(n=4, vocab=60)
    logits[1] = -math.inf
    logits[2, 7] = math.nan
    others = [SamplingParams(temperature=0.9, top_k=5, seed=1), SamplingParams(temperature=0.0)]
    got = sample(logits, [others[0], params, params, others[1]], [SeededNoise(1), None, None, None], [5] * 4)
    assert got[1] == got[2] == -1
    assert got[0] == sample(logits[:1], others[:1], [SeededNoise(1)], [5])[0]
    assert got[3] == logits[3].argmax()


def test_sample_takes_the_float64_oracles_token_on_both_paths(sampler_path):
    # A seeded row's pick against a float64 loop: the filters from their definitions (min-p on the
    # tempered distribution, top-k with ties, top-p keeping the crossing token), renormalized, and the
    # first token whose running sum passes the uniform of that seed at that output position.
    g = torch.Generator().manual_seed(8)
    vocab = 400
    cases = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.3, top_k=20, seed=2),
             SamplingParams(temperature=0.9, min_p=0.05, seed=3), SamplingParams(temperature=0.7, seed=4),
             SamplingParams(temperature=1.0, min_p=0.02, top_k=40, top_p=0.8, seed=5)]
    checked = 0
    for trial in range(20):
        logits = torch.randn(len(cases), vocab, generator=g) * 2.5
        got = sample(logits, cases, [p.make_generator() for p in cases], [trial] * len(cases)).tolist()
        for r, p in enumerate(cases):
            probs, margin = _oracle_probs(logits[r], p)
            u = SeededNoise(p.seed).uniform_at(trial)
            run, edge = 0.0, math.inf
            for t, q in enumerate(probs):       # the pick's own margin: how close u lands to a boundary
                run += q
                edge = min(edge, abs(run - u))
            if margin < 1e-5 or edge < 1e-5:
                continue
            assert got[r] == _first_past(probs, u), (trial, p)
            checked += 1
    assert checked >= 90


def _oracle_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[list[float], float]:
    """A row's distribution from the filters' definitions in float64, and how close a top-p decision
    came to p (tests/test_sampling_oracle.py's oracle, renormalized over the whole vocabulary)."""
    from test_sampling_oracle import oracle_keep

    keep, probs, margin = oracle_keep(logits, p)
    return [probs.get(i, 0.0) for i in range(logits.shape[0])], margin
