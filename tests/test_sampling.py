"""SamplingParams validation (vLLM's conventions) and the batched ``sample`` function."""

from __future__ import annotations

import math

import pytest
import torch

from qwen_ops.engine.sampling import SamplingParams, sample

SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 64 - 1      # torch.Generator.manual_seed's range, inclusive


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
@pytest.mark.parametrize("seed", [2 ** 70, 2 ** 64, SEED_MIN - 1, -(2 ** 70)])
def test_seed_out_of_range_is_rejected_at_construction(seed):
    with pytest.raises(ValueError) as info:
        SamplingParams(seed=seed, temperature=1.0)
    assert str(info.value) == f"seed = {seed}, expected an int in [-2**63, 2**64) or None"


def test_seed_2_pow_70_message_names_the_value():
    with pytest.raises(ValueError, match=r"^seed = 1180591620717411303424, expected an int in \[-2\*\*63, 2\*\*64\)"):
        SamplingParams(seed=2 ** 70)


@pytest.mark.parametrize("seed", ["1", 1.0, True])
def test_seed_must_be_an_int(seed):
    with pytest.raises(ValueError, match=r"^seed = .*, expected an int in \[-2\*\*63, 2\*\*64\) or None$"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 2 ** 63, SEED_MAX])
def test_seed_boundaries_construct_and_seed_a_generator(seed):
    params = SamplingParams(seed=seed, temperature=1.0)
    assert params.seed == seed
    g = params.make_generator(torch.device("cpu"))
    assert isinstance(g, torch.Generator)
    assert g.initial_seed() == seed % 2 ** 64          # torch stores the seed as a uint64
    # The generator really is seeded with it: a second one draws the same numbers.
    again = SamplingParams(seed=seed, temperature=1.0).make_generator(torch.device("cpu"))
    assert torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=again))


def test_no_generator_without_seed_or_when_greedy():
    assert SamplingParams(temperature=1.0).make_generator(torch.device("cpu")) is None
    assert SamplingParams(seed=3, temperature=0.0).make_generator(torch.device("cpu")) is None


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


def test_bad_stop_token_ids_are_rejected_with_their_index():
    with pytest.raises(ValueError, match=r"^stop_token_ids\[1\] = -4, expected an int >= 0$"):
        SamplingParams(stop_token_ids=[3, -4])
    with pytest.raises(ValueError, match=r"^stop_token_ids\[0\] = 40, expected < vocab_size = 32$"):
        SamplingParams(stop_token_ids=[40]).check_vocab(32)


# ----------------------------------------------------------------------------- sample()
def _logits(n=3, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax():
    logits = _logits()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_and_tiny_top_p_always_pick_the_top_token():
    logits = _logits(n=2)
    params = [SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)]
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        assert torch.equal(sample(logits, params, [None, None], g), logits.argmax(dim=-1))


def test_top_k_keeps_only_the_k_best_tokens():
    logits = _logits(n=1, vocab=40)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=50.0, top_k=3)]     # near-uniform over what survives
    drawn = {sample(logits, params, [None], torch.Generator().manual_seed(t)).item() for t in range(200)}
    assert drawn <= allowed and len(drawn) == 3


@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_off_samples_like_no_top_k(off):
    logits = _logits(n=1, vocab=40)
    ref = [sample(logits, [SamplingParams(temperature=50.0)], [None], torch.Generator().manual_seed(t)).item()
           for t in range(50)]
    got = [sample(logits, [SamplingParams(temperature=50.0, top_k=off)], [None],
                  torch.Generator().manual_seed(t)).item() for t in range(50)]
    assert got == ref and len(set(got)) > 3           # off really is off: many tokens drawn


def test_a_seeded_row_does_not_depend_on_its_batch():
    logits = _logits(n=3)
    seeded = SamplingParams(temperature=2.0, seed=SEED_MAX)
    other = SamplingParams(temperature=2.0)
    alone = sample(logits[1:2], [seeded], [seeded.make_generator(torch.device("cpu"))])
    batch = sample(logits, [other, seeded, other], [None, seeded.make_generator(torch.device("cpu")), None],
                   torch.Generator().manual_seed(123))
    assert batch[1] == alone[0]
