"""A checkpoint with one unexpected tensor under a layer index (``model.layers.7.bogus.weight`` in a
2-layer Qwen3) is reported as that unexpected tensor, naming it and its file; it is no layer-count
mismatch. A config whose num_hidden_layers differs from the layers the files really hold still gets
the layer-count message. Checkpoints are written by transformers; the expected messages are the
names this test put in the files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_ops.models.loader import CheckpointError, load_model

pytest.importorskip("transformers", reason="transformers writes the test checkpoints")

from qwen_tiny import save_tiny_checkpoint  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, eos_token_id=3)
BOGUS = "model.layers.7.bogus.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", **TINY)


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny3"), "qwen3", **{**TINY, "num_hidden_layers": 3})


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), "qwen3", max_shard_size="8KB", **TINY)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(file: Path, edit) -> None:
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _set_layers(ckpt: Path, n: int) -> None:
    file = ckpt / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "num_hidden_layers": n}))


def _error(ckpt: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt)
    return str(info.value)


@pytest.mark.parametrize("bogus", [BOGUS, "model.layers.2.bogus.weight", "model.layers.2.self_attn.extra.weight"])
def test_a_stray_tensor_under_a_new_layer_index_is_named_as_unexpected(tiny, tmp_path, bogus):
    ckpt = _copy(tiny, tmp_path)
    file = ckpt / "model.safetensors"
    _rewrite(file, lambda t: t.__setitem__(bogus, torch.zeros(4)))
    msg = _error(ckpt)
    assert f"unexpected tensor '{bogus}' in {file}" in msg, msg
    assert "num_hidden_layers" not in msg and "layer indices" not in msg, msg


def test_the_llm_names_the_stray_tensor(tiny, tmp_path):
    from qwen_ops import LLM

    ckpt = _copy(tiny, tmp_path)
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(BOGUS, torch.zeros(4)))
    with pytest.raises(CheckpointError) as info:
        LLM(str(ckpt), max_model_len=32, max_num_seqs=1)
    assert f"unexpected tensor '{BOGUS}'" in str(info.value) and "num_hidden_layers" not in str(info.value)


def test_a_stray_tensor_in_its_own_shard_of_an_indexed_checkpoint(sharded, tmp_path):
    ckpt = _copy(sharded, tmp_path)
    extra = ckpt / "extra.safetensors"
    save_file({BOGUS: torch.zeros(4)}, str(extra), metadata={"format": "pt"})
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][BOGUS] = extra.name
    index.write_text(json.dumps(data))
    msg = _error(ckpt)
    assert f"unexpected tensor '{BOGUS}' in {extra}" in msg and "num_hidden_layers" not in msg, msg


@pytest.mark.parametrize("n", [1, 3])
def test_a_real_layer_count_mismatch_still_says_num_hidden_layers(tiny, tmp_path, n):
    ckpt = _copy(tiny, tmp_path)
    _set_layers(ckpt, n)
    msg = _error(ckpt)
    assert f"config.json: num_hidden_layers = {n}, but the checkpoint's weights hold layers 0..1 (2 layers)" in msg


def test_a_layer_count_mismatch_beside_a_stray_tensor_is_still_the_layer_count(tiny3, tmp_path):
    ckpt = _copy(tiny3, tmp_path)                 # three real layers, config says two
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(BOGUS, torch.zeros(4)))
    _set_layers(ckpt, 2)
    msg = _error(ckpt)
    assert "config.json: num_hidden_layers = 2, but the checkpoint's weights hold layers 0..2 (3 layers)" in msg


def test_a_missing_middle_layer_is_a_layer_count_mismatch(tiny3, tmp_path):
    ckpt = _copy(tiny3, tmp_path)
    _rewrite(ckpt / "model.safetensors",
             lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")])
    msg = _error(ckpt)
    assert "config.json: num_hidden_layers = 3, but the checkpoint's weights hold 2 layer indices (2 layers)" in msg


def test_the_clean_checkpoint_loads(tiny):
    model = load_model(tiny)
    assert len(model.model.layers) == 2
