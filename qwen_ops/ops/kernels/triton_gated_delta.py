"""Triton kernels of the hybrid-model state ops torch.ops.qwen.causal_conv1d / gated_delta_rule.

Layouts and semantics are those of ``kernels/reference_gated_delta.py`` (the specification). Every float
tensor may be a strided view whose last dimension is contiguous (validation guarantees it); the
kernels take the other strides. Grids come from static shapes only (never from device values),
so every launch is CUDA-graph capturable. Padding sequences (slot -1) exit at once and their
output rows, allocated with ``torch.zeros``, stay zero.

causal_conv1d, two launches in stream order:
  * ``_causal_conv1d_kernel``: program (token block, channel block). Token blocks are numbered over
    the whole batch as in the attention prefill kernel (block b of sequence s has id
    ``query_start_loc[s] // BLOCK_T + s + b``; a binary search finds s). Each output row sums
    ``kernel`` taps, taking inputs before the chunk from the slot's conv state (when the chunk
    continues the slot) or zeros (when it starts the sequence).
  * ``_conv_state_update_kernel``: program (sequence, channel block) writes the slot's new last
    kernel - 1 inputs. It runs after the first launch, so no program reads a state already updated.

gated_delta_rule:
  * ``_gated_delta_rule_recurrent_kernel``: program (sequence, value head, v block) keeps its
    ``[k_dim, BLOCK_V]`` slice of the fp32 state in registers and walks the sequence's tokens:
    L2-normalise q and k, decay, delta update, output. State bytes are read once and written once,
    which is all a decode step needs. Prefill uses the same kernel (sequential in tokens); a
    chunked Triton prefill is future work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwen_ops.ops.kernels import triton_interpret
from qwen_ops.ops.kernels.triton_common import Launch, _find_sequence

L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _causal_conv1d_kernel(
    out_ptr, x_ptr, weight_ptr, bias_ptr, conv_state_ptr, seq_slots_ptr, query_start_loc_ptr, seq_lens_ptr,
    num_seqs, dim,
    stride_xt, stride_ot, stride_wd,                  # x, out [T, dim]; weight [dim, KERNEL]
    stride_ss, stride_sd, stride_sk,                  # conv_state [slots, dim, KERNEL - 1]
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    tb = tl.program_id(0)
    db = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tb, num_seqs, BLOCK_T)
    slot = tl.load(seq_slots_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tb - (q_start // BLOCK_T + seq)
    if (slot < 0) | (local * BLOCK_T >= q_len):   # padding sequence or spare block id
        return
    continues = tl.load(seq_lens_ptr + seq) > q_len

    j = local * BLOCK_T + tl.arange(0, BLOCK_T)      # token index inside the sequence
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = j < q_len
    d_ok = d < dim
    state_row = conv_state_ptr + slot.to(tl.int64) * stride_ss + d[None, :] * stride_sd
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for t in tl.static_range(KERNEL):
        p = j - (KERNEL - 1) + t                     # input position; < 0 lies before this chunk
        from_x = (row_ok & (p >= 0))[:, None] & d_ok[None, :]
        xv = tl.load(x_ptr + (q_start + p).to(tl.int64)[:, None] * stride_xt + d[None, :], mask=from_x, other=0.0)
        from_state = (row_ok & (p < 0) & continues)[:, None] & d_ok[None, :]
        sv = tl.load(state_row + (KERNEL - 1 + p)[:, None] * stride_sk, mask=from_state, other=0.0)
        w = tl.load(weight_ptr + d * stride_wd + t, mask=d_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    out = acc * tl.sigmoid(acc)
    tok = (q_start + j).to(tl.int64)
    tl.store(out_ptr + tok[:, None] * stride_ot + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv_state_update_kernel(
    x_ptr, conv_state_ptr, seq_slots_ptr, query_start_loc_ptr, seq_lens_ptr,
    dim, stride_xt, stride_ss, stride_sd, stride_sk,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Program (sequence, channel block): state column c becomes input position q_len - WIDTH + c.
    seq = tl.program_id(0)
    db = tl.program_id(1)
    slot = tl.load(seq_slots_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (slot < 0) | (q_len <= 0):
        return
    continues = tl.load(seq_lens_ptr + seq) > q_len
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    c = tl.arange(0, BLOCK_W)
    d_ok = d < dim
    p = q_len - WIDTH + c
    ok = d_ok[:, None] & (c < WIDTH)[None, :]
    from_x = ok & (p >= 0)[None, :]
    xv = tl.load(x_ptr + (q_start + p).to(tl.int64)[None, :] * stride_xt + d[:, None], mask=from_x, other=0.0)
    state_row = conv_state_ptr + slot.to(tl.int64) * stride_ss + d[:, None] * stride_sd
    # Old column WIDTH + p (> c) of the same slot and channels: loaded before any store below.
    from_state = ok & (p < 0)[None, :] & continues
    sv = tl.load(state_row + (WIDTH + p)[None, :] * stride_sk, mask=from_state, other=0.0)
    new = tl.where(from_x, xv.to(conv_state_ptr.dtype.element_ty), sv)
    tl.store(state_row + c[None, :] * stride_sk, new, mask=ok)


@triton.jit
def _gated_delta_rule_recurrent_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, seq_slots_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_gt, stride_bt,
    stride_s0, stride_s1, stride_s2,                  # state [slots, HV, K, V]
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, EPS: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)                              # value head
    vb = tl.program_id(2)
    slot = tl.load(seq_slots_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (slot < 0) | (q_len <= 0):
        return
    continues = tl.load(seq_lens_ptr + seq) > q_len
    kh = h // GROUP                                   # the q/k head this value head reads
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < K_DIM
    v_ok = offs_v < V_DIM
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s_ptrs = state_ptr + slot.to(tl.int64) * stride_s0 + h * stride_s1 + offs_k[:, None] * stride_s2 + offs_v[None, :]
    s = tl.load(s_ptrs, mask=tile_ok & continues, other=0.0)   # a starting sequence begins from zeros
    for t in range(q_len):
        tok = (q_start + t).to(tl.int64)
        qv = tl.load(q_ptr + tok * stride_qt + kh * stride_qh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + tok * stride_kt + kh * stride_kh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + tok * stride_vt + h * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * stride_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_bt + h).to(tl.float32)
        qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, 0) + EPS)) * scale
        kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, 0) + EPS))
        s = s * tl.exp(g)
        u = (vv - tl.sum(s * kv[:, None], 0)) * beta   # [BLOCK_V]: beta (v - S^T k)
        s = s + kv[:, None] * u[None, :]
        o = tl.sum(s * qv[:, None], 0)                 # S^T q
        tl.store(out_ptr + tok * stride_ot + h * stride_oh + offs_v, o.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, s, mask=tile_ok)


# --------------------------------------------------------------------------------------------
# Launch plans (static shapes only)
# --------------------------------------------------------------------------------------------

def causal_conv1d_launches(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens, out: torch.Tensor,
                           interpret: bool) -> list[Launch]:
    """The launches that fill ``out`` (zeros on entry, [num_tokens, dim]) and update ``conv_state``."""
    num_tokens, dim = x.shape
    num_seqs = seq_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return []
    kernel = weight.shape[1]
    width = kernel - 1
    seq_slots, query_start_loc, seq_lens = (t.contiguous() for t in (seq_slots, query_start_loc, seq_lens))
    block_t = 4 if interpret else 16
    block_d = min(triton.next_power_of_2(dim), 64 if interpret else 256)
    has_bias = bias is not None
    state_strides = tuple(conv_state.stride())
    launches = [Launch(
        _causal_conv1d_kernel, (num_tokens // block_t + num_seqs, triton.cdiv(dim, block_d)),
        (out, x, weight, bias if has_bias else weight, conv_state, seq_slots, query_start_loc, seq_lens,
         num_seqs, dim, x.stride(0), out.stride(0), weight.stride(0), *state_strides),
        (("KERNEL", kernel), ("BLOCK_T", block_t), ("BLOCK_D", block_d), ("HAS_BIAS", has_bias)),
        num_warps=4, num_stages=1)]
    if width:
        launches.append(Launch(
            _conv_state_update_kernel, (num_seqs, triton.cdiv(dim, block_d)),
            (x, conv_state, seq_slots, query_start_loc, seq_lens, dim, x.stride(0), *state_strides),
            (("WIDTH", width), ("BLOCK_W", triton.next_power_of_2(width)), ("BLOCK_D", block_d)),
            num_warps=4, num_stages=1))
    return launches


def gated_delta_rule_launches(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale: float,
                              out: torch.Tensor, interpret: bool) -> list[Launch]:
    """The launch that fills ``out`` (zeros on entry, [num_tokens, num_v_heads, v_dim]) and updates ``state``."""
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    num_seqs = seq_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return []
    seq_slots, query_start_loc, seq_lens = (t.contiguous() for t in (seq_slots, query_start_loc, seq_lens))
    block_k = triton.next_power_of_2(k_dim)
    # The [BLOCK_K, BLOCK_V] fp32 state tile lives in registers: keep it at about 8K elements.
    block_v = triton.next_power_of_2(v_dim) if interpret else max(16, min(triton.next_power_of_2(v_dim),
                                                                           8192 // block_k))
    return [Launch(
        _gated_delta_rule_recurrent_kernel, (num_seqs, num_v_heads, triton.cdiv(v_dim, block_v)),
        (out, q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, float(scale),
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
         g.stride(0), beta.stride(0), *state.stride()[:3]),
        (("K_DIM", k_dim), ("V_DIM", v_dim), ("GROUP", num_v_heads // num_k_heads), ("BLOCK_K", block_k),
         ("BLOCK_V", block_v), ("EPS", L2NORM_EPS)),
        num_warps=4, num_stages=1)]


# --------------------------------------------------------------------------------------------
# Launchers (arguments already validated); qwen_ops.ops.kernels.triton re-exports them
# --------------------------------------------------------------------------------------------

def causal_conv1d_triton(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> torch.Tensor:
    """Depthwise causal conv + SiLU, [num_tokens, dim] in x.dtype; conv_state updated in place."""
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for launch in causal_conv1d_launches(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens, out,
                                         triton_interpret()):
        launch.run()
    return out


def gated_delta_rule_triton(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens,
                            scale: float) -> torch.Tensor:
    """Gated delta rule, [num_tokens, num_v_heads, v_dim] in v.dtype; state updated in place."""
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for launch in gated_delta_rule_launches(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale,
                                            out, triton_interpret()):
        launch.run()
    return out
