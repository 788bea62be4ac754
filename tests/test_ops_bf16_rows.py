"""The CPU kernels' bf16 rows of rms_norm / add_rms_norm, qk_norm_rope and silu_mul against a float64
oracle that rounds where a bf16 torch model rounds: every op's result to bf16 (computed in fp32 first),
as transformers' Qwen3 layers do on bf16 tensors.

The kernels compute in fp32 with their own exp and their own order of the mean-square sum, so a result
may sit on the other side of a bf16 rounding boundary from the oracle's now and then: the tests ask for
almost every element bit-equal to the oracle and none further than one bf16 step. A kernel that skips
one of those roundings (or rounds twice where the model rounds once) leaves a large share of elements
one step off, which the share catches; the tolerance tests of test_ops_fused.py cannot see it.

Shapes reach the vector paths (rows of 16 lanes with a masked tail, head dims whose halves are whole
vectors) as well as the scalar ones (head dim 80).
"""

from __future__ import annotations

import pytest
import torch

MIN_EQUAL = 0.99   # share of elements bit-equal to the oracle


pytestmark = pytest.mark.usefixtures("cpu_fast_ops")


def _bf16(x64: torch.Tensor) -> torch.Tensor:
    """A float64 result as the kernel's fp32 op would give it (rounded to fp32), then rounded to bf16."""
    return x64.to(torch.float32).to(torch.bfloat16)


def _randn(*shape, scale=1.0, seed=0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape, what
    assert not got.isnan().any(), f"{what}: an output element was never written"
    same = got.view(torch.int16) == want.view(torch.int16)
    equal = same.double().mean().item()
    # one bf16 step at the larger of the two magnitudes (2^-7 relative at the low end of a binade)
    g, w = got.double()[~same], want.double()[~same]
    worst = ((g - w).abs() / (torch.maximum(g.abs(), w.abs()) * 2.0 ** -7 + 1e-30)).max().item() if g.numel() else 0.0
    assert equal >= MIN_EQUAL, f"{what}: {equal:.4f} of elements bit-equal to the float64 oracle, expected >= {MIN_EQUAL}"
    assert worst <= 1.0, f"{what}: an element {worst:.2f} bf16 steps from the oracle, expected at most one"


def _rms_oracle(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    s64 = s.double()
    inv = 1.0 / torch.sqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
    return _bf16(w.double() * _bf16(s64 * inv).double())


@pytest.mark.parametrize("dim", [1024, 1000, 3072, 37])
def test_add_rms_norm_bf16_rows(dim):
    x, res, w = _randn(64, dim, scale=2.0, seed=1), _randn(64, dim, seed=2), _randn(dim, scale=0.3, seed=3) + 1
    normed, total = torch.ops.qwen.add_rms_norm(x, res, w, 1e-6)
    want_total = _bf16(x.double() + res.double())
    assert torch.equal(total.view(torch.int16), want_total.view(torch.int16)), "the residual sum is not bf16(x + r)"
    _assert_matches(normed, _rms_oracle(want_total, w, 1e-6), f"add_rms_norm dim {dim}")
    _assert_matches(torch.ops.qwen.rms_norm(x, w, 1e-6), _rms_oracle(x, w, 1e-6), f"rms_norm dim {dim}")


def test_add_rms_norm_keeps_subnormal_sums():
    """Residual sums in the subnormal range (and next to ordinary values in the same vector) come out
    as torch's bf16(x + r), bit for bit: a rounding instruction that takes subnormals as zeros (as
    VCVTNEPS2BF16 does) must not be used on them."""
    gen = torch.Generator().manual_seed(12)
    tiny = torch.randint(1, 127, (8, 64), generator=gen, dtype=torch.int16)       # bf16 subnormal bit patterns
    sign = torch.randint(0, 2, (8, 64), generator=gen, dtype=torch.int16) * -32768
    x = (tiny | sign).view(torch.bfloat16)
    res = (torch.randint(1, 127, (8, 64), generator=gen, dtype=torch.int16)).view(torch.bfloat16)
    x[::2, ::7] = _randn(4, 10, seed=13)                                          # some ordinary lanes
    _, total = torch.ops.qwen.add_rms_norm(x, res, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    want = (x.float() + res.float()).to(torch.bfloat16)
    assert (want.float().abs() < 2.0 ** -126).sum() > 100 and (want != 0).sum() > 100
    assert torch.equal(total.view(torch.int16), want.view(torch.int16)), "a subnormal residual sum was not kept"


@pytest.mark.parametrize("dim", [3072, 1000, 37])
def test_silu_mul_bf16_rows(dim):
    gate_up = _randn(48, 2 * dim, scale=3.0, seed=4)
    g, u = gate_up[:, :dim].double(), gate_up[:, dim:].double()
    want = _bf16(_bf16(g / (1.0 + torch.exp(-g))).double() * u)
    _assert_matches(torch.ops.qwen.silu_mul(gate_up), want, f"silu_mul dim {dim}")


def test_silu_mul_every_bf16_gate():
    """Every finite bf16 gate value once (with random up values). Below -88 the true silu is under
    1.3e-36 in magnitude and the kernel gives -0 (the oracle's tiny values are not asked for there)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16)
    gate = gate[torch.isfinite(gate.float())]
    n = gate.numel() // 64 * 64
    gate = gate[:n].reshape(-1, 64)
    up = _randn(*gate.shape, scale=2.0, seed=5)
    g, u = gate.double(), up.double()
    want = _bf16(_bf16(g * torch.sigmoid(g)).double() * u)
    want = torch.where(g < -88, torch.zeros_like(want), want)
    got = torch.ops.qwen.silu_mul(torch.cat([gate, up], dim=1))
    _assert_matches(torch.where(g < -88, torch.zeros_like(got), got), want, "silu_mul over every gate")
    assert (got[g < -88] == 0).all(), "silu of a gate below -88 is not zero"


def _with_special_values(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with one element in 400 replaced by a NaN, an infinity, a bf16 subnormal or a signed zero (a
    normed row holding a NaN or an infinity becomes NaNs and zeros)."""
    gen = torch.Generator().manual_seed(seed)
    flat = x.clone().view(-1)
    idx = torch.randint(0, flat.numel(), (flat.numel() // 400,), generator=gen)
    vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-39, -3e-40, 0.0, -0.0])
    flat[idx] = vals[torch.randint(0, len(vals), (len(idx),), generator=gen)].to(torch.bfloat16)
    return flat.view(x.shape)


def _assert_matches_special(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN exactly where the oracle has NaN, the same infinities, and the finite rest as _assert_matches."""
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN where the oracle has none, or none where it has"
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), \
        f"{what}: infinities differ from the oracle's"
    fin = want.isfinite()
    _assert_matches(got[fin], want[fin], what)


def _rope_oracle(x: torch.Tensor, w, table: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    x = _rms_oracle(x, w, 1e-6) if w is not None else x
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat((_bf16(_bf16(x1 * cos).double() - _bf16(x2 * sin).double()),
                      _bf16(_bf16(x2 * cos).double() + _bf16(x1 * sin).double())), dim=-1)


@pytest.mark.parametrize("head_dim", [128, 256, 80])
def test_norms_and_rope_on_nan_inf_and_subnormal_inputs(head_dim):
    """The bf16 rows round their values in fewer operations than round_bf16 because every NaN of bf16
    math is quiet with its low bits clear: NaNs, infinities and subnormals in the inputs still give
    what IEEE arithmetic in float64 gives (NaN where it has NaN, its infinities, the rest as before)."""
    T, nq, nk = 40, 4, 2
    q = _with_special_values(_randn(T, nq, head_dim, scale=2.0, seed=20), 21)
    k = _with_special_values(_randn(T, nk, head_dim, scale=2.0, seed=22), 23)
    w = (_randn(head_dim, scale=0.3, seed=24) + 1, _randn(head_dim, scale=0.3, seed=25) + 1)
    cos_sin = torch.randn(96, head_dim, generator=torch.Generator().manual_seed(26))
    positions = torch.randint(0, 96, (T,), generator=torch.Generator().manual_seed(27), dtype=torch.int32)
    table = cos_sin[positions.long()].to(torch.bfloat16).double()
    for weights in (w, (None, None)):
        got_q, got_k = torch.ops.qwen.qk_norm_rope(q, k, *weights, 1e-6, cos_sin, positions)
        assert got_q.isnan().any() and (got_q.isfinite() & (got_q != 0)).float().mean() > 0.5
        _assert_matches_special(got_q, _rope_oracle(q, weights[0], table), f"qk_norm_rope q, head dim {head_dim}")
        _assert_matches_special(got_k, _rope_oracle(k, weights[1], table), f"qk_norm_rope k, head dim {head_dim}")
    x = _with_special_values(_randn(256, head_dim, scale=2.0, seed=28), 29)
    res = _with_special_values(_randn(256, head_dim, seed=30), 31)
    normed, total = torch.ops.qwen.add_rms_norm(x, res, w[0], 1e-6)
    want_total = _bf16(x.double() + res.double())
    assert total.isnan().any() and normed.isnan().any()
    _assert_matches_special(total, want_total, "add_rms_norm's residual sum")
    _assert_matches_special(normed, _rms_oracle(want_total, w[0], 1e-6), "add_rms_norm")


@pytest.mark.parametrize("norms", [True, False], ids=["norms", "no_norms"])
@pytest.mark.parametrize("head_dim", [128, 64, 256, 80])
def test_qk_norm_rope_bf16_rows(head_dim, norms):
    T, nq, nk = 24, 4, 2
    q, k = _randn(T, nq, head_dim, scale=2.0, seed=6), _randn(T, nk, head_dim, scale=2.0, seed=7)
    weights = (_randn(head_dim, scale=0.3, seed=8) + 1, _randn(head_dim, scale=0.3, seed=9) + 1) if norms else (None, None)
    cos_sin = torch.randn(96, head_dim, generator=torch.Generator().manual_seed(10))
    positions = torch.randint(0, 96, (T,), generator=torch.Generator().manual_seed(11), dtype=torch.int32)
    got_q, got_k = torch.ops.qwen.qk_norm_rope(q, k, *weights, 1e-6, cos_sin, positions)
    table = cos_sin[positions.long()].to(torch.bfloat16).double()
    for x, w, got, name in ((q, weights[0], got_q, "q"), (k, weights[1], got_k, "k")):
        _assert_matches(got, _rope_oracle(x, w, table), f"qk_norm_rope {name}, head dim {head_dim}")
