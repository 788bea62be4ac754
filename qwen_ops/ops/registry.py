"""torch.ops.qwen.*: the one public entry to the kernels.

The schemas come from ``torch_library/qwen.schema`` (installed as ``qwen_ops.torch_library``).
This module defines them, registers one CPU and one CUDA implementation per op that
validate the arguments and dispatch to the selected backend (``qwen_ops.ops.backend``), and
registers the fake kernels that ``torch.compile`` traces with. The C++ extension, when
built, only adds kernels in its own private namespace, which the ``cuda`` backend calls.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from qwen_ops.ops import validation as V
from qwen_ops.ops.backend import backend_for, kernels, value_checks_enabled
from qwen_ops.torch_library import NAMESPACE, SCHEMAS

# Holds the op definitions alive for the life of the process; never mutated after import.
_LIB = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)


def _kv_write_impl(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                   v_scale=None) -> None:
    V.check_kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale, v_scale)
    backend = backend_for(key.device, "kv_write")
    if value_checks_enabled(backend):
        V.check_kv_write_values(key_cache, slot_ids, positions, block_table)
    getattr(kernels(backend), f"kv_write_{backend}")(key, value, key_cache, value_cache, slot_ids,
                                                      positions, block_table, k_scale, v_scale)


def _slot_attention_impl(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                         scale, max_query_len, gate=None, k_scale=None, v_scale=None) -> torch.Tensor:
    V.check_slot_attention(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                           scale, max_query_len, gate, k_scale, v_scale)
    backend = backend_for(query.device, "slot_attention", "decode" if max_query_len == 1 else "prefill")
    if value_checks_enabled(backend):
        V.check_slot_attention_values(query, key_cache, block_table, seq_slots, query_start_loc, seq_lens,
                                      max_query_len)
    return getattr(kernels(backend), f"slot_attention_{backend}")(
        query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens, scale,
        max_query_len, gate, k_scale, v_scale)


for _key in ("CPU", "CUDA"):
    _LIB.impl("kv_write", _kv_write_impl, _key)
    _LIB.impl("slot_attention", _slot_attention_impl, _key)


@torch.library.register_fake(f"{NAMESPACE}::kv_write", lib=_LIB)
def _kv_write_fake(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                   v_scale=None) -> None:
    V.check_kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale, v_scale)


@torch.library.register_fake(f"{NAMESPACE}::slot_attention", lib=_LIB)
def _slot_attention_fake(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                         scale, max_query_len, gate=None, k_scale=None, v_scale=None) -> torch.Tensor:
    V.check_slot_attention(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                           scale, max_query_len, gate, k_scale, v_scale)
    return torch.empty_like(query)


def kv_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches.

    Token i goes to slot ``slot_ids[i]`` (int32, -1 = padding, nothing written) at position
    ``positions[i]`` (int32), i.e. block ``block_table[slot, pos // block_size]``, row
    ``pos % block_size`` of ``key_cache``/``value_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``.
    A float8_e4m3fn / float8_e5m2 cache stores ``fp8(clamp(key / k_scale))`` (and values by
    ``v_scale``; one-element fp32 tensors, None = 1.0): ``qwen_ops.ops.kv_quant``.
    """
    torch.ops.qwen.kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale, v_scale)


def slot_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_slots: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, max_query_len: int,
                   gate: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
                   v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal GQA attention over slot-indexed paged KV, for prefill, chunks, decode and mixes.

    query ``[num_tokens, num_heads, head_dim]``; sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]`` and reads slot ``seq_slots[i]`` (-1 = padding,
    rows zero) holding ``seq_lens[i]`` tokens after this step's write. Row j of a sequence with
    q rows sits at position ``seq_len - q + j``. ``max_query_len`` is a static upper bound on q
    (1 selects the decode kernel). ``gate`` multiplies the output by ``sigmoid(gate)``.
    Returns ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``. An fp8 cache (any query
    dtype) is read as ``float(cache) * k_scale`` / ``* v_scale``.
    """
    return torch.ops.qwen.slot_attention(query, key_cache, value_cache, block_table, seq_slots,
                                         query_start_loc, seq_lens, scale, max_query_len, gate, k_scale, v_scale)


# --------------------------------------------------------------------------------------------
# Slot-state ops of hybrid models (Qwen3.5 / Qwen3-Next): causal_conv1d, gated_delta_rule
# --------------------------------------------------------------------------------------------

def _op_kernel(op: str, backend: str, models: str):
    """``<op>_<backend>`` of the backend's kernel module, or a clear error when it has none (a
    backend module that lacks the op, e.g. the cuda extension for fused_moe, or a cuda build from
    before csrc/ had the state ops). ``models`` names the models that need the op."""
    module = kernels(backend)
    fn = getattr(module, f"{op}_{backend}", None)
    if fn is None:
        raise RuntimeError(f"qwen_ops backend {backend!r} has no kernel for qwen::{op} ({module.__name__}."
                           f"{op}_{backend} does not exist); select the triton or reference backend "
                           f"(QWEN_OPS_BACKEND=triton|reference) for {models}")
    return fn


def _state_op_kernel(op: str, backend: str):
    return _op_kernel(op, backend, "models with linear-attention layers")


def _causal_conv1d_impl(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> torch.Tensor:
    V.check_causal_conv1d(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens)
    backend = backend_for(x.device, "causal_conv1d")
    kernel = _state_op_kernel("causal_conv1d", backend)
    if value_checks_enabled(backend):
        V.check_slot_state_values(x.shape[0], conv_state.shape[0], seq_slots, query_start_loc, seq_lens)
    return kernel(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens)


def _gated_delta_rule_impl(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale) -> torch.Tensor:
    V.check_gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale)
    backend = backend_for(q.device, "gated_delta_rule")
    kernel = _state_op_kernel("gated_delta_rule", backend)
    if value_checks_enabled(backend):
        V.check_slot_state_values(q.shape[0], state.shape[0], seq_slots, query_start_loc, seq_lens)
    return kernel(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale)


for _key in ("CPU", "CUDA"):
    _LIB.impl("causal_conv1d", _causal_conv1d_impl, _key)
    _LIB.impl("gated_delta_rule", _gated_delta_rule_impl, _key)


@torch.library.register_fake(f"{NAMESPACE}::causal_conv1d", lib=_LIB)
def _causal_conv1d_fake(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> torch.Tensor:
    V.check_causal_conv1d(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens)
    return x.new_empty(x.shape)


@torch.library.register_fake(f"{NAMESPACE}::gated_delta_rule", lib=_LIB)
def _gated_delta_rule_fake(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale) -> torch.Tensor:
    V.check_gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale)
    return v.new_empty(v.shape)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv_state: torch.Tensor,
                  seq_slots: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over varlen tokens, continuing each slot's conv state.

    x ``[num_tokens, dim]``; weight ``[dim, kernel]``; bias ``[dim]`` or None; conv_state
    ``[max_slots, dim, kernel - 1]`` (x.dtype) holds each slot's last kernel - 1 inputs, oldest
    first. Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of slot ``seq_slots[i]``
    (int32; -1 = padding: rows zero, nothing written) and has ``seq_lens[i]`` tokens after this call:
    q_len == seq_len starts from zero inputs, q_len < seq_len continues the stored ones. Every live
    slot with rows gets its last kernel - 1 inputs written back. Returns ``[num_tokens, dim]`` in
    x.dtype: ``silu(bias + sum_t weight[:, t] * in[j + t])`` accumulated in fp32.
    """
    return torch.ops.qwen.causal_conv1d(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, seq_slots: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Gated delta rule (Gated DeltaNet) over varlen tokens with a slot-indexed fp32 recurrent state.

    q, k ``[num_tokens, num_k_heads, k_dim]`` are L2-normalised inside the op (fp32,
    ``x * rsqrt(sum x^2 + 1e-6)``, as transformers' ``use_qk_l2norm_in_kernel=True``), then q is
    multiplied by ``scale``; v ``[num_tokens, num_v_heads, v_dim]`` (q's dtype); g (log decay) and
    beta ``[num_tokens, num_v_heads]`` any float dtype. Value head h reads q/k head
    ``h // (num_v_heads // num_k_heads)``. Per head: ``S = exp(g) S + k (beta (v - exp(g) S^T k))^T``,
    ``o = S^T q``. state ``[max_slots, num_v_heads, k_dim, v_dim]`` fp32, updated in place; sequence
    metadata as in :func:`causal_conv1d`. Returns ``[num_tokens, num_v_heads, v_dim]`` in v.dtype.
    """
    return torch.ops.qwen.gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale)


# --------------------------------------------------------------------------------------------
# Mixture of experts (Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE): fused_moe
# --------------------------------------------------------------------------------------------

def _fused_moe_impl(hidden_states, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    V.check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)
    backend = backend_for(hidden_states.device, "fused_moe")
    kernel = _op_kernel("fused_moe", backend, "mixture-of-experts models")
    if value_checks_enabled(backend):
        V.check_fused_moe_values(topk_ids, w13.shape[0])
    return kernel(hidden_states, w13, w2, topk_weights, topk_ids)


for _key in ("CPU", "CUDA"):
    _LIB.impl("fused_moe", _fused_moe_impl, _key)


@torch.library.register_fake(f"{NAMESPACE}::fused_moe", lib=_LIB)
def _fused_moe_fake(hidden_states, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    V.check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)
    return hidden_states.new_empty(hidden_states.shape)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer, for every token's top-k choices.

    hidden_states ``[num_tokens, hidden]``; w13 ``[num_experts, 2 * inter, hidden]`` (each expert's
    gate rows, then its up rows: transformers' ``experts.gate_up_proj``); w2
    ``[num_experts, hidden, inter]`` (``experts.down_proj``), both in hidden_states' dtype;
    topk_weights ``[num_tokens, top_k]`` any float dtype; topk_ids int32 ``[num_tokens, top_k]``,
    each in ``[0, num_experts)``. Returns ``[num_tokens, hidden]`` in hidden_states' dtype:
    ``sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :inter] @ x) * (w13[e, inter:] @ x))`` with
    ``e = topk_ids[t, j]``, accumulated in fp32. Routing (softmax, top-k) is the caller's.
    """
    return torch.ops.qwen.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)


# --------------------------------------------------------------------------------------------
# The CPU fast path: linear_packed, linear_silu_mul_packed, rms_norm, add_rms_norm, qk_norm_rope, silu_mul, moe_packed
# --------------------------------------------------------------------------------------------
# A layer chooses these once, when its weights are packed (qwen_ops/models/layers.py: on the CPU,
# fp32 or bf16, the cpu backend selected and its C kernels built); nothing is chosen per call.
# On CPU tensors they run the C++ dispatcher kernels of kernels/qwen_cpu_ops.cpp (built with the
# C library and registered by cpu_fast_ops, on first use); on any other device the plain-torch
# references (kernels/reference_fused.py), which are also the test oracle.

from qwen_ops.ops.kernels import reference_fused as R  # noqa: E402


def _cpu():
    from qwen_ops.ops.kernels import cpu
    return cpu


_REFERENCES = {
    "linear_packed": R.linear_packed_reference, "linear_silu_mul_packed": R.linear_silu_mul_packed_reference,
    "rms_norm": R.rms_norm_reference,
    "add_rms_norm": R.add_rms_norm_reference, "qk_norm_rope": R.qk_norm_rope_reference,
    "silu_mul": R.silu_mul_reference, "attention_block": R.attention_block_reference,
    "group_mins_add": R.group_mins_add_reference,
    "moe_packed": R.moe_packed_reference,
}
# Their CPU kernels are registered on first use (cpu_fast_ops: the C++ kernels, built then); on
# other devices the references run.
_FAST_LIB = torch.library.Library(NAMESPACE, "IMPL")
for _name, _reference in _REFERENCES.items():
    _FAST_LIB.impl(_name, _reference, "CUDA")


@functools.lru_cache(maxsize=1)
def cpu_fast_ops() -> int:
    """Registers the CPU kernels of the fast ops and the quantized products, once: the C++
    dispatcher kernels of the library ``kernels/cpu.py`` builds. Returns the registration's handle
    (this cache holds it: the kernels stay for the process). Raises the build's error where it does
    not build (``kernels.cpu.why_unavailable()`` says why beforehand)."""
    return _cpu().library().qwen_register_cpu_kernels()


def _first_cpu_call(name: str):
    """The CPU kernel registered at import: it registers the real ones (cpu_fast_ops, once; they
    replace this one in the dispatcher) and calls the op again."""
    def kernel(*args):
        cpu_fast_ops()
        return getattr(torch.ops.qwen, name).default(*args)
    return kernel


for _name in _REFERENCES:
    _FAST_LIB.impl(_name, _first_cpu_call(_name), "CPU")


@torch.library.register_fake(f"{NAMESPACE}::linear_packed", lib=_LIB)
def _linear_packed_fake(x, packed, bias, out_features):
    V.check_linear_packed(x, packed, bias, out_features)
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake(f"{NAMESPACE}::linear_silu_mul_packed", lib=_LIB)
def _linear_silu_mul_packed_fake(x, packed, bias, out_features):
    V.check_linear_silu_mul_packed(x, packed, bias, out_features)
    return x.new_empty((x.shape[0], out_features // 2))


@torch.library.register_fake(f"{NAMESPACE}::rms_norm", lib=_LIB)
def _rms_norm_fake(x, weight, eps):
    V.check_rms_norm(x, weight)
    return torch.empty_like(x)


@torch.library.register_fake(f"{NAMESPACE}::add_rms_norm", lib=_LIB)
def _add_rms_norm_fake(x, residual, weight, eps):
    V.check_rms_norm(x, weight, residual)
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake(f"{NAMESPACE}::qk_norm_rope", lib=_LIB)
def _qk_norm_rope_fake(q, k, q_weight, k_weight, eps, cos_sin, positions):
    V.check_qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake(f"{NAMESPACE}::silu_mul", lib=_LIB)
def _silu_mul_fake(gate_up):
    V.check_silu_mul(gate_up)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.register_fake(f"{NAMESPACE}::group_mins_add", lib=_LIB)
def _group_mins_add_fake(y, x, mins_t):
    V.check_group_mins_add(y, x, mins_t)


@torch.library.register_fake(f"{NAMESPACE}::moe_packed", lib=_LIB)
def _moe_packed_fake(hidden_states, w13, w2, topk_weights, topk_ids):
    V.check_moe_packed(hidden_states, w13, w2, topk_weights, topk_ids)
    return hidden_states.new_empty(hidden_states.shape)


@torch.library.register_fake(f"{NAMESPACE}::attention_block", lib=_LIB)
def _attention_block_fake(qkv, q_weight, k_weight, eps, cos_sin, positions, key_cache, value_cache, slot_ids,
                          block_table, seq_slots, query_start_loc, seq_lens, scale, max_query_len, num_heads,
                          k_scale=None, v_scale=None):
    V.check_attention_block(qkv, q_weight, k_weight, cos_sin, positions, key_cache, value_cache, slot_ids,
                            block_table, seq_slots, query_start_loc, seq_lens, max_query_len, num_heads,
                            k_scale, v_scale)
    return qkv.new_empty((qkv.shape[0], num_heads * key_cache.shape[3]))


# --------------------------------------------------------------------------------------------
# Quantized weights: linear_int8, linear_int4, linear_fp8
# --------------------------------------------------------------------------------------------
# The model's QuantLinear layers (qwen_ops/models/quant.py) call these. On CPU tensors they run the
# C kernels of kernels/qwen_cpu.c (qwen_linear_quant) behind the C++ dispatcher kernels of
# kernels/qwen_cpu_ops.cpp (the reference where that library does not build); on CUDA the Triton kernels of kernels/triton_quant.py (the references
# with QWEN_OPS_BACKEND=reference or without triton). The references are also the oracle.

from qwen_ops.ops.kernels import reference_quant as RQ  # noqa: E402


def _quant_triton(x) -> bool:
    """Whether a quantized op on ``x``'s (non-CPU) device runs its Triton kernel (kernels/triton_quant.py):
    unless the reference backend is selected, or triton is missing."""
    from qwen_ops.ops.backend import get_backend, why_unavailable

    return get_backend() != "reference" and why_unavailable("triton", x.device) is None


def _linear_int8_other(x, qweight, scales, bias):
    V.check_linear_int8(x, qweight, scales, bias)
    if _quant_triton(x):
        from qwen_ops.ops.kernels.triton_quant import linear_quant_triton
        n, k = qweight.shape
        return linear_quant_triton("int8", x, qweight, scales, None, bias, n, k, k // scales.shape[1], 1)
    return RQ.linear_int8_reference(x, qweight, scales, bias)


def _linear_int4_other(x, qweight, scales, zeros, bias):
    V.check_linear_int4(x, qweight, scales, zeros, bias)
    if _quant_triton(x):
        from qwen_ops.ops.kernels.triton_quant import linear_quant_triton
        n, k = qweight.shape[0], 2 * qweight.shape[1]
        return linear_quant_triton("int4", x, qweight, scales, zeros, bias, n, k, k // scales.shape[1], 1)
    return RQ.linear_int4_reference(x, qweight, scales, zeros, bias)


def _linear_int8_a8_other(x, qweight, scales, bias):
    """On CUDA: x quantized as the contract says (in torch), then linear_int8's kernel."""
    V.check_linear_int8(x, qweight, scales, bias)
    xq = RQ.quantize_activations(x, qweight.shape[1] // scales.shape[1])
    return _linear_int8_other(xq, qweight, scales, bias).to(x.dtype)


def _linear_int4_a8_other(x, qweight, scales, zeros, bias):
    V.check_linear_int4(x, qweight, scales, zeros, bias)
    xq = RQ.quantize_activations(x, 2 * qweight.shape[1] // scales.shape[1])
    return _linear_int4_other(xq, qweight, scales, zeros, bias).to(x.dtype)


def _linear_a8_panels_other(x, weight, scales, zeros, bias, out_features):
    """The CPU's layout elsewhere (the layers choose it on CPUs only): the reference."""
    V.check_linear_a8_panels(x, weight, scales, zeros, bias, out_features)
    return RQ.linear_a8_panels_reference(x, weight, scales, zeros, bias, out_features)


def _silu_mul_linear_a8_panels_other(gate_up, weight, scales, zeros, bias, out_features):
    V.check_silu_mul_linear_a8_panels(gate_up, weight, scales, zeros, bias, out_features)
    return RQ.silu_mul_linear_a8_panels_reference(gate_up, weight, scales, zeros, bias, out_features)


def _linear_fp8_other(x, weight, scale_inv, bias, block_n, block_k):
    V.check_linear_fp8(x, weight, scale_inv, bias, block_n, block_k)
    if _quant_triton(x) and block_k % 16 == 0:
        from qwen_ops.ops.kernels.triton_quant import linear_quant_triton
        n, k = weight.shape
        w8a8 = x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)   # fp8 tensor cores
        return linear_quant_triton("fp8", x, weight, scale_inv, None, bias, n, k, block_k, block_n, act_fp8=w8a8)
    return RQ.linear_fp8_reference(x, weight, scale_inv, bias, block_n, block_k)


_QUANT_REFERENCES = {"linear_int8": RQ.linear_int8_reference, "linear_int4": RQ.linear_int4_reference,
                     "linear_fp8": RQ.linear_fp8_reference, "linear_int8_a8": RQ.linear_int8_a8_reference,
                     "linear_int4_a8": RQ.linear_int4_a8_reference,
                     "linear_a8_panels": RQ.linear_a8_panels_reference,
                     "silu_mul_linear_a8_panels": RQ.silu_mul_linear_a8_panels_reference}
_QUANT_CHECKS = {"linear_int8": V.check_linear_int8, "linear_int4": V.check_linear_int4,
                 "linear_fp8": V.check_linear_fp8, "linear_int8_a8": V.check_linear_int8,
                 "linear_int4_a8": V.check_linear_int4, "linear_a8_panels": V.check_linear_a8_panels,
                 "silu_mul_linear_a8_panels": V.check_silu_mul_linear_a8_panels}


def _first_quant_call(name: str):
    """The CPU kernel registered at import: where the C library builds, it registers the C++ kernels
    (cpu_fast_ops, once: they replace this one) and calls the op again; elsewhere the reference runs."""
    def kernel(*args):
        if _cpu().why_unavailable() is None:
            cpu_fast_ops()
            return getattr(torch.ops.qwen, name).default(*args)
        _QUANT_CHECKS[name](*args)
        return _QUANT_REFERENCES[name](*args)
    return kernel


_QUANT_LIB = torch.library.Library(NAMESPACE, "IMPL")
for _name, _other in (("linear_int8", _linear_int8_other), ("linear_int4", _linear_int4_other),
                      ("linear_fp8", _linear_fp8_other), ("linear_int8_a8", _linear_int8_a8_other),
                      ("linear_int4_a8", _linear_int4_a8_other), ("linear_a8_panels", _linear_a8_panels_other),
                      ("silu_mul_linear_a8_panels", _silu_mul_linear_a8_panels_other)):
    _QUANT_LIB.impl(_name, _first_quant_call(_name), "CPU")
    _QUANT_LIB.impl(_name, _other, "CUDA")


@torch.library.register_fake(f"{NAMESPACE}::linear_int8", lib=_LIB)
def _linear_int8_fake(x, qweight, scales, bias):
    V.check_linear_int8(x, qweight, scales, bias)
    return x.new_empty((x.shape[0], qweight.shape[0]))


@torch.library.register_fake(f"{NAMESPACE}::linear_int4", lib=_LIB)
def _linear_int4_fake(x, qweight, scales, zeros, bias):
    V.check_linear_int4(x, qweight, scales, zeros, bias)
    return x.new_empty((x.shape[0], qweight.shape[0]))


# The int8-activation products take the same arguments and give the same shapes.
torch.library.register_fake(f"{NAMESPACE}::linear_int8_a8", _linear_int8_fake, lib=_LIB)
torch.library.register_fake(f"{NAMESPACE}::linear_int4_a8", _linear_int4_fake, lib=_LIB)


@torch.library.register_fake(f"{NAMESPACE}::linear_a8_panels", lib=_LIB)
def _linear_a8_panels_fake(x, weight, scales, zeros, bias, out_features):
    V.check_linear_a8_panels(x, weight, scales, zeros, bias, out_features)
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake(f"{NAMESPACE}::silu_mul_linear_a8_panels", lib=_LIB)
def _silu_mul_linear_a8_panels_fake(gate_up, weight, scales, zeros, bias, out_features):
    V.check_silu_mul_linear_a8_panels(gate_up, weight, scales, zeros, bias, out_features)
    return gate_up.new_empty((gate_up.shape[0], out_features))


@torch.library.register_fake(f"{NAMESPACE}::linear_fp8", lib=_LIB)
def _linear_fp8_fake(x, weight, scale_inv, bias, block_n, block_k):
    V.check_linear_fp8(x, weight, scale_inv, bias, block_n, block_k)
    return x.new_empty((x.shape[0], weight.shape[0]))


# --------------------------------------------------------------------------------------------
# Quantized experts: fused_moe_quant
# --------------------------------------------------------------------------------------------
# The model's QuantMoeExperts (qwen_ops/models/quant.py) call it. On the CPU: the (token, choice) pairs
# grouped by expert (one stable sort), then per non-empty expert linear_<kernel>'s C kernels on its
# contiguous rows in fp32 (the quantized products' kernels, so every path they have serves the experts
# too). On CUDA: the fused MoE Triton kernels with the weight tiles dequantized as they are loaded
# (kernels/triton_moe.py). The reference (kernels/reference_quant.py) is the oracle.

def _check_fused_moe_quant(backend: str, hidden_states, w13, *rest) -> None:
    """The arguments' checks, and the expert ids' values where ``backend`` checks values."""
    V.check_fused_moe_quant(hidden_states, w13, *rest)
    if value_checks_enabled(backend):
        V.check_fused_moe_values(rest[6], w13.shape[0])         # topk_ids


def _fused_moe_quant_cpu(hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros, topk_weights,
                         topk_ids, kernel, block_k):
    _check_fused_moe_quant("cpu", hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros,
                           topk_weights, topk_ids, kernel, block_k)
    num_tokens, hidden = hidden_states.shape
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    top_k, inter = topk_ids.shape[1], w13.shape[1] // 2
    linear = getattr(torch.ops.qwen, "linear_" + kernel).default
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    tokens = torch.div(order, top_k, rounding_mode="floor")
    rows = hidden_states.index_select(0, tokens).float()
    out_rows = torch.empty(rows.shape[0], hidden, dtype=torch.float32)
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        z13 = None if w13_zeros is None else w13_zeros[e]
        z2 = None if w2_zeros is None else w2_zeros[e]
        gate_up = RQ.expert_product(kernel, rows[start:start + n], w13[e], w13_scales[e], z13, block_k, linear)
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out_rows[start:start + n] = RQ.expert_product(kernel, act, w2[e], w2_scales[e], z2, block_k, linear)
        start += n
    out_rows *= topk_weights.reshape(-1).index_select(0, order).float()[:, None]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32).index_add_(0, tokens, out_rows)
    return out.to(hidden_states.dtype)


def _fused_moe_quant_other(*args):
    _check_fused_moe_quant("triton", *args)
    if _quant_triton(args[0]):
        from qwen_ops.ops.kernels.triton_moe import fused_moe_quant_triton

        return fused_moe_quant_triton(*args)
    return RQ.fused_moe_quant_reference(*args)


_QUANT_LIB.impl("fused_moe_quant", _fused_moe_quant_cpu, "CPU")
_QUANT_LIB.impl("fused_moe_quant", _fused_moe_quant_other, "CUDA")


@torch.library.register_fake(f"{NAMESPACE}::fused_moe_quant", lib=_LIB)
def _fused_moe_quant_fake(hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros, topk_weights,
                          topk_ids, kernel, block_k):
    V.check_fused_moe_quant(hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros, topk_weights,
                            topk_ids, kernel, block_k)
    return hidden_states.new_empty(hidden_states.shape)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [rows, K] @ w.T (+ bias)`` with ``w = qweight (int8 [N, K]) * scales (fp32 [N, G])`` per group of
    ``K / G`` elements; fp32 arithmetic, returned in x's dtype."""
    return torch.ops.qwen.linear_int8(x, qweight, scales, bias)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with ``w = (q - zeros) * scales`` per group; ``qweight`` uint8 ``[N, K / 2]``
    holds element k in nibble ``k % 2`` (low first), ``zeros`` uint8 and ``scales`` fp32 ``[N, G]``."""
    return torch.ops.qwen.linear_int4(x, qweight, scales, zeros, bias)


def linear_int8_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear_int8`` with x quantized to int8 per row and block (``reference_quant.quantize_activations``):
    integer products (AVX512-VNNI on CPUs that have it)."""
    return torch.ops.qwen.linear_int8_a8(x, qweight, scales, bias)


def linear_int4_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear_int4`` with x quantized to int8 per row and block, as ``linear_int8_a8``."""
    return torch.ops.qwen.linear_int4_a8(x, qweight, scales, zeros, bias)


def linear_a8_panels(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``linear_int8_a8`` (``zeros`` None) or ``linear_int4_a8`` on weights in 64-feature panels
    (``qwen_ops.models.quant.pack_a8_panels``): the CPU's layout of those products."""
    return torch.ops.qwen.linear_a8_panels(x, weight, scales, zeros, bias, out_features)


def silu_mul_linear_a8_panels(gate_up: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                              zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_features: int
                              ) -> torch.Tensor:
    """``linear_a8_panels(silu_mul(gate_up), ...)`` in one call: an MLP's down product on its gate | up rows."""
    return torch.ops.qwen.silu_mul_linear_a8_panels(gate_up, weight, scales, zeros, bias, out_features)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: Optional[torch.Tensor],
               block_n: int, block_k: int) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with ``w = float(weight) * scale_inv[n // block_n, k // block_k]`` (float8_e4m3fn
    weights with block-wise fp32 scales, as Qwen3-*-FP8 checkpoints store them)."""
    return torch.ops.qwen.linear_fp8(x, weight, scale_inv, bias, block_n, block_k)


# --------------------------------------------------------------------------------------------
# Multi-LoRA: lora_shrink, lora_expand
# --------------------------------------------------------------------------------------------
# Punica / S-LoRA's SGMV / BGMV as vLLM's lora ops: a pool of adapter slots, each token's slot in
# lora_indices (-1 = none). A LoRA layer adds lora_expand(y, lora_shrink(x, A, idx, scalings), B, idx,
# slice_sizes) to its base product y. On CPU tensors the C++ dispatcher kernels of kernels/qwen_cpu_ops.cpp
# (C arithmetic in kernels/qwen_cpu_lora.c; registered with the fast ops by cpu_fast_ops) or, where those do
# not build, the references; on CUDA the Triton kernels of kernels/triton_lora.py (the references with
# QWEN_OPS_BACKEND=reference or without triton). The references (kernels/reference_lora.py) are the oracle.

from qwen_ops.ops.kernels import reference_lora as RL  # noqa: E402


def _lora_shrink_checked(backend: str, x, lora_a, lora_indices, scalings) -> None:
    V.check_lora_shrink(x, lora_a, lora_indices, scalings)
    if value_checks_enabled(backend):
        V.check_lora_indices_values(lora_indices, lora_a.shape[0])


def _lora_expand_checked(backend: str, y, buffer, lora_b, lora_indices, slice_sizes) -> None:
    V.check_lora_expand(y, buffer, lora_b, lora_indices, slice_sizes)
    if value_checks_enabled(backend):
        V.check_lora_indices_values(lora_indices, lora_b.shape[0])


def _lora_shrink_host(x, lora_a, lora_indices, scalings):
    """The CPU kernel where the C++ kernels do not build: the reference."""
    _lora_shrink_checked("reference", x, lora_a, lora_indices, scalings)
    return RL.lora_shrink_reference(x, lora_a, lora_indices, scalings)


def _lora_expand_host(y, buffer, lora_b, lora_indices, slice_sizes):
    _lora_expand_checked("reference", y, buffer, lora_b, lora_indices, slice_sizes)
    RL.lora_expand_reference(y, buffer, lora_b, lora_indices, slice_sizes)


def _first_lora_call(name: str, host_kernel):
    """The CPU kernel registered at import: where the C++ kernels build, it registers them (cpu_fast_ops, once:
    they replace this one) and calls the op again; elsewhere it runs the reference (no ctypes kernel)."""
    def kernel(*args):
        if _cpu().why_unavailable() is None:
            cpu_fast_ops()
            return getattr(torch.ops.qwen, name).default(*args)
        return host_kernel(*args)
    return kernel


def _lora_shrink_other(x, lora_a, lora_indices, scalings):
    _lora_shrink_checked("triton", x, lora_a, lora_indices, scalings)
    if _quant_triton(x):
        from qwen_ops.ops.kernels.triton_lora import lora_shrink_triton
        return lora_shrink_triton(x, lora_a, lora_indices, scalings)
    return RL.lora_shrink_reference(x, lora_a, lora_indices, scalings)


def _lora_expand_other(y, buffer, lora_b, lora_indices, slice_sizes):
    _lora_expand_checked("triton", y, buffer, lora_b, lora_indices, slice_sizes)
    if _quant_triton(y):
        from qwen_ops.ops.kernels.triton_lora import lora_expand_triton
        lora_expand_triton(y, buffer, lora_b, lora_indices, slice_sizes)
    else:
        RL.lora_expand_reference(y, buffer, lora_b, lora_indices, slice_sizes)


_LORA_LIB = torch.library.Library(NAMESPACE, "IMPL")
_LORA_LIB.impl("lora_shrink", _first_lora_call("lora_shrink", _lora_shrink_host), "CPU")
_LORA_LIB.impl("lora_expand", _first_lora_call("lora_expand", _lora_expand_host), "CPU")
_LORA_LIB.impl("lora_shrink", _lora_shrink_other, "CUDA")
_LORA_LIB.impl("lora_expand", _lora_expand_other, "CUDA")


@torch.library.register_fake(f"{NAMESPACE}::lora_shrink", lib=_LIB)
def _lora_shrink_fake(x, lora_a, lora_indices, scalings):
    V.check_lora_shrink(x, lora_a, lora_indices, scalings)
    return x.new_empty((x.shape[0], lora_a.shape[1]), dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::lora_expand", lib=_LIB)
def _lora_expand_fake(y, buffer, lora_b, lora_indices, slice_sizes) -> None:
    V.check_lora_expand(y, buffer, lora_b, lora_indices, slice_sizes)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_indices: torch.Tensor,
                scalings: torch.Tensor) -> torch.Tensor:
    """The LoRA A products of a batch with one adapter slot per row: x ``[T, K]``, lora_a ``[L, S * R, K]`` (the
    pool's slots; S slices' A matrices stacked, each zero-padded to rank R) in x's dtype, lora_indices int32
    ``[T]`` (-1 = no adapter), scalings fp32 ``[L]``. Returns fp32 ``[T, S * R]``:
    ``scalings[i] * (lora_a[i] @ x[t])``, ``i = lora_indices[t]``; zero rows for -1."""
    return torch.ops.qwen.lora_shrink(x, lora_a, lora_indices, scalings)


def lora_expand(y: torch.Tensor, buffer: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
                slice_sizes: list[int]) -> None:
    """In place, the LoRA B products added to the layer's output y ``[T, N]``: buffer fp32 ``[T, S * R]``
    (lora_shrink's), lora_b ``[L, N, R]`` in y's dtype with ``N = sum(slice_sizes)``; column n of slice s gets
    ``buffer[t, s R : (s + 1) R] . lora_b[i, n]`` (fp32, y + sum rounded once). Rows with -1 untouched."""
    torch.ops.qwen.lora_expand(y, buffer, lora_b, lora_indices, slice_sizes)
