"""The native CPU executor on bf16 models: bf16 packed weights and bf16 KV caches, activations
rounded to bf16 where the model's forward rounds them.

The error-bound rule of the repo (flash-attention's, ``tolerances.assert_within_flash_bound``):
the executor's distance from the fp32 truth (the same bf16 weights run in fp32, with the same
starting caches) is at most twice that of a same-dtype torch run plus a small floor. The
same-dtype runs are the model's own bf16 forward (the eager op path, ``native_cpu=False``) and
transformers' bf16 model. Covered: Qwen3 (q/k norms) and Qwen2 (q/k/v biases), prefill, decode,
a chunk mixed with a decode, padding, the portable (no AVX-512) build, and the engine's choice.

On a CPU with AVX512-BF16 the products run as bf16 dot products (``cpu.bf16_products()``),
elsewhere as widening loads into fp32 FMAs: these tests cover whichever this machine runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_ops
from qwen_ops.engine.executors import NativeCPUExecutor
from qwen_ops.ops.kernels import cpu

from qwen_tiny import load_hf, new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata
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
    executor = NativeCPUExecutor(model)
    assert executor._lm_head.dtype == torch.bfloat16, "bf16 weights are packed as bf16"
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(executor.run, model.config, STEPS, table, torch.bfloat16)
    with qwen_ops.use_backend("reference"):
        op_path, op_caches = _run_steps(model, model.config, STEPS, table, torch.bfloat16)
        exact, exact_caches = _run_steps(_load(path, torch.float32), model.config, STEPS, table, torch.float32)
    assert all(c.dtype == torch.bfloat16 for pair in got_caches for c in pair)
    assert max((o - e).abs().max() for o, e in zip(op_path, exact)) > 0, "bf16 must differ from fp32 here"
    _assert_steps_within_bound(got, got_caches, op_path, op_caches, exact, exact_caches)
    # Most logits are bit-identical to the op path's (same roundings at the same points); the rest
    # differ where an fp32 summation order flips a bf16 rounding.
    same = sum(int((g == o).sum()) for g, o in zip(got, op_path)) / sum(g.numel() for g in got)
    assert same > 0.5, f"only {same:.0%} of the logits equal the op path's"


def test_native_bf16_moe_matches_the_op_path(tmp_path, monkeypatch):
    """qwen3_moe in bf16: the C forward calls back for the MoE blocks, which run as the model's own
    bf16 ``SparseMoeBlock``; within the bound of the op path, relative to the fp32 truth (the same
    bf16 weights in fp32)."""
    from checkpoints import make_moe_checkpoint

    model = _load(make_moe_checkpoint(tmp_path, "qwen3_moe"), torch.bfloat16)
    exact_model = copy.deepcopy(model).float()
    executor = NativeCPUExecutor(model)
    assert executor._experts == [None] * len(model.model.layers), "bf16 experts are not packed"
    calls = []
    real = cpu.dense_forward
    monkeypatch.setattr(cpu, "dense_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(executor.run, model.config, STEPS, table, torch.bfloat16)
    monkeypatch.setattr(cpu, "dense_forward", real)
    assert len(calls) == len(STEPS)
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
    model = _load(path, torch.bfloat16)
    executor = NativeCPUExecutor(model)
    ids = torch.randint(3, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(5))
    table = shuffled_block_table(1, 5)
    caches = new_kv_caches(model.config, table.numel() + 1, BLOCK_SIZE, torch.bfloat16)
    got, done = [], 0
    with torch.inference_mode():
        for n in [6, 3] + [1] * 7:
            pos, attn, _ = step_metadata([(0, done, n)], table)
            rows = torch.arange(n)        # every row's logits (the C code normalizes only these)
            got.append(executor.run(ids[done:done + n], pos, attn, caches, rows))
            done += n
        hf_bf16 = load_hf(path, torch.bfloat16)(ids[None]).logits[0].float()
        exact = load_hf(path, torch.float32)(ids[None]).logits[0]
    got = torch.cat(got)
    assert_within_flash_bound(got, exact, hf_bf16)


def test_portable_build_matches(tmp_path, monkeypatch):
    """The C file's AVX-512 paths off (the scalar bf16 products), on shapes off the vector widths
    and an odd inner dim (a bf16 pair without a partner)."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    path = _save(tmp_path, "qwen3", hidden_size=40, intermediate_size=57, head_dim=16)
    model = _load(path, torch.bfloat16)
    table = shuffled_block_table(3, 5)
    with qwen_ops.use_backend("reference"):
        op_path, op_caches = _run_steps(model, model.config, STEPS, table, torch.bfloat16)
        exact, exact_caches = _run_steps(_load(path, torch.float32), model.config, STEPS, table, torch.float32)
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QWEN_OPS_CPU_CFLAGS", "-mno-avx512f")
    portable = cpu.library.__wrapped__()
    monkeypatch.setattr(cpu, "library", lambda: portable)
    assert cpu.bf16_products() == "widening"
    got, got_caches = _run_steps(NativeCPUExecutor(model).run, model.config, STEPS, table, torch.bfloat16)
    _assert_steps_within_bound(got, got_caches, op_path, op_caches, exact, exact_caches)


def test_the_engine_runs_bf16_models_natively(tmp_path, monkeypatch):
    """A bf16 engine takes the native executor for prefill and decode, with bf16 caches, and its
    greedy tokens equal the op path's (``native_cpu=False``)."""
    from qwen_ops.engine.engine import QwenEngine

    path = _save(tmp_path, "qwen3", max_position_embeddings=256)
    calls = []
    native = cpu.dense_forward
    monkeypatch.setattr(cpu, "dense_forward", lambda *a, **k: calls.append(1) or native(*a, **k))
    outputs = {}
    for native_cpu in (True, False):
        eng = QwenEngine.from_pretrained(path, dtype=torch.bfloat16, max_slots=2, max_seq_len=64,
                                         native_cpu=native_cpu)
        assert (eng.runner.native is not None) == native_cpu
        assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16
        tokens = [eng.prefill([5, 6, 7, 8], slot_id=0).next_token]
        for _ in range(8):
            tokens.append(eng.decode_step(tokens[-1], slot_id=0).next_token)
        outputs[native_cpu] = tokens
    assert len(calls) == 9, "every step of the native engine runs the C forward"
    assert outputs[True] == outputs[False]


def test_mixed_dtypes_are_refused(tmp_path):
    model = _load(_save(tmp_path, "qwen3"), torch.bfloat16)
    mixed = copy.deepcopy(model)
    mixed.model.norm.float()
    assert "model.norm.weight is torch.float32" in NativeCPUExecutor.why_not(mixed)
    executor = NativeCPUExecutor(model)
    assert not executor.supports(4, 4, new_kv_caches(model.config, 8, BLOCK_SIZE, torch.float32))
    assert executor.supports(4, 4, new_kv_caches(model.config, 8, BLOCK_SIZE, torch.bfloat16))
