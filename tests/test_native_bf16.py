"""The CPU fast path on bf16 models: the layers' ops on bf16 packed weights and bf16 KV caches,
activations rounded to bf16 where the model's plain forward rounds them.

The error-bound rule of the repo (flash-attention's, ``tolerances.assert_within_flash_bound``):
the fast path's distance from the fp32 truth (the same bf16 weights run in fp32, with the same
starting caches) is at most twice that of a same-dtype torch run plus a small floor. The
same-dtype runs are the model's own bf16 forward (the eager op path, ``native_cpu=False``) and
transformers' bf16 model. Covered: Qwen3 (q/k norms) and Qwen2 (q/k/v biases), prefill, decode,
a chunk mixed with a decode, padding, the portable (no AVX-512) build, and the engine's choice.
The packed model is a copy that ran ``process_weights_after_loading()`` (the runner's packing).

On a CPU with AVX512-BF16 the products run as bf16 dot products (``cpu.bf16_products()``),
elsewhere as widening loads into fp32 FMAs: these tests cover whichever this machine runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_ops
from qwen_ops.models.layers import forward_choices
from qwen_ops.ops.kernels import cpu

from qwen_tiny import fresh_library, load_hf, new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata
from tolerances import assert_within_flash_bound

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

# (slot, start position, tokens) per sequence, per step: prefills of 9 and 14 tokens, decodes of
# both, a decode next to a 3-token chunk, and a step with a padding sequence (slot -1).
STEPS = [[(0, 0, 9), (2, 0, 14)], [(0, 9, 1), (2, 14, 1)], [(2, 15, 1), (0, 10, 3)], [(0, 13, 1), (-1, 0, 1)]]
MODEL_TYPES = ["qwen3", "qwen2"]
BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def _needs_cpu_kernels():
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")


def _save(tmp_path, model_type: str, **overrides):
    """A tiny bf16 checkpoint (weights stored in bf16, so the fp32 load is the exact same values)."""
    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return save_tiny_checkpoint(tmp_path / model_type, model_type, dtype=torch.bfloat16, **kwargs)


def _load(path, dtype):
    from qwen_ops.models.loader import load_checkpoint

    return load_checkpoint(path, dtype=dtype).model


def _packed(model):
    fast = copy.deepcopy(model)
    fast.process_weights_after_loading()
    return fast


def _run_steps(forward, config, steps, table, dtype):
    """Logits (fp32) of each step and the caches after them, on caches that start random (the same
    bf16 values for every dtype) and the same random token ids."""
    gen = torch.Generator().manual_seed(21)
    caches = new_kv_caches(config, table.numel() + 1, BLOCK_SIZE, dtype)
    for kc, vc in caches:
        kc.copy_(torch.randn(kc.shape, generator=gen).to(torch.bfloat16))
        vc.copy_(torch.randn(vc.shape, generator=gen).to(torch.bfloat16))
    outs = []
    with torch.inference_mode():
        for chunks in steps:
            pos, attn, last = step_metadata(chunks, table)
            ids = torch.randint(0, config.vocab_size, (int(pos.shape[0]),), generator=gen)
            outs.append(forward(ids, pos, attn, caches, last).float())
    return outs, caches


def _assert_steps_within_bound(got, got_caches, same_dtype, same_dtype_caches, exact, exact_caches) -> None:
    for step, (g, s, e) in enumerate(zip(got, same_dtype, exact, strict=True)):
        assert torch.isfinite(g).all(), f"step {step}: non-finite logits"
        assert_within_flash_bound(g, e, s)
    for g, s, e in zip(got_caches, same_dtype_caches, exact_caches, strict=True):
        for gc, sc, ec in zip(g, s, e):
            assert_within_flash_bound(gc.float(), ec, sc.float())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_native_bf16_matches_the_op_path(model_type, tmp_path):
    """Against the model's own bf16 forward (reference ops), relative to the fp32 truth."""
    path = _save(tmp_path, model_type)
    model = _load(path, torch.bfloat16)
    fast = _packed(model)
    assert set(forward_choices(fast).values()) == {"cpu"}
    assert fast.lm_head_packed.dtype == torch.bfloat16, "bf16 weights are packed as bf16"
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(fast, model.config, STEPS, table, torch.bfloat16)
    with qwen_ops.use_backend("reference"):
        op_path, op_caches = _run_steps(model, model.config, STEPS, table, torch.bfloat16)
        exact, exact_caches = _run_steps(_load(path, torch.float32), model.config, STEPS, table, torch.float32)
    assert all(c.dtype == torch.bfloat16 for pair in got_caches for c in pair)
    assert max((o - e).abs().max() for o, e in zip(op_path, exact)) > 0, "bf16 must differ from fp32 here"
    _assert_steps_within_bound(got, got_caches, op_path, op_caches, exact, exact_caches)
    # On the widening path most logits are bit-identical to the op path's (same roundings at the same
    # points); the rest differ where an fp32 summation order flips a bf16 rounding. With AMX tiles or
    # AVX512-BF16 dot products, the attention's flash path rounds P to bf16 before P V (as
    # flash-attention's bf16 kernels do; issue 42), a rounding the op path does not make, so only the
    # bound above holds there (31% equal, measured on both).
    from qwen_ops.ops.kernels import cpu
    if cpu.bf16_products() == "widening":
        same = sum(int((g == o).sum()) for g, o in zip(got, op_path)) / sum(g.numel() for g in got)
        assert same > 0.5, f"only {same:.0%} of the logits equal the op path's"


def test_native_bf16_moe_matches_the_op_path(tmp_path):
    """qwen3_moe in bf16: the fast ops around the MoE blocks, whose routed experts stay on
    ``fused_moe`` (moe_packed is fp32); within the bound of the op path, relative to the fp32 truth
    (the same bf16 weights in fp32)."""
    from checkpoints import make_moe_checkpoint

    model = _load(make_moe_checkpoint(tmp_path, "qwen3_moe"), torch.bfloat16)
    exact_model = copy.deepcopy(model).float()
    fast = _packed(model)
    choices = forward_choices(fast)
    assert {c for name, c in choices.items() if name.endswith("experts")} == {"native"}, "bf16 experts are not packed"
    assert choices["model.layers.0.self_attn"] == "cpu"
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(fast, model.config, STEPS, table, torch.bfloat16)
    with qwen_ops.use_backend("reference"):
        op_path, op_caches = _run_steps(model, model.config, STEPS, table, torch.bfloat16)
        exact, exact_caches = _run_steps(exact_model, model.config, STEPS, table, torch.float32)
    assert max((o - e).abs().max() for o, e in zip(op_path, exact)) > 0, "bf16 must differ from fp32 here"
    _assert_steps_within_bound(got, got_caches, op_path, op_caches, exact, exact_caches)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_native_bf16_matches_transformers(model_type, tmp_path):
    """Teacher-forced logits of a 16-token sequence (a 6-token prefill, a 3-token chunk, then
    decode steps) against transformers' bf16 and fp32 forwards of the whole sequence."""
    path = _save(tmp_path, model_type)
    model = _packed(_load(path, torch.bfloat16))
    ids = torch.randint(3, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(5))
    table = shuffled_block_table(1, 5)
    caches = new_kv_caches(model.config, table.numel() + 1, BLOCK_SIZE, torch.bfloat16)
    got, done = [], 0
    with torch.inference_mode():
        for n in [6, 3] + [1] * 7:
            pos, attn, _ = step_metadata([(0, done, n)], table)
            rows = torch.arange(n)        # every row's logits
            got.append(model(ids[done:done + n], pos, attn, caches, rows).float())
            done += n
        hf_bf16 = load_hf(path, torch.bfloat16)(ids[None]).logits[0].float()
        exact = load_hf(path, torch.float32)(ids[None]).logits[0]
    got = torch.cat(got)
    assert_within_flash_bound(got, exact, hf_bf16)


def test_portable_build_matches(tmp_path, monkeypatch, portable_library):
    """The C file's AVX-512 paths off (the scalar bf16 products), on shapes off the vector widths
    and an odd inner dim (a bf16 pair without a partner): a build of its own, its kernels registered
    for this test's lifetime."""
    from qwen_tiny import registered_kernels

    path = _save(tmp_path, "qwen3", hidden_size=40, intermediate_size=57, head_dim=16)
    model = _load(path, torch.bfloat16)
    table = shuffled_block_table(3, 5)
    with qwen_ops.use_backend("reference"):
        op_path, op_caches = _run_steps(model, model.config, STEPS, table, torch.bfloat16)
        exact, exact_caches = _run_steps(_load(path, torch.float32), model.config, STEPS, table, torch.float32)
    portable = portable_library
    monkeypatch.setattr(cpu, "library", lambda: portable)
    assert cpu.bf16_products() == "widening"
    with registered_kernels(portable):
        got, got_caches = _run_steps(_packed(model), model.config, STEPS, table, torch.bfloat16)
    _assert_steps_within_bound(got, got_caches, op_path, op_caches, exact, exact_caches)


def test_the_engine_runs_bf16_models_natively(tmp_path):
    """A bf16 engine's layers take the fast ops, with bf16 caches, and its greedy tokens equal the
    op path's (``native_cpu=False``)."""
    from qwen_ops.engine.engine import QwenEngine

    path = _save(tmp_path, "qwen3", max_position_embeddings=256)
    outputs = {}
    for native_cpu in (True, False):
        eng = QwenEngine.from_pretrained(path, dtype=torch.bfloat16, max_slots=2, max_seq_len=64,
                                         native_cpu=native_cpu)
        assert set(forward_choices(eng.model).values()) == {"cpu" if native_cpu else "native"}
        assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16
        tokens = [eng.prefill([5, 6, 7, 8], slot_id=0).next_token]
        for _ in range(8):
            tokens.append(eng.decode_step(tokens[-1], slot_id=0).next_token)
        outputs[native_cpu] = tokens
    assert outputs[True] == outputs[False]


def test_mixed_dtypes_keep_the_plain_forward(tmp_path):
    """A model whose parameters mix dtypes keeps every layer on its plain forward (the ops take one
    dtype), and still runs."""
    model = _load(_save(tmp_path, "qwen3"), torch.bfloat16)
    mixed = copy.deepcopy(model)
    mixed.model.norm.float()
    mixed.process_weights_after_loading()
    assert set(forward_choices(mixed).values()) == {"native"}
    assert set(forward_choices(_packed(model)).values()) == {"cpu"}


@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_every_bf16_product_path_matches_float64(tmp_path, monkeypatch, rows):
    """The three ways of a bf16 product, each forced (``QWEN_OPS_BF16_PRODUCTS``) in a fresh load of the
    library: AMX tiles and AVX512-BF16 dot products (each only where the CPU has it; elsewhere the mode
    falls back to widening) and widening loads into fp32 FMAs, against float64 on bf16 inputs (whose
    products are exact: only the fp32 sums round), with one and two threads, through the fp32-input
    entry and the op's bf16 one (rounded once to bf16). K = 200 leaves a partial AMX tile of pairs,
    N = 70 a partial panel. Which one the engine runs is the CPU's choice (``cpu.bf16_products()``:
    AMX where the CPU has it; else dot products only where they beat widening: this Intel Xeon's
    issue at a quarter of its FMA rate)."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 200
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    packed = cpu.pack_panels(w)
    want = x.double() @ w.double().T + bias.double()
    flags = f" {cpu._cpu_flags()} "
    has = {"amx": 2 if " amx_bf16" in flags and " amx_tile" in flags else 0,
           "dot": 1 if " avx512_bf16" in flags else 0, "widening": 0}
    for mode, code in has.items():
        lib = fresh_library(tmp_path, monkeypatch, QWEN_OPS_BF16_PRODUCTS=mode)
        assert lib.qwen_bf16_products() == code, mode
        for threads in (1, 2):
            y = torch.full((rows, n), float("nan"))
            xf = x.float()
            lib.qwen_linear_packed_bf16(xf.data_ptr(), k, rows, packed.data_ptr(), bias.data_ptr(), n, k, y.data_ptr(),
                                        n, threads)
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
            yb = torch.full((rows, n), float("nan")).bfloat16()
            assert lib.qwen_linear(x.data_ptr(), k, rows, packed.data_ptr(), bias.data_ptr(), n, k, yb.data_ptr(), n, 2,
                                   threads) == 0
            assert torch.equal(yb, y.bfloat16()), (mode, threads)      # the same sums, rounded once


def test_a_rows_bf16_product_does_not_depend_on_its_batch():
    """linear_packed's bf16 product of a row is bit for bit the same alone and in batches of every
    size up to past two blocks of AMX rows (one path for every row count: cpu.bf16_products()), so a
    sequence's tokens do not depend on what it is batched with."""
    g = torch.Generator().manual_seed(7)
    n, k = 96, 160
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    packed = cpu.pack_panels(w)
    x = torch.randn(40, k, generator=g).bfloat16()
    alone = torch.cat([torch.ops.qwen.linear_packed.default(x[i:i + 1], packed, None, n) for i in range(40)])
    torch.testing.assert_close(alone.double(), x.double() @ w.double().T, rtol=0.02, atol=0.02)
    for rows in (2, 7, 16, 17, 33, 40):
        assert torch.equal(torch.ops.qwen.linear_packed.default(x[:rows], packed, None, n), alone[:rows]), rows


@pytest.mark.parametrize("name", ["QWEN_OPS_BF16_PRODUCTS", "QWEN_OPS_INT8_PRODUCTS"])
def test_a_product_setting_out_of_its_values_is_an_error(name, monkeypatch, tmp_path):
    """A misspelt path (``amxx``) is a clear error naming the variable and its values, not a silent
    fall-back to the CPU's choice; the library already loaded keeps working."""
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(name, "amxx")
    with pytest.raises(ValueError, match=rf"{name} = 'amxx', expected one of"):
        cpu.library.__wrapped__()
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    y = torch.ops.qwen.linear_packed.default(x, cpu.pack_panels(w), None, 40)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=0.02, atol=0.02)
