"""Ways to run one step of the model's forward, which the runner picks between per step.

The model has ONE forward (plain torch plus ``torch.ops.qwen.*``). An executor runs that forward
or the same math by another route:

- eager: ``model(...)`` as written;
- compiled: the runner's ``torch.compile``d decode step (Inductor or Torch-TensorRT), and its
  CUDA-graph replay (both in ``runner.py``, over static buffers);
- native CPU (``NativeCPUExecutor``, here): the dense model's whole forward in one C call
  (``cpu.dense_forward``) on weights packed once at construction; under tensor parallelism
  (fp32), on this rank's slices, the C code calling back for the all-reduce after each row-parallel
  product, and the logits gathered after it.

The native executor is an optimisation of the same math, tested against the eager op path
(``tests/test_executors.py``). It never serves stale weights: it packs at construction,
``refresh()`` repacks (the engine calls it after loading weights), and before every step it
compares every module and tensor on the path, with its storage and version counter, with what it
packed from, repacking when one changed (a replaced submodule, ``.to()``, ``param.data = ...``, an
in-place write). A write that bypasses the
version counter (``param.data.copy_(...)``) is invisible to any torch tensor; call ``refresh()``
(or ``QwenEngine.refresh_weights()``) after one.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

from qwen_ops.models.dense import QwenAttention, QwenDecoderLayer, QwenForCausalLM
from qwen_ops.models.layers import QwenMLP, RMSNorm
from qwen_ops.models.moe import SparseMoeBlock
from qwen_ops.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, _all_gather_last,
                                      _all_reduce)
from qwen_ops.ops import validation as V
from qwen_ops.ops.backend import resolve_backend, value_checks_enabled
from qwen_ops.ops.kernels import cpu as cpu_kernels
from qwen_ops.ops.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
_VERSION = operator.attrgetter("_version")


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32, copy=True).contiguous()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:     # an inference tensor has no version counter (and stays as made)
        return -1


class NativeCPUExecutor:
    """``cpu.dense_forward`` for a Qwen2/Qwen3 model (dense, or qwen3_moe) in fp32 or bf16 on the CPU.

    A mixture-of-experts layer's MLP is called back from the C forward: the router in torch (the
    model's own), the routed experts in C on weights packed once (``cpu.moe_packed``; bf16 models
    run the whole ``SparseMoeBlock`` as written); the rest of the step (norms, projections,
    attention, dense MLPs, lm_head) is C.

    A bf16 model keeps bf16 weights (packed, half the bytes of fp32) and bf16 KV caches, and its
    activations are rounded to bf16 where the model's forward rounds them (products and norms
    compute in fp32, as torch's bf16 ops do); tested against the op path in
    ``tests/test_native_bf16.py``.

    Covers batches of up to ``cpu.DENSE_FORWARD_MAX_TOKENS`` tokens whose sequence chunks have at
    most ``cpu.REFERENCE_ABOVE_QUERY_LEN`` query rows, at any intra-op thread count: the products
    split across torch's threads (``cpu.threaded_products()``), the rest runs on one, and the
    results do not depend on the count. ``supports`` says whether a step fits; the runner runs
    the others eagerly.
    """

    def __init__(self, model: torch.nn.Module):
        reason = self.why_not(model)
        if reason is not None:
            raise ValueError(f"the native CPU executor cannot run this model: {reason}")
        self.model = model
        self._key: Optional[tuple] = None
        self.refresh()

    # ------------------------------------------------------------------ eligibility
    @staticmethod
    def why_not(model: torch.nn.Module) -> Optional[str]:
        """None when the executor can hold ``model``, else the reason (the runner logs nothing:
        an ineligible model simply runs eagerly)."""
        if type(model) is not QwenForCausalLM:
            return f"{type(model).__name__} is not the dense QwenForCausalLM"
        if cpu_kernels.why_unavailable() is not None:
            return f"the cpu backend's C kernels are unavailable ({cpu_kernels.why_unavailable()})"
        tp = getattr(model, "tp", None)
        parallel = tp is not None and tp.size > 1
        # Under tensor parallelism every split layer is its parallel class, on the model's group.
        column = ColumnParallelLinear if parallel else torch.nn.Linear
        row = RowParallelLinear if parallel else torch.nn.Linear
        for layer in model.model.layers:
            if not (type(layer) is QwenDecoderLayer and type(layer.self_attn) is QwenAttention
                    and type(layer.mlp) in (QwenMLP, SparseMoeBlock)):
                return "a decoder layer was replaced"
            mlp = layer.mlp
            if type(mlp) is SparseMoeBlock:
                if parallel:
                    return ("tensor-parallel mixture-of-experts layers run on the op path (their experts "
                            "all-reduce in the module)")
            elif (any(m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
                    or type(mlp.gate_proj) is not column or type(mlp.up_proj) is not column
                    or type(mlp.down_proj) is not row):
                return f"the MLP has biases or projections other than {column.__name__} / {row.__name__}"
            attn = layer.self_attn
            if (any(type(m) is not column for m in (attn.q_proj, attn.k_proj, attn.v_proj))
                    or type(attn.o_proj) is not row):
                return f"an attention projection is not a {column.__name__} / {row.__name__}"
            if parallel and (attn.o_proj.bias is not None or attn.o_proj.tp is not tp or mlp.down_proj.tp is not tp):
                return "a row-parallel projection has a bias or another tensor-parallel group"
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
            if any(type(n) is not RMSNorm or n.eps != model.model.norm.eps for n in norms):
                return "the norms differ from one RMSNorm eps"
        lm_head = model.lm_head
        head = ParallelLMHead if parallel else torch.nn.Linear
        if type(lm_head) is not head or lm_head.bias is not None or (parallel and lm_head.tp is not tp):
            return f"lm_head is not a bias-free {head.__name__}"
        dtype = lm_head.weight.dtype
        if parallel and dtype != torch.float32:
            return (f"tensor parallelism with {dtype} weights runs on the op path (the native forward's "
                    "tensor-parallel reduce covers float32)")
        for name, p in model.named_parameters():
            if p.dtype != dtype or p.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
                return (f"{name} is {p.dtype} on {p.device} and lm_head.weight {dtype}, expected every weight "
                        "float32, or every weight bfloat16, on the CPU")
        return None

    def supports(self, num_tokens: int, max_query_len: int, kv_caches: list[KVCache]) -> bool:
        """Whether a step of ``num_tokens`` tokens in chunks of at most ``max_query_len`` runs here:
        CPU caches of one layout in the model's dtype, the cpu backend selected for the ops
        (``QWEN_OPS_BACKEND=reference`` keeps everything in torch), and a batch the C code's
        scratch and its attention kernel cover."""
        if (num_tokens > cpu_kernels.DENSE_FORWARD_MAX_TOKENS or max_query_len > cpu_kernels.REFERENCE_ABOVE_QUERY_LEN
                or len(kv_caches) != len(self.model.model.layers)):
            return False
        key_cache = kv_caches[0][0]
        if key_cache.device.type != "cpu" or resolve_backend(key_cache.device, "kv_write") != "cpu":
            return False
        layout = (key_cache.shape, key_cache.stride())
        dtype = self._dtype
        return all(t.dtype == dtype and (t.shape, t.stride()) == layout for pair in kv_caches for t in pair)

    # ------------------------------------------------------------------ packing
    def _path_tensors(self) -> tuple[list[torch.nn.Module], list[torch.Tensor]]:
        """The modules the C forward reads, found now through the modules' own dicts (a replaced
        child module shows up here; nn.Module attribute access would cost ~0.3 us a name), and
        their parameters and buffers."""
        top = self.model._modules
        inner = top["model"]._modules
        mods = [top["lm_head"], inner["norm"], inner["rotary_emb"]]
        for layer in inner["layers"]._modules.values():
            lm = layer._modules
            mods += (layer, lm["self_attn"], lm["mlp"], lm["input_layernorm"], lm["post_attention_layernorm"])
            mods += lm["self_attn"]._modules.values()
            mods += lm["mlp"]._modules.values()
        mods = [m for m in mods if m is not None]          # q_norm / k_norm are None in Qwen2
        tensors = [t for m in mods for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
        return mods, tensors

    def _identity(self) -> tuple[tuple, tuple]:
        """(key, objects): every module and tensor on the path, with its storage and version
        counter, and the objects themselves. Runs before every step."""
        mods, tensors = self._path_tensors()
        try:   # C-level maps
            versions = tuple(map(_VERSION, tensors))
        except RuntimeError:
            versions = tuple(map(_version, tensors))
        key = (tuple(map(id, mods)), tuple(map(id, tensors)), tuple(map(torch.Tensor.data_ptr, tensors)), versions)
        return key, (mods, tensors)

    def refresh(self) -> None:
        """Repack every weight from the model as it is now (after a load, ``.to()`` or an update)."""
        reason = self.why_not(self.model)
        if reason is not None:
            raise ValueError(f"the native CPU executor cannot run this model any more: {reason}")
        m = self.model
        dtype = m.lm_head.weight.dtype
        with torch.no_grad():
            layers = []
            for layer in m.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                weights = {
                    "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                    "q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj,
                    "q_bias": a.q_proj.bias, "k_bias": a.k_proj.bias, "v_bias": a.v_proj.bias, "o_bias": a.o_proj.bias,
                    "q_norm": None if a.q_norm is None else a.q_norm.weight,
                    "k_norm": None if a.k_norm is None else a.k_norm.weight,
                    # A mixture-of-experts MLP: no weights here; the C code calls back for it (run()).
                    "gate": getattr(mlp, "gate_proj", None), "up": getattr(mlp, "up_proj", None),
                    "down": getattr(mlp, "down_proj", None),
                }
                if set(weights) != set(cpu_kernels.DENSE_LAYER_WEIGHTS):
                    raise AssertionError("NativeCPUExecutor and cpu.DENSE_LAYER_WEIGHTS disagree")
                # Matrices as packed panels in the model's dtype; vectors as contiguous fp32 copies
                # (the C code reads them flat; a bf16 value is exact in fp32).
                layers.append([cpu_kernels.pack_panels(w.weight.detach().contiguous())
                               if isinstance(w, torch.nn.Linear)
                               else None if w is None else _fp32_copy(w)
                               for w in (weights[name] for name in cpu_kernels.DENSE_LAYER_WEIGHTS)])
            # Per layer: its MoE block or None, and (qwen3_moe in fp32) every expert's w13 and w2
            # packed too, for cpu.moe_packed (bf16 models run the block's own experts).
            self._moe = [layer.mlp if type(layer.mlp) is SparseMoeBlock else None for layer in m.model.layers]
            self._experts = [None] * len(layers)
            if dtype == torch.float32:
                for i, block in enumerate(self._moe):
                    if block is not None:
                        ex = block.experts
                        w13 = [cpu_kernels.pack_panels(w.detach().contiguous()) for w in ex.gate_up_proj]
                        w2 = [cpu_kernels.pack_panels(w.detach().contiguous()) for w in ex.down_proj]
                        self._experts[i] = (w13, w2, cpu_kernels.addresses(w13), cpu_kernels.addresses(w2),
                                            ex.down_proj.shape[2])
            dense = next((layer.mlp for layer in m.model.layers if type(layer.mlp) is QwenMLP), None)
            self._inter = 0 if dense is None else dense.gate_proj.out_features
            self._dtype = dtype
            self._layers = layers
            self._addresses = cpu_kernels.addresses(w for layer in layers for w in layer)
            self._lm_head = cpu_kernels.pack_panels(m.lm_head.weight.detach().contiguous())
            self._final_norm = _fp32_copy(m.model.norm.weight)
            # The model casts the fp32 table's rows to its dtype (RotaryEmbedding.forward): the same values.
            self._rope = m.model.rotary_emb.cos_sin.detach().to(dtype).to(torch.float32).contiguous()
        # The objects stay referenced, so no id in the key can be reused by a new object.
        self._key, self._packed_from = self._identity()

    # ------------------------------------------------------------------ one step
    def _check_metadata(self, num_tokens: int, positions32: torch.Tensor, attn: AttentionMetadata,
                        kv_caches: list[KVCache]) -> None:
        """The checks torch.ops.qwen.kv_write and slot_attention make on every call, made once for
        all layers (the C code takes the metadata as it is)."""
        a = self.model.model.layers[0].self_attn
        key_cache, value_cache = kv_caches[0]
        q = key_cache.new_empty((num_tokens, a.num_heads, a.head_dim))
        k = key_cache.new_empty((num_tokens, a.num_kv_heads, a.head_dim))
        V.check_kv_write(k, k, key_cache, value_cache, attn.slot_ids, positions32, attn.block_table)
        V.check_slot_attention(q, key_cache, value_cache, attn.block_table, attn.seq_slots, attn.query_start_loc,
                               attn.seq_lens, a.scale, attn.max_query_len, None)
        if value_checks_enabled("cpu"):
            V.check_kv_write_values(key_cache, attn.slot_ids, positions32, attn.block_table)
            V.check_slot_attention_values(q, key_cache, attn.block_table, attn.seq_slots, attn.query_start_loc,
                                          attn.seq_lens, attn.max_query_len)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
            kv_caches: list[KVCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``: the model's forward (same arguments) in one C call."""
        if not self.supports(input_ids.shape[0], attn.max_query_len, kv_caches):
            raise ValueError("this step does not fit the native CPU executor (see NativeCPUExecutor.supports)")
        if self._identity()[0] != self._key:     # a module or weight was replaced, moved or written: repack
            self.refresh()
        m = self.model
        positions32 = positions.to(torch.int32)
        self._check_metadata(input_ids.shape[0], positions32, attn, kv_caches)
        # The embedding module's own forward: under tensor parallelism, its all-reduce.
        h = m.model.embed_tokens(input_ids).to(torch.float32).contiguous()   # bf16 embeddings: exact in fp32
        a = m.model.layers[0].self_attn
        tp = getattr(m, "tp", None)
        reduce = None
        if tp is not None and tp.size > 1:
            def reduce(partial: torch.Tensor) -> None:       # the same collective as RowParallelLinear's
                partial.copy_(_all_reduce(partial, tp))
        mlp = None
        if any(block is not None for block in self._moe):
            def mlp(layer: int, x: torch.Tensor, out: torch.Tensor) -> None:     # the model's own block
                block, packed = self._moe[layer], self._experts[layer]
                if packed is None:                                  # bf16: its own experts too
                    out.copy_(block(x.to(self._dtype)))
                    return
                out.copy_(block(x, experts=lambda x, weights, ids: cpu_kernels.moe_packed(
                    x, ids, weights, packed[2], packed[3], packed[4], torch.empty_like(x))))
        logits = cpu_kernels.dense_forward(
            h, self._addresses, kv_caches, a.num_heads, a.head_dim, self._inter, m.model.norm.eps, a.scale, positions32, self._rope, attn.slot_ids, attn.block_table, attn.seq_slots,
            attn.query_start_loc, attn.seq_lens, logits_indices, self._final_norm, self._lm_head,
            m.lm_head.out_features, reduce=reduce, mlp=mlp)
        if reduce is not None:                              # ParallelLMHead's gather of each rank's rows
            logits = _all_gather_last(logits, tp)[:, :m.lm_head.vocab_size]
        return logits
