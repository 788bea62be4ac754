"""Dense Qwen2 / Qwen3 causal LM as a plain nn.Module whose attention is torch.ops.qwen.*.

The forward pass works on a flat batch of tokens (no batch dimension): ``input_ids [T]``,
``positions [T]``, an :class:`~qwen_ops.ops.metadata.AttentionMetadata` that says which slot and
sequence each token belongs to, and the engine's paged KV caches, one ``(key_cache,
value_cache)`` pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Attention is ``torch.ops.qwen.kv_write`` followed by ``torch.ops.qwen.slot_attention``; there
is no Python branching on tensor values, so the forward traces with
``torch.compile(fullgraph=True)`` and its decode step can be captured into a CUDA graph.

Parameter names equal the Hugging Face state-dict keys (``model.layers.0.self_attn.q_proj.weight``
...), so checkpoints load by name. Numerics follow transformers: RMSNorm and RoPE tables in
fp32, cast back to the model dtype at the same points.

This is the model's only forward: eager, compiled and CUDA-graph captured runs all execute it.
Faster ways to run the same math live outside the model, in the engine's executors
(``qwen_ops/engine/executors.py``: the one-call native CPU forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.models.config import QwenConfig
from qwen_ops.ops.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, in fp32 (the part every Qwen norm variant shares)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``, the mean square taken in fp32 as in transformers' Qwen2RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE as a precomputed fp32 table ``cos_sin [max_position_embeddings, head_dim]``.

    Row p holds ``cos(p * inv_freq) * s`` in its first half and ``sin(p * inv_freq) * s`` in its
    second (``s`` is yarn's attention factor, 1 otherwise), by the same fp32 operations that
    transformers runs at every step, so gathering rows by position reproduces its values.
    """

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.half = config.head_dim // 2
        # On torch's default device. Under the loader's torch.device("meta") it stays an empty
        # meta tensor (meta arange would import torch's Python meta kernels, ~180 MB) and the
        # loader computes it on the target device: being non-persistent, it is not in checkpoints.
        table = torch.empty(config.max_position_embeddings, config.head_dim)
        self.register_buffer("cos_sin", table if table.is_meta else rope_table(config, table.device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim // 2]`` in ``dtype`` for int32 or int64 ``positions [T]``."""
        table = torch.index_select(self.cos_sin, 0, positions).to(dtype)
        return table[:, None, :self.half], table[:, None, self.half:]


def rope_table(config: QwenConfig, device: torch.device) -> torch.Tensor:
    """fp32 ``[max_position_embeddings, head_dim]``: cos | sin of every position, times the scaling."""
    inv_freq, scaling = config.rope.inv_freq_and_scaling(config.head_dim, config.max_position_embeddings)
    positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]  # [max_pos, head_dim // 2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` (halves convention); same roundings as ``q*cos + rotate_half(q)*sin``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class QwenAttention(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # a module attribute, fixed at construction: not data-dependent
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        key_cache, value_cache = kv_cache
        torch.ops.qwen.kv_write(k, v, key_cache, value_cache, attn.slot_ids, positions32, attn.block_table)
        o = torch.ops.qwen.slot_attention(q, key_cache, value_cache, attn.block_table, attn.seq_slots,
                                          attn.query_start_loc, attn.seq_lens, self.scale, attn.max_query_len)
        return self.o_proj(o.view(T, self.num_heads * self.head_dim))


class QwenMLP(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.self_attn = QwenAttention(config)
        self.mlp = QwenMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, positions32, attn, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class QwenModel(nn.Module):
    """The decoder stack (``model.*`` in Hugging Face names)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        weight = torch.empty(config.vocab_size, config.hidden_size)
        # Under the loader's torch.device("meta") the checkpoint fills the weight; normal_ on a
        # meta tensor would import torch's Python meta kernels (~180 MB of host memory) for nothing.
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(QwenDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class QwenForCausalLM(nn.Module):
    """Qwen2/Qwen3 dense causal LM; see the module docstring for the forward contract."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer, the kind of cache it takes: all "attention" (paged KV); cf. models/hybrid's "linear"."""
        return ["attention"] * len(self.model.layers)

    def allocate_caches(self, num_blocks: int, block_size: int, max_slots: int, dtype: torch.dtype,
                        device: torch.device) -> list[KVCache]:
        """Zero-filled ``(key_cache, value_cache)`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.

        ``max_slots`` is unused (no per-slot state); it keeps the signature of the hybrid model's method.
        """
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[KVCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` (model dtype) of the rows ``logits_indices [N]`` of the batch.

        input_ids: int64 ``[T]``; positions: int32 or int64 ``[T]`` absolute position of each token;
        attn: slot metadata for ``torch.ops.qwen.*`` (int32 tensors); kv_caches: one
        ``(key_cache, value_cache)`` per layer, written in place; logits_indices: int64 ``[N]``
        (typically the last token of each sequence). Padding tokens carry ``slot_ids == -1``.
        """
        # kv_write takes int32 positions; .to is a no-op when the engine already passes int32.
        positions32 = positions.to(torch.int32)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, positions32, attn, kv_cache)
        # RMSNorm is row-wise, so normalising only the selected rows gives the same values and
        # skips the lm_head matmul on every other row.
        h = torch.index_select(h, 0, logits_indices)
        return self.lm_head(self.model.norm(h))
