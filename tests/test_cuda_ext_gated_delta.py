"""Tests of the CUDA C++ kernels of the hybrid state ops (csrc/qwen_gated_delta_kernels.cuh):
torch.ops._qwen_C.causal_conv1d and torch.ops._qwen_C.gated_delta_rule.

* Everywhere with g++ (C++20): the real kernels, their dispatch and grids run on CPU tensors
  through the SIMT emulator (tests/emulation/, built by the ``emulator`` fixture of
  tests/test_cuda_ext.py) against the reference kernels (qwen_ops/ops/kernels/reference_gated_delta.py):
  fresh random inputs from tests/test_ops_gated_delta.py's case builders (strided views of one
  projection, NaN in the rows of padding sequences and in the state of slots that start here),
  outputs NaN-poisoned before the run. Live rows must match the reference, padding rows must stay
  untouched (the host allocates them as zeros), slots no sequence uses must come back bit for bit,
  and a sequence fed in chunks (prefill, decode tokens, a chunk shorter than the conv window) must
  equal one call. GQA ratios 1 and 2, several k_dim templates, partial value tiles.
* With a GPU and the built extension: the ``cuda`` backend through torch.ops.qwen.* against the
  reference, and a decode step of both ops captured in a CUDA graph and replayed.

The schema-drift and registration checks of these ops run in tests/test_cuda_ext.py (CUDA_OPS).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import qwen_ops
from qwen_ops.ops.kernels.reference_gated_delta import L2NORM_EPS, causal_conv1d_reference, gated_delta_rule_reference
from test_cuda_ext import (DTYPE_CODE, GPU_REASON, _i64s, _ptr, capture_in_cuda_graph,  # noqa: F401
                           emulator)  # emulator: a fixture
from test_ops_gated_delta import (CHUNKS, LINEAR_TOLERANCE, SCENARIOS, Seq, make_conv_case, make_delta_case,
                             make_metadata)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCENARIO_NAMES = tuple(SCENARIOS)
GQA_RATIOS = (1, 2)
# GPU work: deselected without a CUDA GPU (conftest.py); skipped when the extension is not built.
def needs_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))(test))


def _close(out: torch.Tensor, expected: torch.Tensor, dtype, what: str) -> None:
    tol = LINEAR_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol.atol, rtol=tol.rtol, equal_nan=False,
                               msg=lambda m: f"{what}\n{m}")


def _check_rows(meta, out: torch.Tensor, expected: torch.Tensor, dtype, pad_value: float, what: str) -> None:
    """Live rows match the reference; padding rows hold `pad_value` (NaN: untouched; 0: zeroed)."""
    live, pad = meta.rows("live").to(out.device), meta.rows("padding").to(out.device)
    _close(out[live], expected[live], dtype, what)
    if pad_value != pad_value:
        assert bool(out[pad].isnan().all()), f"{what}: a padding row was written"
    else:
        assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"{what}: padding rows are not zero"


def _check_state(meta, got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, exact: bool, what: str) -> None:
    """Slots no sequence updates are unchanged bit for bit; the others match the reference."""
    untouched = meta.untouched_slots()
    for slot in untouched:
        assert torch.equal(got[slot].nan_to_num(7.0), before[slot].nan_to_num(7.0)), f"{what}: slot {slot} written"
    written = [s for s in range(got.shape[0]) if s not in untouched]
    assert not got[written].isnan().any(), f"{what}: a written state holds NaN"
    if exact:  # the conv state holds copies of inputs
        assert torch.equal(got[written], want[written]), f"{what}: conv state differs from the reference"
    else:
        _close(got[written], want[written], torch.float32, f"{what}: state")


# ---- the kernels on the CPU, through the SIMT emulator ----------------------------------------------

def emulate_causal_conv1d(lib, x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> torch.Tensor:
    """The CUDA conv kernels on CPU tensors; conv_state updated in place; the output starts as NaN."""
    out = torch.full(x.shape, float("nan"), dtype=x.dtype)
    dims = [x.shape[0], x.shape[1], weight.shape[1], seq_slots.shape[0], conv_state.shape[0]]
    strides = [x.stride(0), out.stride(0), weight.stride(0), weight.stride(1), 0 if bias is None else bias.stride(0),
               *conv_state.stride(), seq_slots.stride(0), query_start_loc.stride(0), seq_lens.stride(0)]
    rc = lib.qwen_emu_causal_conv1d(ctypes.c_int(DTYPE_CODE[x.dtype]), _ptr(x), _ptr(weight), _ptr(bias),
                                    _ptr(conv_state), _ptr(out), _ptr(seq_slots), _ptr(query_start_loc),
                                    _ptr(seq_lens), _i64s(dims), _i64s(strides))
    assert rc == 0, "no conv kernel for this input"
    return out


def emulate_gated_delta_rule(lib, q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens,
                             scale: float) -> torch.Tensor:
    """The CUDA delta-rule kernel on CPU tensors; state updated in place; the output starts as NaN."""
    out = torch.full(v.shape, float("nan"), dtype=v.dtype)
    dims = [q.shape[0], q.shape[1], v.shape[1], q.shape[2], v.shape[2], seq_slots.shape[0], state.shape[0]]
    strides = [q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), *state.stride()[:3],
               seq_slots.stride(0), query_start_loc.stride(0), seq_lens.stride(0)]
    dtypes = (ctypes.c_int * 3)(DTYPE_CODE[q.dtype], DTYPE_CODE[g.dtype], DTYPE_CODE[beta.dtype])
    rc = lib.qwen_emu_gated_delta_rule(dtypes, _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(state),
                                       _ptr(out), _ptr(seq_slots), _ptr(query_start_loc), _ptr(seq_lens),
                                       _i64s(dims), _i64s(strides), ctypes.c_double(scale),
                                       ctypes.c_double(L2NORM_EPS))
    if rc != 0:
        raise RuntimeError("no gated_delta_rule kernel for this input")
    return out


def _compare_conv(lib, case, dtype, what: str) -> None:
    ref_state, state = case.conv_state.clone(), case.conv_state.clone()
    expected = causal_conv1d_reference(*case.args(ref_state))
    out = emulate_causal_conv1d(lib, *case.args(state))
    _check_rows(case.meta, out, expected, dtype, float("nan"), what)
    _check_state(case.meta, state, ref_state, case.conv_state, exact=True, what=what)


def _compare_delta(lib, case, dtype, what: str) -> None:
    ref_state, state = case.state.clone(), case.state.clone()
    expected = gated_delta_rule_reference(*case.args(ref_state))
    out = emulate_gated_delta_rule(lib, *case.args(state))
    _check_rows(case.meta, out, expected, dtype, float("nan"), what)
    _check_state(case.meta, state, ref_state, case.state, exact=False, what=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_emulated_causal_conv1d_scenarios(emulator, scenario, dtype):
    case = make_conv_case(scenario, dtype=dtype, device="cpu", seed=30)
    _compare_conv(emulator, case, dtype, f"conv {scenario} {dtype}")


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("kernel", (4, 2, 1))
def test_emulated_causal_conv1d_kernels_and_bias(emulator, kernel, bias):
    """dim 140: two channel tiles, the second partial; kernel 1 has no state to update."""
    case = make_conv_case("mixed", dtype=torch.float32, device="cpu", kernel=kernel, bias=bias, dim=140, seed=31)
    _compare_conv(emulator, case, torch.float32, f"conv kernel {kernel} bias {bias}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_emulated_gated_delta_rule_scenarios(emulator, scenario, dtype):
    case = make_delta_case(scenario, dtype=dtype, device="cpu", ratio=2, seed=32)
    _compare_delta(emulator, case, dtype, f"delta {scenario} {dtype}")


@pytest.mark.parametrize("k_dim, v_dim", ((16, 40), (64, 32), (100, 24), (256, 8)))
@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_emulated_gated_delta_rule_shapes(emulator, ratio, k_dim, v_dim):
    """Every k_dim template (32/64/128/256, padded ones), value tiles full, partial and two of them,
    GQA ratios 1 and 2; g in fp32 and beta in bf16 (each may have its own dtype)."""
    case = make_delta_case("mixed", dtype=torch.bfloat16, device="cpu", num_k_heads=2, ratio=ratio, k_dim=k_dim,
                           v_dim=v_dim, seed=33 + k_dim)
    assert case.g.dtype == torch.float32 and case.beta.dtype == torch.bfloat16
    _compare_delta(emulator, case, torch.bfloat16, f"delta ratio {ratio} k{k_dim} v{v_dim}")


def test_emulated_chunks_equal_one_call(emulator):
    """A 24-token sequence fed as CHUNKS (prefill, decode tokens, a chunk shorter than the conv window)
    beside a decode row of another slot gives the outputs and final state of one call."""
    total = sum(CHUNKS)
    conv = make_conv_case(None, dtype=torch.float32, device="cpu", seqs=(Seq(1, 0, total),), seed=40)
    delta = make_delta_case(None, dtype=torch.float32, device="cpu", seqs=(Seq(1, 0, total),), seed=41)
    conv_whole, delta_whole = conv.conv_state.clone(), delta.state.clone()
    out_conv = emulate_causal_conv1d(emulator, *conv.args(conv_whole))
    out_delta = emulate_gated_delta_rule(emulator, *delta.args(delta_whole))

    conv_state, delta_state = conv.conv_state.clone(), delta.state.clone()
    other = Seq(3, 4, 1)
    extra = make_delta_case(None, dtype=torch.float32, device="cpu", seqs=(other,), seed=42)
    extra_conv = make_conv_case(None, dtype=torch.float32, device="cpu", seqs=(other,), seed=43)
    conv_rows, delta_rows, done = [], [], 0
    for n in CHUNKS:
        meta = make_metadata((other, Seq(1, done, n)), "cpu").args()
        x = torch.cat([extra_conv.x, conv.x[done:done + n]])
        conv_rows.append(emulate_causal_conv1d(emulator, x, conv.weight, conv.bias, conv_state, *meta)[1:])
        parts = [torch.cat([a, b[done:done + n]]) for a, b in
                 zip((extra.q, extra.k, extra.v, extra.g, extra.beta), (delta.q, delta.k, delta.v, delta.g, delta.beta))]
        delta_rows.append(emulate_gated_delta_rule(emulator, *parts, delta_state, *meta, delta.scale)[1:])
        done += n
    _close(torch.cat(conv_rows), out_conv, torch.float32, "conv chunks")
    assert torch.equal(conv_state[1], conv_whole[1]), "conv state after chunks differs from one call"
    _close(torch.cat(delta_rows), out_delta, torch.float32, "delta chunks")
    _close(delta_state[1], delta_whole[1], torch.float32, "delta state after chunks")


def test_emulated_unsupported_k_dim_has_no_kernel(emulator):
    case = make_delta_case("decode", dtype=torch.float32, device="cpu", k_dim=300, v_dim=4, seed=44)
    with pytest.raises(RuntimeError, match="no gated_delta_rule kernel"):
        emulate_gated_delta_rule(emulator, *case.args(case.state.clone()))


# ---- GPU: the cuda backend against the reference ----------------------------------------------------

def _poison_next_allocation(like: torch.Tensor) -> None:
    torch.full((like.numel() + 64,), float("nan"), dtype=like.dtype, device=like.device)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_cuda_state_ops_match_reference(scenario, dtype):
    dev = torch.device("cuda")
    for ratio in GQA_RATIOS:
        conv = make_conv_case(scenario, dtype=dtype, device=dev, dim=200, seed=50 + ratio)
        delta = make_delta_case(scenario, dtype=dtype, device=dev, ratio=ratio, k_dim=128, v_dim=72, seed=60 + ratio)
        for case, op, ref, state_of in ((conv, torch.ops.qwen.causal_conv1d, causal_conv1d_reference, "conv_state"),
                                        (delta, torch.ops.qwen.gated_delta_rule, gated_delta_rule_reference, "state")):
            before = getattr(case, state_of)
            ref_state, state = before.clone(), before.clone()
            expected = ref(*case.args(ref_state))
            _poison_next_allocation(expected)
            with qwen_ops.use_backend("cuda"):
                out = op(*case.args(state))
            torch.cuda.synchronize()
            what = f"{op} {scenario} {dtype} ratio {ratio}"
            _check_rows(case.meta, out, expected, dtype, 0.0, what)
            _check_state(case.meta, state, ref_state, before, exact=state_of == "conv_state", what=what)


@needs_gpu
def test_cuda_state_ops_decode_step_in_cuda_graph():
    """Both ops captured once for a padded decode batch, replayed on new inputs in the same buffers."""
    dev = torch.device("cuda")
    seqs = (Seq(0, 5, 1), Seq(2, 9, 1), Seq(-1, 0, 1), Seq(4, 1, 1))
    conv = make_conv_case(None, dtype=torch.bfloat16, device=dev, dim=256, seqs=seqs, seed=70)
    delta = make_delta_case(None, dtype=torch.bfloat16, device=dev, k_dim=128, v_dim=128, seqs=seqs, seed=71)
    conv_state, state = conv.conv_state.clone(), delta.state.clone()

    def step():
        return (torch.ops.qwen.causal_conv1d(*conv.args(conv_state)),
                torch.ops.qwen.gated_delta_rule(*delta.args(state)))

    graph, outs = capture_in_cuda_graph(step)
    for t in (conv.x, delta.q, delta.k, delta.v):
        live = conv.meta.rows("live").to(dev)
        t[live] = torch.randn_like(t[live])
    conv_state.copy_(conv.conv_state.nan_to_num(0.5))
    state.copy_(delta.state.nan_to_num(0.5))
    conv_ref, state_ref = conv_state.clone(), state.clone()
    expected = (causal_conv1d_reference(*conv.args(conv_ref)), gated_delta_rule_reference(*delta.args(state_ref)))
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    # The padding row is not written by the kernels; the graph re-zeroes it with the output allocation.
    _check_rows(conv.meta, outs[0], expected[0], torch.bfloat16, 0.0, "graph conv")
    _check_rows(delta.meta, outs[1], expected[1], torch.bfloat16, 0.0, "graph delta")
    assert torch.equal(conv_state, conv_ref)
    _close(state, state_ref, torch.float32, "graph state")
