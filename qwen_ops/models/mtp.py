"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 checkpoints (``mtp.*`` weights),
the proposer of speculative decoding with ``"method": "mtp"`` (``engine/mtp.py``). The layout is
the one vLLM's ``qwen3_next_mtp`` reads:

* ``mtp.pre_fc_norm_embedding`` and ``mtp.pre_fc_norm_hidden``: offset RMSNorms (``1 + weight``, as
  every norm of these models) of the next token's embedding and of the target's hidden state (after
  the target's final norm: what its LM head reads);
* ``mtp.fc`` ``[H, 2H]`` (no bias) on their concatenation ``[embedding | hidden]``;
* ``mtp.layers.0``: one full-attention decoder layer of the family (gated attention with q/k norms
  and partial RoPE; the dense MLP, or the MoE block with its shared expert), with a KV cache of its own;
* ``mtp.norm``, then the target's ``lm_head``; the embedding is the target's too (shared, not copied).

Row p of a pass takes (the token at position p + 1, the target's hidden state at p), sits at
position p, and its logits predict the token at p + 2. Chained drafts feed the layer's own normed
output as the hidden state of the next row (vLLM's MTP proposer does the same).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from qwen_ops.models.config import FULL_ATTENTION, QwenConfig
from qwen_ops.models.hybrid import HybridDecoderLayer
from qwen_ops.models.layers import OffsetRMSNorm, kv_cache_zeros
from qwen_ops.ops.metadata import AttentionMetadata


class MTPHead(nn.Module):
    """The ``mtp.*`` parameters (registered as ``model.mtp`` of the target, so the loader reads them
    under their checkpoint names)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        if config.mtp_layers != 1:
            raise ValueError(f"the checkpoint has {config.mtp_layers} MTP layers (num_nextn_predict_layers / "
                             "mtp_num_hidden_layers); speculative 'mtp' supports exactly 1")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, eps)
        # Layer index 0 for the MLP choice: vLLM reads the index from "mtp.layers.0", so a sparse model's
        # MTP layer is sparse exactly when its layer 0 is.
        self.layers = nn.ModuleList([HybridDecoderLayer(config, FULL_ATTENTION, 0)])
        self.norm = OffsetRMSNorm(hidden, eps)


class MTPModel(nn.Module):
    """The MTP layer behind the forward contract of the target models (``dense.QwenForCausalLM``), so
    a ``ModelRunner`` drives it (its KV cache, block table, slots, swap): ``forward(input_ids,
    positions, attn, kv_caches, logits_indices)`` returns logits of the selected rows. The target's
    hidden state of every row is the one input that contract has no place for: the caller sets
    ``hidden_in`` ``[T, H]`` (rows in the pass's order) before each pass, and ``hidden_out`` holds the
    pass's normed output rows afterwards (the next chained row's hidden state). Eager only."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        if getattr(target, "mtp", None) is None:
            raise ValueError("the target model has no MTP layer (load it with mtp=True)")
        self.__dict__["target"] = target          # not a submodule: its parameters are the target's
        self.config = target.config
        self.hidden_in: Optional[torch.Tensor] = None
        self.hidden_out: Optional[torch.Tensor] = None

    @property
    def layer_kinds(self) -> list[str]:
        return ["attention"]

    def allocate_caches(self, num_blocks: int, block_size: int, max_slots: int, dtype: torch.dtype,
                        device: torch.device, kv_dtype: Optional[torch.dtype] = None
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One ``(key_cache, value_cache)`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` (zeros)."""
        attn = self.target.mtp.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, self.config.head_dim)
        dtype = kv_dtype or dtype
        return [(kv_cache_zeros(shape, dtype, device), kv_cache_zeros(shape, dtype, device))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list, logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_in
        if hidden is None or hidden.shape[0] != input_ids.shape[0]:
            raise ValueError(f"MTPModel.hidden_in has {None if hidden is None else hidden.shape[0]} rows, expected "
                             f"{input_ids.shape[0]} (one target hidden state per token of the pass)")
        target, head = self.target, self.target.mtp
        e = head.pre_fc_norm_embedding(target.model.embed_tokens(input_ids))
        h = head.pre_fc_norm_hidden(hidden.to(e.dtype))
        x = head.fc(torch.cat((e, h), dim=-1))
        cos, sin = target.model.rotary_emb(positions, x.dtype)
        x = head.layers[0](x, cos, sin, positions.to(torch.int32), attn, kv_caches[0])
        out = head.norm(x)
        self.hidden_out = out
        return target.lm_head(torch.index_select(out, 0, logits_indices))
