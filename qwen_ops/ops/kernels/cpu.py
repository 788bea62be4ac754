"""The ``cpu`` backend: native C kernels for kv_write and slot_attention on CPU tensors, plus the
pieces of the engine's native CPU executor (``qwen_ops/engine/executors.py``): the packed-panel
matrix product, the dense model's whole forward in one call (``dense_forward``), and the greedy
argmax that sampling uses.

``qwen_cpu.c`` (next to this file) is compiled on first use with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``) into a shared library kept in a per-user cache
(``$QWEN_OPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/qwen_ops`` or ``~/.cache/qwen_ops``), keyed by
the source, the compiler, the flags and the CPU's feature flags (it is built with
``-march=native``, and with OpenMP where the compiler has it, so that the packed products split
across torch's intra-op threads). It is called through ctypes: no torch headers, so the build
takes a few seconds, needs nothing but a C compiler, and ``pip install`` stays pure Python.

Without a C compiler the backend is unavailable and ``auto`` keeps the reference on the CPU.
Long prefills (more than ``REFERENCE_ABOVE_QUERY_LEN`` query rows in a sequence) run on the
reference too, whose SDPA is faster there than the C kernel's row-by-row attention.
The hybrid models' state ops (causal_conv1d, gated_delta_rule) have no native kernel here:
this backend runs them with the reference kernels. ``fused_moe`` runs the grouped-by-expert torch
implementation of ``reference_moe.py`` (its GEMMs are MKL's / oneDNN's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from qwen_ops.ops.kernels.reference import (causal_conv1d_reference, gated_delta_rule_reference,
                                        slot_attention_reference)

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("qwen_cpu.c")
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_KV_WRITE_ARGS = [_p] * 7 + [_i64] * 4 + [_i64] * 4 + [_i64] * 7 + [_i64] * 2
_ATTENTION_ARGS = [_p] * 9 + [_i64] * 5 + [_i32, _f32] + [_i64] * 4 + [_i64] * 6 + [_i64] * 2
_ARGMAX_ARGS = [_p, _i64, _i64, _i64, _p]
_LINEAR_PACKED_ARGS = [_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i64]
_PACK_PANELS_ARGS = [_p, _i64, _i64, _p]
_DENSE_FORWARD_ARGS = ([_p, _i64, _p] + [_i64] * 5 + [_f32, _f32, _p, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _i64]
                       + [_p] * 3 + [_i64] * 5 + [_p, _i64, _p, _p, _i64, _p, _i32, _p, _i64, _p, _p])
# qwen_dense_forward's reduce: sums a partial product over the tensor-parallel ranks in place.
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)
# qwen_dense_forward's mlp: a mixture-of-experts layer's MLP, (layer, x, out, rows) -> 0.
MLP_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
# name -> (argtypes, restype) of every function the library exports
_SIGNATURES = {
    "qwen_kv_write": (_KV_WRITE_ARGS, None),
    "qwen_slot_attention": (_ATTENTION_ARGS, ctypes.c_int),
    "qwen_argmax_rows": (_ARGMAX_ARGS, None),
    "qwen_linear_packed": (_LINEAR_PACKED_ARGS, None),
    "qwen_pack_panels": (_PACK_PANELS_ARGS, None),
    "qwen_linear_packed_bf16": (_LINEAR_PACKED_ARGS, None),
    "qwen_pack_panels_bf16": (_PACK_PANELS_ARGS, None),
    "qwen_bf16_dot_products": ([], ctypes.c_int),
    "qwen_openmp": ([], ctypes.c_int),
    "qwen_dense_forward": (_DENSE_FORWARD_ARGS, ctypes.c_int),
    "qwen_dense_weights_per_layer": ([], ctypes.c_int64),
    "qwen_moe_packed": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _p, _i64], ctypes.c_int),
}


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    if os.environ.get("QWEN_OPS_CACHE_DIR"):
        return Path(os.environ["QWEN_OPS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qwen_ops"


def _extra_flags() -> list[str]:
    """``$QWEN_OPS_CPU_CFLAGS``, appended to the compile flags (e.g. ``-mno-avx512f`` to build the
    portable loops instead of the AVX-512 paths; the tests do)."""
    return os.environ.get("QWEN_OPS_CPU_CFLAGS", "").split()


def _build(cc: str, out: Path) -> None:
    """Compile to a temporary name, then rename: concurrent builders never load a half-written file.

    With OpenMP where the compiler has it (the products then split across torch's intra-op
    threads; GCC's libgomp.so.1 is the one torch itself loaded, so both share one thread pool),
    else without (single-threaded products)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    # some compilers (or CPUs) reject -march=native; some compilers have no OpenMP runtime
    for arch, openmp in ((["-march=native"], ["-fopenmp"]), (["-march=native"], []), ([], ["-fopenmp"]), ([], [])):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, *arch, *openmp, *_extra_flags(), str(SOURCE), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, out)
            return
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}:\n{proc.stderr.strip()}")
    raise RuntimeError("compiling the qwen_ops CPU kernels failed:\n" + "\n".join(errors))


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernels (built on first call, then cached on disk and in this process)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, " ".join(FLAGS + tuple(_extra_flags())), _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"qwen_cpu_{key}.so"
    if not path.exists():
        # Say so: the first use on a machine waits a few seconds here, which should not look like a hang.
        logger.warning("qwen_ops: compiling the CPU kernels with %s (first use on this machine, a few seconds) "
                       "into %s", cc, path)
        start = time.perf_counter()
        _build(cc, path)
        logger.warning("qwen_ops: CPU kernels compiled in %.1f s", time.perf_counter() - start)
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    if lib.qwen_dense_weights_per_layer() != len(DENSE_LAYER_WEIGHTS):
        raise RuntimeError(f"{path} does not match {__file__} (DENSE_LAYER_WEIGHTS); delete it to rebuild")
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


def kv_write_cpu(key, value, key_cache, value_cache, slot_ids, positions, block_table) -> None:
    slot_ids, positions = _i32_vector(slot_ids), _i32_vector(positions)
    ks, vs, kcs, vcs, bts = key.stride(), value.stride(), key_cache.stride(), value_cache.stride(), block_table.stride()
    _, block_size, kv_heads, head_dim = key_cache.shape
    library().qwen_kv_write(
        key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        slot_ids.data_ptr(), positions.data_ptr(), block_table.data_ptr(),
        key.shape[0], kv_heads, head_dim, key.element_size(),
        ks[0], ks[1], vs[0], vs[1],
        block_size, kcs[0], kcs[1], kcs[2],
        vcs[0], vcs[1], vcs[2],
        bts[0], bts[1])


# Above this many query rows per sequence, the reference (SDPA's flash attention over gathered
# keys) is faster than the C kernel, which attends row by row (the crossover measured:
# benchmarks/README.md, "Measured design choices").
REFERENCE_ABOVE_QUERY_LEN = 96


def slot_attention_cpu(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                       scale: float, max_query_len: int, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    if max_query_len > REFERENCE_ABOVE_QUERY_LEN:
        return slot_attention_reference(query, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                                        seq_lens, scale, max_query_len, gate)
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
        bts[0], bts[1])
    if status != 0:
        raise MemoryError("qwen_ops cpu slot_attention could not allocate its scratch memory")
    return out


# No native kernels for the hybrid models' state ops: the reference runs them (see the module doc).
causal_conv1d_cpu = causal_conv1d_reference
gated_delta_rule_cpu = gated_delta_rule_reference

# fused_moe: tokens grouped by expert, one torch GEMM per expert and projection (reference_moe.py).
from qwen_ops.ops.kernels.reference_moe import fused_moe_cpu  # noqa: E402,F401


# --------------------------------------------------------------------------------------------
# Fused fp32 pieces of the dense model's eager CPU forward (qwen_ops/models/dense.py calls them when the
# cpu backend is selected; not torch ops: under torch.compile the model keeps its torch code).
# --------------------------------------------------------------------------------------------




def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64) of fp32 ``x [rows, cols]`` with contiguous rows and cols >= 1:
    the first maximum, or the first NaN, as torch (several times faster than torch's CPU argmax on
    a batch of logits: benchmarks/README.md)."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    library().qwen_argmax_rows(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr())
    return out


def threaded_products() -> bool:
    """Whether the packed products split across ``torch.get_num_threads()`` threads (the library
    was built with OpenMP); without, they run on one thread whatever the setting, which still
    measured faster than torch's threaded products in most real-size runs (benchmarks/README.md),
    and never slower than one thread."""
    return bool(library().qwen_openmp())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 or bf16 ``weight [N, K]`` packed for ``linear_packed``, 32 output features
    per panel, zero past N: fp32 ``[ceil(N / 32), K, 32]`` (k-major), bf16 ``[ceil(N / 32),
    ceil(K / 2), 32, 2]`` (k in pairs, zero past K: the layout of AVX512-BF16 dot products)."""
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


def bf16_products() -> str:
    """How the products on bf16 weights run on this CPU: "avx512_bf16" (dot products, where the CPU
    has AVX512-BF16) or "widening" (bf16 -> fp32 loads feeding fp32 FMAs)."""
    return "avx512_bf16" if library().qwen_bf16_dot_products() else "widening"


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in fp32 for fp32 ``x [rows, K]`` with contiguous rows and an
    fp32 ``bias``, from ``packed = pack_panels(weight)`` (fp32 rounding of a different summation
    order than BLAS). For a bf16 weight, the products accumulate in fp32 and ``x`` should hold
    bf16 values (as a bf16 model's activations do): the AVX512-BF16 path rounds it to bf16."""
    rows, k = x.shape
    out = torch.empty((rows, out_features), dtype=torch.float32)
    fn = library().qwen_linear_packed_bf16 if packed.dtype == torch.bfloat16 else library().qwen_linear_packed
    fn(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), None if bias is None else bias.data_ptr(), out_features, k,
       out.data_ptr(), out_features, torch.get_num_threads())
    return out


# Batches up to this many tokens take dense_forward in the dense model's eager CPU forward (its
# scratch holds every activation of a layer for all tokens at once); larger ones walk the modules.
DENSE_FORWARD_MAX_TOKENS = 1024

# What qwen_dense_forward's timings add up, in order (T_PRODUCTS .. in qwen_cpu.c): the layers'
# matrix products, the lm_head product, attention (q/k norm, RoPE, kv write, attention), the rest.
DENSE_FORWARD_TIMINGS = ("products", "lm_head", "attention", "other")

# The order of qwen_dense_forward's per-layer weight addresses (the enum in qwen_cpu.c).
DENSE_LAYER_WEIGHTS = ("input_norm", "q", "q_bias", "k", "k_bias", "v", "v_bias", "q_norm", "k_norm", "o", "o_bias",
                       "post_norm", "gate", "up", "down")


def position_error(positions32: torch.Tensor, table_rows: int) -> ValueError:
    """The error for positions outside the RoPE table ``[0, table_rows)`` that the C code reads by position."""
    return ValueError(f"positions span [{int(positions32.min())}, {int(positions32.max())}], expected "
                      f"0 <= position < max_position_embeddings = {table_rows}")


def addresses(tensors) -> torch.Tensor:
    """int64 tensor of the tensors' data pointers (0 for None), for C code taking address tables."""
    return torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)


def _c_floats(address: int, n: int) -> torch.Tensor:
    """The ``n`` fp32 values at ``address`` (C scratch) as a tensor, without a copy."""
    return torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)


def _guarded(fn: Callable, errors: list) -> Callable:
    """``fn`` as a C callback: 0 when it returns, 1 when it raises (the exception appended to
    ``errors``, for the caller to raise after the C call: ctypes would only print it)."""
    def call(*args) -> int:
        try:
            fn(*args)
            return 0
        except BaseException as e:          # noqa: BLE001 - raised by the caller after the C call returns
            errors.append(e)
            return 1
    return call


def moe_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               inter: int, out: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts layer's routed experts into ``out [T, H]`` (fp32, overwritten):
    ``torch.ops.qwen.fused_moe``'s math on weights packed once (``pack_panels`` of each expert's
    ``w13 [2I, H]`` and ``w2 [H, I]``; ``w13`` / ``w2`` hold their addresses, int64 ``[E]``).
    ``x [T, H]`` fp32 contiguous, ``ids [T, k]`` int32, ``weights [T, k]`` fp32. The products split
    across torch's threads like ``dense_forward``'s."""
    T, H = x.shape
    k = ids.shape[1]
    if not (x.dtype == weights.dtype == out.dtype == torch.float32 and ids.dtype == torch.int32
            and x.is_contiguous() and out.is_contiguous() and out.shape == x.shape and weights.shape == ids.shape
            and ids.shape[0] == T and w13.shape == w2.shape and w13.dtype == torch.int64 and w13.dim() == 1):
        raise ValueError(f"moe_packed: x {tuple(x.shape)} {x.dtype}, ids {tuple(ids.shape)} {ids.dtype}, weights "
                         f"{tuple(weights.shape)} {weights.dtype}, out {tuple(out.shape)} {out.dtype}, w13/w2 "
                         f"{tuple(w13.shape)}/{tuple(w2.shape)}: expected fp32 contiguous x and out of one shape, "
                         "int32 ids and fp32 weights [T, k], int64 address vectors [E]")
    ids, weights = ids.contiguous(), weights.contiguous()
    status = library().qwen_moe_packed(x.data_ptr(), T, H, ids.data_ptr(), weights.data_ptr(), k, w13.shape[0],
                                       w13.data_ptr(), w2.data_ptr(), inter, out.data_ptr(), torch.get_num_threads())
    if status == -3:
        raise IndexError(f"ids span [{int(ids.min())}, {int(ids.max())}], expected expert ids in [0, {w13.shape[0]})")
    if status != 0:
        raise MemoryError("qwen_ops cpu moe_packed could not allocate its scratch memory")
    return out


def dense_forward(h: torch.Tensor, weight_addresses: torch.Tensor, caches: list, num_heads: int, head_dim: int,
                  inter: int, eps: float, scale: float, positions32: torch.Tensor, rope: torch.Tensor,
                  slot_ids: torch.Tensor, block_table: torch.Tensor, seq_slots: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, final_norm: torch.Tensor,
                  lm_head: torch.Tensor, vocab: int, timings: Optional[torch.Tensor] = None,
                  reduce: Optional[Callable[[torch.Tensor], None]] = None,
                  mlp: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None) -> torch.Tensor:
    """The whole dense forward of a batch in one C call; returns fp32 logits ``[len(rows), vocab]``.

    The model's dtype is that of the packed ``lm_head``: float32, or bfloat16, where every
    activation is rounded to bf16 where the model's bf16 forward rounds it (so ``h`` and the logits
    hold bf16 values in fp32) and the products accumulate in fp32.
    ``h [T, hidden]`` (fp32) holds the embeddings and is overwritten (the residual stream).
    ``weight_addresses`` (``addresses(...)``) lists each layer's tensors (or None) in
    ``DENSE_LAYER_WEIGHTS`` order, the matrices packed (``pack_panels``, the model's dtype;
    ``lm_head`` is the packed ``[vocab, hidden]`` weight too), the vectors fp32; one layer per
    entry of ``caches``, which holds each layer's ``(key_cache, value_cache)``, all in the model's
    dtype with one shape and one set of strides. ``rope``: the fp32 cos | sin table, rounded to
    bf16 for a bf16 model (as the model casts it). The caller checks all of that and the attention
    metadata (as the ops do); the C code checks ``positions32`` against ``rope`` and ``rows``
    against T. ``timings``: None, or a float64 tensor that the seconds spent in each part of
    ``DENSE_FORWARD_TIMINGS`` are added to. The products split across ``torch.get_num_threads()``
    threads (``threaded_products()``); the results do not depend on the thread count.

    Tensor parallelism: with one rank's slices (``qwen_cpu.c``), ``reduce(buf)`` sums the fp32
    1-D ``buf`` (a view of the C scratch: the o and down products) over the ranks in place, twice
    a layer; an exception it raises stops the forward and is raised here. The logits are then
    this rank's ``vocab`` rows of the vocabulary, for the caller to gather.

    Mixture-of-experts layers (their gate, up and down addresses 0): ``mlp(layer, x, out)`` writes
    the layer's MLP of the normed rows ``x`` into ``out`` (fp32 ``[T, hidden]`` views of the C
    scratch); an exception it raises is raised here.
    """
    lib = library()
    T, hidden = h.shape
    dtype = caches[0][0].dtype
    if lm_head.dtype != dtype or dtype not in (torch.float32, torch.bfloat16) or h.dtype != torch.float32:
        raise ValueError(f"lm_head is {lm_head.dtype}, the caches {dtype} and h {h.dtype}, expected float32 h "
                         "and a float32 or bfloat16 lm_head and caches of one dtype")
    if timings is not None and (timings.dtype != torch.float64 or timings.shape != (len(DENSE_FORWARD_TIMINGS),)):
        raise ValueError(f"timings has shape {tuple(timings.shape)} and dtype {timings.dtype}, expected float64 "
                         f"[{len(DENSE_FORWARD_TIMINGS)}]")
    if weight_addresses.shape != (len(DENSE_LAYER_WEIGHTS) * len(caches),) or weight_addresses.dtype != torch.int64:
        raise ValueError(f"weight_addresses has shape {tuple(weight_addresses.shape)} and dtype "
                         f"{weight_addresses.dtype}, expected int64 [{len(DENSE_LAYER_WEIGHTS)} x {len(caches)} layers]")
    cache_addresses = (ctypes.c_int64 * (2 * len(caches)))(*(t.data_ptr() for pair in caches for t in pair))
    kc = caches[0][0]
    positions32, slot_ids = _i32_vector(positions32), _i32_vector(slot_ids)
    seq_slots, query_start_loc, seq_lens = _i32_vector(seq_slots), _i32_vector(query_start_loc), _i32_vector(seq_lens)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    logits = torch.empty((rows.shape[0], vocab), dtype=torch.float32)
    errors: list[BaseException] = []
    callback = None if reduce is None else REDUCE_FN(_guarded(
        lambda address, n: reduce(_c_floats(address, n)), errors))
    mlp_callback = None if mlp is None else MLP_FN(_guarded(
        lambda layer, x, out, rows: mlp(layer, _c_floats(x, rows * hidden).view(rows, hidden),
                                        _c_floats(out, rows * hidden).view(rows, hidden)), errors))
    status = lib.qwen_dense_forward(
        weight_addresses.data_ptr(), len(caches), cache_addresses, hidden, num_heads, kc.shape[2], head_dim, inter,
        float(eps), float(scale), h.data_ptr(), T, positions32.data_ptr(), rope.data_ptr(), rope.stride(0), rope.shape[0],
        slot_ids.data_ptr(), block_table.data_ptr(), block_table.stride(0), block_table.stride(1),
        seq_slots.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(), seq_slots.shape[0], kc.shape[1],
        kc.stride(0), kc.stride(1), kc.stride(2), rows.data_ptr(), rows.shape[0], final_norm.data_ptr(),
        lm_head.data_ptr(), vocab, logits.data_ptr(), _DTYPE_CODES[dtype],
        None if timings is None else timings.data_ptr(), torch.get_num_threads(),
        None if callback is None else ctypes.cast(callback, ctypes.c_void_p),
        None if mlp_callback is None else ctypes.cast(mlp_callback, ctypes.c_void_p))
    if status == -5:
        if not errors:
            raise ValueError("a layer has no MLP weights (a mixture-of-experts layer) and no mlp was given")
        raise errors[0]
    if status == -2:
        raise position_error(positions32, rope.shape[0])
    if status == -3:
        raise IndexError(f"logits_indices span [{int(rows.min())}, {int(rows.max())}], expected rows of "
                         f"the batch, 0 <= index < {T}")
    if status != 0:
        raise MemoryError("qwen_ops cpu dense_forward could not allocate its scratch memory")
    return logits
