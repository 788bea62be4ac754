"""The fp8 KV cache (issue 42 item 4): kv_write into float8_e4m3fn / float8_e5m2 caches and
slot_attention / attention_block reading them, on every backend, against oracles written here in
plain torch (quantize: fp32 division, clamp, torch's own ``.to(fp8)``; dequantize: ``float(q) * scale``),
never the package's ``kv_quant`` helpers; the reference op against a float64 loop over the
dequantized cache. Then the engine: the cache's dtype and the blocks a budget buys, checkpoint
scales, ``calculate_kv_scales`` against transformers' own keys and values, and greedy output
against transformers with the same quantize/dequantize applied to its cache.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import qwen_ops
from qwen_ops.ops import backend as backend_mod
from qwen_ops.ops.kernels.reference import slot_attention_reference
from qwen_ops.ops.kernels.reference_fused import attention_block_reference
from test_ops import FLASH_CASES, SCENARIOS, Seq, loop_oracle_attention, make_attention_case, poison_allocator
from tolerances import assert_attention_close

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _ids(value) -> str:
    return str(value).removeprefix("torch.")


def plain_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The oracle's quantization: fp32 division by the scale, clamp to the finite range, torch's rounding."""
    m = torch.finfo(dtype).max
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-m, m).to(dtype)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values that probe a conversion: every finite fp8 value, each midpoint between neighbours
    (a tie, rounded to the even code) and the fp32 values just either side of it, both signs, zeros,
    and values past the largest (saturate)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    vals = torch.unique(codes[torch.isfinite(codes)]).double()
    pos = vals[vals >= 0]
    mids = ((pos[1:] + pos[:-1]) / 2).float()
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, float("inf"))),
                      torch.nextafter(mids, torch.zeros_like(mids)), pos.float()])
    big = torch.tensor([torch.finfo(dtype).max * 1.01, torch.finfo(dtype).max * 1.2, 1e30, float("inf")])
    out = torch.cat([near, -near, big, -big, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    return out


# --------------------------------------------------------------------------------------------
# kv_write
# --------------------------------------------------------------------------------------------

def _kv_write_case(values: torch.Tensor, dtype: torch.dtype, fp8: torch.dtype, device, seed: int):
    """kv_write arguments writing ``values`` (padded with randn) as keys and 0.37 x them as values,
    over caches of random bytes; tokens scattered over random blocks, a padding token among them."""
    gen = torch.Generator().manual_seed(seed)
    nk, D, bs = 2, 32, 4
    per_token = nk * D
    T = -(-values.numel() // per_token) + 1
    flat = torch.randn(T * per_token, generator=gen) * 5
    flat[:values.numel()] = values
    key = flat.view(T, nk, D).to(dtype)
    value = (0.37 * flat).view(T, nk, D).to(dtype)
    num_blocks = T // bs + 8
    table = torch.randperm(num_blocks, generator=gen)[: 2 * (num_blocks // 2)].view(2, -1).to(torch.int32)
    slots = torch.tensor([i % 2 for i in range(T)], dtype=torch.int32)
    slots[T // 2] = -1
    positions = torch.tensor([i // 2 for i in range(T)], dtype=torch.int32)
    storage = [torch.randint(0, 256, (num_blocks, bs, nk, D), generator=gen, dtype=torch.uint8) for _ in range(2)]
    storage = [s.masked_fill(s.view(fp8).float().isnan(), 0) for s in storage]   # junk, but no NaN codes
    return (key.to(device), value.to(device), slots.to(device), positions.to(device), table.to(device)), storage


def _oracle_write(key, value, cache_k, cache_v, slots, positions, table, k_scale, v_scale, fp8):
    bs = cache_k.shape[1]
    for i in range(key.shape[0]):
        s = int(slots[i])
        if s < 0:
            continue
        p = int(positions[i])
        b = int(table[s, p // bs])
        cache_k[b, p % bs] = plain_quantize(key[i].cpu(), k_scale, fp8).view(torch.uint8)
        cache_v[b, p % bs] = plain_quantize(value[i].cpu(), v_scale, fp8).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_ids)
@pytest.mark.parametrize("fp8", FP8, ids=_ids)
def test_kv_write_fp8_matches_plain_torch(backend, fp8, dtype, device):
    """Every byte of the cache storage (written rows and the junk around them) equals the plain-torch
    oracle's: round to nearest even with ties, saturation past the largest value, subnormals, signs."""
    values = edge_values(fp8)
    if dtype != torch.float32:      # values the source dtype holds (the oracle and the op read the same)
        values = values.to(dtype).float()
    for k_scale, v_scale in ((1.0, 1.0), (0.0371, 2.5)):
        (key, value, slots, positions, table), storage = _kv_write_case(values, dtype, fp8, device, seed=3)
        expected = [s.clone() for s in storage]
        _oracle_write(key, value, expected[0], expected[1], slots.cpu(), positions.cpu(), table.cpu(), k_scale,
                      v_scale, fp8)
        assert not torch.equal(expected[0], storage[0]), "nothing was written: the test would be vacuous"
        caches = [s.clone().to(device).view(fp8) for s in storage]
        scales = [torch.tensor([s], dtype=torch.float32, device=device) for s in (k_scale, v_scale)]
        with qwen_ops.use_backend(backend):
            torch.ops.qwen.kv_write(key, value, caches[0], caches[1], slots, positions, table, *scales)
        for got, want in zip(caches, expected):
            got = got.view(torch.uint8).cpu()
            bad = (got != want).nonzero()
            assert bad.numel() == 0, (f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
                                      f"{int(got[tuple(bad[0])])} != {int(want[tuple(bad[0])])}")


def test_kv_write_fp8_scale_none_is_one(device):
    (key, value, slots, positions, table), storage = _kv_write_case(torch.randn(64) * 100, torch.float32,
                                                                    torch.float8_e4m3fn, device, seed=4)
    a = [s.clone().to(device).view(torch.float8_e4m3fn) for s in storage]
    b = [s.clone().to(device).view(torch.float8_e4m3fn) for s in storage]
    one = torch.ones(1, device=device)
    torch.ops.qwen.kv_write(key, value, a[0], a[1], slots, positions, table)
    torch.ops.qwen.kv_write(key, value, b[0], b[1], slots, positions, table, one, one)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------
# slot_attention over fp8 caches
# --------------------------------------------------------------------------------------------

def _fp8_case(scenario, fp8, qdtype, device, *, group=2, head_dim=64, block_size=16, gate=False, seed=0,
              k_scale=0.05, v_scale=0.02):
    """An attention case (test_ops.make_attention_case: NaN at every position no sequence may read,
    junk block ids, NaN padding rows) whose caches are quantized by the plain-torch oracle, with the
    dequantized fp32 caches beside them for the loop oracle."""
    case = make_attention_case(scenario, dtype=torch.float32, device=device, group=group, num_kv_heads=2,
                               head_dim=head_dim, block_size=block_size, gate=gate, seed=seed, layout="contiguous")
    kc = plain_quantize(case.key_cache.cpu() * 3, k_scale, fp8).to(device)
    vc = plain_quantize(case.value_cache.cpu(), v_scale, fp8).to(device)
    query = case.query.to(qdtype)
    quantized = dataclasses.replace(case, query=query, key_cache=kc, value_cache=vc,
                                    gate=None if case.gate is None else case.gate.to(qdtype))
    dequantized = dataclasses.replace(case, query=query, key_cache=kc.float() * k_scale, value_cache=vc.float() * v_scale,
                                      gate=quantized.gate)
    scales = (torch.tensor([k_scale], device=device), torch.tensor([v_scale], device=device))
    return quantized, dequantized, scales


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("fp8", FP8, ids=_ids)
@pytest.mark.parametrize("scenario", ["decode", "mixed", "chunk", "padding"])
def test_reference_fp8_matches_loop_oracle(scenario, fp8, qdtype, device):
    q8, deq, scales = _fp8_case(SCENARIOS[scenario], fp8, qdtype, device, gate=True, seed=5)
    out = slot_attention_reference(*q8.args(), *scales)
    assert not out.isnan().any(), "the reference read a position it must not read"
    exact = loop_oracle_attention(deq)
    tol = 2e-5 if qdtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double().cpu(), exact, atol=tol, rtol=tol)


def _check_fp8_attention(backend, quantized, scales, qdtype):
    expected = slot_attention_reference(*quantized.args(), *scales)
    assert not expected.isnan().any()
    poison_allocator(quantized.query)
    with qwen_ops.use_backend(backend):
        out = torch.ops.qwen.slot_attention(*quantized.args(), *scales)
    assert out.dtype == qdtype
    assert_attention_close(out, expected, qdtype, msg=f"backend {backend}")
    return out


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("fp8", FP8, ids=_ids)
@pytest.mark.parametrize("scenario", ["decode", "mixed", "padding"])
def test_slot_attention_fp8_backends(backend, scenario, fp8, qdtype, device):
    q8, _, scales = _fp8_case(SCENARIOS[scenario], fp8, qdtype, device, gate=True, block_size=3, seed=6)
    _check_fp8_attention(backend, q8, scales, qdtype)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("fp8", FP8, ids=_ids)
@pytest.mark.parametrize("case_name", list(FLASH_CASES))
def test_slot_attention_fp8_cpu_flash(case_name, fp8, qdtype, group):
    """The CPU kernel's flash path (prompts and chunks crossing key blocks and pages, beside decode
    rows and padding) over fp8 pages, widened to the query's dtype first; one thread and two alike."""
    reason = backend_mod.why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    q8, _, scales = _fp8_case(FLASH_CASES[case_name], fp8, qdtype, torch.device("cpu"), group=group,
                              head_dim=64 if group != 3 else 80, gate=group == 3, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _check_fp8_attention("cpu", q8, scales, qdtype)
        torch.set_num_threads(2)
        with qwen_ops.use_backend("cpu"):
            two = torch.ops.qwen.slot_attention(*q8.args(), *scales)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_slot_attention_fp8_long_decode_cpu():
    """Decode rows over 300 fp8 keys (the row path's vector reads, head dim 128) on the cpu backend."""
    reason = backend_mod.why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    seqs = (Seq(0, 299, 1), Seq(-1, 0, 1), Seq(2, 150, 1))
    for fp8 in FP8:
        q8, _, scales = _fp8_case(seqs, fp8, torch.bfloat16, torch.device("cpu"), head_dim=128, seed=8)
        _check_fp8_attention("cpu", q8, scales, torch.bfloat16)


def test_fp8_attention_differs_from_ignoring_the_scales(device):
    """Not vacuous: reading the cache with the scales left out (1.0) gives another answer."""
    q8, _, scales = _fp8_case(SCENARIOS["mixed"], torch.float8_e4m3fn, torch.float32, device, seed=9)
    right = slot_attention_reference(*q8.args(), *scales)
    wrong = slot_attention_reference(*q8.args())
    assert (right - wrong).abs().max() > 1e-2


def test_attention_block_fp8_cpu_matches_reference():
    """The CPU fast path's fused op (its own kv write and attention calls) on fp8 caches: the cache
    bytes equal the reference op's, the output within the dtype's attention tolerance."""
    reason = backend_mod.why_unavailable("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(11)
    H, nk, D, bs, T = 8, 2, 64, 16, 70
    for fp8 in FP8:
        for dtype in (torch.float32, torch.bfloat16):
            qkv = torch.randn(T, (H + 2 * nk) * D, generator=gen).to(dtype)
            cos_sin = torch.randn(256, D, generator=gen)
            positions = torch.arange(T, dtype=torch.int32)
            table = torch.randperm(12, generator=gen)[:10].view(2, 5).to(torch.int32)
            slots = torch.zeros(T, dtype=torch.int32)
            caches = [torch.zeros(12, bs, nk, D, dtype=fp8) for _ in range(4)]
            meta = (slots, table, torch.tensor([0], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32),
                    torch.tensor([T], dtype=torch.int32))
            scales = (torch.tensor([0.11]), torch.tensor([0.03]))
            qw, kw = (torch.rand(D, generator=gen) + 0.5).to(dtype), (torch.rand(D, generator=gen) + 0.5).to(dtype)
            want = attention_block_reference(qkv, qw, kw, 1e-6, cos_sin, positions, caches[0], caches[1], *meta,
                                             D ** -0.5, T, H, *scales)
            got = torch.ops.qwen.attention_block(qkv, qw, kw, 1e-6, cos_sin, positions, caches[2], caches[3], *meta,
                                                 D ** -0.5, T, H, *scales)
            assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
            assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
            assert_attention_close(got.view(T, H, D), want.view(T, H, D), dtype)


@pytest.mark.parametrize("make, message", [
    (lambda: torch.tensor([1.0], dtype=torch.float64), "k_scale has dtype torch.float64"),
    (lambda: torch.ones(2), "k_scale has dtype torch.float32 and shape (2,)"),
])
def test_fp8_scales_are_validated(make, message):
    q8, _, (k_scale, v_scale) = _fp8_case(SCENARIOS["decode"], torch.float8_e4m3fn, torch.float32,
                                          torch.device("cpu"), seed=12)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        torch.ops.qwen.slot_attention(*q8.args(), make(), v_scale)


def test_fp8_cache_rejects_an_int8_cache():
    q8, _, scales = _fp8_case(SCENARIOS["decode"], torch.float8_e4m3fn, torch.float32, torch.device("cpu"), seed=13)
    bad = dataclasses.replace(q8, key_cache=q8.key_cache.view(torch.int8), value_cache=q8.value_cache.view(torch.int8))
    with pytest.raises(ValueError, match="key_cache has dtype torch.int8"):
        torch.ops.qwen.slot_attention(*bad.args(), *scales)


# --------------------------------------------------------------------------------------------
# The engine with kv_cache_dtype="fp8": transformers with its cache quantized the same way is the oracle
# --------------------------------------------------------------------------------------------

K_SCALES = (0.02, 0.035)      # per layer: coarse enough that the quantization changes the answer
V_SCALES = (0.015, 0.01)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """A tiny random Qwen3 checkpoint, and a copy whose files carry per-layer k_scale / v_scale
    tensors (the compressed-tensors spelling: ``model.layers.N.self_attn.k_scale``)."""
    from safetensors.torch import load_file, save_file

    from checkpoints import make_qwen3_checkpoint

    plain = make_qwen3_checkpoint(tmp_path_factory.mktemp("fp8") / "plain", seed=3)
    scaled = tmp_path_factory.mktemp("fp8") / "scaled"
    scaled.mkdir()
    for f in plain.iterdir():
        if f.name != "model.safetensors":
            (scaled / f.name).write_bytes(f.read_bytes())
    tensors = load_file(plain / "model.safetensors")
    for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})
    return plain, scaled


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _fake_quant(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    return plain_quantize(x, scale, fp8).float() * scale


@torch.no_grad()
def hf_greedy_fp8(hf, prompt, n, fp8=None, scales=None):
    """transformers' greedy loop; with ``fp8``, every key and value it caches goes through the plain-torch
    quantize / dequantize first (vLLM's semantics: the attention reads the cache, its own token included).
    ``scales``: per layer (k_scale, v_scale); a dict is filled as vLLM's calculate_kv_scales would, from
    each layer's first keys and values (amax / 200, amax / 100)."""
    from transformers import DynamicCache

    class FakeQuantCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if fp8 is not None:
                if isinstance(scales, dict) and layer_idx not in scales:
                    scales[layer_idx] = (float(key_states.abs().max()) / 200, float(value_states.abs().max()) / 100)
                ks, vs = scales[layer_idx]
                key_states, value_states = _fake_quant(key_states, ks, fp8), _fake_quant(value_states, vs, fp8)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    cache = FakeQuantCache(config=hf.config)
    ids = torch.tensor([list(prompt)])
    out = []
    for _ in range(n):
        logits = hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids = torch.tensor([[tok]])
    return out


PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 23, 77, 11, 5, 90], [7, 7, 31, 64, 2, 119, 54, 33], list(range(10, 70))]


def _llm(path, **kw):
    from qwen_ops.serving.llm import LLM

    return LLM(str(path), **{"max_num_seqs": 4, "max_model_len": 256, **kw})


def _greedy(llm, prompts, n=12):
    from qwen_ops.engine.sampling import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0.0,
                                                                                  ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("fp8_name, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_engine_fp8_matches_transformers_with_a_quantized_cache(fp8_ckpt, fp8_name, fp8):
    """Greedy tokens equal transformers' whose cache is quantized by the oracle with the checkpoint's
    scales, and (so the check has teeth) transformers without the quantization answers otherwise."""
    plain, scaled = fp8_ckpt
    hf = _hf(plain)
    llm = _llm(scaled, kv_cache_dtype=fp8_name)
    caches = llm.engine.runner.kv_caches
    assert all(t.dtype == fp8 for pair in caches for t in pair)
    got = _greedy(llm, PROMPTS)
    scales = list(zip(K_SCALES, V_SCALES))
    want = [hf_greedy_fp8(hf, p, 12, fp8, scales) for p in PROMPTS]
    assert got == want
    assert want != [hf_greedy_fp8(hf, p, 12) for p in PROMPTS], "the quantization changed nothing: vacuous"


def test_checkpoint_scales_are_loaded(fp8_ckpt):
    from qwen_ops.models.loader import load_checkpoint

    plain, scaled = fp8_ckpt
    layers = load_checkpoint(scaled).model.model.layers
    assert [float(l.self_attn.k_scale) for l in layers] == pytest.approx(K_SCALES)
    assert [float(l.self_attn.v_scale) for l in layers] == pytest.approx(V_SCALES)
    assert all(l.self_attn.k_scale.dtype == torch.float32 for l in layers)
    layers = load_checkpoint(plain).model.model.layers
    assert all(float(l.self_attn.k_scale) == 1.0 == float(l.self_attn.v_scale) for l in layers)


def test_calculate_kv_scales_match_transformers_keys(fp8_ckpt):
    """vLLM's calculate_kv_scales: each layer's scales are amax |k| / 200 and amax |v| / 100 of the first
    batch (keys after RoPE), as measured inside transformers' cache by the oracle, which then quantizes
    with them; the greedy tokens agree too."""
    plain, _ = fp8_ckpt
    llm = _llm(plain, kv_cache_dtype="fp8", calculate_kv_scales=True)
    prompt = PROMPTS[2]
    got = _greedy(llm, [prompt], n=12)[0]
    measured: dict = {}
    want = hf_greedy_fp8(_hf(plain), prompt, 12, torch.float8_e4m3fn, measured)
    for i, layer in enumerate(llm.engine.model.model.layers):
        assert float(layer.self_attn.k_scale) == pytest.approx(measured[i][0], rel=1e-5)
        assert float(layer.self_attn.v_scale) == pytest.approx(measured[i][1], rel=1e-5)
        assert not layer.self_attn.calculate_kv_scales
    assert got == want


def test_fp8_cache_holds_more_tokens_in_the_same_budget(fp8_ckpt):
    plain, _ = fp8_ckpt
    budget = 1 << 20
    blocks = {(dt, kvd): _llm(plain, dtype=dt, kv_cache_dtype=kvd, kv_cache_bytes=budget, max_num_seqs=64
                              ).stats()["total_blocks"]
              for dt in ("float32", "bfloat16") for kvd in ("auto", "fp8")}
    assert blocks[("bfloat16", "fp8")] == 2 * blocks[("bfloat16", "auto")]
    assert blocks[("float32", "fp8")] == 4 * blocks[("float32", "auto")]


def test_fp8_swap_prefix_caching_and_speculation_keep_the_answer(fp8_ckpt):
    """Preemption by swap (a pool too small for the batch), prefix-cache hits and ngram speculation
    give the tokens of an fp8 engine without them."""
    plain, _ = fp8_ckpt
    prompts = [PROMPTS[2], PROMPTS[2][:40] + [3, 4, 5], PROMPTS[0], PROMPTS[1]]
    base = _greedy(_llm(plain, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts, n=24)
    swapped = _llm(plain, kv_cache_dtype="fp8", preemption_mode="swap", num_kv_blocks=16, block_size=8, max_model_len=96,
                   enable_prefix_caching=False)
    assert _greedy(swapped, prompts, n=24) == base
    assert swapped.stats()["num_swaps_out"] > 0, "nothing was swapped: the check would be vacuous"
    cached = _llm(plain, kv_cache_dtype="fp8")
    assert _greedy(cached, prompts[:1], n=24) == base[:1]
    assert _greedy(cached, prompts[1:], n=24) == base[1:]
    assert cached.stats()["prefix_cache_hits"] > 0
    spec = _llm(plain, kv_cache_dtype="fp8", enable_prefix_caching=False,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert _greedy(spec, prompts, n=24) == base


@pytest.mark.parametrize("bad", ["fp16", "int8", None, torch.float8_e4m3fn])
def test_kv_cache_dtype_is_validated_by_name(fp8_ckpt, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype = "):
        _llm(fp8_ckpt[0], kv_cache_dtype=bad)
