"""The ``cpu`` backend: native C kernels for kv_write and slot_attention on CPU tensors, the CPU
fast path's ops that the model's layers choose when their weights are packed (linear_packed,
rms_norm, add_rms_norm, qk_norm_rope, silu_mul, moe_packed; ``qwen_ops/models/layers.py``), and
the greedy argmax that sampling uses.

``qwen_cpu.c`` (next to this file, the arithmetic) and ``qwen_cpu_ops.cpp`` (the fast ops'
dispatcher kernels, against torch's headers) are one shared library, the only CPU build:
``cpu_build.py`` builds it (at ``pip install``, else on first use) and says where a build for this
machine is found. The C part is built with ``-march=native``, and with OpenMP where the compiler has
it, so that the packed products split across torch's intra-op threads. This module calls the C
functions through ctypes (kv_write, slot_attention, the host helpers); the fast ops' C++ kernels are
registered by ``registry.cpu_fast_ops``. It is the build PyTorch's own
``torch.utils.cpp_extension.load`` would make, without its ninja dependency.

Without a C or C++ compiler (or torch's headers) the backend is unavailable and ``auto`` keeps the reference on the CPU.
Sequences with many query rows (prefill, chunked prefill) take slot_attention's flash path
(``qwen_cpu_flash.c``: pages read in place, causal blocks skipped, AMX tiles for bf16); fp16
long prefills run on the reference.
The hybrid models' state ops (causal_conv1d, gated_delta_rule) have no native kernel here:
this backend runs them with the reference kernels. ``fused_moe`` runs the grouped-by-expert torch
implementation of ``reference_moe.py`` (its GEMMs are MKL's / oneDNN's).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import platform
import time
from pathlib import Path
from typing import Optional

import torch

# The build's pieces, named here too: the tests swap _compiler, _cxx_compiler, _build and SOURCE of
# this module, which library() reads.
from qwen_ops.ops.kernels.cpu_build import (CXX_SOURCE, SOURCE, _compiler, _cpu_flags,  # noqa: F401
                                            _cxx_compiler, build, cache_dir, check_toolchain, library_name,
                                            search_dirs)
from qwen_ops.ops.kernels.reference import (causal_conv1d_reference, gated_delta_rule_reference,
                                        slot_attention_reference)

logger = logging.getLogger(__name__)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KV_WRITE_ARGS = [_p] * 7 + [_i64] * 4 + [_i64] * 4 + [_i64] * 7 + [_i64] * 2
_KV_WRITE_FP8_ARGS = [_p] * 7 + [_i64] * 3 + [_i32, _i32, _f32, _f32] + [_i64] * 4 + [_i64] * 7 + [_i64] * 2
_ATTENTION_ARGS = ([_p] * 9 + [_i64] * 5 + [_i32, _f32] + [_i64] * 4 + [_i64] * 6 + [_i64] * 2 + [_i64]
                   + [_i32, _f32, _f32])
_PACK_PANELS_ARGS = [_p, _i64, _i64, _p]
# name -> (argtypes, restype) of every function the library exports
_SIGNATURES = {
    "qwen_register_cpu_kernels": ([], ctypes.c_void_p),
    "qwen_unregister_cpu_kernels": ([_p], None),
    "qwen_kv_write": (_KV_WRITE_ARGS, None),
    "qwen_kv_write_fp8": (_KV_WRITE_FP8_ARGS, None),
    "qwen_slot_attention": (_ATTENTION_ARGS, ctypes.c_int),
    "qwen_argmax_rows": ([_p, _i64, _i64, _i64, _p], None),
    "qwen_sample_rows": ([_p, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p, _i64, _p], None),
    "qwen_apply_token_bitmask": ([_p, _i64, _i64, _p, _i64, _p, _i64], None),
    "qwen_pack_panels": (_PACK_PANELS_ARGS, None),
    "qwen_pack_panels_bf16": (_PACK_PANELS_ARGS, None),
    "qwen_bf16_products": ([], ctypes.c_int),
    "qwen_int8_dot_products": ([], ctypes.c_int),
    "qwen_int8_amx": ([], ctypes.c_int),
    "qwen_linear_packed": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i64], None),
    "qwen_linear_packed_bf16": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i64], None),
    "qwen_linear": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i32, _i64], ctypes.c_int),
    "qwen_rms_norm": ([_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _f32, _i32], ctypes.c_int),
    "qwen_qk_norm_rope": ([_p, _i64, _i64, _i64, _p, _i64, _i64, _i64, _p, _p, _f32, _p, _i64, _p, _p, _p, _i64,
                           _i64, _i32], ctypes.c_int),
    "qwen_silu_mul": ([_p, _i64, _p, _i64, _p, _i64, _i64, _i32], ctypes.c_int),
    "qwen_moe_packed": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _p, _i64], ctypes.c_int),
    "qwen_linear_quant": ([_i32, _p, _i64, _i64, _p, _p, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64],
                          ctypes.c_int),
    "qwen_linear_quant_a8": ([_i32, _p, _i64, _i64, _p, _p, _p, _i64, _p, _i64, _i64, _p, _i64, _i64, _i64],
                             ctypes.c_int),
    "qwen_linear_a8_panels": ([_i32, _p, _i64, _i64, _i64, _p, _p, _p, _i64, _p, _i64, _i64, _p, _i64, _i64, _i64,
                               _i64], ctypes.c_int),
}


def _build(cc: str, cxx: str, out: Path) -> None:
    """``cpu_build.build`` of this module's ``SOURCE`` and ``CXX_SOURCE``."""
    build(cc, cxx, out, SOURCE, CXX_SOURCE)


# Environment settings the C library reads once per process (qwen_cpu.c): their allowed values.
PRODUCT_SETTINGS = {"QWEN_OPS_BF16_PRODUCTS": ("amx", "dot", "widening"), "QWEN_OPS_INT8_PRODUCTS": ("vnni",)}


def _check_product_settings() -> None:
    for name, allowed in PRODUCT_SETTINGS.items():
        value = os.environ.get(name)
        if value not in (None, "", *allowed):
            raise ValueError(f"{name} = {value!r}, expected one of {', '.join(allowed)} (or unset: the CPU's own choice)")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernels, loaded once per process: the build for this machine found where
    ``cpu_build.search_dirs`` says (the per-user cache, then the one ``pip install`` made), else
    compiled now into the cache. The C functions are called through ctypes by this module; the fast
    ops' C++ kernels are registered by ``qwen_register_cpu_kernels`` (registry.py calls it, once)."""
    _check_product_settings()
    cc, cxx = _compiler(), _cxx_compiler()
    check_toolchain(cc, cxx)
    name = library_name(cc, cxx)
    lib = None
    for folder in search_dirs():
        if (folder / name).exists():
            try:
                lib = ctypes.CDLL(str(folder / name))
                break
            except OSError as e:        # e.g. a wheel's build whose torch libraries moved: build again
                logger.warning("qwen_ops: cannot load %s (%s); compiling the CPU kernels instead", folder / name, e)
    if lib is None:
        path = cache_dir() / name
        # Say so: the first use on a machine waits here (no build at install, or another CPU, compiler
        # or torch since), which should not look like a hang.
        logger.warning("qwen_ops: compiling the CPU kernels with %s and %s (first use on this machine, about "
                       "30 s) into %s", cc, cxx, path)
        start = time.perf_counter()
        _build(cc, cxx, path)
        logger.warning("qwen_ops: CPU kernels compiled in %.1f s", time.perf_counter() - start)
        lib = ctypes.CDLL(str(path))
    for fn_name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@functools.lru_cache(maxsize=1)
def why_unavailable() -> Optional[str]:
    """None when the kernels compile and load here, else the reason."""
    try:
        library()
    except (OSError, RuntimeError) as exc:
        return str(exc)
    return None


def _i32_vector(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _scale(t: Optional[torch.Tensor]) -> float:
    """A one-element fp32 scale tensor (validated) as a float; None is 1.0."""
    return 1.0 if t is None else float(t.reshape(()))


def kv_write_cpu(key, value, key_cache, value_cache, slot_ids, positions, block_table, k_scale=None,
                 v_scale=None) -> None:
    slot_ids, positions = _i32_vector(slot_ids), _i32_vector(positions)
    ks, vs, kcs, vcs, bts = key.stride(), value.stride(), key_cache.stride(), value_cache.stride(), block_table.stride()
    _, block_size, kv_heads, head_dim = key_cache.shape
    if key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        library().qwen_kv_write_fp8(
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            slot_ids.data_ptr(), positions.data_ptr(), block_table.data_ptr(),
            key.shape[0], kv_heads, head_dim, _DTYPE_CODES[key.dtype], _DTYPE_CODES[key_cache.dtype],
            _scale(k_scale), _scale(v_scale), ks[0], ks[1], vs[0], vs[1],
            block_size, kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2], bts[0], bts[1])
        return
    library().qwen_kv_write(
        key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        slot_ids.data_ptr(), positions.data_ptr(), block_table.data_ptr(),
        key.shape[0], kv_heads, head_dim, key.element_size(),
        ks[0], ks[1], vs[0], vs[1],
        block_size, kcs[0], kcs[1], kcs[2],
        vcs[0], vcs[1], vcs[2],
        bts[0], bts[1])


# fp16 has no flash path in the C kernel (qwen_cpu_flash.c takes fp32 and bf16): above this many
# query rows per sequence its attention runs the reference (SDPA over gathered keys), which is
# faster there than the C kernel's row-by-row attention.
FP16_REFERENCE_ABOVE_QUERY_LEN = 96


def slot_attention_cpu(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                       scale: float, max_query_len: int, gate: Optional[torch.Tensor] = None,
                       k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    if query.dtype == torch.float16 and max_query_len > FP16_REFERENCE_ABOVE_QUERY_LEN:
        return slot_attention_reference(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                                        seq_lens, scale, max_query_len, gate, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = seq_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out.zero_()
    seq_slots, query_start_loc, seq_lens = _i32_vector(seq_slots), _i32_vector(query_start_loc), _i32_vector(seq_lens)
    qs, kcs, vcs, bts = query.stride(), key_cache.stride(), value_cache.stride(), block_table.stride()
    gs = (0, 0) if gate is None else gate.stride()
    status = library().qwen_slot_attention(
        query.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_table.data_ptr(), seq_slots.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        None if gate is None else gate.data_ptr(),
        num_seqs, num_heads, key_cache.shape[2], head_dim, key_cache.shape[1],
        _DTYPE_CODES[query.dtype], float(scale),
        qs[0], qs[1], gs[0], gs[1],
        kcs[0], kcs[1], kcs[2],
        vcs[0], vcs[1], vcs[2],
        bts[0], bts[1], torch.get_num_threads(), _DTYPE_CODES[key_cache.dtype], _scale(k_scale), _scale(v_scale))
    if status != 0:
        raise MemoryError("qwen_ops cpu slot_attention could not allocate its scratch memory")
    return out


# No native kernels for the hybrid models' state ops: the reference runs them (see the module doc).
causal_conv1d_cpu = causal_conv1d_reference
gated_delta_rule_cpu = gated_delta_rule_reference

# fused_moe: tokens grouped by expert, one torch GEMM per expert and projection (reference_moe.py).
from qwen_ops.ops.kernels.reference_moe import fused_moe_cpu  # noqa: E402,F401


# --------------------------------------------------------------------------------------------
# Host helpers of the C library that are not ops: sampling's argmax, a grammar's bitmask, weight
# packing, what this CPU's products run on, huge-page memory. (The fast ops' kernels are the C++
# dispatcher kernels of qwen_cpu_ops.cpp, in the same library; registry.py registers them.)
# --------------------------------------------------------------------------------------------

def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64) of fp32 ``x [rows, cols]`` with contiguous rows and cols >= 1:
    the first maximum, or the first NaN, as torch (several times faster than torch's CPU argmax on
    a batch of logits: benchmarks/README.md)."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    library().qwen_argmax_rows(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr())
    return out


def _sample_rows_args(x: torch.Tensor, temps: torch.Tensor, top_p: Optional[torch.Tensor],
                      floor: Optional[torch.Tensor]):
    rows, cols = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or cols < 1:
        raise ValueError(f"x is {x.dtype} [{rows}, {cols}] with column stride {x.stride(1)}, expected float32 rows "
                         "of >= 1 contiguous columns")
    temps = temps.to(torch.float32).contiguous()
    top_p = torch.ones(rows, dtype=torch.float64) if top_p is None else top_p.to(torch.float64).contiguous()
    floor = None if floor is None else floor.to(torch.float32).contiguous()
    if temps.shape != (rows,) or top_p.shape != (rows,) or (floor is not None and floor.shape != (rows,)):
        raise ValueError(f"temps {tuple(temps.shape)}, top_p {tuple(top_p.shape)} and floor "
                         f"{None if floor is None else tuple(floor.shape)}, expected [{rows}] each")
    return rows, cols, temps, top_p, floor


def sample_rows(x: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, top_p: Optional[torch.Tensor] = None,
                floor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row of fp32 ``x [rows, cols]`` (contiguous rows) drawn from softmax(x / temps)
    by the inverse CDF with float64 uniforms ``u [rows]`` in [0, 1) (``sampling.cdf_pick`` over
    ``sampling_weights``' row, one pass in C: no probability tensor, no float64 copy, no sort); where
    ``top_p [rows]`` is below 1, over the tokens its top-p keeps (most likely first, ties by token,
    while the mass before them is at most p: the token crossing p stays); ``floor [rows]``: tokens
    whose logit is below it weigh 0 (min-p and top-k). int64, -1 where a row has no finite maximum
    or a NaN."""
    rows, cols, temps, top_p, floor = _sample_rows_args(x, temps, top_p, floor)
    u = u.to(torch.float64).contiguous()
    if u.shape != (rows,):
        raise ValueError(f"u {tuple(u.shape)}, expected [{rows}]")
    out = torch.empty(rows, dtype=torch.int64)
    w = torch.empty(cols, dtype=torch.float32)
    bsum = torch.empty((cols + 63) // 64, dtype=torch.float64)
    library().qwen_sample_rows(x.data_ptr(), rows, cols, x.stride(0), temps.data_ptr(),
                               None if floor is None else floor.data_ptr(), top_p.data_ptr(), u.data_ptr(),
                               out.data_ptr(), w.data_ptr(), 0, bsum.data_ptr())
    if bool((out == -2).any()):
        raise MemoryError("qwen_sample_rows could not allocate its top-p scratch")
    return out


def sampling_weights(x: torch.Tensor, temps: torch.Tensor, top_p: Optional[torch.Tensor] = None,
                     floor: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights ``sample_rows`` picks from, kept: fp32 ``[rows, cols]``, exp(x / temps - max) with
    the tokens below each row's ``floor`` and past its top-p cut zeroed (not normalized), and bool
    ``[rows]``: False where a row has no finite maximum or a NaN (its weights all 0)."""
    rows, cols, temps, top_p, floor = _sample_rows_args(x, temps, top_p, floor)
    out = torch.empty(rows, dtype=torch.int64)
    w = torch.empty((rows, cols), dtype=torch.float32)
    bsum = torch.empty((cols + 63) // 64, dtype=torch.float64)
    library().qwen_sample_rows(x.data_ptr(), rows, cols, x.stride(0), temps.data_ptr(),
                               None if floor is None else floor.data_ptr(), top_p.data_ptr(), None,
                               out.data_ptr(), w.data_ptr(), cols, bsum.data_ptr())
    if bool((out == -2).any()):
        raise MemoryError("qwen_sample_rows could not allocate its top-p scratch")
    return w, out == 0


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows) -> None:
    """In place: fp32 ``logits [N, vocab]`` (contiguous rows) rows ``rows[i]`` keep only the tokens
    whose bit is set in int32 ``mask [len(rows), words]`` (xgrammar's bitmask layout: bit b of word w
    is token 32 w + b); the rest, and tokens past the mask, become -inf. ``xgrammar``'s
    ``apply_token_bitmask_inplace`` is the reference (tests/test_structured.py)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits has dtype {logits.dtype}, shape {tuple(logits.shape)} and strides "
                         f"{logits.stride()}, expected fp32 [N, vocab] with contiguous rows")
    rows_t = torch.as_tensor(list(rows), dtype=torch.int64)
    if mask.dtype != torch.int32 or mask.dim() != 2 or mask.shape[0] != rows_t.numel():
        raise ValueError(f"mask has dtype {mask.dtype} and shape {tuple(mask.shape)}, expected int32 "
                         f"[{rows_t.numel()} rows, words]")
    if rows_t.numel() and (int(rows_t.min()) < 0 or int(rows_t.max()) >= logits.shape[0]):
        raise ValueError(f"rows = {rows_t.tolist()}, expected row indices in [0, {logits.shape[0]})")
    mask = mask.contiguous()
    library().qwen_apply_token_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[1], mask.data_ptr(),
                                       mask.shape[1], rows_t.data_ptr(), rows_t.numel())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 or bf16 ``weight [N, K]`` packed for ``linear_packed``, 32 output features
    per panel, zero past N: fp32 ``[ceil(N / 32), K, 32]`` (k-major), bf16 ``[ceil(N / 32),
    ceil(K / 2), 32, 2]`` (k in pairs, zero past K: the layout of AVX512-BF16 dot products).
    ``pack_panels_reference`` (kernels/reference_fused.py) is the same layout in torch."""
    if weight.dim() != 2 or not weight.is_contiguous() or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, dtype {weight.dtype} and strides "
                         f"{weight.stride()}, expected a contiguous [N, K] float32 or bfloat16 tensor")
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        packed = torch.empty(((n + 31) // 32, (k + 1) // 2, 32, 2), dtype=torch.bfloat16)
        library().qwen_pack_panels_bf16(weight.data_ptr(), n, k, packed.data_ptr())
        return packed
    packed = torch.empty(((n + 31) // 32, k, 32), dtype=torch.float32)
    library().qwen_pack_panels(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose whole 2 MB pages Linux is asked to back with huge pages: its
    bytes start on a 2 MB boundary of an anonymous mapping of their own, advised ``MADV_HUGEPAGE``
    (used where transparent huge pages are ``always`` or ``madvise``; a tail under 2 MB keeps 4 KB pages,
    so nothing is resident beyond the tensor's bytes). A one-row product streams its weights once a
    step, and on 4 KB pages every 4 KB costs a TLB miss: the int8 / int4 panels read 10-15% faster
    from huge pages on the AMX Xeon (benchmarks/README.md). Elsewhere, or under 2 MB: ``torch.empty``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # not shmem
    raw = torch.frombuffer(area, dtype=torch.uint8)     # keeps the mapping alive as long as a view of it
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:             # a kernel without transparent huge pages: 4 KB pages, as torch.empty
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``huge_page_empty`` filled with zeros (every page made resident now, as ``torch.zeros`` does): a
    paged KV cache, whose blocks a step reads scattered over the whole cache, one TLB miss a block on
    4 KB pages."""
    return huge_page_empty(shape, dtype).zero_()


class HugePageArena:
    """One ``huge_page_empty`` buffer of ``nbytes`` handed out in order (``take``): the weights a model's
    step streams one after another, laid out in that order on 2 MB pages, small layers included (a
    tensor of its own under 2 MB gets none), and a product's prefetch running past its end finds the
    next one's first bytes. Its pages become resident as they are written; the buffer lives as long as
    any tensor taken from it."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = huge_page_empty((max(1, nbytes),), torch.uint8)
        self.used = 0

    def copy(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of ``t`` in the next bytes (``take``), or None when they do not fit."""
        out = self.take(tuple(t.shape), t.dtype)
        return None if out is None else out.copy_(t)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """An uninitialized tensor of the next bytes (64-byte aligned), or None when they do not fit."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // 64) * 64
        if start + nbytes > self.buffer.numel():
            return None
        self.used = start + nbytes
        return self.buffer[start:start + nbytes].view(dtype).view(shape)


def int8_dot_products() -> bool:
    """Whether the int8-activation products (``linear_int8_a8`` / ``linear_int4_a8``) run AVX512-VNNI
    integer dot products on this CPU; without, they run a portable loop that is correct but tens of
    times slower."""
    return bool(library().qwen_int8_dot_products())


def int8_products() -> str:
    """How the int8-activation products of more than 4 rows run on this CPU, one choice per process:
    "amx" (AMX-INT8 tiles, where the CPU has them, unless ``QWEN_OPS_INT8_PRODUCTS=vnni``),
    "avx512_vnni" or "portable"; every path gives the same bits (exact integer sums)."""
    if library().qwen_int8_amx():
        return "amx"
    return "avx512_vnni" if int8_dot_products() else "portable"


def bf16_products() -> str:
    """How the products on bf16 weights run on this CPU, one choice per process: "amx" (AMX tiles,
    where the CPU has them), "avx512_bf16" (dot products, where the CPU has AVX512-BF16 and they
    beat widening) or "widening" (bf16 -> fp32 loads feeding fp32 FMAs); ``QWEN_OPS_BF16_PRODUCTS``
    (amx | dot | widening) forces one where the CPU has it."""
    return {2: "amx", 1: "avx512_bf16"}.get(library().qwen_bf16_products(), "widening")


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """The product under torch.ops.qwen.linear_packed, without the op: ``F.linear(x, weight, bias)``
    in fp32 for fp32 ``x [rows, K]`` with contiguous rows and an fp32 ``bias``, from ``packed =
    pack_panels(weight)`` of an fp32 or bf16 weight (fp32 accumulation; for a bf16 weight ``x``
    should hold bf16 values: the AVX512-BF16 path rounds it to bf16)."""
    rows, k = x.shape
    out = torch.empty((rows, out_features), dtype=torch.float32)
    fn = library().qwen_linear_packed_bf16 if packed.dtype == torch.bfloat16 else library().qwen_linear_packed
    fn(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), None if bias is None else bias.data_ptr(), out_features, k,
       out.data_ptr(), out_features, torch.get_num_threads())
    return out
