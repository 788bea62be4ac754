"""The multi-LoRA ops (torch.ops.qwen.lora_shrink / lora_expand): the CPU C++ kernels and the Triton kernels
(interpreter, small shapes) against the plain-torch references (qwen_ops/ops/kernels/reference_lora.py), the
references against a float64 loop, on fresh random inputs with outputs poisoned first; 1 and 2 threads give the
same bits; an error per validation rule, in the Python checks and in the C++ kernels; opcheck; torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from qwen_ops.ops import registry
from qwen_ops.ops import validation as V
from qwen_ops.ops.kernels import cpu
from qwen_ops.ops.kernels import reference_lora as RL

from tolerances import LORA_TOLERANCE

RANKS = [1, 8, 16, 64]
SLICES = [(24,), (40, 12), (40, 16, 24)]       # S = 1, 2 (gate | up), 3 (q | k | v), unequal sizes
NUM_TOKENS = [1, 5, 37, 300]
DTYPES = [torch.float32, torch.bfloat16]
# (T, R, slices, first 16 rows of one slot): 16-row tiles of one slot take tl.dot, mixed ones the gathered path
TRITON_CASES = [(1, 8, (24,), False), (5, 1, (40, 12), False), (20, 16, (40, 16, 24), True),
                (33, 8, (20, 12), True), (24, 8, (40, 12), False)]
IN_FEATURES = 72                                # 4 vectors of 16 and a tail
MAX_LORAS = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lora_indices(num_tokens: int, g: torch.Generator) -> torch.Tensor:
    """Runs of random lengths, each of a random slot or -1 (padding): a prefill's runs and a decode's mix."""
    out = []
    while len(out) < num_tokens:
        length = int(torch.randint(1, 12, (1,), generator=g))
        out += [int(torch.randint(-1, MAX_LORAS, (1,), generator=g))] * length
    out[0] = 1                                  # never all padding
    if num_tokens > 2:
        out[num_tokens - 1] = -1
    return torch.tensor(out[:num_tokens], dtype=torch.int32)


def _case(num_tokens, rank, slices, dtype, seed=0):
    g = _gen(seed * 7919 + num_tokens * 31 + rank)
    n, k, s = sum(slices), IN_FEATURES, len(slices)
    x = torch.randn(num_tokens, k, generator=g).to(dtype)
    lora_a = (torch.randn(MAX_LORAS, s * rank, k, generator=g) * 0.2).to(dtype)
    lora_b = (torch.randn(MAX_LORAS, n, rank, generator=g) * 0.2).to(dtype)
    scalings = torch.rand(MAX_LORAS, generator=g) + 0.25
    y = torch.randn(num_tokens, n, generator=g).to(dtype)
    return x, lora_a, lora_b, scalings, y, _lora_indices(num_tokens, g)


def _close(got, want, dtype):
    tol = LORA_TOLERANCE[dtype]
    assert not got.isnan().any(), "an output element was never written"
    torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol)


@pytest.fixture
def cpu_kernels():
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    registry.cpu_fast_ops()


# ------------------------------------------------------------------------------------------------
# The reference against a float64 loop
# ------------------------------------------------------------------------------------------------

def _loop_oracle(x, lora_a, lora_b, scalings, y, idx, slices):
    """Explicit loops in float64: (shrink output, expanded y)."""
    T, rank = x.shape[0], lora_b.shape[2]
    shrunk = torch.zeros(T, lora_a.shape[1], dtype=torch.float64)
    out = y.double().clone()
    for t in range(T):
        i = int(idx[t])
        if i < 0:
            continue
        for j in range(lora_a.shape[1]):
            shrunk[t, j] = float(scalings[i]) * sum(float(lora_a[i, j, k]) * float(x[t, k]) for k in range(x.shape[1]))
        n = 0
        for s, size in enumerate(slices):
            for _ in range(size):
                out[t, n] += sum(float(shrunk[t, s * rank + r]) * float(lora_b[i, n, r]) for r in range(rank))
                n += 1
    return shrunk, out


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_a_float64_loop(dtype):
    slices = (6, 3, 5)
    x, lora_a, lora_b, scalings, y, idx = _case(7, 3, slices, dtype)
    x, lora_a = x[:, :10].contiguous(), lora_a[:, :, :10].contiguous()
    shrunk_want, y_want = _loop_oracle(x, lora_a, lora_b, scalings, y, idx, slices)
    shrunk = RL.lora_shrink_reference(x, lora_a, idx, scalings)
    torch.testing.assert_close(shrunk.double(), shrunk_want, atol=1e-5, rtol=1e-5)
    got = y.clone()
    RL.lora_expand_reference(got, shrunk, lora_b, idx, list(slices))
    # y's dtype rounds once: within one ulp of the float64 value
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(got.double(), y_want, atol=1e-5, rtol=ulp)
    padding = idx < 0
    assert torch.equal(got[padding], y[padding])


# ------------------------------------------------------------------------------------------------
# The CPU kernels (C++ dispatcher kernels over qwen_cpu_lora.c)
# ------------------------------------------------------------------------------------------------

def _cpu_on_threads(x, lora_a, lora_b, scalings, y, idx, want, slices) -> dict:
    """``{threads: (shrink's output, y after expand)}`` for 1 and 2 threads (expand from the reference's buffer)."""
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            shrunk = torch.ops.qwen.lora_shrink(x, lora_a, idx, scalings)
            got = y.clone()
            torch.ops.qwen.lora_expand(got, want, lora_b, idx, list(slices))
        finally:
            torch.set_num_threads(1)
        results[threads] = (shrunk, got)
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("rank", RANKS)
def test_cpu_kernels_match_the_reference(rank, slices, num_tokens, dtype, cpu_kernels, poisoned_empty):
    x, lora_a, lora_b, scalings, y, idx = _case(num_tokens, rank, slices, dtype)
    want = RL.lora_shrink_reference(x, lora_a, idx, scalings)
    y_want = y.clone()
    RL.lora_expand_reference(y_want, want, lora_b, idx, list(slices))
    results = _cpu_on_threads(x, lora_a, lora_b, scalings, y, idx, want, slices)
    shrunk, got = results[1]
    _close(shrunk, want, torch.float32)
    _close(got, y_want, dtype)
    padding = idx < 0
    assert torch.equal(got[padding], y[padding]), "rows without an adapter must stay untouched"
    assert torch.equal(results[2][0], shrunk) and torch.equal(results[2][1], got), "2 threads changed the bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [8, 16, 20])
def test_cpu_kernels_long_runs_match_the_reference(rank, dtype, cpu_kernels, poisoned_empty):
    """A prefill's long runs of one adapter (the kernels' long-block paths: k in several passes with a tail,
    columns past a slice's last whole tile), also one row at a time: each row's bits whatever its neighbours."""
    g = _gen(rank)
    slices, k = (200, 72, 37), 1100
    n, s = sum(slices), len(slices)
    idx = torch.tensor([0] * 70 + [-1] * 5 + [2] * 53 + [1] * 3 + [2] * 40 + [3] * 17, dtype=torch.int32)
    t = idx.numel()
    x = torch.randn(t, k, generator=g).to(dtype)
    lora_a = (torch.randn(MAX_LORAS, s * rank, k, generator=g) * 0.05).to(dtype)
    lora_b = (torch.randn(MAX_LORAS, n, rank, generator=g) * 0.2).to(dtype)
    scalings = torch.rand(MAX_LORAS, generator=g) + 0.25
    y = torch.randn(t, n, generator=g).to(dtype)
    want = RL.lora_shrink_reference(x, lora_a, idx, scalings)
    y_want = y.clone()
    RL.lora_expand_reference(y_want, want, lora_b, idx, list(slices))
    results = _cpu_on_threads(x, lora_a, lora_b, scalings, y, idx, want, slices)
    shrunk, got = results[1]
    _close(shrunk, want, torch.float32)
    if dtype == torch.float16:
        torch.testing.assert_close(got.float(), y_want.float(), atol=1e-3, rtol=2.0 ** -10)
    else:
        _close(got, y_want, dtype)
    assert torch.equal(got[idx < 0], y[idx < 0]), "rows without an adapter must stay untouched"
    assert torch.equal(results[2][0], shrunk) and torch.equal(results[2][1], got), "2 threads changed the bits"
    for row in (0, 50, 69, 80, 130, 160, t - 1):
        alone = torch.ops.qwen.lora_shrink(x[row:row + 1], lora_a, idx[row:row + 1], scalings)
        assert torch.equal(alone, shrunk[row:row + 1]), f"row {row} alone: other shrink bits"
        got1 = y[row:row + 1].clone()
        torch.ops.qwen.lora_expand(got1, want[row:row + 1], lora_b, idx[row:row + 1], list(slices))
        assert torch.equal(got1, got[row:row + 1]), f"row {row} alone: other expand bits"


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_cpu_expand_rounds_special_values_as_torch(num_tokens, cpu_kernels):
    """bf16 y + a zero delta, rounded once: subnormals, infinities, NaNs, -0 come out as torch's y.float() + 0
    rounded to bf16 (a rounding instruction that takes subnormals as zeros would not), bit for bit."""
    g = _gen(11)
    slices, rank = (96, 40), 16
    n = sum(slices)
    specials = torch.tensor([1e-39, -3e-40, 9.2e-41, 1.1754e-38, float("inf"), -float("inf"), float("nan"), -0.0,
                             3.0e38, 1.0, -2.5, 0.0], dtype=torch.float32)
    y = specials[torch.randint(0, specials.numel(), (num_tokens, n), generator=g)].bfloat16()
    idx = torch.zeros(num_tokens, dtype=torch.int32)
    buf = torch.randn(num_tokens, len(slices) * rank, generator=g)
    lora_b = torch.zeros(MAX_LORAS, n, rank, dtype=torch.bfloat16)
    got, want = y.clone(), y.clone()
    torch.ops.qwen.lora_expand(got, buf, lora_b, idx, list(slices))
    RL.lora_expand_reference(want, buf, lora_b, idx, list(slices))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got.view(torch.int16), (y.float() + 0.0).bfloat16().view(torch.int16))


def test_cpu_kernels_take_float16_and_strided_rows(cpu_kernels, poisoned_empty):
    x, lora_a, lora_b, scalings, y, idx = _case(37, 8, (40, 12), torch.float16)
    wide = torch.randn(37, IN_FEATURES + 5, generator=_gen(3)).half()
    x = wide[:, :IN_FEATURES]                           # rows 77 elements apart
    _close(torch.ops.qwen.lora_shrink(x, lora_a, idx, scalings), RL.lora_shrink_reference(x, lora_a, idx, scalings),
           torch.float32)
    buf = RL.lora_shrink_reference(x, lora_a, idx, scalings)
    big = torch.randn(37, 60, generator=_gen(4)).half()
    got, want = big.clone(), big.clone()
    torch.ops.qwen.lora_expand(got[:, :52], buf, lora_b, idx, [40, 12])
    RL.lora_expand_reference(want[:, :52], buf, lora_b, idx, [40, 12])
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2.0 ** -10)
    assert torch.equal(got[:, 52:], big[:, 52:])


def test_cpu_kernels_run_the_c_arithmetic(cpu_kernels):
    """The op on CPU tensors is the C++ kernel, not the reference fallback: its registration replaced the one
    made at import."""
    for name in ("lora_shrink", "lora_expand"):
        active = [line for line in torch._C._dispatch_dump(f"qwen::{name}").splitlines() if line.startswith("CPU:")]
        assert len(active) == 1 and "qwen_cpu_ops.cpp" in active[0], active


# ------------------------------------------------------------------------------------------------
# The Triton kernels (interpreter on CPU tensors; a GPU runs them through the op)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,rank,slices,one_slot_tile", TRITON_CASES)
def test_triton_kernels_match_the_reference(num_tokens, rank, slices, one_slot_tile, dtype, device, poisoned_empty):
    pytest.importorskip("triton")
    from qwen_ops.ops.backend import why_unavailable
    from qwen_ops.ops.kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    reason = why_unavailable("triton", device)
    if reason is not None:
        pytest.skip(reason)
    x, lora_a, lora_b, scalings, y, idx = (t.to(device) for t in _case(num_tokens, rank, slices, dtype, seed=2))
    if one_slot_tile:
        idx[:16] = 2
    else:
        idx[::3] = 0                             # every 16-row tile mixes slots
    want = RL.lora_shrink_reference(x, lora_a, idx, scalings)
    _close(lora_shrink_triton(x, lora_a, idx, scalings), want, torch.float32)
    got, y_want = y.clone(), y.clone()
    lora_expand_triton(got, want, lora_b, idx, list(slices))
    RL.lora_expand_reference(y_want, want, lora_b, idx, list(slices))
    _close(got, y_want, dtype)
    padding = idx < 0
    assert torch.equal(got[padding], y[padding])


# ------------------------------------------------------------------------------------------------
# Errors, opcheck, fakes, torch.compile
# ------------------------------------------------------------------------------------------------

def _valid():
    x, lora_a, lora_b, scalings, y, idx = _case(5, 4, (10, 6), torch.float32)
    buf = torch.randn(5, 8)
    return dict(x=x, lora_a=lora_a, lora_indices=idx, scalings=scalings), \
        dict(y=y, buffer=buf, lora_b=lora_b[:, :16].contiguous(), lora_indices=idx, slice_sizes=[10, 6])


SHRINK_ERRORS = [
    ("x", lambda a: a["x"][0], r"x has shape \(72,\) \(rank 1\), expected rank 2"),
    ("x", lambda a: a["x"].long(), r"x has dtype torch.int64, expected one of float32, float16, bfloat16"),
    ("lora_a", lambda a: a["lora_a"].bfloat16(), r"lora_a has dtype torch.bfloat16, expected x's torch.float32"),
    ("lora_a", lambda a: a["lora_a"][..., :70].contiguous(), r"lora_a has shape \(4, 8, 70\), expected \[max_loras, num_slices "
                                                r"\* max_rank, 72\] \(x's in_features\)"),
    ("lora_a", lambda a: a["lora_a"].transpose(1, 2).contiguous().transpose(1, 2),
     r"lora_a has shape \(4, 8, 72\) and strides .*, expected a contiguous tensor"),
    ("lora_indices", lambda a: a["lora_indices"].long(), r"lora_indices has dtype torch.int64, expected torch.int32"),
    ("lora_indices", lambda a: a["lora_indices"][:4], r"lora_indices has shape \(4,\), expected \[5\] \(one adapter "
                                                      r"slot per row of x\)"),
    ("scalings", lambda a: a["scalings"][:3], r"scalings has shape \(3,\) and dtype torch.float32, expected float32 "
                                              r"\[4\] \(one per slot of lora_a\)"),
]
EXPAND_ERRORS = [
    ("y", lambda a: a["y"].t(), r"y has stride .*: its last dimension must be contiguous"),
    ("buffer", lambda a: a["buffer"].double(), r"buffer has dtype torch.float64, expected torch.float32"),
    ("buffer", lambda a: a["buffer"][:4], r"buffer has shape \(4, 8\), expected \[5, num_slices \* max_rank\] "
                                          r"\(y's rows\)"),
    ("lora_b", lambda a: a["lora_b"].bfloat16(), r"lora_b has dtype torch.bfloat16, expected y's torch.float32"),
    ("slice_sizes", lambda a: [16], r"buffer has shape \(5, 8\), expected \[5, 4\] \(len\(slice_sizes\) = 1 slices "
                                    r"of max_rank = 4, lora_b.shape\[2\]\)"),
    ("slice_sizes", lambda a: [10, 5], r"slice_sizes = \[10, 5\] sums to 15, expected lora_b.shape\[1\] = 16"),
    ("slice_sizes", lambda a: [0, 16], r"slice_sizes = \[0, 16\], expected a non-empty list of positive ints"),
    ("y", lambda a: a["y"][:, :12], r"y has shape \(5, 12\), expected \[5, 16\] \(lora_b's out_features\)"),
    ("lora_indices", lambda a: a["lora_indices"][:3], r"lora_indices has shape \(3,\), expected \[5\] \(one adapter "
                                                      r"slot per row of y\)"),
]
VALUE_ERRORS = [(torch.tensor([0, 1, 4, -1, 0], dtype=torch.int32), r"lora_indices\[2\] = 4, but only 4 adapter "
                 r"slots exist; expected -1 \(no adapter\) or 0 <= slot < 4"),
                (torch.tensor([0, -2, 1, -1, 0], dtype=torch.int32), r"lora_indices\[1\] = -2, but only 4")]


def _runners(cpu_ok: bool):
    """The Python checks (the fakes' and the CUDA kernels') and, where it builds, the C++ kernel."""
    out = {"validation": (lambda **a: V.check_lora_shrink(**a), lambda **a: V.check_lora_expand(**a))}
    if cpu_ok:
        out["c++"] = (lambda **a: torch.ops.qwen.lora_shrink(*a.values()),
                      lambda **a: torch.ops.qwen.lora_expand(*a.values()))
    return out


def _cpu_ok() -> bool:
    return cpu.why_unavailable() is None and bool(registry.cpu_fast_ops())


@pytest.mark.parametrize("case", range(len(SHRINK_ERRORS) + len(EXPAND_ERRORS)))
def test_errors_name_the_argument_value_and_expectation(case):
    for name, (shrink, expand) in _runners(_cpu_ok()).items():
        shrink_args, expand_args = _valid()
        shrink(**shrink_args)
        expand(**expand_args)                        # the valid arguments pass
        if case < len(SHRINK_ERRORS):
            arg, bad, message = SHRINK_ERRORS[case]
            shrink_args[arg] = bad(shrink_args)
            with pytest.raises(ValueError, match=message):
                shrink(**shrink_args)
        else:
            arg, bad, message = EXPAND_ERRORS[case - len(SHRINK_ERRORS)]
            before = expand_args["y"].clone()
            expand_args[arg] = bad(expand_args)
            with pytest.raises(ValueError, match=message):
                expand(**expand_args)
            assert torch.equal(expand_args["y"] if arg != "y" else before, before), f"{name} wrote y before its checks"


@pytest.mark.parametrize("bad,message", VALUE_ERRORS)
def test_index_values_are_checked(bad, message):
    shrink_args, expand_args = _valid()
    with pytest.raises(ValueError, match=message):
        V.check_lora_indices_values(bad, 4)
    y = expand_args["y"].clone()
    with pytest.raises(ValueError, match=message):            # the CPU op (C++ or the reference's checks)
        torch.ops.qwen.lora_shrink(shrink_args["x"], shrink_args["lora_a"], bad, shrink_args["scalings"])
    with pytest.raises(ValueError, match=message):
        torch.ops.qwen.lora_expand(y, expand_args["buffer"], expand_args["lora_b"], bad, [10, 6])
    assert torch.equal(y, expand_args["y"]), "nothing is written before the checks pass"


def test_opcheck():
    shrink_args, expand_args = _valid()
    torch.library.opcheck(torch.ops.qwen.lora_shrink.default, tuple(shrink_args.values()))
    torch.library.opcheck(torch.ops.qwen.lora_expand.default, tuple(expand_args.values()))


def test_fake_kernels_trace_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    shrink_args, expand_args = _valid()
    mode = FakeTensorMode()
    with mode:
        fake = {k: mode.from_tensor(v) for k, v in shrink_args.items()}
        out = torch.ops.qwen.lora_shrink(*fake.values())
        assert out.shape == (5, 8) and out.dtype == torch.float32
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in expand_args.items()}
        assert torch.ops.qwen.lora_expand(*fake.values()) is None
        fake["slice_sizes"] = [10, 5]
        with pytest.raises(ValueError, match="sums to 15"):
            torch.ops.qwen.lora_expand(*fake.values())


def test_compiled_shrink_then_expand_in_place():
    """torch.compile(fullgraph=True) keeps both ops whole, and the in-place expand lands in the caller's y."""
    import torch._dynamo

    x, lora_a, lora_b, scalings, y, idx = _case(9, 8, (40, 16, 24), torch.float32)

    def lora_layer(x, y, lora_a, lora_b, idx, scalings):
        buf = torch.ops.qwen.lora_shrink(x, lora_a, idx, scalings)
        torch.ops.qwen.lora_expand(y, buf, lora_b, idx, [40, 16, 24])
        return y.sum()

    torch._dynamo.reset()
    compiled = torch.compile(lora_layer, fullgraph=True, backend="aot_eager")
    got, want = y.clone(), y.clone()
    total = compiled(x, got, lora_a, lora_b, idx, scalings)
    lora_layer(x, want, lora_a, lora_b, idx, scalings)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(total, want.sum())
    assert not torch.equal(got, y), "the expand changed y"
