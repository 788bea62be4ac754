"""Quantized weights (issue 28): the ops ``linear_int8`` / ``linear_int4`` / ``linear_fp8`` against
their references and an independent float64 formula, ``opcheck``, argument errors; checkpoints in the
FP8 block-wise, AWQ and GPTQ layouts written here from the formats' published packing (not with the
loader's code), loaded bit for bit and run against ``transformers`` on the same model dequantized by
this file; online int8 / fp8 within their stated error bounds; errors naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_ops.models import quant as Q
from qwen_ops.models.layers import forward_choices
from qwen_ops.models.loader import CheckpointError, load_model
from qwen_ops.ops.kernels import reference_quant as RQ

transformers = pytest.importorskip("transformers", reason="transformers is the dequantized model's oracle")

from qwen_tiny import greedy_generate, hf_greedy, load_hf, save_tiny_checkpoint  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, eos_token_id=3, tie_word_embeddings=False)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ's GEMM interleave: nibble i of a word is column 8j + AWQ_ORDER[i]
# The worst relative error of one online-quantized weight (the oracle's own figures, not the code's):
# rounding to the int8 grid costs half a step of the row's max (max|w| / 254); e4m3 keeps 3 mantissa
# bits, so at most 2^-4 of the value.
RELATIVE_ERROR = {"int8": 0.5 / 127, "fp8": 2.0 ** -4}


# ------------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------------

def _int8_case(g, rows, n, k, groups):
    return (torch.randn(rows, k, generator=g), torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
            torch.rand(n, groups, generator=g) * 0.02 + 0.001)


def _int4_case(g, rows, n, k, groups):
    return (torch.randn(rows, k, generator=g), torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            torch.rand(n, groups, generator=g) * 0.02 + 0.001,
            torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8))


def _fp8_case(g, rows, n, k, block):
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (torch.randn(rows, k, generator=g), w,
            torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-4)


SHAPES = [(64, 128), (67, 256), (12, 48), (5, 40)]   # N % 4 != 0, K % 16 != 0 (the portable loop) included


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_and_int4_kernels_match_the_reference(rows, shape, poisoned_empty):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    for groups in sorted({1, k // 8 if k % 16 else k // 16, k // 32 if k % 32 == 0 else 1}):   # groups of 32: int4's AVX-512 path
        x, q, s = _int8_case(g, rows, n, k, groups)
        want = RQ.linear_int8_reference(x, q, s)
        bias = torch.randn(n, generator=g)
        got = torch.ops.qwen.linear_int8(x, q, s, None)
        got_b = torch.ops.qwen.linear_int8(x, q, s, bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got_b, want + bias, rtol=1e-5, atol=1e-4)
        x, q4, s, z = _int4_case(g, rows, n, k, groups)
        want = RQ.linear_int4_reference(x, q4, s, z, bias)
        got = torch.ops.qwen.linear_int4(x, q4, s, z, bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 6])
@pytest.mark.parametrize("block", [(16, 32), (48, 48), (128, 128), None])
def test_fp8_kernel_matches_the_reference(rows, block, poisoned_empty):
    g = torch.Generator().manual_seed(rows)
    for n, k in ((64, 128), (67, 96), (6, 40)):
        blk = (n, k) if block is None else block       # None: one scale for the tensor (online fp8)
        x, w, si = _fp8_case(g, rows, n, k, blk)
        want = RQ.linear_fp8_reference(x, w, si, None, *blk)
        got = torch.ops.qwen.linear_fp8(x, w, si, None, *blk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


def test_fp8_widening_is_exact_for_every_code():
    """All 254 finite e4m3fn codes (NaN's two codes excluded), each alone in a row: the kernel's
    widening must equal torch's conversion exactly."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn).view(1, -1).expand(16, -1).contiguous()     # [16, 254] -> pad K to 256
    w = torch.cat([w, torch.zeros(16, 2, dtype=torch.uint8).view(torch.float8_e4m3fn)], dim=1)
    x = torch.eye(256)
    y = torch.ops.qwen.linear_fp8(x, w, torch.ones(1, 1), None, 16, 256)      # y[k, n] = w[n, k]
    assert torch.equal(y[:254, 0], codes.view(torch.float8_e4m3fn).float())


def test_bf16_and_half_inputs_round_once(monkeypatch):
    g = torch.Generator().manual_seed(7)
    x, q, s = _int8_case(g, 3, 64, 128, 4)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        got = torch.ops.qwen.linear_int8(xd, q, s, None)
        assert got.dtype == dtype
        want = (xd.float() @ (q.float() * s.repeat_interleave(32, 1)).T).to(dtype)
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    x, q4, s, z = _int4_case(g, 2, 256, 256, 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.qwen.linear_int4(x, q4, s, z, None)
        torch.set_num_threads(2)
        two = torch.ops.qwen.linear_int4(x, q4, s, z, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_kernel_error_is_at_or_below_the_references(kind):
    """Against float64 products of the same dequantized weights, the C kernel's error is no larger
    than the reference's (an fp32 matmul) beyond float noise: 1.5x its mean absolute error."""
    g = torch.Generator().manual_seed(21)
    errs = {}
    for rows in (1, 8):
        if kind == "int8":
            x, q, s = _int8_case(g, rows, 256, 1024, 8)
            w, run = RQ.dequantize_int8(q, s), lambda: torch.ops.qwen.linear_int8(x, q, s, None)
            ref = RQ.linear_int8_reference(x, q, s)
        elif kind == "int4":
            x, q4, s, z = _int4_case(g, rows, 256, 1024, 8)
            w, run = RQ.dequantize_int4(q4, s, z), lambda: torch.ops.qwen.linear_int4(x, q4, s, z, None)
            ref = RQ.linear_int4_reference(x, q4, s, z)
        else:
            x, w8, si = _fp8_case(g, rows, 256, 1024, (128, 128))
            w, run = RQ.dequantize_fp8(w8, si, 128, 128), lambda: torch.ops.qwen.linear_fp8(x, w8, si, None, 128, 128)
            ref = RQ.linear_fp8_reference(x, w8, si, None, 128, 128)
        truth = x.double() @ w.double().T
        errs[rows] = (float((run().double() - truth).abs().mean()), float((ref.double() - truth).abs().mean()))
        assert errs[rows][0] <= 1.5 * errs[rows][1] + 1e-9, errs


def test_portable_build_matches_the_reference(portable_library):
    """A build without AVX-512 runs the portable loop of qwen_linear_quant for every kind."""
    import ctypes

    lib = portable_library
    g = torch.Generator().manual_seed(2)
    x, q, s = _int8_case(g, 3, 20, 64, 4)
    _, q4, _, z = _int4_case(g, 3, 20, 64, 4)
    _, w8, si = _fp8_case(g, 3, 20, 64, (1, 32))
    cases = [(0, q, s, None, 16, 1, RQ.linear_int8_reference(x, q, s)),
             (1, q4, s, z, 16, 1, RQ.linear_int4_reference(x, q4, s, z)),
             (2, w8, si, None, 32, 1, RQ.linear_fp8_reference(x, w8, si, None, 1, 32))]
    for kind, w, sc, zz, group, bn, want in cases:
        y = torch.full((3, 20), float("nan"))
        status = lib.qwen_linear_quant(kind, x.data_ptr(), 64, 3, w.data_ptr(), sc.data_ptr(),
                                       None if zz is None else zz.data_ptr(), group, bn, None, 20, 64,
                                       y.data_ptr(), 20, 1)
        assert status == 0
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    assert isinstance(lib, ctypes.CDLL)


def test_references_match_an_independent_float64_formula():
    """The references' dequantization against element-by-element numpy from the contracts' words."""
    g = torch.Generator().manual_seed(11)
    x, q4, s, z = _int4_case(g, 2, 8, 32, 2)
    qn, sn, zn = q4.numpy(), s.numpy().astype(np.float64), z.numpy()
    w = np.zeros((8, 32))
    for n in range(8):
        for k in range(32):
            byte = int(qn[n, k // 2])
            nib = byte & 15 if k % 2 == 0 else byte >> 4
            w[n, k] = (nib - int(zn[n, k // 16])) * sn[n, k // 16]
    want = x.double().numpy() @ w.T
    np.testing.assert_allclose(RQ.linear_int4_reference(x, q4, s, z).double().numpy(), want, rtol=1e-5, atol=1e-5)
    x, w8, si = _fp8_case(g, 2, 6, 40, (4, 16))
    codes = w8.view(torch.uint8).numpy()
    wd = np.zeros((6, 40))
    for n in range(6):
        for k in range(40):
            c = int(codes[n, k])
            sign, e, m = -1.0 if c & 0x80 else 1.0, (c >> 3) & 15, c & 7
            mag = 2.0 ** (e - 7) * (1 + m / 8) if e else 2.0 ** -6 * (m / 8)
            wd[n, k] = sign * mag * float(si[n // 4, k // 16])
    np.testing.assert_allclose(RQ.linear_fp8_reference(x, w8, si, None, 4, 16).double().numpy(),
                               x.double().numpy() @ wd.T, rtol=1e-5, atol=1e-4)


def test_opcheck():
    g = torch.Generator().manual_seed(5)
    x, q, s = _int8_case(g, 3, 64, 128, 4)
    torch.library.opcheck(torch.ops.qwen.linear_int8.default, (x, q, s, torch.randn(64, generator=g)))
    x, q4, s, z = _int4_case(g, 2, 64, 128, 4)
    torch.library.opcheck(torch.ops.qwen.linear_int4.default, (x, q4, s, z, None))
    x, w, si = _fp8_case(g, 2, 64, 128, (32, 64))
    # test_schema compares inputs before and after with ops that have no float8 kernel on the CPU
    # ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn), so it runs on the other three.
    torch.library.opcheck(torch.ops.qwen.linear_fp8.default, (x, w, si, None, 32, 64),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_layer_forward_follows_assigned_tensors_and_ops():
    """QuantLinear builds its op call once (``_make_call``); assigning a weight, scale, bias or op afterwards
    must reach the next forward, and so must in-place updates. Oracle: float64 ``x @ (q * s)^T + b``."""
    g = torch.Generator().manual_seed(21)
    layer = Q.QuantLinear(64, 48, True, "int8", 2, (0, 0), torch.float32)
    x, q, s = _int8_case(g, 3, 48, 64, 2)

    def oracle(x, q, s, b):
        w = q.double() * s.double().repeat_interleave(32, dim=1)
        return x.double() @ w.T + b.double()

    layer.qweight, layer.scales = q, s
    layer.bias = torch.nn.Parameter(torch.randn(48, generator=g), requires_grad=False)
    layer.process_weights_after_loading()
    assert layer._call is not None
    torch.testing.assert_close(layer(x).double(), oracle(x, q, s, layer.bias), rtol=1e-5, atol=1e-4)
    x3 = x.reshape(3, 1, 64)
    torch.testing.assert_close(layer(x3), layer(x).reshape(3, 1, 48), rtol=0, atol=0)
    _, q2, s2 = _int8_case(g, 1, 48, 64, 2)
    layer.qweight = q2                                   # a new tensor: the built call is dropped
    torch.testing.assert_close(layer(x).double(), oracle(x, q2, s, layer.bias), rtol=1e-5, atol=1e-4)
    layer.scales = s2
    layer.process_weights_after_loading()
    with torch.no_grad():
        layer.bias.mul_(-2)                              # in place, after the call was built again
    layer.process_weights_after_loading()               # the fp32 copy of the bias the op takes
    torch.testing.assert_close(layer(x).double(), oracle(x, q2, s2, layer.bias), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        layer.qweight.copy_(q)                          # in place: the call holds the same tensor
    torch.testing.assert_close(layer(x).double(), oracle(x, q, s2, layer.bias), rtol=1e-5, atol=1e-4)
    layer.bias = torch.nn.Parameter(torch.randn(48, generator=g), requires_grad=False)   # after the fp32 copy
    torch.testing.assert_close(layer(x).double(), oracle(x, q, s2, layer.bias), rtol=1e-5, atol=1e-4)
    layer.process_weights_after_loading()
    layer._apply(lambda t: t.clone())                   # as .to(another device): new tensors, no __setattr__
    with torch.no_grad():
        layer.qweight.copy_(q2)
        layer.bias.mul_(-1)
    torch.testing.assert_close(layer(x).double(), oracle(x, q2, s2, layer.bias), rtol=1e-5, atol=1e-4)
    calls = []
    layer._op = lambda *args: calls.append(args) or RQ.linear_int8_reference(*args)
    layer(x)
    assert len(calls) == 1 and calls[0][1] is layer.qweight


def test_argument_errors_name_the_argument():
    g = torch.Generator().manual_seed(0)
    x, q, s = _int8_case(g, 2, 64, 128, 4)
    with pytest.raises(ValueError, match=r"qweight has shape \(64, 128\) and dtype torch.uint8, expected int8"):
        torch.ops.qwen.linear_int8(x, q.view(torch.uint8), s, None)
    with pytest.raises(ValueError, match=r"scales has shape \(64, 3\).*G dividing in_features = 128"):
        torch.ops.qwen.linear_int8(x, q, torch.ones(64, 3), None)
    with pytest.raises(ValueError, match=r"x has shape \(2, 64\), expected \[rows, 128\]"):
        torch.ops.qwen.linear_int8(x[:, :64], q, s, None)
    with pytest.raises(ValueError, match=r"bias has shape \(63,\)"):
        torch.ops.qwen.linear_int8(x, q, s, torch.ones(63))
    x, q4, s, z = _int4_case(g, 2, 64, 128, 4)
    with pytest.raises(ValueError, match=r"zeros has shape \(64, 2\) and dtype torch.uint8, expected uint8 \[64, 4\]"):
        torch.ops.qwen.linear_int4(x, q4, s, z[:, :2].contiguous(), None)
    x, w, si = _fp8_case(g, 2, 64, 128, (32, 64))
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 2\).*expected float32 \[2, 1\]"):
        torch.ops.qwen.linear_fp8(x, w, si, None, 32, 128)
    with pytest.raises(ValueError, match=r"block_n = 0, expected a positive int"):
        torch.ops.qwen.linear_fp8(x, w, si, None, 0, 64)


# ------------------------------------------------------------------------------------------------
# Checkpoint formats, written here from their specifications
# ------------------------------------------------------------------------------------------------

def _rtn_asym(w: torch.Tensor, group: int, zmin: int = 0):
    """4-bit round-to-nearest with zero points per group along K: q, z [N, G] ints, s fp16 [N, G]."""
    n, k = w.shape
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).clamp(min=1e-4).half()
    z = torch.clamp(torch.round(-lo / s.float()), zmin, 15).to(torch.int64)
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, 15).to(torch.int64).view(n, k)
    return q, z, s


def _dequant(q, z, s, group):
    """The formats' formula, (q - z) * s in fp32, written out here."""
    return (q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)


def _words(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Pack unsigned ``values`` (< 2**bits) along ``axis``, 32 / bits per int32 word, lowest bits first."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    words = np.zeros(v.shape[:-1], dtype=np.uint64)
    for i in range(per):
        words |= v[..., i] << np.uint64(bits * i)
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis))


def _awq_tensors(prefix, q, z, s):
    """AutoAWQ GEMM: qweight int32 [K, N / 8], qzeros [K / g, N / 8] (columns interleaved), scales [K / g, N]."""
    def pack(m: np.ndarray) -> np.ndarray:                 # m [R, N]: word j, nibble i <- column 8j + order[i]
        r, n = m.shape
        cols = m.reshape(r, n // 8, 8)[:, :, AWQ_ORDER]
        return _words(cols.reshape(r, n), 4, 1)
    return {prefix + ".qweight": torch.from_numpy(pack(q.T.numpy())),
            prefix + ".qzeros": torch.from_numpy(pack(z.T.numpy())),
            prefix + ".scales": s.T.contiguous()}


def _gptq_tensors(prefix, q, z, s, bits, group):
    """AutoGPTQ (v1): qweight int32 [K * bits / 32, N] (k packed), qzeros [K / g, N * bits / 32] storing z - 1
    (n packed), scales [K / g, N], g_idx [K]."""
    k = q.shape[1]
    return {prefix + ".qweight": torch.from_numpy(_words(q.T.numpy(), bits, 0)),
            prefix + ".qzeros": torch.from_numpy(_words((z.T.numpy() - 1) & ((1 << bits) - 1), bits, 1)),
            prefix + ".scales": s.T.contiguous(),
            prefix + ".g_idx": torch.arange(k, dtype=torch.int32) // group}


def _fp8_tensors(prefix, w, block):
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale = (amax / 448).clamp(min=1e-8)
    per = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / per).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {prefix + ".weight": q, prefix + ".weight_scale_inv": scale}, q.float() * per


def write_quantized(src: Path, dst: Path, method: str, bits: int = 4, block=(48, 48), zmin: int = 1):
    """A quantized copy of the fp32 checkpoint ``src`` in ``dst`` and its dequantized fp32 twin in
    ``dst.parent / (dst.name + '_dequant')`` (the oracle). Returns (dst, twin)."""
    hf = load_hf(src)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    tensors, dequant = {}, {}
    for layer in range(TINY["num_hidden_layers"]):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            w = state.pop(prefix + ".weight")
            if method == "fp8":
                t, d = _fp8_tensors(prefix, w, block)
            elif bits == 4:
                q, z, s = _rtn_asym(w, GROUP, zmin)
                t = _awq_tensors(prefix, q, z, s) if method == "awq" else _gptq_tensors(prefix, q, z, s, 4, GROUP)
                d = _dequant(q, z, s, GROUP)
            else:                                          # GPTQ 8-bit symmetric: z = 128
                n, k = w.shape
                s = (w.view(n, k // GROUP, GROUP).abs().amax(-1) / 127).clamp(min=1e-4).half()
                q = torch.clamp(torch.round(w / s.float().repeat_interleave(GROUP, 1)), -127, 127).to(torch.int64) + 128
                z = torch.full_like(s, 128, dtype=torch.int64)
                t = _gptq_tensors(prefix, q, z, s, 8, GROUP)
                d = _dequant(q, z, s, GROUP)
            tensors.update(t)
            dequant[prefix] = d
    tensors.update(state)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        if method == "fp8" else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False, "sym": bits == 8,
         "checkpoint_format": "gptq"})
    (dst / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for prefix, d in dequant.items():
            hf.get_submodule(prefix).weight.copy_(d)
    twin = dst.parent / (dst.name + "_dequant")
    hf.save_pretrained(twin)
    return dst, twin, dequant


@pytest.fixture(scope="module")
def fp32_ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("fp32") / "ckpt", "qwen3", seed=3, **TINY)


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    from qwen_tiny import shuffled_block_table, step_metadata, new_kv_caches

    table = shuffled_block_table(1, 8)
    positions, attn, _ = step_metadata([(0, 0, len(ids))], table)
    caches = new_kv_caches(model.config, 9, 4, torch.float32)
    with torch.no_grad():
        return model(torch.tensor(ids), positions, attn, caches, torch.arange(len(ids)))


FORMATS = [("awq", 4), ("gptq", 4), ("gptq", 8), ("fp8", 8)]


@pytest.mark.parametrize("method,bits", FORMATS, ids=[f"{m}{b}" for m, b in FORMATS])
def test_checkpoint_loads_bit_for_bit_and_matches_transformers(method, bits, fp32_ckpt, tmp_path):
    path, twin, dequant = write_quantized(fp32_ckpt, tmp_path / "q", method, bits)
    model = load_model(path)
    scheme = "fp8" if method == "fp8" else ("int4" if bits == 4 else "int8")
    for prefix, want in dequant.items():
        layer = model.get_submodule(prefix)
        assert isinstance(layer, Q.QuantLinear) and layer.scheme == scheme
        got = (RQ.dequantize_int4(layer.qweight, layer.scales, layer.zeros) if scheme == "int4" else
               RQ.dequantize_int8(layer.qweight, layer.scales) if scheme == "int8" else
               RQ.dequantize_fp8(layer.qweight, layer.scales, *layer.block))
        assert torch.equal(got, want), f"{prefix}: dequantized weights differ from the format's"
    model.process_weights_after_loading()
    choices = forward_choices(model)
    assert choices["model.layers.0.self_attn"] == "cpu" and choices["model.layers.0.mlp"] == "cpu", choices
    assert choices["model.layers.0.self_attn.q_proj"] == scheme
    hf = load_hf(twin)
    ids = [5, 17, 2, 60, 33, 9, 41, 8, 77, 1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), want, rtol=1e-4, atol=1e-4)
    prompts = [[5, 17, 2, 60], [33, 9, 41]]
    assert greedy_generate(model, prompts, 8) == [hf_greedy(hf, p, 8) for p in prompts]


def test_llm_serves_a_gptq_checkpoint(fp32_ckpt, tmp_path):
    from qwen_ops import LLM, SamplingParams

    path, twin, _ = write_quantized(fp32_ckpt, tmp_path / "q", "gptq", 4)
    llm = LLM(str(path), max_num_seqs=4, max_model_len=32)
    outs = llm.generate([[5, 17, 2, 60], [33, 9, 41]], SamplingParams(max_tokens=6, temperature=0.0,
                                                                      ignore_eos=True))
    hf = load_hf(twin)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in ([5, 17, 2, 60], [33, 9, 41])]


def test_gptq_v1_zero_of_zero_reads_as_sixteen(fp32_ckpt, tmp_path):
    """AutoGPTQ's v1 format stores z - 1 in 4 bits, so z = 0 is stored as 15 and every kernel that
    reads the format (AutoGPTQ's, vLLM's) takes it as 16; so does the loader."""
    path, _, dequant = write_quantized(fp32_ckpt, tmp_path / "q", "gptq", 4, zmin=0)
    model = load_model(path)
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    assert int(layer.zeros.max()) <= 16
    # where the writer's z was 0, the loader reads 16
    hf_w = load_hf(fp32_ckpt).get_submodule("model.layers.0.mlp.up_proj").weight.detach()
    _, z, _ = _rtn_asym(hf_w, GROUP, 0)
    assert torch.equal(layer.zeros.long() == 16, z == 0)


# ------------------------------------------------------------------------------------------------
# Online quantization
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantization_is_within_its_bound(method, fp32_ckpt):
    full = load_model(fp32_ckpt)
    model = load_model(fp32_ckpt, quantization=method)
    for prefix in (f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS):
        w = full.get_submodule(prefix).weight.detach()
        layer = model.get_submodule(prefix)
        if method == "int8":
            d = RQ.dequantize_int8(layer.qweight, layer.scales)
            bound = w.abs().amax(1, keepdim=True) * RELATIVE_ERROR["int8"] * (1 + 1e-6)
        else:
            d = RQ.dequantize_fp8(layer.qweight, layer.scales, *layer.block)
            scale = float(layer.scales[0, 0])
            assert bool((layer.scales == scale).all())          # one scale for the tensor
            bound = w.abs() * RELATIVE_ERROR["fp8"] + scale * 2.0 ** -10 + 1e-9
        assert bool(((d - w).abs() <= bound).all()), f"{prefix}: {float((d - w).abs().max())}"
    # int8 quantizes the LM head too (llama.cpp's Q8_0 does); fp8 leaves it, as vLLM
    assert isinstance(model.lm_head, Q.QuantLinear) == (method == "int8")
    full.process_weights_after_loading()
    model.process_weights_after_loading()
    ids = [5, 17, 2, 60, 33, 9, 41, 8]
    ref, got = _all_logits(full, ids), _all_logits(model, ids)
    # The logits' error follows from the weights': each is off by at most half a step, 1/254 of its
    # row's max (int8; an RMS of ~1/440 of the max, ~0.7% of a row's RMS for these Gaussian rows) or
    # 1/16 of itself (fp8; an RMS of ~3.6%). Through 14 products and 2 residual layers of this random,
    # peaked model that measured 2.1% (int8) and 10.4% (fp8) of the logits' norm; the bounds are 2x.
    rel = float((got - ref).norm() / ref.norm())
    assert rel < (0.04 if method == "int8" else 0.2), rel


def test_online_quantization_keeps_peak_memory_to_one_tensor(fp32_ckpt):
    model = load_model(fp32_ckpt, quantization="int8")
    assert any(isinstance(m, Q.QuantLinear) for m in model.model.layers.modules())
    assert not any(isinstance(m, torch.nn.Linear) and m is not model.lm_head
                   for m in model.model.layers.modules())


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def _with_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,match", [
    ({"desc_act": "yes"}, r"quantization_config.desc_act = 'yes'; supported: False, True"),
    ({"bits": 3}, r"quantization_config.bits = 3; supported: 4, 8"),
    ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method = 'bitsandbytes'"),
    ({"group_size": 20}, r"quantization_config.group_size = 20, expected a positive multiple of 16"),
    ({"checkpoint_format": "marlin"}, r"quantization_config.checkpoint_format = 'marlin'"),
    ({"lm_head": "yes"}, r"quantization_config.lm_head = 'yes'; supported: False, True"),
    ({"lm_head": True}, r"quantization_config.lm_head = true, but the checkpoint has no quantized LM head"),
])
def test_unsupported_gptq_fields_are_named(change, match, fp32_ckpt, tmp_path):
    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "q", "gptq", 4)
    _with_config(path, **change)
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_unsupported_awq_and_fp8_fields_are_named(fp32_ckpt, tmp_path):
    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "awq", "awq", 4)
    _with_config(path, version="gemv")
    with pytest.raises(ValueError, match=r"quantization_config.version = 'gemv'"):
        load_model(path)
    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "fp8", "fp8")
    _with_config(path, weight_block_size=None)
    with pytest.raises(ValueError, match=r"quantization_config.weight_block_size = None"):
        load_model(path)
    _with_config(path, weight_block_size=[48, 48], activation_scheme="static")
    with pytest.raises(ValueError, match=r"quantization_config.activation_scheme = 'static'"):
        load_model(path)


def test_bad_group_assignment_and_misshaped_tensors_are_named(fp32_ckpt, tmp_path):
    from safetensors.torch import load_file

    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "q", "gptq", 4)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    good = tensors[name]
    tensors[name] = torch.zeros_like(good)              # every input in group 0
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.down_proj.g_idx' does not assign 32 input"):
        load_model(path)
    tensors[name] = good
    bad = "model.layers.0.self_attn.k_proj.qweight"
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.k_proj.qweight' has shape \[8, 31\]"):
        load_model(path)


def test_online_quantization_argument_errors(fp32_ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"quantization = 'int3'; expected one of int8, int4, fp8"):
        load_model(fp32_ckpt, quantization="int3")
    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "q", "awq", 4)
    with pytest.raises(ValueError, match=r"quantization = 'int8', but .* holds a 'awq' checkpoint"):
        load_model(path, quantization="int8")
    from qwen_ops import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2 with quantized weights \(awq\)"):
        LLM(str(path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2 with quantized weights \(int8\)"):
        LLM(str(fp32_ckpt), tensor_parallel_size=2, quantization="int8")


@pytest.mark.parametrize("fmt,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_export_round_trips_within_one_step(fmt, bits, fp32_ckpt, tmp_path):
    """quant_export's round-to-nearest files load through the loader with every weight within one
    quantization step of the original (half a step, one where the grid's end clamps)."""
    from qwen_ops.models.quant_export import export

    path = export(fp32_ckpt, tmp_path / fmt, fmt, bits, group_size=GROUP)
    full, model = load_model(fp32_ckpt), load_model(path)
    for prefix in (f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS):
        w = full.get_submodule(prefix).weight.detach()
        layer = model.get_submodule(prefix)
        d = (RQ.dequantize_int4(layer.qweight, layer.scales, layer.zeros) if bits == 4
             else RQ.dequantize_int8(layer.qweight, layer.scales))
        step = layer.scales.repeat_interleave(GROUP, 1)
        assert bool(((d - w).abs() <= step * 1.0001).all()), prefix


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gptq_quantized_lm_head_loads_bit_for_bit_and_matches_transformers(tied, tmp_path):
    """``lm_head: true`` (GPTQModel's quantized LM head: ``lm_head.qweight`` ...), written here from the
    format; a tied checkpoint's head is quantized from the embedding, which stays in full precision
    for the lookup. The oracle: transformers with that head dequantized and the embedding as stored."""
    src = save_tiny_checkpoint(tmp_path / "fp32", "qwen3", seed=4, **{**TINY, "tie_word_embeddings": tied})
    path, twin, _ = write_quantized(src, tmp_path / "q", "gptq", 4)
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    head = tensors["model.embed_tokens.weight"] if tied else tensors["lm_head.weight"]
    tensors.pop("lm_head.weight", None)
    q, z, s = _rtn_asym(head, GROUP, 1)
    tensors.update(_gptq_tensors("lm_head", q, z, s, 4, GROUP))
    save_file(tensors, str(file))
    _with_config(path, lm_head=True)
    model = load_model(path)
    assert isinstance(model.lm_head, Q.QuantLinear) and model.lm_head.kernel == "int4"
    assert torch.equal(RQ.dequantize_int4(model.lm_head.qweight, model.lm_head.scales, model.lm_head.zeros),
                       _dequant(q, z, s, GROUP))
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    hf = load_hf(twin)
    hf.lm_head.weight = torch.nn.Parameter(_dequant(q, z, s, GROUP))       # unties a tied head
    model.process_weights_after_loading()
    ids = [5, 17, 2, 60, 33, 9, 41, 8, 77, 1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_large_layers_convert_in_blocks_bit_for_bit(method, bits, fp32_ckpt, tmp_path, monkeypatch):
    """A layer of more than CONVERT_COLUMNS output features (an LM head) is converted a block at a time
    (its unpacked int32 copies would be gigabytes): the buffers equal the whole-layer conversion's."""
    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "q", method, bits)
    whole = dict(load_model(path).named_buffers())
    monkeypatch.setattr(Q, "CONVERT_COLUMNS", 24)           # 64- and 128-feature layers in 3-6 blocks
    blocked = dict(load_model(path).named_buffers())
    quantized = [name for name in whole if name.endswith(("qweight", "scales", "zeros"))]
    assert quantized and all(torch.equal(whole[name], blocked[name]) for name in quantized)


def test_export_writes_a_quantized_lm_head(fp32_ckpt, tmp_path):
    from qwen_ops.models.quant_export import export

    path = export(fp32_ckpt, tmp_path / "gptq", "gptq", 4, group_size=GROUP, lm_head=True)
    model = load_model(path)
    w = load_model(fp32_ckpt).lm_head.weight.detach()
    d = RQ.dequantize_int4(model.lm_head.qweight, model.lm_head.scales, model.lm_head.zeros)
    assert bool(((d - w).abs() <= model.lm_head.scales.repeat_interleave(GROUP, 1) * 1.0001).all())
    with pytest.raises(ValueError, match="lm_head = True with format = 'awq'"):
        export(fp32_ckpt, tmp_path / "awq", "awq", 4, group_size=GROUP, lm_head=True)


# ------------------------------------------------------------------------------------------------
# The Triton kernels (CUDA's path), under TRITON_INTERPRET=1 on small shapes (tests/conftest.py)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 5, 20])
def test_triton_kernels_match_the_reference(rows, poisoned_empty):
    pytest.importorskip("triton")
    from qwen_ops.ops.backend import triton_interpret
    from qwen_ops.ops.kernels.triton_quant import linear_quant_triton

    if not triton_interpret():
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(rows)
    n, k = 72, 96                                   # N and rows not multiples of the tiles
    bias = torch.randn(n, generator=g)
    x, q, s = _int8_case(g, rows, n, k, 3)          # groups of 32
    _, q4, _, z = _int4_case(g, rows, n, k, 3)
    _, w8, si = _fp8_case(g, rows, n, k, (16, 48))
    cases = [("int8", q, s, None, 32, 1, RQ.linear_int8_reference(x, q, s, bias)),
             ("int4", q4, s, z, 32, 1, RQ.linear_int4_reference(x, q4, s, z, bias)),
             ("fp8", w8, si, None, 48, 16, RQ.linear_fp8_reference(x, w8, si, bias, 16, 48))]
    for kind, w, sc, zz, group, block_rows, want in cases:
        got = linear_quant_triton(kind, x, w, sc, zz, bias, n, k, group, block_rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=kind)
    xb = x.bfloat16()
    got = linear_quant_triton("int4", xb, q4, s, z, None, n, k, 32, 1)
    want = RQ.linear_int4_reference(xb, q4, s, z)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max()) <= float(want.float().abs().max()) * 2 ** -7


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_online_int8_on_hybrid_and_moe_models(family, tmp_path):
    """Gated DeltaNet projections, full-attention layers and shared experts take QuantLinear layers,
    the routed experts a QuantMoeExperts (test_quant_moe.py checks those against transformers); the
    greedy tokens equal the same model's with its quantized layers on the ops' references."""
    from checkpoints import make_moe_checkpoint, make_qwen3_5_checkpoint
    from qwen_ops import LLM, SamplingParams

    path = (make_qwen3_5_checkpoint(tmp_path / "m") if family == "qwen3_5"
            else make_moe_checkpoint(tmp_path / "m", "qwen3_next"))
    llm = LLM(str(path), quantization="int8", max_num_seqs=2, max_model_len=32)
    schemes = Q.describe(llm.engine.model)
    assert any(".linear_attn.in_proj" in name for name in schemes), sorted(schemes)
    assert any(".self_attn.o_proj" in name for name in schemes), sorted(schemes)
    if family == "qwen3_next":
        assert any(".shared_expert." in name for name in schemes), sorted(schemes)
        assert any(name.endswith(".mlp.experts") for name in schemes), sorted(schemes)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 2, 60, 9], [33, 9, 41]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    for m in llm.engine.model.modules():
        if isinstance(m, Q.QuantLinear):
            m._op = RQ.REFERENCES[m.scheme]
        if isinstance(m, Q.QuantMoeExperts):
            m.forward = (lambda self: lambda x, w, i: RQ.fused_moe_quant_reference(
                x, self.w13, self.w13_scales, self.w13_zeros, self.w2, self.w2_scales, self.w2_zeros, w, i,
                self.kernel, self.block_k))(m)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == got


def test_bf16_products_record_their_path_and_rows_do_not_depend_on_the_batch(fp32_ckpt):
    """A bf16 model's fused products are linear_packed's, recorded with how this CPU runs them (AMX
    tiles, AVX512-BF16 dot products or widening: one path for every row count), so the logits of a
    prompt's first rows are bit for bit the same whether 4, 12 or 40 rows run in the step (oneDNN
    past a row count, as before, broke this on AMX CPUs), and within 3% (by norm) of the fp32 model's."""
    from qwen_ops.models.layers import product_choices
    from qwen_ops.ops.kernels import cpu

    model = load_model(fp32_ckpt, dtype="bfloat16")
    model.process_weights_after_loading()
    kinds = product_choices(model)
    assert {kind.split(";")[0] for kind in kinds.values()} == {f"packed panels ({cpu.bf16_products()})"}
    assert all(kind.endswith("; silu_mul in the same call") == name.endswith("gate_up") for name, kind in kinds.items())
    ids = [(7 * i + 5) % 90 + 3 for i in range(40)]
    rows = {n: _all_logits_dtype(model, ids[:n]) for n in (4, 12, 40)}
    assert torch.equal(rows[40][:12], rows[12]) and torch.equal(rows[12][:4], rows[4])
    exact = load_model(fp32_ckpt)
    exact.process_weights_after_loading()
    want = _all_logits_dtype(exact, ids, torch.float32)
    assert ((rows[40].float() - want).norm() / want.norm()).item() < 0.03     # bf16 rounds every layer (1.7% here)


def _all_logits_dtype(model, ids, dtype=torch.bfloat16):
    from qwen_tiny import new_kv_caches, shuffled_block_table, step_metadata

    positions, attn, _ = step_metadata([(0, 0, len(ids))], shuffled_block_table(1, 16))
    caches = new_kv_caches(model.config, 17, 4, dtype)
    with torch.no_grad():
        return model(torch.tensor(ids), positions, attn, caches, torch.arange(len(ids)))


def test_compiled_decode_runs_the_quantized_ops(fp32_ckpt, tmp_path):
    """torch.compile(fullgraph=True) of the decode step traces QuantLinear's op calls (their fakes)
    and gives the eager model's greedy tokens."""
    from qwen_ops import LLM, SamplingParams

    path, _, _ = write_quantized(fp32_ckpt, tmp_path / "q", "awq", 4)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 2, 60], [33, 9, 41]]
    eager = [o.outputs[0].token_ids for o in LLM(str(path), max_num_seqs=2, max_model_len=32).generate(prompts, sp)]
    llm = LLM(str(path), max_num_seqs=2, max_model_len=32, compile=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == eager
    from qwen_ops.engine.batch import BatchedRequest
    assert llm.engine.runner.executor_for([BatchedRequest(0, [5], 9)]) == "compiled"


def test_gptq_act_order_loads_and_matches_transformers(fp32_ckpt, tmp_path):
    """desc_act: each input feature k belongs to group g_idx[k], a random assignment of 32 inputs a
    group, written here from the format (q, z, s per group; qweight in the original k order)."""
    hf = load_hf(fp32_ckpt)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    tensors, dequant = {}, {}
    g = torch.Generator().manual_seed(9)
    for layer in range(TINY["num_hidden_layers"]):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            w = state.pop(prefix + ".weight")
            n, k = w.shape
            g_idx = torch.randperm(k, generator=g) // GROUP               # group of input k
            order = torch.sort(g_idx, stable=True).indices               # inputs of group 0, then 1, ...
            q_sorted, z, s = _rtn_asym(w[:, order], GROUP, 1)             # grouped along the sorted inputs
            q = torch.empty_like(q_sorted)
            q[:, order] = q_sorted                                        # back to the original k order
            t = _gptq_tensors(prefix, q, z, s, 4, GROUP)
            t[prefix + ".g_idx"] = g_idx.to(torch.int32)
            tensors.update(t)
            d = torch.empty(n, k)
            d[:, order] = _dequant(q_sorted, z, s, GROUP)
            dequant[prefix] = d
    tensors.update(state)
    path = tmp_path / "actorder"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((fp32_ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                                     "sym": False, "checkpoint_format": "gptq"}
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for prefix, d in dequant.items():
            hf.get_submodule(prefix).weight.copy_(d)
    model = load_model(path)
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert layer.perm is not None
    model.process_weights_after_loading()
    ids = [5, 17, 2, 60, 33, 9, 41, 8, 77, 1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), want, rtol=1e-4, atol=1e-4)


def test_bench_quant_fails_on_wrong_tokens(fp32_ckpt, monkeypatch, capsys):
    """benchmarks/bench_quant.py exits 1 when a quantized kernel's tokens differ from its reference's:
    here the int8 op is replaced by one whose products are 1.5x too large (the reference twin is not)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_quant", Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--checkpoint", str(fp32_ckpt), "--variants", "int8", "--threads", "1", "--reps", "1", "--steps", "2"]
    assert bench.main(args) == 0
    real = Q._OPS["int8"]
    monkeypatch.setitem(Q._OPS, "int8", lambda x, *rest: real(x, *rest) * 1.5)
    assert bench.main(args) == 1
    assert "FAIL" in capsys.readouterr().out


def test_triton_fp8_w8a8_scales_activations_per_row():
    """W8A8 (the path sm_89+ GPUs take): activations quantized per row to FP8, then the fp8 product; against
    the reference on the activations as quantized (the kernel's only rounding beyond the reference's)."""
    pytest.importorskip("triton")
    from qwen_ops.ops.backend import triton_interpret
    from qwen_ops.ops.kernels.triton_quant import linear_quant_triton, quantize_rows_fp8

    if not triton_interpret():
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(4)
    x, w8, si = _fp8_case(g, 5, 72, 96, (1, 48))
    x = x * torch.linspace(0.1, 10, 5)[:, None]                 # rows of different ranges
    xq, xs = quantize_rows_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and float(xq.float().abs().max()) <= 448
    want = RQ.linear_fp8_reference(xq.float() * xs[:, None], w8, si, None, 1, 48)
    got = linear_quant_triton("fp8", x, w8, si, None, None, 72, 96, 48, 1, act_fp8=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    exact = RQ.linear_fp8_reference(x, w8, si, None, 1, 48)
    assert float((got - exact).norm() / exact.norm()) < 0.05         # the activations' FP8 rounding
