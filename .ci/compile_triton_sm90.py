"""CI check: every Triton kernel of qwen_ops/ops/kernels/triton.py, triton_gated_delta.py, triton_moe.py,
triton_quant.py and triton_lora.py compiles for sm_90 without a GPU.

The kernel configurations come from the launchers' own launch plans
(``kv_write_launches`` / ``slot_attention_launches``), built on small CPU tensors for each
dtype, head_dim, GQA ratio, gate and decode/prefill shape below, so this check compiles what
the launchers would launch and cannot drift from them. Each distinct (kernel, signature,
constexprs) is compiled once with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``.

Prints one line per kernel configuration; exits 1 if any fails to compile or needs more shared
memory than an sm_90 block may have.

Usage: python .ci/compile_triton_sm90.py
"""

from __future__ import annotations

import os
import sys
import time

# The interpreter replaces triton.jit functions with interpreted ones: compile the real kernels.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qwen_ops.ops.kernels import triton as qt  # noqa: E402
from qwen_ops.ops.kernels import triton_gated_delta as ql  # noqa: E402
from qwen_ops.ops.kernels import triton_moe as qm  # noqa: E402
from qwen_ops.ops.kernels import triton_quant as qq  # noqa: E402
from qwen_ops.ops.kernels import triton_lora as qr  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED_BYTES = 227 * 1024  # opt-in dynamic shared memory per block on H100/H200
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
_POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
            torch.int8: "*i8", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}

# (num_heads, num_kv_heads, gate, decode context capacity). Every dtype x head_dim compiles the
# first shape (GQA 4, gate, multi-split decode with merge); bf16 also compiles the others
# (GQA 1 without gate and GQA 7, both one-split decode), which change only constexprs.
SHAPES = ((16, 4, True, 4096), (8, 8, False, 64), (14, 2, True, 64))
FULL_SHAPES_DTYPE = torch.bfloat16


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER[value.dtype]
    if isinstance(value, bool):
        raise TypeError("bool runtime argument: pass it as a constexpr")
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported runtime argument {value!r}")


def _launches(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, gate: bool, capacity: int,
              kv_dtype: torch.dtype = None):
    """Launch plans of both ops for one shape, built on tiny CPU tensors (nothing runs); ``kv_dtype``: an
    fp8 cache (the kernels' FP8 variants, with scale tensors)."""
    block_size = 16
    num_slots, num_seqs = 4, 4
    blocks = capacity // block_size
    cache = torch.empty(num_slots * blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype)
    scale = torch.ones(1) if kv_dtype is not None else None
    block_table = torch.zeros(num_slots, blocks, dtype=torch.int32)
    index = torch.zeros(num_seqs, dtype=torch.int32)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    plans = []
    for num_tokens, max_query_len in ((num_seqs, 1), (3 * num_seqs, 3)):
        query = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
        g = torch.empty_like(query) if gate else None
        out = torch.empty_like(query)
        plans += qt.slot_attention_launches(query, cache, cache, block_table, index, qsl, index, 0.1,
                                            max_query_len, g, out, interpret=False, k_scale=scale, v_scale=scale)
    kv = torch.empty(num_seqs, num_kv_heads, head_dim, dtype=dtype)
    plans += qt.kv_write_launches(kv, kv, cache, cache, index, index, block_table, scale, scale)
    return plans


def _state_launches(dtype: torch.dtype):
    """Launch plans of the hybrid state ops at Qwen3.5 shapes (conv kernel 4, 16 k / 32 v heads of 128)."""
    num_seqs, slots = 4, 4
    dim = 2 * 16 * 128 + 32 * 128
    index = torch.zeros(num_seqs, dtype=torch.int32)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    plans = []
    for num_tokens in (num_seqs, 3 * num_seqs):
        x = torch.empty(num_tokens, dim, dtype=dtype)
        weight = torch.empty(dim, 4, dtype=dtype)
        conv_state = torch.empty(slots, dim, 3, dtype=dtype)
        for bias in (None, torch.empty(dim, dtype=dtype)):
            plans += ql.causal_conv1d_launches(x, weight, bias, conv_state, index, qsl, index, torch.empty_like(x),
                                               interpret=False)
        q = torch.empty(num_tokens, 16, 128, dtype=dtype)
        v = torch.empty(num_tokens, 32, 128, dtype=dtype)
        gb = torch.empty(num_tokens, 32, dtype=torch.float32)
        state = torch.empty(slots, 32, 128, 128, dtype=torch.float32)
        plans += ql.gated_delta_rule_launches(q, q, v, gb, gb, state, index, qsl, index, 0.1, torch.empty_like(v),
                                              interpret=False)
    return plans


def _moe_launches(dtype: torch.dtype):
    """Launch plans of fused_moe on a Qwen3-30B-A3B-shaped layer (128 experts, top 8, hidden 2048,
    inter 768): a decode batch (few rows per expert) and a 512-token prefill, i.e. both configs."""
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype)
    w2 = torch.empty(num_experts, hidden, inter, dtype=dtype)
    plans = []
    for num_tokens in (4, 512):
        x = torch.empty(num_tokens, hidden, dtype=dtype)
        topk_ids = torch.zeros(num_tokens, top_k, dtype=torch.int32)
        topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
        cfg = qm.moe_config(num_tokens * top_k, num_experts, dtype, interpret=False)
        alignment = qm.moe_align_block_size(topk_ids, num_experts, cfg.block_m)
        act = torch.empty(num_tokens * top_k, inter, dtype=dtype)
        partial = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32)
        plans += qm.fused_moe_launches(x, w13, w2, topk_weights, alignment, top_k, act, partial, cfg, upcast=False)
        # quantized experts (fused_moe_quant): int8 / int4 / fp8 weights, groups of 128 as the checkpoints'
        packed = {1: (torch.int8, 1), 2: (torch.uint8, 2), 3: (torch.float8_e4m3fn, 1)}
        for kind, (wdtype, per) in packed.items():
            q13 = torch.empty(num_experts, 2 * inter, hidden // per, dtype=wdtype)
            q2 = torch.empty(num_experts, hidden, inter // per, dtype=wdtype)
            s13 = torch.empty(num_experts, 2 * inter, hidden // 128, dtype=torch.float32)
            s2 = torch.empty(num_experts, hidden, inter // 128, dtype=torch.float32)
            z13, z2 = (s13.to(torch.uint8), s2.to(torch.uint8)) if kind == 2 else (None, None)
            quant = qm.QuantWeights(kind, s13, z13, 128, s2, z2, 128)
            plans += qm.fused_moe_launches(x, q13, q2, topk_weights, alignment, top_k, act, partial, cfg,
                                           upcast=False, quant=quant)
    return plans


def _quant_launches(dtype: torch.dtype):
    """Launch plans of the quantized linear ops on Qwen3-0.6B's gate|up shape (N 6144, K 1024): decode
    (1 row), a batch (24) and a prefill (512), each kind with its checkpoints' groups (128) and a bias."""
    n, k = 6144, 1024
    weights = {"int8": torch.empty(n, k, dtype=torch.int8), "int4": torch.empty(n, k // 2, dtype=torch.uint8),
               "fp8": torch.empty(n, k, dtype=torch.float8_e4m3fn)}
    scales = torch.empty(n, k // 128, dtype=torch.float32)
    zeros = torch.empty(n, k // 128, dtype=torch.uint8)
    bias = torch.empty(n, dtype=torch.float32)
    plans = []
    for rows in (1, 24, 512):
        x = torch.empty(rows, k, dtype=dtype)
        out = torch.empty(rows, n, dtype=dtype)
        for kind, w in weights.items():
            plans += qq.linear_quant_launches(kind, x, w, scales, zeros if kind == "int4" else None,
                                              bias if rows == 24 else None, out, n, k, 128, 1, upcast=False)
        # fp8 W8A8 (sm_89+): fp8 activations with per-row scales
        plans += qq.linear_quant_launches("fp8", torch.empty(rows, k, dtype=torch.float8_e4m3fn), weights["fp8"],
                                          scales, None, None, out, n, k, 128, 1, upcast=False,
                                          x_scales=torch.empty(rows, dtype=torch.float32))
    return plans


def _lora_launches(dtype: torch.dtype):
    """Launch plans of the LoRA ops on Qwen3-0.6B's q|k|v group (K 1024, slices 2048 / 1024 / 1024), rank 16,
    4 adapter slots: decode (1 and 8 rows, gathered tiles) and prefill (64 and 512 rows, tl.dot tiles)."""
    k, sizes, r, loras = 1024, [2048, 1024, 1024], 16, 4
    a = torch.empty(loras, 3 * r, k, dtype=dtype)
    b = torch.empty(loras, sum(sizes), r, dtype=dtype)
    scal = torch.empty(loras, dtype=torch.float32)
    plans = []
    for rows in (1, 8, 64, 512):
        x = torch.empty(rows, k, dtype=dtype)
        idx = torch.empty(rows, dtype=torch.int32)
        buf = torch.empty(rows, 3 * r, dtype=torch.float32)
        plans += qr.lora_shrink_launches(buf, x, a, idx, scal, upcast=False)
        plans += qr.lora_expand_launches(torch.empty(rows, sum(sizes), dtype=dtype), buf, b, idx, sizes)
    return plans


def _compile(launch: qt.Launch):
    fn = launch.kernel
    constexprs = dict(launch.constexprs)
    runtime = [name for name in fn.arg_names if name not in constexprs]
    if len(runtime) != len(launch.args):
        raise TypeError(f"{fn.__name__}: {len(launch.args)} runtime args for parameters {runtime}")
    signature = {name: _arg_type(value) for name, value in zip(runtime, launch.args)}
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in fn.arg_names}  # kernel parameter order
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)


def _plans():
    """(dtype, launch) for every configuration the launchers would launch."""
    for dtype in DTYPES:
        for launch in _state_launches(dtype):
            yield dtype, launch
        for launch in _moe_launches(dtype):
            yield dtype, launch
        for launch in _quant_launches(dtype):
            yield dtype, launch
        for launch in _lora_launches(dtype):
            yield dtype, launch
        for head_dim in HEAD_DIMS:
            for num_heads, num_kv_heads, gate, capacity in (SHAPES if dtype == FULL_SHAPES_DTYPE else SHAPES[:1]):
                for launch in _launches(dtype, head_dim, num_heads, num_kv_heads, gate, capacity):
                    yield dtype, launch
        for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):   # the fp8 KV cache (issue 42)
            for head_dim in (128,):
                num_heads, num_kv_heads, gate, capacity = SHAPES[0]
                for launch in _launches(dtype, head_dim, num_heads, num_kv_heads, gate, capacity, kv_dtype):
                    yield dtype, launch


def main() -> int:
    seen: set = set()
    failures = 0
    for dtype, launch in _plans():
        types = tuple(_arg_type(a) for a in launch.args)
        key = (launch.kernel.__name__, types, launch.constexprs, launch.num_warps, launch.num_stages)
        if key in seen:
            continue
        seen.add(key)
        config = " ".join(f"{k}={v}" for k, v in launch.constexprs)
        label = (f"{launch.kernel.__name__} {str(dtype).removeprefix('torch.')} {config} "
                 f"warps={launch.num_warps} stages={launch.num_stages}")
        start = time.perf_counter()
        try:
            compiled = _compile(launch)
        except Exception as exc:  # report every failing config, then fail
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        shared = compiled.metadata.shared
        status = "ok  "
        if shared > SM90_MAX_SHARED_BYTES:
            failures += 1
            status = "FAIL"
        print(f"{status} {label} shared={shared}B ptx={len(compiled.asm['ptx'])}B "
              f"{time.perf_counter() - start:.2f}s", flush=True)
    print(f"{len(seen)} kernel configurations, {failures} failed (triton {triton.__version__}, sm_90)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
