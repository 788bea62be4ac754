"""Qwen2 / Qwen3 causal LM (and Qwen3-MoE, ``qwen3_moe``) as a plain nn.Module whose attention is
torch.ops.qwen.*.

The forward pass works on a flat batch of tokens (no batch dimension): ``input_ids [T]``,
``positions [T]``, an :class:`~qwen_ops.ops.metadata.AttentionMetadata` that says which slot and
sequence each token belongs to, and the engine's paged KV caches, one ``(key_cache,
value_cache)`` pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Attention is ``torch.ops.qwen.kv_write`` followed by ``torch.ops.qwen.slot_attention``; there
is no Python branching on tensor values, so the forward traces with
``torch.compile(fullgraph=True)`` and its decode step can be captured into a CUDA graph.

Parameter names equal the Hugging Face state-dict keys (``model.layers.0.self_attn.q_proj.weight``
...), so checkpoints load by name. A ``qwen3_moe`` config gives its sparse layers a mixture-of-experts
MLP (``qwen_ops.models.moe``: routing in torch, experts in ``torch.ops.qwen.fused_moe``), chosen per
layer at construction; the forward is the same. Numerics follow transformers: RMSNorm and RoPE tables in
fp32, cast back to the model dtype at the same points.

This is the model's only forward: eager, compiled and CUDA-graph captured runs all execute it, on
every device. On the CPU its layers run the cpu backend's fused ops on packed weights, each layer
having chosen them once in ``process_weights_after_loading()`` (``qwen_ops/models/layers.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.layers import (RMSNorm, RotaryEmbedding, LINEAR_PACKED, SlotAttention, forward_hooks, hooked,
                                    kv_cache_zeros, pack_linears, panels_on_huge_pages, uses_cpu_kernels)
from qwen_ops.models.moe import make_mlp
from qwen_ops.models.quant import QuantLinear, attach_panel_arena
from qwen_ops.ops.backend import use_backend
from qwen_ops.ops.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


# Rows from which the LM head runs as the plain module (a GEMM library's large-M kernel) rather than
# the packed panels made for a few rows (benchmarks/README.md, "Scoring a prompt").
LM_HEAD_PACKED_ROWS = 128

class QwenAttention(SlotAttention):
    """Qwen2 / Qwen3 attention: no output gate; Qwen3 adds per-head RMSNorm on q and k."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__(config, qk_norm=RMSNorm if config.qk_norm else None)


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = QwenAttention(config)
        self.mlp = make_mlp(config, layer_idx)   # dense SwiGLU, or a MoE block in qwen3_moe's sparse layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                sin: Optional[torch.Tensor], positions32: torch.Tensor, attn: AttentionMetadata,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the residual stream is ``residual + h`` at the layer's entry
        (``residual`` None: ``h`` itself, the embeddings) and ``residual + mlp_out`` at its exit;
        each add happens inside the next norm (vLLM's residual carry: one op on the CPU fast path).
        Its parts are called as modules, so their hooks run."""
        if residual is None:          # the first layer (structure, not data)
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x = self.self_attn(x, cos, sin, positions32, attn, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


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
        self.layers = nn.ModuleList(QwenDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.choose_rope()

    def choose_rope(self) -> None:
        """Whether a step needs cos / sin tables: not when every attention layer reads the table
        itself (its CPU fast path), unless a hook waits on ``rotary_emb``."""
        self._needs_cos_sin = not all(layer.self_attn.reads_rope_table() for layer in self.layers)
        self._rope_hooks = forward_hooks(self.rotary_emb)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[KVCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states ``[N, hidden]`` of the rows ``logits_indices`` (arguments as
        in :meth:`QwenForCausalLM.forward`)."""
        # kv_write takes int32 positions; .to is a no-op when the engine already passes int32.
        positions32 = positions.to(torch.int32)
        h = self.embed_tokens(input_ids)
        cos = sin = None
        if self._needs_cos_sin or hooked(self._rope_hooks):
            cos, sin = self.rotary_emb(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, positions32, attn, kv_cache)
        # RMSNorm is row-wise, so normalising only the selected rows gives the same values and
        # skips the lm_head matmul on every other row.
        h, residual = torch.index_select(h, 0, logits_indices), torch.index_select(residual, 0, logits_indices)
        return self.norm(h, residual)[0]


class QwenForCausalLM(nn.Module):
    """Qwen2 / Qwen3 / Qwen3-MoE causal LM; see the module docstring for the forward contract."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._lm_head = self._lm_head_native
        self._lm_head_hooks = ()

    def process_weights_after_loading(self) -> None:
        """Every layer picks its forward for the device, dtype and backend it now has, and packs what
        that forward reads (models/layers.py); call again after changing weights. A model whose
        parameters mix dtypes keeps every layer on its plain forward (the ops take one dtype)."""
        if len({p.dtype for p in self.parameters()}) > 1:
            with use_backend("reference"):
                return self._choose_forwards()
        return self._choose_forwards()

    def _choose_forwards(self) -> None:
        attach_panel_arena(self)        # the int8-activation layers' panels, in the order a step reads them
        for module in self.modules():
            if isinstance(module, SlotAttention):
                module.process_weights_after_loading(self.model.rotary_emb.cos_sin)
            elif module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        self.model.choose_rope()
        self._choose_lm_head()
        panels_on_huge_pages(self)

    def _choose_lm_head(self) -> None:
        self._lm_head = self._lm_head_native
        if self.lm_head is None:                      # an embedding model's load without one (models/loader.py)
            return
        if isinstance(self.lm_head, QuantLinear):     # online int8 quantizes the head too (models/quant.py)
            self.lm_head.use_panels()         # its forward is the QuantLinear's: _lm_head_native
        elif uses_cpu_kernels(self.lm_head.weight):
            packed, _, self._vocab_rows, self._lm_head_finish = pack_linears(self.lm_head)
            self.register_buffer("lm_head_packed", packed, persistent=False)
            self._lm_head = self._lm_head_cpu
            self._lm_head_hooks = forward_hooks(self.lm_head)

    def _lm_head_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)

    def _lm_head_cpu(self, x: torch.Tensor) -> torch.Tensor:
        # The packed product stands in for lm_head while no hook waits on it, and below
        # LM_HEAD_PACKED_ROWS rows (decodes, a prefill's last rows): a scored prompt's thousands of
        # rows go to the module itself, oneDNN's / MKL's GEMM (3.7x the panels at 2,000 x 151,936 bf16).
        if x.shape[0] >= LM_HEAD_PACKED_ROWS or hooked(self._lm_head_hooks):
            return self.lm_head(x)
        return self._lm_head_finish(LINEAR_PACKED(x, self.lm_head_packed, None, self._vocab_rows))

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer, the kind of cache it takes: all "attention" (paged KV); cf. models/hybrid's "linear"."""
        return ["attention"] * len(self.model.layers)

    def allocate_caches(self, num_blocks: int, block_size: int, max_slots: int, dtype: torch.dtype,
                        device: torch.device, kv_dtype: Optional[torch.dtype] = None) -> list[KVCache]:
        """Zero-filled ``(key_cache, value_cache)`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer,
        in ``kv_dtype`` (default ``dtype``; an fp8 dtype for a quantized cache).

        ``max_slots`` is unused (no per-slot state); it keeps the signature of the hybrid model's method.
        """
        dtype = kv_dtype or dtype
        # The heads this model holds (fewer than the config's under tensor parallelism).
        shape = (num_blocks, block_size, self.model.layers[0].self_attn.num_kv_heads, self.config.head_dim)
        return [(kv_cache_zeros(shape, dtype, device), kv_cache_zeros(shape, dtype, device)) for _ in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[KVCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` (model dtype) of the rows ``logits_indices [N]`` of the batch.

        input_ids: int64 ``[T]``; positions: int32 or int64 ``[T]`` absolute position of each token;
        attn: slot metadata for ``torch.ops.qwen.*`` (int32 tensors); kv_caches: one
        ``(key_cache, value_cache)`` per layer, written in place; logits_indices: int64 ``[N]``
        (typically the last token of each sequence). Padding tokens carry ``slot_ids == -1``.
        """
        return self._lm_head(self.model(input_ids, positions, attn, kv_caches, logits_indices))
