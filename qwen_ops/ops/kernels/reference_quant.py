"""Plain-torch references (the specification and test oracle) of the quantized linear ops:
``linear_int8``, ``linear_int4`` and ``linear_fp8`` (schemas in ``torch_library/qwen.schema``), and
``linear_int8_a8`` / ``linear_int4_a8``, the same products on int8-quantized activations.

Each dequantizes the weight to fp32 with one rounding per element, then multiplies in fp32 and
rounds the result once to x's dtype:

* int8: ``qweight`` int8 ``[N, K]``, ``scales`` fp32 ``[N, G]`` (group ``g = K / G``):
  ``w[n, k] = qweight[n, k] * scales[n, k // g]`` (symmetric; per channel when G == 1).
* int4: ``qweight`` uint8 ``[N, K / 2]``, element k in nibble ``k % 2`` (low nibble first) of byte
  ``k // 2``; ``scales`` fp32 and ``zeros`` uint8 (each in 0..15), both ``[N, G]``:
  ``w[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]`` (AWQ's and GPTQ's formula).
* fp8: ``weight`` float8_e4m3fn ``[N, K]``, ``scale_inv`` fp32 ``[ceil(N / block_n), ceil(K / block_k)]``:
  ``w[n, k] = float(weight[n, k]) * scale_inv[n // block_n, k // block_k]`` (Qwen3-*-FP8's block-wise
  layout; one block of ``[N, K]`` is a per-tensor scale).

Then ``y = x @ w.T (+ bias fp32 [N])`` in fp32, rounded once to ``x.dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` (two elements a byte, low nibble first) -> uint8 ``[N, K]`` in 0..15."""
    return torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(qweight.shape[0], 2 * qweight.shape[1])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` of values in 0..15 (K even) -> ``[N, K / 2]``, element k in nibble k % 2."""
    pairs = q.to(torch.uint8).reshape(q.shape[0], q.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _per_element(groups: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """``groups [ceil(rows / block_rows), ceil(cols / block_cols)]`` repeated to ``[rows, cols]``."""
    return groups.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    return qweight.float() * _per_element(scales.float(), n, k, 1, k // scales.shape[1])


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    q = unpack_int4(qweight)
    n, k = q.shape
    g = k // scales.shape[1]
    return (q.float() - _per_element(zeros.float(), n, k, 1, g)) * _per_element(scales.float(), n, k, 1, g)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = weight.shape
    return weight.float() * _per_element(scale_inv.float(), n, k, block_n, block_k)


def _product(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear_int8_reference(x, qweight, scales, bias=None) -> torch.Tensor:
    return _product(x, dequantize_int8(qweight, scales), bias)


def linear_int4_reference(x, qweight, scales, zeros, bias=None) -> torch.Tensor:
    return _product(x, dequantize_int4(qweight, scales, zeros), bias)


def linear_fp8_reference(x, weight, scale_inv, bias, block_n, block_k) -> torch.Tensor:
    return _product(x, dequantize_fp8(weight, scale_inv, block_n, block_k), bias)


def activation_block(group: int) -> int:
    """The block of x elements that share one int8 scale in the ``*_a8`` products: 128 when it divides
    the weight's group (a per-channel weight's group is all of K), else the group."""
    return 128 if group % 128 == 0 else group


def _activation_digits(x: torch.Tensor, group: int):
    """Per row and block of ``activation_block(group)`` elements: the digits ``d = round_half_even(x *
    (127 / amax))`` in -127..127 (fp32 arithmetic; 0 where amax is 0) ``[rows, blocks, ab]`` and
    ``unit = amax / 127`` ``[rows, blocks]`` (NaN for a block holding a NaN or an infinity)."""
    xf = x.float()
    rows, k = xf.shape
    ab = activation_block(group)
    blocks = xf.reshape(rows, k // ab, ab)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(blocks).all(dim=-1)
    # Tensor by tensor: torch computes a Python number divided by a tensor (and a tensor by a number)
    # through a reciprocal, two roundings; the kernels divide once.
    n127 = torch.full_like(amax, 127.0)
    scale = torch.where(amax > 0, n127 / amax, torch.zeros_like(amax))
    digits = torch.round(torch.where(finite[..., None], blocks * scale[..., None], torch.zeros_like(blocks)))
    unit = torch.where(finite, amax / n127, torch.full_like(amax, float("nan")))
    return digits.clamp(-127, 127), unit


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the ``*_a8`` products see it (fp32): per row and block of ``activation_block(group)``
    elements, ``unit = amax / 127`` and ``x ~ round_half_even(x * (127 / amax)) * unit`` (the digits in
    -127..127: llama.cpp's Q8_0 activations, one scale a block). A block of zeros stays zero; a block
    holding a NaN or an infinity is NaN."""
    digits, unit = _activation_digits(x, group)
    return (digits * unit[..., None]).reshape(x.shape[0], x.shape[1])


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fma(a, b, c)`` of fp32 tensors with one rounding, as the kernels' FMA: the product is exact in
    float64; a float64 sum rounded to fp32 rounds twice, which differs from one rounding only when
    the float64 sum lands exactly on an fp32 midpoint (about once in 2^29 operations, so some
    thousands of times in a real-size generate): there TwoSum's error term decides the side."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)                      # s + err == p + c exactly
    r = s.float()
    diff = s - r.double()
    toward = torch.nextafter(r, torch.where(diff > 0, torch.tensor(float("inf")), torch.tensor(float("-inf"))))
    tie = (diff != 0) & (diff.abs() * 2 == (toward.double() - r.double()).abs())
    return torch.where(tie & (err * diff > 0), toward, r)


def _a8_product(x, weights: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bias) -> torch.Tensor:
    """The contract of the ``*_a8`` products, computed as the kernels compute it: ``weights`` the
    unsigned weights ``u`` ``[N, K]`` and ``zeros`` ``[N, G]`` (int8: ``q + 128`` and 128), then per
    output ``acc = fma(float(sum_k d u - z sum_k d), s * unit, acc)`` over the blocks in order (each
    integer sum exact in float64, each fma one fp32 rounding: ``_fma32``), ``+ bias``."""
    n, k = weights.shape
    group = k // scales.shape[1]
    digits, unit = _activation_digits(x, group)
    ab = digits.shape[-1]
    dsum = digits.sum(dim=-1).double()
    u = weights.double()
    acc = torch.zeros((x.shape[0], n), dtype=torch.float32)
    for b in range(digits.shape[1]):
        g = b * ab // group
        isum = digits[:, b].double() @ u[:, b * ab:(b + 1) * ab].T
        f = isum - dsum[:, b, None] * zeros[:, g].double()[None, :]
        sc = scales[:, g][None, :].float() * unit[:, b, None]
        acc = _fma32(f.float(), sc, acc)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def linear_int8_a8_reference(x, qweight, scales, bias=None) -> torch.Tensor:
    """``linear_int8`` on int8 activations (W8A8): ``quantize_activations(x) @ dequantize_int8(...).T``,
    with the kernels' arithmetic (``_a8_product``)."""
    return _a8_product(x, qweight.to(torch.int16) + 128, torch.full_like(scales, 128.0), scales, bias)


def linear_int4_a8_reference(x, qweight, scales, zeros, bias=None) -> torch.Tensor:
    """``linear_int4`` on int8 activations (W4A8), as ``linear_int8_a8_reference``."""
    return _a8_product(x, unpack_int4(qweight), zeros.float(), scales, bias)


def unpack_a8_panels(weight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], out_features: int
                     ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``linear_a8_panels``' operands back in ``linear_*_a8``'s layout: ``(qweight, scales, zeros)`` of the
    first ``out_features`` features. The panels (64 output features each, the features in the lanes):
    int8 (``zeros`` None) ``weight[p, kq, f, i] = q[64 p + f, 4 kq + i] + 128``; int4
    ``weight[p, o, f, i] = u[64 p + f, 8 o + i] | u[64 p + f, 8 o + 4 + i] << 4``; ``scales`` / ``zeros``
    ``[p, group, f]``."""
    n = out_features
    if zeros is None:
        u = weight.permute(0, 2, 1, 3).reshape(weight.shape[0] * 64, -1)[:n]     # [N, K], element 4 kq + i
        qweight = (u.to(torch.int16) - 128).to(torch.int8)
    else:
        lo, hi = weight & 15, weight >> 4                                          # k = 8 o + i, 8 o + 4 + i
        u = torch.cat((lo, hi), dim=-1).permute(0, 2, 1, 3).reshape(weight.shape[0] * 64, -1)[:n]
        qweight = pack_int4(u)
    rows = scales.permute(0, 2, 1).reshape(-1, scales.shape[1])[:n].contiguous()
    zrows = None if zeros is None else zeros.permute(0, 2, 1).reshape(-1, zeros.shape[1])[:n].contiguous()
    return qweight.contiguous(), rows, zrows


def linear_a8_panels_reference(x, weight, scales, zeros, bias, out_features) -> torch.Tensor:
    """``linear_int8_a8`` (``zeros`` None) or ``linear_int4_a8`` of the panels' weights."""
    qweight, s, z = unpack_a8_panels(weight, scales, zeros, out_features)
    if z is None:
        return linear_int8_a8_reference(x, qweight, s, bias)
    return linear_int4_a8_reference(x, qweight, s, z, bias)


def silu_mul_linear_a8_panels_reference(gate_up, weight, scales, zeros, bias, out_features) -> torch.Tensor:
    """``linear_a8_panels`` of ``silu_mul(gate_up)`` (both references)."""
    from qwen_ops.ops.kernels.reference_fused import silu_mul_reference

    return linear_a8_panels_reference(silu_mul_reference(gate_up), weight, scales, zeros, bias, out_features)


# The reference of each QuantLinear scheme (``qwen_ops.models.quant``), by scheme name.
REFERENCES = {"int8": linear_int8_reference, "int4": linear_int4_reference, "fp8": linear_fp8_reference,
              "int8_a8": linear_int8_a8_reference, "int4_a8": linear_int4_a8_reference}


def expert_product(kernel: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                   zeros: Optional[torch.Tensor], block_k: int, linear=None) -> torch.Tensor:
    """``linear_<kernel>`` of one expert's weight on rows ``x`` (no bias), through ``linear`` (a function
    of the op's arguments; default: the reference)."""
    linear = linear or REFERENCES[kernel]
    if kernel in ("int4", "int4_a8"):
        return linear(x, w, scales, zeros, None)
    if kernel == "fp8":
        return linear(x, w, scales, None, 1, block_k)
    return linear(x, w, scales, None)


def fused_moe_quant_reference(hidden_states, w13, w13_scales, w13_zeros, w2, w2_scales, w2_zeros, topk_weights,
                              topk_ids, kernel: str, block_k: int) -> torch.Tensor:
    """The specification of ``fused_moe_quant``: ``fused_moe_reference``'s loop (one expert at a time,
    everything in fp32) with each product the reference of ``linear_<kernel>`` on fp32 rows."""
    num_tokens, hidden = hidden_states.shape
    inter = w13.shape[1] // 2
    x = hidden_states.float()
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for expert in torch.unique(topk_ids).tolist():
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)
        z13 = None if w13_zeros is None else w13_zeros[expert]
        z2 = None if w2_zeros is None else w2_zeros[expert]
        gate_up = expert_product(kernel, x[token], w13[expert], w13_scales[expert], z13, block_k)
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = expert_product(kernel, act, w2[expert], w2_scales[expert], z2, block_k)
        out.index_add_(0, token, y * topk_weights[token, choice].float()[:, None])
    return out.to(hidden_states.dtype)
