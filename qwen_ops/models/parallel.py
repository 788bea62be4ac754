"""Tensor parallelism (Megatron style) for the dense and hybrid Qwen models, on ``torch.distributed``.

``shard_model(model, tp)`` turns a model built on the meta device into this rank's slice of it,
before the loader fills it, so each rank allocates and reads only its own weights:

- q/k/v and gate/up become ``ColumnParallelLinear`` (output features split by head, or by
  intermediate channel), o and down ``RowParallelLinear`` (input features split the same way,
  one all-reduce after the product, the bias added once after it);
- attention heads are split across ranks; when ``num_kv_heads < tp`` each KV head is replicated
  on ``tp / num_kv_heads`` ranks (as vLLM does), so every rank holds exactly one;
- the embedding is vocabulary-parallel (rows split; a token outside a rank's rows contributes
  zeros; one all-reduce), the lm_head column-parallel over the vocabulary with an all-gather,
  so every rank ends with the full logits (rank 0 samples);
- a hybrid model's Gated DeltaNet layers are split by key head with their value heads, the
  conv's channels and the gates with them, ``out_proj`` row-parallel (``_shard_gated_delta_net``);
  every head's recurrent state lives on one rank.

Each sharded parameter carries ``tp_slice = (dim, ranges, full)``: the rows (``dim`` 0) or
columns (``dim`` 1) ``[start, stop)`` of each range of the checkpoint tensor of length ``full``
along ``dim``, concatenated (one range, except for the q | k | v channels of a Gated DeltaNet),
zero rows padding it past them. The loader reads exactly those ranges with
``safe_open(...).get_slice``.

The all-reduce and all-gather go through shared memory when every rank is on this host
(``torch.ops.qwen.shm_all_reduce`` / ``shm_all_gather``, ``ops/shm_collectives.py``: gloo costs
about 2 ms each on these VMs), else ``torch.distributed._functional_collectives``; either way
``torch.compile(fullgraph=True)`` traces them without a graph break. The KV cache of a rank holds only
its KV heads; the slot ops take any head count, so they are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qwen_ops.models.config import ARCHITECTURES, QwenConfig
from qwen_ops.models.moe import MoeExperts, SparseMoeBlock
from qwen_ops.ops import shm_collectives  # noqa: F401  (registers torch.ops.qwen.shm_all_reduce / _gather)


@dataclass(frozen=True, eq=False)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, the name of the
    ``torch.distributed`` process group (None when ``size == 1``; a name, which the functional
    collectives take, not the group, so that ``destroy_process_group`` frees the group and joins
    gloo's threads: ``engine/distributed.py``), and, when every rank is on
    this host, the shared-memory workspace of ``torch.ops.qwen.shm_all_reduce`` (else None: the
    collectives go through ``torch.distributed``)."""
    rank: int
    size: int
    group: Any = None
    workspace: Optional[torch.Tensor] = None
    mapping: Any = None          # keeps the workspace's shared-memory mapping alive as long as the group


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.workspace is not None:
        return torch.ops.qwen.shm_all_reduce(x, tp.workspace, tp.rank, tp.size)
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", tp.group)


def _all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate every rank's ``x [N, C]`` along the last dim: ``[N, tp.size * C]``."""
    if tp.workspace is not None:
        gathered = torch.ops.qwen.shm_all_gather(x, tp.workspace, tp.rank, tp.size)
    else:
        import torch.distributed._functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor   # renamed in torch 2.12
        gathered = gather(x.contiguous(), 0, tp.group)      # [tp.size * N, C]
    n = x.shape[0]
    return torch.cat([gathered[r * n:(r + 1) * n] for r in range(tp.size)], dim=-1)


def check_tp_config(config: QwenConfig, size: int) -> None:
    """Reject sizes that cannot split this model, naming the numbers."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size = {size!r}, expected an int >= 1")
    if size == 1:
        return
    if config.is_hybrid:
        lin = config.linear
        if lin.num_key_heads % size:
            raise ValueError(f"tensor_parallel_size = {size} does not divide the linear-attention layers' "
                             f"linear_num_key_heads = {lin.num_key_heads}")
        if lin.num_value_heads % size:
            raise ValueError(f"tensor_parallel_size = {size} does not divide the linear-attention layers' "
                             f"linear_num_value_heads = {lin.num_value_heads}")
    if config.is_hybrid and ARCHITECTURES[config.model_type].fused_linear_projections:
        raise ValueError(f"tensor_parallel_size = {size}: tensor parallelism of {config.model_type}'s fused "
                         "linear-attention projections (in_proj_qkvz) is not built; use tensor_parallel_size=1")
    if config.moe is not None:
        moe = config.moe
        if moe.moe_intermediate_size % size:
            raise ValueError(f"tensor_parallel_size = {size} does not divide moe_intermediate_size = "
                             f"{moe.moe_intermediate_size}")
        if moe.has_shared_expert and moe.shared_expert_intermediate_size % size:
            raise ValueError(f"tensor_parallel_size = {size} does not divide shared_expert_intermediate_size = "
                             f"{moe.shared_expert_intermediate_size}")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size = {size} does not divide num_attention_heads = {heads}")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size = {size} and num_key_value_heads = {kv}: one must divide the other")
    if any(not (config.moe is not None and config.moe.is_sparse_layer(i)) for i in range(config.num_hidden_layers)) \
            and config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size = {size} does not divide intermediate_size = {config.intermediate_size}")


def _span(full: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(start, stop, per_rank)``: rank's even share of ``full`` (the last may be short: padded)."""
    per = -(-full // tp.size)
    start = min(full, tp.rank * per)
    return start, min(full, start + per), per


def _mark(param: nn.Parameter, dim: int, start: int, stop: int, full: int) -> nn.Parameter:
    return _mark_pieces(param, dim, [(start, stop)], full)


def _mark_pieces(param: nn.Parameter, dim: int, pieces: Sequence[tuple[int, int]], full: int) -> nn.Parameter:
    """``param`` holds the ranges ``pieces`` of a dim-``dim`` of size ``full``, concatenated in
    order (Gated DeltaNet's q | k | v channels: three ranges per rank)."""
    param.tp_slice = (dim, tuple((int(a), int(b)) for a, b in pieces), full)
    return param


class ColumnParallelLinear(nn.Linear):
    """Output features ``[start, stop)`` of a full ``nn.Linear``; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, start: int, stop: int, full_out: int):
        super().__init__(in_features, out_features, bias=bias)
        _mark(self.weight, 0, start, stop, full_out)
        if self.bias is not None:
            _mark(self.bias, 0, start, stop, full_out)


class RowParallelLinear(nn.Linear):
    """Input features ``[start, stop)`` of a full ``nn.Linear``, then an all-reduce; the bias
    (not split) is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, start: int, stop: int, full_in: int,
                 tp: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        _mark(self.weight, 1, start, stop, full_in)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(F.linear(x, self.weight))

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` summed over the ranks (a LoRA delta's partial rank-R products: models/lora.py)."""
        return _all_reduce(y, self.tp)

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``y`` summed over the ranks, then the bias (also what follows
        the CPU fast path's packed product: models/layers.py ``pack_linears``)."""
        y = _all_reduce(y, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, stop)`` of the embedding (padded to an even share); tokens elsewhere give
    zeros here, and the all-reduce sums the one rank that has each."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        start, stop, per = _span(vocab_size, tp)
        super().__init__(per, dim)
        _mark(self.weight, 0, start, stop, vocab_size)
        self.tp, self.start, self.stop = tp, start, stop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        h = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return _all_reduce(h, self.tp)


class ParallelLMHead(nn.Linear):
    """Vocabulary rows ``[start, stop)`` (padded to an even share), then an all-gather of every
    rank's logits, trimmed to the vocabulary: each rank returns the full ``[N, vocab]``."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup):
        start, stop, per = _span(vocab_size, tp)
        super().__init__(dim, per, bias=False)
        _mark(self.weight, 0, start, stop, vocab_size)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(F.linear(x, self.weight))

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's logits ``y`` of its vocabulary rows, gathered and trimmed to the vocabulary."""
        return _all_gather_last(y, self.tp)[:, :self.vocab_size]


def _meta_like(make):
    """Build a replacement module on the meta device (the model being sharded is on it)."""
    with torch.device("meta"):
        return make()


def shard_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """This rank's slice of a dense Qwen model built on the meta device (module docstring)."""
    if tp.size == 1:
        return model
    config: QwenConfig = model.config
    check_tp_config(config, tp.size)
    hidden, head_dim = config.hidden_size, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    heads_per_rank = heads // tp.size
    if kv_heads >= tp.size:
        kv_per_rank, kv_first = kv_heads // tp.size, tp.rank * (kv_heads // tp.size)
    else:                                   # replicate: rank r holds KV head r // (tp / kv_heads)
        kv_per_rank, kv_first = 1, tp.rank // (tp.size // kv_heads)
    inter = config.intermediate_size // tp.size
    for layer in model.model.layers:
        mlp = layer.mlp
        if getattr(layer, "is_linear", False):
            _shard_gated_delta_net(layer.linear_attn, config, tp)
            attn = None
        else:
            attn = layer.self_attn
        if isinstance(mlp, SparseMoeBlock):
            _shard_moe(mlp, config, tp)
        else:
            _shard_mlp(mlp, hidden, inter, config.intermediate_size, tp)
        if attn is None:
            continue
        q_rows = heads_per_rank * head_dim * (2 if attn.output_gate else 1)
        q_full = attn.q_proj.out_features
        q0 = tp.rank * q_rows
        kv0, kv_rows = kv_first * head_dim, kv_per_rank * head_dim
        o0, o_cols = tp.rank * heads_per_rank * head_dim, heads_per_rank * head_dim
        bias = attn.q_proj.bias is not None
        attn.q_proj = _meta_like(lambda: ColumnParallelLinear(hidden, q_rows, bias, q0, q0 + q_rows, q_full))
        attn.k_proj = _meta_like(lambda: ColumnParallelLinear(hidden, kv_rows, bias, kv0, kv0 + kv_rows,
                                                              kv_heads * head_dim))
        attn.v_proj = _meta_like(lambda: ColumnParallelLinear(hidden, kv_rows, bias, kv0, kv0 + kv_rows,
                                                              kv_heads * head_dim))
        o_bias = attn.o_proj.bias is not None
        attn.o_proj = _meta_like(lambda: RowParallelLinear(o_cols, hidden, o_bias, o0, o0 + o_cols,
                                                           heads * head_dim, tp))
        attn.num_heads, attn.num_kv_heads = heads_per_rank, kv_per_rank
    model.model.embed_tokens = _meta_like(lambda: VocabParallelEmbedding(config.vocab_size, hidden, tp))
    model.lm_head = _meta_like(lambda: ParallelLMHead(hidden, config.vocab_size, tp))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.tp = tp
    return model


def _shard_mlp(mlp: nn.Module, hidden: int, inter: int, full_i: int, tp: TPGroup) -> None:
    i0 = tp.rank * inter
    mlp.gate_proj = _meta_like(lambda: ColumnParallelLinear(hidden, inter, False, i0, i0 + inter, full_i))
    mlp.up_proj = _meta_like(lambda: ColumnParallelLinear(hidden, inter, False, i0, i0 + inter, full_i))
    mlp.down_proj = _meta_like(lambda: RowParallelLinear(inter, hidden, False, i0, i0 + inter, full_i, tp))


class ParallelMoeExperts(MoeExperts):
    """Every expert's intermediate channels ``[start, stop)`` (gate and up rows of ``w13``, columns
    of ``w2``): ``fused_moe`` on them gives a partial sum, and one all-reduce completes it."""

    def __init__(self, config: QwenConfig, tp: TPGroup):
        nn.Module.__init__(self)
        moe = config.moe
        E, H, I = moe.num_experts, config.hidden_size, moe.moe_intermediate_size
        start, per = tp.rank * (I // tp.size), I // tp.size
        self.gate_up_proj = _mark_pieces(nn.Parameter(torch.empty(E, 2 * per, H)), 1,
                                         [(start, start + per), (I + start, I + start + per)], 2 * I)
        self.down_proj = _mark(nn.Parameter(torch.empty(E, H, per)), 2, start, start + per, I)
        self.tp = tp
        self.forward = self.forward_native

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _all_reduce(super().forward_native(x, weights, ids), self.tp)

    def forward_cpu(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _all_reduce(super().forward_cpu(x, weights, ids), self.tp)


def _shard_moe(block: SparseMoeBlock, config: QwenConfig, tp: TPGroup) -> None:
    """The experts split by intermediate channel (vLLM's tensor-parallel MoE; every rank routes every
    token, the router is whole); the shared expert like a dense MLP; its sigmoid gate whole."""
    block.experts = _meta_like(lambda: ParallelMoeExperts(config, tp))
    if block.shared_expert is not None:
        full = config.moe.shared_expert_intermediate_size
        _shard_mlp(block.shared_expert, config.hidden_size, full // tp.size, full, tp)


def _shard_gated_delta_net(gdn: nn.Module, config: QwenConfig, tp: TPGroup) -> None:
    """A Gated DeltaNet layer's share: ``num_key_heads / N`` key heads and their value heads (the
    value heads of key head h are ``[h g, (h + 1) g)``, ``g = num_value_heads / num_key_heads``), so
    the recurrence of every head stays on one rank and only ``out_proj`` sums over ranks.

    The conv's channels and ``in_proj_qkv``'s rows are ``q | k | v`` over all heads: a rank holds
    three ranges of them. ``A_log`` / ``dt_bias`` follow the value heads; the gated norm (over one
    head's channels) is whole on every rank."""
    lin = config.linear
    hidden = config.hidden_size
    hk, hv = lin.num_key_heads // tp.size, lin.num_value_heads // tp.size
    dk, dv = lin.key_head_dim, lin.value_head_dim
    kd, vd = hk * dk, hv * dv                       # this rank's key and value channels
    k0, v0 = tp.rank * kd, tp.rank * vd
    qkv_pieces = [(k0, k0 + kd), (lin.key_dim + k0, lin.key_dim + k0 + kd),
                  (2 * lin.key_dim + v0, 2 * lin.key_dim + v0 + vd)]
    conv_dim = 2 * kd + vd

    def column(out: int, pieces, full: int) -> nn.Linear:
        layer = _meta_like(lambda: ColumnParallelLinear(hidden, out, False, 0, out, full))
        _mark_pieces(layer.weight, 0, pieces, full)
        return layer

    if hasattr(gdn, "in_proj_qkvz"):
        # Qwen3-Next (its layers are mixture-of-experts here, which check_tp_config rejects first).
        raise ValueError(f"tensor parallelism of {config.model_type}'s fused in_proj_qkvz is not built")
    gdn.in_proj_qkv = column(conv_dim, qkv_pieces, lin.conv_dim)       # Qwen3.5: q | k | v, z, b, a
    gdn.in_proj_z = column(vd, [(v0, v0 + vd)], lin.value_dim)
    heads = [(tp.rank * hv, (tp.rank + 1) * hv)]
    gdn.in_proj_b = column(hv, heads, lin.num_value_heads)
    gdn.in_proj_a = column(hv, heads, lin.num_value_heads)
    kernel = lin.conv_kernel_dim
    gdn.conv1d = _meta_like(lambda: nn.Conv1d(conv_dim, conv_dim, kernel_size=kernel, groups=conv_dim, bias=False,
                                              padding=kernel - 1))
    _mark_pieces(gdn.conv1d.weight, 0, qkv_pieces, lin.conv_dim)
    for name in ("dt_bias", "A_log"):
        param = _meta_like(lambda: nn.Parameter(torch.empty(hv)))
        setattr(gdn, name, _mark(param, 0, tp.rank * hv, (tp.rank + 1) * hv, lin.num_value_heads))
    gdn.out_proj = _meta_like(lambda: RowParallelLinear(vd, hidden, False, v0, v0 + vd, lin.value_dim, tp))
    gdn.num_k_heads, gdn.num_v_heads = hk, hv
    gdn.key_dim, gdn.value_dim = kd, vd


def tp_slice(param: torch.Tensor) -> Optional[tuple[int, tuple[tuple[int, int], ...], int]]:
    """``(dim, ranges, full)``: the ranges along ``dim`` of the checkpoint tensor (of size ``full``
    there) that ``param`` holds, concatenated; or None for a whole tensor."""
    return getattr(param, "tp_slice", None)
