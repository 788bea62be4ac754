"""qwen_ops.models.linear.Linear: nn.Linear's results and state dict, through oneDNN for fp32 CPU batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qwen_ops
from qwen_ops.models import linear as L
from qwen_ops.ops.kernels import cpu

pytestmark = pytest.mark.skipif(not L._onednn_linear_available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def onednn_route():
    """The oneDNN route is what Linear takes with the cpu backend off (its packed route is tested
    at the end of this file, under the cpu backend)."""
    with qwen_ops.use_backend("reference"):
        yield


def _layer(bias: bool, seed: int = 0) -> L.Linear:
    torch.manual_seed(seed)
    layer = L.Linear(96, 80, bias=bias)
    with torch.no_grad():            # random, non-zero bias too
        if bias:
            layer.bias.normal_()
    return layer.eval()


@pytest.mark.parametrize("rows", [1, L.ONEDNN_MIN_ROWS - 1, L.ONEDNN_MIN_ROWS, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_and_takes_onednn_from_the_threshold(rows, bias, monkeypatch):
    layer = _layer(bias)
    x = torch.randn(rows, 96)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or pointwise(*a))
    with torch.inference_mode():
        out = layer(x)
    expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if rows >= L.ONEDNN_MIN_ROWS else 0)


def test_non_contiguous_input_and_other_dtypes_and_training():
    layer = _layer(True)
    wide = torch.randn(40, 2 * 96)
    x = wide[:, ::2]                                   # a strided view
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # bf16 and autograd keep F.linear (oneDNN's fp32 kernel has no backward here).
    bf = _layer(False).to(torch.bfloat16)
    xb = torch.randn(32, 96, dtype=torch.bfloat16)
    assert torch.equal(bf(xb), F.linear(xb, bf.weight))
    layer.train()
    out = layer(torch.randn(32, 96))
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_state_dict_is_nn_linear():
    layer = _layer(True)
    plain = torch.nn.Linear(96, 80)
    plain.load_state_dict(layer.state_dict())
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 96)
    assert torch.equal(plain(x), layer(x))


def test_compiled_uses_the_opaque_op_with_no_graph_break():
    from torch._dynamo.utils import counters

    layer = _layer(True, seed=3)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(48, 96)
    with torch.inference_mode():
        out = compiled(x)
        ref = layer(x)
    assert counters["graph_break"] == {}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.qwen_ops.onednn_linear.default, (x, layer.weight.detach(), layer.bias.detach()))


def test_prepacked_weight_follows_in_place_writes_and_replacement():
    layer = _layer(True, seed=5)
    x = torch.randn(32, 96)
    with torch.inference_mode():
        first = layer(x)
    assert layer._packed is not None, "the batched call did not prepack"
    torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(-2.0)                          # in place: the version counter moves
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(80, 96))   # replaced: a new data pointer
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.prepack = False
    layer._packed = None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert layer._packed is None


def test_a_module_with_a_packed_weight_deep_copies_and_saves(tmp_path):
    import copy

    layer = _layer(True, seed=6)
    x = torch.randn(32, 96)
    with torch.inference_mode():
        want = layer(x)
    assert layer._packed is not None
    clone = copy.deepcopy(layer)
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert layer._packed is not None, "copying must not drop the original's packed weight"
    for other in (clone, loaded):
        assert other._packed is None
        with torch.inference_mode():
            torch.testing.assert_close(other(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, L.ONEDNN_MIN_ROWS, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_group_matches_the_modules_one_by_one(rows, bias, monkeypatch):
    """One oneDNN product over the concatenated weights from ONEDNN_MIN_ROWS rows (else one call per
    module), same values as each module; the packed concatenation follows weight writes."""
    torch.manual_seed(3)
    layers = tuple(L.Linear(96, n, bias=bias).eval() for n in (64, 16, 16))
    with torch.no_grad():
        for layer in layers:
            if bias:
                layer.bias.normal_()
    x = torch.randn(rows, 96)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or pointwise(*a))
    with torch.inference_mode():
        outs = L.linear_group(x, layers)
    assert len(calls) == (1 if rows >= L.ONEDNN_MIN_ROWS else 0)
    for out, layer in zip(outs, layers):
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layers[1].weight.mul_(-2.0)                  # in place: the packed concatenation must follow
        if bias:
            layers[2].bias.add_(1.0)
    with torch.inference_mode():
        outs = L.linear_group(x, layers)
    for out, layer in zip(outs, layers):
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_linear_group_with_autograd_or_mixed_biases_calls_the_modules():
    torch.manual_seed(4)
    layers = (L.Linear(32, 24, bias=True), L.Linear(32, 8, bias=False))
    x = torch.randn(20, 32)
    outs = L.linear_group(x, layers)                  # mixed biases: one call each
    for out, layer in zip(outs, layers):
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    same = (layers[0], L.Linear(32, 8, bias=True))
    outs = L.linear_group(x, same)                    # grad enabled and weights require grad: no oneDNN
    sum(o.sum() for o in outs).backward()
    assert same[0].weight.grad is not None and same[1].weight.grad is not None


# --------------------------------------------------------------------------------------------
# The packed route: cpu.linear_packed on Linear.panels(), with the cpu backend selected
# --------------------------------------------------------------------------------------------

def _cpu_backend():
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    return qwen_ops.use_backend("cpu")


@pytest.mark.parametrize("rows", [1, 5, L.ONEDNN_MIN_ROWS, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_route_matches_f_linear_and_follows_the_weight(rows, bias, monkeypatch):
    layer = _layer(bias, seed=7)
    x = torch.randn(rows, 96)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or pointwise(*a))
    with _cpu_backend(), torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        first = layer.panels()
        assert layer.panels() is first, "the packed copy is made once"
    with torch.no_grad():
        layer.weight.mul_(-2.0)                          # in place: repacked
    with _cpu_backend(), torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert layer.panels() is not first
    assert calls == [], "the packed route does not call oneDNN"


def test_packed_route_leaves_autograd_strided_rows_and_prepack_off_to_the_others():
    layer = _layer(True, seed=8)
    with _cpu_backend():
        out = layer(torch.randn(4, 96))                  # grad enabled: F.linear, differentiable
        out.sum().backward()
        assert layer.weight.grad is not None and layer._panels is None
        with torch.inference_mode():
            x = torch.randn(6, 2 * 96)[:, ::2]           # strided rows: F.linear
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert layer._panels is None
            layer.prepack = False
            x = torch.randn(6, 96)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert layer._panels is None


def test_moving_the_module_drops_its_packed_copies():
    layer = _layer(True, seed=9)
    with _cpu_backend(), torch.inference_mode():
        layer(torch.randn(3, 96))
    assert layer._panels is not None
    layer.double()
    assert layer._panels is None and layer._packed is None
    x = torch.randn(3, 96, dtype=torch.float64)
    with _cpu_backend(), torch.inference_mode():       # fp64: F.linear, nothing packed
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._panels is None
