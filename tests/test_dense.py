"""Parity of qwen_ops.models.dense.QwenForCausalLM (attention through torch.ops.qwen.*) with transformers.

Tiny random Qwen2/Qwen3 checkpoints are saved with transformers' ``save_pretrained`` and loaded
both by ``qwen_ops.models.loader`` and by transformers. Checked: prefill logits (single sequence and a
mixed batch with padding), greedy generation of 32 tokens against ``generate(do_sample=False)``
(per prompt, batched, and with chunked prefill), bf16 checkpoints loaded as fp32 and as bf16,
and tracing with ``torch.compile(fullgraph=True)``. Runs on the reference (CPU) backend.
"""

from __future__ import annotations

import pytest
import torch

from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.models.loader import load_checkpoint, load_model
from qwen_ops.models.dense import QwenForCausalLM

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

from qwen_tiny import (greedy_generate, hf_greedy, load_hf, new_kv_caches, save_tiny_checkpoint,  # noqa: E402
                       shuffled_block_table, step_metadata)

BASE = dict(vocab_size=256, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
# name -> (model_type, config kwargs). GQA ratios 1, 2, 4, 7; tied and untied; rope default,
# linear and yarn (factor 4 x original 64 = max_position_embeddings 256, as transformers expects).
MODEL_CASES = {
    "qwen2-mha-untied": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                       tie_word_embeddings=False)),
    "qwen2-gqa2-tied-linear": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 10000.0})),
    "qwen3-gqa4-headdim32-yarn": ("qwen3", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                                head_dim=32, tie_word_embeddings=False,
                                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 64,
                                                                 "rope_theta": 10000.0})),
    "qwen3-gqa7-tied-bias": ("qwen3", dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=1,
                                           head_dim=8, tie_word_embeddings=True, attention_bias=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
# Max |ours - transformers| on logits, fp32. Reached: 2e-6 to 3e-6 (|logits| up to 5); the bound
# leaves room for a different summation order in a future kernel, not for a wrong formula.
FP32_ATOL = 2e-5
PROMPT_LENGTHS = (1, 6, 17)
NEW_TOKENS = 32
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, qwen_ops Checkpoint, transformers model), built once per module."""
    built = {}
    for i, (name, (model_type, kwargs)) in enumerate(MODEL_CASES.items()):
        path = save_tiny_checkpoint(tmp_path_factory.mktemp(name), model_type, seed=i, **BASE, **kwargs)
        built[name] = (path, load_checkpoint(path, dtype="float32"), load_hf(path))
    return built


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """All-row logits [T, vocab] of one sequence prefilled in one forward."""
    T = len(ids)
    table = shuffled_block_table(1, -(-T // BLOCK_SIZE), seed=T)
    caches = new_kv_caches(model.config, table.numel() + 1, BLOCK_SIZE, model.lm_head.weight.dtype)
    positions, attn, _ = step_metadata([(0, 0, T)], table)
    return model(torch.tensor(ids), positions, attn, caches, torch.arange(T))


@pytest.mark.parametrize("name", MODEL_CASES)
def test_prefill_logits_match_transformers(checkpoints, name):
    _, ckpt, hf = checkpoints[name]
    ids = _prompts(ckpt.config.vocab_size, seed=1)[-1]
    ours = _prefill_logits(ckpt.model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero numbers
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-gqa2-tied-linear", "qwen3-gqa4-headdim32-yarn"])
def test_mixed_batch_with_padding_matches_transformers(checkpoints, name):
    """Three prompts, a padding sequence (slot -1) in the middle, last-token logits only."""
    _, ckpt, hf = checkpoints[name]
    model, config = ckpt.model, ckpt.config
    prompts = _prompts(config.vocab_size, seed=2)
    blocks_per_slot = -(-max(PROMPT_LENGTHS) // BLOCK_SIZE)
    table = shuffled_block_table(len(prompts), blocks_per_slot, seed=3)
    caches = new_kv_caches(config, table.numel() + 1, BLOCK_SIZE, torch.float32)
    chunks = [(0, 0, len(prompts[0])), (-1, 0, 3), (1, 0, len(prompts[1])), (2, 0, len(prompts[2]))]
    positions, attn, last = step_metadata(chunks, table)
    attn.seq_lens[1] = 0  # a padding sequence holds nothing
    ids = prompts[0] + [7, 7, 7] + prompts[1] + prompts[2]
    keep = torch.tensor([0, 2, 3])
    with torch.no_grad():
        ours = model(torch.tensor(ids), positions, attn, caches, last[keep])
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", MODEL_CASES)
def test_greedy_generation_matches_transformers(checkpoints, name):
    _, ckpt, hf = checkpoints[name]
    prompts = _prompts(ckpt.config.vocab_size, seed=4)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(e) == NEW_TOKENS for e in expected)
    # One prompt per run (a batch of one), then all prompts in one batch.
    for prompt, want in zip(prompts, expected):
        assert greedy_generate(ckpt.model, [prompt], NEW_TOKENS, block_size=BLOCK_SIZE) == [want]
    assert greedy_generate(ckpt.model, prompts, NEW_TOKENS, block_size=BLOCK_SIZE, seed=5) == expected


def test_chunked_prefill_generation_matches_transformers(checkpoints):
    _, ckpt, hf = checkpoints["qwen3-gqa4-headdim32-yarn"]
    prompts = _prompts(ckpt.config.vocab_size, seed=6)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    got = greedy_generate(ckpt.model, prompts, NEW_TOKENS, block_size=BLOCK_SIZE, prefill_chunk=5, seed=7)
    assert got == expected


def test_tied_embeddings_share_one_parameter(checkpoints):
    tied = checkpoints["qwen2-gqa2-tied-linear"][1].model
    untied = checkpoints["qwen2-mha-untied"][1].model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_logits_only_for_selected_rows(checkpoints):
    _, ckpt, _ = checkpoints["qwen3-gqa7-tied-bias"]
    ids = _prompts(ckpt.config.vocab_size, seed=8)[-1]
    full = _prefill_logits(ckpt.model, ids)
    table = shuffled_block_table(1, -(-len(ids) // BLOCK_SIZE))
    caches = new_kv_caches(ckpt.config, table.numel() + 1, BLOCK_SIZE, torch.float32)
    positions, attn, _ = step_metadata([(0, 0, len(ids))], table)
    rows = torch.tensor([len(ids) - 1, 0, 3])
    with torch.no_grad():
        some = ckpt.model(torch.tensor(ids), positions.to(torch.int32), attn, caches, rows)
    assert some.shape == (3, ckpt.config.vocab_size)
    torch.testing.assert_close(some, full[rows], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    model_type, kwargs = MODEL_CASES["qwen3-gqa4-headdim32-yarn"]
    return save_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), model_type, seed=11, dtype=torch.bfloat16,
                                **BASE, **kwargs)


def test_bf16_checkpoint_loaded_as_fp32_matches_transformers(bf16_checkpoint):
    ids = _prompts(256, seed=9)[-1]
    ours = _prefill_logits(load_model(bf16_checkpoint, "fp32"), ids)
    with torch.no_grad():
        ref = load_hf(bf16_checkpoint, torch.float32)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=0)


def test_bf16_checkpoint_loaded_as_bf16(bf16_checkpoint):
    """bf16 error bound relative to transformers' own bf16 run (flash-attention's test rule).

    Both runs round the same weights and activations to bf16, but ours keeps attention's
    softmax and P@V in fp32 where transformers' eager path rounds P to bf16, so ours may be
    closer to the fp32 truth but must not be more than twice as far (plus a small floor).
    """
    ids = _prompts(256, seed=9)[-1]
    model = load_model(bf16_checkpoint, "auto")  # config.json says bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    ours = _prefill_logits(model, ids).float()
    truth = _prefill_logits(load_model(bf16_checkpoint, torch.float32), ids)
    with torch.no_grad():
        hf_bf16 = load_hf(bf16_checkpoint, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    ours_err = (ours - truth).abs().max()
    hf_err = (hf_bf16 - truth).abs().max()
    assert hf_err > 0  # bf16 really differs from fp32 here, so the bound is meaningful
    assert ours_err <= 2 * hf_err + 1e-2, (ours_err, hf_err)


def test_compile_fullgraph_no_graph_break(checkpoints):
    """The forward traces whole (no graph break) and the compiled prefill + decode match eager."""
    from torch._dynamo.utils import counters

    _, ckpt, _ = checkpoints["qwen3-gqa4-headdim32-yarn"]
    model = ckpt.model
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    ids = _prompts(ckpt.config.vocab_size, seed=10)[-1]
    table = shuffled_block_table(1, -(-(len(ids) + 1) // BLOCK_SIZE))
    outputs = []
    for fn in (model, compiled):
        caches = new_kv_caches(ckpt.config, table.numel() + 1, BLOCK_SIZE, torch.float32)
        pre_pos, pre_attn, pre_last = step_metadata([(0, 0, len(ids))], table)
        dec_pos, dec_attn, dec_last = step_metadata([(0, len(ids), 1)], table)
        with torch.no_grad():
            first = fn(torch.tensor(ids), pre_pos, pre_attn, caches, pre_last)
            second = fn(first.argmax(-1), dec_pos.to(torch.int32), dec_attn, caches, dec_last)
        outputs.append((first, second, caches))
    assert counters["graph_break"] == {}
    assert counters["stats"]["unique_graphs"] >= 1
    (e1, e2, ecache), (c1, c2, ccache) = outputs
    torch.testing.assert_close(c1, e1, atol=1e-5, rtol=0)
    torch.testing.assert_close(c2, e2, atol=1e-5, rtol=0)
    # The compiled graph wrote the caches in place: the same positions hold the same keys (to fp32
    # rounding: Inductor may fuse and reorder the torch code).
    written = torch.tensor(table[0].tolist())[: -(-(len(ids) + 1) // BLOCK_SIZE)]
    for (ek, ev), (ck, cv) in zip(ecache, ccache):
        for e, c in ((ek, ck), (ev, cv)):
            got = c[written].flatten(0, 1)[: len(ids) + 1]
            torch.testing.assert_close(got, e[written].flatten(0, 1)[: len(ids) + 1], atol=1e-5, rtol=0)


def test_model_built_directly_runs_and_is_deterministic():
    """QwenForCausalLM(config) without a checkpoint: the engine may build one for tests."""
    from qwen_ops.models.config import QwenConfig

    config = QwenConfig(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=16, qk_norm=True)
    torch.manual_seed(0)
    model = QwenForCausalLM(config).eval()
    assert model.model.rotary_emb.cos_sin.shape == (16, 8)
    table = shuffled_block_table(1, 2)
    runs = []
    for _ in range(2):
        caches = new_kv_caches(config, 3, BLOCK_SIZE, torch.float32)
        positions, attn, last = step_metadata([(0, 0, 5)], table)
        with torch.no_grad():
            runs.append(model(torch.arange(5), positions, attn, caches, last))
    assert torch.isfinite(runs[0]).all()
    assert torch.equal(runs[0], runs[1])
    assert isinstance(attn, AttentionMetadata)


def test_decoder_layer_calls_its_parts_as_modules_and_follows_a_replaced_part():
    """QwenDecoderLayer calls its parts as modules; a part assigned after the choice of forwards is
    called from the next forward on. Oracle: the same layer run with the replaced MLP called by hand."""
    from qwen_ops.models.config import QwenConfig

    config = QwenConfig(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=16, qk_norm=True)
    torch.manual_seed(0)
    model = QwenForCausalLM(config).eval()
    model.process_weights_after_loading()
    layer = model.model.layers[0]
    table = shuffled_block_table(1, 2)
    positions, attn, last = step_metadata([(0, 0, 5)], table)
    with torch.no_grad():
        before = model(torch.arange(5), positions, attn, new_kv_caches(config, 3, BLOCK_SIZE, torch.float32), last)

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.seen = inner, 0

        def forward(self, x):
            self.seen += 1
            return 2 * self.inner(x)

    model._apply(lambda t: t.clone())        # as .to(another device): new buffers; the attention's follow them
    attention = layer.self_attn
    assert attention._block_weights[0] is attention.q_norm.weight
    assert attention._block_weights[1] is attention.k_norm.weight
    assert attention._block_weights[2] is attention.rope_cos_sin
    with torch.no_grad():
        again = model(torch.arange(5), positions, attn, new_kv_caches(config, 3, BLOCK_SIZE, torch.float32), last)
    torch.testing.assert_close(again, before, rtol=0, atol=0)
    layer.mlp = Doubled(layer.mlp)
    with torch.no_grad():
        after = model(torch.arange(5), positions, attn, new_kv_caches(config, 3, BLOCK_SIZE, torch.float32), last)
    assert layer.mlp.seen == 1
    assert not torch.allclose(before, after)
    # the oracle: the embeddings through the layer's parts, called one by one, the MLP's output doubled
    with torch.no_grad():
        caches = new_kv_caches(config, 3, BLOCK_SIZE, torch.float32)
        h = model.model.embed_tokens(torch.arange(5))
        x = layer.input_layernorm(h)
        a = layer.self_attn(x, None, None, positions.to(torch.int32), attn, caches[0])
        x, residual = layer.post_attention_layernorm(a, h)
        out, _ = model.model.norm(2 * layer.mlp.inner(x), residual)
        want = model.lm_head(out)[last]
    torch.testing.assert_close(after, want)
