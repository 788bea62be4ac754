"""Reference kernels of the hybrid-model state ops: causal_conv1d and gated_delta_rule (plain torch).

They are the specification of ``torch.ops.qwen.causal_conv1d`` / ``torch.ops.qwen.gated_delta_rule``
and the test oracle, and the CPU kernels. Layouts (validated before these run):

  x                    [num_tokens, dim]                 conv input, one row per token
  weight, bias         [dim, kernel], [dim]              depthwise causal conv
  conv_state           [max_slots, dim, kernel - 1]      a slot's last kernel - 1 inputs, oldest first
  q, k                 [num_tokens, num_k_heads, k_dim]
  v                    [num_tokens, num_v_heads, v_dim]
  g, beta              [num_tokens, num_v_heads]         log decay (<= 0) and write strength
  state                [max_slots, num_v_heads, k_dim, v_dim] fp32

Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` (q_len of them) and slot
``seq_slots[i]``; ``seq_lens[i]`` counts its tokens after this call. ``q_len == seq_len`` means the
sequence starts here (zero conv inputs before it, zero recurrent state); ``q_len < seq_len``
continues the stored state. Padding sequences (slot -1) and sequences with no rows write nothing;
padding rows of the output are zero.

The gated delta rule, per value head (transformers' ``torch_recurrent_gated_delta_rule`` with
``use_qk_l2norm_in_kernel=True``; value head h reads q/k head ``h // (num_v_heads // num_k_heads)``,
i.e. ``repeat_interleave`` of the q/k heads):

  q_t <- scale * q_t / ||q_t||,  k_t <- k_t / ||k_t||        (fp32, ``x * rsqrt(sum x^2 + 1e-6)``)
  S_t  = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
  o_t  = S_t^T q_t                                           (S is [k_dim, v_dim])

``gated_delta_rule_reference`` runs decode rows (q_len == 1) as one batched recurrent step and longer
queries with the chunked (WY / UT-transform) form below, which computes the same recurrence with
matrix products; ``gated_delta_rule_recurrent`` runs every sequence token by token and is the oracle
the chunked form is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6     # transformers' / FLA's l2norm epsilon
CHUNK_SIZE = 64       # tokens per chunk of the chunked form (transformers uses 64 too)


# --------------------------------------------------------------------------------------------
# causal_conv1d
# --------------------------------------------------------------------------------------------

def causal_conv1d_reference(x, weight, bias, conv_state, seq_slots, query_start_loc, seq_lens) -> torch.Tensor:
    """``silu(bias + sum_t weight[:, t] * in[j + t])`` per token, ``in`` = previous kernel-1 inputs ++ x rows.

    Returns [num_tokens, dim] in x.dtype (accumulated in fp32); conv_state of every live slot with
    rows becomes its last kernel - 1 inputs.
    """
    num_tokens, dim = x.shape
    kernel = weight.shape[1]
    width = kernel - 1
    out = torch.zeros((num_tokens, dim), dtype=x.dtype, device=x.device)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    live = ((seq_slots >= 0) & (q_lens > 0)).nonzero()[:, 0]
    if live.numel() == 0:
        return out
    slots = seq_slots[live].long()
    starts = query_start_loc[:-1][live].long()
    lens = q_lens[live]
    num_live = live.numel()
    device = x.device

    # Inputs before each sequence's first row [S, width, dim]: the stored ones when the chunk
    # continues the slot, zeros when it starts the sequence (the slot may hold anything then).
    continues = (seq_lens[live].long() > lens)[:, None, None]
    prev = torch.where(continues, conv_state[slots].transpose(1, 2).float(), 0.0)

    # One buffer holding, per sequence, its previous inputs then its rows:
    # sequence s occupies ext[off[s] : off[s] + width + lens[s]].
    off = torch.cumsum(lens, 0) - lens + torch.arange(num_live, device=device) * width
    seq_of_row = torch.repeat_interleave(torch.arange(num_live, device=device), lens)      # [R]
    j = torch.arange(seq_of_row.numel(), device=device) - (torch.cumsum(lens, 0) - lens)[seq_of_row]
    ext = torch.empty((int(lens.sum()) + num_live * width, dim), dtype=torch.float32, device=device)
    taps = torch.arange(width, device=device)
    ext[(off[:, None] + taps[None, :]).flatten()] = prev.reshape(-1, dim)
    rows = starts[seq_of_row] + j                                                        # rows of x
    ext[off[seq_of_row] + width + j] = x[rows].float()

    # Row j of sequence s sees ext[off[s] + j + t], t = 0 .. kernel-1 (t = kernel-1 is the row itself):
    # one gather per tap, so no [R, kernel, dim] window is materialised.
    first = off[seq_of_row] + j                                                         # [R]
    w = weight.float()
    acc = torch.zeros((first.numel(), dim), dtype=torch.float32, device=device)
    if bias is not None:
        acc += bias.float()
    for t in range(kernel):
        acc.addcmul_(torch.index_select(ext, 0, first + t), w[:, t])
    out[rows] = F.silu(acc).to(x.dtype)

    # The new state: the last ``width`` entries of each sequence's segment.
    if width:
        last = ext[(off + lens)[:, None] + taps[None, :]]                                  # [S, width, dim]
        conv_state[slots] = last.transpose(1, 2).to(conv_state.dtype)
    return out


# --------------------------------------------------------------------------------------------
# gated_delta_rule
# --------------------------------------------------------------------------------------------

def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, as transformers' l2norm (fp32 in, fp32 out)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepared(q, k, v, g, beta, rows, scale: float, group: int):
    """fp32 inputs of ``rows``: q (normalised, scaled), k (normalised) with heads repeated to v's heads.

    Returns q, k [R, HV, K], v [R, HV, V], g, beta [R, HV].
    """
    qf = l2norm(q[rows].float()) * scale
    kf = l2norm(k[rows].float())
    if group > 1:   # value head h reads q/k head h // group
        qf, kf = qf.repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)
    return qf, kf, v[rows].float(), g[rows].float(), beta[rows].float()


def delta_rule_recurrent(q, k, v, g, beta, s0):
    """Token-by-token gated delta rule, batched over a leading dim B.

    q, k [B, L, H, K]; v [B, L, H, V]; g, beta [B, L, H]; s0 [B, H, K, V] (fp32).
    Returns out [B, L, H, V] and the final state [B, H, K, V].
    """
    s = s0
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv_mem = (k[:, t, :, None, :] @ s).squeeze(-2)                          # [B, H, V]: S^T k
        u = (v[:, t] - kv_mem) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = (q[:, t, :, None, :] @ s).squeeze(-2)                        # S^T q
    return out, s


def delta_rule_chunked(q, k, v, g, beta, s0, chunk_size: int = CHUNK_SIZE):
    """The same recurrence for one sequence, ``chunk_size`` tokens at a time with matrix products.

    q, k [H, L, K]; v [H, L, V]; g, beta [H, L]; s0 [H, K, V] (fp32). Returns out [H, L, V], state.

    Inside a chunk, with gamma_i = g_1 + ... + g_i (log decay from the chunk start) and S the state
    before the chunk, the updates u solve the unit lower-triangular system
        u_i + sum_{j<i} beta_i (k_i . k_j) e^{gamma_i - gamma_j} u_j = beta_i v_i - beta_i e^{gamma_i} S^T k_i
    and then  o_i = e^{gamma_i} S^T q_i + sum_{j<=i} (q_i . k_j) e^{gamma_i - gamma_j} u_j,
              S'  = e^{gamma_C} S + sum_j e^{gamma_C - gamma_j} k_j u_j^T.
    Every exponent is <= 0, so nothing overflows. Padding rows (k = v = beta = g = 0) give u = 0 and
    leave the state as it was.
    """
    H, L, _ = k.shape
    C = min(chunk_size, L)
    pad = (-L) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // C
    q, k, v = (t.reshape(H, n, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(H, n, C), beta.reshape(H, n, C)

    gamma = g.cumsum(-1)                                                          # [H, n, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta[..., None]
    # The system matrix; its diagonal is ignored (unitriangular), so it may hold beta_i |k_i|^2.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                                      # [H, n, C, C], causal
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]                           # [H, n, 1, 1]

    s = s0
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for i in range(n):
        u = u_v[:, i] - u_s[:, i] @ s                                              # [H, C, V]
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ u
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(H, n * C, -1)[:, :L], s


def _initial_state(state, slot: int, continues: bool) -> torch.Tensor:
    if continues:
        return state[slot].clone()
    return torch.zeros(state.shape[1:], dtype=torch.float32, device=state.device)


def _gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale: float,
                      chunked: bool) -> torch.Tensor:
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    group = v.shape[1] // q.shape[1]
    starts = query_start_loc.tolist()
    slots, lens = seq_slots.tolist(), seq_lens.tolist()
    decode = [i for i, s in enumerate(slots) if s >= 0 and starts[i + 1] - starts[i] == 1]
    longer = [i for i, s in enumerate(slots) if s >= 0 and starts[i + 1] - starts[i] > 1]
    if chunked and decode:
        # All one-token sequences in one batched step: [S, 1, H, *].
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        idx = torch.tensor([slots[i] for i in decode], device=q.device)
        continues = torch.tensor([lens[i] > 1 for i in decode], device=q.device)[:, None, None, None]
        s0 = torch.where(continues, state[idx], 0.0)
        qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta, rows, scale, group)
        o, s = delta_rule_recurrent(qf[:, None], kf[:, None], vf[:, None], gf[:, None], bf[:, None], s0)
        out[rows] = o[:, 0].to(out.dtype)
        state[idx] = s
    for i in (longer if chunked else decode + longer):
        q_len = starts[i + 1] - starts[i]
        rows = torch.arange(starts[i], starts[i + 1], device=q.device)
        s0 = _initial_state(state, slots[i], lens[i] > q_len)
        qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta, rows, scale, group)
        if chunked:
            o, s = delta_rule_chunked(qf.transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1),
                                      gf.t(), bf.t(), s0)
            o = o.transpose(0, 1)
        else:
            o, s = delta_rule_recurrent(qf[None], kf[None], vf[None], gf[None], bf[None], s0[None])
            o, s = o[0], s[0]
        out[rows] = o.to(out.dtype)
        state[slots[i]] = s
    return out


def gated_delta_rule_reference(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens,
                               scale: float) -> torch.Tensor:
    """Gated delta rule over varlen tokens; [num_tokens, num_v_heads, v_dim] in v.dtype, state updated.

    Decode rows run as one batched recurrent step, longer queries with the chunked form.
    """
    return _gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale, chunked=True)


def gated_delta_rule_recurrent(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens,
                               scale: float) -> torch.Tensor:
    """The same op computed token by token for every sequence (the oracle of the chunked form)."""
    return _gated_delta_rule(q, k, v, g, beta, state, seq_slots, query_start_loc, seq_lens, scale, chunked=False)
