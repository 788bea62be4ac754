"""The mixture-of-experts MLP of qwen3_moe, qwen3_next and qwen3_5_moe, on torch.ops.qwen.fused_moe.

Numerics follow transformers 5.x's ``Qwen3MoeSparseMoeBlock`` / ``Qwen3NextSparseMoeBlock`` /
``Qwen3_5MoeSparseMoeBlock``:

* routing, in plain torch here: ``logits = x @ gate.weight^T`` (model dtype), softmax in fp32, top-k,
  renormalised to sum 1 when ``norm_topk_prob`` (always for Qwen3.5-MoE), cast to the logits' dtype;
* the routed experts in one op call: ``fused_moe(x, experts.gate_up_proj, experts.down_proj, weights,
  ids)``, i.e. ``sum_j w_j * down_e(silu(gate_e x) * up_e x)``;
* Qwen3-Next and Qwen3.5-MoE add a shared expert (a SwiGLU MLP every token takes) scaled by
  ``sigmoid(shared_expert_gate(x))``.

Parameter names are transformers' in-memory ones: ``mlp.gate.weight [E, H]``,
``mlp.experts.gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows: the op's w13),
``mlp.experts.down_proj [E, H, I]`` (w2), ``mlp.shared_expert.{gate,up,down}_proj.weight``,
``mlp.shared_expert_gate.weight [1, H]``. Checkpoints saved by ``save_pretrained`` hold one tensor per
expert instead (``mlp.experts.<e>.gate_proj.weight`` ...); the loader stacks them.

Which layers are sparse is fixed at construction (``MoeConfig.is_sparse_layer``: ``decoder_sparse_step``
and ``mlp_only_layers``); the others keep a dense :class:`~qwen_ops.models.layers.QwenMLP`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.ops import host
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.layers import QwenMLP, uses_cpu_kernels

INIT_STD = 0.02   # transformers' initializer_range, for models built without a checkpoint


def _init_normal(t: torch.Tensor) -> torch.Tensor:
    # Under the loader's torch.device("meta") the checkpoint fills it (normal_ on meta would import
    # torch's Python meta kernels for nothing, as in dense.py).
    return t if t.is_meta else nn.init.normal_(t, 0.0, INIT_STD)


class TopKRouter(nn.Module):
    """Softmax top-k routing (transformers' ``*TopKRouter``): ``weight [num_experts, hidden]``."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.weight = nn.Parameter(_init_normal(torch.empty(moe.num_experts, config.hidden_size)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights ``[T, top_k]`` (x's dtype) and expert ids int32 ``[T, top_k]`` of ``x [T, hidden]``."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:   # fixed at construction: no data-dependent branch
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids.to(torch.int32)


class MoeExperts(nn.Module):
    """The stacked expert weights (transformers' ``*Experts``), run by ``torch.ops.qwen.fused_moe``."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        moe = config.moe
        E, H, I = moe.num_experts, config.hidden_size, moe.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(_init_normal(torch.empty(E, 2 * I, H)))   # w13: gate rows, then up rows
        self.down_proj = nn.Parameter(_init_normal(torch.empty(E, H, I)))          # w2
        self.forward = self.forward_native

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.qwen.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)

    def forward_cpu(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.qwen.moe_packed.default(x, self.w13_packed, self.w2_packed, weights, ids)

    def process_weights_after_loading(self) -> None:
        """fp32 on the CPU fast path (models/layers.py): every expert's matrices packed, for
        ``torch.ops.qwen.moe_packed``; otherwise (bf16 too) ``fused_moe`` on the stacked weights."""
        if self.gate_up_proj.dtype == torch.float32 and uses_cpu_kernels(self.gate_up_proj):
            with torch.no_grad():
                self.register_buffer("w13_packed", torch.stack([host.pack_panels(w.detach().contiguous())
                                                                for w in self.gate_up_proj]), persistent=False)
                self.register_buffer("w2_packed", torch.stack([host.pack_panels(w.detach().contiguous())
                                                               for w in self.down_proj]), persistent=False)
            self.forward = self.forward_cpu
        else:
            self.forward = self.forward_native


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen3-Next / Qwen3.5-MoE) the sigmoid-gated shared expert."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        moe = config.moe
        self.gate = TopKRouter(config)
        self.experts = MoeExperts(config)
        if moe.has_shared_expert:
            self.shared_expert = QwenMLP(config, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` in x's dtype."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:   # fixed at construction
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def make_mlp(config: QwenConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s MLP: a :class:`SparseMoeBlock` where the config makes it sparse, else dense."""
    if config.moe is not None and config.moe.is_sparse_layer(layer_idx):
        return SparseMoeBlock(config)
    return QwenMLP(config)
