"""Tiny random Hugging Face Qwen checkpoints for engine/scheduler tests (transformers is test-only)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_qwen3_checkpoint(path: Path, *, vocab_size: int = 128, hidden_size: int = 64, layers: int = 2,
                          heads: int = 4, kv_heads: int = 2, head_dim: int = 16, seed: int = 0,
                          eos_token_id: int = 1, max_position_embeddings: int = 512) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                      rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=eos_token_id,
                      bos_token_id=0)
    model = Qwen3ForCausalLM(cfg)
    # Larger-than-default weights make the logits peaked, so greedy ties (and flaky argmax) are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def make_qwen3_5_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen3.5 hybrid (linear, linear, linear, full attention) with random, peaked weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=128, intermediate_size=64, max_position_embeddings=256, rms_norm_eps=1e-6,
                  hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    cfg = Qwen3_5TextConfig(**{**kwargs, **overrides})
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return Path(path)


# --------------------------------------------------------------------------------------------
# Mixture-of-experts models: qwen3_moe, qwen3_next, qwen3_5_moe
# --------------------------------------------------------------------------------------------

# Shared sizes of the tiny MoE checkpoints (several experts, top-k 2; tests override any of them).
MOE_BASE = dict(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=32,
                max_position_embeddings=256, rms_norm_eps=1e-6, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=8, num_experts_per_tok=2)
# The hybrids' extra sizes (Gated DeltaNet) and a layer pattern with both kinds.
MOE_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                  shared_expert_intermediate_size=40, num_hidden_layers=3,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})


def randomize_moe(model) -> None:
    """Random values in every weight, peaked enough for clear greedy margins and routing.

    Plain-weight norms (Qwen3-MoE's, the gated norm) around 1, (1 + weight) norms around 0; the
    router a little stronger than the rest, so that no token's k-th and (k+1)-th expert are near a tie.
    """
    offset_norms = model.config.model_type != "qwen3_moe"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or (name.endswith("norm.weight") and not offset_norms):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.4)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)


def make_moe_checkpoint(path: Path, model_type: str, *, seed: int = 0, original_format: bool = True,
                        **overrides) -> Path:
    """A tiny random ``model_type`` checkpoint (qwen3_moe, qwen3_next, qwen3_5_moe_text) saved by transformers.

    ``original_format=False`` saves the stacked expert tensors (``mlp.experts.gate_up_proj``) instead of
    one tensor per expert (``save_pretrained(..., save_original_format=False)``).
    """
    import transformers

    classes = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(num_hidden_layers=2)),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, MOE_HYBRID),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, MOE_HYBRID),
    }
    config_cls, model_cls, extra = classes[model_type]
    kwargs = dict(MOE_BASE, **extra)
    if model_type == "qwen3_5_moe_text":    # no dense MLP layers, no routing flags
        kwargs.pop("intermediate_size")
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    randomize_moe(model)
    model.save_pretrained(path, save_original_format=original_format)
    return Path(path)


def save_word_tokenizer(path: Path, vocab_size: int = 128) -> Path:
    """A word-level ``tokenizer.json`` for a tiny checkpoint: token id i is the word ``w<i>``, so a served
    reply's text maps back to token ids (``text.split()``) and token-id prompts need no real vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(path) / "tokenizer.json"))
    return Path(path)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(base: Path, out: Path, r: int, targets=LORA_TARGETS, seed: int = 0, rslora: bool = False,
                      **extra) -> Path:
    """A random peft LoRA adapter of ``base`` saved to ``out``: A and B both nonzero (peft starts B at
    zero, a no-op adapter that would test nothing), alpha = 2 r."""
    import peft

    from qwen_tiny import load_hf

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                          **extra)
    model = peft.get_peft_model(load_hf(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return Path(out)
