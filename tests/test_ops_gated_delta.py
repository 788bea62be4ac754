"""Tests of torch.ops.qwen.causal_conv1d and torch.ops.qwen.gated_delta_rule (hybrid-model state ops).

* The reference is checked against independent oracles: transformers' own torch fallbacks
  (``torch_recurrent_gated_delta_rule``, ``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn`` /
  ``causal_conv1d_update``) and, for the chunked prefill form, the token-by-token recurrence.
* Every available backend is checked against the reference on fresh random inputs: slots of
  sequences that start here hold NaN (the op must not read them), slots no sequence touches hold
  random values that must come back bit for bit, padding sequences' input rows are NaN and their
  output rows must be zero, outputs are allocated over freed NaN memory, inputs are strided views
  split from one projection as the model splits them.
* A sequence fed in chunks (prefill chunks, single decode tokens, chunks shorter than the conv
  window) gives the same outputs and final state as one call; opcheck; bad inputs raise a
  ValueError naming the argument with nothing written; a backend without kernels raises a clear
  RuntimeError; torch.compile(fullgraph=True) traces both ops.

On a CPU-only machine the triton backend runs under TRITON_INTERPRET=1 (tests/conftest.py), so
shapes are tiny.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import qwen_ops
from qwen_ops.ops import registry as ops
from qwen_ops.ops.kernels.reference_gated_delta import (causal_conv1d_reference, delta_rule_chunked, delta_rule_recurrent,
                                               gated_delta_rule_recurrent, gated_delta_rule_reference, l2norm)
from conftest import BACKEND_PARAMS, backend_unavailable_reason
from tolerances import Tolerance


@pytest.fixture(params=[p for p in BACKEND_PARAMS if p != "cpu"])
def backend(request, device):
    """conftest's backend fixture less the cpu backend, which has no native state-op kernels (it
    runs these ops with the reference kernels): comparing it with the reference would test nothing."""
    reason = backend_unavailable_reason(request.param, device)
    if reason is not None:
        pytest.skip(f"backend {request.param!r} unavailable on {device}: {reason}")
    return request.param


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_RATIOS = [1, 2, 3]          # num_v_heads // num_k_heads
CONV_KERNELS = [4, 2]
MAX_SLOTS = 5

# Both ops compute in fp32 and round the output once to the input dtype: one or two ulps apart.
# fp32 allows for the chunked form's different summation order (it reached ~3e-7 here).
LINEAR_TOLERANCE = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}


def _ids(value) -> str:
    return str(value).removeprefix("torch.")


def assert_linear_close(out, expected, dtype, msg: str = "") -> None:
    tol = LINEAR_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol.atol, rtol=tol.rtol,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


@dataclass(frozen=True)
class Seq:
    slot: int      # -1 = padding sequence
    context: int   # tokens already in the slot; 0 = the sequence starts in this call
    q_len: int     # rows this call; seq_len = context + q_len


SCENARIOS = {
    # a one-token prompt (slot 3) starts from zero; a padding sequence in the middle
    "decode": (Seq(2, 4, 1), Seq(-1, 0, 1), Seq(0, 17, 1), Seq(3, 0, 1)),
    "prefill": (Seq(1, 0, 7), Seq(0, 0, 12), Seq(3, 0, 1)),
    # continuing chunks; 2 rows is shorter than the conv window of 3, so old inputs shift
    "chunk": (Seq(2, 9, 6), Seq(0, 20, 2)),
    "mixed": (Seq(0, 10, 1), Seq(1, 0, 9), Seq(2, 5, 4), Seq(4, 30, 1)),
    # padding sequences with rows, a live sequence with no rows this call
    "padding": (Seq(1, 6, 3), Seq(-1, 0, 2), Seq(2, 5, 0), Seq(0, 12, 1), Seq(-1, 0, 1)),
    # more than one chunk of the chunked form (64 tokens), starting and continuing
    "long": (Seq(0, 0, 70), Seq(3, 11, 66)),
}
SCENARIO_NAMES = list(SCENARIOS)


@dataclass(frozen=True)
class Metadata:
    seqs: tuple[Seq, ...]
    seq_slots: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return sum(s.q_len for s in self.seqs)

    def rows(self, kind: str) -> torch.Tensor:
        """Bool [num_tokens]: rows of padding sequences ("padding") or of live ones ("live")."""
        mask = []
        for s in self.seqs:
            mask += [(s.slot < 0) == (kind == "padding")] * s.q_len
        return torch.tensor(mask, dtype=torch.bool)

    def untouched_slots(self) -> list[int]:
        """Slots whose state no sequence of this call may change."""
        written = {s.slot for s in self.seqs if s.slot >= 0 and s.q_len > 0}
        return [slot for slot in range(MAX_SLOTS) if slot not in written]

    def fresh_slots(self) -> list[int]:
        return [s.slot for s in self.seqs if s.slot >= 0 and s.context == 0 and s.q_len > 0]

    def args(self) -> tuple:
        return self.seq_slots, self.query_start_loc, self.seq_lens


def make_metadata(seqs, device) -> Metadata:
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.q_len)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return Metadata(tuple(seqs), i32([s.slot for s in seqs]), i32(starts),
                    i32([s.context + s.q_len if s.slot >= 0 else 3 for s in seqs]))


def _state_for(meta: Metadata, shape, dtype, device, gen) -> torch.Tensor:
    """Random state; NaN in the slots of sequences that start here (they must not be read)."""
    state = torch.randn((MAX_SLOTS,) + tuple(shape), generator=gen).to(device, dtype)
    for slot in meta.fresh_slots():
        state[slot] = float("nan")
    return state


def _poison_rows(meta: Metadata, *tensors: torch.Tensor) -> None:
    pad = meta.rows("padding").to(tensors[0].device)
    for t in tensors:
        t[pad] = float("nan")


def poison_allocator(like: torch.Tensor) -> None:
    """Free a NaN-filled block of ``like``'s size, so a kernel's output allocation likely reuses it."""
    torch.full((like.numel() + 64,), float("nan"), dtype=like.dtype, device=like.device)


def run_op(backend: str, op, *args):
    with qwen_ops.use_backend(backend):
        return op(*args)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvCase:
    meta: Metadata
    x: torch.Tensor             # [T, dim], a strided view (columns of a wider projection)
    weight: torch.Tensor        # [dim, kernel]
    bias: Optional[torch.Tensor]
    conv_state: torch.Tensor    # [MAX_SLOTS, dim, kernel - 1]

    def args(self, conv_state: Optional[torch.Tensor] = None) -> tuple:
        state = self.conv_state if conv_state is None else conv_state
        return (self.x, self.weight, self.bias, state) + self.meta.args()


def make_conv_case(scenario, *, dtype, device, dim: int = 24, kernel: int = 4, bias: bool = True,
                   seed: int = 0, seqs=None) -> ConvCase:
    gen = torch.Generator().manual_seed(seed)
    meta = make_metadata(seqs or SCENARIOS[scenario], device)
    wide = torch.randn(meta.num_tokens, dim + 8, generator=gen).to(device, dtype)
    x = wide[:, 4:4 + dim]
    _poison_rows(meta, x)
    weight = (torch.randn(dim, 1, kernel, generator=gen) * 0.5).to(device, dtype).squeeze(1)  # as conv1d.weight
    b = (torch.randn(dim, generator=gen) * 0.5).to(device, dtype) if bias else None
    state = _state_for(meta, (dim, kernel - 1), dtype, device, gen)
    return ConvCase(meta, x, weight, b, state)


@dataclass(frozen=True)
class DeltaCase:
    meta: Metadata
    q: torch.Tensor             # [T, HK, K]  (q, k, v: strided views of one projection)
    k: torch.Tensor
    v: torch.Tensor             # [T, HV, V]
    g: torch.Tensor             # [T, HV] fp32, <= 0
    beta: torch.Tensor          # [T, HV]
    state: torch.Tensor         # [MAX_SLOTS, HV, K, V] fp32
    scale: float

    def args(self, state: Optional[torch.Tensor] = None) -> tuple:
        return ((self.q, self.k, self.v, self.g, self.beta, self.state if state is None else state)
                + self.meta.args() + (self.scale,))


def make_delta_case(scenario, *, dtype, device, num_k_heads: int = 2, ratio: int = 2, k_dim: int = 8,
                    v_dim: int = 12, seed: int = 0, seqs=None) -> DeltaCase:
    gen = torch.Generator().manual_seed(seed)
    meta = make_metadata(seqs or SCENARIOS[scenario], device)
    T, HV = meta.num_tokens, num_k_heads * ratio
    key_dim = num_k_heads * k_dim
    mixed = torch.randn(T, 2 * key_dim + HV * v_dim, generator=gen).to(device, dtype)
    q = mixed[:, :key_dim].view(T, num_k_heads, k_dim)
    k = mixed[:, key_dim:2 * key_dim].view(T, num_k_heads, k_dim)
    v = mixed[:, 2 * key_dim:].view(T, HV, v_dim)
    # As the model computes them: g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b).
    g = -torch.rand(T, HV, generator=gen).mul(2.0).to(device)
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen)).to(device, dtype)
    _poison_rows(meta, q, k, v, g, beta)
    state = _state_for(meta, (HV, k_dim, v_dim), torch.float32, device, gen)
    return DeltaCase(meta, q, k, v, g, beta, state, k_dim ** -0.5)


def _check_state(meta: Metadata, got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, dtype) -> None:
    """Written slots close to the expected ones; untouched slots (padding, no rows) bit for bit unchanged."""
    for slot in meta.untouched_slots():
        torch.testing.assert_close(got[slot], before[slot], atol=0, rtol=0, equal_nan=True,
                                   msg=lambda m: f"slot {slot} is not used this call but was written\n{m}")
    written = [s for s in range(MAX_SLOTS) if s not in meta.untouched_slots()]
    assert not got[written].isnan().any(), "a written state holds NaN"
    assert_linear_close(got[written], want[written], dtype, "state")


def _check_output(meta: Metadata, out: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    pad = meta.rows("padding").to(out.device)
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows are not zero"
    assert not out.isnan().any()
    assert_linear_close(out, expected, dtype)


# --------------------------------------------------------------------------------------------
# The reference against independent oracles
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [64, 16, 5])
def test_chunked_form_matches_recurrence(chunk_size):
    gen = torch.Generator().manual_seed(1)
    H, L, K, V = 3, 70, 8, 12
    q = l2norm(torch.randn(H, L, K, generator=gen)) * K ** -0.5
    k = l2norm(torch.randn(H, L, K, generator=gen))
    v = torch.randn(H, L, V, generator=gen)
    g = -torch.rand(H, L, generator=gen) * 2
    beta = torch.rand(H, L, generator=gen)
    s0 = torch.randn(H, K, V, generator=gen)
    out, s = delta_rule_chunked(q, k, v, g, beta, s0, chunk_size)
    t = (lambda x: x.transpose(0, 1)[None])
    ref_out, ref_s = delta_rule_recurrent(t(q), t(k), t(v), g.t()[None], beta.t()[None], s0[None])
    assert_linear_close(out, ref_out[0].transpose(0, 1), torch.float32)
    assert_linear_close(s, ref_s[0], torch.float32)


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_reference_matches_token_by_token_oracle(scenario, device):
    case = make_delta_case(scenario, dtype=torch.float32, device=device, ratio=3, seed=2)
    states = [case.state.clone(), case.state.clone()]
    out = gated_delta_rule_reference(*case.args(states[0]))
    expected = gated_delta_rule_recurrent(*case.args(states[1]))
    _check_output(case.meta, out, expected, torch.float32)
    _check_state(case.meta, states[0], states[1], case.state, torch.float32)


@pytest.mark.parametrize("ratio", HEAD_RATIOS)
def test_reference_matches_transformers_fallbacks(ratio, device):
    """One sequence continuing a slot (a prefill chunk), then one decode token, against transformers."""
    qwen35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                                 reason="transformers is the parity reference")
    L, slot = 37, 1
    case = make_delta_case(None, dtype=torch.float32, device=device, ratio=ratio,
                           seqs=(Seq(slot, 5, L), Seq(0, 0, 1)), seed=3)
    state = case.state.clone()
    out = gated_delta_rule_reference(*case.args(state))
    kw = dict(initial_state=case.state[slot:slot + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_args = [t[:L][None] for t in (case.q, case.k, case.v, case.g, case.beta)]
    # (named here: transformers 5.25 wraps these functions in modules that have no __name__)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        hf_out, hf_state = getattr(qwen35, name)(*hf_args, **kw)
        assert_linear_close(out[:L], hf_out[0], torch.float32, name)
        assert_linear_close(state[slot], hf_state[0], torch.float32, name)
    # A decode step from that state.
    step = make_delta_case(None, dtype=torch.float32, device=device, ratio=ratio, seqs=(Seq(slot, 5 + L, 1),),
                           seed=4)
    step_out = gated_delta_rule_reference(*step.args(state.clone()))
    hf_out, _ = qwen35.torch_recurrent_gated_delta_rule(*[t[None] for t in (step.q, step.k, step.v, step.g, step.beta)],
                                                        initial_state=state[slot:slot + 1], output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    assert_linear_close(step_out, hf_out[0], torch.float32, "decode")


@pytest.mark.parametrize("kernel", CONV_KERNELS)
def test_conv_reference_matches_transformers_fallbacks(kernel, device):
    qwen35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                                 reason="transformers is the parity reference")
    L = 9
    case = make_conv_case(None, dtype=torch.float32, device=device, kernel=kernel, seqs=(Seq(2, 0, L),), seed=5)
    state = case.conv_state.clone()
    out = causal_conv1d_reference(*case.args(state))
    hf = qwen35.causal_conv1d_fn(case.x.t()[None], case.weight, case.bias, activation="silu")[0].t()
    assert_linear_close(out, hf, torch.float32, "prefill")
    step = make_conv_case(None, dtype=torch.float32, device=device, kernel=kernel, seqs=(Seq(2, L, 1),), seed=6)
    hf_state = state[2:3].clone()
    step_out = causal_conv1d_reference(step.x, case.weight, case.bias, state, *step.meta.args())
    hf_step = qwen35.causal_conv1d_update(step.x.t()[None].contiguous(), hf_state, case.weight, case.bias,
                                          activation="silu")[0].t()
    assert_linear_close(step_out, hf_step, torch.float32, "decode")
    torch.testing.assert_close(state[2], hf_state[0], atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# Every backend against the reference
# --------------------------------------------------------------------------------------------

def _compare_conv(backend, case: ConvCase, dtype) -> None:
    ref_state = case.conv_state.clone()
    expected = causal_conv1d_reference(*case.args(ref_state))
    state = case.conv_state.clone()
    poison_allocator(case.x)
    out = run_op(backend, torch.ops.qwen.causal_conv1d, *case.args(state))
    assert out.shape == case.x.shape and out.dtype == dtype
    _check_output(case.meta, out, expected, dtype)
    for slot in case.meta.untouched_slots():
        assert torch.equal(state[slot].nan_to_num(7.0), case.conv_state[slot].nan_to_num(7.0)), f"slot {slot} written"
    # The state holds copies of inputs: exact.
    torch.testing.assert_close(state, ref_state, atol=0, rtol=0, equal_nan=True)


def _compare_delta(backend, case: DeltaCase, dtype) -> None:
    ref_state = case.state.clone()
    expected = gated_delta_rule_reference(*case.args(ref_state))
    state = case.state.clone()
    poison_allocator(case.v)
    out = run_op(backend, torch.ops.qwen.gated_delta_rule, *case.args(state))
    assert out.shape == case.v.shape and out.dtype == dtype
    _check_output(case.meta, out, expected, dtype)
    _check_state(case.meta, state, ref_state, case.state, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_causal_conv1d_scenarios(backend, scenario, dtype, device):
    _compare_conv(backend, make_conv_case(scenario, dtype=dtype, device=device, seed=10), dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", CONV_KERNELS)
def test_causal_conv1d_kernels_and_bias(backend, kernel, bias, device):
    case = make_conv_case("mixed", dtype=torch.float32, device=device, kernel=kernel, bias=bias, dim=70, seed=11)
    _compare_conv(backend, case, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_gated_delta_rule_scenarios(backend, scenario, dtype, device):
    _compare_delta(backend, make_delta_case(scenario, dtype=dtype, device=device, seed=12), dtype)


@pytest.mark.parametrize("ratio", HEAD_RATIOS)
def test_gated_delta_rule_head_ratios(backend, ratio, device):
    case = make_delta_case("mixed", dtype=torch.float32, device=device, num_k_heads=2, ratio=ratio, k_dim=16,
                           v_dim=24, seed=13)
    _compare_delta(backend, case, torch.float32)


def test_empty_batch(backend, device):
    conv = make_conv_case("decode", dtype=torch.float32, device=device)
    meta = (conv.meta.seq_slots[:0], conv.meta.query_start_loc[:1], conv.meta.seq_lens[:0])
    out = run_op(backend, torch.ops.qwen.causal_conv1d, conv.x[:0], conv.weight, conv.bias, conv.conv_state, *meta)
    assert out.shape == (0, conv.x.shape[1])
    delta = make_delta_case("decode", dtype=torch.float32, device=device)
    out = run_op(backend, torch.ops.qwen.gated_delta_rule, delta.q[:0], delta.k[:0], delta.v[:0], delta.g[:0],
                 delta.beta[:0], delta.state, *meta, delta.scale)
    assert out.shape == (0,) + tuple(delta.v.shape[1:])


# --------------------------------------------------------------------------------------------
# Continuation: chunks of one sequence equal one call
# --------------------------------------------------------------------------------------------

# Chunk lengths of a 24-token sequence: prefill, decode tokens, a chunk shorter than the conv window.
CHUNKS = (6, 1, 2, 1, 9, 5)


def _in_chunks(step, total: int, other: Seq):
    """Run ``step(seqs, rows)`` once per chunk of CHUNKS; the sequence lives in slot 1 beside ``other``."""
    outputs, done = [], 0
    for n in CHUNKS:
        seqs = (other, Seq(1, done, n))
        rows = torch.arange(done, done + n)
        outputs.append(step(seqs, rows))
        done += n
    assert done == total
    return torch.cat(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_chunks_equal_one_call(backend, dtype, device):
    total = sum(CHUNKS)
    other = Seq(3, 4, 1)   # a decode row of another slot in every call
    conv = make_conv_case(None, dtype=dtype, device=device, seqs=(Seq(1, 0, total),), seed=20)
    delta = make_delta_case(None, dtype=dtype, device=device, seqs=(Seq(1, 0, total),), seed=21)
    conv_state, delta_state = conv.conv_state.clone(), delta.state.clone()
    whole_conv = run_op(backend, torch.ops.qwen.causal_conv1d, *conv.args(conv_state))
    whole_delta = run_op(backend, torch.ops.qwen.gated_delta_rule, *delta.args(delta_state))

    conv_chunked, delta_chunked = conv.conv_state.clone(), delta.state.clone()
    extra = torch.randn(1, conv.x.shape[1], dtype=dtype, device=device)

    def conv_step(seqs, rows):
        meta = make_metadata(seqs, device)
        x = torch.cat([extra, conv.x[rows.to(device)]])
        return run_op(backend, torch.ops.qwen.causal_conv1d, x, conv.weight, conv.bias, conv_chunked,
                      *meta.args())[1:]

    def delta_step(seqs, rows):
        meta = make_metadata(seqs, device)
        r = rows.to(device)
        parts = [torch.cat([t[:1], t[r]]) for t in (delta.q, delta.k, delta.v, delta.g, delta.beta)]
        return run_op(backend, torch.ops.qwen.gated_delta_rule, *parts, delta_chunked, *meta.args(),
                      delta.scale)[1:]

    assert_linear_close(_in_chunks(conv_step, total, other), whole_conv, dtype, "conv output")
    torch.testing.assert_close(conv_chunked[1], conv_state[1], atol=0, rtol=0)
    assert_linear_close(_in_chunks(delta_step, total, other), whole_delta, dtype, "delta output")
    # Rounding of each chunk's inputs is identical; only fp32 summation order differs.
    assert_linear_close(delta_chunked[1], delta_state[1], torch.float32, "delta state")


def test_starting_sequence_ignores_stored_state(backend, device):
    """q_len == seq_len restarts the slot: the result does not depend on what the slot held."""
    conv = make_conv_case(None, dtype=torch.float32, device=device, seqs=(Seq(0, 0, 5),), seed=22)
    delta = make_delta_case(None, dtype=torch.float32, device=device, seqs=(Seq(0, 0, 5),), seed=23)
    results = []
    for fill in (float("nan"), 3.0):
        cs, ds = conv.conv_state.clone().fill_(fill), delta.state.clone().fill_(fill)
        results.append((run_op(backend, torch.ops.qwen.causal_conv1d, *conv.args(cs)),
                        run_op(backend, torch.ops.qwen.gated_delta_rule, *delta.args(ds)), cs[0], ds[0]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# opcheck, compile, bad inputs, a backend without kernels
# --------------------------------------------------------------------------------------------

def test_opcheck(backend, device):
    conv = make_conv_case("mixed", dtype=torch.float32, device=device, seed=30)
    delta = make_delta_case("mixed", dtype=torch.float32, device=device, seed=31)
    with qwen_ops.use_backend(backend):
        torch.library.opcheck(torch.ops.qwen.causal_conv1d.default, conv.args(conv.conv_state.clone()))
        torch.library.opcheck(torch.ops.qwen.gated_delta_rule.default, delta.args(delta.state.clone()))


def test_compile_fullgraph_matches_eager(device):
    from torch._dynamo.utils import counters

    conv = make_conv_case("mixed", dtype=torch.float32, device=device, seed=32)
    delta = make_delta_case("mixed", dtype=torch.float32, device=device, seed=33)

    def step(x, conv_state, q, k, v, g, beta, state):
        y = ops.causal_conv1d(x, conv.weight, conv.bias, conv_state, *conv.meta.args())
        o = ops.gated_delta_rule(q, k, v, g, beta, state, *delta.meta.args(), delta.scale)
        return y * 2, o + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        cs, st = conv.conv_state.clone(), delta.state.clone()
        results.append(fn(conv.x, cs, delta.q, delta.k, delta.v, delta.g, delta.beta, st) + (cs, st))
    assert counters["graph_break"] == {}
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, atol=0, rtol=0, equal_nan=True)


def _replace(args: tuple, index: int, value) -> tuple:
    return args[:index] + (value,) + args[index + 1:]


def _set(t: torch.Tensor, index: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# (id, index of the argument to replace, replacement(args), message fragment)
BAD_CONV = [
    ("x_rank", 0, lambda a: a[0][0], "x has shape"),
    ("weight_dim", 1, lambda a: a[1][:5], "weight has shape"),
    ("weight_dtype", 1, lambda a: a[1].half(), "weight has dtype"),
    ("bias_shape", 2, lambda a: a[2][:3], "bias has shape"),
    ("state_width", 3, lambda a: a[3][..., :2], "conv_state has shape"),
    ("state_dtype", 3, lambda a: a[3].double(), "conv_state has dtype"),
    ("seq_slots_int64", 4, lambda a: a[4].long(), "seq_slots has dtype"),
    ("query_start_loc_length", 5, lambda a: a[5][:-1], "query_start_loc has"),
    ("seq_lens_length", 6, lambda a: a[6][:-1], "seq_lens has"),
    ("x_last_dim_strided", 0, lambda a: torch.randn(a[0].shape[0], 2 * a[0].shape[1])[:, ::2], "last dimension"),
    ("x_other_device", 0, lambda a: a[0].to("meta"), "all tensors must be on one device"),
]
BAD_DELTA = [
    ("q_rank", 0, lambda a: a[0][0], "q has shape"),
    ("k_shape", 1, lambda a: a[1][:, :1], "k has shape"),
    ("v_heads", 2, lambda a: torch.randn(a[2].shape[0], 3, a[2].shape[2]), "multiple of"),
    ("v_dtype", 2, lambda a: a[2].half(), "v has dtype"),
    ("g_shape", 3, lambda a: a[3][:, :1], "g has shape"),
    ("beta_shape", 4, lambda a: a[4][:-1], "beta has shape"),
    ("state_dtype", 5, lambda a: a[5].half(), "state has dtype"),
    ("state_shape", 5, lambda a: a[5][..., :4], "state has shape"),
    ("seq_lens_int64", 8, lambda a: a[8].long(), "seq_lens has dtype"),
    ("scale_nan", 9, lambda a: float("nan"), "scale"),
    ("q_other_device", 0, lambda a: a[0].to("meta"), "all tensors must be on one device"),
]
# Value checks (they read index tensors): reference always, other backends under QWEN_OPS_DEBUG=1.
# Arguments 4..6 of causal_conv1d are 6..8 of gated_delta_rule: ``offset`` shifts them.
BAD_VALUES = [
    ("slot_out_of_range", 0, lambda t: _set(t, 0, MAX_SLOTS + 4), "seq_slots\\[0\\] = 9"),
    ("slot_below_padding", 0, lambda t: _set(t, 1, -2), "seq_slots\\[1\\] = -2"),
    ("duplicate_slot", 0, lambda t: _set(t, 2, 0), "appear only once"),
    ("seq_len_below_query", 2, lambda t: _set(t, 1, 3), "seq_lens\\[1\\] = 3"),
    ("query_start_loc_end", 1, lambda t: _set(t, -1, 200), "query_start_loc\\[-1\\] = 200"),
    ("query_start_loc_start", 1, lambda t: _set(t, 0, 1), "query_start_loc\\[0\\] = 1"),
]


def _prepare_bad(args, index, make, bad_id, device):
    bad = _replace(args, index, make(args))
    if "device" not in bad_id:
        bad = tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in bad)
    return bad


@pytest.mark.parametrize("bad_id,index,make,message", BAD_CONV, ids=[c[0] for c in BAD_CONV])
def test_causal_conv1d_rejects_bad_input(backend, bad_id, index, make, message, device):
    case = make_conv_case("mixed", dtype=torch.float32, device=device, seed=40)
    state = case.conv_state.clone()
    with pytest.raises(ValueError, match=message):
        run_op(backend, torch.ops.qwen.causal_conv1d, *_prepare_bad(case.args(state), index, make, bad_id, device))
    assert torch.equal(state.nan_to_num(7.0), case.conv_state.nan_to_num(7.0)), "conv_state was written"


@pytest.mark.parametrize("bad_id,index,make,message", BAD_DELTA, ids=[c[0] for c in BAD_DELTA])
def test_gated_delta_rule_rejects_bad_input(backend, bad_id, index, make, message, device):
    case = make_delta_case("mixed", dtype=torch.float32, device=device, seed=41)
    state = case.state.clone()
    with pytest.raises(ValueError, match=message):
        run_op(backend, torch.ops.qwen.gated_delta_rule, *_prepare_bad(case.args(state), index, make, bad_id, device))
    assert torch.equal(state.nan_to_num(7.0), case.state.nan_to_num(7.0)), "state was written"


@pytest.mark.parametrize("op", ["causal_conv1d", "gated_delta_rule"])
@pytest.mark.parametrize("bad_id,meta_index,make,message", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_index_values_rejected(backend, op, bad_id, meta_index, make, message, device, monkeypatch):
    monkeypatch.setenv("QWEN_OPS_DEBUG", "1")   # value checks read the device: opt-in off reference
    if op == "causal_conv1d":
        case = make_conv_case("mixed", dtype=torch.float32, device=device, seed=42)
        before, offset = case.conv_state, 4
    else:
        case = make_delta_case("mixed", dtype=torch.float32, device=device, seed=43)
        before, offset = case.state, 6
    state = before.clone()
    args = case.args(state)
    bad = _replace(args, offset + meta_index, make(args[offset + meta_index]))
    with pytest.raises(ValueError, match=message):
        run_op(backend, getattr(torch.ops.qwen, op), *bad)
    assert torch.equal(state.nan_to_num(7.0), before.nan_to_num(7.0)), "state was written"


@pytest.mark.parametrize("op", ["causal_conv1d", "gated_delta_rule"])
def test_backend_without_kernels_raises_clearly(op, monkeypatch):
    """A backend module without ``<op>_<backend>`` (e.g. an older cuda build): a clear error."""
    import types

    empty = types.ModuleType("qwen_ops.ops.kernels.empty")
    monkeypatch.setattr(ops, "kernels", lambda name: empty)
    with pytest.raises(RuntimeError, match=f"backend 'cuda' has no kernel for qwen::{op}.*triton or reference"):
        ops._state_op_kernel(op, "cuda")
    monkeypatch.undo()
    from qwen_ops.ops.kernels import reference_gated_delta
    assert ops._state_op_kernel(op, "reference") is getattr(reference_gated_delta, f"{op}_reference")

