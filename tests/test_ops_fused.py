"""The CPU fast path's ops (torch.ops.qwen.linear_packed, linear_silu_mul_packed, rms_norm, add_rms_norm,
qk_norm_rope, silu_mul, attention_block, moe_packed) against their plain-torch references
(qwen_ops/ops/kernels/reference_fused.py), on fresh random inputs, with every output poisoned
(NaN) before the kernel writes it (QWEN_OPS_POISON_OUTPUTS for the C++ kernels); opcheck on each;
the panel layout against a torch packing; errors that name the argument.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qwen_ops.ops.kernels import cpu
from qwen_ops.ops.kernels import reference_fused as R
from qwen_ops.ops.kernels.reference_moe import fused_moe_reference

from qwen_tiny import shuffled_block_table, step_metadata
from tolerances import FUSED_TOLERANCE

DTYPES = [torch.float32, torch.bfloat16]
LINEAR_SHAPES = [(64, 256), (13, 40), (70, 7)]          # (out, in): off the 32-feature panels, odd K
ROWS = [1, 5, 13]
NORM_SHAPES = [(1, 64), (7, 40), (3, 4, 16)]
# (slot, start, tokens) per sequence: a prefill, a decode, a chunk, and a padding sequence.
ATTENTION_STEP = [(0, 0, 9), (2, 14, 1), (1, 5, 3), (-1, 0, 1)]


pytestmark = pytest.mark.usefixtures("cpu_fast_ops")


def _close(got, want, dtype):
    tol = FUSED_TOLERANCE[dtype]
    assert not got.isnan().any(), "an output element was never written"
    torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _linear_case(rows, shape, dtype, bias, pad=3):
    n, k = shape
    weight = _randn(n, k, dtype=dtype, seed=rows)
    x = _randn(rows, k + pad, dtype=dtype, seed=rows + 1)[:, :k]          # strided rows (pad 0: contiguous)
    return x, cpu.pack_panels(weight), _randn(n, seed=3) if bias else None, n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_pack_panels_matches_the_torch_layout(shape, dtype):
    weight = _randn(*shape, dtype=dtype)
    packed = cpu.pack_panels(weight)
    assert torch.equal(packed, R.pack_panels_reference(weight))
    assert torch.equal(R.unpack_panels(packed, *shape), weight)


# rows strided by an odd count of elements, or contiguous: bf16 rows with an even K are VDPBF16PS's pairs as
# they are (AVX512-BF16 CPUs without AMX; K = 512: a 1 KB stride, copied to another first)
PADS = [3, 0]


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_packed(rows, shape, dtype, bias, pad):
    args = _linear_case(rows, shape, dtype, bias, pad)
    got = torch.ops.qwen.linear_packed(*args)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    _close(got, R.linear_packed_reference(*args), dtype)


# (intermediate, in): gate | up panels in pairs (I a multiple of 32) with odd K, K2 over the AMX path's
# 128-pair parts, and an I off the panels (the product's rows, then silu_mul)
SILU_SHAPES = [(32, 37), (64, 512), (40, 24)]


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
@pytest.mark.parametrize("rows", [1, 13, 40, 260])     # 260: the dot-product path's fused SiLU (DP_SILU_MIN_ROWS)
def test_linear_silu_mul_packed(rows, shape, dtype, bias, pad):
    inter, k = shape
    x, _, b, n = _linear_case(rows, (2 * inter, k), dtype, bias, pad)
    packed = cpu.pack_panels((_randn(n, k, seed=rows) * k ** -0.5).to(dtype))     # gate, up of unit scale
    got = torch.ops.qwen.linear_silu_mul_packed(x, packed, b, n)
    assert got.dtype == dtype and got.shape == (rows, inter)
    _close(got, R.linear_silu_mul_packed_reference(x, packed, b, n), dtype)
    # the fused epilogue rounds the sums as linear_packed does, then silu_mul's steps: the same bits
    assert torch.equal(got, torch.ops.qwen.silu_mul(torch.ops.qwen.linear_packed(x, packed, b, n)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_of_no_rows(dtype):
    """A step whose every chunk skips the LM head gives it zero rows: an empty result, as the reference's."""
    x, packed, b, n = _linear_case(3, (64, 40), dtype, True)
    for op, ref, width in ((torch.ops.qwen.linear_packed, R.linear_packed_reference, n),
                           (torch.ops.qwen.linear_silu_mul_packed, R.linear_silu_mul_packed_reference, n // 2)):
        got = op(x[:0], packed, b, n)
        assert got.shape == (0, width) and got.dtype == dtype
        assert ref(x[:0], packed, b, n).shape == got.shape


def test_linear_silu_mul_packed_streams_a_prefill_sized_output():
    """Rows x intermediate over 1 MB: the AMX path's streaming stores, row blocks past one chunk."""
    x, packed, b, n = _linear_case(600, (2 * 1024, 64), torch.bfloat16, True)
    got = torch.ops.qwen.linear_silu_mul_packed(x, packed, b, n)
    _close(got, R.linear_silu_mul_packed_reference(x, packed, b, n), torch.bfloat16)
    assert torch.equal(got, torch.ops.qwen.silu_mul(torch.ops.qwen.linear_packed(x, packed, b, n)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_and_add_rms_norm(shape, dtype):
    x, residual = _randn(*shape, dtype=dtype, seed=1), _randn(*shape, dtype=dtype, seed=2)
    weight = _randn(shape[-1], dtype=dtype, seed=3)
    _close(torch.ops.qwen.rms_norm(x, weight, 1e-6), R.rms_norm_reference(x, weight, 1e-6), dtype)
    normed, total = torch.ops.qwen.add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_total = R.add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total), "the residual sum is one rounded add, as torch's"
    _close(normed, want_normed, dtype)


def _qkv(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], 1)   # strided views
    return qkv, q, k, v


@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope(dtype, norms):
    _, q, k, _ = _qkv(6, 4, 2, 16, dtype)
    weights = (_randn(16, dtype=dtype, seed=4), _randn(16, dtype=dtype, seed=5)) if norms else (None, None)
    cos_sin = _randn(40, 16, seed=6)
    positions = torch.tensor([0, 3, 39, 7, 7, 12], dtype=torch.int32)
    got = torch.ops.qwen.qk_norm_rope(q, k, *weights, 1e-6, cos_sin, positions)
    for g, w in zip(got, R.qk_norm_rope_reference(q, k, *weights, 1e-6, cos_sin, positions), strict=True):
        assert g.is_contiguous()
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = _randn(5, 2 * 37 + 6, dtype=dtype)[:, :2 * 37]      # strided rows, odd intermediate size
    _close(torch.ops.qwen.silu_mul(gate_up), R.silu_mul_reference(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,groups,n", [(1, 576, 18, 960), (5, 64, 2, 37), (3, 1536, 48, 576)])
def test_group_mins_add(dtype, rows, k, groups, n):
    """y += (x summed per group) @ mins_t in place, against a float64 loop; mins_t a column slice of a wider
    transposed copy (strided rows), as a fused layer's parts hold it; x with strided rows."""
    y = _randn(rows, n, dtype=dtype, seed=1)
    x = _randn(rows, k + 8, dtype=dtype, seed=2)[:, :k]
    wide = _randn(groups, n + 16, seed=3)
    mins_t = wide[:, 5:5 + n]
    want = y.double() + x.double().reshape(rows, groups, -1).sum(-1) @ mins_t.double()
    got = y.clone()
    torch.ops.qwen.group_mins_add(got, x, mins_t)
    scale = y.double().abs() + x.double().abs().reshape(rows, groups, -1).sum(-1) @ mins_t.double().abs()
    tol = 1e-6 if dtype == torch.float32 else 8e-3          # fp32 sums; bf16: y rounded once
    assert ((got.double() - want).abs() <= tol * scale + 1e-12).all()
    ref = y.clone()
    R.group_mins_add_reference(ref, x, mins_t)
    _close(got, ref, dtype)
    with pytest.raises(ValueError, match=r"mins_t.*\[?\(?3, 37.*dividing"):
        torch.ops.qwen.group_mins_add(_randn(2, 37), _randn(2, 64), _randn(3, 37))


def _attention_case(dtype, norms=True, num_heads=4, kv_heads=2, head_dim=16, block_size=4):
    table = shuffled_block_table(3, 5)
    positions, attn, _ = step_metadata(ATTENTION_STEP, table)
    qkv, _, _, _ = _qkv(positions.shape[0], num_heads, kv_heads, head_dim, dtype, seed=8)
    shape = (table.numel() + 1, block_size, kv_heads, head_dim)
    caches = _randn(*shape, dtype=dtype, seed=9), _randn(*shape, dtype=dtype, seed=10)   # random, not zeros
    weights = (_randn(head_dim, dtype=dtype, seed=11), _randn(head_dim, dtype=dtype, seed=12)) if norms else (None, None)
    return (qkv, *weights, 1e-6, _randn(64, head_dim, seed=13), positions.to(torch.int32), *caches, attn.slot_ids,
            attn.block_table, attn.seq_slots, attn.query_start_loc, attn.seq_lens, head_dim ** -0.5,
            attn.max_query_len, num_heads)


def _clone_caches(args):
    args = list(args)
    args[6], args[7] = args[6].clone(), args[7].clone()
    return args


@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_block(dtype, norms):
    """q/k norm + RoPE + kv write + attention in one op: the output and both caches against the
    reference (kv_write_reference and slot_attention_reference after the reference norm + RoPE)."""
    args = _attention_case(dtype, norms)
    got_args, want_args = _clone_caches(args), _clone_caches(args)
    got = torch.ops.qwen.attention_block(*got_args)
    want = R.attention_block_reference(*want_args)
    _close(got, want, dtype)
    assert not got[-1].any(), "the padding sequence's row is zero"
    for i in (6, 7):
        _close(got_args[i], want_args[i], dtype)


def test_attention_block_long_prefill():
    """A long prompt: attention_block's attention takes slot_attention's flash path."""
    table = shuffled_block_table(1, 30)
    positions, attn, _ = step_metadata([(0, 0, 101)], table)
    qkv, _, _, _ = _qkv(positions.shape[0], 4, 2, 16, torch.float32)
    shape = (table.numel() + 1, 4, 2, 16)
    args = (qkv, None, None, 1e-6, _randn(128, 16), positions.to(torch.int32), _randn(*shape), _randn(*shape),
            attn.slot_ids, table, attn.seq_slots, attn.query_start_loc, attn.seq_lens, 0.25, attn.max_query_len, 4)
    got_args, want_args = _clone_caches(args), _clone_caches(args)
    _close(torch.ops.qwen.attention_block(*got_args), R.attention_block_reference(*want_args), torch.float32)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 2, 4), (7, 3, 8), (33, 4, 16)])
def test_moe_packed(num_tokens, top_k, num_experts):
    hidden, inter = 40, 24
    x = _randn(num_tokens, hidden, seed=1)
    w13, w2 = _randn(num_experts, 2 * inter, hidden, seed=2), _randn(num_experts, hidden, inter, seed=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    p13 = torch.stack([cpu.pack_panels(w.contiguous()) for w in w13])
    p2 = torch.stack([cpu.pack_panels(w.contiguous()) for w in w2])
    got = torch.ops.qwen.moe_packed(x, p13, p2, weights, ids)
    _close(got, fused_moe_reference(x, w13, w2, weights, ids), torch.float32)
    _close(R.moe_packed_reference(x, p13, p2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids),
           torch.float32)
    bad = ids.clone()
    bad[0, 0] = num_experts
    with pytest.raises(ValueError, match=f"topk_ids\\[0, 0\\] = {num_experts}, but w13 has {num_experts} experts"):
        torch.ops.qwen.moe_packed(x, p13, p2, weights, bad)


def _samples():
    x, packed, bias, n = _linear_case(3, (40, 24), torch.float32, True)
    _, q, k, _ = _qkv(3, 4, 2, 16, torch.float32)
    norm_x = _randn(3, 24)
    e = 4
    p13 = torch.stack([cpu.pack_panels(_randn(32, 24, seed=i)) for i in range(e)])
    p2 = torch.stack([cpu.pack_panels(_randn(24, 16, seed=i)) for i in range(e)])
    return {
        "linear_packed": (x.contiguous(), packed, bias, n),
        "linear_silu_mul_packed": (x.contiguous(), packed, bias, n),
        "rms_norm": (norm_x, _randn(24, seed=1), 1e-6),
        "add_rms_norm": (norm_x, _randn(3, 24, seed=2), _randn(24, seed=1), 1e-6),
        "qk_norm_rope": (q, k, _randn(16), None, 1e-6, _randn(8, 16), torch.tensor([0, 5, 7], dtype=torch.int32)),
        "silu_mul": (_randn(3, 20),),
        "group_mins_add": (_randn(3, 40, seed=3), _randn(3, 64, seed=4), _randn(2, 40, seed=5)),
        "attention_block": tuple(_attention_case(torch.float32)),
        "moe_packed": (_randn(3, 24), p13, p2, torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [3, 0]],
                                                                             dtype=torch.int32)),
    }


@pytest.mark.parametrize("name", ["linear_packed", "linear_silu_mul_packed", "rms_norm", "add_rms_norm",
                                  "qk_norm_rope", "silu_mul", "attention_block", "moe_packed", "group_mins_add"])
def test_opcheck(name, monkeypatch):
    monkeypatch.delenv("QWEN_OPS_POISON_OUTPUTS")      # opcheck compares runs; NaN never equals NaN
    torch.library.opcheck(getattr(torch.ops.qwen, name).default, _samples()[name])


def test_errors_name_the_argument_value_and_expectation():
    x, packed, bias, n = _linear_case(3, (40, 24), torch.float32, True)
    with pytest.raises(ValueError, match=r"packed has shape \[2, 24, 32\] and dtype Float, expected a "
                                         r"contiguous \[1, 24, 32\] Float tensor \(pack_panels of a \[20, 24\]"):
        torch.ops.qwen.linear_packed(x, packed, bias, 20)
    with pytest.raises(ValueError, match="bias has shape"):
        torch.ops.qwen.linear_packed(x, packed, bias[:10], n)
    with pytest.raises(ValueError, match="out_features is 39, expected a positive even count"):
        torch.ops.qwen.linear_silu_mul_packed(x, packed, bias, 39)
    args = list(_attention_case(torch.float32))
    bad_slots = args[8].clone()
    bad_slots[0] = 3
    keys = args[6].clone()
    with pytest.raises(ValueError, match="slot_ids\\[0\\] = 3, but only 3 slots exist"):
        torch.ops.qwen.attention_block(*args[:8], bad_slots, *args[9:])
    bad_positions = args[5].clone()
    bad_positions[2] = 64
    with pytest.raises(ValueError, match="positions\\[2\\] = 64, expected 0 <= position < 64"):
        torch.ops.qwen.attention_block(*args[:5], bad_positions, *args[6:])
    assert torch.equal(args[6], keys), "nothing is written before the checks pass"
    q = _randn(3, 4, 16)
    with pytest.raises(ValueError, match="cos_sin has shape"):
        torch.ops.qwen.qk_norm_rope(q, q, None, None, 1e-6, _randn(8, 8), torch.zeros(3, dtype=torch.int32))


IN_PLACE = {"group_mins_add"}       # ops that update an argument and return nothing


def test_fake_kernels_trace_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, args in _samples().items():
        mode = FakeTensorMode()
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode:
            out = getattr(torch.ops.qwen, name)(*fake)
        assert out is not None or name in IN_PLACE, name


def test_compiled_graph_keeps_the_ops_whole():
    """Opaque ops with fakes: torch.compile(fullgraph=True) traces them without a break."""
    import torch._dynamo

    args = _linear_case(3, (40, 24), torch.float32, True)
    norm_w = _randn(40, seed=5)

    def f(x, packed, bias, n):
        y = torch.ops.qwen.linear_packed(x, packed, bias, n)
        return torch.ops.qwen.rms_norm(y, norm_w, 1e-6)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = args[0].contiguous()
    torch.testing.assert_close(compiled(x, *args[1:]), f(x, *args[1:]))
    assert dataclasses.is_dataclass(FUSED_TOLERANCE[torch.float32])


def test_the_ops_run_on_cpu_tensors_in_a_fresh_process():
    """No packing call needed first: the CPU kernel registered at import registers the real ones
    on the first call (and they replace it)."""
    import subprocess
    import sys

    code = ("import torch, qwen_ops\n"
            "from qwen_ops.ops.kernels.reference_fused import silu_mul_reference\n"
            "x = torch.randn(3, 16)\n"
            "torch.testing.assert_close(torch.ops.qwen.silu_mul(x), silu_mul_reference(x))\n"
            "torch.testing.assert_close(torch.ops.qwen.silu_mul(x), silu_mul_reference(x))\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
