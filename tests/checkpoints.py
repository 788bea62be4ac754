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


def make_qwen3_5_checkpoint(path: Path, *, seed: int = 0) -> Path:
    """A tiny Qwen3.5 hybrid (linear, linear, linear, full attention) with random, peaked weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(vocab_size=128, intermediate_size=64, max_position_embeddings=256, rms_norm_eps=1e-6,
                            hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=12, eos_token_id=1,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
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
