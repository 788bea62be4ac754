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

Eager fp32 forwards on the CPU without autograd (the engine's case), with the cpu backend
selected (:func:`use_fused_cpu_kernels`), check the attention metadata once as the ops would, then
run the whole forward in one C call (``cpu.dense_forward``: batches of up to 1024 tokens in chunks
of at most 96 rows) or walk the modules with fused C kernels (norms, RoPE, per-layer attention
blocks, SiLU * up). Traced forwards always take the torch code and the ops.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from qwen_ops.ops import validation as V
from qwen_ops import ops  # noqa: F401  (registers torch.ops.qwen.*)
from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.ops.backend import value_checks_enabled
from qwen_ops.models.config import QwenConfig
from qwen_ops.ops.kernels import cpu as cpu_kernels
from qwen_ops.models.linear import Linear, linear_group, tensor_identity

KVCache = tuple[torch.Tensor, torch.Tensor]
_VERSION = operator.attrgetter("_version")


def use_fused_cpu_kernels(h: torch.Tensor) -> bool:
    """Whether this eager forward runs its norms and RoPE through the cpu backend's fused C kernels.

    Only for fp32 CPU activations without autograd, when the ops resolve to the cpu backend
    (``QWEN_OPS_BACKEND=reference`` keeps the whole model in torch), and never while
    ``torch.compile`` traces (Inductor fuses the torch code itself). The fused calls (RMSNorm with
    the residual add, q/k-norm + RoPE, SiLU * up) replace 2-34 torch ops each, whose dispatch
    dominates a small eager CPU decode step.
    """
    return not torch.is_grad_enabled() and cpu_kernels.usable_for(h)


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
        self.q_proj = Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = Linear(q_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                attn: AttentionMetadata, kv_cache: KVCache, cos_sin: torch.Tensor | None = None,
                native: bool = False) -> torch.Tensor:
        """``cos_sin`` (the fp32 RoPE table) selects the fused C path; ``cos``/``sin`` are then unused.
        ``native`` (with ``cos_sin``): norms, RoPE, kv write and attention in one C call, the caller
        having checked the metadata as the ops would (QwenForCausalLM.forward does)."""
        T = x.shape[0]
        q, k, v = linear_group(x, (self.q_proj, self.k_proj, self.v_proj))
        if native:
            norms = self.q_norm is not None
            o = cpu_kernels.attention_block(q, k, v, self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.q_norm.weight if norms else None,
                                            self.k_norm.weight if norms else None,
                                            self.q_norm.eps if norms else 0.0, cos_sin, positions32, kv_cache,
                                            attn, self.scale)
            return self.o_proj(o)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if cos_sin is not None:
            norms = self.q_norm is not None
            q, k = cpu_kernels.qk_norm_rope(q, k, self.q_norm.weight if norms else None,
                                            self.k_norm.weight if norms else None,
                                            self.q_norm.eps if norms else 0.0, cos_sin, positions32)
        else:
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
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: the gate's SiLU and the product in one C kernel (see use_fused_cpu_kernels)."""
        gate, up = linear_group(x, (self.gate_proj, self.up_proj))
        if fused:
            return self.down_proj(cpu_kernels.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.self_attn = QwenAttention(config)
        self.mlp = QwenMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions32: torch.Tensor,
                attn: AttentionMetadata, kv_cache: KVCache, cos_sin: torch.Tensor | None = None,
                native: bool = False) -> torch.Tensor:
        if cos_sin is not None:   # fused C norms and RoPE (see use_fused_cpu_kernels)
            x, _ = cpu_kernels.rms_norm(h, self.input_layernorm.weight, self.input_layernorm.eps)
            a = self.self_attn(x, cos, sin, positions32, attn, kv_cache, cos_sin, native)
            x, h = cpu_kernels.rms_norm(a, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                                        add=h)   # h = h + a, x = norm(h)
            return h + self.mlp(x, fused=True)
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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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
        table = None
        native = False   # attention blocks in one C call each (metadata checked here, once)
        if use_fused_cpu_kernels(h):
            if self._native_caches(kv_caches):
                self._check_attention_metadata(h.shape[0], positions32, attn, kv_caches)
                native = attn.max_query_len <= cpu_kernels.REFERENCE_ABOVE_QUERY_LEN
                if (native and h.shape[0] <= cpu_kernels.DENSE_FORWARD_MAX_TOKENS
                        and cpu_kernels.packed_products_enabled()):
                    logits = self._native_forward(h, positions32, attn, kv_caches, logits_indices)
                    if logits is not None:
                        return logits
            table = self.model.rotary_emb.cos_sin     # read by position inside the C kernel: check them
            if positions32.numel() and (int(positions32.min()) < 0 or int(positions32.max()) >= table.shape[0]):
                raise cpu_kernels.position_error(positions32, table.shape[0])
            cos = sin = None
        else:
            cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, positions32, attn, kv_cache, table, native)
        # RMSNorm is row-wise, so normalising only the selected rows gives the same values and
        # skips the lm_head matmul on every other row.
        h = torch.index_select(h, 0, logits_indices)
        if table is not None:
            h, _ = cpu_kernels.rms_norm(h, self.model.norm.weight, self.model.norm.eps)
        else:
            h = self.model.norm(h)
        return self.lm_head(h)

    # ---- the eager CPU path: the whole forward in one C call (see the module docstring) ----

    def _native_layer_weights(self) -> Optional[list[tuple[Optional[torch.Tensor], ...]]]:
        """Per layer, the tensors of ``cpu_kernels.DENSE_LAYER_WEIGHTS`` (matrices as the modules'
        packed copies, ``Linear.panels``), or None when a module is not the stock one, a weight is
        not a contiguous fp32 tensor or a projection has ``prepack`` off (the modules then run)."""
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (type(layer) is QwenDecoderLayer and type(attn) is QwenAttention and type(mlp) is QwenMLP):
                return None
            mods = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            if any(type(m) is not Linear for m in mods) or any(m.bias is not None for m in mods[4:]):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm) + (
                (attn.q_norm, attn.k_norm) if attn.q_norm is not None else ())
            if any(type(n) is not RMSNorm or n.eps != layer.input_layernorm.eps for n in norms):
                return None
            q_norm = None if attn.q_norm is None else attn.q_norm.weight
            k_norm = None if attn.k_norm is None else attn.k_norm.weight
            ws = (layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
                  attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias, q_norm, k_norm, attn.o_proj.weight,
                  attn.o_proj.bias, layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                  mlp.down_proj.weight)
            if any(w is not None and (w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous())
                   for w in ws) or not all(m.prepack for m in mods):
                return None
            # the matrices as the modules' packed copies (Linear.panels), shared with their own calls
            panels = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
                      "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
            layers.append(tuple(panels[name].panels() if name in panels else w
                                for name, w in zip(cpu_kernels.DENSE_LAYER_WEIGHTS, ws)))
        return layers

    def prepare_cpu_forward(self, kv_caches: list[KVCache]) -> None:
        """Pack the weights for the eager CPU forward now (the first such forward would): the
        runner calls this at construction, so no request waits for it."""
        with torch.inference_mode():
            probe = self.model.embed_tokens.weight[:1]
            if (use_fused_cpu_kernels(probe) and cpu_kernels.packed_products_enabled()
                    and self._native_caches(kv_caches)):
                self._native_plan()

    def _native_caches(self, kv_caches: list[KVCache]) -> bool:
        """Whether the caches suit the C attention blocks: fp32, one shape and one set of strides."""
        if not kv_caches:
            return False
        key_cache = kv_caches[0][0]
        layout = (key_cache.shape, key_cache.stride())
        return key_cache.dtype == torch.float32 and all(
            t.dtype == torch.float32 and (t.shape, t.stride()) == layout for pair in kv_caches for t in pair)

    def _check_attention_metadata(self, T: int, positions32: torch.Tensor, attn: AttentionMetadata,
                                  kv_caches: list[KVCache]) -> None:
        """The checks torch.ops.qwen.kv_write and slot_attention make on every call, made once for
        all layers (the C attention blocks take the metadata as it is): shapes, dtypes and devices
        always; index values unless the caller is trusted (the engine), as the host backends do."""
        attn_mod = self.model.layers[0].self_attn
        key_cache, value_cache = kv_caches[0]
        q = key_cache.new_empty((T, attn_mod.num_heads, attn_mod.head_dim))
        k = key_cache.new_empty((T, attn_mod.num_kv_heads, attn_mod.head_dim))
        V.check_kv_write(k, k, key_cache, value_cache, attn.slot_ids, positions32, attn.block_table)
        V.check_slot_attention(q, key_cache, value_cache, attn.block_table, attn.seq_slots, attn.query_start_loc,
                               attn.seq_lens, attn_mod.scale, attn.max_query_len, None)
        if value_checks_enabled("cpu"):
            V.check_kv_write_values(key_cache, attn.slot_ids, positions32, attn.block_table)
            V.check_slot_attention_values(q, key_cache, attn.block_table, attn.seq_slots, attn.query_start_loc,
                                          attn.seq_lens, attn.max_query_len)

    def _native_objects(self) -> tuple[list, list]:
        """Every module and parameter the one-call forward reads, found through the modules' own
        dicts (nn.Module attribute access costs ~0.3 us a name; this walk a few us in all)."""
        top = self._modules
        inner = top["model"]._modules
        mods = [top["lm_head"], inner["norm"]]
        for layer in inner["layers"]._modules.values():
            lm = layer._modules
            mods += (layer, lm["self_attn"], lm["mlp"], lm["input_layernorm"], lm["post_attention_layernorm"])
            mods += lm["self_attn"]._modules.values()
            mods += lm["mlp"]._modules.values()
        return mods, [p for m in mods for p in m._parameters.values() if p is not None]

    def _native_plan(self) -> Optional[tuple[list, torch.Tensor, torch.Tensor]]:
        """(packed weights, the per-layer weight addresses, the packed lm_head) for
        ``cpu_kernels.dense_forward``, or None when the model does not fit it. Cached, and rebuilt
        (with all the checks) when any module or parameter on the path is replaced, moved
        (``.to()``, ``param.data = ...``) or written in place (its version counter; writes through
        ``param.data`` are not tracked, as for any torch version counter)."""
        mods, params = self._native_objects()
        try:   # C-level maps: this runs before every small-batch forward
            versions = tuple(map(_VERSION, params))
        except RuntimeError:   # an inference tensor has no version counter (and stays as made)
            versions = tuple(tensor_identity(p)[1] for p in params)
        key = (tuple(map(id, mods)), tuple(map(id, params)), tuple(map(torch.Tensor.data_ptr, params)), versions)
        objects = (mods, params)
        cached = self.__dict__.get("_native_cache")
        if cached is not None and cached[0] == key:
            return cached[2]
        plan = None
        weights = self._native_layer_weights()
        norm, lm_head = self.model.norm, self.lm_head
        if (weights is not None and type(norm) is RMSNorm and norm.eps == self.model.layers[0].input_layernorm.eps
                and type(lm_head) is Linear and lm_head.bias is None and lm_head.prepack
                and all(w.dtype == torch.float32 and w.is_contiguous() for w in (norm.weight, lm_head.weight))):
            plan = (weights, cpu_kernels.addresses(w for layer in weights for w in layer), lm_head.panels())
        self.__dict__["_native_cache"] = (key, objects, plan)   # objects: alive, so no id is reused
        return plan

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state.pop("_native_cache", None)   # addresses of this instance's tensors
        return state

    def _apply(self, fn, recurse: bool = True):
        self.__dict__.pop("_native_cache", None)   # .to() / .half() ...: the plan's tensors are the old ones
        return super()._apply(fn, recurse)

    def _native_forward(self, h: torch.Tensor, positions32: torch.Tensor, attn: AttentionMetadata,
                        kv_caches: list[KVCache], logits_indices: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits from ``cpu_kernels.dense_forward`` (the same math as the torch path, with the
        cpu backend's kernels), or None when this model does not fit it. The caller has checked the
        caches (``_native_caches``) and the metadata (``_check_attention_metadata``)."""
        plan = self._native_plan()
        if plan is None or len(kv_caches) != len(plan[0]):
            return None
        norm, attn_mod = self.model.norm, self.model.layers[0].self_attn
        return cpu_kernels.dense_forward(
            h, plan[1], kv_caches, attn_mod.num_heads, attn_mod.head_dim, self.config.intermediate_size,
            norm.eps, attn_mod.scale, positions32, self.model.rotary_emb.cos_sin, attn.slot_ids, attn.block_table,
            attn.seq_slots, attn.query_start_loc, attn.seq_lens, logits_indices, norm.weight, plan[2],
            self.lm_head.out_features)
