"""Tests of torch.ops.qwen.fused_moe (mixture-of-experts experts; qwen_ops/ops/kernels/*moe.py) on every backend.

* The reference is checked against two independent oracles: a per-(token, choice) loop written
  here in fp64, and transformers' own ``Qwen3MoeExperts`` module.
* Every available backend is checked against the reference on fresh random inputs: several
  token counts (1 included), top-k and expert counts, experts no token is routed to (their
  weights are NaN, so reading them shows), strided views, routing weights in fp32 and in the
  model dtype; outputs are allocated over freed NaN memory; fp16 / bf16 also within the
  flash-attention bound of a same-dtype torch run (tests/tolerances.py).
* opcheck, torch.compile(fullgraph=True) of a router plus the op, bad inputs (each error names
  the argument), out-of-range expert ids, the block alignment of the Triton path, backend choice.

On a CPU-only machine the triton backend runs under TRITON_INTERPRET=1 (tests/conftest.py), so
shapes are tiny.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import qwen_ops
from qwen_ops.ops import backend as backend_mod
from qwen_ops.ops import registry as ops
from qwen_ops.ops.kernels.reference_moe import fused_moe_reference
from tolerances import MOE_TOLERANCE, assert_within_flash_bound

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOW_PRECISION_DTYPES = [torch.float16, torch.bfloat16]
# name -> (num_tokens, top_k, num_experts)
CASES = {
    "decode-t1-k1": (1, 1, 4),
    "decode-t1-k4": (1, 4, 8),
    "small-k2": (7, 2, 4),
    "batch-k4": (16, 4, 8),
    "ragged-k3": (33, 3, 6),
}
CASE_NAMES = list(CASES)
HIDDEN, INTER = 32, 24      # INTER is not a multiple of the Triton tile: masked columns


def _ids(value) -> str:
    return str(value).removeprefix("torch.")


@dataclass(frozen=True)
class MoeCase:
    x: torch.Tensor              # [T, H]
    w13: torch.Tensor            # [E, 2I, H]
    w2: torch.Tensor             # [E, H, I]
    topk_weights: torch.Tensor   # [T, k]
    topk_ids: torch.Tensor       # int32 [T, k], duplicate-free per token
    unused: tuple[int, ...]      # experts no token is routed to (their weights are NaN)

    def args(self) -> tuple:
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids


def make_case(num_tokens: int, top_k: int, num_experts: int, *, dtype, device, hidden: int = HIDDEN,
              inter: int = INTER, seed: int = 0, strided: bool = False,
              weights_dtype: torch.dtype = torch.float32) -> MoeCase:
    gen = torch.Generator().manual_seed(seed)
    # Every third expert from 1 gets no token, as long as top_k distinct experts remain.
    unused = tuple(range(1, num_experts, 3))[:num_experts - top_k]
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int32)
    for t in range(num_tokens):
        ids[t] = allowed[torch.randperm(len(allowed), generator=gen)[:top_k]]
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    pad = 5 if strided else 0      # strided: column views of wider tensors
    x = torch.randn(num_tokens, hidden + pad, generator=gen).to(device, dtype)[:, pad:]
    w13 = (torch.randn(num_experts, 2 * inter, hidden + pad, generator=gen) * 0.2).to(device, dtype)[..., :hidden]
    w2 = (torch.randn(num_experts, hidden, inter + pad, generator=gen) * 0.2).to(device, dtype)[..., :inter]
    if unused:
        w13[list(unused)] = float("nan")
        w2[list(unused)] = float("nan")
    weights = torch.cat([weights, torch.rand(num_tokens, pad, generator=gen)], 1).to(device, weights_dtype)[:, :top_k]
    ids = ids.to(device)
    if strided:   # ids with transposed strides
        ids = ids.t().contiguous().t()
    return MoeCase(x, w13, w2, weights, ids, unused)


def loop_oracle(case: MoeCase, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * w2[e] @ (silu(gate) * up), one (token, choice) at a time, all in ``dtype``."""
    x, w13, w2, tw = (t.cpu().to(dtype) for t in (case.x, case.w13, case.w2, case.topk_weights))
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=dtype)
    for t, row in enumerate(case.topk_ids.cpu().tolist()):
        for j, e in enumerate(row):
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += tw[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def poison_allocator(like: torch.Tensor) -> None:
    """Free a NaN-filled block of ``like``'s size, so an op's torch.empty output likely reuses it."""
    torch.full((like.numel() + 64,), float("nan"), dtype=like.dtype, device=like.device)


def run_op(backend: str, *args):
    with qwen_ops.use_backend(backend):
        return torch.ops.qwen.fused_moe(*args)


def assert_moe_close(out, expected, dtype, msg: str = "") -> None:
    tol = MOE_TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=tol.atol, rtol=tol.rtol,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


def check_backend(backend: str, case: MoeCase, dtype) -> torch.Tensor:
    poison_allocator(torch.empty(case.x.shape[0] * case.topk_ids.shape[1], case.x.shape[1]))
    out = run_op(backend, *case.args())
    assert out.shape == case.x.shape and out.dtype == dtype and out.device == case.x.device
    assert not out.isnan().any(), "NaN in the output: an unrouted expert or unwritten memory was read"
    assert_moe_close(out, fused_moe_reference(*case.args()), dtype)
    if dtype != torch.float32:
        assert_within_flash_bound(out.cpu(), loop_oracle(case), loop_oracle(case, dtype))
    return out


# --------------------------------------------------------------------------------------------
# The reference against independent oracles
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_reference_matches_loop_oracle(name, dtype, device):
    case = make_case(*CASES[name], dtype=dtype, device=device, seed=1)
    out = fused_moe_reference(*case.args())
    assert out.dtype == dtype and not out.isnan().any()
    assert_moe_close(out, loop_oracle(case), dtype)
    if dtype != torch.float32:
        assert_within_flash_bound(out.cpu(), loop_oracle(case), loop_oracle(case, dtype))


def test_loop_oracle_is_not_vacuous(device):
    case = make_case(7, 2, 4, dtype=torch.float32, device=device, seed=2)
    out = loop_oracle(case)
    assert out.abs().max() > 0.5
    swapped = MoeCase(case.x, case.w13, case.w2, case.topk_weights, case.topk_ids.flip(1), case.unused)
    assert (loop_oracle(swapped) - out).abs().max() > 0.1   # the weights follow their choices


def test_reference_matches_transformers_experts(device):
    transformers = pytest.importorskip("transformers", reason="transformers is a parity reference")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    case = make_case(16, 4, 8, dtype=torch.float32, device="cpu", seed=3)
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=8,
                                      num_experts_per_tok=4)
    experts = Qwen3MoeExperts(cfg).eval()
    with torch.no_grad():
        experts.gate_up_proj.copy_(case.w13.nan_to_num(0.0))
        experts.down_proj.copy_(case.w2.nan_to_num(0.0))
        ref = experts(case.x, case.topk_ids.long(), case.topk_weights)
    torch.testing.assert_close(fused_moe_reference(*case.args()), ref, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------------------------
# Every backend against the reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_fused_moe_cases(backend, name, dtype, device):
    check_backend(backend, make_case(*CASES[name], dtype=dtype, device=device, seed=10), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_fused_moe_strided_views_and_model_dtype_weights(backend, dtype, device):
    case = make_case(9, 3, 6, dtype=dtype, device=device, seed=11, strided=True, weights_dtype=dtype)
    assert not case.x.is_contiguous() and not case.w13.is_contiguous() and not case.topk_ids.is_contiguous()
    check_backend(backend, case, dtype)


@pytest.mark.parametrize("hidden,inter", [(48, 40), (16, 64), (64, 16)])
def test_fused_moe_sizes(backend, hidden, inter, device):
    check_backend(backend, make_case(12, 2, 5, dtype=torch.float32, device=device, seed=12, hidden=hidden,
                                     inter=inter), torch.float32)


def test_fused_moe_many_tokens_per_expert(backend, device):
    """More rows per expert than one Triton row block, and an expert every token picks."""
    case = make_case(40, 2, 3, dtype=torch.float32, device=device, seed=13)
    check_backend(backend, case, torch.float32)


def test_fused_moe_empty_batch(backend, device):
    case = make_case(0, 2, 4, dtype=torch.float32, device=device)
    out = run_op(backend, *case.args())
    assert out.shape == (0, HIDDEN) and out.dtype == torch.float32


def test_fused_moe_is_deterministic(backend, device):
    case = make_case(16, 4, 8, dtype=torch.bfloat16, device=device, seed=14)
    assert torch.equal(run_op(backend, *case.args()), run_op(backend, *case.args()))


# --------------------------------------------------------------------------------------------
# opcheck, compile, backend choice
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_opcheck(backend, dtype, device):
    case = make_case(7, 2, 4, dtype=dtype, device=device, seed=20, strided=True)
    with qwen_ops.use_backend(backend):
        torch.library.opcheck(torch.ops.qwen.fused_moe.default, case.args())


def test_compile_fullgraph_matches_eager(device):
    """A router in plain torch (softmax, top-k, renormalise) and the op, traced with no graph break."""
    from torch._dynamo.utils import counters

    case = make_case(10, 2, 4, dtype=torch.float32, device=device, seed=21)
    w13, w2 = case.w13.nan_to_num(0.0), case.w2.nan_to_num(0.0)
    router = torch.randn(4, HIDDEN, device=device)

    def moe(x):
        probs = F.linear(x, router).softmax(-1, dtype=torch.float32)
        weights, ids = probs.topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return ops.fused_moe(x, w13, w2, weights, ids.to(torch.int32)) + x

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    eager = moe(case.x)
    assert counters["graph_break"] == {}
    torch.testing.assert_close(compiled(case.x), eager, atol=0, rtol=0)
    torch.testing.assert_close(compiled(case.x[:3]), moe(case.x[:3]), atol=0, rtol=0)


def test_auto_backend_choice_on_cpu():
    expected = "cpu" if backend_mod.why_unavailable("cpu", torch.device("cpu")) is None else "reference"
    with qwen_ops.use_backend("auto"):
        assert backend_mod.resolve_backend(torch.device("cpu"), "fused_moe") == expected


def test_backend_without_kernel_raises_clearly(monkeypatch):
    """The cuda extension has no fused_moe: asking it for one names the op and the way out."""
    import types

    empty = types.ModuleType("qwen_ops.ops.kernels.empty")
    monkeypatch.setattr(ops, "kernels", lambda name: empty)
    with pytest.raises(RuntimeError, match="backend 'cuda' has no kernel for qwen::fused_moe.*triton or reference"):
        ops._op_kernel("fused_moe", "cuda", "mixture-of-experts models")
    monkeypatch.undo()
    from qwen_ops.ops.kernels import reference_moe
    assert ops._op_kernel("fused_moe", "reference", "") is reference_moe.fused_moe_reference


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------

# (id, index of the argument to replace, replacement(args), message fragment)
BAD_INPUTS = [
    ("x_rank", 0, lambda a: a[0][0], "hidden_states has shape"),
    ("x_hidden", 0, lambda a: a[0][:, :5], "w13 has shape .* hidden_size = 5"),
    ("x_int", 0, lambda a: a[0].to(torch.int32), "hidden_states has dtype"),
    ("x_last_dim_strided", 0, lambda a: torch.randn(a[0].shape[0], 2 * a[0].shape[1])[:, ::2], "last dimension"),
    ("w13_rank", 1, lambda a: a[1][0], "w13 has shape .* rank 3"),
    ("w13_odd_rows", 1, lambda a: a[1][:, :-1], "w13 has shape"),
    ("w13_dtype", 1, lambda a: a[1].half(), "w13 has dtype"),
    ("w2_shape", 2, lambda a: a[2][:, :, :-1], "w2 has shape"),
    ("w2_experts", 2, lambda a: a[2][:-1], "w2 has shape"),
    ("w2_dtype", 2, lambda a: a[2].half(), "w2 has dtype"),
    ("weights_tokens", 3, lambda a: a[3][:-1], "topk_weights has shape"),
    ("weights_int", 3, lambda a: a[3].to(torch.int32), "topk_weights has dtype"),
    ("ids_int64", 4, lambda a: a[4].long(), "topk_ids has dtype torch.int64, expected torch.int32"),
    ("ids_shape", 4, lambda a: a[4][:, :1], "topk_ids has shape"),
    ("ids_rank", 4, lambda a: a[4][0], "topk_ids has shape"),
    ("x_other_device", 0, lambda a: a[0].to("meta"), "all tensors must be on one device"),
]


@pytest.mark.parametrize("bad_id,index,make,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_fused_moe_rejects_bad_input(backend, bad_id, index, make, message, device):
    case = make_case(7, 2, 4, dtype=torch.float32, device=device, seed=30)
    args = case.args()
    bad = args[:index] + (make(args),) + args[index + 1:]
    if "device" not in bad_id:
        bad = tuple(a.to(device) if a.device.type == "cpu" else a for a in bad)
    with pytest.raises(ValueError, match=message):
        run_op(backend, *bad)


@pytest.mark.parametrize("value", [4, -1, 1000])
def test_out_of_range_expert_ids_rejected(backend, value, device, monkeypatch):
    """Host backends always check the ids; the others under QWEN_OPS_DEBUG=1."""
    if backend not in backend_mod.HOST_BACKENDS:
        monkeypatch.setenv("QWEN_OPS_DEBUG", "1")
    case = make_case(7, 2, 4, dtype=torch.float32, device=device, seed=31)
    ids = case.topk_ids.clone()
    ids[5, 1] = value
    with pytest.raises(ValueError, match=f"topk_ids\\[5, 1\\] = {value}, but w13 has 4 experts"):
        run_op(backend, case.x, case.w13, case.w2, case.topk_weights, ids)


# --------------------------------------------------------------------------------------------
# The Triton path's block alignment (plain torch, runs without a GPU)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 8, 128, 16), (33, 3, 6, 16), (40, 2, 3, 4)])
def test_moe_align_block_size(num_tokens, top_k, num_experts, block_m):
    pytest.importorskip("triton")
    from qwen_ops.ops.kernels.triton_moe import moe_align_block_size

    case = make_case(num_tokens, top_k, num_experts, dtype=torch.float32, device="cpu", seed=40)
    a = moe_align_block_size(case.topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = case.topk_ids.reshape(-1).long()
    padded = int(a.num_padded)
    assert padded % block_m == 0 and padded <= a.sorted_pairs.numel() == a.num_blocks * block_m
    live = a.sorted_pairs[a.sorted_pairs < num_pairs]
    assert sorted(live.tolist()) == list(range(num_pairs))            # every pair exactly once
    assert bool((a.sorted_pairs[padded:] == num_pairs).all())          # the spare rows are padding
    for b in range(padded // block_m):
        rows = a.sorted_pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert rows.numel() > 0, f"block {b} holds only padding"
        assert bool((flat[rows] == int(a.block_experts[b])).all()), f"block {b} mixes experts"


@pytest.mark.parametrize("grouped", [False, True], ids=["expert-loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_cpu_backend_both_gemm_paths(grouped, dtype, monkeypatch):
    """The cpu kernel's two ways to run the per-expert GEMMs (a loop over the non-empty experts, or
    one grouped_mm) agree with the reference; which one runs depends on the batch and the strides."""
    from qwen_ops.ops.kernels import reference_moe

    if grouped and not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    monkeypatch.setattr(reference_moe, "_grouped_mm_suits", lambda *a: grouped)
    for name in ("decode-t1-k4", "ragged-k3"):
        case = make_case(*CASES[name], dtype=dtype, device="cpu", seed=50)
        out = reference_moe.fused_moe_cpu(*case.args())
        assert not out.isnan().any()
        assert_moe_close(out, fused_moe_reference(*case.args()), dtype, name)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 2, 4), (7, 3, 8), (33, 4, 16)])
def test_native_packed_experts_match_the_oracle(num_tokens, top_k, num_experts, monkeypatch):
    """``torch.ops.qwen.moe_packed`` (the experts on packed weights, the CPU fast path) against the
    loop oracle, its output poisoned (NaN); bad ids refused with the argument named."""
    from qwen_ops.ops.kernels import cpu

    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    ops.cpu_fast_ops()
    monkeypatch.setenv("QWEN_OPS_POISON_OUTPUTS", "1")
    case = make_case(num_tokens, top_k, num_experts, dtype=torch.float32, device="cpu", seed=num_tokens)
    packed13 = torch.stack([cpu.pack_panels(w.contiguous()) for w in case.w13])
    packed2 = torch.stack([cpu.pack_panels(w.contiguous()) for w in case.w2])
    out = torch.ops.qwen.moe_packed(case.x, packed13, packed2, case.topk_weights, case.topk_ids)
    assert not out.isnan().any()
    assert_moe_close(out, loop_oracle(case).float(), torch.float32)
    bad = case.topk_ids.clone()
    bad[0, 0] = num_experts
    with pytest.raises(ValueError, match=f"expected 0 <= expert id < {num_experts}"):
        torch.ops.qwen.moe_packed(case.x, packed13, packed2, case.topk_weights, bad)
    with pytest.raises(ValueError, match="hidden_states has shape"):
        torch.ops.qwen.moe_packed(case.x.double(), packed13, packed2, case.topk_weights, case.topk_ids)
