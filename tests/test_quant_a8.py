"""Int8 activations (issue 28, item 3): ``linear_int8_a8`` / ``linear_int4_a8`` against an oracle
written here from the contract (numpy float32 digits, float64 products), every kernel path giving
the same bits (portable loop, up to 4 rows, the panels of more rows, one row at a time, 1 or 2
threads), the error at or below the reference's, ``opcheck``; and the layers that choose them:
``quantization="w8a8"`` online, ``"awq_a8"`` / ``"gptq_a8"`` on those checkpoints, within a stated
bound of the full-precision model, and the errors for combinations that do not exist.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen_ops.models import quant as Q
from qwen_ops.models.layers import forward_choices
from qwen_ops.models.loader import load_model
from qwen_ops.ops import validation as V
from qwen_ops.ops.kernels import cpu
from qwen_ops.ops.kernels import reference_quant as RQ
from qwen_tiny import fresh_library

pytest.importorskip("transformers", reason="the quantized checkpoints' twins load in transformers")

from test_quant import _all_logits, write_quantized  # noqa: E402
from qwen_tiny import save_tiny_checkpoint  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=64, eos_token_id=3, tie_word_embeddings=False)


def _case(kind: str, rows: int, n: int, k: int, groups: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # rows of very different sizes, so every row's scale matters
    x = torch.randn(rows, k, generator=g) * (torch.rand(rows, 1, generator=g) * 4 + 0.01)
    s = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    bias = torch.randn(n, generator=g)
    if kind == "int8":
        return x, (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), s), bias
    return x, (torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8), s,
               torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)), bias


def _op(kind: str):
    return torch.ops.qwen.linear_int8_a8 if kind == "int8" else torch.ops.qwen.linear_int4_a8


def _oracle(kind: str, x: torch.Tensor, w: tuple, bias: torch.Tensor) -> np.ndarray:
    """The contract, element by element: per row and block of ab elements (128 when it divides the
    group, else the group) digits d = round_half_even(x * float32(127 / amax)) in float32, then
    y = sum over blocks of (sum d * (q - z)) * s * (amax / 127) + bias in float64."""
    xn = x.numpy().astype(np.float32)
    rows, k = xn.shape
    if kind == "int8":
        q, s = w[0].numpy().astype(np.int64), w[1].numpy().astype(np.float64)
        zq = np.zeros_like(q)
    else:
        b = w[0].numpy().astype(np.int64)
        q = np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], k)
        s = w[1].numpy().astype(np.float64)
        zq = np.repeat(w[2].numpy().astype(np.int64), k // s.shape[1], axis=1)
    group = k // s.shape[1]
    ab = 128 if group % 128 == 0 else group
    y = np.zeros((rows, q.shape[0]))
    for m in range(rows):
        for b0 in range(0, k, ab):
            blk = xn[m, b0:b0 + ab]
            amax = np.float32(np.abs(blk).max())
            scale = np.float32(127.0) / amax if amax > 0 else np.float32(0)
            d = np.clip(np.rint(blk * scale), -127, 127).astype(np.int64)    # np.rint: half to even
            isum = ((q[:, b0:b0 + ab] - zq[:, b0:b0 + ab]) * d).sum(axis=1)
            y[m] += isum * s[:, b0 // group] * float(amax / np.float32(127.0))
    return y + bias.double().numpy()


# (n, k, groups): vector paths (K % 64 == 0, blocks of 128 or 64) and the portable loop (K = 96, 48)
SHAPES = [(64, 256, 2), (70, 512, 1), (36, 384, 6), (40, 96, 3), (12, 48, 3)]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 33])
def test_a8_kernels_match_the_contract(kind, rows, poisoned_empty):
    for i, (n, k, groups) in enumerate(SHAPES):
        x, w, bias = _case(kind, rows, n, k, groups, seed=rows * 10 + i)
        want = _oracle(kind, x, w, bias)
        got = _op(kind)(x, *w, bias)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # the reference says the same (a check of the reference against the contract), and it computes
        # the kernels' fp32 steps in the kernels' order: the same bits
        ref = RQ.REFERENCES[f"{kind}_a8"](x, *w, bias)
        np.testing.assert_allclose(ref.double().numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert torch.equal(got, ref)


def _a8_rows(kind, x, weight, scales, zeros, bias, n, k, group, portable):
    """The C library's qwen_linear_quant_a8 on fp32 rows (``portable``: its scalar loop)."""
    x = x.float()
    out = torch.full((x.shape[0], n), float("nan"))
    assert cpu.library().qwen_linear_quant_a8(kind, x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(),
                                              scales.data_ptr(), None if zeros is None else zeros.data_ptr(), group,
                                              None if bias is None else bias.data_ptr(), n, k, out.data_ptr(), n,
                                              torch.get_num_threads(), int(portable)) == 0
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a8_every_path_computes_the_same_bits(kind):
    """Integer sums are exact and the fp32 steps the same in every path: a row's outputs do not
    depend on the rows beside it (1, up to 4 or more rows), the thread count, or the build."""
    n, k, groups = 72, 512, 4
    x, w, bias = _case(kind, 13, n, k, groups, seed=4)
    zeros = w[2] if kind == "int4" else None
    run = lambda rows, portable=False: _a8_rows(0 if kind == "int8" else 1, rows, w[0], w[1], zeros, bias, n, k,
                                                k // groups, portable)
    batch = run(x)
    assert torch.equal(batch, run(x, portable=True))
    assert torch.equal(batch, torch.cat([run(x[i:i + 1]) for i in range(13)]))
    assert torch.equal(batch[:3], run(x[:3])) and torch.equal(batch[5:10], run(x[5:10]))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(batch, run(x)) and torch.equal(batch[:2], run(x[:2]))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a8_error_is_at_or_below_the_references(kind):
    """Against the float64 oracle, the kernel's error (exact integer sums, one rounding each block)
    is no larger than the reference's, 1.5x its mean (the reference does the same arithmetic)."""
    for rows in (1, 8, 40):
        x, w, bias = _case(kind, rows, 256, 1024, 8, seed=rows)
        truth = _oracle(kind, x, w, bias)
        got = float(np.abs(_op(kind)(x, *w, bias).double().numpy() - truth).mean())
        ref = float(np.abs(RQ.REFERENCES[f"{kind}_a8"](x, *w, bias).double().numpy() - truth).mean())
        assert got <= 1.5 * ref + 1e-9, (rows, got, ref)


def test_a8_bf16_input_rounds_once():
    x, w, bias = _case("int4", 5, 64, 256, 2, seed=8)
    xb = x.bfloat16()
    got = torch.ops.qwen.linear_int4_a8(xb, *w, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.ops.qwen.linear_int4_a8(xb.float(), *w, bias).bfloat16())


def test_a8_zero_and_non_finite_blocks():
    """A block of zeros quantizes to zeros (no division by zero); a block with an infinity makes its
    row NaN, as the reference; the other rows are untouched."""
    x, w, bias = _case("int8", 3, 32, 256, 1, seed=2)
    x[0, :128] = 0.0
    x[1, 130] = float("inf")
    got = torch.ops.qwen.linear_int8_a8(x, *w, bias)
    ref = RQ.linear_int8_a8_reference(x, *w, bias)
    assert torch.isnan(got[1]).all() and torch.isnan(ref[1]).all()
    torch.testing.assert_close(got[[0, 2]], ref[[0, 2]], rtol=1e-5, atol=1e-4)


def test_a8_opcheck_and_errors():
    x, w, bias = _case("int8", 3, 64, 256, 2, seed=5)
    torch.library.opcheck(torch.ops.qwen.linear_int8_a8.default, (x, *w, bias))
    x4, w4, _ = _case("int4", 2, 64, 256, 2, seed=6)
    torch.library.opcheck(torch.ops.qwen.linear_int4_a8.default, (x4, *w4, None))
    with pytest.raises(ValueError, match=r"qweight has shape \(64, 256\) and dtype torch.uint8, expected int8"):
        torch.ops.qwen.linear_int8_a8(x, w[0].view(torch.uint8), w[1], None)
    with pytest.raises(ValueError, match=r"x has shape \(3, 128\), expected \[rows, 256\]"):
        torch.ops.qwen.linear_int8_a8(x[:, :128], *w, None)
    with pytest.raises(ValueError, match=r"zeros has shape \(64, 1\) and dtype torch.uint8, expected uint8 \[64, 2\]"):
        torch.ops.qwen.linear_int4_a8(x4, w4[0], w4[1], w4[2][:, :1].contiguous(), None)


# ------------------------------------------------------------------------------------------------
# The layers
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("a8") / "ckpt", "qwen3", seed=5, **TINY)


IDS = [5, 17, 2, 60, 33, 9, 41, 8, 77, 1]


def test_online_w8a8_chooses_the_a8_ops_within_its_bound(ckpt):
    full, int8, w8a8 = load_model(ckpt), load_model(ckpt, quantization="int8"), load_model(ckpt, quantization="w8a8")
    for m in (full, int8, w8a8):
        m.process_weights_after_loading()
    choices = forward_choices(w8a8)
    assert choices["model.layers.0.self_attn.q_proj"] == "int8_a8" and choices["model.layers.1.mlp.down_proj"] == "int8_a8"
    assert Q.describe(w8a8)["lm_head"] == "int8_a8"              # the head too, as online int8
    for prefix in ("model.layers.0.mlp.up_proj", "lm_head"):      # the same weights as "int8"
        assert torch.equal(w8a8.get_submodule(prefix).state_dict()["qweight"], int8.get_submodule(prefix).qweight)
    ref, weights_only, got = (_all_logits(m, IDS) for m in (full, int8, w8a8))
    # Activations add their own rounding: half a step of a block's max, 1/254 of it (an RMS of
    # ~1/440 of the max), the same size as the weights'. Measured on three seeds of this random
    # model: 2.3-2.8% (int8 weights) and 3.5-4.2% (w8a8) of the logits' norm; the bound is 2x.
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.08, rel
    assert float((weights_only - ref).norm() / ref.norm()) < rel      # the activations' share is real


@pytest.mark.parametrize("method,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_checkpoint_with_int8_activations(method, bits, ckpt, tmp_path):
    path, twin, _ = write_quantized(ckpt, tmp_path / "q", method, bits)
    plain, a8 = load_model(path), load_model(path, quantization=f"{method}_a8")
    for m in (plain, a8):
        m.process_weights_after_loading()
    layer = a8.get_submodule("model.layers.0.mlp.gate_proj")
    assert layer.kernel == ("int4_a8" if bits == 4 else "int8_a8")
    assert torch.equal(layer.state_dict()["qweight"], plain.get_submodule("model.layers.0.mlp.gate_proj").qweight)
    full = load_model(twin)                       # the dequantized model in full precision
    full.process_weights_after_loading()
    ref, got = _all_logits(full, IDS), _all_logits(a8, IDS)
    rel = float((got - ref).norm() / ref.norm())
    # the activations' rounding alone (the weights are the twin's): measured 1.9-2.5% on three seeds
    assert rel < 0.05, rel


def test_int8_activation_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"quantization = 'fp8_a8'; expected one of int8, int4, fp8, w8a8"):
        load_model(ckpt, quantization="fp8_a8")
    with pytest.raises(ValueError, match=r"quantization = 'gptq_a8'.*this checkpoint has no quantization_config"):
        load_model(ckpt, quantization="gptq_a8")
    path, _, _ = write_quantized(ckpt, tmp_path / "q", "gptq", 4)
    with pytest.raises(ValueError, match=r"quantization = 'awq_a8', but .* holds a 'gptq' checkpoint.*'gptq_a8'"):
        load_model(path, quantization="awq_a8")
    with pytest.raises(ValueError, match=r"quantization = 'w8a8', but .* holds a 'gptq' checkpoint"):
        load_model(path, quantization="w8a8")
    fp8, _, _ = write_quantized(ckpt, tmp_path / "f", "fp8", 8)
    with pytest.raises(ValueError, match=r"quantization = 'fp8_a8', but .* holds a 'fp8' checkpoint"):
        load_model(fp8, quantization="fp8_a8")
    with pytest.raises(ValueError, match=r"activations = 'int8' for fp8 weights"):
        Q.QuantLinear(64, 64, False, "fp8", 1, (1, 64), torch.float32, activations="int8")


def test_llm_w8a8_tokens_do_not_depend_on_the_batch(ckpt):
    """Rows are quantized alone and the integer sums are exact: a prompt's greedy tokens are the same
    alone and beside others (prefill of many rows, decode of a few)."""
    from qwen_ops import LLM, SamplingParams

    llm = LLM(str(ckpt), quantization="w8a8", max_num_seqs=4, max_model_len=48)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 2, 60, 33, 9], [33, 9, 41], [7, 7, 8, 1, 60, 2, 5, 9, 11]]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def _fma32_exact(a: float, b: float, c: float) -> float:
    """fp32 fma by exact rationals: the nearer of the two fp32 values around a * b + c (ties: even)."""
    from fractions import Fraction

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = torch.tensor(float(exact), dtype=torch.float64).float()          # within one fp32 step
    cands = {float(near), float(torch.nextafter(near, torch.tensor(float("inf")))),
             float(torch.nextafter(near, torch.tensor(float("-inf"))))}
    best = sorted(cands, key=lambda v: (abs(Fraction(v) - exact),
                                        int(torch.tensor(v, dtype=torch.float32).view(torch.int32)) & 1))
    return best[0]


def test_reference_fma_rounds_once():
    """The references' fp32 FMA (``_fma32``) against exact rational arithmetic, on a case where a
    float64 sum rounded to fp32 rounds twice (8(1+2^-23) * -8(1-2^-23) + (2^30 + 128): exactly
    2^30 + 64 + 2^-40, just above an fp32 midpoint; float64 drops the 2^-40, the tie goes to 2^30)
    and on random ones."""
    a = torch.tensor([8 * (1 + 2 ** -23)], dtype=torch.float32)
    b = torch.tensor([-8 * (1 - 2 ** -23)], dtype=torch.float32)
    c = torch.tensor([2.0 ** 30 + 128], dtype=torch.float32)
    assert float((a.double() * b.double() + c.double()).float()) == 2.0 ** 30          # rounded twice
    assert float(RQ._fma32(a, b, c)) == 2.0 ** 30 + 128 == _fma32_exact(float(a), float(b), float(c))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2000, generator=g), torch.randn(2000, generator=g)
    c = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-30, 30, (2000,), generator=g).float())
    got = RQ._fma32(a, b, c)
    assert [float(v) for v in got] == [_fma32_exact(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)]


def test_a8_digits_at_rounding_midpoints():
    """Blocks whose elements sit within an ulp of a digit's rounding midpoint (x * 127 / amax near
    n + 1/2), for amax values where one division (the kernels') and torch's number-over-tensor
    (a reciprocal, then a product) give different scales: the reference's digits must be the
    kernel's there too, so the products agree bit for bit. (The reference once divided the second
    way; on the real-size model that moved a digit in a few rows of a generate.)"""
    g = torch.Generator().manual_seed(4)
    amax = torch.rand(4096, generator=g) + 0.5
    one_division = torch.full_like(amax, 127.0) / amax
    rows = []
    for a, sc in zip(amax[one_division != 127.0 / amax][:64], one_division[one_division != 127.0 / amax][:64]):
        mids = (torch.arange(127, dtype=torch.float64) + 0.5) / float(sc)      # x with x * scale = n + 1/2
        x = torch.cat([mids.float(), torch.nextafter(mids.float(), torch.tensor(0.0))])[:127]
        rows.append(torch.cat([a.view(1), x * torch.where(torch.rand(127, generator=g) < 0.5, -1.0, 1.0)]))
    x = torch.stack(rows) if rows else torch.randn(8, 128, generator=g)
    q = torch.randint(-127, 128, (16, 128), generator=g, dtype=torch.int8)
    s = torch.rand(16, 1, generator=g) * 0.01
    assert torch.equal(torch.ops.qwen.linear_int8_a8(x, q, s, None), RQ.linear_int8_a8_reference(x, q, s, None))


def test_a8_products_report_their_path_and_warn_without_vnni(ckpt, monkeypatch, caplog):
    """This CPU has AVX512-VNNI, so the products run VPDPBUSD (their batches on AMX tiles where it has
    AMX-INT8: recorded in ``product_choices``); on one without, loading a model with int8 activations
    warns that the portable loop runs instead (forced here)."""
    import logging

    from qwen_ops.models.layers import product_choices

    has_vnni = " avx512_vnni" in f" {cpu._cpu_flags()} "
    assert cpu.int8_dot_products() == has_vnni
    model = load_model(ckpt, quantization="w8a8")
    model.process_weights_after_loading()
    flags = f" {cpu._cpu_flags()} "
    batches = "amx" if " amx_int8" in flags and " amx_tile" in flags else "avx512_vnni" if has_vnni else "portable"
    assert cpu.int8_products() == batches
    kinds = product_choices(model)
    how = "linear_a8_panels" if has_vnni else "linear_int8_a8"     # the panels where VNNI runs them
    assert kinds["model.layers.0.mlp.gate_up"] == f"int8_a8 ({how}; {batches} past 4 rows)", kinds
    from qwen_ops.ops import host          # the models' way to the CPU's facts

    monkeypatch.setattr(host, "int8_dot_products", lambda: False)
    with caplog.at_level(logging.WARNING, logger="qwen_ops.models.loader"):
        load_model(ckpt, quantization="w8a8")
    assert "no AVX512-VNNI" in caplog.text


def test_bench_quant_gates_a8_tokens_and_runs_vs_bf16(ckpt, monkeypatch, capsys):
    """bench_quant.py's w8a8 row must match its reference twin (the a8 references compute the
    kernels' arithmetic, so fp32 tokens agree exactly): a kernel made 1.5x too large fails it.
    ``--vs-bf16`` steps a variant and the bf16 model alternately and reports their ratio."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_quant", Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--checkpoint", str(ckpt), "--variants", "w8a8", "--threads", "1", "--reps", "1", "--steps", "2"]
    assert bench.main(args) == 0
    assert bench.main(args + ["--vs-bf16"]) == 0
    assert "| w8a8 | 1 |" in capsys.readouterr().out
    real, real_panels = Q._OPS["int8_a8"], Q.LINEAR_A8_PANELS
    monkeypatch.setitem(Q._OPS, "int8_a8", lambda x, *rest: real(x, *rest) * 1.5)
    monkeypatch.setattr(Q, "LINEAR_A8_PANELS", lambda x, *rest: real_panels(x, *rest) * 1.5)
    real_silu = Q.SILU_MUL_LINEAR_A8_PANELS
    monkeypatch.setattr(Q, "SILU_MUL_LINEAR_A8_PANELS", lambda x, *rest: real_silu(x, *rest) * 1.5)
    assert bench.main(args) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="needs the C kernels")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bench_quant_kernel_timer_runs_the_ops_kernel(kind):
    """``--one-row``'s C loop calls the library's kernel on each weight it is given: its output (the last
    weight's) equals ``linear_a8_panels``' on that weight, and it takes time."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_quant", Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    time_calls = bench.kernel_timer()
    g = torch.Generator().manual_seed(7)
    n, k = 128, 256
    s = torch.rand(n, k // 128, generator=g) * 0.01 + 1e-3
    weights = []
    for _ in range(3):
        if kind == "int8":
            q, z = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None
        else:
            q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
            z = torch.randint(0, 16, (n, k // 128), generator=g, dtype=torch.uint8)
        weights.append(Q.pack_a8_panels(q, s, z))
    x = torch.randn(1, k, generator=g)
    y = torch.full((1, n), float("nan"))
    sp, zp = weights[0][1], weights[0][2]
    seconds = time_calls(kind, x, [w for w, _, _ in weights], sp, zp, n, y)
    assert seconds > 0
    want = torch.ops.qwen.linear_a8_panels(x, weights[-1][0], sp, zp, None, n)
    assert torch.equal(y, want)
    assert not torch.equal(y, torch.ops.qwen.linear_a8_panels(x, weights[0][0], sp, zp, None, n))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a8_amx_and_vnni_panels_compute_the_same_bits(kind, tmp_path, monkeypatch):
    """The many-row products on AMX tiles (``cpu.int8_products()``: where the CPU has AMX-INT8) and on
    VPDPBUSD (``QWEN_OPS_INT8_PRODUCTS=vnni``, a library of its own), 21 rows (a block of 16 tile
    rows and a tail of 5) with one and two threads: the same bits, and the reference's."""
    if cpu._compiler() is None or not cpu.int8_dot_products():
        pytest.skip("needs the C kernels with AVX512-VNNI")
    n, k, groups = 72, 512, 4
    x, w, bias = _case(kind, 21, n, k, groups, seed=5)
    zeros = w[2] if kind == "int4" else None
    want = RQ.REFERENCES[f"{kind}_a8"](x, *w, bias)
    flags = f" {cpu._cpu_flags()} "
    for mode in ("default", "vnni"):
        lib = fresh_library(tmp_path, monkeypatch, **({"QWEN_OPS_INT8_PRODUCTS": "vnni"} if mode == "vnni" else {}))
        assert lib.qwen_int8_amx() == (mode == "default" and " amx_int8" in flags and " amx_tile" in flags)
        for threads in (1, 2):
            out = torch.full((21, n), float("nan"))
            assert lib.qwen_linear_quant_a8(0 if kind == "int8" else 1, x.data_ptr(), k, 21, w[0].data_ptr(),
                                            w[1].data_ptr(), None if zeros is None else zeros.data_ptr(), k // groups,
                                            bias.data_ptr(), n, k, out.data_ptr(), n, threads, 0) == 0
            assert torch.equal(out, want), (mode, threads)


# ------------------------------------------------------------------------------------------------
# linear_a8_panels: the CPU's layout of the int8-activation products
# ------------------------------------------------------------------------------------------------

def _panels(kind: str, w: tuple) -> tuple:
    return Q.pack_a8_panels(w[0], w[1], w[2] if kind == "int4" else None)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a8_panels_compute_the_rows_products_bits_on_every_path(kind, tmp_path, monkeypatch):
    """linear_a8_panels against the rows' op contract (the float64 oracle, and the rows' reference bit for
    bit: the same arithmetic in the same order), on fresh random weights, with the output poisoned:
    1-4 rows (the VNNI streams; one row takes two panels at a time, so N = 200 and 140 give a thread
    pairs only, and pairs and a single panel), 5, 17 and 21 (AMX tiles where the CPU has them: a block
    of 16 and a tail; VNNI in a library forced to it), partial panels (N = 200, 140, 70), group sizes of
    128, 32 and the whole row, one and two threads, and the portable loop."""
    if cpu._compiler() is None:
        pytest.skip("needs the C kernels")
    code = 0 if kind == "int8" else 1
    flags = f" {cpu._cpu_flags()} "
    modes = ("default", "vnni") if cpu.int8_dot_products() else ("default",)
    for mode in modes:
        lib = fresh_library(tmp_path, monkeypatch, **({"QWEN_OPS_INT8_PRODUCTS": "vnni"} if mode == "vnni" else {}))
        assert lib.qwen_int8_amx() == (mode == "default" and cpu.int8_dot_products() and " amx_int8" in flags
                                       and " amx_tile" in flags)
        for seed, (rows, n, k, groups) in enumerate([(1, 200, 256, 2), (2, 70, 512, 16), (3, 128, 384, 1),
                                                      (4, 64, 256, 2), (5, 200, 256, 2), (17, 70, 512, 16),
                                                      (21, 128, 384, 1), (1, 140, 512, 16)]):
            x, w, bias = _case(kind, rows, n, k, groups, seed=seed)
            panels = _panels(kind, w)
            want = RQ.REFERENCES[f"{kind}_a8"](x, *w, bias)
            if mode == "default" and seed < 3:
                assert np.allclose(want.double().numpy(), _oracle(kind, x, w, bias), rtol=1e-5, atol=1e-4)
            for threads, portable in ((1, 0), (2, 0), (1, 1)):
                out = torch.full((rows, n), float("nan"))
                assert lib.qwen_linear_a8_panels(code, x.data_ptr(), k, 0, rows, panels[0].data_ptr(),
                                                 panels[1].data_ptr(), None if kind == "int8" else panels[2].data_ptr(),
                                                 k // groups, bias.data_ptr(), n, k, out.data_ptr(), n, 0, threads,
                                                 portable) == 0
                assert torch.equal(out, want), (mode, rows, n, threads, portable)
            # bf16 rows in and out, as they are: x's bf16 values, the product rounded once to bf16
            xb = x.bfloat16()
            outb = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
            assert lib.qwen_linear_a8_panels(code, xb.data_ptr(), k, 1, rows, panels[0].data_ptr(),
                                             panels[1].data_ptr(), None if kind == "int8" else panels[2].data_ptr(),
                                             k // groups, bias.data_ptr(), n, k, outb.data_ptr(), n, 1, 1, 0) == 0
            assert torch.equal(outb, RQ.REFERENCES[f"{kind}_a8"](xb, *w, bias)), (mode, rows, "bf16")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a8_panels_op_contract_and_bad_input(kind):
    """The op: its layout round-trips (pack, then the reference's unpack), bf16 rows, opcheck, and errors
    that name the argument, the value and what was expected; the op keeps working after them."""
    x, w, bias = _case(kind, 3, 128, 256, 2, seed=11)
    panels = _panels(kind, w)
    back = RQ.unpack_a8_panels(*panels, 128)
    assert all(torch.equal(a, b) for a, b in zip(back, w))
    zeros = panels[2]
    op = torch.ops.qwen.linear_a8_panels
    assert torch.equal(op(x, panels[0], panels[1], zeros, bias, 128), RQ.REFERENCES[f"{kind}_a8"](x, *w, bias))
    xb = x.bfloat16()
    assert torch.equal(op(xb, panels[0], panels[1], zeros, None, 128), RQ.REFERENCES[f"{kind}_a8"](xb, *w, None))
    torch.library.opcheck(op.default, (x, panels[0], panels[1], zeros, bias, 128))
    per = "4" if kind == "int8" else "8"
    with pytest.raises(ValueError, match=rf"weight has shape .* expected uint8 \[3, in_features / {per}, 64, 4\]"):
        op(x, panels[0], panels[1], zeros, None, 130)
    with pytest.raises(ValueError, match=r"x has shape \(3, 255\), expected \[rows, 256\]"):
        op(x[:, :255].contiguous(), panels[0], panels[1], zeros, None, 128)
    with pytest.raises(ValueError, match=r"scales has shape \(2, 2, 32\) and dtype torch.float32, expected float32 \[2, G, 64\]"):
        op(x, panels[0], panels[1][:, :, :32].contiguous(), zeros, None, 128)
    with pytest.raises(ValueError, match=r"out_features = 0, expected a positive int"):
        op(x, panels[0], panels[1], zeros, None, 0)
    # blocks of zeros, a NaN, an infinity and huge values: the rows' reference's bits (NaN rows NaN)
    odd = x.clone()
    odd[0, :128] = 0.0
    odd[1, 5] = float("nan")
    odd[2, 200] = float("inf")
    odd[2, :128] *= 1e30
    for xs in (odd, odd.bfloat16()):
        torch.testing.assert_close(op(xs, panels[0], panels[1], zeros, bias, 128),
                                   RQ.REFERENCES[f"{kind}_a8"](xs, *w, bias), rtol=0, atol=0, equal_nan=True)
    if kind == "int4":
        with pytest.raises(ValueError, match=r"zeros has shape \(2, 2, 64\) and dtype torch.int32, expected contiguous uint8"):
            op(x, panels[0], panels[1], zeros.int(), None, 128)
    assert torch.equal(op(x, panels[0], panels[1], zeros, bias, 128), RQ.REFERENCES[f"{kind}_a8"](x, *w, bias))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_silu_mul_a8_panels_op_contract_and_bad_input(kind):
    """silu_mul_linear_a8_panels (an MLP's down product on its gate | up rows, one call): against the float64
    oracle of the panels' contract on silu_mul's reference rows, bit for bit the two ops it stands for, fp32
    and bf16 rows, one and two threads, opcheck, and errors naming the argument; it keeps working after them."""
    k, n = 256, 128
    _, w, bias = _case(kind, 3, n, k, 2, seed=21)
    panels = _panels(kind, w)
    g = torch.Generator().manual_seed(22)
    gate_up = torch.randn(3, 2 * k, generator=g) * (torch.rand(3, 1, generator=g) * 4 + 0.01)
    op = torch.ops.qwen.silu_mul_linear_a8_panels
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (gate_up, gate_up.bfloat16()):
                got = op(rows, *panels, bias, n)
                assert got.dtype == rows.dtype and got.shape == (3, n)
                h = torch.ops.qwen.silu_mul(rows)
                assert torch.equal(got, torch.ops.qwen.linear_a8_panels(h, *panels, bias, n)), (threads, rows.dtype)
                # silu_mul's kernel and reference may differ in an ulp, which can move an activation digit
                want = RQ.silu_mul_linear_a8_panels_reference(rows, *panels, bias, n)
                torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02 * float(want.abs().max()))
            h = torch.nn.functional.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
            np.testing.assert_allclose(op(gate_up, *panels, bias, n).double().numpy(), _oracle(kind, h.float(), w, bias),
                                       rtol=1e-5, atol=1e-3)
    finally:
        torch.set_num_threads(before)
    torch.library.opcheck(op.default, (gate_up, *panels, bias, n))
    with pytest.raises(ValueError, match=r"gate_up has shape \(3, 511\)"):
        op(gate_up[:, :511].contiguous(), *panels, bias, n)
    with pytest.raises(ValueError, match=r"gate_up has shape \(3, 256\), expected \[rows, 512\]"):
        op(gate_up[:, :256].contiguous(), *panels, bias, n)
    with pytest.raises(ValueError, match=r"gate_up has shape \(3, 256\), expected \[rows, 512\]"):   # the fake's
        V.check_silu_mul_linear_a8_panels(gate_up[:, :256].contiguous(), *panels, bias, n)
    with pytest.raises(ValueError, match=r"gate_up has dtype (torch.float16|Half), expected float32 or bfloat16"):
        op(gate_up.half(), *panels, bias, n)
    with pytest.raises(ValueError, match=r"out_features = 0, expected a positive int"):
        op(gate_up, *panels, bias, 0)
    assert torch.equal(op(gate_up, *panels, bias, n),
                       torch.ops.qwen.linear_a8_panels(torch.ops.qwen.silu_mul(gate_up), *panels, bias, n))


def test_a8_layers_on_panels_keep_one_copy_and_the_checkpoint_layout(ckpt, monkeypatch):
    """Where VNNI runs the products, w8a8 layers repack into panels once: the fused q|k|v's parts read
    slices of its panels (no second copy of the weights), the state dict still holds the checkpoint's
    layout (equal to the rows model's), loading a state dict repacks it, and the logits are the rows
    model's bit for bit (the same arithmetic)."""
    if cpu._compiler() is None or not cpu.int8_dot_products():
        pytest.skip("needs the C kernels with AVX512-VNNI")
    rows, panels = load_model(ckpt, quantization="w8a8"), load_model(ckpt, quantization="w8a8")
    panels.process_weights_after_loading()
    with monkeypatch.context() as m:     # the rows model: every layer keeps linear_int8_a8 (as without VNNI)
        m.setattr(Q.QuantLinear, "panels_fit", lambda self: False)
        rows.process_weights_after_loading()
    attn = panels.get_submodule("model.layers.0.self_attn")
    fused = attn.qkv_quant
    assert fused.panels and tuple(fused.qweight.shape) == (4, 128 // 4, 64, 4)   # 128 + 64 + 64 features
    start, end = fused.qweight.data_ptr(), fused.qweight.data_ptr() + fused.qweight.numel()
    for name in ("q_proj", "k_proj", "v_proj"):
        part = getattr(attn, name)
        assert part.panels and start <= part.qweight.data_ptr() < end
    assert not any(m.panels for m in rows.modules() if isinstance(m, Q.QuantLinear))
    # the down products take the gate | up rows themselves (silu_mul_linear_a8_panels, one call less)
    from qwen_ops.models.layers import product_choices

    mlp = panels.get_submodule("model.layers.0.mlp")
    assert mlp._down_of_gate_up == mlp.down_proj.forward_silu_mul
    assert product_choices(panels)["model.layers.0.mlp.down"].endswith("; silu_mul in the same call")
    assert not product_choices(rows)["model.layers.0.mlp.down"].endswith("; silu_mul in the same call")
    # every layer's panels in one arena (2 MB pages), in the order a step reads them
    order = [panels.get_submodule(f"model.layers.{i}.{name}") for i in range(2)
             for name in ("self_attn.qkv_quant", "self_attn.o_proj", "mlp.gate_up_quant", "mlp.down_proj")]
    ptrs = [m.qweight.data_ptr() for m in order]
    assert all(m.panels for m in order) and ptrs == sorted(ptrs), ptrs
    assert ptrs[-1] - ptrs[0] < sum(m.qweight.numel() + 64 for m in order)
    assert not any("panel_arena" in m.__dict__ for m in panels.modules())
    want, got = rows.state_dict(), panels.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(_all_logits(rows, IDS), _all_logits(panels, IDS))
    # a changed weight, loaded through the state dict, reaches the fused panels
    changed = {k: v.clone() for k, v in want.items()}
    changed["model.layers.0.self_attn.k_proj.qweight"].neg_()
    panels.load_state_dict(changed)
    assert torch.equal(panels.state_dict()["model.layers.0.self_attn.k_proj.qweight"],
                       changed["model.layers.0.self_attn.k_proj.qweight"])
    rows.load_state_dict(changed)
    assert torch.equal(_all_logits(rows, IDS), _all_logits(panels, IDS))


def test_huge_page_tensors_are_plain_tensors():
    """cpu.huge_page_empty: the shape and dtype asked for, writable, its bytes on a 2 MB boundary (Linux),
    and a small one is torch.empty's."""
    t = cpu.huge_page_empty((3, 1 << 19), torch.float32)
    assert t.shape == (3, 1 << 19) and t.dtype == torch.float32 and t.is_contiguous()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    assert float(t[2, -1]) == t.numel() - 1
    import platform
    if platform.system() == "Linux":
        assert t.data_ptr() % cpu.HUGE_PAGE == 0
    small = cpu.huge_page_empty((4, 4), torch.uint8)
    assert small.shape == (4, 4) and small.dtype == torch.uint8
