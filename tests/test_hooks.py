"""Hooks on the model's modules run on the eager paths, as in plain PyTorch (issue 43 item 2).

The oracle is transformers with the same hooks: the set of modules it calls is a subset of the set
ours calls (names are shared: our parameter names are Hugging Face's), and a steering hook that
adds a fixed vector to a module's output changes our logits and greedy tokens exactly as it
changes transformers'. All of it on the default CPU path (each layer's packed ``forward_cpu``),
where the fused products stand in for q_proj, k_proj, v_proj, gate_proj, up_proj, down_proj and
lm_head: while a hook waits on one of those, the layer runs its plain forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qwen_ops.models.layers import forward_choices
from qwen_ops.ops.kernels import cpu

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")

from qwen_tiny import load_hf, new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata  # noqa: E402

FP32_ATOL = 2e-5          # as test_dense: fp32 rounding between implementations, not a wrong formula
BLOCK_SIZE = 4
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12]
# module name -> what is added to its output (a vector over its last dim, seeded by the name)
STEERED = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
           "model.layers.1.self_attn.o_proj", "model.layers.0.self_attn", "model.layers.0.mlp.gate_proj",
           "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj", "model.layers.1.mlp",
           "model.layers.0.self_attn.k_norm", "lm_head", "model.embed_tokens"]


@pytest.fixture(autouse=True)
def _needs_cpu_kernels(monkeypatch):
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    monkeypatch.setenv("QWEN_OPS_POISON_OUTPUTS", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hooks"), "qwen3", seed=3, vocab_size=96, hidden_size=64,
                                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(checkpoint):
    """(ours on the CPU fast path, transformers), one tiny Qwen3 checkpoint."""
    from qwen_ops.models.loader import load_checkpoint

    path = checkpoint
    ours = copy.deepcopy(load_checkpoint(path, dtype="float32").model)
    ours.process_weights_after_loading()
    choices = forward_choices(ours)
    assert choices["model.layers.0.self_attn"] == "cpu" and choices["model.layers.1.mlp"] == "cpu"
    assert choices["lm_head"] == "cpu"
    return ours, load_hf(path)


@torch.no_grad()
def _ours_logits(model, ids=PROMPT) -> torch.Tensor:
    T = len(ids)
    table = shuffled_block_table(1, -(-T // BLOCK_SIZE), seed=T)
    caches = new_kv_caches(model.config, table.numel() + 1, BLOCK_SIZE, torch.float32)
    positions, attn, _ = step_metadata([(0, 0, T)], table)
    return model(torch.tensor(ids), positions, attn, caches, torch.arange(T))


@torch.no_grad()
def _hf_logits(hf, ids=PROMPT) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _steer(vector: torch.Tensor):
    """A forward hook adding ``vector`` to a module's (first) output."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + vector,) + tuple(output[1:])
        return output + vector
    return hook


def _register(model, names, make_hook):
    modules = dict(model.named_modules())
    return [modules[n].register_forward_hook(make_hook(n)) for n in names]


def _vector_for(name: str, hf) -> torch.Tensor:
    """The steering vector of ``name``: random, over the last dim of the module's output in transformers."""
    seen = {}

    def record(module, args, output):      # returns None: the output stays
        seen["o"] = _first(output)

    handle = dict(hf.named_modules())[name].register_forward_hook(record)
    _hf_logits(hf)
    handle.remove()
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return 0.5 * torch.randn(seen["o"].shape[-1], generator=g)


def _int8(checkpoint):
    from qwen_ops.models.loader import load_model

    model = load_model(checkpoint, quantization="int8")
    model.process_weights_after_loading()
    assert forward_choices(model)["model.layers.0.self_attn"] == "cpu"
    return model


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_every_module_transformers_calls_is_called(models, checkpoint, quantized):
    """Pre-hooks on every module with the same name in both models: each that transformers calls in
    a forward, ours calls too (and as many times); the int8 model's fused products too."""
    ours, hf = models
    if quantized:
        ours = _int8(checkpoint)
    shared = sorted(set(dict(ours.named_modules())) & set(dict(hf.named_modules())) - {""})
    counts = {"ours": {}, "hf": {}}

    def counter(side):
        def make(name):
            def pre(module, args):
                counts[side][name] = counts[side].get(name, 0) + 1
            return pre
        return make

    handles = []
    for side, model in (("ours", ours), ("hf", hf)):
        modules = dict(model.named_modules())
        handles += [modules[n].register_forward_pre_hook(counter(side)(n)) for n in shared]
    try:
        _ours_logits(ours)
        _hf_logits(hf)
    finally:
        for h in handles:
            h.remove()
    called_by_hf = {n: c for n, c in counts["hf"].items()}
    assert "model.layers.1.self_attn.q_proj" in called_by_hf and "model.layers.0.mlp.down_proj" in called_by_hf
    missed = {n: (c, counts["ours"].get(n, 0)) for n, c in called_by_hf.items() if counts["ours"].get(n, 0) != c}
    assert not missed, f"(transformers' calls, ours) differ: {missed}"


@pytest.mark.parametrize("name", STEERED)
def test_steering_hook_matches_transformers(models, name):
    ours, hf = models
    plain = _ours_logits(ours)
    torch.testing.assert_close(plain, _hf_logits(hf), atol=FP32_ATOL, rtol=0)
    vector = _vector_for(name, hf)
    handles = _register(ours, [name], lambda n: _steer(vector)) + _register(hf, [name], lambda n: _steer(vector))
    try:
        steered, expected = _ours_logits(ours), _hf_logits(hf)
    finally:
        for h in handles:
            h.remove()
    assert (expected - plain).abs().max() > 1e-2, "the steering vector should move the logits"
    torch.testing.assert_close(steered, expected, atol=FP32_ATOL, rtol=0)
    # removed: the fast path again, with the same logits as before
    torch.testing.assert_close(_ours_logits(ours), plain, atol=0, rtol=0)


def test_global_module_hook_sees_every_module_transformers_calls(models):
    """``torch.nn.modules.module.register_module_forward_hook`` (every module's forward)."""
    ours, hf = models
    seen = {"ours": set(), "hf": set()}
    names = {id(m): ("ours", n) for n, m in ours.named_modules()} | {id(m): ("hf", n) for n, m in hf.named_modules()}

    def hook(module, args, output):
        side_name = names.get(id(module))
        if side_name is not None:
            seen[side_name[0]].add(side_name[1])

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        _ours_logits(ours)
        _hf_logits(hf)
    finally:
        handle.remove()
    shared = set(dict(ours.named_modules())) & set(dict(hf.named_modules()))
    assert (seen["hf"] & shared) - seen["ours"] == set()
    assert "model.layers.0.self_attn.v_proj" in seen["ours"]


def test_a_copied_model_sees_hooks_on_its_own_modules_and_global_ones(models):
    """``copy.deepcopy`` of a packed model (as an engine may take): hooks on the copy's modules, and
    global hooks registered after the copy, run; hooks on the original's do not reach the copy."""
    ours, _ = models
    copied = copy.deepcopy(ours)
    seen = []
    on_original = ours.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append("original"))
    try:
        _ours_logits(copied)
        assert seen == []
        on_copy = copied.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.append("copy"))
        _ours_logits(copied)
        on_copy.remove()
        assert seen == ["copy"]
        q_proj = copied.model.layers[1].self_attn.q_proj
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: seen.append("global") if m is q_proj else None)
        try:
            _ours_logits(copied)
        finally:
            handle.remove()
        assert seen == ["copy", "global"]
    finally:
        on_original.remove()


def test_fast_path_ops_run_without_hooks_and_not_with_one(models):
    """The choice is per call: with no hook the fused ops run; a hook on q_proj turns that layer's
    attention (only) to its plain forward."""
    ours, _ = models

    def op_names():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _ours_logits(ours)
        return [e.name for e in prof.events()]

    assert op_names().count("qwen::attention_block") == 2
    handle = ours.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, o: None)
    try:
        names = op_names()
    finally:
        handle.remove()
    assert names.count("qwen::attention_block") == 1 and names.count("qwen::slot_attention") == 1


def test_engine_greedy_tokens_with_a_steering_hook_match_transformers(models, tmp_path):
    """Through the engine's step (the one-request decode path): a hook on one MLP steers greedy
    tokens as transformers' ``generate`` with the same hook."""
    from qwen_ops import QwenEngine, SamplingParams

    ours, hf = models
    engine = QwenEngine(copy.deepcopy(ours), ours.config, max_slots=2, max_seq_len=64, block_size=BLOCK_SIZE)
    name = "model.layers.1.mlp"
    vector = 2.0 * _vector_for(name, hf)
    handles = _register(engine.model, [name], lambda n: _steer(vector)) + _register(hf, [name], lambda n: _steer(vector))
    try:
        slot = engine.allocate_slot("steered")
        out = engine.prefill(PROMPT, slot_id=slot, sampling=SamplingParams(temperature=0.0))
        tokens = [out.next_token]
        for _ in range(11):
            tokens.append(engine.decode_step(tokens[-1], slot_id=slot).next_token)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(PROMPT):].tolist()
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        unsteered = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    assert expected != unsteered, "the hook should change transformers' tokens"
    assert tokens == expected
