"""The model's CPU fast path (each layer's ``forward_cpu`` on torch.ops.qwen.linear_packed,
rms_norm, add_rms_norm, attention_block, silu_mul over weights packed by
``process_weights_after_loading``) against the same model on its plain-torch forward with the
reference ops, and the one place the choice is made.

Each comparison runs the same steps twice on random caches: once through the packed model (the
packing the runner does), once through the unpacked model under ``use_backend("reference")``;
logits and caches must agree to fp32 rounding. The C++ kernels' outputs start NaN
(``QWEN_OPS_POISON_OUTPUTS``).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import qwen_ops
from qwen_ops.models.layers import forward_choices
from qwen_ops.ops.kernels import cpu

from qwen_tiny import new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata

# (slot, start position, tokens) per sequence, per step: prefills of 9 and 14 tokens, decodes of
# both, a decode next to a 3-token chunk, and a step with a padding sequence (slot -1).
STEPS = [[(0, 0, 9), (2, 0, 14)], [(0, 9, 1), (2, 14, 1)], [(2, 15, 1), (0, 10, 3)], [(0, 13, 1), (-1, 0, 1)]]


@pytest.fixture(autouse=True)
def _needs_cpu_kernels(monkeypatch):
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    monkeypatch.setenv("QWEN_OPS_POISON_OUTPUTS", "1")


def _tiny_dense(tmp_path, model_type: str, **overrides):
    from qwen_ops.models.loader import load_checkpoint

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return load_checkpoint(save_tiny_checkpoint(tmp_path / model_type, model_type, **kwargs)).model


def _packed(model):
    fast = copy.deepcopy(model)
    fast.process_weights_after_loading()
    return fast


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
    assert set(forward_choices(model).values()) == {"native"}
    with qwen_ops.use_backend("reference"):
        return _run_steps(model, model.config, steps, table)


def _assert_same_steps(got, got_caches, want, want_caches) -> None:
    for g, w in zip(got, want, strict=True):
        assert not g.isnan().any()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_fast_path_matches_the_op_path(model_type, tmp_path):
    """Prefill, decode, a chunk mixed with a decode, and padding; Qwen2 has q/k/v biases and no
    q/k norms, Qwen3 the reverse. Every layer of the packed model chose the fast ops."""
    model = _tiny_dense(tmp_path, model_type)
    fast = _packed(model)
    assert set(forward_choices(fast).values()) == {"cpu"} and "lm_head" in forward_choices(fast)
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(fast, model.config, STEPS, table)
    want, want_caches = _op_path(model, STEPS, table)
    _assert_same_steps(got, got_caches, want, want_caches)


def test_panels_lie_in_step_order_on_huge_pages_and_so_do_kv_caches(tmp_path):
    """``process_weights_after_loading`` moves every packed product's panels into one buffer on 2 MB pages:
    one after another in module order (the order a step reads them), the LM head's last, the first on a
    2 MB boundary (Linux), each panel's values unchanged. ``allocate_caches`` puts each KV tensor on 2 MB
    pages, zero-filled. (The fast-path tests around this one run on such panels and caches.)"""
    import platform
    from qwen_ops.models.layers import pack_linears

    model = _tiny_dense(tmp_path, "qwen3", vocab_size=4096, hidden_size=256, intermediate_size=512)
    fast = _packed(model)
    panels = [(name, b) for name, b in fast.named_buffers() if name.endswith("_packed")]
    in_memory = [name for name, b in sorted(panels, key=lambda nb: nb[1].data_ptr())]
    layer_order = [name for name, _ in panels if name != "lm_head_packed"]
    assert in_memory == layer_order + ["lm_head_packed"] and len(layer_order) == 8
    by_address = sorted((b for _, b in panels), key=lambda b: b.data_ptr())
    for before, after in zip(by_address, by_address[1:]):
        gap = after.data_ptr() - (before.data_ptr() + before.numel() * before.element_size())
        assert 0 <= gap < 64
    if platform.system() == "Linux":
        assert by_address[0].data_ptr() % cpu.HUGE_PAGE == 0
    assert torch.equal(fast.lm_head_packed, pack_linears(model.lm_head)[0])
    caches = fast.allocate_caches(2048, 16, 1, torch.float32, torch.device("cpu"))
    assert len(caches) == 2
    for kc, vc in caches:
        for t in (kc, vc):
            assert t.shape == (2048, 16, 2, 16) and not t.any()
            if platform.system() == "Linux":
                assert t.data_ptr() % cpu.HUGE_PAGE == 0


def test_portable_build_matches(portable_library, monkeypatch):
    """The C file's AVX-512 paths off: the portable loops (a build of their own, its kernels
    registered for this test's lifetime) against the references."""
    from qwen_ops.ops.kernels import reference_fused as R
    from qwen_tiny import registered_kernels

    portable = portable_library
    monkeypatch.setattr(cpu, "library", lambda: portable)
    gen = torch.Generator().manual_seed(0)
    with registered_kernels(portable):
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(5, 40, generator=gen).to(dtype), torch.randn(57, 40, generator=gen).to(dtype)
            packed = cpu.pack_panels(w)
            torch.testing.assert_close(torch.ops.qwen.linear_packed(x, packed, None, 57).float(),
                                       R.linear_packed_reference(x, packed, None, 57).float(), rtol=2e-2, atol=2e-2)


def test_the_choice_follows_the_backend_setting_read_once(tmp_path):
    """QWEN_OPS_BACKEND=reference (or fp16 weights) when the weights are packed keeps every layer on
    its plain forward; the setting read later changes nothing (no per-call decision)."""
    model = _tiny_dense(tmp_path, "qwen3")
    with qwen_ops.use_backend("reference"):
        ref = _packed(model)
    assert set(forward_choices(ref).values()) == {"native"}
    half = copy.deepcopy(model).to(torch.float16)
    half.process_weights_after_loading()
    assert set(forward_choices(half).values()) == {"native"}
    fast = _packed(model)
    with qwen_ops.use_backend("reference"):
        assert set(forward_choices(fast).values()) == {"cpu"}


def test_more_threads_same_results(tmp_path):
    """With two intra-op threads the products split across them (OpenMP builds), and every logit and
    cache entry is bit-identical to one thread's: each output is summed by one thread in one order."""
    model = _packed(_tiny_dense(tmp_path, "qwen3", hidden_size=64, intermediate_size=320))   # 20 panels to split
    table = shuffled_block_table(3, 5)
    one, one_caches = _run_steps(model, model.config, STEPS, table)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two, two_caches = _run_steps(model, model.config, STEPS, table)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.equal(a, b) for pa, pb in zip(one_caches, two_caches) for a, b in zip(pa, pb))


@pytest.mark.parametrize("tokens", [1, 9])
def test_bad_metadata_raises_before_anything_is_written(tokens, tmp_path):
    """Bad slot ids, block ids or positions raise the ops' errors with the caches unchanged; a bad
    row index raises index_select's (the caches are written by then, as on the op path: the model's
    forward reads logits_indices after the layers)."""
    model = _packed(_tiny_dense(tmp_path, "qwen3", max_position_embeddings=64))
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
        (torch.tensor([3]), far[0], far[1], far[2], ValueError, "64"),
        (ids, pos, attn, torch.tensor([0, 2 * tokens]), IndexError, "index"),
    ]
    with torch.inference_mode():
        for bad_ids, bad_pos, bad_attn, rows, exc, name in cases:
            with pytest.raises(exc, match=name):
                model(bad_ids, bad_pos, bad_attn, caches, rows)
            if name == "index":
                continue
            for (kc, vc), (kb, vb) in zip(caches, before):
                assert torch.equal(kc, kb) and torch.equal(vc, vb), f"caches changed by the call with bad {name}"


def _engine_path(tmp_path):
    return save_tiny_checkpoint(tmp_path / "q3", "qwen3", vocab_size=96, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=256)


def test_the_engine_packs_at_construction_and_refresh_repacks(tmp_path, monkeypatch):
    """The runner packs up front (the first request packs nothing); weights changed afterwards are
    what ``refresh_weights()`` repacks, and the next step uses them (against the op path)."""
    from qwen_ops.engine.engine import QwenEngine

    eng = QwenEngine.from_pretrained(_engine_path(tmp_path), max_slots=2, max_seq_len=64)
    assert set(forward_choices(eng.model).values()) == {"cpu"}
    from qwen_ops.ops import host          # the models' way to packing

    packs = []
    pack = host.pack_panels
    monkeypatch.setattr(host, "pack_panels", lambda w: packs.append(1) or pack(w))
    r = eng.prefill([5, 6, 7], slot_id=0)
    eng.decode_step(r.next_token, slot_id=0)
    assert packs == []
    with torch.no_grad():
        eng.model.lm_head.weight.mul_(-2.0)
        eng.model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    eng.refresh_weights()
    assert packs
    got = eng.prefill([5, 6, 7, 8], slot_id=1).logits
    ref = QwenEngine(copy.deepcopy(eng.model), eng.config, max_slots=2, max_seq_len=64, native_cpu=False)
    assert set(forward_choices(ref.model).values()) == {"native"}
    with qwen_ops.use_backend("reference"):
        want = ref.prefill([5, 6, 7, 8], slot_id=1).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_runner_chooses_eager_compiled_or_graph_only(tmp_path):
    """The runner's choice is eager / compiled / CUDA graph; every eager step (a long chunk too) runs
    the model's forward, whose layers chose the fast ops once; a long prefill equals the op path."""
    from qwen_ops.engine.engine import QwenEngine
    from qwen_ops.engine.batch import BatchedRequest

    path = _engine_path(tmp_path)
    eng = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=256)
    short, long = [BatchedRequest(0, [5] * 9, 0)], [BatchedRequest(0, [5] * 130, 0)]
    assert eng.runner.executor_for(short) == "eager" and eng.runner.executor_for(long) == "eager"
    long_prompt = [3 + i % 90 for i in range(130)]   # the attention's flash path
    got = eng.prefill(long_prompt, slot_id=1)
    ref = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=256, native_cpu=False)
    with qwen_ops.use_backend("reference"):
        want = ref.prefill(long_prompt, slot_id=1)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    compiled = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=256, compile=True)
    assert compiled.runner.executor_for([BatchedRequest(0, [5], 9)]) == "compiled"
    assert compiled.runner.executor_for(short) == "eager"
    assert set(forward_choices(compiled.model).values()) == {"cpu"}
