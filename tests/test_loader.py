"""qwen_ops.models.loader: sharded and single-file weights, dtypes, tied embeddings, tokenizer, EOS ids,
and every bad-input error naming the file or tensor at fault."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_ops.models.loader import (CheckpointError, load_checkpoint, load_eos_token_ids, load_model, resolve_dtype)
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.tokenizer import load_tokenizer

pytest.importorskip("transformers", reason="transformers writes the test checkpoints")

from qwen_tiny import save_tiny_checkpoint  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, eos_token_id=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """An untied Qwen3 checkpoint in one model.safetensors; tests copy it before breaking it."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", **TINY)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), "qwen3", max_shard_size="8KB", **TINY)


@pytest.fixture
def copy(tiny, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny, dst)
    return dst


def _rewrite(file: Path, edit) -> None:
    """Load every tensor of a safetensors file, let ``edit`` change the dict, save it back."""
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_same_weights(tiny, sharded):
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").is_file()
    a, b = load_model(tiny), load_model(sharded)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert not any(p.is_meta for p in b.parameters())
    assert not any(p.requires_grad for p in b.parameters())


def test_mapping_window_reopens_without_changing_values(tiny, monkeypatch):
    import qwen_ops.models.loader as loader

    want = load_model(tiny, "bf16").state_dict()
    monkeypatch.setattr(loader, "MAP_WINDOW_BYTES", 1)  # unmap after every tensor
    got = load_model(tiny, "bf16").state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype, want", [("float32", torch.float32), ("fp32", torch.float32),
                                         ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         ("fp16", torch.float16), ("float16", torch.float16),
                                         (torch.float16, torch.float16), ("auto", torch.float32)])
def test_dtypes(tiny, dtype, want):
    model = load_model(tiny, dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32  # RoPE table stays fp32
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        src = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, src.to(want))


def test_resolve_dtype_errors(tiny):
    config = QwenConfig.from_pretrained(tiny)
    with pytest.raises(ValueError, match="dtype = 'int8'; expected a torch dtype or one of"):
        resolve_dtype("int8", config)
    with pytest.raises(ValueError, match="resolves to torch.float64"):
        resolve_dtype(torch.float64, config)
    with pytest.raises(TypeError, match="expected a torch.dtype or a str"):
        resolve_dtype(16, config)


def test_tied_checkpoint_with_or_without_lm_head(copy):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    # transformers 5 drops lm_head.weight from tied checkpoints; 4.x-era files often keep it.
    with_head = load_model(copy)
    assert with_head.lm_head.weight is with_head.model.embed_tokens.weight
    _rewrite(copy / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    without = load_model(copy)
    assert without.lm_head.weight is without.model.embed_tokens.weight
    assert torch.equal(without.lm_head.weight, with_head.model.embed_tokens.weight)


def test_checkpoint_fields_and_eos_ids(copy):
    ckpt = load_checkpoint(copy)
    assert ckpt.eos_token_ids == (3,)  # generation_config.json and config.json both say 3
    assert ckpt.tokenizer is None
    with pytest.raises(ValueError, match="has no tokenizer.json, so it cannot encode or decode text"):
        ckpt.require_tokenizer()
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3, 9]}))
    assert load_eos_token_ids(copy, ckpt.config) == (7, 3, 9)
    (copy / "generation_config.json").unlink()
    assert load_eos_token_ids(copy, ckpt.config) == (3,)


def test_tokenizer_round_trip(copy):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def fibonacci(n):\n    return n"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(copy / "tokenizer.json"))
    ckpt = load_checkpoint(copy)
    text = "def fibonacci(n):\n    return n  # é"
    ids = ckpt.require_tokenizer().encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert ckpt.tokenizer.decode(ids) == text
    assert ckpt.tokenizer.token_to_id("<|endoftext|>") == 0
    (copy / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot read tokenizer"):
        load_tokenizer(copy)


# ----------------------------------------------------------------------------- bad input


def test_missing_config_json(copy):
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt/config\.json: no such file"):
        load_checkpoint(copy)


def test_missing_weight_file(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weight file: expected model\.safetensors or "
                                                r"model\.safetensors\.index\.json"):
        load_model(copy)


def test_missing_shard(sharded, tmp_path):
    dst = shutil.copytree(sharded, tmp_path / "ckpt")
    victim = sorted(dst.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{victim.name}: weight file is missing \(named in .*index\.json"):
        load_model(dst)


def test_tensor_missing_from_its_shard(sharded, tmp_path):
    dst = shutil.copytree(sharded, tmp_path / "ckpt")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_norm.weight"
    shard = dst / index["weight_map"][name]
    _rewrite(shard, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing from .*{shard.name}"):
        load_model(dst)


@pytest.mark.parametrize("garbage", [b"\xff" * 64, struct.pack("<Q", 10 ** 12) + b"{}",
                                     struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 16])
def test_corrupt_safetensors_header(copy, garbage):
    (copy / "model.safetensors").write_bytes(garbage)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or unreadable safetensors file"):
        load_model(copy)


def test_truncated_safetensors_file(copy):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or unreadable"):
        load_model(copy)


def test_unsupported_model_type(copy):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type = 'mistral' is not supported; "
                                         r"supported model types: qwen2, qwen3"):
        load_checkpoint(copy)


def test_unsupported_rope_type(copy):
    config = json.loads((copy / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: rope type 'dynamic' is not supported"):
        load_checkpoint(copy)


def test_misshaped_tensor(copy):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(copy / "model.safetensors", lambda t: t.__setitem__(name, torch.randn(8, 32)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*model\.safetensors has shape \[8, 32\], "
                                              r"expected \[16, 32\]"):
        load_model(copy)


def test_missing_and_unexpected_tensors_are_all_listed(copy):
    def edit(t):
        t.pop("model.norm.weight")
        t.pop("model.layers.0.mlp.down_proj.weight")
        t["model.layers.0.self_attn.q_proj.bias"] = torch.randn(32)
    _rewrite(copy / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as e:
        load_model(copy)
    msg = str(e.value)
    assert "missing tensor 'model.norm.weight' (not in" in msg and "model.safetensors)" in msg
    assert "missing tensor 'model.layers.0.mlp.down_proj.weight'" in msg
    assert "unexpected tensor 'model.layers.0.self_attn.q_proj.bias' in" in msg


def test_quantized_tensor_dtype_is_rejected(copy):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(copy / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(48, 32, dtype=torch.int8)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .* has dtype I8"):
        load_model(copy)


def test_old_rotary_buffers_are_ignored(copy):
    _rewrite(copy / "model.safetensors",
             lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.randn(4)))
    load_model(copy)


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "nope")


# ----------------------------------------------------------------------------- sizes checked before building
def _edit_config(ckpt: Path, **changes) -> None:
    file = ckpt / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_a_config_with_more_layers_than_the_weights_fails_before_building(copy, monkeypatch):
    import qwen_ops.models.loader as loader

    _edit_config(copy, num_hidden_layers=1000)

    def must_not_build(*args, **kwargs):
        raise AssertionError("the model was built before the layer count was checked")

    monkeypatch.setattr(loader, "QwenForCausalLM", must_not_build)
    with pytest.raises(CheckpointError) as info:
        load_model(copy)
    assert "config.json: num_hidden_layers = 1000, but the checkpoint's weights hold layers 0..1 (2 layers)" \
        in str(info.value)


def test_the_rope_table_holds_only_max_positions_rows(copy):
    _edit_config(copy, max_position_embeddings=1 << 22)
    model = load_model(copy, max_positions=48)
    table = model.model.rotary_emb.cos_sin
    assert table.shape[0] == 48
    # The rows it holds are the full table's rows: an independent fp64 computation of default RoPE.
    cfg = QwenConfig.from_pretrained(copy)
    half = table.shape[1] // 2
    inv = 1.0 / (cfg.rope.theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    angles = torch.arange(48, dtype=torch.float64)[:, None] * inv[None, :]
    assert torch.allclose(table.double(), torch.cat((angles.cos(), angles.sin()), dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match=r"num_positions = 0, expected an int in \[1, max_position_embeddings"):
        load_model(copy, max_positions=0)
