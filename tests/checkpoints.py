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
