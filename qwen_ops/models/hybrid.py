"""Hybrid Qwen causal LMs on torch.ops.qwen.*: Qwen3.5 (``qwen3_5_text``, and the language model of
``qwen3_5``), Qwen3.5-MoE (``qwen3_5_moe_text`` / ``qwen3_5_moe``) and Qwen3-Next (``qwen3_next``).

Layers follow ``config.layer_types``: ``linear_attention`` layers are Gated DeltaNet, whose state is
indexed by the same slots as the KV cache; ``full_attention`` layers are gated softmax attention
over the paged KV cache. Numerics follow transformers 5.x's ``modeling_qwen3_5.py``:

* RMSNorm is ``x / rms(x) * (1 + weight)`` in fp32, cast back at the end (``Qwen3_5RMSNorm``), for
  the layer norms, the final norm and the per-head q/k norms;
* full attention: ``q_proj`` gives ``[query | gate]`` per head (2 x head_dim), q/k norms, RoPE on the
  first ``int(head_dim * partial_rotary_factor)`` channels of each head (text-only mRoPE: its three
  position rows are equal, so the interleaved sections collapse to plain partial RoPE), then
  ``kv_write`` + ``slot_attention(..., gate=gate)``, i.e. output times ``sigmoid(gate)``, and o_proj;
* Gated DeltaNet: ``in_proj_qkv`` -> ``causal_conv1d`` (+ SiLU, conv state per slot) -> q, k, v;
  ``beta = sigmoid(in_proj_b x)``, ``g = -exp(A_log) * softplus(in_proj_a x + dt_bias)``;
  ``gated_delta_rule`` (q/k L2-normalised inside the op, scale k_dim^-0.5, recurrent state per
  slot in fp32); a gated RMSNorm ``(x / rms(x)) * weight * silu(z)`` with ``z = in_proj_z x``;
  ``out_proj``;
* a dense SwiGLU MLP in every layer (Qwen3.5), or the mixture-of-experts block of
  ``qwen_ops.models.moe`` (routed experts in ``torch.ops.qwen.fused_moe`` plus a sigmoid-gated shared
  expert) in the sparse layers of Qwen3.5-MoE and Qwen3-Next.

Qwen3-Next (``modeling_qwen3_next.py``) has the same layers with one difference: its Gated DeltaNet
projects q | k | v | z and b | a with two fused matrices, ``in_proj_qkvz`` and ``in_proj_ba``, whose
rows are grouped per key head (``[q_h, k_h, v_h.., z_h..]`` for each q/k head h, the value heads of
that group together). :class:`FusedProjectionGatedDeltaNet` splits them back into the conv's
``q | k | v`` channel order; everything after the projections is shared.

The forward contract is that of :class:`qwen_ops.models.dense.QwenForCausalLM`, with one cache pair per
layer: ``(key_cache, value_cache)`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` for
full-attention layers and ``(conv_state, recurrent_state)`` ``[max_slots, conv_dim, kernel - 1]``
(model dtype) and ``[max_slots, num_v_heads, k_dim, v_dim]`` (fp32) for linear layers;
:meth:`Qwen3_5ForCausalLM.allocate_caches` builds them. The linear layers use ``seq_slots``,
``query_start_loc`` and ``seq_lens`` of the same :class:`~qwen_ops.ops.metadata.AttentionMetadata`:
a sequence whose query covers its whole length starts from zero state, a chunk continues its slot.

Parameter names equal transformers' state-dict keys (``model.layers.0.linear_attn.A_log`` ...).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.models.config import ARCHITECTURES, FULL_ATTENTION, QwenConfig
from qwen_ops.models.layers import GatedRMSNorm, OffsetRMSNorm, RotaryEmbedding, SlotAttention, kv_cache_zeros
from qwen_ops.models.moe import make_mlp

Cache = tuple[torch.Tensor, torch.Tensor]
ATTENTION, LINEAR = "attention", "linear"   # cache kinds, as in ``layer_kinds``


class GatedAttention(SlotAttention):
    """Full attention whose q_proj also yields a per-channel output gate, with offset q/k norms
    (transformers' Qwen3_5Attention)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__(config, qk_norm=OffsetRMSNorm, output_gate=True)


class GatedDeltaNet(nn.Module):
    """Linear attention with a gated delta rule (transformers' Qwen3_5GatedDeltaNet) on slot state ops."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        lin = config.linear
        self.num_k_heads, self.num_v_heads = lin.num_key_heads, lin.num_value_heads
        self.head_k_dim, self.head_v_dim = lin.key_head_dim, lin.value_head_dim
        self.key_dim, self.value_dim = lin.key_dim, lin.value_dim
        self.scale = lin.key_head_dim ** -0.5
        hidden = config.hidden_size
        # Depthwise causal conv over q | k | v channels; the op takes its weight as [conv_dim, kernel].
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, kernel_size=lin.conv_kernel_dim, groups=lin.conv_dim,
                                bias=False, padding=lin.conv_kernel_dim - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self._make_projections(hidden, lin.conv_dim)

    def _make_projections(self, hidden: int, conv_dim: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's input ``q | k | v`` ``[T, conv_dim]``, z ``[T, value_dim]``, b and a ``[T, num_v_heads]``."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata, state: Cache) -> torch.Tensor:
        T = x.shape[0]
        conv_state, recurrent_state = state
        meta = (attn.seq_slots, attn.query_start_loc, attn.seq_lens)
        qkv, z, b, a = self.project(x)
        mixed = torch.ops.qwen.causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                             conv_state, *meta)                          # [T, conv_dim]
        q = mixed[:, :self.key_dim].view(T, self.num_k_heads, self.head_k_dim)
        k = mixed[:, self.key_dim:2 * self.key_dim].view(T, self.num_k_heads, self.head_k_dim)
        v = mixed[:, 2 * self.key_dim:].view(T, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()                                                                # [T, num_v_heads]
        # fp32, as transformers: in fp16 exp(A_log) could overflow.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = torch.ops.qwen.gated_delta_rule(q, k, v, g, beta, recurrent_state, *meta, self.scale)
        z = z.reshape(T * self.num_v_heads, self.head_v_dim)
        o = self.norm(o.view(T * self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(o.view(T, self.value_dim))


class FusedProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet (transformers' Qwen3NextGatedDeltaNet): ``in_proj_qkvz`` and
    ``in_proj_ba``, rows grouped per key head, instead of Qwen3.5's four projections."""

    def _make_projections(self, hidden: int, conv_dim: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        T, hk = x.shape[0], self.num_k_heads
        per_group = self.num_v_heads // hk                     # value heads per key head
        dk, dv = self.head_k_dim, per_group * self.head_v_dim
        # Key head h's rows: [q_h (dk), k_h (dk), v of its value heads (dv), z of them (dv)].
        q, k, v, z = torch.split(self.in_proj_qkvz(x).view(T, hk, 2 * dk + 2 * dv), [dk, dk, dv, dv], dim=2)
        b, a = torch.split(self.in_proj_ba(x).view(T, hk, 2 * per_group), [per_group, per_group], dim=2)
        qkv = torch.cat((q.reshape(T, self.key_dim), k.reshape(T, self.key_dim), v.reshape(T, self.value_dim)), 1)
        return (qkv, z.reshape(T, self.value_dim), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig, layer_type: str, layer_idx: int = 0) -> None:
        super().__init__()
        self.is_linear = layer_type != FULL_ATTENTION   # fixed at construction: no data-dependent branch
        if self.is_linear:
            fused = ARCHITECTURES[config.model_type].fused_linear_projections
            self.linear_attn = (FusedProjectionGatedDeltaNet if fused else GatedDeltaNet)(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = make_mlp(config, layer_idx)   # dense SwiGLU, or a MoE block in sparse layers
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                attn: AttentionMetadata, cache: Cache) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_linear:
            h = h + self.linear_attn(x, attn, cache)
        else:
            h = h + self.self_attn(x, cos, sin, positions32, attn, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(nn.Module):
    """The decoder stack (``model.*`` in transformers' Qwen3_5ForCausalLM names)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:   # under the loader's meta device the checkpoint fills it
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, kind, i) for i, kind in enumerate(config.layer_types))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid causal LM; the forward contract is QwenForCausalLM's (see
    the module docstring)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        if not config.is_hybrid:
            raise ValueError(f"model_type = {config.model_type!r} is not a hybrid model; use "
                             "qwen_ops.models.dense.QwenForCausalLM")
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = None           # the MTP layer (models/mtp.py; the loader sets it) for speculative "mtp"
        # Speculative "mtp" (engine/mtp.py) reads every row's final hidden state: the forward then
        # normalises all rows and keeps them in ``hidden_out`` (eager; chosen when the MTP is attached).
        self.keep_hidden = False
        self.hidden_out = None

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer, the kind of cache it takes: "attention" (paged KV) or "linear" (slot state)."""
        return [LINEAR if layer.is_linear else ATTENTION for layer in self.model.layers]

    def allocate_caches(self, num_blocks: int, block_size: int, max_slots: int, dtype: torch.dtype,
                        device: torch.device, kv_dtype: Optional[torch.dtype] = None) -> list[Cache]:
        """Zero-filled caches, one pair per layer in ``layer_kinds`` order.

        attention: key_cache, value_cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``kv_dtype``
        (default ``dtype``; an fp8 dtype for a quantized cache);
        linear: conv_state ``[max_slots, conv_dim, kernel - 1]`` in ``dtype`` and recurrent_state
        ``[max_slots, num_v_heads, k_dim, v_dim]`` in fp32 (indexed by slot, like block_table rows).
        """
        c = self.config
        lin = c.linear
        caches: list[Cache] = []
        # The heads and channels each layer holds (a share of the config's under tensor parallelism).
        for kind, layer in zip(self.layer_kinds, self.model.layers):
            if kind == ATTENTION:
                shape = (num_blocks, block_size, layer.self_attn.num_kv_heads, c.head_dim)
                caches.append((kv_cache_zeros(shape, kv_dtype or dtype, device),
                               kv_cache_zeros(shape, kv_dtype or dtype, device)))
            else:
                gdn = layer.linear_attn
                caches.append((torch.zeros((max_slots, gdn.conv1d.weight.shape[0], lin.conv_kernel_dim - 1),
                                           dtype=dtype, device=device),
                               torch.zeros((max_slots, gdn.num_v_heads, lin.key_head_dim, lin.value_head_dim),
                                           dtype=torch.float32, device=device)))
        return caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                caches: list[Cache], logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` (model dtype) of the rows ``logits_indices [N]``.

        input_ids int64 ``[T]``; positions int32/int64 ``[T]``; attn: slot metadata (int32); caches: one
        pair per layer (see :meth:`allocate_caches`), updated in place; logits_indices int64 ``[N]``.
        """
        positions32 = positions.to(torch.int32)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            h = layer(h, cos, sin, positions32, attn, cache)
        if self.keep_hidden:      # the norm is row-wise: the selected rows' logits are the same
            self.hidden_out = self.model.norm(h)
            return self.lm_head(torch.index_select(self.hidden_out, 0, logits_indices))
        h = self.model.norm(torch.index_select(h, 0, logits_indices))
        return self.lm_head(h)
