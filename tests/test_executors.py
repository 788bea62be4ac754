"""The native CPU executor against the eager op path (the model's one forward), and the runner's
choice of executor.

Each comparison runs the same steps twice on random caches: once through ``model(...)`` with the
``reference`` op backend (plain torch and the reference ops), once through
``NativeCPUExecutor.run``; logits and caches must agree to fp32 rounding. Outputs are poisoned
(NaN from ``torch.empty``) where the C code allocates them.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import qwen_ops
from qwen_ops.engine.executors import NativeCPUExecutor
from qwen_ops.ops.kernels import cpu

from qwen_tiny import new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata


@pytest.fixture(autouse=True)
def _needs_cpu_kernels():
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")


def _tiny_dense(tmp_path, model_type: str, **overrides):
    from qwen_ops.models.loader import load_checkpoint

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return load_checkpoint(save_tiny_checkpoint(tmp_path / model_type, model_type, **kwargs)).model


def _count_native_calls(monkeypatch) -> list:
    calls = []
    native = cpu.dense_forward
    monkeypatch.setattr(cpu, "dense_forward", lambda *a, **k: calls.append(1) or native(*a, **k))
    return calls


def _run_steps(forward, config, steps, table, block_size=4):
    """The logits of each step and the caches after them. The caches start random: NaN or zeros in
    unwritten rows could hide a wrong read."""
    gen = torch.Generator().manual_seed(21)
    caches = new_kv_caches(config, table.numel() + 1, block_size, torch.float32)
    for kc, vc in caches:
        kc.copy_(torch.randn(kc.shape, generator=gen))
        vc.copy_(torch.randn(vc.shape, generator=gen))
    outs = []
    with torch.inference_mode():
        for chunks in steps:
            pos, attn, last = step_metadata(chunks, table)
            ids = torch.randint(0, config.vocab_size, (int(pos.shape[0]),), generator=gen)
            outs.append(forward(ids, pos, attn, caches, last))
    return outs, caches


def _op_path(model, steps, table):
    with qwen_ops.use_backend("reference"):
        return _run_steps(model, model.config, steps, table)


def _assert_same_steps(got, got_caches, want, want_caches) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


@pytest.fixture
def poisoned_empty(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    return monkeypatch


# (slot, start position, tokens) per sequence, per step: prefills of 9 and 14 tokens, decodes of
# both, a decode next to a 3-token chunk, and a step with a padding sequence (slot -1).
NATIVE_STEPS = [[(0, 0, 9), (2, 0, 14)], [(0, 9, 1), (2, 14, 1)], [(2, 15, 1), (0, 10, 3)], [(0, 13, 1), (-1, 0, 1)]]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_native_executor_matches_the_op_path(model_type, tmp_path, monkeypatch, poisoned_empty):
    """Prefill, decode, a chunk mixed with a decode, and padding; Qwen2 has q/k/v biases and no
    q/k norms, Qwen3 the reverse."""
    model = _tiny_dense(tmp_path, model_type)
    executor = NativeCPUExecutor(model)
    calls = _count_native_calls(monkeypatch)
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(executor.run, model.config, NATIVE_STEPS, table)
    assert len(calls) == len(NATIVE_STEPS)
    poisoned_empty.undo()
    want, want_caches = _op_path(model, NATIVE_STEPS, table)
    _assert_same_steps(got, got_caches, want, want_caches)


def test_portable_build_matches(tmp_path, monkeypatch):
    """The C file's AVX-512 paths off: the portable loops, on shapes off the vector widths."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    model = _tiny_dense(tmp_path, "qwen3", hidden_size=40, intermediate_size=56, head_dim=16)
    table = shuffled_block_table(3, 5)
    want, _ = _op_path(model, NATIVE_STEPS, table)
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QWEN_OPS_CPU_CFLAGS", "-mno-avx512f")
    portable = cpu.library.__wrapped__()
    monkeypatch.setattr(cpu, "library", lambda: portable)
    executor = NativeCPUExecutor(model)
    got, _ = _run_steps(executor.run, model.config, NATIVE_STEPS, table)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_what_it_does_not_cover(tmp_path):
    """Models it cannot hold are refused with the reason; steps it cannot run are refused by
    ``supports`` (the runner runs those eagerly)."""
    model = _tiny_dense(tmp_path, "qwen3")
    assert NativeCPUExecutor.why_not(model) is None
    executor = NativeCPUExecutor(model)
    caches = new_kv_caches(model.config, 8, 4, torch.float32)
    assert executor.supports(16, 16, caches)
    assert not executor.supports(cpu.DENSE_FORWARD_MAX_TOKENS + 1, 1, caches)
    assert not executor.supports(200, cpu.REFERENCE_ABOVE_QUERY_LEN + 1, caches)
    with qwen_ops.use_backend("reference"):
        assert not executor.supports(16, 16, caches)
    assert not executor.supports(16, 16, new_kv_caches(model.config, 8, 4, torch.bfloat16)), "caches in another dtype"
    assert NativeCPUExecutor.why_not(copy.deepcopy(model).to(torch.bfloat16)) is None   # tests/test_native_bf16.py
    half = copy.deepcopy(model).to(torch.float16)
    assert "float32, or every weight bfloat16" in NativeCPUExecutor.why_not(half)
    with pytest.raises(ValueError, match="cannot run this model: .*float16"):
        NativeCPUExecutor(half)
    mixed = copy.deepcopy(model)
    mixed.model.layers[1].mlp.to(torch.bfloat16)
    assert "model.layers.1.mlp.gate_proj.weight is torch.bfloat16" in NativeCPUExecutor.why_not(mixed)
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(64, 96, bias=True)
    assert "MLP" in NativeCPUExecutor.why_not(model)


def test_more_threads_same_results(tmp_path):
    """With two intra-op threads the executor still runs (its products split across them where
    the library has OpenMP), and every logit and cache entry is bit-identical to one thread's:
    each output is summed by one thread in one order."""
    model = _tiny_dense(tmp_path, "qwen3", hidden_size=64, intermediate_size=320)   # 10 panels to split
    executor = NativeCPUExecutor(model)
    table = shuffled_block_table(3, 5)
    assert executor.supports(16, 16, new_kv_caches(model.config, 8, 4, torch.float32))
    one, one_caches = _run_steps(executor.run, model.config, NATIVE_STEPS, table)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert executor.supports(16, 16, new_kv_caches(model.config, 8, 4, torch.float32))
        two, two_caches = _run_steps(executor.run, model.config, NATIVE_STEPS, table)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.equal(a, b) for pa, pb in zip(one_caches, two_caches) for a, b in zip(pa, pb))


@pytest.mark.parametrize("tokens", [1, 9])
def test_bad_metadata_raises_before_anything_is_written(tokens, tmp_path):
    """Bad slot ids, block ids, row indices or positions raise the ops' errors; caches unchanged."""
    model = _tiny_dense(tmp_path, "qwen3", max_position_embeddings=64)
    executor = NativeCPUExecutor(model)
    table = shuffled_block_table(2, 20)                         # 80 positions a slot, past the RoPE table
    caches = new_kv_caches(model.config, table.numel() + 1, 4, torch.float32)
    for kc, vc in caches:
        kc.normal_()
        vc.normal_()
    before = [(kc.clone(), vc.clone()) for kc, vc in caches]
    pos, attn, last = step_metadata([(0, 3, tokens), (1, 5, tokens)], table)
    ids = torch.arange(2 * tokens) + 5
    bad_slot_ids = attn.slot_ids.clone()
    bad_slot_ids[-1] = 2
    far = step_metadata([(0, 64, 1)], table)                    # position 64 of a 64-entry RoPE table
    cases = [
        (ids, pos, dataclasses.replace(attn, slot_ids=bad_slot_ids), last, ValueError, "slot_ids"),
        (ids, pos, dataclasses.replace(attn, block_table=table.clone().fill_(999)), last, ValueError, "block_table"),
        (ids, pos, attn, torch.tensor([0, 2 * tokens]), IndexError, "index"),
        (torch.tensor([3]), far[0], far[1], far[2], ValueError, "max_position_embeddings = 64"),
    ]
    for bad_ids, bad_pos, bad_attn, rows, exc, name in cases:
        with pytest.raises(exc, match=name):
            executor.run(bad_ids, bad_pos, bad_attn, caches, rows)
        for (kc, vc), (kb, vb) in zip(caches, before):
            assert torch.equal(kc, kb) and torch.equal(vc, vb), f"caches changed by the call with bad {name}"


def test_never_serves_stale_weights(tmp_path, monkeypatch):
    """In-place writes, replaced storages (``param.data = ...``), ``.to()`` and replaced submodules
    repack before the next step; writes that bypass the version counter are picked up by ``refresh()``."""
    model = _tiny_dense(tmp_path, "qwen3")
    executor = NativeCPUExecutor(model)
    table = shuffled_block_table(3, 5)
    steps = NATIVE_STEPS[:2]
    packs = []
    pack = cpu.pack_panels
    monkeypatch.setattr(cpu, "pack_panels", lambda w: packs.append(1) or pack(w))

    def check():
        got, _ = _run_steps(executor.run, model.config, steps, table)
        want, _ = _op_path(model, steps, table)
        for g, w in zip(got, want):       # stale weights would be off by O(1), not by rounding
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)

    check()
    assert packs == []                                                    # packed at construction only
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)                 # in place
    check()
    assert packs, "an in-place write must repack"
    packs.clear()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.data = torch.randn(64, 64)   # new storage
    check()
    assert packs
    model.float()                                                         # .to(): a no-op for fp32, still right
    check()
    packs.clear()
    replacement = torch.nn.Linear(64, 96, bias=False)                     # a replaced submodule, same shape
    model.model.layers[0].mlp.up_proj = replacement
    check()
    assert packs, "a replaced submodule must repack"
    packs.clear()
    with torch.no_grad():
        model.lm_head.weight.data.copy_(torch.randn_like(model.lm_head.weight))   # invisible to version counters
    executor.refresh()
    assert packs
    check()


def test_the_runner_picks_one_executor_per_step(tmp_path, monkeypatch):
    """Native for what it covers on the CPU, eager for the rest (a long chunk, the reference op
    backend, several threads); the compiled step for decodes with compile=True."""
    from qwen_ops.engine.engine import QwenEngine
    from qwen_ops.engine.batch import BatchedRequest

    path = save_tiny_checkpoint(tmp_path / "q3", "qwen3", vocab_size=96, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=256)
    eng = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=256)
    runner = eng.runner
    assert runner.native is not None
    short, long = [BatchedRequest(0, [5] * 9, 0)], [BatchedRequest(0, [5] * (cpu.REFERENCE_ABOVE_QUERY_LEN + 1), 0)]
    assert runner.executor_for(short) == "native" and runner.executor_for(long) == "eager"
    assert runner.executor_for([BatchedRequest(0, [5], 9), BatchedRequest(1, [6], 3)]) == "native"
    with qwen_ops.use_backend("reference"):
        assert runner.executor_for(short) == "eager"
    calls = _count_native_calls(monkeypatch)
    r = eng.prefill([5, 6, 7], slot_id=0)
    eng.decode_step(r.next_token, slot_id=0)
    assert len(calls) == 2
    long_prompt = [3 + i % 90 for i in range(cpu.REFERENCE_ABOVE_QUERY_LEN + 1)]
    eager_out = eng.prefill(long_prompt, slot_id=1)                 # the model's forward, eager
    assert len(calls) == 2
    with qwen_ops.use_backend("reference"):
        want = eng.prefill(long_prompt, slot_id=1)
    torch.testing.assert_close(eager_out.logits, want.logits, rtol=1e-5, atol=1e-5)
    compiled = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=256, compile=True)
    assert compiled.runner.executor_for([BatchedRequest(0, [5], 9)]) == "compiled"
    assert compiled.runner.executor_for(short) == "native"


def test_the_engine_packs_at_construction(tmp_path, monkeypatch):
    """The runner builds the native executor up front: the first request packs nothing."""
    from qwen_ops.engine.engine import QwenEngine

    path = save_tiny_checkpoint(tmp_path / "q3", "qwen3", vocab_size=96, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=128)
    eng = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=64)
    packs = []
    pack = cpu.pack_panels
    monkeypatch.setattr(cpu, "pack_panels", lambda w: packs.append(1) or pack(w))
    calls = _count_native_calls(monkeypatch)
    r = eng.prefill([5, 6, 7], slot_id=0)
    eng.decode_step(r.next_token, slot_id=0)
    assert packs == [] and len(calls) == 2
    with torch.no_grad():
        eng.model.lm_head.weight.data.copy_(torch.randn_like(eng.model.lm_head.weight))
    eng.refresh_weights()
    assert packs


def test_dense_forward_reduce_callback(tmp_path, monkeypatch):
    """The tensor-parallel hook of the native forward: an identity reduce changes nothing, a reduce
    that doubles its buffer in place changes the logits (so the C code reads it back), and an
    exception in it stops the forward and is raised, not swallowed by ctypes."""
    from checkpoints import make_qwen3_checkpoint

    eng = qwen_ops.QwenEngine.from_pretrained(make_qwen3_checkpoint(tmp_path), max_slots=4, max_seq_len=64,
                                              block_size=4)
    assert eng.runner.native is not None
    prompt = list(range(3, 14))
    real = cpu.dense_forward
    seen = []

    def with_reduce(reduce):
        monkeypatch.setattr(cpu, "dense_forward", lambda *a, **k: real(*a, **{**k, "reduce": reduce}))
        slot = eng.allocate_slot(len(seen))
        seen.append(slot)
        try:
            return eng.prefill(prompt, slot_id=slot).logits
        finally:
            monkeypatch.setattr(cpu, "dense_forward", real)
            eng.free_slot(slot)

    base = eng.prefill(prompt, slot_id=eng.allocate_slot("base")).logits
    sizes = []
    same = with_reduce(lambda buf: sizes.append(buf.numel()))
    assert torch.equal(same, base)
    assert sizes == [len(prompt) * 64] * 4          # 2 layers x (o, down), [T, hidden] each
    doubled = with_reduce(lambda buf: buf.mul_(2.0))
    assert not torch.allclose(doubled, base)

    def boom(buf):
        raise RuntimeError("peer rank went away")

    with pytest.raises(RuntimeError, match="peer rank went away"):
        with_reduce(boom)
