"""QwenConfig: the architecture of a Qwen checkpoint, read from a Hugging Face ``config.json``.

Reads files written by transformers 4.x (``rope_theta`` / ``rope_scaling`` at top level,
``torch_dtype``) and 5.x (``rope_parameters`` holding theta and scaling, ``dtype``). Defaults
follow the transformers class of each ``model_type`` so that a config means here what it
means there (for instance a Qwen3 config without ``head_dim`` has head_dim 128, Qwen2 always
has q/k/v biases). The one deliberate exception: a config without a RoPE theta is an error,
never a silent 10000.

Hybrid Qwen3.5 models (``qwen3_5_text``, and ``qwen3_5`` whose ``text_config`` is read) add
``layer_types`` (or transformers' ``full_attention_interval`` default), the Gated DeltaNet sizes
(:class:`LinearAttentionConfig`) and ``partial_rotary_factor`` (default 0.25, as transformers).

Mixture-of-experts models add :class:`MoeConfig` (experts, top-k, expert and shared-expert sizes,
``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``): ``qwen3_moe`` (Qwen3 attention),
``qwen3_next`` (hybrid, its Gated DeltaNet projections fused as ``in_proj_qkvz`` / ``in_proj_ba``) and
``qwen3_5_moe_text`` / ``qwen3_5_moe`` (the Qwen3.5 hybrid; the router always renormalises its top-k
and every layer is sparse). Each field defaults as transformers' config class of that type does.

RoPE frequencies are computed exactly as transformers 5.x's rope init functions
(``modeling_rope_utils.py``) compute them, in fp32, so that cos/sin tables match bit for bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

CONFIG_FILE = "config.json"

# Upper bounds of the sizes a config.json names, checked before anything is built or allocated
# (a config claiming a million layers used to build them all before the checkpoint said no).
# Each is far above every published Qwen model (Qwen3-235B-A22B: 94 layers, 64 query heads, hidden
# 4096, vocab 151,936, 128 experts; Qwen2.5-1M: 1,010,000 positions).
MAX_SIZES = MappingProxyType({
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24,
    # Gated DeltaNet and mixture-of-experts sizes
    "linear_num_key_heads": 1024, "linear_num_value_heads": 1024, "linear_key_head_dim": 1024,
    "linear_value_head_dim": 1024, "linear_conv_kernel_dim": 64, "num_experts": 1 << 14,
    "num_experts_per_tok": 1 << 10, "moe_intermediate_size": 1 << 18, "shared_expert_intermediate_size": 1 << 18,
    "decoder_sparse_step": 1024,
})


def check_size(name: str, value: Any, what: str = "", low: int = 1) -> int:
    """``value`` as an int in [low, MAX_SIZES[name]], or a ValueError naming ``what`` (default ``name``)."""
    high = MAX_SIZES[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        kind = "a positive int" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{what or name} = {value!r}, expected {kind} <= {high}")
    return value


def _number(value: Any, what: str, positive: bool = True) -> float:
    """A finite JSON number (> 0 with ``positive``) as a float, or a ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ValueError(f"{what} = {value!r}, expected a finite number" + (" > 0" if positive else ""))
    return float(value)


@dataclass(frozen=True)
class MoeDefaults:
    """A mixture-of-experts ``model_type``'s transformers defaults, and which fields it reads."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: Optional[int]  # None: the architecture has no shared expert
    norm_topk_prob: Optional[bool]  # default of the flag; None: no flag, the top-k is always renormalised
    sparse_step: bool               # reads decoder_sparse_step and mlp_only_layers (else every layer is sparse)


@dataclass(frozen=True)
class Architecture:
    """What a ``model_type`` implies beyond the numbers in its config.json."""
    qk_norm: bool                   # per-head RMSNorm on q and k before RoPE (Qwen3)
    qkv_bias: Optional[bool]        # fixed q/k/v bias, or None = read ``attention_bias``
    o_bias_follows_attention_bias: bool  # o_proj has a bias when ``attention_bias`` is true
    default_head_dim: Optional[int]  # head_dim when config.json has none; None = hidden / heads
    default_attention_bias: bool
    hybrid: bool = False            # Gated DeltaNet + gated full attention layers (qwen_ops.models.hybrid)
    default_partial_rotary_factor: float = 1.0  # when config.json names none
    moe: Optional[MoeDefaults] = None  # mixture-of-experts MLPs (qwen_ops.models.moe); None = dense MLPs
    fused_linear_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba (else Qwen3.5's four)
    text_model_type: Optional[str] = None   # a multimodal wrapper: its text_config has this model_type


# Supported model types. transformers' Qwen2Attention hard-codes bias=True on q/k/v and False on
# o_proj whatever ``attention_bias`` says; Qwen3Attention uses ``attention_bias`` (default False)
# for all four projections and defaults head_dim to 128. A later ``qwen3_5_text`` adds a row here.
ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType({
    "qwen2": Architecture(qk_norm=False, qkv_bias=True, o_bias_follows_attention_bias=False,
                          default_head_dim=None, default_attention_bias=True),
    "qwen3": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                          default_head_dim=128, default_attention_bias=False),
    # Llama (LlamaConfig: SmolLM2, and what GGUF files of Llama-architecture models hold): Qwen2's layers
    # with ``attention_bias`` (default False) on all four projections, head_dim hidden / heads by default.
    "llama": Architecture(qk_norm=False, qkv_bias=None, o_bias_follows_attention_bias=True,
                          default_head_dim=None, default_attention_bias=False),
    # Qwen3.5 text model (Qwen3_5TextConfig): attention_bias on all four projections, head_dim 256,
    # partial_rotary_factor 0.25 by default. "qwen3_5" is the multimodal wrapper: its text_config is
    # read and only the language model (checkpoint names model.language_model.*) is loaded.
    "qwen3_5_text": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                                 default_head_dim=256, default_attention_bias=False, hybrid=True,
                                 default_partial_rotary_factor=0.25),
    "qwen3_5": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                            default_head_dim=256, default_attention_bias=False, hybrid=True,
                            default_partial_rotary_factor=0.25, text_model_type="qwen3_5_text"),
    # Qwen3 attention (head_dim defaults to hidden / heads: Qwen3MoeConfig has no head_dim field) and
    # sparse MoE MLPs; transformers 5.x writes num_experts as "num_local_experts".
    "qwen3_moe": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                              default_head_dim=None, default_attention_bias=False,
                              moe=MoeDefaults(128, 8, 768, None, norm_topk_prob=False, sparse_step=True)),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) and sparse MoE MLPs with a
    # sigmoid-gated shared expert (transformers' Qwen2MoeConfig defaults).
    "qwen2_moe": Architecture(qk_norm=False, qkv_bias=True, o_bias_follows_attention_bias=False,
                              default_head_dim=None, default_attention_bias=True,
                              moe=MoeDefaults(60, 4, 1408, 5632, norm_topk_prob=False, sparse_step=True)),
    # Qwen3-Next: the Qwen3.5 hybrid layout with fused Gated DeltaNet input projections, and MoE MLPs
    # with a sigmoid-gated shared expert.
    "qwen3_next": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                               default_head_dim=256, default_attention_bias=False, hybrid=True,
                               default_partial_rotary_factor=0.25, fused_linear_projections=True,
                               moe=MoeDefaults(512, 10, 512, 512, norm_topk_prob=True, sparse_step=True)),
    # Qwen3.5-MoE text model; "qwen3_5_moe" is its multimodal wrapper (language model only, as qwen3_5).
    "qwen3_5_moe_text": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                                     default_head_dim=256, default_attention_bias=False, hybrid=True,
                                     default_partial_rotary_factor=0.25,
                                     moe=MoeDefaults(256, 8, 512, 512, norm_topk_prob=None, sparse_step=False)),
    "qwen3_5_moe": Architecture(qk_norm=True, qkv_bias=None, o_bias_follows_attention_bias=True,
                                default_head_dim=256, default_attention_bias=False, hybrid=True,
                                default_partial_rotary_factor=0.25, text_model_type="qwen3_5_moe_text",
                                moe=MoeDefaults(256, 8, 512, 512, norm_topk_prob=None, sparse_step=False)),
})

# Layer kinds of hybrid models, as transformers names them in ``layer_types``.
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
DEFAULT_FULL_ATTENTION_INTERVAL = 4   # transformers' default when config.json has no layer_types

ROPE_TYPES = ("default", "linear", "yarn")

# Keys of a rope dict that carry no meaning for the supported types (written by some exporters).
_IGNORED_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``inv_freq_and_scaling`` turns them into frequencies."""
    rope_type: str = "default"
    theta: float = 10000.0
    factor: Optional[float] = None                       # linear, yarn
    original_max_position_embeddings: Optional[int] = None  # yarn
    attention_factor: Optional[float] = None             # yarn: scale applied to cos/sin
    beta_fast: Optional[float] = None                    # yarn, default 32
    beta_slow: Optional[float] = None                    # yarn, default 1
    mscale: Optional[float] = None                       # yarn (DeepSeek style attention factor)
    mscale_all_dim: Optional[float] = None
    truncate: bool = True                                # yarn: floor/ceil the correction range
    partial_rotary_factor: float = 1.0                   # fraction of head_dim that is rotated (Qwen3.5)

    def rotary_dim(self, head_dim: int) -> int:
        """Leading channels of a head that RoPE rotates (transformers: ``int(head_dim * partial_rotary_factor)``)."""
        return int(head_dim * self.partial_rotary_factor)

    def inv_freq_and_scaling(self, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        """fp32 CPU inverse frequencies ``[head_dim // 2]`` and the factor cos/sin are multiplied by.

        Mirrors transformers' ``compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters``
        and ``_compute_yarn_parameters`` operation for operation (same dtypes, same order).
        """
        dim = head_dim
        base = self.theta
        if self.rope_type == "default":
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
        if self.rope_type == "linear":
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
            inv_freq = 1.0 / (base ** exponents)
            return inv_freq / self.factor, 1.0
        if self.rope_type == "yarn":
            return self._yarn(dim, max_position_embeddings)
        raise ValueError(f"rope_type = {self.rope_type!r}; expected one of {', '.join(ROPE_TYPES)}")

    def _yarn(self, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        base = self.theta
        original = self.original_max_position_embeddings or max_position_embeddings
        factor = self.factor if self.factor is not None else max_position_embeddings / original

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = self.attention_factor
        if attention_factor is None:
            if self.mscale and self.mscale_all_dim:
                attention_factor = float(get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        beta_fast = self.beta_fast or 32
        beta_slow = self.beta_slow or 1

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp

        pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp.to(dtype=torch.float)
        inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                    + inv_freq_extrapolation * extrapolation_factor)
        return inv_freq, float(attention_factor)


def _read_mtp_layers(d: Mapping[str, Any], source: str) -> int:
    key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in d else "mtp_num_hidden_layers"
    value = d.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}: {key} = {value!r}, expected an int >= 0")
    return value


@dataclass(frozen=True)
class QwenConfig:
    """Architecture and numbers of a dense Qwen2/Qwen3 model (the fields the model and engine read)."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # bias on q_proj, k_proj, v_proj
    o_proj_bias: bool = False      # bias on o_proj
    qk_norm: bool = False          # per-head q_norm / k_norm (Qwen3)
    torch_dtype: Optional[str] = None  # "bfloat16", ... as written in config.json; None if absent
    eos_token_ids: tuple[int, ...] = ()  # from config.json only; see loader.load_eos_token_ids
    # Hybrid models only (qwen3_5_text, qwen3_5, qwen3_next, qwen3_5_moe*): the kind of every layer, and
    # the linear layers' sizes.
    layer_types: tuple[str, ...] = ()
    linear: Optional["LinearAttentionConfig"] = None
    # Mixture-of-experts models only (qwen3_moe, qwen3_next, qwen3_5_moe*).
    moe: Optional["MoeConfig"] = None
    # Multi-token-prediction layers (``mtp.*`` weights; ``num_nextn_predict_layers`` of Qwen3-Next,
    # ``mtp_num_hidden_layers`` of Qwen3.5): the proposer of speculative ``"method": "mtp"``.
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(_unsupported_type_message(self.model_type, "<QwenConfig>"))
        check_size("num_hidden_layers", self.num_hidden_layers)
        if self.is_hybrid:
            _check_hybrid(self)
        elif self.layer_types or self.linear is not None:
            raise ValueError(f"model_type = {self.model_type!r} has only full-attention layers; layer_types and "
                             f"linear belong to hybrid model types ({', '.join(_types(lambda a: a.hybrid))})")
        if ARCHITECTURES[self.model_type].moe is not None:
            if self.moe is None:
                raise ValueError(f"model_type = {self.model_type!r} is a mixture-of-experts model and needs its "
                                 "expert sizes (moe=MoeConfig(...))")
            _check_moe(self.moe, self.num_hidden_layers)
        elif self.moe is not None:
            raise ValueError(f"model_type = {self.model_type!r} has dense MLPs; moe belongs to mixture-of-experts "
                             f"model types ({', '.join(_types(lambda a: a.moe is not None))})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            check_size(name, getattr(self, name))
        _number(self.rms_norm_eps, "rms_norm_eps")
        _number(self.rope.theta, "rope_theta")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads = {self.num_key_value_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = {self.head_dim}, expected an even number (RoPE rotates pairs)")
        if self.rope.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type = {self.rope.rope_type!r}; expected one of {', '.join(ROPE_TYPES)}")

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet (linear attention) layers beside gated full attention (qwen_ops.models.hybrid)."""
        return ARCHITECTURES[self.model_type].hybrid

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The checkpoint's dtype as a torch dtype (None when config.json names none)."""
        return None if self.torch_dtype is None else getattr(torch, self.torch_dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, overrides: Optional[Mapping[str, Any]] = None) -> "QwenConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself), or a GGUF file's metadata;
        ``overrides``: keys laid over it before it is read (vLLM's ``hf_overrides``)."""
        from qwen_ops.models.gguf import gguf_of

        gguf = gguf_of(path)
        if gguf is not None:            # a GGUF file: its metadata as a config.json would hold it
            source = str(gguf.path) + (" with hf_overrides" if overrides else "")
            return cls.from_dict(_lay_over(gguf.config_dict(), overrides or {}), source=source)
        path = Path(path)
        file = path / CONFIG_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no such file; a Hugging Face checkpoint directory must hold "
                                    f"{CONFIG_FILE}")
        try:
            data = json.loads(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{file}: not UTF-8 text, so not a config.json ({e})") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
        if overrides:
            return cls.from_dict(_lay_over(data, overrides), source=f"{file} with hf_overrides")
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "QwenConfig":
        """Build from the dict of a config.json; ``source`` names the file in error messages."""
        d = dict(d)
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(_unsupported_type_message(model_type, source))
        arch = ARCHITECTURES[model_type]
        outer: Mapping[str, Any] = {}
        if arch.text_model_type is not None:   # multimodal wrapper: the language model's config is nested
            outer, d = d, _text_config(d, source, model_type, arch.text_model_type)

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"{source}: required key {key!r} is missing")
            return d[key]

        def size(key: str, default: Any = None) -> Any:
            """An integer size, bounded (MAX_SIZES), checked before anything is computed from it;
            0 is an error, never read as "absent"."""
            value = d.get(key) if d.get(key) is not None else (need(key) if default is None else default)
            return check_size(key, value, f"{source}: {key}")

        # The sizes everything else is derived from, before any of it is.
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            size(key)

        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{source}: hidden_act = {hidden_act!r}; only 'silu' is supported")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = size("head_dim", arch.default_head_dim or max(1, hidden // num_heads))
        _check_no_sliding_window(d, source)
        attention_bias = bool(d.get("attention_bias", arch.default_attention_bias))
        max_pos = size("max_position_embeddings", 32768)
        hybrid: dict[str, Any] = {}
        if arch.hybrid:
            hybrid = dict(layer_types=_read_layer_types(d, need("num_hidden_layers"), source),
                          linear=_read_linear(d, source), mtp_layers=_read_mtp_layers(d, source))
            # transformers ties lm_head by the outer (multimodal) config's flag, default False.
            if outer:
                d["tie_word_embeddings"] = outer.get("tie_word_embeddings", False)
                d["eos_token_id"] = _merged_eos(d.get("eos_token_id"), outer.get("eos_token_id"))
                if outer.get("dtype", outer.get("torch_dtype")) is not None:
                    d["dtype"] = outer.get("dtype", outer.get("torch_dtype"))
        moe = _read_moe(d, arch.moe, source) if arch.moe is not None else None
        # Qwen3.5-MoE configs have no dense MLP size (every layer is sparse): the experts' size stands in.
        intermediate = (size("intermediate_size") if d.get("intermediate_size") is not None
                        else moe.moe_intermediate_size if moe and not arch.moe.sparse_step
                        else need("intermediate_size"))
        fields = dict(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=size("num_key_value_heads", num_heads),
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=_number(d.get("rms_norm_eps", 1e-6), f"{source}: rms_norm_eps"),
            rope=_read_rope(d, source, max_pos, arch.default_partial_rotary_factor if arch.hybrid else None),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch.qkv_bias if arch.qkv_bias is not None else attention_bias,
            o_proj_bias=attention_bias if arch.o_bias_follows_attention_bias else False,
            qk_norm=arch.qk_norm,
            torch_dtype=_read_dtype(d, source),
            eos_token_ids=token_ids(d.get("eos_token_id"), f"{source}: eos_token_id"),
            moe=moe,
            **hybrid,
        )
        try:
            return cls(**fields)
        except ValueError as e:          # QwenConfig's own checks: say which file they are about
            raise ValueError(f"{source}: {e}") from None


def _types(predicate) -> list[str]:
    return [name for name, arch in ARCHITECTURES.items() if predicate(arch)]


def _lay_over(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """config.json's ``data`` with vLLM's ``hf_overrides`` over it. The older rope keys (``rope_theta``,
    ``rope_scaling``, which vLLM's examples override) also go into a ``rope_parameters`` the file holds
    (transformers 5 writes that, and it is read first): the scaling replaces its type and factors, the
    theta its theta."""
    out = {**data, **overrides}
    params = data.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_parameters" not in overrides and (
            "rope_theta" in overrides or "rope_scaling" in overrides):
        theta = overrides.get("rope_theta", params.get("rope_theta"))
        scaling = overrides.get("rope_scaling")
        merged = dict(scaling) if isinstance(scaling, Mapping) else {
            k: v for k, v in params.items() if k != "rope_theta"}
        if theta is not None:
            merged["rope_theta"] = theta
        out["rope_parameters"] = merged
    return out


def _unsupported_type_message(model_type: Any, source: str) -> str:
    return (f"{source}: model_type = {model_type!r} is not supported; supported model types: "
            f"{', '.join(ARCHITECTURES)}")


def token_ids(value: Any, what: str) -> tuple[int, ...]:
    """An ``eos_token_id``-style field (absent, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what} = {value!r}, expected a non-negative int or a list of them")
    return tuple(values)


def _read_dtype(d: Mapping[str, Any], source: str) -> Optional[str]:
    name = d.get("dtype", d.get("torch_dtype"))  # 5.x writes "dtype", 4.x "torch_dtype"
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{source}: dtype = {name!r} is not a torch dtype")
    return name


def _check_no_sliding_window(d: Mapping[str, Any], source: str) -> None:
    """transformers only applies a window when use_sliding_window is set; the ops have none."""
    if not d.get("use_sliding_window", False):
        return
    window = d.get("sliding_window")
    layers = d.get("num_hidden_layers", 0)
    layer_types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 28)
                                          else "full_attention" for i in range(layers)]
    if window is not None and "sliding_attention" in layer_types:
        raise ValueError(f"{source}: use_sliding_window = true with sliding_window = {window}; sliding-window "
                         "attention is not supported (set use_sliding_window to false to run full attention)")


def _read_rope(d: Mapping[str, Any], source: str, max_position_embeddings: int,
               default_partial: Optional[float] = None) -> RopeConfig:
    """``default_partial`` None: only full rotary is accepted; else the default partial_rotary_factor."""
    # 5.x: everything in rope_parameters; 4.x: rope_theta at top level, scaling in rope_scaling
    # (None for plain RoPE). As in transformers, a theta inside the dict wins over a top-level one.
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters/rope_scaling = {params!r}, expected a JSON object")
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{source}: no RoPE theta: expected rope_parameters.rope_theta (transformers 5.x) "
                         "or a top-level rope_theta (transformers 4.x)")
    theta = _number(theta, f"{source}: rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial or 1.0))
    if default_partial is None and partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor = {partial!r}; only 1.0 (full rotary) is supported")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise ValueError(f"{source}: partial_rotary_factor = {partial!r}, expected a number in (0, 1]")
    factor = params.get("factor")
    if rope_type == "linear" and not isinstance(factor, (int, float)):
        raise ValueError(f"{source}: rope type 'linear' needs a numeric 'factor', got {factor!r}")
    if rope_type == "yarn" and factor is not None and not isinstance(factor, (int, float)):
        raise ValueError(f"{source}: rope type 'yarn' has factor = {factor!r}, expected a number")
    if factor is not None:
        _number(factor, f"{source}: rope factor")
    # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins.
    original = d.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=None if factor is None else float(factor),
        original_max_position_embeddings=original if rope_type == "yarn" else None,
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=float(partial),
    )


# --------------------------------------------------------------------------------------------
# Hybrid models (Qwen3.5): layer kinds and Gated DeltaNet sizes
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearAttentionConfig:
    """Sizes of the Gated DeltaNet layers (transformers' ``linear_*`` config fields)."""
    num_key_heads: int      # linear_num_key_heads: q/k heads
    num_value_heads: int    # linear_num_value_heads: v heads; a multiple of num_key_heads
    key_head_dim: int       # linear_key_head_dim
    value_head_dim: int     # linear_value_head_dim
    conv_kernel_dim: int = 4  # linear_conv_kernel_dim: causal depthwise conv width

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of in_proj_qkv): q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


_LINEAR_FIELDS = {"linear_num_key_heads": "num_key_heads", "linear_num_value_heads": "num_value_heads",
                  "linear_key_head_dim": "key_head_dim", "linear_value_head_dim": "value_head_dim",
                  "linear_conv_kernel_dim": "conv_kernel_dim"}
# transformers' Qwen3_5TextConfig defaults.
_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def _check_hybrid(config: QwenConfig) -> None:
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(config.layer_types)} entries, expected num_hidden_layers = "
                         f"{config.num_hidden_layers}")
    for i, kind in enumerate(config.layer_types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] = {kind!r} is not a supported layer type; expected one of "
                             f"{', '.join(LAYER_TYPES)}")
    linear = config.linear
    if linear is None:
        raise ValueError(f"model_type = {config.model_type!r} needs the linear-attention sizes (linear=...)")
    for name, value in vars(linear).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"linear {name} = {value!r}, expected a positive int")
    if linear.num_value_heads % linear.num_key_heads != 0:
        raise ValueError(f"linear_num_value_heads = {linear.num_value_heads} is not a multiple of "
                         f"linear_num_key_heads = {linear.num_key_heads}: each q/k head must serve a whole "
                         "number of value heads")
    rotary = config.rope.rotary_dim(config.head_dim)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"partial_rotary_factor = {config.rope.partial_rotary_factor} gives a rotary dim of "
                         f"{rotary} for head_dim = {config.head_dim}, expected an even number >= 2")


def _text_config(d: Mapping[str, Any], source: str, model_type: str, text_type: str) -> dict[str, Any]:
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: model_type {model_type!r} needs a 'text_config' object (the language model's "
                         f"config), got {text!r}")
    found = text.get("model_type", text_type)
    if found != text_type:
        raise ValueError(f"{source}: text_config.model_type = {found!r}, expected {text_type!r}")
    return dict(text, model_type=model_type)


def _merged_eos(inner: Any, outer: Any) -> Any:
    values = []
    for v in (inner, outer):
        if v is not None:
            values += list(v) if isinstance(v, (list, tuple)) else [v]
    return list(dict.fromkeys(values)) or None


def _read_layer_types(d: Mapping[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    """``layer_types``, or transformers' default from ``full_attention_interval``: every n-th layer is full."""
    layer_types = d.get("layer_types")
    if layer_types is None:
        interval = d.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{source}: full_attention_interval = {interval!r}, expected a positive int")
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"{source}: layer_types = {layer_types!r}, expected a list of layer type names")
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"{source}: layer_types[{i}] = {kind!r} is not a supported layer type; expected one of "
                             f"{', '.join(LAYER_TYPES)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"{source}: layer_types has {len(layer_types)} entries, expected num_hidden_layers = "
                         f"{num_layers}")
    return tuple(layer_types)


def _read_linear(d: Mapping[str, Any], source: str) -> LinearAttentionConfig:
    values = {}
    for key, field_name in _LINEAR_FIELDS.items():
        value = d.get(key)
        value = _LINEAR_DEFAULTS[key] if value is None else value
        values[field_name] = check_size(key, value, f"{source}: {key}")
    if values["num_value_heads"] % values["num_key_heads"] != 0:
        raise ValueError(f"{source}: linear_num_value_heads = {values['num_value_heads']} is not a multiple of "
                         f"linear_num_key_heads = {values['num_key_heads']}: each q/k head must serve a whole "
                         "number of value heads")
    return LinearAttentionConfig(**values)


# --------------------------------------------------------------------------------------------
# Mixture-of-experts models (qwen3_moe, qwen3_next, qwen3_5_moe)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeConfig:
    """Sizes and routing of the sparse MLPs (transformers' MoE config fields)."""
    num_experts: int               # num_experts (num_local_experts in transformers 5.x's qwen3_moe files)
    num_experts_per_tok: int       # top-k
    moe_intermediate_size: int     # each expert's intermediate size
    norm_topk_prob: bool           # renormalise the top-k softmax probabilities to sum to 1
    # None: the architecture has no shared expert (qwen3_moe); 0: it is switched off (transformers then
    # builds zero-size projections that add nothing; checkpoints may hold them, empty)
    shared_expert_intermediate_size: Optional[int] = None
    decoder_sparse_step: int = 1   # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (these keep a dense MLP)

    @property
    def has_shared_expert(self) -> bool:
        return bool(self.shared_expert_intermediate_size)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """transformers' rule: not in mlp_only_layers, experts exist, and (i + 1) % decoder_sparse_step == 0."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_moe(moe: MoeConfig, num_layers: int) -> None:
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        value = getattr(moe, name)
        if not _positive(value):
            raise ValueError(f"moe {name} = {value!r}, expected a positive int")
    if moe.num_experts_per_tok > moe.num_experts:
        raise ValueError(f"num_experts_per_tok = {moe.num_experts_per_tok} exceeds num_experts = {moe.num_experts}")
    shared = moe.shared_expert_intermediate_size
    if shared is not None and not (_positive(shared) or (shared == 0 and not isinstance(shared, bool))):
        raise ValueError(f"shared_expert_intermediate_size = {shared!r}, expected an int >= 0 (0: no shared expert)")
    for i in moe.mlp_only_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ValueError(f"mlp_only_layers holds {i!r}, expected layer indices in [0, {num_layers})")


def _read_moe(d: Mapping[str, Any], defaults: MoeDefaults, source: str) -> MoeConfig:
    def read(key: str, default: Any, *aliases: str) -> Any:
        for k in (key,) + aliases:
            if d.get(k) is not None:
                return d[k]
        return default

    values = dict(
        num_experts=read("num_experts", defaults.num_experts, "num_local_experts"),
        num_experts_per_tok=read("num_experts_per_tok", defaults.num_experts_per_tok),
        moe_intermediate_size=read("moe_intermediate_size", defaults.moe_intermediate_size),
    )
    if defaults.sparse_step:
        values["decoder_sparse_step"] = read("decoder_sparse_step", 1)
    for key, value in values.items():
        check_size(key, value, f"{source}: {key}")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise ValueError(f"{source}: num_experts_per_tok = {values['num_experts_per_tok']} exceeds num_experts = "
                         f"{values['num_experts']}")
    if defaults.shared_expert_intermediate_size is not None:
        shared = read("shared_expert_intermediate_size", defaults.shared_expert_intermediate_size)
        check_size("shared_expert_intermediate_size", shared, f"{source}: shared_expert_intermediate_size "
                   "(0: no shared expert)", low=0)
        values["shared_expert_intermediate_size"] = shared
    norm = True if defaults.norm_topk_prob is None else read("norm_topk_prob", defaults.norm_topk_prob)
    if not isinstance(norm, bool):
        raise ValueError(f"{source}: norm_topk_prob = {norm!r}, expected true or false")
    mlp_only = read("mlp_only_layers", []) if defaults.sparse_step else []
    num_layers = d.get("num_hidden_layers", 0)
    if not isinstance(mlp_only, (list, tuple)) or not all(
            not isinstance(i, bool) and isinstance(i, int) and 0 <= i < num_layers for i in mlp_only):
        raise ValueError(f"{source}: mlp_only_layers = {mlp_only!r}, expected a list of layer indices in "
                         f"[0, {num_layers})")
    return MoeConfig(norm_topk_prob=norm, mlp_only_layers=tuple(mlp_only), **values)
