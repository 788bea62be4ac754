"""A GGUF file (llama.cpp's format) of a dense Qwen3 checkpoint that has no tokenizer, for bench_long.py's
llama.cpp runs (``--llama-gguf``):

    python benchmarks/gguf_from_checkpoint.py CHECKPOINT_DIR OUT.gguf [--dtype bf16|f32] [--gguf-py DIR]

llama.cpp's own ``convert_hf_to_gguf.py`` needs the checkpoint's tokenizer; bench_realsize's random
checkpoint has none. This writes the same tensors under llama.cpp's names (``qwen3`` architecture), the
hyperparameters from ``config.json``, and a tokenizer of type "none" with the checkpoint's vocabulary
size, so llama.cpp runs it on token ids. The norms stay fp32 (as llama.cpp's converter keeps them); the
matrices are written in ``--dtype``. ``gguf`` is llama.cpp's Python package (``pip install gguf``, or
``--gguf-py`` the ``gguf-py`` directory of a llama.cpp source tree).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Hugging Face names of one layer -> llama.cpp's (blk.N. + these + .weight)
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face weight (``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``)."""
    stem, _, leaf = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{leaf}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}.{leaf}"
    raise ValueError(f"weight {hf_name!r} has no llama.cpp name here (a dense Qwen3 checkpoint is expected)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    parser.add_argument("--gguf-py", type=Path, default=None, help="llama.cpp's gguf-py directory")
    args = parser.parse_args(argv)
    if args.gguf_py is not None:
        sys.path.insert(0, str(args.gguf_py))
    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((args.checkpoint / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        raise SystemExit(f"config.json model_type = {cfg.get('model_type')!r}, expected 'qwen3'")
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    w = gguf.GGUFWriter(str(args.out), "qwen3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if args.dtype == "bf16" else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("none")
    w.add_vocab_size(cfg["vocab_size"])
    tensors = {}
    for f in sorted(args.checkpoint.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name, t in tensors.items():
        t = t.float()
        if t.dim() == 1 or args.dtype == "f32":
            w.add_tensor(gguf_name(name), t.numpy())
        else:   # bf16 bits as uint16, with their logical shape
            w.add_tensor(gguf_name(name), t.to(torch.bfloat16).view(torch.int16).numpy().view("uint16"),
                         raw_shape=tuple(t.shape), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: {len(tensors)} tensors, {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
