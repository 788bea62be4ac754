"""Quantized mixture-of-experts layers (issue 28): ``torch.ops.qwen.fused_moe_quant`` against a float64
oracle written here (the weights dequantized from the layouts' formulas, one token and choice at a
time), its reference, the Triton kernels under the interpreter, ``opcheck`` and argument errors; Qwen3-MoE
checkpoints whose experts are stored per expert in the AWQ, GPTQ and FP8 layouts (written by
test_quant.py's writers from the formats' packing) loaded bit for bit and run against ``transformers`` on
the model dequantized by this file; online int8 / w8a8 / fp8 of the experts in both checkpoint layouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_ops.models import quant as Q
from qwen_ops.models.loader import CheckpointError, load_model
from qwen_ops.ops.kernels import reference_quant as RQ

transformers = pytest.importorskip("transformers", reason="transformers is the dequantized model's oracle")

from checkpoints import make_moe_checkpoint  # noqa: E402
from qwen_tiny import greedy_generate, hf_greedy, load_hf  # noqa: E402
from test_quant import _all_logits, _awq_tensors, _dequant, _fp8_tensors, _gptq_tensors, _rtn_asym  # noqa: E402

KERNELS = ["int8", "int4", "fp8", "int8_a8", "int4_a8"]
E, H, I, T, TOP_K = 4, 64, 32, 7, 2


# ------------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------------

def _weights(kernel: str, n: int, k: int, group: int, g: torch.Generator):
    """Random quantized experts ``[E, n, k]`` in the op's layout: (w, scales, zeros, dequantized fp64),
    the dequantization written out from the layout's formula."""
    scales = torch.rand(E, n, -(-k // group), generator=g) * 0.02 + 0.001
    per = scales.double().repeat_interleave(group, 2)[:, :, :k]
    if kernel.startswith("int8"):
        w = torch.randint(-127, 128, (E, n, k), generator=g, dtype=torch.int8)
        return w, scales, None, w.double() * per
    if kernel.startswith("int4"):
        q = torch.randint(0, 16, (E, n, k), generator=g, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (E, n, k // group), generator=g, dtype=torch.uint8)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)            # element k in nibble k % 2, low first
        return packed, scales, zeros, (q.double() - zeros.double().repeat_interleave(group, 2)) * per
    w = (torch.randn(E, n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, scales, None, w.double() * per


def _digits64(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as int8 activations per row and block (the a8 contract), in float64 here."""
    rows, k = x.shape
    b = x.double().view(rows, k // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    unit = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(b / unit).clamp(-127, 127) * unit).view(rows, k)


def _case(kernel: str, seed: int, dtype=torch.float32, tokens: int = T):
    g = torch.Generator().manual_seed(seed)
    group = 16
    w13, s13, z13, d13 = _weights(kernel, 2 * I, H, group, g)
    w2, s2, z2, d2 = _weights(kernel, H, I, group, g)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    weights = torch.rand(tokens, TOP_K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    args = (x, w13, s13, z13, w2, s2, z2, weights, ids, kernel, group if kernel == "fp8" else 0)
    return args, d13, d2


def _oracle(args, d13, d2) -> torch.Tensor:
    """One (token, choice) at a time in float64 on the dequantized weights."""
    x, *_, weights, ids, kernel, _ = args
    a8 = kernel.endswith("_a8")
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t:t + 1].double()
        for j in range(TOP_K):
            e = int(ids[t, j])
            gu = (_digits64(xt, 16) if a8 else xt) @ d13[e].T          # a8: blocks of the group, 16
            act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            out[t] += float(weights[t, j]) * ((_digits64(act, 16) if a8 else act) @ d2[e].T)[0]
    return out


@pytest.mark.parametrize("kernel", KERNELS)
def test_op_and_reference_match_a_float64_oracle(kernel):
    args, d13, d2 = _case(kernel, seed=KERNELS.index(kernel))
    want = _oracle(args, d13, d2)
    # fp32 products against float64; a8: a digit may round the other way where x * 127 / amax lands
    # near a half in fp32
    tol = (2e-3 if kernel.endswith("_a8") else 1e-5) * float(want.abs().max())
    for got in (torch.ops.qwen.fused_moe_quant(*args), RQ.fused_moe_quant_reference(*args)):
        assert got.dtype == torch.float32
        assert float((got.double() - want).abs().max()) <= tol


@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_kernel_matches_the_reference(kernel):
    """Fresh inputs each kernel, bf16 activations too: the grouped C-kernel path against the reference
    (bit for bit for the a8 kernels, whose reference computes the kernels' arithmetic)."""
    for dtype in (torch.float32, torch.bfloat16):
        args, _, _ = _case(kernel, seed=10 + KERNELS.index(kernel), dtype=dtype)
        got = torch.ops.qwen.fused_moe_quant(*args)
        want = RQ.fused_moe_quant_reference(*args)
        assert got.dtype == dtype
        if kernel.endswith("_a8"):
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2 if dtype != torch.float32 else 1e-5,
                                       atol=1e-5 * float(want.float().abs().max()) + (2e-2 if dtype != torch.float32 else 0))


def test_an_expert_nobody_chose_and_no_tokens():
    args, _, _ = _case("int4", seed=3, tokens=1)          # two of the four experts take no row
    torch.testing.assert_close(torch.ops.qwen.fused_moe_quant(*args), RQ.fused_moe_quant_reference(*args),
                               rtol=1e-5, atol=1e-6)
    empty = (args[0][:0],) + args[1:7] + (args[7][:0], args[8][:0]) + args[9:]
    assert torch.ops.qwen.fused_moe_quant(*empty).shape == (0, H)


@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernels_match_the_reference(kernel, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from qwen_ops.ops.kernels.triton_moe import fused_moe_quant_triton

    for dtype in (torch.float32, torch.bfloat16):
        args, _, _ = _case(kernel, seed=20 + KERNELS.index(kernel), dtype=dtype, tokens=5)
        got = fused_moe_quant_triton(*args)
        want = RQ.fused_moe_quant_reference(*args)
        assert got.dtype == dtype
        # bf16: the kernels round act to bf16 between the products (the reference keeps it in fp32)
        scale = float(want.float().abs().max())
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert float((got.float() - want.float()).abs().max()) <= tol * scale


def test_opcheck():
    for kernel in ("int8", "int4", "fp8", "int4_a8"):
        args, _, _ = _case(kernel, seed=30, tokens=3)
        # fp8: test_schema compares inputs with ops that have no float8 CPU kernel (as test_quant.py's)
        utils = (("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if kernel == "fp8"
                 else ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
        torch.library.opcheck(torch.ops.qwen.fused_moe_quant.default, args, test_utils=utils)


def test_argument_errors_name_the_argument():
    args, _, _ = _case("int4", seed=4, tokens=3)
    x, w13, s13, z13, w2, s2, z2, weights, ids, kernel, block_k = args

    def call(**changes):
        names = ("hidden_states", "w13", "w13_scales", "w13_zeros", "w2", "w2_scales", "w2_zeros", "topk_weights",
                 "topk_ids", "kernel", "block_k")
        values = dict(zip(names, args))
        values.update(changes)
        return torch.ops.qwen.fused_moe_quant(*values.values())

    with pytest.raises(ValueError, match="kernel = 'int3'"):
        call(kernel="int3")
    with pytest.raises(ValueError, match="w13 has shape .* dtype torch.int8, expected torch.uint8"):
        call(w13=w13.to(torch.int8))
    with pytest.raises(ValueError, match="w13_zeros is None, expected uint8"):
        call(w13_zeros=None)
    with pytest.raises(ValueError, match="w2 has shape"):
        call(w2=w2[:, :-1])
    with pytest.raises(ValueError, match="w2_scales has 3 groups"):
        call(w2_scales=torch.rand(E, H, 3), w2_zeros=torch.zeros(E, H, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="block_k = 16, expected 0"):
        call(block_k=16)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 0\] = 9"):
        call(topk_ids=torch.full_like(ids, 9))
    with pytest.raises(ValueError, match="w13_scales has shape .* expected a contiguous"):
        call(w13_scales=s13.transpose(1, 2).contiguous().transpose(1, 2))
    # the op is intact after the errors
    assert torch.isfinite(call()).all()


# ------------------------------------------------------------------------------------------------
# Checkpoints: experts stored per expert in each format, and online quantization
# ------------------------------------------------------------------------------------------------

MOE = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
           num_hidden_layers=2)
GROUP = 16
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", "qwen3_moe", seed=5, **MOE)


def _quantize(w: torch.Tensor, method: str, bits: int, prefix: str):
    """The format's file tensors of one weight and its dequantized fp32 value."""
    if method == "fp8":
        return _fp8_tensors(prefix, w, (16, 16))
    if bits == 4:
        q, z, s = _rtn_asym(w, GROUP, 1)
        t = _awq_tensors(prefix, q, z, s) if method == "awq" else _gptq_tensors(prefix, q, z, s, 4, GROUP)
        return t, _dequant(q, z, s, GROUP)
    n, k = w.shape
    s = (w.view(n, k // GROUP, GROUP).abs().amax(-1) / 127).clamp(min=1e-4).half()
    q = torch.clamp(torch.round(w / s.float().repeat_interleave(GROUP, 1)), -127, 127).to(torch.int64) + 128
    z = torch.full_like(s, 128, dtype=torch.int64)
    return _gptq_tensors(prefix, q, z, s, 8, GROUP), _dequant(q, z, s, GROUP)


def write_quantized_moe(src: Path, dst: Path, method: str, bits: int):
    """``src``'s experts (one tensor per expert in its file) and attention projections stored in
    ``method``'s layout; returns (dst, the transformers model of src with those weights dequantized,
    {tensor prefix: dequantized weight})."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    tensors, dequant = {}, {}
    for name in list(state):
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and (".mlp.experts." in name or prefix.endswith(ATTENTION)):
            t, d = _quantize(state.pop(name), method, bits, prefix)
            tensors.update(t)
            dequant[prefix] = d
    tensors.update(state)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
        if method == "fp8" else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False, "sym": bits == 8,
         "checkpoint_format": "gptq"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst, _dequantized_hf(src, dequant), dequant


def _dequantized_hf(src: Path, dequant: dict):
    """transformers' model of ``src`` with the given weights (per-expert names too) replaced."""
    hf = load_hf(src)
    with torch.no_grad():
        for prefix, d in dequant.items():
            head, sep, rest = prefix.partition(".mlp.experts.")
            if not sep:
                hf.get_submodule(prefix).weight.copy_(d)
                continue
            e, proj = rest.split(".")
            experts = hf.get_submodule(head + ".mlp.experts")
            if proj == "down_proj":
                experts.down_proj[int(e)].copy_(d)
            else:
                half = experts.gate_up_proj.shape[1] // 2
                rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
                experts.gate_up_proj[int(e), rows].copy_(d)
    return hf


def _expert_weights(layer: Q.QuantMoeExperts, e: int, buffer: str) -> torch.Tensor:
    """Expert e's ``w13`` / ``w2`` dequantized by the op's layout (the reference's dequantizers)."""
    w, s = getattr(layer, buffer)[e], getattr(layer, buffer + "_scales")[e]
    if layer.scheme == "int4":
        return RQ.dequantize_int4(w, s, getattr(layer, buffer + "_zeros")[e])
    if layer.scheme == "int8":
        return RQ.dequantize_int8(w, s)
    return RQ.dequantize_fp8(w, s, 1, layer.block_k)


FORMATS = [("awq", 4), ("gptq", 4), ("gptq", 8), ("fp8", 8)]


@pytest.mark.parametrize("method,bits", FORMATS, ids=[f"{m}{b}" for m, b in FORMATS])
def test_moe_checkpoint_loads_bit_for_bit_and_matches_transformers(method, bits, moe_ckpt, tmp_path):
    path, hf, dequant = write_quantized_moe(moe_ckpt, tmp_path / "q", method, bits)
    model = load_model(path)
    scheme = "fp8" if method == "fp8" else ("int4" if bits == 4 else "int8")
    for layer_idx in range(MOE["num_hidden_layers"]):
        experts = model.get_submodule(f"model.layers.{layer_idx}.mlp.experts")
        assert isinstance(experts, Q.QuantMoeExperts) and experts.kernel == scheme
        for e in range(MOE["num_experts"]):
            p = f"model.layers.{layer_idx}.mlp.experts.{e}."
            w13, w2 = _expert_weights(experts, e, "w13"), _expert_weights(experts, e, "w2")
            assert torch.equal(w13, torch.cat([dequant[p + "gate_proj"], dequant[p + "up_proj"]]))
            assert torch.equal(w2, dequant[p + "down_proj"])
    assert Q.describe(model)["model.layers.0.mlp.experts"] == scheme
    model.process_weights_after_loading()
    ids = [5, 17, 2, 60, 33, 9, 41, 8, 77, 1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids), want, rtol=1e-4, atol=1e-4)
    prompts = [[5, 17, 2, 60], [33, 9, 41]]
    assert greedy_generate(model, prompts, 8) == [hf_greedy(hf, p, 8) for p in prompts]


def test_llm_serves_a_gptq_moe_checkpoint_eager_and_compiled(moe_ckpt, tmp_path):
    """Eager and compiled. The compiled MoE engine starts after a compiled dense engine in the same
    process (no ``torch._dynamo.reset()``): each engine compiles its own code object
    (``runner._own_code``); sharing one, the MoE model ran the dense model's graph and failed."""
    from qwen_ops import LLM, SamplingParams
    from qwen_tiny import save_tiny_checkpoint

    path, hf, _ = write_quantized_moe(moe_ckpt, tmp_path / "q", "gptq", 4)
    prompts = [[5, 17, 2, 60], [33, 9, 41]]
    want = [hf_greedy(hf, p, 6) for p in prompts]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    dense = save_tiny_checkpoint(tmp_path / "dense", "qwen3", seed=2, vocab_size=128, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    first = LLM(str(dense), max_num_seqs=2, max_model_len=32, compile=True)
    dense_tokens = [o.outputs[0].token_ids for o in first.generate(prompts, sp)]
    for compile_ in (False, True):
        llm = LLM(str(path), max_num_seqs=2, max_model_len=32, compile=compile_)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want, compile_
    # and the first engine still runs its own graphs
    assert [o.outputs[0].token_ids for o in first.generate(prompts, sp)] == dense_tokens


@pytest.mark.parametrize("method", ["int8", "w8a8", "fp8"])
@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "stacked"])
def test_online_quantization_of_the_experts(method, original_format, tmp_path):
    """Every expert quantized as it is read, from either checkpoint layout: each weight within the
    scheme's bound of the original, and the model's logits equal to transformers' on the model with
    the loaded experts and projections dequantized (a8: its activations quantized as the contract
    says, so the tokens are compared with the kernels' own reference instead)."""
    src = make_moe_checkpoint(tmp_path / "m", "qwen3_moe", seed=6, original_format=original_format, **MOE)
    model = load_model(src, quantization=method)
    hf = load_hf(src)
    kernel = {"int8": "int8", "w8a8": "int8_a8", "fp8": "fp8"}[method]
    bound = 0.5 / 127 if method != "fp8" else 2.0 ** -4    # half an int8 step of the row max; e4m3's 3 mantissa bits
    dequant = {}
    for layer_idx in range(MOE["num_hidden_layers"]):
        name = f"model.layers.{layer_idx}.mlp.experts"
        experts = model.get_submodule(name)
        assert isinstance(experts, Q.QuantMoeExperts) and experts.kernel == kernel
        original = hf.get_submodule(name)
        for e in range(MOE["num_experts"]):
            for buffer, want in (("w13", original.gate_up_proj[e]), ("w2", original.down_proj[e])):
                got = _expert_weights(experts, e, buffer)
                scale = want.abs().amax(dim=1, keepdim=True) if method != "fp8" else want.abs().max()
                assert bool(((got - want).abs() <= bound * scale + 1e-7).all()), (name, e, buffer)
            half = MOE["moe_intermediate_size"]
            w13 = _expert_weights(experts, e, "w13")
            dequant[f"{name}.{e}.gate_proj"], dequant[f"{name}.{e}.up_proj"] = w13[:half], w13[half:]
            dequant[f"{name}.{e}.down_proj"] = _expert_weights(experts, e, "w2")
        for proj in ATTENTION:
            layer = model.get_submodule(f"model.layers.{layer_idx}.{proj}")
            dequant[f"model.layers.{layer_idx}.{proj}"] = (RQ.dequantize_fp8(layer.qweight, layer.scales, *layer.block)
                                                          if method == "fp8" else
                                                          RQ.dequantize_int8(layer.qweight, layer.scales))
    if isinstance(model.lm_head, Q.QuantLinear):          # online int8 quantizes the LM head too
        dequant["lm_head"] = RQ.dequantize_int8(model.lm_head.qweight, model.lm_head.scales)
    model.process_weights_after_loading()
    ids = [5, 17, 2, 60, 33, 9, 41, 8]
    got = _all_logits(model, ids)
    if method == "w8a8":
        for m in model.modules():
            if isinstance(m, Q.QuantLinear):
                m.use_references()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Q.QuantMoeExperts, "forward", lambda self, x, w, i: RQ.fused_moe_quant_reference(
                x, self.w13, self.w13_scales, self.w13_zeros, self.w2, self.w2_scales, self.w2_zeros, w, i,
                self.kernel, self.block_k))
            torch.testing.assert_close(got, _all_logits(model, ids), rtol=1e-5, atol=1e-5)
        return
    twin = _dequantized_hf(src, dequant)
    with torch.no_grad():
        want = twin(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_act_order_experts_and_misshaped_expert_tensors_are_named(moe_ckpt, tmp_path):
    path, _, _ = write_quantized_moe(moe_ckpt, tmp_path / "q", "gptq", 4)
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    name = "model.layers.1.mlp.experts.2.up_proj.g_idx"
    tensors[name] = torch.randperm(MOE["hidden_size"], generator=torch.Generator().manual_seed(0)).to(torch.int32) // GROUP
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj has act-order groups"):
        load_model(path)
    tensors[name] = torch.arange(MOE["hidden_size"], dtype=torch.int32) // GROUP
    bad = "model.layers.0.mlp.experts.3.down_proj.scales"
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.3\.down_proj\.scales' has shape"):
        load_model(path)
