"""QwenConfig: config.json of transformers 4.x and 5.x, defaults as transformers, RoPE frequencies, errors."""

from __future__ import annotations

import json

import pytest
import torch

from qwen_ops.models.config import ARCHITECTURES, QwenConfig, RopeConfig

transformers = pytest.importorskip("transformers", reason="transformers is the reference for defaults and RoPE")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
# rope dicts (5.x spelling) whose frequencies must equal transformers' own.
ROPE_CASES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 1000000},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
    {"rope_type": "linear", "factor": 8, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0},  # original defaults to max_position
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
     "attention_factor": 0.8},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
     "mscale": 1.0, "mscale_all_dim": 0.5},
]


def _hf_config(model_type: str, **kwargs):
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    return cls(**{**SMALL, **kwargs})


def _saved_dict(hf_config) -> dict:
    """What ``save_pretrained`` would write to config.json."""
    return json.loads(hf_config.to_json_string())


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda r: "-".join(str(v) for v in r.values()))
def test_rope_frequencies_equal_transformers(model_type, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config(model_type, head_dim=16, rope_parameters=dict(rope))
    ours = QwenConfig.from_dict(_saved_dict(hf))
    if rope["rope_type"] == "default":
        model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
        rotary = model_cls(hf).model.rotary_emb
        want, want_scaling = rotary.inv_freq, rotary.attention_scaling
    else:
        want, want_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, torch.device("cpu"))
    got, scaling = ours.rope.inv_freq_and_scaling(ours.head_dim, ours.max_position_embeddings)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert scaling == want_scaling


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("attention_bias", [None, False, True])
@pytest.mark.parametrize("head_dim", [None, 16])
def test_architecture_follows_transformers(model_type, attention_bias, head_dim):
    """head_dim and which projections have a bias: read off a transformers model of the same config."""
    kwargs = {} if attention_bias is None else {"attention_bias": attention_bias}
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    d = {**SMALL, "model_type": model_type, "rope_theta": 10000.0, **kwargs}  # a hand-written config.json
    ours = QwenConfig.from_dict(d)
    hf_config = transformers.AutoConfig.for_model(**d)
    attn = transformers.AutoModelForCausalLM.from_config(hf_config).model.layers[0].self_attn
    assert ours.head_dim == attn.head_dim
    assert ours.attention_bias == (attn.q_proj.bias is not None) == (attn.k_proj.bias is not None)
    assert ours.o_proj_bias == (attn.o_proj.bias is not None)
    assert ours.qk_norm == hasattr(attn, "q_norm")


def test_transformers_4x_and_5x_layouts_agree():
    common = {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
    v5 = {**common, "dtype": "bfloat16",
          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                              "original_max_position_embeddings": 32}}
    v4 = {**common, "torch_dtype": "bfloat16", "rope_theta": 1e6,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    a, b = QwenConfig.from_dict(v5), QwenConfig.from_dict(v4)
    assert a == b
    assert a.rope.theta == 1e6 and a.rope.rope_type == "yarn" and a.dtype == torch.bfloat16
    plain4 = QwenConfig.from_dict({**common, "rope_theta": 5e5, "rope_scaling": None})
    assert plain4.rope == RopeConfig(rope_type="default", theta=5e5)


def test_real_config_json_round_trip(tmp_path):
    hf = _hf_config("qwen3", head_dim=8, tie_word_embeddings=True, eos_token_id=[3, 5], rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 123456.0})
    hf.save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        c = QwenConfig.from_pretrained(source)
        assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("qwen3", 64, 32, 2)
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 8)
        assert c.max_position_embeddings == 128 and c.rms_norm_eps == 1e-5
        assert c.tie_word_embeddings and c.qk_norm and c.eos_token_ids == (3, 5)
        assert c.rope.theta == 123456.0 and c.torch_dtype is None  # a bare config saves no dtype


def test_missing_theta_is_an_error_naming_the_file(tmp_path):
    d = {**SMALL, "model_type": "qwen3", "rope_parameters": {"rope_type": "default"}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"config\.json: no RoPE theta"):
        QwenConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no RoPE theta"):
        QwenConfig.from_dict({**SMALL, "model_type": "qwen2"})


def test_unsupported_model_type_names_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": "gemma", "rope_theta": 1e4}))
    with pytest.raises(ValueError) as e:
        QwenConfig.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "'gemma'" in msg and "config.json" in msg
    assert all(t in msg for t in ARCHITECTURES)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"type": "longrope"},
                                  {"rope_type": "llama3", "factor": 8.0}])
def test_unsupported_rope_type(tmp_path, rope):
    d = {**SMALL, "model_type": "qwen3", "rope_parameters": {**rope, "rope_theta": 1e4}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"config\.json: rope type '\w+' is not supported; supported: default"):
        QwenConfig.from_pretrained(tmp_path)


def test_bad_configs(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        QwenConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        QwenConfig.from_pretrained(tmp_path)
    base = {**SMALL, "model_type": "qwen2", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="'vocab_size' is missing"):
        QwenConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="hidden_act = 'gelu'"):
        QwenConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        QwenConfig.from_dict({**base, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads = 3"):
        QwenConfig.from_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        QwenConfig.from_dict({**base, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="eos_token_id"):
        QwenConfig.from_dict({**base, "eos_token_id": "</s>"})
    with pytest.raises(ValueError, match="'linear' needs a numeric 'factor'"):
        QwenConfig.from_dict({**base, "rope_scaling": {"type": "linear"}})
    # A window flag without sliding layers (or no window size) is plain full attention, as in transformers.
    assert QwenConfig.from_dict({**base, "use_sliding_window": False, "sliding_window": 64}).head_dim == 8


def test_config_is_frozen_and_validated():
    c = QwenConfig.from_dict({**SMALL, "model_type": "qwen3", "rope_theta": 1e4})
    with pytest.raises(AttributeError):
        c.head_dim = 3
    with pytest.raises(ValueError, match="model_type = 'gpt2'"):
        QwenConfig(model_type="gpt2", vocab_size=1, hidden_size=1, intermediate_size=1, num_hidden_layers=1,
                   num_attention_heads=1, num_key_value_heads=1, head_dim=2, max_position_embeddings=1)
    with pytest.raises(ValueError, match="head_dim = 3, expected an even number"):
        QwenConfig(model_type="qwen2", vocab_size=1, hidden_size=1, intermediate_size=1, num_hidden_layers=1,
                   num_attention_heads=1, num_key_value_heads=1, head_dim=3, max_position_embeddings=1)


# ----------------------------------------------------------------------------- bounds and field-named errors
def _write(tmp_path, data) -> None:
    (tmp_path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("field, value, expected", [
    ("num_hidden_layers", 1_000_000, "num_hidden_layers = 1000000, expected a positive int <= 1024"),
    ("max_position_embeddings", 10 ** 9, "max_position_embeddings = 1000000000, expected a positive int <= 16777216"),
    ("vocab_size", 10 ** 9, "vocab_size = 1000000000, expected a positive int <= 4194304"),
    ("num_key_value_heads", 0, "num_key_value_heads = 0, expected a positive int <= 1024"),   # not "absent"
    ("num_attention_heads", 0, "num_attention_heads = 0, expected a positive int <= 1024"),   # was ZeroDivisionError
    ("head_dim", 4096, "head_dim = 4096, expected a positive int <= 1024"),
    ("intermediate_size", 0, "intermediate_size = 0, expected a positive int <= 262144"),
    ("rms_norm_eps", "abc", "rms_norm_eps = 'abc', expected a finite number > 0"),
    ("rope_theta", 0, "rope_theta = 0, expected a finite number > 0"),
    ("rope_theta", -1e4, "rope_theta = -10000.0, expected a finite number > 0"),
])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_every_size_is_bounded_and_named_with_its_file(tmp_path, model_type, field, value, expected):
    _write(tmp_path, {**SMALL, "model_type": model_type, "rope_theta": 1e4, field: value})
    with pytest.raises(ValueError) as info:
        QwenConfig.from_pretrained(tmp_path)
    assert str(info.value) == f"{tmp_path / 'config.json'}: {expected}"


@pytest.mark.parametrize("field, value", [("num_experts", 10 ** 6), ("moe_intermediate_size", 10 ** 7),
                                          ("num_experts_per_tok", 0)])
def test_moe_sizes_are_bounded(tmp_path, field, value):
    _write(tmp_path, {**SMALL, "model_type": "qwen3_moe", "rope_theta": 1e4, field: value})
    with pytest.raises(ValueError, match=rf"config\.json: {field} = {value}, expected a positive int <= \d+$"):
        QwenConfig.from_pretrained(tmp_path)


def test_linear_attention_sizes_are_bounded(tmp_path):
    _write(tmp_path, {**SMALL, "model_type": "qwen3_5_text", "rope_theta": 1e4, "linear_key_head_dim": 10 ** 5})
    with pytest.raises(ValueError, match=r"config\.json: linear_key_head_dim = 100000, expected a positive int <= 1024$"):
        QwenConfig.from_pretrained(tmp_path)


def test_a_binary_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ValueError, match=r"config\.json: not UTF-8 text, so not a config\.json"):
        QwenConfig.from_pretrained(tmp_path)


def test_deeply_nested_config_json_is_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        QwenConfig.from_pretrained(tmp_path)
