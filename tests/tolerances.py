"""The one tolerance table of the op tests, and the flash-attention style error bound.

KV-cache writes copy bits and are compared exactly (``torch.equal``); only attention, which
accumulates in fp32 and rounds its output to the input dtype, has tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Attention output vs the reference (both round an fp32 result to the dtype; outputs are
# convex combinations of randn values, |out| < ~4, so one ulp is 2e-3 in fp16, 1.6e-2 in bf16).
ATTENTION_TOLERANCE = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.float16: Tolerance(atol=4e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=1.6e-2),
}

# fused_moe vs the reference (fp32 products, one rounding). fp32: summation order only. fp16 / bf16:
# the backends round gate|up and SiLU * up to the dtype before the down product (as vLLM does), so
# they may sit a few output ulps from the reference (|out| < ~4: 4e-3 in fp16, 3e-2 in bf16 per
# ulp); the flash bound against a same-dtype torch run is the sharper check.
MOE_TOLERANCE = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.float16: Tolerance(atol=1e-2, rtol=4e-3),
    torch.bfloat16: Tolerance(atol=8e-2, rtol=3e-2),
}

# Slack of the flash-attention bound, which is relative to a same-dtype torch computation.
FLASH_BOUND_EPS = 1e-5


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    tol = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol.atol, rtol=tol.rtol, equal_nan=False,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


def assert_within_flash_bound(out: torch.Tensor, exact: torch.Tensor, same_dtype_torch: torch.Tensor,
                              eps: float = FLASH_BOUND_EPS) -> None:
    """``max|out - exact| <= 2 * max|same_dtype_torch - exact| + eps`` (flash-attention's test bound).

    exact: the result computed in fp32 or better; same_dtype_torch: plain torch run entirely in
    ``out.dtype``, i.e. the error any honest low-precision implementation may make.
    """
    err = (out.double() - exact.double()).abs().max().item()
    base = (same_dtype_torch.double() - exact.double()).abs().max().item()
    assert err <= 2 * base + eps, (f"max error {err:.3g} exceeds 2 x {base:.3g} (same-dtype torch) + {eps:g}")

# The CPU fast path's ops (tests/test_ops_fused.py) vs their references: the same fp32 math in
# another summation order, rounded once to the dtype (bf16: one output ulp of |x| < ~8 is 3e-2).
FUSED_TOLERANCE = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=1.6e-2),
}

# The multi-LoRA ops (tests/test_ops_lora.py) vs their references: shrink is fp32 sums of exactly widened
# products (summation order only); expand rounds y + fp32 sum once to y's dtype, so a bf16 y may land one ulp
# (2^-8 relative, up to 2^-7 just above a power of two) from the reference.
LORA_TOLERANCE = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=1e-4, rtol=2.0 ** -7),
}
