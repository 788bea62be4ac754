"""benchmarks/gguf_from_checkpoint.py: every weight of a Qwen3 checkpoint gets llama.cpp's name for it.

The oracle is llama.cpp's tensor list for its ``qwen3`` architecture (gguf-py's constants: token_embd,
output_norm, output, and per block attn_norm, attn_q / k / v, attn_q_norm / k_norm, attn_output, ffn_norm,
ffn_gate / up / down), written out here, against the names transformers' Qwen3 gives its weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers names the weights")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gguf_from_checkpoint.py"
LLAMA_CPP_BLOCK = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                   "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]


def test_every_qwen3_weight_maps_to_its_llama_cpp_name():
    spec = importlib.util.spec_from_file_location("gguf_from_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=False)
    names = list(transformers.Qwen3ForCausalLM(cfg).state_dict())
    got = sorted(module.gguf_name(n) for n in names)
    want = sorted(["token_embd.weight", "output_norm.weight", "output.weight"]
                  + [f"blk.{i}.{t}.weight" for i in range(2) for t in LLAMA_CPP_BLOCK])
    assert got == want
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts"):
        module.gguf_name("model.layers.0.mlp.experts.0.up_proj.weight")
