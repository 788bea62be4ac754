"""Argument checks shared by every backend and by the fake kernels.

``check_*`` functions look only at metadata (shape, dtype, device, strides), so they also
run on fake tensors while tracing. ``check_*_values`` read index tensors and therefore
sync the device; the reference backend always runs them, other backends only under
``QWEN_OPS_DEBUG=1`` (a CUDA graph may not read device values).

Every error names the argument, the value found and what was expected, and is raised
before anything is written.
"""

from __future__ import annotations

from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)     # a quantized KV cache (ops/kv_quant.py)
INDEX_DTYPE = torch.int32


def _rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(t.shape)} (rank {t.dim()}), expected rank {rank}: {layout}")


def _index(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dtype != INDEX_DTYPE:
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.int32")
    _rank(name, t, rank, layout)


def _float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of float32, float16, bfloat16")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} has stride {t.stride()}: its last dimension must be contiguous (stride 1)")


def _same_device(**tensors: Optional[torch.Tensor]) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all tensors must be on one device")


def _cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    _rank("key_cache", key_cache, 4, layout)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype in FP8_DTYPES:
            if t.stride(-1) != 1 and t.shape[-1] > 1:
                raise ValueError(f"{name} has stride {t.stride()}: its last dimension must be contiguous (stride 1)")
        elif t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}, expected one of float32, float16, bfloat16 (the model's "
                             "dtype) or float8_e4m3fn, float8_e5m2 (a quantized cache)")
        else:
            _float(name, t)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache has shape {tuple(value_cache.shape)}, expected the shape of "
                         f"key_cache {tuple(key_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache has dtype {value_cache.dtype}, expected key_cache's {key_cache.dtype}")


def _check_kv_scales(key_cache, k_scale, v_scale) -> None:
    """k_scale / v_scale: None or one-element float32 tensors on the cache's device (read for fp8 caches)."""
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            continue
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(f"{name} has dtype {t.dtype} and shape {tuple(t.shape)}, expected a one-element "
                             "float32 tensor (the cache's per-tensor scale) or None (1.0)")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}; "
                             "all tensors must be on one device")


def _cache_takes(name: str, t: torch.Tensor, key_cache: torch.Tensor) -> None:
    """A tensor written to / read against the caches: their dtype, or any float dtype for an fp8 cache."""
    if key_cache.dtype in FP8_DTYPES:
        return
    if t.dtype != key_cache.dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected the cache dtype {key_cache.dtype}")


def check_kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                   v_scale=None) -> None:
    _same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                 slot_ids=slot_ids, positions=positions, block_table=block_table)
    _cache_pair(key_cache, value_cache)
    _check_kv_scales(key_cache, k_scale, v_scale)
    _, _, kv_heads, head_dim = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        _rank(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        _float(name, t)
        if tuple(t.shape[1:]) != (kv_heads, head_dim):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [num_tokens, {kv_heads}, {head_dim}] "
                             f"to match the cache's num_kv_heads={kv_heads}, head_dim={head_dim}")
        _cache_takes(name, t, key_cache)
    if value.dtype != key.dtype:
        raise ValueError(f"value has dtype {value.dtype}, expected key's {key.dtype}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value has {value.shape[0]} tokens but key has {key.shape[0]}")
    num_tokens = key.shape[0]
    for name, t in (("slot_ids", slot_ids), ("positions", positions)):
        _index(name, t, 1, "[num_tokens]")
        if t.shape[0] != num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} entries, expected num_tokens = {num_tokens}")
    _index("block_table", block_table, 2, "[max_slots, max_blocks_per_slot]")


def check_slot_attention(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                         seq_lens, scale, max_query_len, gate, k_scale=None, v_scale=None) -> None:
    _same_device(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                 seq_slots=seq_slots, query_start_loc=query_start_loc, seq_lens=seq_lens, gate=gate)
    _cache_pair(key_cache, value_cache)
    _check_kv_scales(key_cache, k_scale, v_scale)
    _, _, kv_heads, head_dim = key_cache.shape
    _rank("query", query, 3, "[num_tokens, num_heads, head_dim]")
    _float("query", query)
    if query.shape[2] != head_dim:
        raise ValueError(f"query has head_dim {query.shape[2]} (shape {tuple(query.shape)}), "
                         f"expected the cache's head_dim {head_dim}")
    if query.shape[1] % kv_heads != 0:
        raise ValueError(f"query has {query.shape[1]} heads, expected a multiple of the cache's "
                         f"num_kv_heads = {kv_heads}")
    _cache_takes("query", query, key_cache)
    if gate is not None:
        _float("gate", gate)
        if gate.shape != query.shape:
            raise ValueError(f"gate has shape {tuple(gate.shape)}, expected the query shape {tuple(query.shape)}")
        if gate.dtype != query.dtype:
            raise ValueError(f"gate has dtype {gate.dtype}, expected the query dtype {query.dtype}")
    _index("block_table", block_table, 2, "[max_slots, max_blocks_per_slot]")
    _check_seq_metadata(seq_slots, query_start_loc, seq_lens)
    if not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len = {max_query_len!r}, expected an int >= 1")
    if not (scale == scale and abs(scale) != float("inf")):
        raise ValueError(f"scale = {scale!r}, expected a finite float")


def _slot_capacity(block_table: torch.Tensor, key_cache: torch.Tensor) -> int:
    return block_table.shape[1] * key_cache.shape[1]


def _check_blocks(block_table, slots, num_blocks_needed, num_blocks, what) -> None:
    """Every block a sequence uses must name a physical block of the cache."""
    if slots.numel() == 0:
        return
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] < num_blocks_needed[:, None]
    rows = block_table[slots.long()]
    bad = used & ((rows < 0) | (rows >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        slot = int(slots[i])
        raise ValueError(f"block_table[{slot}, {j}] = {int(rows[i, j])} ({what}), but the cache has "
                         f"{num_blocks} blocks; expected 0 <= block id < {num_blocks}")


def check_kv_write_values(key_cache, slot_ids, positions, block_table) -> None:
    max_slots = block_table.shape[0]
    capacity = _slot_capacity(block_table, key_cache)
    bad = (slot_ids < -1) | (slot_ids >= max_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot_ids[{i}] = {int(slot_ids[i])}, but block_table has {max_slots} slots; "
                         f"expected -1 (padding) or 0 <= slot < {max_slots}")
    live = slot_ids >= 0
    bad = live & ((positions < 0) | (positions >= capacity))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"positions[{i}] = {int(positions[i])} for slot {int(slot_ids[i])}, but a slot holds "
                         f"{capacity} positions (block_table columns x block_size); expected 0 <= position < {capacity}")
    block_size = key_cache.shape[1]
    slots, pos = slot_ids[live], positions[live]
    if slots.numel():
        block_ids = block_table[slots.long(), (pos // block_size).long()]
        bad = (block_ids < 0) | (block_ids >= key_cache.shape[0])
        if bool(bad.any()):
            i = int(live.nonzero()[bad.nonzero()[0, 0], 0])
            j = int(positions[i]) // block_size
            raise ValueError(f"block_table[{int(slot_ids[i])}, {j}] = {int(block_ids[bad][0])} (for positions[{i}]), "
                             f"but the cache has {key_cache.shape[0]} blocks")


def _check_query_start_loc(qsl, num_tokens: int) -> torch.Tensor:
    """query_start_loc must be a non-decreasing prefix sum from 0 to num_tokens; returns q_lens."""
    if qsl.numel() and int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0] = {int(qsl[0])}, expected 0")
    q_lens = qsl[1:] - qsl[:-1]
    if bool((q_lens < 0).any()):
        i = int((q_lens < 0).nonzero()[0, 0])
        raise ValueError(f"query_start_loc decreases at index {i + 1} ({int(qsl[i])} -> {int(qsl[i + 1])}); "
                         "expected a non-decreasing prefix sum")
    if qsl.numel() and int(qsl[-1]) != num_tokens:
        raise ValueError(f"query_start_loc[-1] = {int(qsl[-1])}, expected num_tokens = {num_tokens} (query rows)")
    return q_lens


def _check_seq_slots(seq_slots, max_slots: int, holder: str) -> None:
    bad = (seq_slots < -1) | (seq_slots >= max_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"seq_slots[{i}] = {int(seq_slots[i])}, but {holder} has {max_slots} slots; "
                         f"expected -1 (padding) or 0 <= slot < {max_slots}")


def check_slot_attention_values(query, key_cache, block_table, seq_slots, query_start_loc, seq_lens,
                                max_query_len) -> None:
    num_tokens = query.shape[0]
    max_slots = block_table.shape[0]
    capacity = _slot_capacity(block_table, key_cache)
    q_lens = _check_query_start_loc(query_start_loc, num_tokens)
    _check_seq_slots(seq_slots, max_slots, "block_table")
    if q_lens.numel() and int(q_lens.max()) > max_query_len:
        i = int(q_lens.argmax())
        raise ValueError(f"max_query_len = {max_query_len}, but sequence {i} has {int(q_lens[i])} query tokens; "
                         "expected max_query_len >= every query length")
    live = seq_slots >= 0
    bad = live & ((seq_lens < q_lens) | (seq_lens > capacity))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])} with {int(q_lens[i])} query tokens, expected "
                         f"{int(q_lens[i])} <= seq_len <= {capacity} (the slot's capacity)")
    block_size = key_cache.shape[1]
    needed = (seq_lens[live] + block_size - 1) // block_size
    _check_blocks(block_table, seq_slots[live], needed, key_cache.shape[0], "a block the sequence reads")


# --------------------------------------------------------------------------------------------
# Slot-state ops of hybrid models: causal_conv1d and gated_delta_rule
# --------------------------------------------------------------------------------------------

def _check_seq_metadata(seq_slots, query_start_loc, seq_lens) -> None:
    """seq_slots, seq_lens int32 [num_seqs], query_start_loc int32 [num_seqs + 1] (shapes only)."""
    _index("seq_slots", seq_slots, 1, "[num_seqs]")
    _index("seq_lens", seq_lens, 1, "[num_seqs]")
    _index("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    num_seqs = seq_slots.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, expected num_seqs = {num_seqs} (len of seq_slots)")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries, expected num_seqs + 1 = "
                         f"{num_seqs + 1} (seq_slots has {num_seqs})")


def check_causal_conv1d(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> None:
    _same_device(x=x, weight=weight, bias=bias, conv_state=conv_state, seq_slots=seq_slots,
                 query_start_loc=query_start_loc, seq_lens=seq_lens)
    _rank("x", x, 2, "[num_tokens, dim]")
    _float("x", x)
    dim = x.shape[1]
    _rank("weight", weight, 2, "[dim, kernel] (the depthwise Conv1d weight [dim, 1, kernel] squeezed)")
    _float("weight", weight)
    if weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [{dim}, kernel >= 1] to match x's dim = {dim}")
    kernel = weight.shape[1]
    if bias is not None:
        _rank("bias", bias, 1, "[dim]")
        _float("bias", bias)
        if bias.shape[0] != dim:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{dim}] to match x's dim = {dim}")
    _rank("conv_state", conv_state, 3, "[max_slots, dim, kernel - 1]")
    _float("conv_state", conv_state)
    if conv_state.shape[1:] != (dim, kernel - 1):
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected [max_slots, {dim}, {kernel - 1}] "
                         f"for x's dim = {dim} and weight's kernel = {kernel}")
    for name, t in (("weight", weight), ("bias", bias), ("conv_state", conv_state)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected x's dtype {x.dtype}")
    _check_seq_metadata(seq_slots, query_start_loc, seq_lens)


def check_gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale) -> None:
    _same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, seq_slots=seq_slots,
                 query_start_loc=query_start_loc, seq_lens=seq_lens)
    _rank("q", q, 3, "[num_tokens, num_k_heads, k_dim]")
    _float("q", q)
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected q's shape {tuple(q.shape)}")
    _float("k", k)
    _rank("v", v, 3, "[num_tokens, num_v_heads, v_dim]")
    _float("v", v)
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    if v.shape[0] != num_tokens:
        raise ValueError(f"v has {v.shape[0]} tokens (shape {tuple(v.shape)}), expected q's num_tokens = {num_tokens}")
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"v has {num_v_heads} heads, expected a multiple of q/k's num_k_heads = {num_k_heads}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected q's dtype {q.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        _rank(name, t, 2, "[num_tokens, num_v_heads]")
        _float(name, t)
        if tuple(t.shape) != (num_tokens, num_v_heads):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{num_tokens}, {num_v_heads}] "
                             "(num_tokens, num_v_heads)")
    _rank("state", state, 4, "[max_slots, num_v_heads, k_dim, v_dim]")
    if state.dtype != torch.float32:
        raise ValueError(f"state has dtype {state.dtype}, expected torch.float32 (the recurrent state is kept in fp32)")
    _float("state", state)
    if tuple(state.shape[1:]) != (num_v_heads, k_dim, v_dim):
        raise ValueError(f"state has shape {tuple(state.shape)}, expected [max_slots, {num_v_heads}, {k_dim}, {v_dim}] "
                         "(num_v_heads, k_dim, v_dim of v and k)")
    _check_seq_metadata(seq_slots, query_start_loc, seq_lens)
    if not isinstance(scale, (int, float)) or not (scale == scale and abs(scale) != float("inf")):
        raise ValueError(f"scale = {scale!r}, expected a finite float")


def check_slot_state_values(num_tokens: int, max_slots: int, seq_slots, query_start_loc, seq_lens) -> None:
    """Index values of causal_conv1d / gated_delta_rule (reads the device, like the other value checks).

    query_start_loc is a prefix sum from 0 to num_tokens; every seq_slot is -1 or a slot of the state;
    a live sequence holds at least its query tokens (seq_len >= q_len) and no live slot appears twice
    (two sequences updating one slot's state in one call would race).
    """
    q_lens = _check_query_start_loc(query_start_loc, num_tokens)
    _check_seq_slots(seq_slots, max_slots, "the state")
    live = seq_slots >= 0
    bad = live & (seq_lens < q_lens)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])} with {int(q_lens[i])} query tokens, expected "
                         f"seq_len >= {int(q_lens[i])}")
    slots = seq_slots[live]
    if slots.numel() > 1:
        values, counts = torch.unique(slots, return_counts=True)
        if bool((counts > 1).any()):
            slot = int(values[counts > 1][0])
            rows = (seq_slots == slot).nonzero()[:, 0].tolist()
            raise ValueError(f"seq_slots{rows} = {slot}: a live slot may appear only once per call "
                             "(its state is updated in place)")


# --------------------------------------------------------------------------------------------
# Mixture of experts: fused_moe
# --------------------------------------------------------------------------------------------

def check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    _same_device(hidden_states=hidden_states, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    _rank("hidden_states", hidden_states, 2, "[num_tokens, hidden_size]")
    _float("hidden_states", hidden_states)
    num_tokens, hidden = hidden_states.shape
    _rank("w13", w13, 3, "[num_experts, 2 * intermediate_size, hidden_size] (gate rows, then up rows)")
    _float("w13", w13)
    num_experts, two_inter, w13_hidden = w13.shape
    if num_experts < 1 or two_inter < 2 or two_inter % 2 or w13_hidden != hidden:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}, expected [num_experts >= 1, 2 * intermediate_size "
                         f"(even, >= 2), {hidden}] to match hidden_states' hidden_size = {hidden}")
    inter = two_inter // 2
    _rank("w2", w2, 3, "[num_experts, hidden_size, intermediate_size]")
    _float("w2", w2)
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}, expected [{num_experts}, {hidden}, {inter}] "
                         f"(w13's num_experts, hidden_states' hidden_size, w13's intermediate_size)")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != hidden_states.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected hidden_states' dtype {hidden_states.dtype}")
    _check_routing(num_tokens, topk_weights, topk_ids)


def _check_routing(num_tokens: int, topk_weights, topk_ids) -> None:
    _rank("topk_weights", topk_weights, 2, "[num_tokens, top_k]")
    _float("topk_weights", topk_weights)
    _index("topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    if topk_weights.shape[0] != num_tokens or topk_weights.shape[1] < 1:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected [{num_tokens}, top_k >= 1] "
                         f"(hidden_states has {num_tokens} tokens)")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected topk_weights' shape "
                         f"{tuple(topk_weights.shape)}")


# fused_moe_quant's kernels: the weight dtype of each, and whether its elements pack two a byte.
MOE_QUANT_KERNELS = {"int8": (torch.int8, False), "int8_a8": (torch.int8, False), "int4": (torch.uint8, True),
                     "int4_a8": (torch.uint8, True), "fp8": (torch.float8_e4m3fn, False)}


def _moe_quant_weight(name: str, w, scales, zeros, kernel: str, block_k: int, experts: Optional[int],
                      rows: Optional[int], in_features: Optional[int], what: str) -> tuple[int, int, int]:
    """One of fused_moe_quant's weights with its scales and zeros; returns (experts, rows, in_features)."""
    dtype, packed = MOE_QUANT_KERNELS[kernel]
    layout = f"[num_experts, {what}{' / 2' if packed else ''}]"
    if w.dtype != dtype or w.dim() != 3:
        raise ValueError(f"{name} has shape {tuple(w.shape)} and dtype {w.dtype}, expected {dtype} {layout} "
                         f"(kernel = {kernel!r})")
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * (2 if packed else 1)
    if (experts is not None and e != experts) or (rows is not None and n != rows) or (
            in_features is not None and k != in_features) or e < 1:
        want = [experts or "num_experts >= 1", rows or "N", (in_features // 2 if packed else in_features)
                if in_features else "K"]
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected [{', '.join(str(v) for v in want)}] ({layout})")
    for label, t in ((name, w), (name + "_scales", scales), (name + "_zeros", zeros)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{label} has shape {tuple(t.shape)} and strides {t.stride()}, expected a contiguous "
                             "tensor")
    if scales.dtype != torch.float32 or scales.dim() != 3 or tuple(scales.shape[:2]) != (e, n) or scales.shape[2] < 1:
        raise ValueError(f"{name}_scales has shape {tuple(scales.shape)} and dtype {scales.dtype}, expected float32 "
                         f"[{e}, {n}, G]")
    groups = scales.shape[2]
    if kernel == "fp8":
        if groups != -(-k // block_k):
            raise ValueError(f"{name}_scales has {groups} groups, expected ceil({k} / block_k = {block_k}) = "
                             f"{-(-k // block_k)}")
    elif k % groups or (packed and (k // groups) % 2):
        raise ValueError(f"{name}_scales has {groups} groups, expected G dividing in_features = {k}"
                         + (" into groups of an even size" if packed else ""))
    if packed:
        if zeros is None or zeros.dtype != torch.uint8 or tuple(zeros.shape) != tuple(scales.shape):
            got = "None" if zeros is None else f"shape {tuple(zeros.shape)} and dtype {zeros.dtype}"
            raise ValueError(f"{name}_zeros is {got}, expected uint8 {list(scales.shape)} ({name}_scales' shape)")
    elif zeros is not None:
        raise ValueError(f"{name}_zeros has shape {tuple(zeros.shape)}, expected None (kernel = {kernel!r} has no "
                         "zero points)")
    return e, n, k


def check_fused_moe_quant(hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros, topk_weights,
                          topk_ids, kernel: str, block_k: int) -> None:
    _same_device(hidden_states=hidden_states, w13=w13, w13_scales=w13_scales, w2=w2, w2_scales=w2_scales,
                 topk_weights=topk_weights, topk_ids=topk_ids)
    if any(z is not None and z.device != hidden_states.device for z in (w13_zeros, w2_zeros)):
        _same_device(hidden_states=hidden_states, w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    if kernel not in MOE_QUANT_KERNELS:
        raise ValueError(f"kernel = {kernel!r}, expected one of {', '.join(MOE_QUANT_KERNELS)}")
    if kernel == "fp8":
        if isinstance(block_k, bool) or not isinstance(block_k, int) or block_k < 1:
            raise ValueError(f"block_k = {block_k!r}, expected a positive int (fp8: input features per scale)")
    elif block_k != 0:
        raise ValueError(f"block_k = {block_k!r}, expected 0 for kernel = {kernel!r} (its group is K / G)")
    _rank("hidden_states", hidden_states, 2, "[num_tokens, hidden_size]")
    _float("hidden_states", hidden_states)
    num_tokens, hidden = hidden_states.shape
    experts, two_inter, _ = _moe_quant_weight("w13", w13, w13_scales, w13_zeros, kernel, block_k, None, None,
                                              hidden, "2 * intermediate_size, hidden_size")
    if two_inter < 2 or two_inter % 2:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}, expected an even 2 * intermediate_size >= 2 rows")
    _moe_quant_weight("w2", w2, w2_scales, w2_zeros, kernel, block_k, experts, hidden, two_inter // 2,
                      "hidden_size, intermediate_size")
    _check_routing(num_tokens, topk_weights, topk_ids)


def check_fused_moe_values(topk_ids, num_experts: int) -> None:
    """Every expert id names an expert of w13 / w2 (reads the device, like the other value checks)."""
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"topk_ids[{t}, {j}] = {int(topk_ids[t, j])}, but w13 has {num_experts} experts; "
                         f"expected 0 <= expert id < {num_experts}")


# --------------------------------------------------------------------------------------------
# The CPU fast path's ops (linear_packed, linear_silu_mul_packed, rms_norm, add_rms_norm, qk_norm_rope,
# silu_mul, moe_packed)
# --------------------------------------------------------------------------------------------

FAST_DTYPES = (torch.float32, torch.bfloat16)


def _fast(name: str, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
    if t.dtype not in FAST_DTYPES or (dtype is not None and t.dtype != dtype):
        want = f"{dtype}" if dtype is not None else "float32 or bfloat16"
        raise ValueError(f"{name} has dtype {t.dtype}, expected {want}")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} has stride {t.stride()}: its last dimension must be contiguous (stride 1)")


def packed_shape(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape of ``pack_panels`` of a ``[out_features, in_features]`` weight of ``dtype``."""
    panels = (out_features + 31) // 32
    if dtype == torch.bfloat16:
        return (panels, (in_features + 1) // 2, 32, 2)
    return (panels, in_features, 32)


def check_linear_packed(x, packed, bias, out_features) -> None:
    if packed.device != x.device or (bias is not None and bias.device != x.device):
        _same_device(x=x, packed=packed, bias=bias)
    _rank("x", x, 2, "[rows, in_features]")
    _fast("x", x)
    want = packed_shape(out_features, x.shape[1], x.dtype)
    if packed.dtype != x.dtype or tuple(packed.shape) != want or not packed.is_contiguous():
        raise ValueError(f"packed has shape {tuple(packed.shape)} and dtype {packed.dtype}, expected a contiguous "
                         f"{list(want)} {x.dtype} tensor (pack_panels of a [{out_features}, {x.shape[1]}] weight "
                         f"of x's dtype)")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (out_features,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias has shape {tuple(bias.shape)} and dtype {bias.dtype}, expected contiguous "
                         f"float32 [{out_features}]")


def check_linear_silu_mul_packed(x, packed, bias, out_features) -> None:
    """linear_silu_mul_packed: linear_packed's arguments, out_features the gate and up features (even)."""
    if out_features <= 0 or out_features % 2:
        raise ValueError(f"out_features is {out_features}, expected a positive even count (gate | up features)")
    check_linear_packed(x, packed, bias, out_features)


def check_rms_norm(x, weight, residual=None) -> None:
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        _same_device(x=x, weight=weight, residual=residual)
    _fast("x", x)
    if x.dim() < 1 or not x.is_contiguous():
        raise ValueError(f"x has shape {tuple(x.shape)} and strides {x.stride()}, expected a contiguous [..., dim]")
    if weight.dtype != x.dtype or tuple(weight.shape) != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight has shape {tuple(weight.shape)} and dtype {weight.dtype}, expected contiguous "
                         f"[{x.shape[-1]}] {x.dtype} (x's last dim and dtype)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual has shape {tuple(residual.shape)} and dtype {residual.dtype}, expected "
                         f"x's {tuple(x.shape)} {x.dtype}, contiguous")


def check_qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions) -> None:
    _same_device(q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos_sin=cos_sin, positions=positions)
    for name, t in (("q", q), ("k", k)):
        _rank(name, t, 3, "[num_tokens, heads, head_dim]")
        _fast(name, t, q.dtype)
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or D % 2:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [{T}, kv_heads, {D}] (q's tokens and even "
                         f"head_dim)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.dtype != q.dtype or tuple(w.shape) != (D,) or not w.is_contiguous()):
            raise ValueError(f"{name} has shape {tuple(w.shape)} and dtype {w.dtype}, expected contiguous "
                             f"[{D}] {q.dtype}")
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != D or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin has shape {tuple(cos_sin.shape)} and dtype {cos_sin.dtype}, expected float32 "
                         f"[max_positions, {D}] (cos | sin over the whole head) with contiguous rows")
    _index("positions", positions, 1, "[num_tokens]")
    if positions.shape[0] != T:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected [{T}] (q's tokens)")


def check_group_mins_add(y, x, mins_t) -> None:
    """group_mins_add: y [rows, N] and x [rows, K] float32 / bfloat16 (last dims contiguous), mins_t fp32 [G, N]
    with G dividing K (its rows may be strided, its last dim contiguous)."""
    _rank("y", y, 2, "[rows, out_features]")
    _rank("x", x, 2, "[rows, in_features]")
    _rank("mins_t", mins_t, 2, "[groups, out_features]")
    _fast("y", y)
    _fast("x", x)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has shape {tuple(x.shape)} and y {tuple(y.shape)}, expected the same rows")
    if mins_t.dtype != torch.float32 or mins_t.shape[1] != y.shape[1] or mins_t.shape[0] < 1 \
            or x.shape[1] % mins_t.shape[0] or (mins_t.shape[1] > 1 and mins_t.stride(1) != 1):
        raise ValueError(f"mins_t has shape {tuple(mins_t.shape)}, dtype {mins_t.dtype} and strides "
                         f"{tuple(mins_t.stride())}, expected float32 [groups, {y.shape[1]}] (y's columns) with groups "
                         f"dividing x's {x.shape[1]} inputs and its last dim contiguous")
    if y.device != x.device or y.device != mins_t.device:
        raise ValueError(f"y, x and mins_t are on {y.device}, {x.device} and {mins_t.device}, expected one device")


def check_silu_mul(gate_up) -> None:
    _rank("gate_up", gate_up, 2, "[rows, 2 * intermediate_size] (gate | up)")
    _fast("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up has shape {tuple(gate_up.shape)}, expected an even last dim (gate | up)")


def check_moe_packed(hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    _same_device(hidden_states=hidden_states, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    _rank("hidden_states", hidden_states, 2, "[num_tokens, hidden_size]")
    if hidden_states.dtype != torch.float32:
        raise ValueError(f"hidden_states has dtype {hidden_states.dtype}, expected torch.float32")
    hidden = hidden_states.shape[1]
    _rank("w13", w13, 4, "[num_experts, panels, hidden_size, 32]")
    _rank("w2", w2, 4, "[num_experts, panels, intermediate_size, 32]")
    E, inter = w13.shape[0], w2.shape[2]
    if (E < 1 or tuple(w13.shape[1:]) != packed_shape(2 * inter, hidden, torch.float32)
            or tuple(w2.shape) != (E,) + packed_shape(hidden, inter, torch.float32)
            or w13.dtype != torch.float32 or w2.dtype != torch.float32
            or not (w13.is_contiguous() and w2.is_contiguous())):
        raise ValueError(f"w13 {tuple(w13.shape)} {w13.dtype} and w2 {tuple(w2.shape)} {w2.dtype}: expected "
                         f"contiguous float32 stacks of each expert's pack_panels of its [2 * I, {hidden}] and "
                         f"[{hidden}, I] weights (I = w2.shape[2] = {inter})")
    _rank("topk_weights", topk_weights, 2, "[num_tokens, top_k]")
    _float("topk_weights", topk_weights)
    _index("topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    if topk_weights.shape[0] != hidden_states.shape[0] or topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)}, expected "
                         f"one shape [{hidden_states.shape[0]}, top_k] (hidden_states' tokens)")


def check_attention_block(qkv, q_weight, k_weight, cos_sin, positions, key_cache, value_cache, slot_ids, block_table,
                          seq_slots, query_start_loc, seq_lens, max_query_len, num_heads, k_scale=None,
                          v_scale=None) -> None:
    _rank("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    nk, D = key_cache.shape[2], key_cache.shape[3]
    if not isinstance(num_heads, int) or num_heads < 1 or num_heads % nk:
        raise ValueError(f"num_heads = {num_heads!r}, expected a positive multiple of the caches' num_kv_heads = {nk}")
    _rank("qkv", qkv, 2, "[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]")
    _fast("qkv", qkv)
    if qkv.shape[1] != (num_heads + 2 * nk) * D:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}, expected [num_tokens, {(num_heads + 2 * nk) * D}] "
                         f"(q | k | v of {num_heads} + 2 x {nk} heads of {D})")
    T = qkv.shape[0]
    q = qkv[:, :num_heads * D].view(T, num_heads, D)
    k = qkv[:, num_heads * D:(num_heads + nk) * D].view(T, nk, D)
    v = qkv[:, (num_heads + nk) * D:].view(T, nk, D)
    check_qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions)
    if key_cache.dtype != qkv.dtype and key_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"key_cache has dtype {key_cache.dtype}, expected qkv's {qkv.dtype} or an fp8 dtype")
    check_kv_write(k, v, key_cache, value_cache, slot_ids, positions, block_table, k_scale, v_scale)
    check_slot_attention(q, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens, 1.0,
                         max_query_len, None, k_scale, v_scale)


# ---------------------------------------------------------------------------------------------
# Quantized linear ops (linear_int8, linear_int4, linear_fp8): references in kernels/reference_quant.py
# ---------------------------------------------------------------------------------------------

def _quant_common(x, bias, out_features: int, in_features: int, **others) -> None:
    if any(t is not None and t.device != x.device for t in (bias, *others.values())):
        _same_device(x=x, bias=bias, **others)
    _rank("x", x, 2, "[rows, in_features]")
    _float("x", x)
    if x.shape[1] != in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [rows, {in_features}] (the weight's in_features)")
    for name, t in others.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} has shape {tuple(t.shape)} and strides {t.stride()}, expected a contiguous tensor")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (out_features,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias has shape {tuple(bias.shape)} and dtype {bias.dtype}, expected contiguous "
                         f"float32 [{out_features}]")


def _groups(name: str, t: torch.Tensor, dtype: torch.dtype, rows: int, in_features: int) -> int:
    """Checks a per-group tensor ``[rows, G]`` of ``dtype`` with G dividing in_features; returns the group size."""
    if t.dtype != dtype or t.dim() != 2 or t.shape[0] != rows or t.shape[1] < 1 or in_features % t.shape[1]:
        raise ValueError(f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}, expected {dtype} [{rows}, G] "
                         f"with G dividing in_features = {in_features} (G groups of in_features / G elements)")
    return in_features // t.shape[1]


def check_linear_int8(x, qweight, scales, bias) -> None:
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight has shape {tuple(qweight.shape)} and dtype {qweight.dtype}, expected int8 "
                         "[out_features, in_features]")
    n, k = qweight.shape
    _quant_common(x, bias, n, k, qweight=qweight, scales=scales)
    _groups("scales", scales, torch.float32, n, k)


def check_linear_int4(x, qweight, scales, zeros, bias) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight has shape {tuple(qweight.shape)} and dtype {qweight.dtype}, expected uint8 "
                         "[out_features, in_features / 2] (two 4-bit elements a byte)")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    _quant_common(x, bias, n, k, qweight=qweight, scales=scales, zeros=zeros)
    g = _groups("scales", scales, torch.float32, n, k)
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"zeros has shape {tuple(zeros.shape)} and dtype {zeros.dtype}, expected uint8 "
                         f"{list(scales.shape)} (scales' shape)")
    if g % 2:
        raise ValueError(f"scales has {scales.shape[1]} groups of {g} elements; expected an even group size")


def check_linear_a8_panels(x, weight, scales, zeros, bias, out_features) -> None:
    """linear_a8_panels: int8 (``zeros`` None) or int4 weights in 64-feature panels (``pack_a8_panels``)."""
    if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features = {out_features!r}, expected a positive int")
    panels, per = -(-out_features // 64), (4 if zeros is None else 8)
    if (weight.dtype != torch.uint8 or weight.dim() != 4 or weight.shape[0] != panels or weight.shape[1] < 1
            or tuple(weight.shape[2:]) != (64, 4)):
        raise ValueError(f"weight has shape {tuple(weight.shape)} and dtype {weight.dtype}, expected uint8 [{panels}, "
                         f"in_features / {per}, 64, 4] (pack_a8_panels of {out_features} output features, "
                         f"{'int8' if zeros is None else 'int4'})")
    k = per * weight.shape[1]
    _quant_common(x, bias, out_features, k, weight=weight, scales=scales)
    if (scales.dtype != torch.float32 or scales.dim() != 3 or scales.shape[0] != panels or scales.shape[1] < 1
            or k % scales.shape[1] or scales.shape[2] != 64):
        raise ValueError(f"scales has shape {tuple(scales.shape)} and dtype {scales.dtype}, expected float32 "
                         f"[{panels}, G, 64] with G dividing in_features = {k}")
    g = k // scales.shape[1]
    if g % 128 and g % per:
        raise ValueError(f"scales has {scales.shape[1]} groups of {g} elements; expected a group size that is a "
                         f"multiple of {per} or of 128")
    if zeros is not None:
        if zeros.device != x.device:
            _same_device(x=x, zeros=zeros)
        if zeros.dtype != torch.uint8 or tuple(zeros.shape) != tuple(scales.shape) or not zeros.is_contiguous():
            raise ValueError(f"zeros has shape {tuple(zeros.shape)} and dtype {zeros.dtype}, expected contiguous uint8 "
                             f"{list(scales.shape)} (scales' shape)")


def check_silu_mul_linear_a8_panels(gate_up, weight, scales, zeros, bias, out_features) -> None:
    """silu_mul_linear_a8_panels: gate_up as silu_mul takes it, its halves as linear_a8_panels takes x."""
    check_silu_mul(gate_up)
    if weight.dim() == 4:
        k = (4 if zeros is None else 8) * weight.shape[1]
        if gate_up.shape[1] != 2 * k:
            raise ValueError(f"gate_up has shape {tuple(gate_up.shape)}, expected [rows, {2 * k}] (gate | up of the "
                             f"weight's in_features = {k})")
    check_linear_a8_panels(gate_up[:, :gate_up.shape[1] // 2], weight, scales, zeros, bias, out_features)


def check_linear_fp8(x, weight, scale_inv, bias, block_n: int, block_k: int) -> None:
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)} and dtype {weight.dtype}, expected "
                         "float8_e4m3fn [out_features, in_features]")
    n, k = weight.shape
    _quant_common(x, bias, n, k, weight=weight, scale_inv=scale_inv)
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}, expected a positive int")
    want = (-(-n // block_n), -(-k // block_k))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)} and dtype {scale_inv.dtype}, expected "
                         f"float32 {list(want)} (ceil({n} / block_n = {block_n}), ceil({k} / block_k = {block_k}))")


# ---------------------------------------------------------------------------------------------
# Multi-LoRA (lora_shrink, lora_expand): references in kernels/reference_lora.py
# ---------------------------------------------------------------------------------------------

def _lora_indices(lora_indices, num_tokens: int, holder: str) -> None:
    _index("lora_indices", lora_indices, 1, "[num_tokens] (each row's adapter slot, -1 = none)")
    if lora_indices.shape[0] != num_tokens:
        raise ValueError(f"lora_indices has shape {tuple(lora_indices.shape)}, expected [{num_tokens}] (one adapter "
                         f"slot per row of {holder})")


def _lora_weights(name: str, w, dtype: torch.dtype, holder: str, layout: str) -> None:
    _rank(name, w, 3, layout)
    if w.dtype != dtype:
        raise ValueError(f"{name} has dtype {w.dtype}, expected {holder}'s {dtype}")
    if not w.is_contiguous():
        raise ValueError(f"{name} has shape {tuple(w.shape)} and strides {w.stride()}, expected a contiguous tensor")
    if min(w.shape) < 1:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected every dim >= 1: {layout}")


def check_lora_shrink(x, lora_a, lora_indices, scalings) -> None:
    _same_device(x=x, lora_a=lora_a, lora_indices=lora_indices, scalings=scalings)
    _rank("x", x, 2, "[num_tokens, in_features]")
    _float("x", x)
    _lora_weights("lora_a", lora_a, x.dtype, "x", "[max_loras, num_slices * max_rank, in_features]")
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a has shape {tuple(lora_a.shape)}, expected [max_loras, num_slices * max_rank, "
                         f"{x.shape[1]}] (x's in_features)")
    _lora_indices(lora_indices, x.shape[0], "x")
    slots = lora_a.shape[0]
    if scalings.dtype != torch.float32 or tuple(scalings.shape) != (slots,):
        raise ValueError(f"scalings has shape {tuple(scalings.shape)} and dtype {scalings.dtype}, expected float32 "
                         f"[{slots}] (one per slot of lora_a)")


def check_lora_expand(y, buffer, lora_b, lora_indices, slice_sizes) -> None:
    _same_device(y=y, buffer=buffer, lora_b=lora_b, lora_indices=lora_indices)
    _rank("y", y, 2, "[num_tokens, out_features]")
    _float("y", y)
    _rank("buffer", buffer, 2, "[num_tokens, num_slices * max_rank]")
    if buffer.dtype != torch.float32:
        raise ValueError(f"buffer has dtype {buffer.dtype}, expected torch.float32 (lora_shrink's output)")
    if buffer.shape[1] > 1 and buffer.stride(1) != 1:
        raise ValueError(f"buffer has stride {buffer.stride()}: its last dimension must be contiguous (stride 1)")
    if buffer.shape[0] != y.shape[0]:
        raise ValueError(f"buffer has shape {tuple(buffer.shape)}, expected [{y.shape[0]}, num_slices * max_rank] "
                         "(y's rows)")
    _lora_weights("lora_b", lora_b, y.dtype, "y", "[max_loras, out_features, max_rank]")
    sizes = list(slice_sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"slice_sizes = {sizes!r}, expected a non-empty list of positive ints (each slice's "
                         "out_features)")
    rank = lora_b.shape[2]
    if len(sizes) * rank != buffer.shape[1]:
        raise ValueError(f"buffer has shape {tuple(buffer.shape)}, expected [{y.shape[0]}, {len(sizes) * rank}] "
                         f"(len(slice_sizes) = {len(sizes)} slices of max_rank = {rank}, lora_b.shape[2])")
    if sum(sizes) != lora_b.shape[1]:
        raise ValueError(f"slice_sizes = {sizes} sums to {sum(sizes)}, expected lora_b.shape[1] = {lora_b.shape[1]} "
                         "(the slices' out_features)")
    if y.shape[1] != lora_b.shape[1]:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected [{y.shape[0]}, {lora_b.shape[1]}] (lora_b's "
                         "out_features)")
    _lora_indices(lora_indices, y.shape[0], "y")


def check_lora_indices_values(lora_indices, max_loras: int) -> None:
    """Every row's slot is -1 or a slot of the pool (reads the device, like the other value checks)."""
    bad = (lora_indices < -1) | (lora_indices >= max_loras)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"lora_indices[{t}] = {int(lora_indices[t])}, but only {max_loras} adapter slots exist; "
                         f"expected -1 (no adapter) or 0 <= slot < {max_loras}")
