"""Parity of the mixture-of-experts models (qwen_ops.models.moe) with transformers: qwen3_moe, qwen3_next, qwen3_5_moe.

Tiny random checkpoints (tests/checkpoints.py: several experts, top-k 2 to 4, with and without
``norm_topk_prob``, the shared expert on and off, ``decoder_sparse_step`` and ``mlp_only_layers``, tied
and untied embeddings) are saved with transformers' ``save_pretrained`` (one tensor per expert), one
also with the stacked layout (``save_original_format=False``), and loaded both by
``qwen_ops.models.loader`` and by transformers. Checked: prefill logits within 1e-4 relative (one
sequence, and a mixed batch with a padding sequence), greedy generation of 32 tokens against
``generate(do_sample=False)`` per prompt and batched, the sparse/dense layer pattern, both checkpoint
layouts loading to the same weights, a missing expert named, the multimodal ``qwen3_5_moe`` wrapper,
the model on every backend (triton under the interpreter), ``torch.compile(fullgraph=True)``, and the
CPU fast path's ops (packed experts, ``moe_packed``) on qwen3_moe against the op path. Caches start NaN-poisoned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch

import qwen_ops
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.dense import QwenForCausalLM
from qwen_ops.models.hybrid import FusedProjectionGatedDeltaNet, GatedDeltaNet, Qwen3_5ForCausalLM
from qwen_ops.models.layers import QwenMLP
from qwen_ops.models.loader import CheckpointError, load_checkpoint
from qwen_ops.models.moe import SparseMoeBlock

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

from checkpoints import MOE_BASE, MOE_HYBRID, make_moe_checkpoint, randomize_moe  # noqa: E402
from conftest import backend_unavailable_reason  # noqa: E402
from qwen_tiny import hf_greedy, load_hf, shuffled_block_table, step_metadata  # noqa: E402

L, F = "linear_attention", "full_attention"
# name -> (model_type, overrides of tests/checkpoints.py's sizes)
MODEL_CASES = {
    "qwen3_moe-top2": ("qwen3_moe", dict()),
    # top 4 of 6 renormalised, tied, biases; layer 1 sparse only (step 2; layer 3 listed as dense)
    "qwen3_moe-top4-norm-tied-sparse2": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=4, norm_topk_prob=True,
                                                           tie_word_embeddings=True, attention_bias=True,
                                                           num_hidden_layers=4, decoder_sparse_step=2,
                                                           mlp_only_layers=[3])),
    # shared expert on; layer 0 keeps a dense MLP
    "qwen3_next-shared": ("qwen3_next", dict(mlp_only_layers=[0])),
    # shared expert off (size 0), top 3 without renormalising, tied, value heads 3 per key head
    "qwen3_next-noshared-top3-tied": ("qwen3_next", dict(shared_expert_intermediate_size=0, num_experts_per_tok=3,
                                                         norm_topk_prob=False, tie_word_embeddings=True,
                                                         linear_num_key_heads=1, linear_num_value_heads=3,
                                                         layer_types=[F, L, L])),
    "qwen3_5_moe-shared": ("qwen3_5_moe_text", dict()),
    "qwen3_5_moe-top4-tied": ("qwen3_5_moe_text", dict(num_experts=6, num_experts_per_tok=4,
                                                       tie_word_embeddings=True, layer_types=[L, L, F])),
}
# Relative bound on fp32 logits: max |ours - transformers| <= REL * max |transformers|.
REL = 1e-4
PROMPT_LENGTHS = (1, 6, 17)
NEW_TOKENS = 32
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, qwen_ops Checkpoint, transformers model)."""
    built = {}
    for i, (name, (model_type, overrides)) in enumerate(MODEL_CASES.items()):
        path = make_moe_checkpoint(tmp_path_factory.mktemp(name), model_type, seed=i, **overrides)
        built[name] = (path, load_checkpoint(path, dtype="float32"), load_hf(path))
    return built


def _prompts(vocab_size: int, seed: int, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lengths]


def poisoned_caches(model, num_blocks: int, max_slots: int) -> list:
    caches = model.allocate_caches(num_blocks, BLOCK_SIZE, max_slots, model.lm_head.weight.dtype, torch.device("cpu"))
    for pair in caches:
        for t in pair:
            t.fill_(float("nan"))
    return caches


@torch.no_grad()
def prefill_logits(model, ids: list[int], slot: int = 2) -> torch.Tensor:
    """All-row logits [T, vocab] of one sequence prefilled in one forward, in slot ``slot`` of 3."""
    T = len(ids)
    table = shuffled_block_table(3, -(-T // BLOCK_SIZE), seed=T)
    caches = poisoned_caches(model, table.numel() + 1, 3)
    positions, attn, _ = step_metadata([(slot, 0, T)], table)
    return model(torch.tensor(ids), positions, attn, caches, torch.arange(T))


@torch.no_grad()
def greedy(model, prompts: Sequence[Sequence[int]], new_tokens: int, *, prefill_chunk: Optional[int] = None,
           seed: int = 0) -> list[list[int]]:
    """Greedy continuations in one batch (prompt i in slot len(prompts) - i), a padding row in every decode step."""
    max_slots = len(prompts) + 1
    slots = [len(prompts) - i for i in range(len(prompts))]
    table = shuffled_block_table(max_slots, -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE), seed)
    caches = poisoned_caches(model, table.numel() + 1, max_slots)
    done, last = [0] * len(prompts), [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks, ids, owners = [], [], []
        for i, p in enumerate(prompts):
            n = min(len(p) - done[i], prefill_chunk or len(p))
            if n > 0:
                chunks.append((slots[i], done[i], n))
                ids += p[done[i]:done[i] + n]
                owners.append(i)
        positions, attn, rows = step_metadata(chunks, table)
        logits = model(torch.tensor(ids), positions, attn, caches, rows)
        for row, i in enumerate(owners):
            done[i] += chunks[row][2]
            last[i] = logits[row]
    outputs = [[int(l.argmax())] for l in last]
    for _ in range(new_tokens - 1):
        chunks = [(slots[i], len(p) + len(outputs[i]) - 1, 1) for i, p in enumerate(prompts)] + [(-1, 0, 1)]
        positions, attn, rows = step_metadata(chunks, table)
        logits = model(torch.tensor([o[-1] for o in outputs] + [0]), positions, attn, caches, rows[:-1])
        for i, token in enumerate(logits.argmax(-1).tolist()):
            outputs[i].append(token)
    return outputs


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    scale = ref.abs().max().item()
    assert scale > 0.5, "not a comparison of near-zero numbers"
    err = (ours - ref).abs().max().item()
    assert err <= REL * scale, f"{what}: max |ours - transformers| = {err:.3g} > {REL:g} x {scale:.3g}"


# --------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODEL_CASES)
def test_prefill_logits_match_transformers(checkpoints, name):
    _, ckpt, hf = checkpoints[name]
    for ids in _prompts(ckpt.config.vocab_size, seed=1):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert_logits_close(prefill_logits(ckpt.model, ids), ref, f"{name}, {len(ids)} tokens")


@pytest.mark.parametrize("name", ["qwen3_moe-top2", "qwen3_next-shared"])
def test_mixed_batch_with_padding_matches_transformers(checkpoints, name):
    """Three prompts and a padding sequence (slot -1, its rows routed like any other) in one forward."""
    _, ckpt, hf = checkpoints[name]
    prompts = _prompts(ckpt.config.vocab_size, seed=2)
    table = shuffled_block_table(4, -(-max(PROMPT_LENGTHS) // BLOCK_SIZE), seed=3)
    caches = poisoned_caches(ckpt.model, table.numel() + 1, 4)
    chunks = [(3, 0, len(prompts[0])), (-1, 0, 3), (0, 0, len(prompts[1])), (1, 0, len(prompts[2]))]
    positions, attn, last = step_metadata(chunks, table)
    ids = prompts[0] + [7, 7, 7] + prompts[1] + prompts[2]
    with torch.no_grad():
        ours = ckpt.model(torch.tensor(ids), positions, attn, caches, last[torch.tensor([0, 2, 3])])
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert_logits_close(ours, ref, name)


@pytest.mark.parametrize("name", MODEL_CASES)
def test_greedy_generation_matches_transformers(checkpoints, name):
    _, ckpt, hf = checkpoints[name]
    prompts = _prompts(ckpt.config.vocab_size, seed=4)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)   # distinct continuations: slots cannot mix
    assert greedy(ckpt.model, prompts[-1:], NEW_TOKENS) == expected[-1:]
    assert greedy(ckpt.model, prompts, NEW_TOKENS, seed=5) == expected


def test_chunked_prefill_matches_transformers(checkpoints):
    _, ckpt, hf = checkpoints["qwen3_5_moe-shared"]
    prompts = _prompts(ckpt.config.vocab_size, seed=6, lengths=(3, 13))
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    assert greedy(ckpt.model, prompts, 16, prefill_chunk=5, seed=7) == expected


# --------------------------------------------------------------------------------------------
# Structure and loading
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODEL_CASES)
def test_layers_and_names_follow_transformers(checkpoints, name):
    """Sparse and dense MLPs where transformers has them; every parameter name and value equal."""
    _, ckpt, hf = checkpoints[name]
    for ours, theirs in zip(ckpt.model.model.layers, hf.model.layers, strict=True):
        sparse = "Sparse" in type(theirs.mlp).__name__
        assert isinstance(ours.mlp, SparseMoeBlock if sparse else QwenMLP)
        if sparse:
            assert (ours.mlp.shared_expert is not None) == bool(getattr(ckpt.config.moe,
                                                                        "shared_expert_intermediate_size", 0))
        if hasattr(theirs, "linear_attn"):
            fused = ckpt.config.model_type == "qwen3_next"
            assert type(ours.linear_attn) is (FusedProjectionGatedDeltaNet if fused else GatedDeltaNet)
    shared_off = ckpt.config.moe.shared_expert_intermediate_size == 0   # transformers keeps empty shells
    hf_params = {n: p for n, p in hf.named_parameters() if not (shared_off and ".shared_expert" in n)}
    ours = dict(ckpt.model.named_parameters())
    assert set(ours) == set(hf_params) - ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    for n, p in ours.items():
        assert torch.equal(p, hf_params[n]), n


def test_sparse_layer_pattern(checkpoints):
    _, ckpt, _ = checkpoints["qwen3_moe-top4-norm-tied-sparse2"]
    kinds = [type(layer.mlp) for layer in ckpt.model.model.layers]
    assert kinds == [QwenMLP, SparseMoeBlock, QwenMLP, QwenMLP]   # step 2: layers 1, 3; layer 3 listed dense
    assert ckpt.model.lm_head.weight is ckpt.model.model.embed_tokens.weight


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_stacked_and_per_expert_layouts_load_alike(tmp_path, model_type):
    per_expert = make_moe_checkpoint(tmp_path / "per_expert", model_type, seed=11)
    stacked = make_moe_checkpoint(tmp_path / "stacked", model_type, seed=11, original_format=False)
    from safetensors import safe_open
    with safe_open(str(stacked / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    with safe_open(str(per_expert / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in set(f.keys())
    a, b = (dict(load_checkpoint(p).model.named_parameters()) for p in (per_expert, stacked))
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_sharded_per_expert_checkpoint_loads(tmp_path, checkpoints):
    """Experts of one layer split over several shard files."""
    path, ckpt, _ = checkpoints["qwen3_moe-top2"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    loaded = dict(load_checkpoint(tmp_path).model.named_parameters())
    for n, p in ckpt.model.named_parameters():
        assert torch.equal(loaded[n], p), n


def test_missing_expert_is_named(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    path, _, _ = checkpoints["qwen3_moe-top2"]
    for f in ("config.json", "generation_config.json"):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"):
        load_checkpoint(tmp_path)


def test_bf16_load_matches_transformers_bf16(checkpoints):
    path, _, _ = checkpoints["qwen3_moe-top2"]
    ckpt = load_checkpoint(path, dtype="bfloat16")
    assert ckpt.model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    hf = load_hf(path, dtype=torch.bfloat16)
    ids = _prompts(ckpt.config.vocab_size, seed=8, lengths=(9,))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = prefill_logits(ckpt.model, ids).float()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


def test_multimodal_qwen3_5_moe_loads_language_model_only(tmp_path):
    torch.manual_seed(12)
    text = dict(MOE_BASE, **MOE_HYBRID)
    text.pop("intermediate_size")
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[1, 1, 0], mrope_interleaved=True)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=2,
                  temporal_patch_size=1, num_position_embeddings=16)
    model = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    randomize_moe(model.model.language_model)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.model_type == "qwen3_5_moe" and isinstance(ckpt.model, Qwen3_5ForCausalLM)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _prompts(ckpt.config.vocab_size, seed=13, lengths=(11,))[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert_logits_close(prefill_logits(ckpt.model, ids), ref, "qwen3_5_moe")


# --------------------------------------------------------------------------------------------
# Backends, compile, the CPU fast path, configs
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_model_on_every_backend_matches_reference(checkpoints, backend):
    reason = backend_unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"backend {backend!r} unavailable: {reason}")
    for name in ("qwen3_moe-top2", "qwen3_5_moe-shared"):
        _, ckpt, _ = checkpoints[name]
        ids = _prompts(ckpt.config.vocab_size, seed=14, lengths=(5,))[0]
        with qwen_ops.use_backend("reference"):
            ref = prefill_logits(ckpt.model, ids)
        with qwen_ops.use_backend(backend):
            ours = prefill_logits(ckpt.model, ids)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)


def test_compile_fullgraph_no_graph_break(checkpoints):
    from torch._dynamo.utils import counters

    _, ckpt, _ = checkpoints["qwen3_moe-top2"]
    model = ckpt.model
    ids = _prompts(ckpt.config.vocab_size, seed=15, lengths=(7,))[0]
    table = shuffled_block_table(3, 4, seed=1)
    positions, attn, last = step_metadata([(1, 0, len(ids))], table)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    outs = []
    for fn in (model, compiled):
        caches = model.allocate_caches(table.numel() + 1, BLOCK_SIZE, 3, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            outs.append(fn(torch.tensor(ids), positions, attn, caches, last))
    assert counters["graph_break"] == {}
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_moe-top2", "qwen3_moe-top4-norm-tied-sparse2"])
def test_native_cpu_executor_runs_moe(checkpoints, name):
    """qwen3_moe on the fast ops (every sparse layer's experts on moe_packed, the router in torch;
    layer 3 of the second case keeps a dense MLP, packed too) against the op path: greedy tokens
    equal, logits within 1e-5. The hybrid MoE models keep their plain forward."""
    from qwen_ops.models.layers import forward_choices
    from qwen_ops.ops.kernels import cpu

    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    path, ckpt, _ = checkpoints[name]
    prompt = _prompts(ckpt.config.vocab_size, 5, (13,))[0]
    runs = {}
    for native in (True, False):
        eng = qwen_ops.QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=64, block_size=BLOCK_SIZE,
                                                  native_cpu=native)
        choices = forward_choices(eng.model)
        sparse = [n for n in choices if n.endswith("mlp.experts")]
        assert len(sparse) == sum(isinstance(layer.mlp, SparseMoeBlock) for layer in ckpt.model.model.layers) > 0
        assert set(choices.values()) == {"cpu" if native else "native"}
        res = eng.prefill(prompt, slot_id=0)
        out = [(res.next_token, res.logits)]
        for _ in range(6):
            res = eng.decode_step(out[-1][0], slot_id=0)
            out.append((res.next_token, res.logits))
        runs[native] = out
    hybrid = qwen_ops.QwenEngine.from_pretrained(checkpoints["qwen3_5_moe-shared"][0], max_slots=2, max_seq_len=64,
                                                 block_size=BLOCK_SIZE)
    assert set(forward_choices(hybrid.model).values()) == {"native"}
    for (tn, ln), (to, lo) in zip(runs[True], runs[False]):
        assert tn == to
        assert (ln - lo).abs().max() / lo.abs().max() < 1e-5


def _write_config(tmp_path: Path, **changes) -> Path:
    config = dict(MOE_BASE, model_type="qwen3_moe", num_hidden_layers=2, rope_parameters={"rope_theta": 1e4})
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_config_reads_transformers_5_names_and_defaults(tmp_path):
    cfg = QwenConfig.from_pretrained(_write_config(tmp_path, num_experts=None, num_local_experts=5))
    assert cfg.moe.num_experts == 5 and cfg.moe.norm_topk_prob is False and cfg.moe.shared_expert_intermediate_size is None
    assert cfg.head_dim == 16
    nxt = QwenConfig.from_dict(dict(MOE_BASE, **MOE_HYBRID, model_type="qwen3_next"))
    assert nxt.moe.norm_topk_prob is True and nxt.moe.shared_expert_intermediate_size == 40 and nxt.is_hybrid
    text = dict(MOE_BASE, **MOE_HYBRID, model_type="qwen3_5_moe_text", norm_topk_prob=False, decoder_sparse_step=2)
    text.pop("intermediate_size")
    q35 = QwenConfig.from_dict(text)
    assert q35.moe.norm_topk_prob is True and q35.moe.decoder_sparse_step == 1   # neither field exists there
    assert q35.intermediate_size == MOE_BASE["moe_intermediate_size"]


@pytest.mark.parametrize("changes,message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok = 9 exceeds num_experts = 8"),
    (dict(num_experts=0), "num_experts = 0, expected a positive int"),
    (dict(moe_intermediate_size=-1), "moe_intermediate_size = -1"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step = 0"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers = \\[2\\], expected a list of layer indices in \\[0, 2\\)"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob = 'yes'"),
], ids=["topk", "experts", "moe-size", "sparse-step", "mlp-only", "norm-flag"])
def test_bad_moe_configs(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        QwenConfig.from_pretrained(_write_config(tmp_path, **changes))


def test_tensor_parallelism_of_moe_configs(checkpoints):
    """MoE models split (tests/test_tensor_parallel.py) where the sizes divide; Qwen3-Next's fused
    linear-attention projections are not split: a clear error, not a half-sharded model."""
    from qwen_ops.models.parallel import check_tp_config

    _, ckpt, _ = checkpoints["qwen3_moe-top2"]
    check_tp_config(ckpt.config, 1)
    check_tp_config(ckpt.config, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size = 3 does not divide moe_intermediate_size = 32"):
        check_tp_config(ckpt.config, 3)
    _, ckpt, _ = checkpoints["qwen3_next-shared"]
    with pytest.raises(ValueError, match="qwen3_next's fused linear-attention projections"):
        check_tp_config(ckpt.config, 2)
