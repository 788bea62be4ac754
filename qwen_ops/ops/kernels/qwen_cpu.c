/* Native CPU kernels of torch.ops.qwen.*: kv_write and slot_attention, and (from the middle of
 * the file on) the CPU fast path's ops that the model's layers choose on the CPU: fused norms
 * (with the residual add), q/k norm + RoPE, SiLU * up, packed-panel matrix products on fp32 or
 * bf16 weights, and the packed mixture-of-experts experts.
 *
 * Plain C, no torch headers: qwen_ops/kernels/cpu.py compiles this file with the system C
 * compiler on first use (a few seconds), caches the shared library, and calls it through
 * ctypes with data pointers and element strides. The point is latency: a CPU decode step calls
 * these ops once per layer on a few KB of data, where the reference's chain of torch ops (block
 * gather, mask, SDPA, scatter) costs far more than the arithmetic.
 *
 * Semantics are those of the reference (qwen_ops/kernels/reference.py): paged caches
 * [num_blocks, block_size, num_kv_heads, head_dim] with any strides but a contiguous last dim,
 * slot -1 = padding (nothing written, output rows zero), keys past seq_len never read, softmax
 * and accumulation in fp32, output rounded once to the query dtype. Index values are trusted:
 * the Python side validates them first (or the engine built them from validated state).
 *
 * Dtype codes: 0 = float32, 1 = float16, 2 = bfloat16; KV caches also 3 = float8_e4m3fn, 4 = float8_e5m2
 * (a quantized cache: kv_write stores fp8(clamp(x / scale)), the attention reads float(q) * scale).
 */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to the nearest bf16 (ties to even) and widened back: the value torch's .to(bfloat16)
 * keeps, as an fp32. Branch-free so that loops over it vectorize; a NaN stays a (quiet) NaN. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t quiet_nan = (u | 0x00400000u) & 0xffff0000u;
    u = (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}

/* fp8 (3 = e4m3fn, 4 = e5m2) to fp32, exactly: the byte moved into an fp16's bit pattern (e5m2 is an
 * fp16's top byte; e4m3's exponent is 8 below fp16's, hence the 2^8), subnormals included. */
static inline float fp8_to_f32(uint8_t b, int kind) {
    if (kind == 4) return f16_to_f32((uint16_t)(b << 8));
    return f16_to_f32((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.0f;
}

/* fp32 to fp8, round to nearest even, saturated at the largest finite value (448 / 57344; vLLM's
 * __NV_SATFINITE, torch's .to() after a clamp); NaN stays NaN. Below the smallest normal (2^-6 /
 * 2^-14) the steps are 2^-9 / 2^-16: a scaling by a power of two and a rounding to an integer
 * (which carries into the smallest normal's code); above it the mantissa is rounded in the bits. */
static inline uint8_t f32_to_fp8(float x, int kind) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    float af;
    memcpy(&af, &a, 4);
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (kind == 4) {
        if (a >= 0x47600000u) return sign | 0x7bu;                                  /* >= 57344 */
        if (a < 0x38800000u) return sign | (uint8_t)(int)nearbyintf(af * 65536.0f);  /* < 2^-14 */
        return sign | (uint8_t)(((a + 0xfffffu + ((a >> 21) & 1u)) >> 21) - (112u << 2));
    }
    if (a >= 0x43e00000u) return sign | 0x7eu;                                      /* >= 448 */
    if (a < 0x3c800000u) return sign | (uint8_t)(int)nearbyintf(af * 512.0f);       /* < 2^-6 */
    return sign | (uint8_t)(((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
}

/* Bytes per element of a dtype code. */
static inline int64_t dtype_elem(int dtype) { return dtype == 0 ? 4 : dtype <= 2 ? 2 : 1; }

/* Whole rows of bf16 <-> fp32, branch-free so that they vectorize (the fast path's ops convert
 * every bf16 activation row they read and write); the roundings of bf16_to_f32 / f32_to_bf16. */
static inline void bf16_row_to_f32(const uint16_t *src, int64_t n, float *dst) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
        const uint32_t u = (uint32_t)src[d] << 16;
        memcpy(dst + d, &u, 4);
    }
}

static inline void f32_row_to_bf16(const float *src, int64_t n, uint16_t *dst) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
        uint32_t u;
        memcpy(&u, src + d, 4);
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
        dst[d] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
    }
}

static inline void load_row(const void *base, int64_t offset, int dtype, int64_t n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    } else if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) dst[d] = f16_to_f32(p[d]);
    } else if (dtype >= 3) {
        const uint8_t *p = (const uint8_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) dst[d] = fp8_to_f32(p[d], dtype);
    } else {
        bf16_row_to_f32((const uint16_t *)base + offset, n, dst);
    }
}

static inline void store_row(void *base, int64_t offset, int dtype, int64_t n, const float *src) {
    if (dtype == 0) {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    } else if (dtype == 1) {
        uint16_t *p = (uint16_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) p[d] = f32_to_f16(src[d]);
    } else {
        f32_row_to_bf16(src, n, (uint16_t *)base + offset);
    }
}

/* exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) split into an integer power and a
 * degree-6 polynomial on [-0.5, 0.5]; relative error ~2e-7, written so the loop vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f;   /* round to nearest (|t| < 2^22), vectorizes */
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};   /* 2^n */
    return p * scale.f;
}

/* Dot product and axpy over one head's row. The head dims of Qwen models (64, 128, 256, and
 * 32 for tiny ones) get copies with the length known at compile time, so the loops unroll and
 * vectorize without remainder handling; other lengths take the generic loop. */
static inline float dot_n(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

static inline void axpy_n(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

static inline float dot(const float *a, const float *b, int64_t n) {
    switch (n) {
        case 32: return dot_n(a, b, 32);
        case 64: return dot_n(a, b, 64);
        case 128: return dot_n(a, b, 128);
        case 256: return dot_n(a, b, 256);
        default: return dot_n(a, b, n);
    }
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    switch (n) {
        case 32: axpy_n(y, a, x, 32); return;
        case 64: axpy_n(y, a, x, 64); return;
        case 128: axpy_n(y, a, x, 128); return;
        case 256: axpy_n(y, a, x, 256); return;
        default: axpy_n(y, a, x, n);
    }
}

/* Token i's key/value rows go to block block_table[slot, pos / block_size], row pos % block_size. */
void qwen_kv_write(const void *key, const void *value, void *key_cache, void *value_cache,
                   const int32_t *slot_ids, const int32_t *positions, const int32_t *block_table,
                   int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t elem_size,
                   int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1,
                   int64_t block_size, int64_t c_sb, int64_t c_sr, int64_t c_sh,
                   int64_t vc_sb, int64_t vc_sr, int64_t vc_sh,
                   int64_t bt_s0, int64_t bt_s1) {
    const size_t row_bytes = (size_t)(head_dim * elem_size);
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int32_t slot = slot_ids[i];
        if (slot < 0) continue;
        const int64_t pos = positions[i];
        const int64_t block = block_table[slot * bt_s0 + (pos / block_size) * bt_s1];
        const int64_t row = pos % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            memcpy((char *)key_cache + (block * c_sb + row * c_sr + h * c_sh) * elem_size,
                   (const char *)key + (i * k_s0 + h * k_s1) * elem_size, row_bytes);
            memcpy((char *)value_cache + (block * vc_sb + row * vc_sr + h * vc_sh) * elem_size,
                   (const char *)value + (i * v_s0 + h * v_s1) * elem_size, row_bytes);
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* f32_to_fp8 on 16 lanes, the same steps (the subnormals' rounding by cvtps_epi32: to nearest even under
 * the default MXCSR), packed to 16 bytes. */
static inline __m128i f32x16_to_fp8(__m512 x, int kind) {
    const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512 small = _mm512_min_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(1.0f));
    const int e4 = kind != 4;
    const __m512i half = _mm512_set1_epi32(e4 ? 0x7ffff : 0xfffff);
    const int shift = e4 ? 20 : 21;
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, (unsigned)shift), one);
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, half), lsb), (unsigned)shift),
                                    _mm512_set1_epi32(e4 ? 120 << 3 : 112 << 2));
    const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(small, _mm512_set1_ps(e4 ? 512.0f : 65536.0f)));
    code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(e4 ? 0x3c800000 : 0x38800000)),
                                 sub);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(e4 ? 0x43e00000 : 0x47600000)),
                                 _mm512_set1_epi32(e4 ? 0x7e : 0x7b));
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000)),
                                 _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}
#endif

/* One head's row of n elements (src_dtype 0-2) divided by scale and stored as fp8 (kind 3 or 4). */
static inline void fp8_store_row(const void *src, int64_t offset, int src_dtype, int64_t n, float scale, int kind,
                                 uint8_t *dst, float *row) {
    load_row(src, offset, src_dtype, n, row);
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(scale);
    for (; d + 16 <= n; d += 16)
        _mm_storeu_si128((__m128i *)(void *)(dst + d), f32x16_to_fp8(_mm512_div_ps(_mm512_loadu_ps(row + d), sv), kind));
#endif
    for (; d < n; ++d) dst[d] = f32_to_fp8(row[d] / scale, kind);
}

/* qwen_kv_write into an fp8 cache (fp8_kind 3 or 4): each element of key / value (src_dtype 0-2)
 * divided by k_scale / v_scale in fp32 and rounded by f32_to_fp8. */
void qwen_kv_write_fp8(const void *key, const void *value, void *key_cache, void *value_cache,
                       const int32_t *slot_ids, const int32_t *positions, const int32_t *block_table,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int src_dtype, int fp8_kind,
                       float k_scale, float v_scale, int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1,
                       int64_t block_size, int64_t c_sb, int64_t c_sr, int64_t c_sh,
                       int64_t vc_sb, int64_t vc_sr, int64_t vc_sh, int64_t bt_s0, int64_t bt_s1) {
    float row[head_dim > 0 ? head_dim : 1];   /* one head's row in fp32: no allocation that could fail */
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int32_t slot = slot_ids[i];
        if (slot < 0) continue;
        const int64_t pos = positions[i];
        const int64_t block = block_table[slot * bt_s0 + (pos / block_size) * bt_s1];
        const int64_t r = pos % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            fp8_store_row(key, i * k_s0 + h * k_s1, src_dtype, head_dim, k_scale, fp8_kind,
                          (uint8_t *)key_cache + block * c_sb + r * c_sr + h * c_sh, row);
            fp8_store_row(value, i * v_s0 + h * v_s1, src_dtype, head_dim, v_scale, fp8_kind,
                          (uint8_t *)value_cache + block * vc_sb + r * vc_sr + h * vc_sh, row);
        }
    }
}

/* Positions t .. of a sequence of n that lie in the block holding position t (t is a block start). */
static inline int64_t rows_in_block(int64_t n, int64_t t, int64_t block_size) {
    return n - t < block_size ? n - t : block_size;
}

/* Positions ahead of the one being read whose key (and value) rows slot_attention prefetches, in whole
 * blocks (at least one) once the pass has started. */
#ifndef ATTN_AHEAD
#define ATTN_AHEAD 32
#endif

/* A query row's value rows up to this many bytes are prefetched with its keys, ahead of the pass over
 * the values, which then finds them in L2; a longer row's would be evicted before that pass reads
 * them, so that pass prefetches its own. */
#ifndef ATTN_V_EARLY_BYTES
#define ATTN_V_EARLY_BYTES (256 << 10)
#endif

/* The cache lines of bytes from row, into L2 (prefetcht1). Every prefetch of the attention goes to L2, none
 * to L1: on the AMD EPYC VM (Zen 4), prefetcht0 of the rows ahead held the core up (the L1's misses in
 * flight are few), and K and V streamed at 7.5 GB/s; into L2, at 13.5. Qwen3-0.6B's heads in bf16, caches
 * cold, one thread: 8 rows x 1,000 keys 4.51 -> 2.47 ms a layer, 1 x 4,000 2.31 -> 1.25 ms, 16 x 300
 * 2.59 -> 1.53 ms; the embedded model's 16 x 300 (fp32) 257 -> 209 us. Not measured on the Xeons. */
static inline __attribute__((always_inline)) void prefetch_bytes(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
}

/* Prefetch position t's row (its first bytes: rows with their heads packed) of a paged cache through the
 * block table: a block is the unit of contiguity in a paged cache, and a
 * decode step reads many short sequences' blocks scattered over the cache, which the hardware
 * prefetcher cannot guess across. Measured on the AMD EPYC VM, the embedded model's six layers of
 * decode attention (16 rows of 300 keys, fp32, each layer's cache cold): 400 us a layer rolling 4
 * positions ahead, 342 at 32 (two blocks of 16), 441 without prefetching. */
static inline __attribute__((always_inline)) void prefetch_row(const void *cache, const int32_t *blocks,
                                                               int64_t bt_s1, int64_t block_size, int64_t t,
                                                               int64_t sb, int64_t sr, int64_t bytes, int64_t elem) {
    const int64_t block = blocks[(t / block_size) * bt_s1], r = t % block_size;
    prefetch_bytes((const char *)cache + (block * sb + r * sr) * elem, bytes);
}

/* prefetch_row for positions from .. to - 1 that are below n (a pass's first blocks, at its start). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, const int32_t *blocks,
                                                                int64_t bt_s1, int64_t block_size, int64_t from,
                                                                int64_t to, int64_t n, int64_t sb, int64_t sr,
                                                                int64_t bytes, int64_t elem) {
    for (int64_t t = from; t < to && t < n; ++t) prefetch_row(cache, blocks, bt_s1, block_size, t, sb, sr, bytes, elem);
}

/* prefetch_row for kv head kh's rows (bytes each) of the block a pass reads `ahead` blocks after block b, the
 * one that starts at position t of n. Called once per kv head of the block being read, so the prefetches
 * are spread among the products (a block's whole rows at once filled the load queue with prefetches,
 * and the products waited behind them: a step's K and V streamed at ~8 GB/s against 12.8 the same
 * reads reach alone; benchmarks/README.md, "The decode row path's prefetches"). */
static inline __attribute__((always_inline)) void prefetch_head_ahead(const void *cache, const int32_t *blocks,
                                                                      int64_t bt_s1, int64_t block_size, int64_t b,
                                                                      int64_t t, int64_t n, int64_t ahead,
                                                                      int64_t sb, int64_t sr, int64_t head_at,
                                                                      int64_t bytes, int64_t elem) {
    const int64_t tf = t + ahead * block_size;
    if (tf >= n) return;
    const int64_t rows = rows_in_block(n, tf, block_size);
    const char *base = (const char *)cache + (blocks[(b + ahead) * bt_s1] * sb + head_at) * elem;
    for (int64_t r = 0; r < rows; ++r) prefetch_bytes(base + r * sr * elem, bytes);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512 paths for fp32 and bf16 caches with head_dim a multiple of 16 (every Qwen head dim). */

/* [sum(a0), sum(a1), sum(a2), sum(a3)] of four 16-lane vectors, by a shuffle network. */
static inline __attribute__((always_inline)) __m128 sum4_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* per 128-bit lane: t01 = [a0_0+a0_2, a1_0+a1_2, a0_1+a0_3, a1_1+a1_3], t23 likewise */
    const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    /* per lane: [a0, a1, a2, a3] partial sums */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* 16 elements of a cache row from element i, as fp32, exactly: kind 0 an fp32 row as it is, 1 a bf16
 * row widened, 3 / 4 an fp8 e4m3 / e5m2 row through fp16's bit pattern (fp8_to_f32; the fp16
 * conversion takes subnormals as they are). */
static inline __attribute__((always_inline)) __m512 cache16_ps(const void *row, int64_t i, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)row + i);
    if (kind == 1) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)((const uint8_t *)row + i)));
    if (kind == 4) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

/* Bytes per element of a cache16_ps kind. */
static inline int64_t kind_elem(int kind) { return kind == 0 ? 4 : kind == 1 ? 2 : 1; }

/* Lane L of the result: the sum of the 16 lanes of v[(L >> 2) + 4 * (L & 3)] (SUM16_SLOT(L)), by four
 * levels of shuffles and adds (256-, 128-, 64-, 32-bit halves): 45 operations for 16 sums. */
#define SUM16_SLOT(L) (((L) >> 2) + 4 * ((L) & 3))
static inline __attribute__((always_inline)) __m512 sum16_avx512(const __m512 *v) {
    __m512 r[8], s[4], t[2];
    for (int k = 0; k < 8; ++k)       /* r[k]: v[2k]'s 8 partial sums, then v[2k + 1]'s */
        r[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int m = 0; m < 4; ++m)       /* quarter i of s[m]: v[4m + i]'s 4 partial sums */
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * m], r[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * m], r[2 * m + 1], 0xDD));
    for (int n = 0; n < 2; ++n) {     /* quarter i of t[n]: v[8n + i]'s 2 partial sums, then v[8n + 4 + i]'s */
        const __m512d x = _mm512_castps_pd(s[2 * n]), y = _mm512_castps_pd(s[2 * n + 1]);
        t[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of GB query heads (q: the first one's row, heads D = 16 NV apart) against KB = 16 / GB key rows
 * of one block at once (k: the first row, rows sr bytes apart), of which the first m (<= KB) are keys:
 * the rest repeat the last key and are not stored. Written to scores[g * ld + j], j < m. Each key row is
 * read (and widened) once for the GB heads; the 16 (head, key) dot products, each one FMA chain,
 * are summed together (sum16_avx512) instead of one shuffle network per product. */
static inline __attribute__((always_inline)) void score_tile_avx512(const float *q, const char *k, int64_t sr,
                                                                    int kind, float *scores, int64_t ld, int m,
                                                                    const int NV, const int GB) {
    const int KB = 16 / GB;
    const char *row[16];
    for (int j = 0; j < KB; ++j) row[j] = k + (j < m ? j : m - 1) * sr;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < NV; ++c)
#pragma GCC unroll 16
        for (int j = 0; j < KB; ++j) {
            const __m512 kv = cache16_ps(row[j], 16 * c, kind);
#pragma GCC unroll 16
            for (int g = 0; g < GB; ++g)
                acc[SUM16_SLOT(g * KB + j)] =
                    _mm512_fmadd_ps(_mm512_loadu_ps(q + (g * NV + c) * 16), kv, acc[SUM16_SLOT(g * KB + j)]);
        }
    const __m512 s = sum16_avx512(acc);      /* lane g KB + j: head g, key j */
    const __mmask16 keys = (__mmask16)((1u << m) - 1u);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    _mm512_mask_storeu_ps(scores, keys, s);
    for (int g = 1; g < GB; ++g)   /* head g's lanes moved down to lane 0 (a lane index: no immediate needed) */
        _mm512_mask_storeu_ps(scores + g * ld, keys,
                              _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(g * KB)), s));
}

/* score_tile_avx512 over the rows rows of one block, with NV (D / 16) and GB as constants where they are
 * 2, 4, 8 or 16 and 1, 2, 4, 8 or 16. */
static inline __attribute__((always_inline)) void score_block_nv(const float *q, const char *k, int64_t sr, int kind,
                                                                 float *scores, int64_t ld, int64_t rows, const int NV,
                                                                 int GB) {
#define SCORE_TILES(G_)                                                                                   \
    for (int64_t r = 0; r < rows; r += 16 / (G_))                                                     \
        score_tile_avx512(q, k + r * sr, sr, kind, scores + r, ld,                                     \
                          (int)(rows - r < 16 / (G_) ? rows - r : 16 / (G_)), NV, (G_));              \
    return;
    switch (GB) {
        case 1: SCORE_TILES(1)
        case 2: SCORE_TILES(2)
        case 4: SCORE_TILES(4)
        case 8: SCORE_TILES(8)
        default: SCORE_TILES(16)
    }
#undef SCORE_TILES
}

/* scores[g * ld + r] = q_g . k_r for the G query heads sharing one kv head (q: the first one's row) and the
 * rows rows of one block (k: the first, rows sr bytes apart), in head groups of 16, 8, 4, 2, 1. */
static void score_block_avx512(const float *q, const char *k, int64_t sr, int kind, int64_t D, int64_t G,
                               float *scores, int64_t ld, int64_t rows) {
    for (int64_t g0 = 0; g0 < G;) {
        int GB = 16;
        while (GB > G - g0) GB /= 2;
        const float *qg = q + g0 * D;
        float *sg = scores + g0 * ld;
        switch (D) {
            case 32: score_block_nv(qg, k, sr, kind, sg, ld, rows, 2, GB); break;
            case 64: score_block_nv(qg, k, sr, kind, sg, ld, rows, 4, GB); break;
            case 128: score_block_nv(qg, k, sr, kind, sg, ld, rows, 8, GB); break;
            case 256: score_block_nv(qg, k, sr, kind, sg, ld, rows, 16, GB); break;
            default: score_block_nv(qg, k, sr, kind, sg, ld, rows, (int)(D / 16), GB); break;
        }
        g0 += GB;
    }
}

/* out[g * D ..] += sum_r p[g * ld + r] v_r over the rows rows of one block (v: the first row of this kv
 * head, rows sr bytes apart), for GB heads sharing the kv head, from a cache16_ps kind of cache: each
 * value row is read (and widened) once for the GB heads; the GB * NV (<= 16) accumulators are
 * registers for the block. */
static inline __attribute__((always_inline)) void wsum_tile_avx512(float *out, const float *p, int64_t ld,
                                                                   const char *v, int64_t sr, int64_t rows, int kind,
                                                                   const int NV, const int GB) {
    __m512 acc[16];
    for (int g = 0; g < GB; ++g)
        for (int c = 0; c < NV; ++c) acc[g * NV + c] = _mm512_loadu_ps(out + (g * NV + c) * 16);
    for (int64_t r = 0; r < rows; ++r) {
        __m512 pt[16];
#pragma GCC unroll 16
        for (int g = 0; g < GB; ++g) pt[g] = _mm512_set1_ps(p[g * ld + r]);
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) {
            const __m512 vc = cache16_ps(v + r * sr, 16 * c, kind);
#pragma GCC unroll 16
            for (int g = 0; g < GB; ++g) acc[g * NV + c] = _mm512_fmadd_ps(pt[g], vc, acc[g * NV + c]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + (g * NV + c) * 16, acc[g * NV + c]);
}

/* wsum_tile_avx512 for the G heads of one kv head (out: their G rows of D, p: their G score rows ld
 * apart, from the block's first position) over one block, in groups of up to 16 / NV heads. */
static inline __attribute__((always_inline)) void wsum_block_nv(float *out, const float *p, int64_t ld, const char *v,
                                                                int64_t sr, int64_t rows, int kind, int64_t G,
                                                                const int NV) {
    const int most = NV >= 16 ? 1 : 16 / NV;
    for (int64_t g0 = 0; g0 < G;) {
        int GB = most < 8 ? most : 8;
        while (GB > G - g0) GB /= 2;
        float *o = out + g0 * NV * 16;
        const float *pg = p + g0 * ld;
        /* (the NV conditions are constants: no instance with more than 16 accumulators) */
        if (GB == 8 && NV <= 2)
            wsum_tile_avx512(o, pg, ld, v, sr, rows, kind, NV, 8);
        else if (GB == 4 && NV <= 4)
            wsum_tile_avx512(o, pg, ld, v, sr, rows, kind, NV, 4);
        else if (GB == 2 && NV <= 8)
            wsum_tile_avx512(o, pg, ld, v, sr, rows, kind, NV, 2);
        else
            wsum_tile_avx512(o, pg, ld, v, sr, rows, kind, NV, 1);
        g0 += GB;
    }
}

/* out[g * D ..] += sum_r p[g * ld + r] v_r for the G query heads of one kv head over the rows rows of one
 * block (v: the first row of the kv head, rows sr bytes apart); head dims of 16s, constant for 32 .. 256. */
static void wsum_block_avx512(float *out, const float *p, int64_t ld, const char *v, int64_t sr, int64_t rows,
                              int kind, int64_t D, int64_t G) {
    switch (D) {   /* constant trip counts: the accumulators are registers */
        case 32: wsum_block_nv(out, p, ld, v, sr, rows, kind, G, 2); return;
        case 64: wsum_block_nv(out, p, ld, v, sr, rows, kind, G, 4); return;
        case 128: wsum_block_nv(out, p, ld, v, sr, rows, kind, G, 8); return;
        case 256: wsum_block_nv(out, p, ld, v, sr, rows, kind, G, 16); return;
        default: break;
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
            const __m512 pt = _mm512_set1_ps(p[g * ld + r]);
            for (int64_t c = 0; c < D; c += 16)
                _mm512_storeu_ps(out + g * D + c, _mm512_fmadd_ps(pt, cache16_ps(v + r * sr, c, kind),
                                                                  _mm512_loadu_ps(out + g * D + c)));
        }
}
#define QWEN_AVX512 1
#else
#define QWEN_AVX512 0
#endif

/* One head's row of a cache as fp32: in place for fp32 caches, converted into buf otherwise. */
static inline const float *cache_row(const void *cache, int64_t offset, int dtype, int64_t D, float *buf) {
    if (dtype == 0) return (const float *)cache + offset;
    load_row(cache, offset, dtype, D, buf);
    return buf;
}

/* The arguments of slot_attention that every query row shares (attend_row below). */
typedef struct {
    const void *query, *key_cache, *value_cache, *gate;
    void *out;
    const int32_t *block_table;
    int64_t H, G, D, num_kv_heads, block_size, max_len, q_s0, q_s1, g_s0, g_s1;
    int64_t k_sb, k_sr, k_sh, v_sb, v_sr, v_sh, bt_s1;
    int dtype;       /* the query's, gate's and output's */
    float scale;     /* times k_scale for an fp8 cache */
    int kv_dtype;    /* the caches': dtype, or 3 / 4 (fp8) */
    float v_scale;   /* 1, or an fp8 cache's value scale */
} attn_args;

/* One query row (token, over keys 0 .. n - 1 of the slot whose block-table row is blocks) for the
 * query heads of kv heads kh0 .. kh1 - 1. scratch: scores [H][max_len], q [H][D], acc [H][D] and one
 * converted row [D], of which the row touches only its heads' parts.
 *
 * One pass over the keys, a block at a time, computes the scores of those heads (score_block_avx512:
 * tiles of keys x the query heads of a kv head, each key row read once per tile), a softmax per head,
 * then one pass over the values, a block at a time (wsum_block_avx512: each value row read once per group
 * of heads). */
static void attend_row(const attn_args *a, int64_t token, int64_t n, const int32_t *blocks, int64_t kh0, int64_t kh1,
                       float *scratch) {
    const int64_t H = a->H, G = a->G, D = a->D, max_len = a->max_len, dtype = a->dtype, kvd = a->kv_dtype;
    const int64_t elem = dtype_elem((int)kvd), h0 = kh0 * G, h1 = kh1 * G;
    float *scores = scratch, *q = scores + H * max_len, *acc = q + H * D, *row = acc + H * D;
#if QWEN_AVX512
    /* fp32, bf16 and fp8 caches, head dims of 16s: vector dot products and weighted sums on the rows as
     * stored (bf16 = cache16_ps's kind) */
    const int fast = kvd != 1 && D % 16 == 0, bf16 = kvd == 2 ? 1 : (int)kvd;
#endif
    for (int64_t h = h0; h < h1; ++h) {
        load_row(a->query, token * a->q_s0 + h * a->q_s1, (int)dtype, D, q + h * D);
        for (int64_t d = 0; d < D; ++d) q[h * D + d] *= a->scale;
    }
    /* scores[h][t] = q_h . k_t, with these heads' key rows of the block(s) ATTN_AHEAD ahead prefetched, and
     * their value rows too while the row's values are few (ATTN_V_EARLY_BYTES; else the pass over
     * the values prefetches them): in a model step the caches come from DRAM */
    const int64_t head_bytes = (kh1 - kh0) * D * elem;
    const void *kc = (const char *)a->key_cache + kh0 * a->k_sh * elem;
    const void *vc = (const char *)a->value_cache + kh0 * a->v_sh * elem;
    const int v_early = n * head_bytes <= ATTN_V_EARLY_BYTES;
    const int64_t ahead = ATTN_AHEAD / a->block_size > 0 ? ATTN_AHEAD / a->block_size : 1;   /* blocks */
    prefetch_rows(kc, blocks, a->bt_s1, a->block_size, 0, ahead * a->block_size, n, a->k_sb, a->k_sr, head_bytes,
                  elem);
    if (v_early)
        prefetch_rows(vc, blocks, a->bt_s1, a->block_size, 0, ahead * a->block_size, n, a->v_sb, a->v_sr, head_bytes,
                      elem);
    for (int64_t t = 0, b = 0; t < n; ++b) {       /* block by block: no division per key */
        const int64_t block = blocks[b * a->bt_s1];
        const int64_t rows = rows_in_block(n, t, a->block_size);
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            const int64_t at = block * a->k_sb + kh * a->k_sh;
            prefetch_head_ahead(a->key_cache, blocks, a->bt_s1, a->block_size, b, t, n, ahead, a->k_sb, a->k_sr,
                                kh * a->k_sh, D * elem, elem);
            if (v_early)
                prefetch_head_ahead(a->value_cache, blocks, a->bt_s1, a->block_size, b, t, n, ahead, a->v_sb,
                                    a->v_sr, kh * a->v_sh, D * elem, elem);
#if QWEN_AVX512
            if (fast) {       /* the block's rows at once */
                score_block_avx512(q + kh * G * D, (const char *)a->key_cache + at * elem, a->k_sr * elem, bf16, D, G,
                                   scores + kh * G * max_len + t, max_len, rows);
                continue;
            }
#endif
            for (int64_t r = 0; r < rows; ++r) {
                const float *k = cache_row(a->key_cache, at + r * a->k_sr, (int)kvd, D, row);
                for (int64_t g = 0; g < G; ++g)
                    scores[(kh * G + g) * max_len + t + r] = dot(q + (kh * G + g) * D, k, D);
            }
        }
        t += rows;
    }
    /* softmax per head, in place */
    for (int64_t h = h0; h < h1; ++h) {
        float *sh = scores + h * max_len;
        float m = sh[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < n; ++t) m = sh[t] > m ? sh[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
            const float e = exp_nonpositive(sh[t] - m);
            sh[t] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
    }
    /* acc[h] = sum_t p[h][t] v_t, block by block as the keys (each block's rows of these heads read once),
     * prefetching the value rows of the block(s) ATTN_AHEAD ahead unless the pass over the keys did */
    memset(acc + h0 * D, 0, sizeof(float) * (size_t)((h1 - h0) * D));
    if (!v_early)
        prefetch_rows(vc, blocks, a->bt_s1, a->block_size, 0, ahead * a->block_size, n, a->v_sb, a->v_sr, head_bytes,
                      elem);
    for (int64_t t = 0, b = 0; t < n; ++b) {
        const int64_t block = blocks[b * a->bt_s1];
        const int64_t rows = rows_in_block(n, t, a->block_size);
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            const int64_t at = block * a->v_sb + kh * a->v_sh;
            if (!v_early)
                prefetch_head_ahead(a->value_cache, blocks, a->bt_s1, a->block_size, b, t, n, ahead, a->v_sb,
                                    a->v_sr, kh * a->v_sh, D * elem, elem);
#if QWEN_AVX512
            if (fast) {
                wsum_block_avx512(acc + kh * G * D, scores + kh * G * max_len + t, max_len,
                                  (const char *)a->value_cache + at * elem, a->v_sr * elem, rows, bf16, D, G);
                continue;
            }
#endif
            for (int64_t r = 0; r < rows; ++r) {
                const float *v = cache_row(a->value_cache, at + r * a->v_sr, (int)kvd, D, row);
                for (int64_t g = 0; g < G; ++g)
                    axpy(acc + (kh * G + g) * D, scores[(kh * G + g) * max_len + t + r], v, D);
            }
        }
        t += rows;
    }
    for (int64_t h = h0; h < h1; ++h) {
        float *o = acc + h * D;
        if (a->v_scale != 1.0f)
            for (int64_t d = 0; d < D; ++d) o[d] *= a->v_scale;
        if (a->gate != NULL) {
            load_row(a->gate, token * a->g_s0 + h * a->g_s1, (int)dtype, D, row);
            for (int64_t d = 0; d < D; ++d) o[d] *= 1.0f / (1.0f + expf(-row[d]));
        }
        store_row(a->out, (token * H + h) * D, (int)dtype, D, o);
    }
}

/* The flash path for sequences with many query rows (qwen_cpu_flash.c, included at the end of this file). */
static int flash_takes(const attn_args *a, int64_t q_len);
static int flash_run(const attn_args *a, const int32_t *seq_slots, const int32_t *query_start_loc,
                     const int32_t *seq_lens, int64_t num_seqs, int64_t bt_s0, int64_t threads);
static int flash_run_fp8(const attn_args *a, const int32_t *seq_slots, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int64_t num_seqs, int64_t bt_s0, int64_t threads);

/* Keys (positions x kv heads) below which slot_attention stays on one thread: the second thread's
 * start costs more than it saves there. */
#ifndef ATTN_PARALLEL_MIN
#define ATTN_PARALLEL_MIN 128
#endif

/* Causal GQA attention of each sequence's query rows over its slot's paged keys and values.
 * out is contiguous [num_tokens, num_heads, head_dim] in the query dtype. Returns 0, or -1 when
 * scratch memory could not be allocated (nothing is then written).
 *
 * The work is query rows x ranges of kv heads (attend_row), split over threads (torch's intra-op
 * count): a lone decode row is split by kv heads, so each thread reads its heads' part of every
 * cache row; with as many rows as threads or more, each row is one piece. Each piece writes only
 * its own heads of its own row, so the threads' results are the one-thread loop's, bit for bit. */
int qwen_slot_attention(const void *query, void *out, const void *key_cache, const void *value_cache,
                        const int32_t *block_table, const int32_t *seq_slots, const int32_t *query_start_loc,
                        const int32_t *seq_lens, const void *gate,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int dtype, float scale,
                        int64_t q_s0, int64_t q_s1, int64_t g_s0, int64_t g_s1,
                        int64_t k_sb, int64_t k_sr, int64_t k_sh, int64_t v_sb, int64_t v_sr, int64_t v_sh,
                        int64_t bt_s0, int64_t bt_s1, int64_t threads, int kv_dtype, float k_scale, float v_scale) {
    const int64_t H = num_heads, D = head_dim;
    const int64_t elem = dtype_elem(dtype);
    const int fp8 = kv_dtype >= 3;
    const attn_args a = {query, key_cache, value_cache, gate, out, block_table, H, num_heads / num_kv_heads, D,
                         num_kv_heads, block_size, 1, q_s0, q_s1, g_s0, g_s1, k_sb, k_sr, k_sh, v_sb, v_sr, v_sh,
                         bt_s1, dtype, fp8 ? scale * k_scale : scale, fp8 ? kv_dtype : dtype, fp8 ? v_scale : 1.0f};
    /* sequences with many query rows: the flash path (an fp8 cache's pages widened first); the others row
     * by row below */
    if ((fp8 ? flash_run_fp8 : flash_run)(&a, seq_slots, query_start_loc, seq_lens, num_seqs, bt_s0, threads) != 0)
        return -1;
    int64_t max_len = 1, rows = 0, keys = 0;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_slots[i] >= 0 && !flash_takes(&a, query_start_loc[i + 1] - query_start_loc[i])) {
            const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
            if (seq_lens[i] > max_len) max_len = seq_lens[i];
            rows += q_len;
            keys += q_len * seq_lens[i];
        }
    if (threads < 1) threads = 1;
    if (keys * num_kv_heads < ATTN_PARALLEL_MIN) threads = 1;
    /* pieces of a row: kv-head ranges when rows are fewer than threads */
    const int64_t chunks = rows < threads ? (threads < num_kv_heads ? threads : num_kv_heads) : 1;
    const int64_t pieces = rows * chunks;
    if (threads > pieces) threads = pieces > 0 ? pieces : 1;
    /* per thread: scores [H][max_len], q [H][D], acc [H][D], one converted row [D]; then per row:
     * its token, key count and slot */
    const size_t per_thread = (size_t)(H * max_len + 2 * H * D + D);
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)threads +
                                     sizeof(int64_t) * 3 * (size_t)(rows > 0 ? rows : 1));
    if (scratch == NULL) return -1;
    int64_t *row_token = (int64_t *)(void *)(scratch + per_thread * (size_t)threads);
    int64_t *row_n = row_token + rows, *row_slot = row_n + rows;
    for (int64_t i = 0, at = 0; i < num_seqs; ++i) {
        const int64_t start = query_start_loc[i], end = query_start_loc[i + 1];
        const int32_t slot = seq_slots[i];
        if (slot < 0) {
            memset((char *)out + start * H * D * elem, 0, (size_t)((end - start) * H * D * elem));
            continue;
        }
        if (flash_takes(&a, end - start)) continue;
        for (int64_t j = 0; j < end - start; ++j, ++at) {
            row_token[at] = start + j;
            row_n[at] = seq_lens[i] - (end - start) + j + 1;        /* keys 0 .. position of this row */
            row_slot[at] = slot;
        }
    }
    attn_args ar = a;
    ar.max_len = max_len;
#pragma omp parallel num_threads((int)threads) if (threads > 1)
    {
#ifdef _OPENMP
        float *mine = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *mine = scratch;
#endif
#pragma omp for schedule(static)
        for (int64_t w = 0; w < pieces; ++w) {
            const int64_t r = w / chunks, c = w % chunks;
            attend_row(&ar, row_token[r], row_n[r], block_table + row_slot[r] * bt_s0, num_kv_heads * c / chunks,
                       num_kv_heads * (c + 1) / chunks, mine);
        }
    }
    free(scratch);
    return 0;
}

/* out[r] = the index of the first maximum of row r (the first NaN if the row has one), as
 * torch.argmax: a vectorized max, then a vectorized search for its first position. */
void qwen_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t s0, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * s0;
        float m = row[0];
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < cols; ++i) {
            m = row[i] > m ? row[i] : m;
            nan |= row[i] != row[i];
        }
        int64_t idx = cols;
        if (nan) {
            for (int64_t i = 0; i < cols; ++i)
                if (row[i] != row[i]) {
                    idx = i;
                    break;
                }
        } else {
#pragma omp simd reduction(min : idx)
            for (int64_t i = 0; i < cols; ++i) {
                const int64_t c = row[i] == m ? i : cols;
                idx = c < idx ? c : idx;
            }
        }
        out[r] = idx;
    }
}

/* The bucket, from the highest down, whose mass carries the running sum *before past limit; the
 * masses of the buckets above it are added to *before. Rounding aside one always does (the caller's
 * buckets hold more than limit - *before); else the lowest non-empty bucket. */
static int top_p_crossing(const double *mass, const int32_t *count, int buckets, double limit, double *before) {
    int lowest = 0;
    for (int b = buckets - 1; b >= 0; --b) {
        if (count[b] == 0) continue;
        if (*before + mass[b] > limit) return b;
        *before += mass[b];
        lowest = b;
    }
    *before -= mass[lowest];
    return lowest;
}

/* Top-p over weights w[0 .. cols) (>= 0, not normalized, total their float64 sum): the tokens in
 * order of weight (ties: lower token first) are kept while the mass strictly before them is at most
 * p x total, so the token that crosses p stays. Zeroes the weights of the others in place; returns 0,
 * or -1 when memory ran out. No sort: the weights' bits (monotone in
 * the value for non-negative floats) are read 11, 11 and 9 at a time; each level's histogram of masses
 * finds the bucket the cut falls in, the next level looks inside that bucket only, and the last one
 * names the cut's value exactly; its ties are taken in token order. */
static int top_p_cut(float *w, int64_t cols, double total, double p) {
    const double limit = p * total;
    double mass[2048], part[4][2048];
    int32_t count[2048];
    /* level 1 in four histograms (tokens t mod 4): runs of tokens in one bucket do not wait on each
     * other's sums */
    memset(part, 0, sizeof part);
    const uint32_t *wb = (const uint32_t *)(const void *)w;
    int64_t t0 = 0;
    for (; t0 + 4 <= cols; t0 += 4)
        for (int j = 0; j < 4; ++j) part[j][wb[t0 + j] >> 20] += (double)w[t0 + j];
    for (; t0 < cols; ++t0) part[0][wb[t0] >> 20] += (double)w[t0];
    for (int b = 0; b < 2048; ++b) {
        mass[b] = (part[0][b] + part[1][b]) + (part[2][b] + part[3][b]);
        count[b] = mass[b] > 0.0;   /* zero-mass buckets hold nothing the cut could keep */
    }
    double before = 0.0;   /* the mass of the tokens above the current bucket */
    const int b1 = top_p_crossing(mass, count, 2048, limit, &before);
    if (b1 == 0) return 0;   /* the cut is among zeros and subnormals: keep every weight */
    int32_t n = 0;
#pragma omp simd reduction(+ : n)
    for (int64_t t = 0; t < cols; ++t) n += (int)(wb[t] >> 20) == b1;
    /* the bucket's bits, then its tokens (one slot more: every token is written, the bucket's kept) */
    uint32_t *bits1 = malloc(sizeof(uint32_t) * 2 * (size_t)(n + 1));
    if (bits1 == NULL) return -1;
    uint32_t *tok1 = bits1 + n + 1;
    int32_t k = 0;
    for (int64_t t = 0; t < cols && k < n; ++t) {   /* no branch on the bucket: it would mispredict */
        uint32_t bits;
        memcpy(&bits, &w[t], 4);
        bits1[k] = bits;
        tok1[k] = (uint32_t)t;
        k += (int)(bits >> 20) == b1;
    }
    memset(mass, 0, sizeof mass);
    memset(count, 0, sizeof count);
    for (int32_t i = 0; i < n; ++i) {
        float v;
        memcpy(&v, &bits1[i], 4);
        mass[(bits1[i] >> 9) & 2047] += (double)v;
        count[(bits1[i] >> 9) & 2047] += 1;
    }
    const int b2 = top_p_crossing(mass, count, 2048, limit, &before);
    memset(mass, 0, sizeof(double) * 512);
    memset(count, 0, sizeof(int32_t) * 512);
    for (int32_t i = 0; i < n; ++i) {
        if ((int)((bits1[i] >> 9) & 2047) != b2) continue;
        float v;
        memcpy(&v, &bits1[i], 4);
        mass[bits1[i] & 511] += (double)v;
        count[bits1[i] & 511] += 1;
    }
    const int b3 = top_p_crossing(mass, count, 512, limit, &before);
    const uint32_t cut_bits = ((uint32_t)b1 << 20) | ((uint32_t)b2 << 9) | (uint32_t)b3;
    float cut_w;
    memcpy(&cut_w, &cut_bits, 4);
    /* the ties at the cut's value, in token order: kept while the mass before them is at most limit
     * (the first always: the mass above the value is) */
    int64_t cut_t = -1;
    double run = before;
    for (int32_t i = 0; i < n && run <= limit; ++i)
        if (bits1[i] == cut_bits) {
            cut_t = tok1[i];
            run += (double)cut_w;
        }
    free(bits1);
#pragma omp simd
    for (int64_t t = 0; t < cols; ++t) w[t] = (w[t] > cut_w) | ((w[t] == cut_w) & (t <= cut_t)) ? w[t] : 0.0f;
    return 0;
}

/* bsum[b] = the float64 sum of w's block b of `block` weights; returns their total. */
static double block_sums(const float *w, int64_t cols, int64_t block, double *bsum) {
    double total = 0.0;
    for (int64_t b = 0; b * block < cols; ++b) {
        const int64_t hi = (b + 1) * block < cols ? (b + 1) * block : cols;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = b * block; t < hi; ++t)
            sum += (double)w[t];
        bsum[b] = sum;
        total += sum;
    }
    return total;
}

/* The sampler's distribution and its pick (engine/sampling.py: the one implementation of temperature,
 * softmax and top-p; min-p and top-k arrive as a floor per row, the logit they keep down to):
 * w_t = exp(x_t / T - max), 0 where x_t < floor[r] (floor NULL: none) or where that exponent is
 * below -87 (so a -inf logit is never picked), then, where top_p[r] < 1, the tokens past
 * its cut zeroed (top_p_cut); summed in float64 per block of 64; out[r] is the first t whose float64
 * running sum passes u[r] times the total (u[r] in [0, 1)): the blocks' sums find the block, a walk
 * inside it the token (the last positive one of the block if rounding leaves the walk short). -1
 * where a row has no finite maximum or a NaN (nothing can be sampled); -2 when memory ran out.
 * w: cols floats of scratch (ws0 = 0), or rows rows of ws0 >= cols floats that keep each row's
 * weights (zero for a -1 row); u NULL: no pick (out[r] 0 for a row with weights). bsum: ceil(cols / 64)
 * doubles. */
void qwen_sample_rows(const float *x, int64_t rows, int64_t cols, int64_t s0, const float *temps, const float *floor,
                      const double *top_p, const double *u, int64_t *out, float *weights, int64_t ws0, double *bsum) {
    enum { BLOCK = 64 };
    const int64_t nb = (cols + BLOCK - 1) / BLOCK;
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * s0;
        float *w = weights + r * ws0;
        const float temp = temps[r];
        float m = -__builtin_inff();
        const float *s = row;                         /* x / T: the row itself at T = 1 */
        if (temp == 1.0f) {
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < cols; ++t) m = row[t] > m ? row[t] : m;
        } else {
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < cols; ++t) {
                w[t] = row[t] / temp;
                m = w[t] > m ? w[t] : m;
            }
            s = w;
        }
        out[r] = -1;
        if (!(m > -__builtin_inff()) || m == __builtin_inff()) {
            if (ws0)
                memset(w, 0, sizeof(float) * (size_t)cols);
            continue;
        }
        const float fl = floor != NULL ? floor[r] : -__builtin_inff();
#pragma omp simd
        for (int64_t t = 0; t < cols; ++t) {
            const float d = s[t] - m;
            const float e = exp_nonpositive(d);
            w[t] = d < -87.0f || row[t] < fl ? 0.0f : e;
        }
        double total = block_sums(w, cols, BLOCK, bsum);
        if (!(total > 0.0)) {                         /* NaN */
            if (ws0)
                memset(w, 0, sizeof(float) * (size_t)cols);
            continue;
        }
        if (top_p[r] < 1.0) {
            if (top_p_cut(w, cols, total, top_p[r]) < 0) {
                out[r] = -2;
                continue;
            }
            total = block_sums(w, cols, BLOCK, bsum);   /* over the kept weights */
        }
        if (u == NULL) {
            out[r] = 0;
            continue;
        }
        const double target = u[r] * total;
        double run = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
            if (!(run + bsum[b] > target)) {
                run += bsum[b];
                continue;
            }
            const int64_t lo = b * BLOCK, hi = (b + 1) * BLOCK < cols ? (b + 1) * BLOCK : cols;
            for (int64_t t = lo; t < hi && out[r] < 0; ++t) {
                run += (double)w[t];
                if (run > target)
                    out[r] = t;
            }
            for (int64_t t = hi - 1; t >= lo && out[r] < 0; --t)
                if (w[t] > 0.0f)
                    out[r] = t;
            break;
        }
    }
}

/* Structured outputs: rows[r] of logits [*, cols] (row stride s0) keep the tokens whose bit is set
 * in mask[r] (int32 words, bit b of word w = token 32 w + b, words_per_row words); every other
 * token, and every token past the mask's bits, becomes -inf. A word of all ones (allowed) is
 * skipped and one of zeros (the common case: a grammar allows few tokens) is a plain fill. */
void qwen_apply_token_bitmask(float *logits, int64_t s0, int64_t cols, const int32_t *mask, int64_t words_per_row,
                              const int64_t *rows, int64_t nrows) {
    const float ninf = -__builtin_inff();
    for (int64_t r = 0; r < nrows; ++r) {
        float *row = logits + rows[r] * s0;
        const uint32_t *m = (const uint32_t *)(mask + r * words_per_row);
        int64_t covered = words_per_row * 32 < cols ? words_per_row * 32 : cols;
        for (int64_t w = 0; w * 32 < covered; ++w) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu)
                continue;
            float *dst = row + w * 32;
            const int64_t n = covered - w * 32 < 32 ? covered - w * 32 : 32;
            if (bits == 0) {
                for (int64_t b = 0; b < n; ++b)
                    dst[b] = ninf;
                continue;
            }
            for (int64_t b = 0; b < n; ++b)
                dst[b] = (bits >> b) & 1u ? dst[b] : ninf;
        }
        for (int64_t c = covered; c < cols; ++c)
            row[c] = ninf;
    }
}

/* exp(x) for any float x (clamped to [-87, 88]): exp_nonpositive's reduction, which is valid on
 * both sides of zero. */
static inline float exp_any(float x) {
    x = x > 88.0f ? 88.0f : x;
    return exp_nonpositive(x);
}

/* silu(g) = g / (1 + exp(-g)); below -88, where exp(-g) passes fp32's range (exp_any clamps it, which
 * would leave g / e^88, e.g. -2 for g = -3e38), -0: the true value is under 1.3e-36 in magnitude. */
static inline float silu_of(float g) { return g < -88.0f ? -0.0f : g / (1.0f + exp_any(-g)); }

/* out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up over rows of dim (the gated MLP);
 * silu rounded before the product, as F.silu(gate) * up rounds it: to fp32, and with bf16 != 0
 * also to bf16 (both results), as torch's bf16 ops compute in fp32 and round each result. */
static void silu_mul_rows(const float *gate, int64_t g_s0, const float *up, int64_t u_s0, float *out, int64_t rows,
                          int64_t dim, int bf16) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate + r * g_s0, *u = up + r * u_s0;
        float *o = out + r * dim;
        if (bf16) {
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) o[i] = round_bf16(round_bf16(silu_of(g[i])) * u[i]);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) {
                const float silu = silu_of(g[i]);
                o[i] = silu * u[i];
            }
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * Fused pieces of a dense Qwen decoder layer, where each torch op costs microseconds of
 * dispatch: RMSNorm (optionally after a residual add) replaces ~9 ops, q/k RMSNorm + RoPE ~34
 * per layer. Same math as qwen_ops/models/layers.py (mean square in
 * fp32, x * rsqrt(ms + eps) then * weight; RoPE halves: x1 cos - x2 sin, x2 cos + x1 sin);
 * summation order differs from torch's, so results agree to fp32 rounding.
 * ---------------------------------------------------------------------------------------------- */

/* Each product and sum rounded on its own, as torch's separate mul/sub/add ops round them (GCC
 * would otherwise contract a * b - c * d into fused multiply-adds). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

/* 1 / sqrt(mean(x^2) + eps). With AVX-512 the squares are summed in one fixed order (16 lanes, four
 * accumulators taking 16-element groups in turn, then a fixed reduction), so that every caller gets the
 * same bits wherever the compiler inlines it (a vectorized `omp simd` reduction may order its sums
 * differently in different callers). */
#if QWEN_AVX512
/* inv_rms's end: 1 / rms of a row of dim from its four accumulators of squares (vector i of the row added
 * into acc[i % 4]), summed in one fixed order; norm_rope_bf16_head accumulates its registers the same way,
 * so both give the same bits. */
static inline __attribute__((always_inline)) float inv_rms_of_squares(const __m512 acc[4], int64_t dim, float eps) {
    const float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    return 1.0f / sqrtf(ss / (float)dim + eps);
}
#endif

static inline float inv_rms(const float *x, int64_t dim, float eps) {
#if QWEN_AVX512
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 k = dim - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (dim - d)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + d);
        acc[(d / 16) % 4] = _mm512_add_ps(acc[(d / 16) % 4], _mm512_mul_ps(v, v));
    }
    return inv_rms_of_squares(acc, dim, eps);
#else
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < dim; ++d) ss += x[d] * x[d];
    return 1.0f / sqrtf(ss / (float)dim + eps);
#endif
}

/* out[r] = w * (s / rms(s)), s = x[r] + add[r] when add is given (s is then written to sum[r]),
 * else s = x[r]. Rows of dim floats, contiguous within the row. With bf16 != 0, the roundings of
 * a bf16 model (transformers' Qwen3RMSNorm on bf16 tensors): the sum s to bf16, s / rms(s) to
 * bf16, and w * that to bf16 (w holds bf16 values). */
static void rms_norm_rows(const float *x, int64_t x_s0, const float *add, int64_t add_s0, float *sum, int64_t sum_s0,
                          const float *w, float *out, int64_t out_s0, int64_t rows, int64_t dim, float eps, int bf16) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *s = x + r * x_s0;
        if (add != NULL) {
            float *dst = sum + r * sum_s0;
            const float *a = add + r * add_s0;
            if (bf16) {
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) dst[d] = round_bf16(s[d] + a[d]);
            } else {
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) dst[d] = s[d] + a[d];
            }
            s = dst;
        }
        const float inv = inv_rms(s, dim, eps);
        float *o = out + r * out_s0;
        if (bf16) {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) o[d] = round_bf16(w[d] * round_bf16(s[d] * inv));
        } else {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) o[d] = w[d] * (s[d] * inv);
        }
    }
}

/* One head row: optional RMSNorm (w != NULL), then RoPE with cs = [cos | sin] of the position.
 * bf16 != 0: every product, sum and the norm rounded to bf16 as torch's bf16 ops round them
 * (cs then holds the bf16 table, as the model casts cos and sin to its dtype). */
static inline void norm_rope_row(const float *x, const float *w, float eps, const float *cs, int64_t D,
                                 float *tmp, float *out, int bf16) {
    const int64_t half = D / 2;
    if (w != NULL) {
        const float inv = inv_rms(x, D, eps);
        if (bf16)
            for (int64_t d = 0; d < D; ++d) tmp[d] = round_bf16(w[d] * round_bf16(x[d] * inv));
        else
            for (int64_t d = 0; d < D; ++d) tmp[d] = w[d] * (x[d] * inv);
        x = tmp;
    }
    if (bf16) {
        for (int64_t i = 0; i < half; ++i) {
            const float c = cs[i], s = cs[half + i];
            const float x1 = x[i], x2 = x[half + i];
            const float a = round_bf16(x1 * c), b = round_bf16(x2 * s), e = round_bf16(x2 * c), f = round_bf16(x1 * s);
            out[i] = round_bf16(a - b);
            out[half + i] = round_bf16(e + f);
        }
        return;
    }
    for (int64_t i = 0; i < half; ++i) {
        const float c = cs[i], s = cs[half + i];
        const float x1 = x[i], x2 = x[half + i];
        const float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;   /* rounded products, as torch */
        out[i] = a - b;
        out[half + i] = e + f;
    }
}

/* q [T, nq, D], k [T, nk, D] (strides in elements, rows contiguous) -> contiguous qo, ko:
 * per head RMSNorm with q_w / k_w (skipped when NULL), then RoPE at positions[t] from the fp32
 * table [max_pos, D] (cos in the first half of a row, sin in the second); bf16 as norm_rope_row. */
static void qk_norm_rope_rows(const float *q, int64_t q_s0, int64_t q_s1, int64_t nq,
                              const float *k, int64_t k_s0, int64_t k_s1, int64_t nk,
                              const float *q_w, const float *k_w, float eps,
                              const float *table, int64_t table_s0, const int32_t *positions,
                              float *qo, float *ko, int64_t T, int64_t D, float *tmp, int bf16) {
    for (int64_t t = 0; t < T; ++t) {
        const float *cs = table + (int64_t)positions[t] * table_s0;
        for (int64_t h = 0; h < nq; ++h)
            norm_rope_row(q + t * q_s0 + h * q_s1, q_w, eps, cs, D, tmp, qo + (t * nq + h) * D, bf16);
        for (int64_t h = 0; h < nk; ++h)
            norm_rope_row(k + t * k_s0 + h * k_s1, k_w, eps, cs, D, tmp, ko + (t * nk + h) * D, bf16);
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* ----------------------------------------------------------------------------------------------
 * Linear layers on packed weights (torch.ops.qwen.linear_packed).
 *
 * A decode step of a small model on one CPU core is a chain of matrix-vector products over
 * weights that live in the L2/L3 caches or stream from DRAM. qwen_linear_packed runs them on
 * weights packed once (the layer's process_weights_after_loading) into 32-feature panels: at 1
 * row it streams the weight at about 70 GB/s (MKL's sgemv on these AMD CPUs: about 25), at 16+
 * rows it runs at oneDNN's speed.
 * ---------------------------------------------------------------------------------------------- */

/* Linear layers on prepacked weights. A weight [N, K] is packed into panels of 32 output features,
 * k-major inside a panel: wp[(p * K + k) * 32 + j] = w[p * 32 + j, k], zero past N. One input row
 * element times one panel row updates 32 outputs with two vector FMAs, so there is no reduction
 * across lanes, and a block of MR input rows reuses each loaded panel row MR times. On 32-row
 * decode batches and 512-row prefill chunks of the embedded model this measured as fast as
 * oneDNN's prepacked products (186 vs 174 GFLOP/s at 32 rows, 241 vs 233 at 512). */
void qwen_pack_panels(const float *w, int64_t N, int64_t K, float *wp) {
    const int64_t P = (N + 31) / 32;
    for (int64_t p = 0; p < P; ++p)
        for (int64_t j = 0; j < 32; ++j) {   /* weight rows read in order; a panel (K x 128 B) stays cached */
            const int64_t n = p * 32 + j;
            float *dst = wp + p * K * 32 + j;
            if (n < N)
                for (int64_t k = 0; k < K; ++k) dst[k * 32] = w[n * K + k];
            else
                for (int64_t k = 0; k < K; ++k) dst[k * 32] = 0.0f;
        }
}

#define PANEL_MR 12   /* input rows per block: 24 accumulators + 2 panel vectors + 1 broadcast */
/* Up to this many input rows, two panels (64 features) are read side by side: two weight streams
 * and four independent FMA chains instead of two. At one row (decode) the products stream their
 * weights from DRAM, and this reads them faster (one core's prefetchers keep more lines in flight
 * over two streams); each output's summation order is unchanged. 4 rows: 16 accumulators. */
#ifndef PANEL_PAIR_MAX_ROWS
#define PANEL_PAIR_MAX_ROWS 4
#endif
/* The sum over k runs in blocks of PANEL_KB, each summed in registers, then added to the output:
 * one sequential fp32 chain over all of K would round K times in a row (max error 6x MKL's at
 * K = 3072, measured), blocks bound it by PANEL_KB + K / PANEL_KB. 256, not 128: the prefill
 * products (6 rows x 2 panels) reload and store their outputs half as often, 0.88x -> 0.92x of
 * oneDNN's prepacked GEMM at 256 rows (benchmarks/README.md); max error against a float64 sum
 * 0.93x MKL's at K = 3072 and 0.53x at K = 1024 (128: 0.57x and 0.40x). */
#define PANEL_KB 256
#define PANEL_WIDE_MR 6   /* rows per block on two panels: 24 accumulators, 4 weight vectors, 1 broadcast */
/* Bytes ahead of the weight being read that the panel kernels prefetch (two lines an iteration,
 * which reads two, per panel): a decode step streams its weights from DRAM once, and one core's
 * hardware prefetchers alone keep too few lines in flight (benchmarks/README.md, real-size figures). */
#ifndef PANEL_PREFETCH
#define PANEL_PREFETCH 4096
#endif
#if PANEL_PREFETCH > 0
#define PREFETCH_2_LINES(p)                                                           \
    do {                                                                              \
        _mm_prefetch((const char *)(p) + PANEL_PREFETCH, _MM_HINT_T0);                \
        _mm_prefetch((const char *)(p) + PANEL_PREFETCH + 64, _MM_HINT_T0);           \
    } while (0)
#else
#define PREFETCH_2_LINES(p) ((void)0)
#endif

/* CALL(r) for r = rows, a constant from 1 to PANEL_MR - 1 (so that accumulators stay registers). */
#define PANEL_ROWS_SWITCH(rows, CALL)                                                          \
    switch (rows) {                                                                            \
        case 11: CALL(11); break; case 10: CALL(10); break; case 9: CALL(9); break;            \
        case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break;                \
        case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break;                \
        case 2: CALL(2); break; case 1: CALL(1); break; default: break;                        \
    }

#if QWEN_AVX512
/* The valid lanes of a 16-feature group with n features left (all, some, or none). */
static inline __mmask16 lanes_left(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* The end of a k block of every panel kernel, over C = 2 * panels groups of 16 features: add
 * the earlier blocks' sums already in y (unless this is the first block), the bias after the last
 * block, and store y[m, 16 c ..] for m < MR (masked to the valid lanes). */
static inline __attribute__((always_inline)) void panel_store_avx512(__m512 acc[][4], int first, int last,
                                                                     const float *bias, float *y, int64_t ys,
                                                                     const __mmask16 *mask, const int MR,
                                                                     const int C) {
    for (int c = 0; c < C; ++c) {
        if (!first)
            for (int m = 0; m < MR; ++m)
                acc[m][c] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[c], y + m * ys + 16 * c), acc[m][c]);
        if (last && bias != NULL) {
            const __m512 b = _mm512_maskz_loadu_ps(mask[c], bias + 16 * c);
            for (int m = 0; m < MR; ++m) acc[m][c] = _mm512_add_ps(acc[m][c], b);
        }
        for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ys + 16 * c, mask[c], acc[m][c]);
    }
}

/* y[m, 0:cols] (+ bias) for m < MR against NP (1 or 2) consecutive panels; cols <= 32 NP. Only
 * the k blocks in [kb, ke) (kb a multiple of PANEL_KB): the sums of the blocks before kb are in y. */
static inline __attribute__((always_inline)) void panel_block_avx512(const float *x, int64_t xs, const float *wp,
                                                                     int64_t K, int64_t kb, int64_t ke,
                                                                     const float *bias, float *y, int64_t ys,
                                                                     int64_t cols, const int MR, const int NP,
                                                                     const int PF) {
    __mmask16 mask[4];
    for (int c = 0; c < 2 * NP; ++c) mask[c] = lanes_left(cols - 16 * c);
    __m512 acc[PANEL_MR][4];
    for (int64_t k0 = kb; k0 < ke; k0 += PANEL_KB) {
        const int64_t k1 = ke - k0 < PANEL_KB ? ke : k0 + PANEL_KB;
        for (int m = 0; m < MR; ++m)
            for (int c = 0; c < 2 * NP; ++c) acc[m][c] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; ++k) {
            __m512 b[4];
            for (int pn = 0; pn < NP; ++pn) {
                const float *w = wp + pn * K * 32 + k * 32;
                if (PF == 1) PREFETCH_2_LINES(w);
                if (PF == 2) {   /* into L2: this row of the next k block, or of the next pair of panels */
                    const float *nw = w + (ke < K ? (ke - kb) * 32 : (2 * K - kb) * 32);
                    _mm_prefetch((const char *)nw, _MM_HINT_T1);
                    _mm_prefetch((const char *)nw + 64, _MM_HINT_T1);
                }
                b[2 * pn] = _mm512_loadu_ps(w);
                b[2 * pn + 1] = _mm512_loadu_ps(w + 16);
            }
            for (int m = 0; m < MR; ++m) {
                const __m512 a = _mm512_set1_ps(x[m * xs + k]);
                for (int c = 0; c < 2 * NP; ++c) acc[m][c] = _mm512_fmadd_ps(a, b[c], acc[m][c]);
            }
        }
        panel_store_avx512(acc, k0 == 0, k1 == K, bias, y, ys, mask, MR, 2 * NP);
    }
}

/* panel_block_avx512 on bf16 panels (qwen_pack_panels_bf16, below), by widening loads. */
static inline __attribute__((always_inline)) void panel_block_bf16_avx512(const float *x, int64_t xs,
                                                                          const uint16_t *wp, int64_t K,
                                                                          int64_t kb, int64_t ke,
                                                                          const float *bias, float *y, int64_t ys,
                                                                          int64_t cols, const int MR, const int NP,
                                                                          const int PF) {
    const int64_t K2 = (K + 1) / 2;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __mmask16 mask[4];
    for (int c = 0; c < 2 * NP; ++c) mask[c] = lanes_left(cols - 16 * c);
    __m512 acc[PANEL_MR][4];
    for (int64_t k0 = kb; k0 < ke; k0 += PANEL_KB) {   /* PANEL_KB is even: k0 starts a pair */
        const int64_t k1 = ke - k0 < PANEL_KB ? ke : k0 + PANEL_KB;
        for (int m = 0; m < MR; ++m)
            for (int c = 0; c < 2 * NP; ++c) acc[m][c] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 2) {
            const int odd_tail = k + 1 == k1;   /* odd K: the last k has no partner */
            __m512i v[4];
            for (int pn = 0; pn < NP; ++pn) {
                const uint16_t *w = wp + pn * K2 * 64 + k * 32;   /* the pair k / 2 */
                if (PF == 1) PREFETCH_2_LINES(w);
                if (PF == 2) {
                    const uint16_t *nw = w + (ke < K ? (ke - kb) * 32 : 2 * K2 * 64 - kb * 32);
                    _mm_prefetch((const char *)nw, _MM_HINT_T1);
                    _mm_prefetch((const char *)nw + 64, _MM_HINT_T1);
                }
                v[2 * pn] = _mm512_loadu_si512((const void *)w);
                v[2 * pn + 1] = _mm512_loadu_si512((const void *)(w + 32));
            }
            for (int m = 0; m < MR; ++m) {
                const __m512 a = _mm512_set1_ps(x[m * xs + k]);
                for (int c = 0; c < 2 * NP; ++c)
                    acc[m][c] = _mm512_fmadd_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16)), acc[m][c]);
            }
            if (odd_tail) break;
            for (int m = 0; m < MR; ++m) {
                const __m512 b = _mm512_set1_ps(x[m * xs + k + 1]);
                for (int c = 0; c < 2 * NP; ++c)
                    acc[m][c] = _mm512_fmadd_ps(b, _mm512_castsi512_ps(_mm512_and_si512(v[c], high)), acc[m][c]);
            }
        }
        panel_store_avx512(acc, k0 == 0, k1 == K, bias, y, ys, mask, MR, 2 * NP);
    }
}

/* One compiled kernel per (rows, panels, dtype) that the drivers below use, reached through const
 * tables (one body each, not one per call site: the library builds in a few seconds). The
 * prefetching ones (PF = 1) stream weights at up to PANEL_MR rows; the 6-row pair kernel is the
 * compute-bound one of prefill. */
typedef void (*panel_kernel)(const float *x, int64_t xs, const char *wp, int64_t K, int64_t kb, int64_t ke,
                             const float *bias, float *y, int64_t ys, int64_t cols);

#define PANEL_KERNEL(MR, NP, PF)                                                                              \
    static void panel_kernel_f32_##MR##_##NP(const float *x, int64_t xs, const char *wp, int64_t K, int64_t kb, \
                                             int64_t ke, const float *bias, float *y, int64_t ys, int64_t cols) { \
        panel_block_avx512(x, xs, (const float *)wp, K, kb, ke, bias, y, ys, cols, MR, NP, PF);               \
    }                                                                                                         \
    static void panel_kernel_bf16_##MR##_##NP(const float *x, int64_t xs, const char *wp, int64_t K,          \
                                              int64_t kb, int64_t ke, const float *bias, float *y, int64_t ys, \
                                              int64_t cols) {                                                 \
        panel_block_bf16_avx512(x, xs, (const uint16_t *)wp, K, kb, ke, bias, y, ys, cols, MR, NP, PF);       \
    }
PANEL_KERNEL(1, 1, 1) PANEL_KERNEL(2, 1, 1) PANEL_KERNEL(3, 1, 1) PANEL_KERNEL(4, 1, 1) PANEL_KERNEL(5, 1, 1)
PANEL_KERNEL(6, 1, 1) PANEL_KERNEL(7, 1, 1) PANEL_KERNEL(8, 1, 1) PANEL_KERNEL(9, 1, 1) PANEL_KERNEL(10, 1, 1)
PANEL_KERNEL(11, 1, 1) PANEL_KERNEL(12, 1, 1)
PANEL_KERNEL(1, 2, 1) PANEL_KERNEL(2, 2, 1) PANEL_KERNEL(3, 2, 1) PANEL_KERNEL(4, 2, 1)
PANEL_KERNEL(6, 2, 0)
#undef PANEL_KERNEL
/* The 6-row pair kernel with PF = 2 (PANEL_WIDE_PF below). */
static void panel_kernel_f32_6_2_pf(const float *x, int64_t xs, const char *wp, int64_t K, int64_t kb, int64_t ke,
                                    const float *bias, float *y, int64_t ys, int64_t cols) {
    panel_block_avx512(x, xs, (const float *)wp, K, kb, ke, bias, y, ys, cols, 6, 2, 2);
}
static void panel_kernel_bf16_6_2_pf(const float *x, int64_t xs, const char *wp, int64_t K, int64_t kb, int64_t ke,
                                     const float *bias, float *y, int64_t ys, int64_t cols) {
    panel_block_bf16_avx512(x, xs, (const uint16_t *)wp, K, kb, ke, bias, y, ys, cols, 6, 2, 2);
}

/* [bf16][rows]: one panel, 1 to PANEL_MR rows, prefetching. */
static const panel_kernel ONE_PANEL[2][PANEL_MR + 1] = {
    {NULL, panel_kernel_f32_1_1, panel_kernel_f32_2_1, panel_kernel_f32_3_1, panel_kernel_f32_4_1,
     panel_kernel_f32_5_1, panel_kernel_f32_6_1, panel_kernel_f32_7_1, panel_kernel_f32_8_1, panel_kernel_f32_9_1,
     panel_kernel_f32_10_1, panel_kernel_f32_11_1, panel_kernel_f32_12_1},
    {NULL, panel_kernel_bf16_1_1, panel_kernel_bf16_2_1, panel_kernel_bf16_3_1, panel_kernel_bf16_4_1,
     panel_kernel_bf16_5_1, panel_kernel_bf16_6_1, panel_kernel_bf16_7_1, panel_kernel_bf16_8_1,
     panel_kernel_bf16_9_1, panel_kernel_bf16_10_1, panel_kernel_bf16_11_1, panel_kernel_bf16_12_1}};
/* [bf16][rows]: two panels, 1 to PANEL_PAIR_MAX_ROWS rows, prefetching (decode). */
static const panel_kernel PANEL_PAIR[2][PANEL_PAIR_MAX_ROWS + 1] = {
    {NULL, panel_kernel_f32_1_2, panel_kernel_f32_2_2, panel_kernel_f32_3_2, panel_kernel_f32_4_2},
    {NULL, panel_kernel_bf16_1_2, panel_kernel_bf16_2_2, panel_kernel_bf16_3_2, panel_kernel_bf16_4_2}};
/* [bf16]: two panels, PANEL_WIDE_MR rows (prefill). */
static const panel_kernel PANEL_WIDE[2] = {panel_kernel_f32_6_2, panel_kernel_bf16_6_2};
/* [bf16]: the same, prefetching into L2 the weights the pair reads next (the next k block, else the next
 * pair of panels): the second row block of a k block runs it, while the first row block, which read this
 * block's weights from memory, is done. The embedded model's five products at 16 rows (a decode batch),
 * weights in L3: 0.92x the time; evicted to DRAM, and at 64-512 rows: level (within 2%). */
static const panel_kernel PANEL_WIDE_PF[2] = {panel_kernel_f32_6_2_pf, panel_kernel_bf16_6_2_pf};

/* qwen_linear_packed (bf16 = 0) and qwen_linear_packed_bf16 (bf16 = 1) on AVX-512.
 * - Up to PANEL_PAIR_MAX_ROWS rows (decode): the weights stream from memory once, so the point is
 *   bandwidth: two panels side by side (two streams, four FMA chains), prefetching ahead.
 * - Up to PANEL_MR rows (batched decode): one panel at a time, all rows in one block, prefetching.
 * - More rows (prefill): each weight is reused by every row, and the point is FMA throughput:
 *   blocks of PANEL_WIDE_MR rows by two panels (24 accumulators, 4 weight loads and 6 broadcasts
 *   per 24 FMAs, against 2 and 12 for 12 rows by one panel), one k block at a time (the pair's k
 *   block, 32 KB in fp32, stays in L1 across the row blocks); the rows left over, and an odd last
 *   panel, one panel at a time. Measured against oneDNN: benchmarks/README.md.
 * Each output's sum runs over k in the same order in every case (the batch does not change a row).
 * threads > 1 (an OpenMP build): the panels are split into that many contiguous ranges, one a
 * thread, each output computed by one thread as above (the results do not depend on threads). */
static void linear_packed_avx512(const float *x, int64_t xs, int64_t M, const void *wp, const float *bias, int64_t N,
                                 int64_t K, float *y, int64_t ys, int bf16, int threads) {
    (void)threads;   /* without OpenMP */
    const int64_t P = (N + 31) / 32, pairs = (P + 1) / 2, panel_bytes = 128 * (bf16 ? (K + 1) / 2 : K);
    const char *w = (const char *)wp;
    const panel_kernel *one = ONE_PANEL[bf16];
    if (M <= PANEL_PAIR_MAX_ROWS) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t q = 0; q < pairs; ++q) {
            const int64_t p = 2 * q;
            const panel_kernel kernel = p + 1 < P ? PANEL_PAIR[bf16][M] : one[M];
            kernel(x, xs, w + p * panel_bytes, K, 0, K, bias == NULL ? NULL : bias + p * 32, y + p * 32, ys,
                   N - p * 32);
        }
        return;
    }
    if (M <= PANEL_MR) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t p = 0; p < P; ++p)
            one[M](x, xs, w + p * panel_bytes, K, 0, K, bias == NULL ? NULL : bias + p * 32, y + p * 32, ys,
                   N - p * 32);
        return;
    }
    const panel_kernel wide = PANEL_WIDE[bf16], wide_pf = PANEL_WIDE_PF[bf16];
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t q = 0; q < pairs; ++q) {
        const int64_t p = 2 * q, np = p + 1 < P ? 2 : 1;
        for (int64_t kb = 0; kb < K; kb += PANEL_KB) {
            const int64_t ke = K - kb < PANEL_KB ? K : kb + PANEL_KB;
            int64_t m = 0;
            if (np == 2)
                for (; m + PANEL_WIDE_MR <= M; m += PANEL_WIDE_MR)
                    (m == PANEL_WIDE_MR ? wide_pf : wide)(x + m * xs, xs, w + p * panel_bytes, K, kb, ke,
                                                          bias == NULL ? NULL : bias + p * 32, y + m * ys + p * 32,
                                                          ys, N - p * 32);
            if (np == 2 && m < M && M - m <= PANEL_PAIR_MAX_ROWS) {   /* a few rows left: both panels at once */
                PANEL_PAIR[bf16][M - m](x + m * xs, xs, w + p * panel_bytes, K, kb, ke,
                                        bias == NULL ? NULL : bias + p * 32, y + m * ys + p * 32, ys, N - p * 32);
                m = M;
            }
            for (; m < M; m += PANEL_MR) {   /* the rows left over (all of them for an odd last panel) */
                const int64_t rows = M - m < PANEL_MR ? M - m : PANEL_MR;
                for (int64_t pn = p; pn < p + np; ++pn)
                    one[rows](x + m * xs, xs, w + pn * panel_bytes, K, kb, ke, bias == NULL ? NULL : bias + pn * 32,
                              y + m * ys + pn * 32, ys, N - pn * 32);
            }
        }
    }
}
#endif

/* y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < M, n < N, from the packed wp (qwen_pack_panels);
 * x rows of stride xs, y rows of stride ys; on up to `threads` threads (AVX-512 OpenMP builds). */
void qwen_linear_packed(const float *x, int64_t xs, int64_t M, const float *wp, const float *bias, int64_t N,
                        int64_t K, float *y, int64_t ys, int64_t threads) {
#if QWEN_AVX512
    linear_packed_avx512(x, xs, M, wp, bias, N, K, y, ys, 0, (int)threads);
#else
    (void)threads;
    const int64_t P = (N + 31) / 32;
    for (int64_t p = 0; p < P; ++p) {
        const float *panel = wp + p * K * 32;
        const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
        const float *b = bias == NULL ? NULL : bias + n0;
        for (int64_t m = 0; m < M; ++m) {
            float total[32] = {0};
            const float *xr = x + m * xs;
            for (int64_t k0 = 0; k0 < K; k0 += PANEL_KB) {
                const int64_t k1 = K - k0 < PANEL_KB ? K : k0 + PANEL_KB;
                float acc[32] = {0};
                for (int64_t k = k0; k < k1; ++k) {
                    const float a = xr[k];
                    const float *w = panel + k * 32;
#pragma omp simd
                    for (int j = 0; j < 32; ++j) acc[j] += a * w[j];
                }
                for (int j = 0; j < 32; ++j) total[j] += acc[j];
            }
            for (int64_t j = 0; j < cols; ++j) y[m * ys + n0 + j] = total[j] + (b == NULL ? 0.0f : b[j]);
        }
    }
#endif
}

/* ----------------------------------------------------------------------------------------------
 * bf16 weights. A weight [N, K] in bf16 is packed like the fp32 one, 32 output features a panel,
 * but k in pairs: wp[((p * K2 + kk) * 32 + j) * 2 + e] = w[p * 32 + j, 2 kk + e], K2 = ceil(K / 2),
 * zero past N and K. One 32-bit lane then holds a feature's weights at k and k + 1, and one
 * 64-byte load holds 16 features' pairs. Two ways to use it, both accumulating in fp32:
 * - widening (any AVX-512 CPU): the high half of a lane is already k + 1's weight as an fp32 (a
 *   bf16 is the top half of an fp32), masked; a 16-bit left shift makes k's. Then the same FMAs,
 *   in the same order, as the fp32 kernel on the widened weights: 1 load, 1 shift, 1 and, and 2
 *   FMAs per row for 64 bytes of weights.
 * - AVX512-BF16 (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later): VDPBF16PS takes
 *   exactly this layout (pairs in 32-bit lanes) and the inputs as bf16 pairs, one instruction for
 *   both k. Chosen at run time by cpuid; compiled with a target attribute, so the library stays
 *   built for -march=native whatever the CPU. The instruction sums k + 1's product, then k's, with
 *   round-to-nearest and denormals flushed, so it differs from the widening path in fp32
 *   rounding only.
 * The inputs x are bf16 values held as fp32 (the activations of a bf16 model are): the widening
 * path uses them as they are, the BF16 path rounds them to bf16 (exact for such values).
 * ---------------------------------------------------------------------------------------------- */
void qwen_pack_panels_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *wp) {
    const int64_t P = (N + 31) / 32, K2 = (K + 1) / 2;
    for (int64_t p = 0; p < P; ++p)
        for (int64_t j = 0; j < 32; ++j) {
            const int64_t n = p * 32 + j;
            uint16_t *dst = wp + p * K2 * 64 + 2 * j;
            for (int64_t k = 0; k < 2 * K2; ++k)
                dst[(k / 2) * 64 + (k & 1)] = n < N && k < K ? w[n * K + k] : 0;
        }
}

#if QWEN_AVX512 && (defined(__clang__) ? __clang_major__ >= 12 : (defined(__GNUC__) && __GNUC__ >= 11))
#define QWEN_DPBF16 1
#define QWEN_DPBF16_TARGET __attribute__((target("avx512bf16")))
#else
#define QWEN_DPBF16 0
#endif

#if QWEN_DPBF16
/* Seconds of n rounds of 12 independent VDPBF16PS (dot != 0) or FMAs: their issue rate. */
static QWEN_DPBF16_TARGET double bf16_probe_seconds(int dot, long n) {
    struct timespec t0, t1;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    const __m512 x = _mm512_set1_ps(1e-3f), y = _mm512_set1_ps(1e-6f);
    const __m512bh p = (__m512bh)_mm512_set1_epi32(0x3a803a80), q = (__m512bh)_mm512_set1_epi32(0x3a803a80);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (dot) {
        for (long i = 0; i < n; ++i) {
#define QWEN_DP(A) A = _mm512_dpbf16_ps(A, p, q);
            QWEN_DP(a0) QWEN_DP(a1) QWEN_DP(a2) QWEN_DP(a3) QWEN_DP(a4) QWEN_DP(a5)
            QWEN_DP(a6) QWEN_DP(a7) QWEN_DP(a8) QWEN_DP(a9) QWEN_DP(a10) QWEN_DP(a11)
#undef QWEN_DP
            __asm__ volatile("" : "+v"(a0), "+v"(a6));
        }
    } else {
        for (long i = 0; i < n; ++i) {
#define QWEN_FMA(A) A = _mm512_fmadd_ps(A, x, y);
            QWEN_FMA(a0) QWEN_FMA(a1) QWEN_FMA(a2) QWEN_FMA(a3) QWEN_FMA(a4) QWEN_FMA(a5)
            QWEN_FMA(a6) QWEN_FMA(a7) QWEN_FMA(a8) QWEN_FMA(a9) QWEN_FMA(a10) QWEN_FMA(a11)
#undef QWEN_FMA
            __asm__ volatile("" : "+v"(a0), "+v"(a6));
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const __m512 all = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                     _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                                                   _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
    volatile float sink = _mm512_reduce_add_ps(all);
    (void)sink;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

/* Whether VDPBF16PS beats the widening path's two FMAs per pair of k on this CPU. Some CPUs with
 * AVX512-BF16 issue it at a quarter of the FMA rate (this Intel Xeon VM: 1.34 against 5.38 per ns,
 * so the widening products of many rows run 1.7x faster there); others at the FMA rate or faster.
 * Measured once, interleaved, best of 5 rounds of about 0.1 ms each: the dot products win when one
 * takes under 1.6 FMAs' time (the widening path also spends a shift and a mask per weight vector). */
static int bf16_dot_is_faster(void) {
    double dot = 1e9, fma = 1e9;
    for (int r = 0; r < 5; ++r) {
        const double d = bf16_probe_seconds(1, 20000), f = bf16_probe_seconds(0, 20000);
        dot = d < dot ? d : dot;
        fma = f < fma ? f : fma;
    }
    return dot < 1.6 * fma;
}
#endif

#if QWEN_DPBF16
/* panel_block_avx512 on a bf16 panel by VDPBF16PS; xp: the input rows as bf16 pairs (row stride xps). */
static inline __attribute__((always_inline)) QWEN_DPBF16_TARGET void panel_block_dpbf16(
        const uint32_t *xp, int64_t xps, const uint16_t *wp, int64_t K2, const float *bias, float *y, int64_t ys,
        int64_t cols, const int MR) {
    __mmask16 mask[2] = {lanes_left(cols), lanes_left(cols - 16)};
    __m512 acc[PANEL_MR][4];
    for (int64_t k0 = 0; k0 < K2; k0 += PANEL_KB / 2) {   /* the fp32 kernel's k blocks */
        const int64_t k1 = K2 - k0 < PANEL_KB / 2 ? K2 : k0 + PANEL_KB / 2;
        for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t kk = k0; kk < k1; ++kk) {
            PREFETCH_2_LINES(wp + kk * 64);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wp + kk * 64));
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wp + kk * 64 + 32));
            for (int m = 0; m < MR; ++m) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[m * xps + kk]);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
            }
        }
        panel_store_avx512(acc, k0 == 0, k1 == K2, bias, y, ys, mask, MR, 2);
    }
}

/* panel_block_dpbf16 for mr (1 .. PANEL_MR) rows. */
static QWEN_DPBF16_TARGET void dpbf16_block(const uint32_t *xp, int64_t xps, const uint16_t *panel, int64_t K2,
                                           const float *bias, float *y, int64_t ys, int64_t cols, int64_t mr) {
    if (mr == PANEL_MR) {
        panel_block_dpbf16(xp, xps, panel, K2, bias, y, ys, cols, PANEL_MR);
        return;
    }
#define DP_BLOCK(MR_) panel_block_dpbf16(xp, xps, panel, K2, bias, y, ys, cols, MR_)
    PANEL_ROWS_SWITCH(mr, DP_BLOCK)
#undef DP_BLOCK
}

/* The panels of y [M, N] = x w^T by VDPBF16PS from xp, the input rows as bf16 pairs (row stride xps). */
static QWEN_DPBF16_TARGET void dpbf16_panels(const uint32_t *xp, int64_t xps, int64_t M, const uint16_t *wp,
                                             const float *bias, int64_t N, int64_t K, float *y, int64_t ys,
                                             int threads) {
    (void)threads;   /* without OpenMP */
    const int64_t K2 = (K + 1) / 2, P = (N + 31) / 32;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < P; ++p) {
        const uint16_t *panel = wp + p * K2 * 64;
        const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
        const float *b = bias == NULL ? NULL : bias + n0;
        for (int64_t m = 0; m < M; m += PANEL_MR)
            dpbf16_block(xp + m * xps, xps, panel, K2, b, y + m * ys + n0, ys, cols,
                         M - m < PANEL_MR ? M - m : PANEL_MR);
    }
}

/* The row stride (in pairs) of x's bf16 pairs for dpbf16_panels: a whole number of 64-byte lines
 * plus one, so that the rows of a block fall in different sets of L1 (qwen_linear). */
static inline int64_t dpbf16_stride(int64_t K2) { return (K2 + 15) / 16 * 16 + 16; }

/* qwen_linear_packed_bf16 by VDPBF16PS. Returns -1 (nothing written) when scratch memory for the
 * bf16 pairs of x could not be allocated. */
static QWEN_DPBF16_TARGET int linear_packed_dpbf16(const float *x, int64_t xs, int64_t M, const uint16_t *wp,
                                                   const float *bias, int64_t N, int64_t K, float *y, int64_t ys,
                                                   int threads) {
    const int64_t K2 = (K + 1) / 2, xps = dpbf16_stride(K2);
    uint32_t *xp = malloc(sizeof(uint32_t) * (size_t)(M * xps > 0 ? M * xps : 1));
    if (xp == NULL) return -1;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t kk = 0; kk < K2; ++kk) {
            const float a = round_bf16(x[m * xs + 2 * kk]);
            const float b = 2 * kk + 1 < K ? round_bf16(x[m * xs + 2 * kk + 1]) : 0.0f;
            uint32_t ua, ub;
            memcpy(&ua, &a, 4);
            memcpy(&ub, &b, 4);
            xp[m * xps + kk] = (ua >> 16) | (ub & 0xFFFF0000u);
        }
    dpbf16_panels(xp, xps, M, wp, bias, N, K, y, ys, threads);
    free(xp);
    return 0;
}
#endif

/* ----------------------------------------------------------------------------------------------
 * bf16 products on AMX tiles (Sapphire Rapids and later Xeons). The bf16 panels above are already
 * the B operand of TDPBF16PS: a tile row is one pair of k for 16 features (64 bytes), and a
 * panel's pair kk holds features 0-15 at byte 128 kk and 16-31 at 128 kk + 64, so a B tile of 16
 * pairs is a load of stride 128 from the panel, no repacking. A tiles (up to 16 input rows x 32 k)
 * come from a copy of x made once per call, zero-padded to a multiple of 32 k; C: rows x 16 fp32.
 * - Up to 16 rows (decode): one block of rows against two panels at a time (4 C tiles, 1 A, 2 B),
 *   prefetching AMX_PREFETCH bytes ahead in both panels: the weights stream from DRAM once, and
 *   one TDPBF16PS (16 x 16 x 32) per KB of weights leaves the tiles idle most of the time.
 * - More rows (prefill): two blocks of 16 rows against one panel (4 C tiles, 2 A, 2 B), the loads
 *   software-pipelined between the products, x copied in tile order (each A tile 1 KB contiguous),
 *   the rows in chunks whose copy stays in L2, and each panel read from DRAM once a chunk while
 *   the panel before it prefetches it into L2.
 * The pairs of a panel past its last multiple of 16 are copied into a zero-padded tile (the panel
 * ends there). TDPBF16PS accumulates each row's products in fp32 in a fixed order, whatever the
 * other rows: a row's result does not depend on its batch, and every row count takes this path.
 * Linux lends the tile registers to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM); each
 * thread configures its tiles and releases them when done.
 * ---------------------------------------------------------------------------------------------- */
#if QWEN_AVX512 && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : (defined(__GNUC__) && __GNUC__ >= 11))
#define QWEN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define QWEN_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
/* The compilers' tile load and store intrinsics are asm statements that name no memory: without this
 * barrier, a buffer written just before a tile load (or read just after a tile store) may have its
 * writes (reads) moved across it, or dropped as dead. */
#define AMX_MEMORY() __asm__ volatile("" ::: "memory")
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 4096
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Whether this process may use AMX tiles: the CPU has them and Linux granted their state. */
static int amx_tiles_granted(void) {
    return __builtin_cpu_supports("amx-tile") &&
           syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* ... and the bf16 products on them. */
static int amx_usable(void) { return __builtin_cpu_supports("amx-bf16") && amx_tiles_granted(); }

/* tmm0-3: C, rows x 16 fp32; tmm4-5: A, rows x 32 bf16; tmm6-7: B, 16 pairs x 16 features. */
static QWEN_AMX_TARGET void amx_configure(int rows) {
    amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = (uint8_t)(t < 6 ? rows : 16);
    }
    AMX_MEMORY();
    _tile_loadconfig(&c);
}

static QWEN_AMX_TARGET void amx_tile_release(void) { _tile_release(); }

/* Half h (features 16 h .. 16 h + 15) of a panel's pairs kk0 .. K2 - 1, zero-padded to 16 pairs. */
static inline void amx_b_tail(const uint16_t *panel, int64_t kk0, int64_t K2, int h, uint16_t *dst) {
    memset(dst, 0, 1024);
    for (int64_t kk = kk0; kk < K2; ++kk) memcpy(dst + (kk - kk0) * 32, panel + kk * 64 + h * 32, 64);
}

/* tmm6, tmm7 = the two halves of a panel's last K2 - kk0 (< 16) pairs, zero-padded (tail: 2 KB scratch). */
static inline __attribute__((always_inline)) QWEN_AMX_TARGET void amx_load_b_tail(const uint16_t *panel, int64_t kk0,
                                                                                 int64_t K2, uint16_t *tail) {
    amx_b_tail(panel, kk0, K2, 0, tail);
    amx_b_tail(panel, kk0, K2, 1, tail + 512);
    AMX_MEMORY();
    _tile_loadd(6, tail, 64);
    _tile_loadd(7, tail + 512, 64);
}

/* The start of a product: the C tiles tmm0-3 zeroed, after the inputs' writes (the barrier). Only
 * amx-tile, so that the bf16 and the int8 kernels both inline it. */
static inline __attribute__((always_inline, target("amx-tile"))) void amx_zero_c(void) {
    AMX_MEMORY();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline __attribute__((always_inline)) void amx_prefetch_2kb(const uint16_t *p) {
    for (int l = 0; l < 32; ++l) _mm_prefetch((const char *)p + AMX_PREFETCH + 64 * l, _MM_HINT_T0);
}

/* c [rows, 64] (row stride ldc) = one block of <= 16 rows of xb (row stride ldx, zero-padded k)
 * times two consecutive panels (only the first when panel2 is NULL: c [rows, 32]). */
static QWEN_AMX_TARGET void amx_block16(const uint16_t *xb, int64_t ldx, const uint16_t *panel,
                                        const uint16_t *panel2, int64_t K2, float *c, int64_t ldc) {
    amx_zero_c();
    const int64_t full = K2 / 16 * 16;
    for (int64_t kk = 0; kk < full; kk += 16) {
        amx_prefetch_2kb(panel + kk * 64);
        _tile_loadd(4, xb + kk * 2, ldx * 2);
        _tile_loadd(6, panel + kk * 64, 128);
        _tile_loadd(7, panel + kk * 64 + 32, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (panel2 != NULL) {
            amx_prefetch_2kb(panel2 + kk * 64);
            _tile_loadd(6, panel2 + kk * 64, 128);
            _tile_loadd(7, panel2 + kk * 64 + 32, 128);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    if (full < K2) {
        uint16_t tail[1024] __attribute__((aligned(64)));
        _tile_loadd(4, xb + full * 2, ldx * 2);
        amx_load_b_tail(panel, full, K2, tail);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (panel2 != NULL) {
            amx_load_b_tail(panel2, full, K2, tail);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    if (panel2 != NULL) {
        _tile_stored(2, c + 32, ldc * 4);
        _tile_stored(3, c + 48, ldc * 4);
    }
    AMX_MEMORY();
}

/* c [32, 32] (row stride ldc) = two blocks of 16 rows times one panel; a0, a1: the blocks' rows in
 * tile order (amx_tile_order). Software-pipelined: each tile register is reloaded for the next 16
 * pairs as soon as its last product of this step has issued (the tiles have no renaming). pf: the
 * next panel's share that this call prefetches into L2, pf_step bytes a step (NULL: none). */
static QWEN_AMX_TARGET void amx_block32(const uint16_t *a0, const uint16_t *a1, const uint16_t *panel, int64_t K2,
                                        float *c, int64_t ldc, const char *pf, int64_t pf_step) {
    amx_zero_c();
    const int64_t full = K2 / 16 * 16;
    if (full > 0) {
        _tile_loadd(4, a0, 64);
        _tile_loadd(6, panel, 128);
        _tile_loadd(7, panel + 32, 128);
        _tile_loadd(5, a1, 64);
        for (int64_t kk = 16; kk < full; kk += 16) {
            if (pf != NULL)
                for (int64_t l = 0; l < pf_step; l += 64) _mm_prefetch(pf + (kk / 16 - 1) * pf_step + l, _MM_HINT_T1);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(4, a0 + kk * 32, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(6, panel + kk * 64, 128);
            _tile_dpbf16ps(3, 5, 7);
            _tile_loadd(5, a1 + kk * 32, 64);
            _tile_loadd(7, panel + kk * 64 + 32, 128);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (full < K2) {
        uint16_t tail[1024] __attribute__((aligned(64)));
        amx_load_b_tail(panel, full, K2, tail);
        _tile_loadd(4, a0 + full * 32, 64);
        _tile_loadd(5, a1 + full * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
    AMX_MEMORY();
}

/* Pairs of k a part of a panel holds in amx_block32_part: 32 KB of weights, which stay in L1 while a
 * chunk's blocks of rows run over them; the A tiles come from L2 by TILELOADDT1, which does not keep
 * them in L1, so they do not push the weights out. Each part costs a store and a reload of the 32 x 32
 * sums, whose wait for the tiles to drain was a quarter of the product's time at 128 pairs (measured in
 * benchmarks/README.md "Prefill's third pass"; 128 pairs and plain loads before: "Products at prefill
 * sizes", against 64, 96, 160 and 384 pairs and whole panels). */
#ifndef AMX_K_PART
#define AMX_K_PART 256
#endif

/* c [32, 32] (row stride 32, fp32) = (c if load_c, else 0) + pairs kk0 .. kk1 - 1 (multiples of 16) of
 * two blocks of 16 rows (a0, a1 in tile order) times one panel: amx_block32 over a part of k, its sums
 * carried between parts in c exactly (fp32 stored and loaded), so the same bits as one call over all k.
 * b_next: this call's share of the weights of the part that runs next, prefetched into L2 (without it the
 * first pair of blocks of each part waited on DRAM for its weights: products 5-9% slower at 512 rows). */
static QWEN_AMX_TARGET void amx_block32_part(const uint16_t *a0, const uint16_t *a1, const uint16_t *panel,
                                             int64_t kk0, int64_t kk1, float *c, int load_c, const char *b_next,
                                             int64_t b_lines) {
    AMX_MEMORY();
    if (load_c) {
        _tile_loadd(0, c, 128);
        _tile_loadd(1, c + 16, 128);
        _tile_loadd(2, c + 16 * 32, 128);
        _tile_loadd(3, c + 16 * 32 + 16, 128);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    _tile_stream_loadd(4, a0 + kk0 * 32, 64);
    _tile_loadd(6, panel + kk0 * 64, 128);
    _tile_loadd(7, panel + kk0 * 64 + 32, 128);
    _tile_stream_loadd(5, a1 + kk0 * 32, 64);
    const int64_t steps = (kk1 - kk0) / 16 - 1, per = steps > 0 ? (b_lines + steps - 1) / steps : 0;
    for (int64_t kk = kk0 + 16; kk < kk1; kk += 16) {   /* software-pipelined as amx_block32 */
        if (b_next != NULL) {   /* b_lines lines of the next part's weights into L2, spread over the steps */
            const int64_t l0 = (kk - kk0 - 16) / 16 * per;
            for (int64_t l = l0; l < l0 + per && l < b_lines; ++l) _mm_prefetch(b_next + 64 * l, _MM_HINT_T1);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stream_loadd(4, a0 + kk * 32, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(6, panel + kk * 64, 128);
        _tile_dpbf16ps(3, 5, 7);
        _tile_stream_loadd(5, a1 + kk * 32, 64);
        _tile_loadd(7, panel + kk * 64 + 32, 128);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
    AMX_MEMORY();
}

/* 16 fp32 rounded to bf16 as f32_to_bf16 does (to nearest even; NaN stays NaN), bit for bit. */
static inline __m256i amx_round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* y[m, j] = c[m, j] (+ bias[j]) for m < rows, j < 32 of a 32-column block whose every row starts on a
 * cache line (amx_streams): written with streaming stores, one whole line a row (bf16) or two (fp32),
 * so that no line of y is read before it is written. The caller fences (_mm_sfence) before y is read. */
static inline void amx_put_stream(const float *c, int64_t ldc, int64_t rows, const float *bias, void *y, int64_t ys,
                                  int y_bf16) {
    const __m512 b0 = bias == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
    const __m512 b1 = bias == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + 16);
    for (int64_t m = 0; m < rows; ++m) {
        const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + m * ldc), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + m * ldc + 16), b1);
        if (y_bf16) {
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(amx_round_bf16(v0)), amx_round_bf16(v1), 1);
            _mm512_stream_si512((__m512i *)(void *)((uint16_t *)y + m * ys), both);
        } else {
            _mm512_stream_ps((float *)y + m * ys, v0);
            _mm512_stream_ps((float *)y + m * ys + 16, v1);
        }
    }
}

/* Whether linear_packed_amx's blocks of 32 columns go out through amx_put_stream: an output larger than
 * about half of L2 (a prefill's: it leaves the cache before anything reads it; the stores' reads for
 * ownership of its lines were a fifth of a 2,000-row product's time, measured in
 * benchmarks/README.md "Products at prefill sizes"), every row on a cache line. */
static inline int amx_streams(const void *y, int64_t ys, int64_t M, int64_t N, int64_t y_size) {
    return M * N * y_size >= (1 << 20) && ((uintptr_t)y & 63) == 0 && (ys * y_size) % 64 == 0;
}

/* y[m, j] = c[m, j] (+ bias[j]) for m < rows, j < cols; y fp32, or bf16 (y_bf16: rounded once). */
static inline void amx_put(const float *c, int64_t ldc, int64_t rows, int64_t cols, const float *bias, void *y,
                           int64_t ys, int y_bf16) {
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 mk = lanes_left(cols - j);
        const __m512 b = bias == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk, bias + j);
        for (int64_t m = 0; m < rows; ++m) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + m * ldc + j), b);
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + m * ys + j, mk, amx_round_bf16(v));
            else
                _mm512_mask_storeu_ps((float *)y + m * ys + j, mk, v);
        }
    }
}

static void silu_mul_bf16_row(const uint16_t *table, const uint16_t *g, const uint16_t *u, uint16_t *o,
                              int64_t dim);   /* below */
static const uint16_t *silu_table(void);

/* y[m, j] = silu(gate) * up for m < rows, j < 32, of a gate block cg and its up block cu (fp32 sums, row
 * stride ldc): each sum (+ bias) rounded to bf16 as amx_put rounds it, then silu_mul_bf16_row on those
 * values, so linear_packed then silu_mul, bit for bit. y bf16; streaming stores where stream (every row
 * on a cache line, amx_streams). */
static inline void amx_put_silu(const float *cg, const float *cu, int64_t ldc, int64_t rows, const float *bias_g,
                                const float *bias_u, uint16_t *y, int64_t ys, int stream, const uint16_t *table) {
    const __m512 bg0 = bias_g == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias_g);
    const __m512 bg1 = bias_g == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias_g + 16);
    const __m512 bu0 = bias_u == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias_u);
    const __m512 bu1 = bias_u == NULL ? _mm512_setzero_ps() : _mm512_loadu_ps(bias_u + 16);
    uint16_t g[32] __attribute__((aligned(64))), u[32] __attribute__((aligned(64))), o[32] __attribute__((aligned(64)));
    for (int64_t m = 0; m < rows; ++m) {
        _mm256_store_si256((__m256i *)(void *)g, amx_round_bf16(_mm512_add_ps(_mm512_loadu_ps(cg + m * ldc), bg0)));
        _mm256_store_si256((__m256i *)(void *)(g + 16),
                           amx_round_bf16(_mm512_add_ps(_mm512_loadu_ps(cg + m * ldc + 16), bg1)));
        _mm256_store_si256((__m256i *)(void *)u, amx_round_bf16(_mm512_add_ps(_mm512_loadu_ps(cu + m * ldc), bu0)));
        _mm256_store_si256((__m256i *)(void *)(u + 16),
                           amx_round_bf16(_mm512_add_ps(_mm512_loadu_ps(cu + m * ldc + 16), bu1)));
        silu_mul_bf16_row(table, g, u, o, 32);
        if (stream)
            _mm512_stream_si512((__m512i *)(void *)(y + m * ys), _mm512_load_si512((const void *)o));
        else
            _mm512_storeu_si512((void *)(y + m * ys), _mm512_load_si512((const void *)o));
    }
}

/* dst[0 .. n) = row m of x from k0 as bf16 (x fp32 holding bf16 values when x_f32: exact), 0 past
 * M or K. */
static inline void amx_x_row(const void *x, int x_f32, int64_t xs, int64_t M, int64_t K, int64_t m, int64_t k0,
                             int64_t n, uint16_t *dst) {
    const int64_t have = m >= M || k0 >= K ? 0 : (K - k0 < n ? K - k0 : n);
    if (x_f32) {
        const float *src = (const float *)x + m * xs + k0;
        for (int64_t j = 0; j < have; ++j) dst[j] = f32_to_bf16(src[j]);
    } else if (have > 0) {
        memcpy(dst, (const uint16_t *)x + m * xs + k0, (size_t)have * 2);
    }
    memset(dst + have, 0, (size_t)(n - have) * 2);
}

/* y [M, N] (fp32, row stride ys) = x [M, K] w^T (+ bias) on AMX tiles from bf16 panels
 * (qwen_pack_panels_bf16); x fp32 holding bf16 values (x_f32 != 0: rounded to bf16, exact for such
 * values) or bf16, row stride xs. Returns -1 (nothing written) when scratch memory could not be
 * allocated. */
/* Bytes of the A operand (the rows in tile order) a chunk of rows keeps in L2 (linear_packed_amx). */
#ifndef AMX_CHUNK_BYTES
#define AMX_CHUNK_BYTES (1 << 20)
#endif

/* silu != 0 (y bf16, N / 2 a multiple of 32): y [M, N / 2] = silu(gate) * up of the product's gate | up
 * halves instead (amx_put_silu: the same bits as the product, then silu_mul), each gate panel with its up
 * panel, the product's rows never stored. */
static QWEN_AMX_TARGET int linear_packed_amx(const void *x, int x_f32, int64_t xs, int64_t M, const uint16_t *wp,
                                             const float *bias, int64_t N, int64_t K, void *y, int y_bf16, int64_t ys,
                                             int threads, int silu) {
    char *yc = (char *)y;
    uint16_t *yh = (uint16_t *)y;
    const int64_t y_size = y_bf16 ? 2 : 4;
    const int64_t K2 = (K + 1) / 2, P = (N + 31) / 32, nkb = (K2 + 15) / 16;
    const int64_t half = N / 2, P2 = P / 2;   /* silu: the up features' first, the gate panels */
    const uint16_t *table = silu ? silu_table() : NULL;
    (void)threads;   /* without OpenMP */
    if (M <= 16) {
        /* xb: the rows as they are, zero-padded to nkb * 32 k (row stride ldx) */
        const int64_t ldx = nkb * 32;
        uint16_t *xb = aligned_alloc(64, (size_t)((M * ldx * 2 + 63) / 64 * 64 + 64));
        if (xb == NULL) return -1;
        for (int64_t m = 0; m < M; ++m) amx_x_row(x, x_f32, xs, M, K, m, 0, ldx, xb + m * ldx);
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float c[16 * 64] __attribute__((aligned(64)));
            amx_configure((int)M);
            const int64_t pairs = silu ? P2 : (P + 1) / 2;
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; ++q) {
                if (silu) {   /* gate panel q with its up panel: c's columns 0 .. 31 and 32 .. 63 */
                    amx_block16(xb, ldx, wp + q * K2 * 64, wp + (q + P2) * K2 * 64, K2, c, 64);
                    amx_put_silu(c, c + 32, 64, M, bias == NULL ? NULL : bias + 32 * q,
                                 bias == NULL ? NULL : bias + half + 32 * q, yh + 32 * q, ys, 0, table);
                    continue;
                }
                const int64_t p = 2 * q, n0 = p * 32, cols = N - n0 < 64 ? N - n0 : 64;
                const uint16_t *panel = wp + p * K2 * 64;
                amx_block16(xb, ldx, panel, p + 1 < P ? panel + K2 * 64 : NULL, K2, c, 64);
                amx_put(c, 64, M, cols, bias == NULL ? NULL : bias + n0, yc + n0 * y_size, ys, y_bf16);
            }
            _tile_release();
        }
        free(xb);
        return 0;
    }
    /* xt: the rows in tile order, blocks of 16 rows (padded to whole pairs of blocks) by 32 k, 1 KB
     * each: xt[((mb * nkb + kb) * 16 + r) * 32 + j] = x[16 mb + r][32 kb + j]. One load of stride 64
     * per A tile, no two rows of it in one cache set. */
    const int64_t Mp = (M + 31) / 32 * 32;
    uint16_t *xt = aligned_alloc(64, (size_t)(Mp * nkb * 64 + 64));
    if (xt == NULL) return -1;
    if (!x_f32 && K % 32 == 0) {    /* bf16 rows of whole 64-byte pieces (every Qwen width): vector copies */
        for (int64_t m = 0; m < Mp; ++m) {
            uint16_t *dst = xt + ((m / 16) * nkb * 16 + m % 16) * 32;
            const uint16_t *src = (const uint16_t *)x + m * xs;
            for (int64_t kb = 0; kb < nkb; ++kb)
                _mm512_storeu_si512((void *)(dst + kb * 512),
                                    m < M ? _mm512_loadu_si512((const void *)(src + kb * 32)) : _mm512_setzero_si512());
        }
    } else {
        for (int64_t mb = 0; mb < Mp / 16; ++mb)
            for (int64_t kb = 0; kb < nkb; ++kb)
                for (int r = 0; r < 16; ++r)
                    amx_x_row(x, x_f32, xs, M, K, 16 * mb + r, 32 * kb, 32, xt + ((mb * nkb + kb) * 16 + r) * 32);
    }
    /* Rows in chunks whose A stays within about 1 MB of L2; each panel is read from DRAM once a chunk
     * (prefetched into L2 by the chunk's previous panel, a share per pair of blocks) and from L2 for
     * the chunk's other pairs of blocks. */
    const int64_t chunk = AMX_CHUNK_BYTES / (nkb * 64 * 32) * 32 > 32 ? AMX_CHUNK_BYTES / (nkb * 64 * 32) * 32 : 32;
    const int stream = amx_streams(y, ys, M, silu ? half : N, y_size);
    /* Panels longer than a part run part by part (amx_block32_part), each part over all the chunk's
     * blocks of rows, whose sums wait in cbuf (4 KB a block, per thread) between parts. */
    const int parts = K2 % 16 == 0 && K2 > AMX_K_PART / 2;
    const int64_t cb_floats = (chunk / 32) * 1024 * (silu ? 2 : 1);   /* silu: the gate blocks', then the up's */
    float *cbuf = parts ? aligned_alloc(64, (size_t)(threads * cb_floats) * sizeof(float)) : NULL;
    if (parts && cbuf == NULL) {
        free(xt);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float c[32 * 32] __attribute__((aligned(64))), c2[32 * 32] __attribute__((aligned(64)));
#ifdef _OPENMP
        float *cb = parts ? cbuf + cb_floats * omp_get_thread_num() : NULL;
#else
        float *cb = cbuf;
#endif
        amx_configure(16);
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m1 = m0 + chunk < M ? m0 + chunk : M, block_pairs = (m1 - m0 + 31) / 32;
            const int64_t steps = nkb > 1 ? nkb - 1 : 1;
            const int64_t pf_step = (K2 * 128 / block_pairs / steps + 63) / 64 * 64;
            /* parts of AMX_K_PART pairs where at least 8 pairs of blocks share each part's weights, else
             * of half as many (fewer pairs of blocks repay the larger part's weights less: 1.2x slower at 64 rows);
             * b_share: bytes of the next part's weights that each pair of blocks prefetches */
            const int64_t kpart = block_pairs >= 8 ? AMX_K_PART : AMX_K_PART / 2;
            const int64_t b_share = (kpart * 128 / block_pairs + 63) / 64 * 64;
            if (parts && silu) {
#pragma omp for schedule(static)
                for (int64_t p = 0; p < P2; ++p) {
                    for (int h = 0; h < 2; ++h) {    /* the gate panel's sums, then the up panel's */
                        const uint16_t *panel = wp + (p + h * P2) * K2 * 64;
                        for (int64_t k0 = 0; k0 < K2; k0 += kpart) {
                            const int64_t k1 = k0 + kpart < K2 ? k0 + kpart : K2;
                            /* the part after this one: this panel's next, else the up panel's first, else
                             * the next gate panel's first */
                            const char *next = (const char *)(k1 < K2 ? panel + k1 * 64
                                                              : h == 0 ? wp + (p + P2) * K2 * 64 : wp + (p + 1) * K2 * 64);
                            for (int64_t m = m0; m < m1; m += 32) {
                                const uint16_t *a0 = xt + (m / 16) * nkb * 512;
                                amx_block32_part(a0, a0 + nkb * 512, panel, k0, k1,
                                                 cb + h * (cb_floats / 2) + ((m - m0) / 32) * 1024, k0 > 0,
                                                 next + (m - m0) / 32 * b_share, b_share / 64);
                            }
                        }
                    }
                    for (int64_t m = m0; m < m1; m += 32) {
                        const float *cg = cb + ((m - m0) / 32) * 1024;
                        amx_put_silu(cg, cg + cb_floats / 2, 32, m1 - m < 32 ? m1 - m : 32,
                                     bias == NULL ? NULL : bias + 32 * p, bias == NULL ? NULL : bias + half + 32 * p,
                                     yh + m * ys + 32 * p, ys, stream, table);
                    }
                }
                continue;
            }
            if (parts) {
#pragma omp for schedule(static)
                for (int64_t p = 0; p < P; ++p) {
                    const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
                    const uint16_t *panel = wp + p * K2 * 64;
                    for (int64_t k0 = 0; k0 < K2; k0 += kpart) {
                        const int64_t k1 = k0 + kpart < K2 ? k0 + kpart : K2;
                        for (int64_t m = m0; m < m1; m += 32) {
                            const uint16_t *a0 = xt + (m / 16) * nkb * 512;
                            float *cm = cb + ((m - m0) / 32) * 1024;
                            /* the part after this one follows it in memory (the next panel's first after the last) */
                            amx_block32_part(a0, a0 + nkb * 512, panel, k0, k1, cm, k0 > 0,
                                             (const char *)(panel + k1 * 64) + (m - m0) / 32 * b_share, b_share / 64);
                            if (k1 < K2) continue;
                            if (stream && cols == 32)
                                amx_put_stream(cm, 32, m1 - m < 32 ? m1 - m : 32, bias == NULL ? NULL : bias + n0,
                                               yc + (m * ys + n0) * y_size, ys, y_bf16);
                            else
                                amx_put(cm, 32, m1 - m < 32 ? m1 - m : 32, cols, bias == NULL ? NULL : bias + n0,
                                        yc + (m * ys + n0) * y_size, ys, y_bf16);
                        }
                    }
                }
                continue;
            }
            if (silu) {
#pragma omp for schedule(static)
                for (int64_t p = 0; p < P2; ++p) {
                    const uint16_t *gate = wp + p * K2 * 64, *up = wp + (p + P2) * K2 * 64;
                    const char *next = p + 1 < P2 ? (const char *)(gate + K2 * 64) : NULL;
                    for (int64_t m = m0; m < m1; m += 32) {
                        const uint16_t *a0 = xt + (m / 16) * nkb * 512;
                        const int64_t share = (m - m0) / 32 * pf_step * steps;   /* of the next pair's panels */
                        amx_block32(a0, a0 + nkb * 512, gate, K2, c, 32, next == NULL ? NULL : next + share, pf_step);
                        amx_block32(a0, a0 + nkb * 512, up, K2, c2, 32,
                                    next == NULL ? NULL : next + P2 * K2 * 128 + share, pf_step);
                        amx_put_silu(c, c2, 32, m1 - m < 32 ? m1 - m : 32, bias == NULL ? NULL : bias + 32 * p,
                                     bias == NULL ? NULL : bias + half + 32 * p, yh + m * ys + 32 * p, ys, stream,
                                     table);
                    }
                }
                continue;
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; ++p) {
                const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
                const char *next = p + 1 < P ? (const char *)(wp + (p + 1) * K2 * 64) : NULL;
                for (int64_t m = m0; m < m1; m += 32) {
                    const uint16_t *a0 = xt + (m / 16) * nkb * 512;
                    amx_block32(a0, a0 + nkb * 512, wp + p * K2 * 64, K2, c, 32,
                                next == NULL ? NULL : next + (m - m0) / 32 * pf_step * steps, pf_step);
                    if (stream && cols == 32)
                        amx_put_stream(c, 32, m1 - m < 32 ? m1 - m : 32, bias == NULL ? NULL : bias + n0,
                                       yc + (m * ys + n0) * y_size, ys, y_bf16);
                    else
                        amx_put(c, 32, m1 - m < 32 ? m1 - m : 32, cols, bias == NULL ? NULL : bias + n0,
                                yc + (m * ys + n0) * y_size, ys, y_bf16);
                }
            }
        }
        if (stream) _mm_sfence();   /* the streaming stores are visible before the product returns */
        _tile_release();
    }
    free(cbuf);
    free(xt);
    return 0;
}
#else
#define QWEN_AMX 0
#endif

/* How the products on bf16 weights run here, one choice per process: 2, AMX tiles (where the CPU
 * has them and Linux grants them); else 1, AVX512-BF16 dot products, where the CPU has them and
 * they are the faster (bf16_dot_is_faster); else 0, widening loads into fp32 FMAs.
 * QWEN_OPS_BF16_PRODUCTS names the path instead ("amx" or "dot" where the CPU has it, else
 * widening; or "widening"). One choice for every product and row count, so a row's result never
 * depends on its batch. */
int qwen_bf16_products(void) {
    static int choice = -1;
    if (choice < 0) {
        const char *forced = getenv("QWEN_OPS_BF16_PRODUCTS");
#if QWEN_DPBF16
        const int dot = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
        const int dot = 0;
#endif
#if QWEN_AMX
        const int amx = amx_usable() ? 2 : 0;
#else
        const int amx = 0;
#endif
        if (forced != NULL && strcmp(forced, "widening") == 0) choice = 0;
        else if (forced != NULL && strcmp(forced, "dot") == 0) choice = dot;
        else if (forced != NULL && strcmp(forced, "amx") == 0) choice = amx;
#if QWEN_DPBF16
        else choice = amx ? amx : dot && bf16_dot_is_faster();
#else
        else choice = amx;
#endif
    }
    return choice;
}

/* qwen_linear_packed on bf16 weights packed by qwen_pack_panels_bf16 (fp32 x, y and bias). */
void qwen_linear_packed_bf16(const float *x, int64_t xs, int64_t M, const uint16_t *wp, const float *bias,
                             int64_t N, int64_t K, float *y, int64_t ys, int64_t threads) {
#if QWEN_AMX
    if (qwen_bf16_products() == 2 && linear_packed_amx(x, 1, xs, M, wp, bias, N, K, y, 0, ys, (int)threads, 0) == 0) return;
#endif
#if QWEN_DPBF16
    if (qwen_bf16_products() == 1 && linear_packed_dpbf16(x, xs, M, wp, bias, N, K, y, ys, (int)threads) == 0) return;
#endif
#if QWEN_AVX512
    linear_packed_avx512(x, xs, M, wp, bias, N, K, y, ys, 1, (int)threads);
#else
    (void)threads;
    const int64_t P = (N + 31) / 32, K2 = (K + 1) / 2;
    for (int64_t p = 0; p < P; ++p) {
        const uint16_t *panel = wp + p * K2 * 64;
        const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
        const float *b = bias == NULL ? NULL : bias + n0;
        for (int64_t m = 0; m < M; ++m) {
            float total[32] = {0};
            const float *xr = x + m * xs;
            for (int64_t k0 = 0; k0 < K; k0 += PANEL_KB) {
                const int64_t k1 = K - k0 < PANEL_KB ? K : k0 + PANEL_KB;
                float acc[32] = {0};
                for (int64_t k = k0; k < k1; ++k) {
                    const float a = xr[k];
                    const uint16_t *w = panel + (k / 2) * 64 + (k & 1);
                    for (int j = 0; j < 32; ++j) acc[j] += a * bf16_to_f32(w[2 * j]);
                }
                for (int j = 0; j < 32; ++j) total[j] += acc[j];
            }
            for (int64_t j = 0; j < cols; ++j) y[m * ys + n0 + j] = total[j] + (b == NULL ? 0.0f : b[j]);
        }
    }
#endif
}

/* ----------------------------------------------------------------------------------------------
 * The kernels of torch.ops.qwen.linear_packed, rms_norm, add_rms_norm, qk_norm_rope and silu_mul
 * (qwen_ops/ops/kernels/cpu.py): the pieces above on tensors of the model's dtype. dtype 0: fp32
 * in and out. dtype 2: bf16 tensors, widened to fp32 rows here, computed with the roundings of a
 * bf16 model (bf16 != 0 above), and stored rounded to bf16 (round to nearest even, as torch).
 * Each returns 0, or -1 when scratch memory could not be allocated (nothing written).
 * ---------------------------------------------------------------------------------------------- */

#if QWEN_DPBF16
/* dpbf16_panels with bf16 results and no [M, N] fp32 buffer: each block of rows x a panel's 32 features sums
 * into a tile that stays in L1 (the k blocks and order of dpbf16_panels), then is rounded to bf16 into y (row
 * stride ys) as store_row rounds. silu (N / 2 a multiple of 32; QWEN_AMX, whose amx_put_silu it shares): y
 * [M, N / 2] = silu_mul of the gate and up halves, each gate panel's tile with its up panel's, so
 * linear_packed then silu_mul, bit for bit, without the product's rows. The buffer's first touch (fresh
 * pages at prefill sizes) and its extra pass were the gap to oneDNN's GEMM on the AMD EPYC VM
 * (bench_prefill_products.py, 512 rows, Qwen3-0.6B's four products): 1.09x its time -> 1.01-1.03x; a 2,000-token
 * bf16 prompt's first token 11.6 -> 11.1 s; 8-request decode 75.7 -> 79 tok/s. */
static QWEN_DPBF16_TARGET void dpbf16_panels_bf16(const uint32_t *xp, int64_t xps, int64_t M, const uint16_t *wp,
                                                  const float *bias, int64_t N, int64_t K, uint16_t *y, int64_t ys,
                                                  int silu, int threads) {
    (void)threads;   /* without OpenMP */
    const int64_t K2 = (K + 1) / 2, P = (N + 31) / 32, PO = silu ? P / 2 : P;
#if QWEN_AMX
    const uint16_t *table = silu ? silu_table() : NULL;
#endif
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < PO; ++p) {
        float tile[2][PANEL_MR * 32] __attribute__((aligned(64)));
        const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
        for (int64_t m = 0; m < M; m += PANEL_MR) {
            const int64_t mr = M - m < PANEL_MR ? M - m : PANEL_MR;
#if QWEN_AMX
            if (silu) {
                dpbf16_block(xp + m * xps, xps, wp + p * K2 * 64, K2, NULL, tile[0], 32, 32, mr);
                dpbf16_block(xp + m * xps, xps, wp + (p + PO) * K2 * 64, K2, NULL, tile[1], 32, 32, mr);
                amx_put_silu(tile[0], tile[1], 32, mr, bias == NULL ? NULL : bias + n0,
                             bias == NULL ? NULL : bias + N / 2 + n0, y + m * ys + n0, ys, 0, table);
                continue;
            }
#endif
            dpbf16_block(xp + m * xps, xps, wp + p * K2 * 64, K2, bias == NULL ? NULL : bias + n0, tile[0], 32, cols,
                         mr);
            for (int64_t r = 0; r < mr; ++r) f32_row_to_bf16(tile[0] + r * 32, cols, y + (m + r) * ys + n0);
        }
    }
}

/* Rows from which qwen_linear_silu_mul on VDPBF16PS pairs each gate panel's tile with its up panel's
 * (dpbf16_panels_bf16's silu) rather than storing the product's rows and then qwen_silu_mul. Below, the
 * weights come from DRAM about once per product and gate and up panels in turn read two streams of them:
 * Qwen3-0.6B's gate|up (6,144 x 1,024), weights cold, AMD EPYC, fused / unfused time: 1 row 1.02, 12-16 rows
 * 1.05-1.13, 32-128 rows 1.01-1.05, 192 rows level, 256 0.98-1.00, 384-512 0.97-0.99. */
#define DP_SILU_MIN_ROWS 256

/* Whether bf16 rows x (stride xs) are VDPBF16PS's pairs as they are: K even, pairs aligned. */
#define DP_ROWS_AS_PAIRS(x, xs, K) ((K) % 2 == 0 && (xs) % 2 == 0 && ((uintptr_t)(x) & 3u) == 0)

/* qwen_linear (silu: qwen_linear_silu_mul) on bf16 rows by VDPBF16PS, rows as pairs (DP_ROWS_AS_PAIRS). Rows
 * whose stride is a multiple of 1 KB are copied to rows of dpbf16_stride first: a block's 12 rows would
 * otherwise share 4 or fewer of L1's 64 sets (at K = 2048, one set for 12 lines of 8 ways: the products ran
 * at 0.78x the speed). Returns -1 when that copy's memory could not be allocated. */
static int linear_dpbf16_bf16(const void *x, int64_t xs, int64_t M, const uint16_t *wp, const float *bias, int64_t N,
                              int64_t K, uint16_t *y, int64_t ys, int silu, int threads) {
    const int copy = M > 1 && (xs * 2) % 1024 == 0;
    const int64_t K2 = K / 2, xps = copy ? dpbf16_stride(K2) : xs / 2;
    const uint32_t *xp = (const uint32_t *)x;
    uint32_t *xc = NULL;
    if (copy) {
        xc = malloc(sizeof(uint32_t) * (size_t)(M * xps));
        if (xc == NULL) return -1;
        for (int64_t m = 0; m < M; ++m) memcpy(xc + m * xps, (const uint16_t *)x + m * xs, sizeof(uint32_t) * (size_t)K2);
        xp = xc;
    }
    dpbf16_panels_bf16(xp, xps, M, wp, bias, N, K, y, ys, silu, threads);
    free(xc);
    return 0;
}
#endif

/* y [M, N] = x [M, K] w^T (+ bias, fp32) from packed weights of x's dtype; rows of strides xs, ys. */
int qwen_linear(const void *x, int64_t xs, int64_t M, const void *wp, const float *bias, int64_t N, int64_t K,
                void *y, int64_t ys, int dtype, int64_t threads) {
    if (dtype == 0) {
        qwen_linear_packed((const float *)x, xs, M, (const float *)wp, bias, N, K, (float *)y, ys, threads);
        return 0;
    }
#if QWEN_AMX
    if (qwen_bf16_products() == 2)   /* the fp32 sums (+ bias) rounded once to bf16, as torch */
        return linear_packed_amx(x, 0, xs, M, (const uint16_t *)wp, bias, N, K, y, 1, ys, (int)threads, 0);
#endif
#if QWEN_DPBF16
    /* A bf16 row with an even K already is the bf16 pairs VDPBF16PS reads: no conversion of x */
    if (qwen_bf16_products() == 1 && DP_ROWS_AS_PAIRS(x, xs, K))
        return linear_dpbf16_bf16(x, xs, M, (const uint16_t *)wp, bias, N, K, (uint16_t *)y, ys, 0, (int)threads);
#endif
    float *buf = malloc(sizeof(float) * (size_t)(M * (K + N) > 0 ? M * (K + N) : 1));
    if (buf == NULL) return -1;
    float *xf = buf, *yf = buf + M * K;
    for (int64_t m = 0; m < M; ++m) load_row(x, m * xs, 2, K, xf + m * K);
    qwen_linear_packed_bf16(xf, K, M, (const uint16_t *)wp, bias, N, K, yf, N, threads);
    for (int64_t m = 0; m < M; ++m) store_row(y, m * ys, 2, N, yf + m * N);   /* one rounding, as torch */
    free(buf);
    return 0;
}

#if QWEN_AVX512
/* The bf16 rows of rms_norm, qk_norm_rope and silu_mul on 16 lanes at a time: the same operations in the
 * same order as their scalar forms above (rms_norm_rows, norm_rope_row, silu_mul_rows with bf16 != 0;
 * every product, sum and quotient rounded to fp32 on its own, then to bf16 where those round it), so
 * the same bits, in one pass over a row instead of widening, computing and narrowing it in three. */
static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* v holds bf16 values (round_bf16x16's results): their upper halves, exactly. */
static inline void bf16x16_store(uint16_t *p, __mmask16 k, __m512 v) {
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* round_bf16 on 16 lanes. */
static inline __m512 round_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), hi);
    const __m512i quiet = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), hi);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* 2^f for the fraction f of exp_nonpositive's reduction, 16 lanes: its degree-6 polynomial by fused
 * multiply-adds (as the compiler contracts the scalar form). exp_any_x16 and the flash path's exp2 share it. */
static inline __attribute__((always_inline)) __m512 exp2_fraction_x16(__m512 f) {
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

/* exp_any on 16 lanes: exp_nonpositive's steps (tested equal to it over every bf16 input of silu_mul). */
static inline __m512 exp_any_x16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(12582912.0f)), _mm512_set1_ps(12582912.0f));
    const __m512 p = exp2_fraction_x16(_mm512_sub_ps(t, n));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* round_bf16x16 in 5 operations instead of 9, for lanes whose NaNs are quiet with the low 16 bits clear:
 * what x86 arithmetic makes of bf16 values (an operation keeps a NaN operand's payload and sets its quiet
 * bit; an invalid one gives 0xffc00000). Such a NaN comes through the rounding unchanged, which is what
 * round_bf16x16 gives it; every other value (subnormals too) rounds as there. */
static inline __attribute__((always_inline)) __m512 round_bf16x16_of_bf16_math(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
                                                _mm512_set1_epi32((int)0xffff0000u)));
}

/* rms_norm_rows (bf16) of one bf16 row: sf receives s (fp32, for inv_rms), sum s as bf16 when add; wf fp32
 * holding bf16 values, so every rounding is of bf16 math (round_bf16x16_of_bf16_math). */
static void rms_norm_bf16_row(const uint16_t *x, const uint16_t *add, uint16_t *sum, const float *wf, uint16_t *out,
                              int64_t dim, float eps, float *sf) {
    for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 k = lanes_left(dim - d);
        __m512 v = bf16x16_load(x + d, k);
        if (add != NULL) {
            v = round_bf16x16_of_bf16_math(_mm512_add_ps(v, bf16x16_load(add + d, k)));
            bf16x16_store(sum + d, k, v);
        }
        _mm512_mask_storeu_ps(sf + d, k, v);
    }
    const __m512 inv = _mm512_set1_ps(inv_rms(sf, dim, eps));
    for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 k = lanes_left(dim - d);
        const __m512 normed = round_bf16x16_of_bf16_math(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, sf + d), inv));
        bf16x16_store(out + d, k, round_bf16x16_of_bf16_math(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, wf + d), normed)));
    }
}

/* norm_rope_row (bf16) of one bf16 head row, D a multiple of 32 up to 256, held in registers: w (fp32
 * holding bf16 values, NULL: no norm), cs the position's cos | sin rounded to bf16. Its values are bf16
 * values and what arithmetic makes of them, so round_bf16x16_of_bf16_math rounds them. The sum of squares
 * runs as inv_rms's (four accumulators, inv_rms_of_squares), so the same bits as the row through scratch. */
static inline __attribute__((always_inline)) void norm_rope_bf16_head(const uint16_t *x, const float *w, float eps,
                                                                      const float *cs, int64_t D, uint16_t *out) {
    __m512 v[16];
    const int64_t nv = D / 16, nh = nv / 2;
#pragma GCC unroll 16
    for (int64_t i = 0; i < nv; ++i) v[i] = bf16x16_load(x + 16 * i, 0xffff);
    if (w != NULL) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
        for (int64_t i = 0; i < nv; ++i) acc[i % 4] = _mm512_add_ps(acc[i % 4], _mm512_mul_ps(v[i], v[i]));
        const __m512 inv = _mm512_set1_ps(inv_rms_of_squares(acc, D, eps));
#pragma GCC unroll 16
        for (int64_t i = 0; i < nv; ++i)
            v[i] = round_bf16x16_of_bf16_math(
                _mm512_mul_ps(_mm512_loadu_ps(w + 16 * i), round_bf16x16_of_bf16_math(_mm512_mul_ps(v[i], inv))));
    }
#pragma GCC unroll 8
    for (int64_t i = 0; i < nh; ++i) {
        const __m512 c = _mm512_loadu_ps(cs + 16 * i), sn = _mm512_loadu_ps(cs + 16 * (nh + i));
        const __m512 x1 = v[i], x2 = v[nh + i];
        const __m512 a = round_bf16x16_of_bf16_math(_mm512_mul_ps(x1, c));
        const __m512 b = round_bf16x16_of_bf16_math(_mm512_mul_ps(x2, sn));
        const __m512 e = round_bf16x16_of_bf16_math(_mm512_mul_ps(x2, c));
        const __m512 f = round_bf16x16_of_bf16_math(_mm512_mul_ps(x1, sn));
        bf16x16_store(out + 16 * i, 0xffff, round_bf16x16_of_bf16_math(_mm512_sub_ps(a, b)));
        bf16x16_store(out + 16 * (nh + i), 0xffff, round_bf16x16_of_bf16_math(_mm512_add_ps(e, f)));
    }
}

/* norm_rope_bf16_head over heads n of one token (head h at x + h * xs, out + h * D); D = 128 unrolled. */
static void norm_rope_bf16_heads(const uint16_t *x, int64_t xs, int64_t n, const float *w, float eps, const float *cs,
                                 int64_t D, uint16_t *out) {
    if (D == 128)
        for (int64_t h = 0; h < n; ++h) norm_rope_bf16_head(x + h * xs, w, eps, cs, 128, out + h * 128);
    else
        for (int64_t h = 0; h < n; ++h) norm_rope_bf16_head(x + h * xs, w, eps, cs, D, out + h * D);
}

/* silu(g) rounded to bf16 (silu_mul_rows' first step, bf16), 16 lanes of bf16 values g. */
static inline __m512 silu_bf16x16(__m512 gv) {
    const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_any_x16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
    return round_bf16x16(_mm512_mask_mov_ps(_mm512_div_ps(gv, denom),
                                           _mm512_cmp_ps_mask(gv, _mm512_set1_ps(-88.0f), _CMP_LT_OQ),
                                           _mm512_set1_ps(-0.0f)));
}

/* silu_bf16x16 of every bf16 bit pattern, by its bits (a gate is bf16: 65,536 inputs; the table holds what
 * silu_bf16x16 computes, so the same bits, without the exp and the division per element: at 2,000 x 3,072
 * they were 4.6 ms of a layer's gate|up + SiLU). Two entries of padding: the gather reads 32 bits at the
 * entry's address. Filled once per process (silu_table). */
static uint16_t silu_bf16_entries[65536 + 2];
static pthread_once_t silu_bf16_once = PTHREAD_ONCE_INIT;

static void silu_bf16_fill(void) {
    for (int32_t i = 0; i < 65536; i += 16) {
        const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i),
                                              _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
        bf16x16_store(silu_bf16_entries + i, 0xffff, silu_bf16x16(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))));
    }
}

static const uint16_t *silu_table(void) {
    pthread_once(&silu_bf16_once, silu_bf16_fill);
    return silu_bf16_entries;
}

/* silu_mul_rows (bf16) of one row of bf16 gate and up; table: silu_table(). */
static void silu_mul_bf16_row(const uint16_t *table, const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t dim) {
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 k = lanes_left(dim - i);
        const __m512i idx = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, g + i));
        const __m512i entry = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, table, 2);
        const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(entry, 16));    /* the entry's 16 bits */
        bf16x16_store(o + i, k, round_bf16x16(_mm512_mul_ps(silu, bf16x16_load(u + i, k))));
    }
}
#endif

/* out = w * (s / rms(s)) per row of dim, s = x (+ add, written to sum when add is given); x, add,
 * sum, out and w all of dtype; row strides x_s0, add_s0, sum_s0, out_s0. */
int qwen_rms_norm(const void *x, int64_t x_s0, const void *add, int64_t add_s0, void *sum, int64_t sum_s0,
                  const void *w, void *out, int64_t out_s0, int64_t rows, int64_t dim, float eps, int dtype) {
    if (dtype == 0) {
        rms_norm_rows(x, x_s0, add, add_s0, sum, sum_s0, w, out, out_s0, rows, dim, eps, 0);
        return 0;
    }
    float *buf = malloc(sizeof(float) * (size_t)(5 * dim));
    if (buf == NULL) return -1;
    float *wf = buf, *xf = wf + dim, *af = xf + dim, *sf = af + dim, *of = sf + dim;
    load_row(w, 0, 2, dim, wf);
#if QWEN_AVX512
    for (int64_t r = 0; r < rows; ++r)
        rms_norm_bf16_row((const uint16_t *)x + r * x_s0, add == NULL ? NULL : (const uint16_t *)add + r * add_s0,
                          add == NULL ? NULL : (uint16_t *)sum + r * sum_s0, wf, (uint16_t *)out + r * out_s0, dim, eps,
                          sf);
    free(buf);
    return 0;
#endif
    for (int64_t r = 0; r < rows; ++r) {
        load_row(x, r * x_s0, 2, dim, xf);
        if (add != NULL) load_row(add, r * add_s0, 2, dim, af);
        rms_norm_rows(xf, dim, add == NULL ? NULL : af, dim, sf, dim, wf, of, dim, 1, dim, eps, 1);
        if (add != NULL) store_row(sum, r * sum_s0, 2, dim, sf);   /* already bf16 values: exact */
        store_row(out, r * out_s0, 2, dim, of);
    }
    free(buf);
    return 0;
}

/* q [T, nq, D], k [T, nk, D] (strides in elements, head rows contiguous) -> contiguous qo, ko of
 * dtype: per head RMSNorm with q_w / k_w (dtype; skipped when NULL), then RoPE at positions[t]
 * from the fp32 table [max_pos, D] (cos | sin), whose values a bf16 model rounds to bf16 first. */
int qwen_qk_norm_rope(const void *q, int64_t q_s0, int64_t q_s1, int64_t nq,
                      const void *k, int64_t k_s0, int64_t k_s1, int64_t nk,
                      const void *q_w, const void *k_w, float eps,
                      const float *table, int64_t table_s0, const int32_t *positions,
                      void *qo, void *ko, int64_t T, int64_t D, int dtype) {
    float *buf = malloc(sizeof(float) * (size_t)(6 * D));
    if (buf == NULL) return -1;
    float *tmp = buf, *qw = tmp + D, *kw = qw + D, *cs = kw + D, *row = cs + D, *res = row + D;
    if (dtype == 0) {
        qk_norm_rope_rows(q, q_s0, q_s1, nq, k, k_s0, k_s1, nk, q_w, k_w, eps, table, table_s0, positions,
                          qo, ko, T, D, tmp, 0);
        free(buf);
        return 0;
    }
    if (q_w != NULL) load_row(q_w, 0, 2, D, qw);
    if (k_w != NULL) load_row(k_w, 0, 2, D, kw);
    for (int64_t t = 0; t < T; ++t) {
        const float *c = table + (int64_t)positions[t] * table_s0;
#if QWEN_AVX512
        if (D % 32 == 0 && D <= 256) {
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(cs + d, round_bf16x16(_mm512_loadu_ps(c + d)));
            norm_rope_bf16_heads((const uint16_t *)q + t * q_s0, q_s1, nq, q_w == NULL ? NULL : qw, eps, cs, D,
                                 (uint16_t *)qo + t * nq * D);
            norm_rope_bf16_heads((const uint16_t *)k + t * k_s0, k_s1, nk, k_w == NULL ? NULL : kw, eps, cs, D,
                                 (uint16_t *)ko + t * nk * D);
            continue;
        }
#endif
        for (int64_t d = 0; d < D; ++d) cs[d] = round_bf16(c[d]);
        for (int64_t h = 0; h < nq + nk; ++h) {
            const int is_q = h < nq;
            const int64_t hh = is_q ? h : h - nq;
            load_row(is_q ? q : k, is_q ? t * q_s0 + hh * q_s1 : t * k_s0 + hh * k_s1, 2, D, row);
            const void *w = is_q ? q_w : k_w;
            norm_rope_row(row, w == NULL ? NULL : (is_q ? qw : kw), eps, cs, D, tmp, res, 1);
            store_row(is_q ? qo : ko, (t * (is_q ? nq : nk) + hh) * D, 2, D, res);
        }
    }
    free(buf);
    return 0;
}

/* y [M, N] (rows ys apart; fp32, or bf16 when y_bf16) += (x [M, K] (rows xs apart; fp32 or bf16) summed per
 * group of K / G, fp32, in order) @ mt [G, N] (fp32, rows ld apart): a quantized weight's per-group minimums
 * (group_mins_add). bf16 y is rounded once, from y + the fp32 term. */
int qwen_group_mins_add(void *y, int64_t ys, int64_t y_bf16, const void *x, int64_t xs, int64_t x_bf16, int64_t M,
                        int64_t K, const float *mt, int64_t ld, int64_t G, int64_t N) {
    const int64_t g = K / G;
    float *sums = (float *)malloc(sizeof(float) * (size_t)G), *acc = (float *)malloc(sizeof(float) * (size_t)N);
    if (sums == NULL || acc == NULL) {
        free(sums);
        free(acc);
        return -1;
    }
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t gi = 0; gi < G; ++gi) {
            float s = 0.0f;
            if (x_bf16) {
                const uint16_t *xr = (const uint16_t *)x + m * xs + gi * g;
                for (int64_t k = 0; k < g; ++k) s += bf16_to_f32(xr[k]);
            } else {
                const float *xr = (const float *)x + m * xs + gi * g;
                for (int64_t k = 0; k < g; ++k) s += xr[k];
            }
            sums[gi] = s;
        }
        for (int64_t n = 0; n < N; ++n) acc[n] = 0.0f;
        for (int64_t gi = 0; gi < G; ++gi) {
            const float s = sums[gi], *row = mt + gi * ld;
#pragma omp simd
            for (int64_t n = 0; n < N; ++n) acc[n] += s * row[n];
        }
        if (y_bf16) {
            uint16_t *yr = (uint16_t *)y + m * ys;
            for (int64_t n = 0; n < N; ++n) yr[n] = f32_to_bf16(bf16_to_f32(yr[n]) + acc[n]);
        } else {
            float *yr = (float *)y + m * ys;
#pragma omp simd
            for (int64_t n = 0; n < N; ++n) yr[n] += acc[n];
        }
    }
    free(sums);
    free(acc);
    return 0;
}

/* out [rows, dim] (contiguous) = silu(gate) * up, gate and up rows of strides g_s0, u_s0, all of dtype. */
int qwen_silu_mul(const void *gate, int64_t g_s0, const void *up, int64_t u_s0, void *out, int64_t rows, int64_t dim,
                  int dtype) {
    if (dtype == 0) {
        silu_mul_rows(gate, g_s0, up, u_s0, out, rows, dim, 0);
        return 0;
    }
#if QWEN_AVX512
    const uint16_t *table = silu_table();
    for (int64_t r = 0; r < rows; ++r)
        silu_mul_bf16_row(table, (const uint16_t *)gate + r * g_s0, (const uint16_t *)up + r * u_s0,
                          (uint16_t *)out + r * dim, dim);
    return 0;
#endif
    float *buf = malloc(sizeof(float) * (size_t)(3 * dim));
    if (buf == NULL) return -1;
    float *g = buf, *u = g + dim, *o = u + dim;
    for (int64_t r = 0; r < rows; ++r) {
        load_row(gate, r * g_s0, 2, dim, g);
        load_row(up, r * u_s0, 2, dim, u);
        silu_mul_rows(g, dim, u, dim, o, 1, dim, 1);
        store_row(out, r * dim, 2, dim, o);
    }
    free(buf);
    return 0;
}

/* out [M, N / 2] (contiguous) = silu_mul(linear_packed(x)): an MLP's gate | up product and its SiLU in one
 * call (torch.ops.qwen.linear_silu_mul_packed). On the AMX tiles, and by VDPBF16PS from DP_SILU_MIN_ROWS rows (bf16,
 * N / 2 a multiple of 32), the sums go through amx_put_silu and the product's rows are never stored;
 * elsewhere the product's rows, then qwen_silu_mul. The same bits either way. Returns -1 when scratch memory could not be allocated. */
int qwen_linear_silu_mul(const void *x, int64_t xs, int64_t M, const void *wp, const float *bias, int64_t N, int64_t K,
                         void *out, int dtype, int64_t threads) {
#if QWEN_AMX
    if (dtype == 2 && qwen_bf16_products() == 2 && N % 64 == 0)
        return linear_packed_amx(x, 0, xs, M, (const uint16_t *)wp, bias, N, K, out, 1, N / 2, (int)threads, 1);
#endif
#if QWEN_DPBF16 && QWEN_AMX
    /* AVX512-BF16 without AMX, from DP_SILU_MIN_ROWS rows */
    if (dtype == 2 && qwen_bf16_products() == 1 && (N / 2) % 32 == 0 && DP_ROWS_AS_PAIRS(x, xs, K) &&
        M >= DP_SILU_MIN_ROWS)
        return linear_dpbf16_bf16(x, xs, M, (const uint16_t *)wp, bias, N, K, (uint16_t *)out, N / 2, 1, (int)threads);
#endif
    const size_t elem = dtype == 0 ? 4 : 2;
    char *gate_up = malloc(elem * (size_t)(M * N > 0 ? M * N : 1));
    if (gate_up == NULL) return -1;
    int status = qwen_linear(x, xs, M, wp, bias, N, K, gate_up, N, dtype, threads);
    if (status == 0) status = qwen_silu_mul(gate_up, N, gate_up + elem * (size_t)(N / 2), N, out, M, N / 2, dtype);
    free(gate_up);
    return status;
}

/* A mixture-of-experts layer's routed experts on packed fp32 weights (torch.ops.qwen.moe_packed): out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j],
 * over the k choices of each of the T rows. w13[e]: the address of expert e's packed [2 I, H]
 * panels (gate rows, then up rows); w2[e]: its packed [H, I]. The rows routed to an expert are
 * gathered (a counting sort by expert, rows in order), run through its two products as one
 * block, and added back weighted, so each expert's weights stream once per call, as
 * torch.ops.qwen.fused_moe's grouped GEMMs do. out is overwritten. Returns 0; -1 when scratch
 * memory could not be allocated; -3 when an id is outside [0, E) (checked before any write). */
int qwen_moe_packed(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *weights, int64_t k,
                    int64_t E, const int64_t *w13, const int64_t *w2, int64_t I, float *out, int64_t threads) {
    const int64_t n = T * k;
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= E) return -3;
    int64_t *start = calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (start == NULL || order == NULL) {
        free(start);
        free(order);
        return -1;
    }
    for (int64_t i = 0; i < n; ++i) start[ids[i] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e) {
        if (start[e + 1] > most) most = start[e + 1];
        start[e + 1] += start[e];
    }
    {
        int64_t *fill = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
        if (fill == NULL) {
            free(start);
            free(order);
            return -1;
        }
        memcpy(fill, start, sizeof(int64_t) * (size_t)E);
        for (int64_t i = 0; i < n; ++i) order[fill[ids[i]]++] = i;     /* choice i = row i / k */
        free(fill);
    }
    const int64_t m = most > 0 ? most : 1;
    float *xs = malloc(sizeof(float) * (size_t)(m * (2 * H + 3 * I)));
    if (xs == NULL) {
        free(start);
        free(order);
        return -1;
    }
    float *gu = xs + m * H, *hs = gu + m * 2 * I, *ys = hs + m * I;
    memset(out, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t e = 0; e < E; ++e) {
        const int64_t first = start[e], rows = start[e + 1] - first;
        if (rows == 0) continue;
        for (int64_t r = 0; r < rows; ++r) memcpy(xs + r * H, x + (order[first + r] / k) * H, sizeof(float) * (size_t)H);
        qwen_linear_packed(xs, H, rows, (const float *)w13[e], NULL, 2 * I, H, gu, 2 * I, threads);
        silu_mul_rows(gu, 2 * I, gu + I, 2 * I, hs, rows, I, 0);
        qwen_linear_packed(hs, I, rows, (const float *)w2[e], NULL, H, I, ys, H, threads);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t choice = order[first + r];
            const float w = weights[choice];
            float *dst = out + (choice / k) * H;
            const float *src = ys + r * H;
#pragma omp simd
            for (int64_t c = 0; c < H; ++c) dst[c] += w * src[c];
        }
    }
    free(xs);
    free(start);
    free(order);
    return 0;
}

/* ----------------------------------------------------------------------------------------------
 * Quantized weights: torch.ops.qwen.linear_int8 / linear_int4 / linear_fp8 (references in
 * qwen_ops/ops/kernels/reference_quant.py). y [M, N] = x [M, K] w^T (+ bias), x and y fp32 (rows
 * of strides xs, ys), w dequantized on the fly from bytes, one fp32 rounding per weight:
 *   kind 0, int8: q int8 [N, K];                   w = q * s[n][k / g]
 *   kind 1, int4: q uint8 [N, K / 2], element k in nibble k % 2 (low first) of byte k / 2;
 *                                                  w = (q - z[n][k / g]) * s[n][k / g], z uint8
 *   kind 2, fp8:  q float8_e4m3fn [N, K];          w = fp32(q) * s[n / bn][k / g]
 * s (and z) rows hold sg = ceil(K / g) groups. Products accumulate in fp32.
 * Up to 4 rows (decode) read every weight byte once: the point is bandwidth, so 4 weight rows are read
 * side by side (4 streams) against the rows of x (which stay in L1). More than 4 rows
 * (prefill): 4 weight rows are dequantized once into an fp32 block (L1/L2) and every row of x is
 * multiplied by it, 4 at a time. threads > 1 (OpenMP builds): the blocks of 4 weight rows are
 * split across that many threads; each output is computed by one thread, in the same order
 * whatever the thread count. The AVX-512 path needs K and g multiples of 16 (every checkpoint's);
 * other shapes take the portable loop.
 * fp8 (e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits) widens exactly by moving the 7
 * magnitude bits to an fp32's exponent/mantissa position and scaling by 2^120, subnormals
 * included; the NaN code (0x7f / 0xff) is not decoded (a checkpoint holds none).
 * ---------------------------------------------------------------------------------------------- */

static inline float fp8_e4m3_to_f32(uint8_t b) {
    const uint32_t mag = (uint32_t)(b & 0x7f) << 20;
    float f;
    memcpy(&f, &mag, 4);
    f *= 1.329227995784916e36f;   /* 2^120 */
    return (b & 0x80) ? -f : f;
}

/* How many weight rows ahead the one-request _a8 products prefetch: about 16 KB, a multiple of 4
 * rows. Measured at one row on 96 MB of weights: int8 rows of 1 KB read 10.5 GB/s prefetching 4 rows
 * (4 KB) ahead, 13.5 at 8 rows, 14.5-15 at 16, 11.5 at 32. (The fp32-activation kernels, which do
 * more work a byte, measured no better at 16 KB and keep 4 rows.) */
static inline int64_t rows_ahead(int64_t row_bytes) {
    const int64_t n = (16384 / row_bytes + 3) / 4 * 4;
    return n < 4 ? 4 : n;
}

static inline float dequant_one(int kind, const uint8_t *row, int64_t k) {
    if (kind == 0) return (float)(int8_t)row[k];
    if (kind == 1) return (float)((row[k >> 1] >> ((k & 1) * 4)) & 15);
    return fp8_e4m3_to_f32(row[k]);
}

/* Output features n0 .. N - 1, element by element (x in its natural order). */
static void quant_rows_portable(int kind, const float *x, int64_t xs, int64_t M, const uint8_t *q, const float *s,
                                const uint8_t *z, int64_t g, int64_t bn, const float *bias, int64_t n0, int64_t N,
                                int64_t K, float *y, int64_t ys, int threads) {
    (void)threads;
    const int64_t sg = (K + g - 1) / g, row_bytes = kind == 1 ? K / 2 : K;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t n = n0; n < N; ++n) {
        const uint8_t *qr = q + n * row_bytes;
        const int64_t srow = (kind == 2 ? n / bn : n) * sg;
        for (int64_t m = 0; m < M; ++m) {
            const float *xr = x + m * xs;
            float total = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                const int64_t grp = srow + k / g;
                float w = dequant_one(kind, qr, k);
                if (kind == 1) w -= (float)z[grp];
                total += xr[k] * (w * s[grp]);
            }
            y[m * ys + n] = total + (bias == NULL ? 0.0f : bias[n]);
        }
    }
}

#if QWEN_AVX512
/* Raw weights (before scale and zero), as fp32. int8 / fp8: 16 elements from k (k % 16 == 0).
 * int4: 32 elements from k (k % 32 == 0) as two vectors, lo = elements k, k+2, ..., k+30 (the low
 * nibbles) and hi = k+1, ..., k+31 (the high ones); x is permuted to match (quant_permute_x), so no
 * shuffle is needed. fp8 widens in the integer domain (no arithmetic on fp32 subnormals, which
 * costs a microcode assist per instruction on these CPUs): exponent e >= 1 moves to fp32's field
 * with the bias difference (120) added; e = 0 is m * 2^-9, exactly. */
static inline __attribute__((always_inline)) __m512 raw16(int kind, const uint8_t *row, int64_t k) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + k));
    if (kind == 0) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const __m512i b = _mm512_cvtepu8_epi32(bytes);
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f));   /* 2^-9 */
    const __m512 f = _mm512_mask_mov_ps(normal, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), subnormal);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

static inline __attribute__((always_inline)) void raw32_int4(const uint8_t *row, int64_t k, __m512 *lo, __m512 *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(row + k / 2)), mask = _mm_set1_epi8(15);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
}

/* Weight rows n0 .. n0 + 3 of a block: their bytes, and where their scale (and zero) rows start
 * (fp8's scale rows cover bn output features each). */
static inline __attribute__((always_inline)) void quant_block_rows(int kind, const uint8_t *q, int64_t row_bytes,
                                                                   int64_t sg, int64_t bn, int64_t n0,
                                                                   const uint8_t *rows[4], int64_t srow[4]) {
    for (int r = 0; r < 4; ++r) {
        rows[r] = q + (n0 + r) * row_bytes;
        srow[r] = (kind == 2 ? (n0 + r) / bn : n0 + r) * sg;
    }
}

/* One request or two (decode): y[m][n0 .. n0 + 3], the 4 weight rows read side by side. Per group,
 * sum_k q x in fp32 vectors, then times the group's scale into the row's total; int4 subtracts
 * z * s * sum_k x (xsum[m * sg + grp], the group sums of x) at the end. The next 4 rows are
 * prefetched a cache line at a time (each row is only K bytes, too short a stream for the
 * hardware prefetcher to get ahead; 16 KB ahead, as the _a8 kernel, measured no better here). */
static inline __attribute__((always_inline)) void quant_block_stream(
        int kind, int MR, const float *x, int64_t xs, const float *xsum, const uint8_t *q, int64_t row_bytes,
        const float *s, const uint8_t *z, int64_t sg, int64_t g, int64_t bn, int64_t n0, int64_t K, int prefetch,
        float out[4][4]) {
    __m512 acc[4][2];
    float zs[4][2] = {{0}};
    for (int r = 0; r < 4; ++r)
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
    const uint8_t *rows[4];
    int64_t srow[4];
    quant_block_rows(kind, q, row_bytes, sg, bn, n0, rows, srow);
    const int64_t step = kind == 1 ? 32 : 16;
    for (int64_t k0 = 0, grp = 0; k0 < K; k0 += g, ++grp) {
        const int64_t k1 = K - k0 < g ? K : k0 + g;
        __m512 part[4][2];
        for (int r = 0; r < 4; ++r)
            for (int m = 0; m < MR; ++m) part[r][m] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += step) {
            const int64_t byte = kind == 1 ? k / 2 : k;
            if (prefetch && (byte & 63) == 0)
                for (int r = 0; r < 4; ++r) _mm_prefetch((const char *)(rows[r] + 4 * row_bytes + byte), _MM_HINT_T0);
            if (kind == 1) {
                __m512 xlo[2], xhi[2];
                for (int m = 0; m < MR; ++m) {
                    xlo[m] = _mm512_loadu_ps(x + m * xs + k);
                    xhi[m] = _mm512_loadu_ps(x + m * xs + k + 16);
                }
                for (int r = 0; r < 4; ++r) {
                    __m512 lo, hi;
                    raw32_int4(rows[r], k, &lo, &hi);
                    for (int m = 0; m < MR; ++m)
                        part[r][m] = _mm512_fmadd_ps(hi, xhi[m], _mm512_fmadd_ps(lo, xlo[m], part[r][m]));
                }
            } else {
                __m512 xv[2];
                for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * xs + k);
                for (int r = 0; r < 4; ++r) {
                    const __m512 w = raw16(kind, rows[r], k);
                    for (int m = 0; m < MR; ++m) part[r][m] = _mm512_fmadd_ps(w, xv[m], part[r][m]);
                }
            }
        }
        for (int r = 0; r < 4; ++r) {
            const float sc = s[srow[r] + grp];
            for (int m = 0; m < MR; ++m) {
                acc[r][m] = _mm512_fmadd_ps(part[r][m], _mm512_set1_ps(sc), acc[r][m]);
                if (kind == 1) zs[r][m] += (float)z[srow[r] + grp] * sc * xsum[m * sg + grp];
            }
        }
    }
    for (int m = 0; m < MR; ++m) {
        const __m128 t = sum4_avx512(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
        _mm_storeu_ps(out[m], t);
        for (int r = 0; r < 4; ++r) out[m][r] -= zs[r][m];
    }
}

/* Three or four requests: as quant_block_stream, but each weight is scaled (and int4's zero
 * subtracted) before its FMAs, (q - z) * s as the reference, so one accumulator per (row, request)
 * is enough: 16 for 4 x 4, where per-group partial sums would need 32 registers. */
static inline __attribute__((always_inline)) void quant_block_stream_scaled(
        int kind, int MR, const float *x, int64_t xs, const float *xsum, const uint8_t *q, int64_t row_bytes,
        const float *s, const uint8_t *z, int64_t sg, int64_t g, int64_t bn, int64_t n0, int64_t K, int prefetch,
        float out[4][4]) {
    (void)xsum;
    __m512 acc[4][4];
    for (int r = 0; r < 4; ++r)
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
    const uint8_t *rows[4];
    int64_t srow[4];
    quant_block_rows(kind, q, row_bytes, sg, bn, n0, rows, srow);
    const int64_t step = kind == 1 ? 32 : 16;
    for (int64_t k0 = 0, grp = 0; k0 < K; k0 += g, ++grp) {
        const int64_t k1 = K - k0 < g ? K : k0 + g;
        __m512 sc[4], zc[4];
        for (int r = 0; r < 4; ++r) {
            sc[r] = _mm512_set1_ps(s[srow[r] + grp]);
            zc[r] = _mm512_set1_ps(kind == 1 ? (float)z[srow[r] + grp] : 0.0f);
        }
        for (int64_t k = k0; k < k1; k += step) {
            const int64_t byte = kind == 1 ? k / 2 : k;
            if (prefetch && (byte & 63) == 0)
                for (int r = 0; r < 4; ++r) _mm_prefetch((const char *)(rows[r] + 4 * row_bytes + byte), _MM_HINT_T0);
            if (kind == 1) {
                for (int r = 0; r < 4; ++r) {
                    __m512 lo, hi;
                    raw32_int4(rows[r], k, &lo, &hi);
                    lo = _mm512_mul_ps(_mm512_sub_ps(lo, zc[r]), sc[r]);
                    hi = _mm512_mul_ps(_mm512_sub_ps(hi, zc[r]), sc[r]);
                    for (int m = 0; m < MR; ++m)
                        acc[r][m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * xs + k + 16),
                                                    _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * xs + k), acc[r][m]));
                }
            } else {
                __m512 xv[4];
                for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * xs + k);
                for (int r = 0; r < 4; ++r) {
                    const __m512 w = _mm512_mul_ps(raw16(kind, rows[r], k), sc[r]);
                    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(w, xv[m], acc[r][m]);
                }
            }
        }
    }
    for (int m = 0; m < MR; ++m) _mm_storeu_ps(out[m], sum4_avx512(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
}

#define QUANT_STREAM_SCALED_KERNEL(KIND, MR)                                                                   \
    static void quant_stream_##KIND##_##MR(const float *x, int64_t xs, const float *xsum, const uint8_t *q,   \
                                           int64_t row_bytes, const float *s, const uint8_t *z, int64_t sg,  \
                                           int64_t g, int64_t bn, int64_t n0, int64_t K, int prefetch,       \
                                           float out[4][4]) {                                                 \
        quant_block_stream_scaled(KIND, MR, x, xs, xsum, q, row_bytes, s, z, sg, g, bn, n0, K, prefetch, out); \
    }
QUANT_STREAM_SCALED_KERNEL(0, 3) QUANT_STREAM_SCALED_KERNEL(0, 4)
QUANT_STREAM_SCALED_KERNEL(1, 3) QUANT_STREAM_SCALED_KERNEL(1, 4)
QUANT_STREAM_SCALED_KERNEL(2, 3) QUANT_STREAM_SCALED_KERNEL(2, 4)

#define QUANT_STREAM_KERNEL(KIND, MR)                                                                          \
    static void quant_stream_##KIND##_##MR(const float *x, int64_t xs, const float *xsum, const uint8_t *q,   \
                                           int64_t row_bytes, const float *s, const uint8_t *z, int64_t sg,  \
                                           int64_t g, int64_t bn, int64_t n0, int64_t K, int prefetch,       \
                                           float out[4][4]) {                                                 \
        quant_block_stream(KIND, MR, x, xs, xsum, q, row_bytes, s, z, sg, g, bn, n0, K, prefetch, out);       \
    }
QUANT_STREAM_KERNEL(0, 1) QUANT_STREAM_KERNEL(0, 2)
QUANT_STREAM_KERNEL(1, 1) QUANT_STREAM_KERNEL(1, 2)
QUANT_STREAM_KERNEL(2, 1) QUANT_STREAM_KERNEL(2, 2)
typedef void (*quant_stream_kernel)(const float *, int64_t, const float *, const uint8_t *, int64_t, const float *,
                                    const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int, float[4][4]);
static const quant_stream_kernel QUANT_STREAM[3][5] = {
    {NULL, quant_stream_0_1, quant_stream_0_2, quant_stream_0_3, quant_stream_0_4},
    {NULL, quant_stream_1_1, quant_stream_1_2, quant_stream_1_3, quant_stream_1_4},
    {NULL, quant_stream_2_1, quant_stream_2_2, quant_stream_2_3, quant_stream_2_4},
};

/* Dequantize weight rows n0 .. n0 + 3 into wb [4][K] (fp32, (q - z) * s as the reference, in x's
 * element order: permuted per 32 for int4). */
static void quant_dequant_block(int kind, const uint8_t *q, int64_t row_bytes, const float *s, const uint8_t *z,
                                int64_t sg, int64_t g, int64_t bn, int64_t n0, int64_t K, float *wb) {
    for (int r = 0; r < 4; ++r) {
        const uint8_t *row = q + (n0 + r) * row_bytes;
        const int64_t srow = (kind == 2 ? (n0 + r) / bn : n0 + r) * sg;
        for (int64_t k0 = 0, grp = 0; k0 < K; k0 += g, ++grp) {
            const int64_t k1 = K - k0 < g ? K : k0 + g;
            const __m512 sc = _mm512_set1_ps(s[srow + grp]);
            if (kind == 1) {
                const __m512 zc = _mm512_set1_ps((float)z[srow + grp]);
                for (int64_t k = k0; k < k1; k += 32) {
                    __m512 lo, hi;
                    raw32_int4(row, k, &lo, &hi);
                    _mm512_storeu_ps(wb + r * K + k, _mm512_mul_ps(_mm512_sub_ps(lo, zc), sc));
                    _mm512_storeu_ps(wb + r * K + k + 16, _mm512_mul_ps(_mm512_sub_ps(hi, zc), sc));
                }
            } else {
                for (int64_t k = k0; k < k1; k += 16)
                    _mm512_storeu_ps(wb + r * K + k, _mm512_mul_ps(raw16(kind, row, k), sc));
            }
        }
    }
}

/* y[m][n0 .. n0 + 3] for MR rows of x against the dequantized block wb [4][K]. */
static inline __attribute__((always_inline)) void quant_block_dense(int MR, const float *x, int64_t xs,
                                                                    const float *wb, int64_t K, float out[4][4]) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; ++r)
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 xv[4];
        for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * xs + k);
        for (int r = 0; r < 4; ++r) {
            const __m512 w = _mm512_loadu_ps(wb + r * K + k);
            for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(w, xv[m], acc[r][m]);
        }
    }
    for (int m = 0; m < MR; ++m) _mm_storeu_ps(out[m], sum4_avx512(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
}

static void quant_dense_4(const float *x, int64_t xs, const float *wb, int64_t K, float out[4][4]) {
    quant_block_dense(4, x, xs, wb, K, out);
}
static void quant_dense_rest(int MR, const float *x, int64_t xs, const float *wb, int64_t K, float out[4][4]) {
    if (MR == 1) quant_block_dense(1, x, xs, wb, K, out);
    else if (MR == 2) quant_block_dense(2, x, xs, wb, K, out);
    else quant_block_dense(3, x, xs, wb, K, out);
}

/* xv: x in the element order the raw loads use (rows of stride xvs: permuted for int4, else x);
 * xsum: int4's group sums of x [M][sg]. Returns -1 (nothing written) when scratch memory could
 * not be allocated. */
static int quant_rows_avx512(int kind, const float *xv, int64_t xvs, const float *xsum, const float *x, int64_t xs,
                             int64_t M, const uint8_t *q, const float *s, const uint8_t *z, int64_t g, int64_t bn,
                             const float *bias, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    (void)threads;
    const int64_t sg = (K + g - 1) / g, row_bytes = kind == 1 ? K / 2 : K, blocks = N / 4;
    int failed = 0;
    if (M <= 4) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            float out[4][4];
            QUANT_STREAM[kind][M](xv, xvs, xsum, q, row_bytes, s, z, sg, g, bn, 4 * b, K, b + 1 < blocks, out);
            for (int64_t m = 0; m < M; ++m)
                for (int r = 0; r < 4; ++r)
                    y[m * ys + 4 * b + r] = out[m][r] + (bias == NULL ? 0.0f : bias[4 * b + r]);
        }
    } else {
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float *wb = malloc(sizeof(float) * (size_t)(4 * K));
            if (wb == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; ++b) {
                if (wb == NULL) continue;
                quant_dequant_block(kind, q, row_bytes, s, z, sg, g, bn, 4 * b, K, wb);
                for (int64_t m = 0; m < M; m += 4) {
                    float out[4][4];
                    const int64_t mr = M - m < 4 ? M - m : 4;
                    if (mr == 4) quant_dense_4(xv + m * xvs, xvs, wb, K, out);
                    else quant_dense_rest((int)mr, xv + m * xvs, xvs, wb, K, out);
                    for (int64_t i = 0; i < mr; ++i)
                        for (int r = 0; r < 4; ++r)
                            y[(m + i) * ys + 4 * b + r] = out[i][r] + (bias == NULL ? 0.0f : bias[4 * b + r]);
                }
            }
            free(wb);
        }
    }
    if (failed) return -1;
    if (blocks * 4 < N)   /* the last N % 4 weight rows */
        quant_rows_portable(kind, x, xs, M, q, s, z, g, bn, bias, blocks * 4, N, K, y, ys, 1);
    return 0;
}
#endif

#if QWEN_AVX512 && defined(__AVX512VNNI__)
#define QWEN_INT4_VNNI 1
/* int4 on one request by integer dot products (AVX512-VNNI), exact to fp32's precision.
 * x is written as three int8 digits per group, x = (d1 + d2 / 254 + d3 / 254^2) * amax / 127 with
 * |d| <= 127 (d1 = round(x * 127 / amax), then the remainders, scaled by 254, rounded): 24 bits of
 * the group's range, as much as an fp32 product keeps. VPDPBUSD multiplies 64 weight nibbles
 * (unsigned bytes) by 64 digits (signed bytes) and adds each 4 products into a 32-bit lane: the
 * group's sums of q x are exact integers, and the one rounding is their conversion at the group's
 * end. Per 64 weights: one 32-byte load, the nibble split (3 narrow ops, one insert) and 3
 * VPDPBUSD, against 12 wide ops on the fp32 widening path, which is compute-bound at half the read
 * bandwidth on these CPUs. A 64-byte vector holds the low nibbles of 32 bytes (elements k, k+2, ...,
 * k+62), then the high ones (k+1, ..., k+63): the digits are permuted the same way. */
static void int4_digits(const float *x, int64_t K, int64_t g, int8_t *d, float *unit, float *xsum) {
    const int64_t sg = K / g;
    for (int64_t grp = 0; grp < sg; ++grp) {
        const float *xg = x + grp * g;
        float amax = 0.0f, total = 0.0f;
        for (int64_t i = 0; i < g; ++i) {
            const float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
            total += xg[i];
        }
        xsum[grp] = total;
        unit[grp] = amax / 127.0f;
        const float scale = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t i = 0; i < g; ++i) {
            const int64_t k = grp * g + i, block = k & ~(int64_t)63, j = k & 63;
            const int64_t p = block + (j & 1 ? 32 + j / 2 : j / 2);     /* the permuted position */
            const float v = xg[i] * scale;
            const float d1 = nearbyintf(v), r1 = (v - d1) * 254.0f;
            const float d2 = nearbyintf(r1), r2 = (r1 - d2) * 254.0f;
            const float d3 = nearbyintf(r2);
            d[p] = (int8_t)d1;
            d[K + p] = (int8_t)d2;
            d[2 * K + p] = (int8_t)(d3 > 127.0f ? 127.0f : (d3 < -127.0f ? -127.0f : d3));
        }
    }
}

static void int4_vnni_rows(const int8_t *d, const float *unit, const float *xsum, const uint8_t *q, const float *s,
                           const uint8_t *z, int64_t g, const float *bias, int64_t n0, int64_t n1, int64_t K,
                           float *y) {
    const int64_t sg = K / g, row_bytes = K / 2;
    const __m256i mask = _mm256_set1_epi8(15);
    for (int64_t n = n0; n + 4 <= n1; n += 4) {
        __m512 acc[4];
        float zs[4] = {0};
        for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
        const uint8_t *rows[4] = {q + n * row_bytes, q + (n + 1) * row_bytes, q + (n + 2) * row_bytes,
                                  q + (n + 3) * row_bytes};
        for (int64_t grp = 0; grp < sg; ++grp) {
            __m512i a1[4], a2[4], a3[4];
            for (int r = 0; r < 4; ++r) a1[r] = a2[r] = a3[r] = _mm512_setzero_si512();
            for (int64_t k = grp * g; k < (grp + 1) * g; k += 64) {
                if (((k / 2) & 63) == 0 && n + 8 <= n1)
                    for (int r = 0; r < 4; ++r) _mm_prefetch((const char *)(rows[r] + 4 * row_bytes + k / 2), _MM_HINT_T0);
                const __m512i x1 = _mm512_loadu_si512((const void *)(d + k));
                const __m512i x2 = _mm512_loadu_si512((const void *)(d + K + k));
                const __m512i x3 = _mm512_loadu_si512((const void *)(d + 2 * K + k));
                for (int r = 0; r < 4; ++r) {
                    const __m256i b = _mm256_loadu_si256((const __m256i *)(rows[r] + k / 2));
                    const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
                    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                    a1[r] = _mm512_dpbusd_epi32(a1[r], w, x1);
                    a2[r] = _mm512_dpbusd_epi32(a2[r], w, x2);
                    a3[r] = _mm512_dpbusd_epi32(a3[r], w, x3);
                }
            }
            for (int r = 0; r < 4; ++r) {
                const int64_t at = (n + r) * sg + grp;
                const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a3[r]), _mm512_set1_ps(1.0f / 64516.0f),
                                                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2[r]), _mm512_set1_ps(1.0f / 254.0f),
                                                                 _mm512_cvtepi32_ps(a1[r])));
                acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(s[at] * unit[grp]), acc[r]);
                zs[r] += (float)z[at] * s[at] * xsum[grp];
            }
        }
        float out[4];
        _mm_storeu_ps(out, sum4_avx512(acc[0], acc[1], acc[2], acc[3]));
        for (int r = 0; r < 4; ++r) y[n + r] = out[r] - zs[r] + (bias == NULL ? 0.0f : bias[n + r]);
    }
}

/* Returns -1 (nothing written) when scratch memory could not be allocated. */
static int int4_vnni(const float *x, const uint8_t *q, const float *s, const uint8_t *z, int64_t g, const float *bias,
                     int64_t N, int64_t K, float *y, int threads) {
    (void)threads;
    const int64_t sg = K / g, blocks = N / 4;
    int8_t *d = malloc((size_t)(3 * K) + sizeof(float) * (size_t)(2 * sg) + 64);
    if (d == NULL) return -1;
    float *unit = (float *)(void *)(((uintptr_t)(d + 3 * K) + 63) & ~(uintptr_t)63), *xsum = unit + sg;
    int4_digits(x, K, g, d, unit, xsum);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        int4_vnni_rows(d, unit, xsum, q, s, z, g, bias, 4 * b0, 4 * b1, K, y);
    }
    free(d);
    return 0;
}
#else
#define QWEN_INT4_VNNI 0
#endif

/* ----------------------------------------------------------------------------------------------
 * Dynamic int8 activations: torch.ops.qwen.linear_int8_a8 / linear_int4_a8 (reference in
 * reference_quant.py, whose docstring is the contract). Each row of x is quantized per block of
 * ab = 128 elements when 128 divides the weight's group g (else ab = g): unit = amax / 127,
 * d = round_half_even(x * (127 / amax)) in -127..127 (d = 0 where amax is 0; unit NaN where amax is
 * not finite). Then, with u the weight as an unsigned byte (int8: q + 128 and z = 128; int4: the
 * nibble and its group's zero z), per output:
 *     y = sum over blocks b, in order, of fma(float(sum_k d u - z * sum_k d), s[n][grp] * unit[b], .)
 * + bias. The integer sums are exact (|.| < 2^24), so every path below (portable, few rows, many
 * rows) computes the same fp32 operations on the same values: a row's outputs do not depend on
 * the rows beside it, nor on the thread count. VPDPBUSD (AVX512-VNNI: unsigned weight bytes times
 * signed activation bytes, 4 products into each 32-bit lane) is 64 multiply-adds an instruction,
 * against 16 for an fp32 FMA, as llama.cpp's Q8_0 dot products.
 * - up to 4 rows: each weight row is read once, 4 rows side by side against the rows' digits (in
 *   L1); lanes are k, so each block's integer sums are reduced across lanes (exact) before the fp32
 *   step.
 * - more rows: 32 weight rows are turned into a panel of unsigned bytes (lanes are output features,
 *   4 consecutive k a lane: VPDPBUSD's layout), and every 4 rows of x run against it with the
 *   digits broadcast: no reductions across lanes. Where the CPU has AMX-INT8, AMX tiles instead
 *   (a8_amx, below): the weights as they are stored are the A operand, so nothing is built per call.
 * ---------------------------------------------------------------------------------------------- */

static inline int64_t a8_block(int64_t g) { return g % 128 == 0 ? 128 : g; }

/* d [M][K] digits, unit and dsum [M][K / ab]; int4p: when not NULL (K % width == 0), d also permuted
 * per ``width`` (64 or 128) elements as the int4 nibble split reads weights (even k, then odd k). */
static void a8_quantize(const float *x, int64_t xs, int64_t M, int64_t K, int64_t ab, int8_t *d, int8_t *int4p,
                        int64_t width, float *unit, int32_t *dsum) {
    const int64_t nb = K / ab;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + m * xs + b * ab;
            float amax = 0.0f;
            for (int64_t i = 0; i < ab; ++i) {
                const float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            int finite = amax <= 3.4028234663852886e38f;
            for (int64_t i = 0; i < ab; ++i) finite &= xb[i] == xb[i];
            unit[m * nb + b] = finite ? amax / 127.0f : NAN;
            const float scale = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t total = 0;
            for (int64_t i = 0; i < ab; ++i) {
                const float v = nearbyintf(finite ? xb[i] * scale : 0.0f);
                const int8_t di = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
                const int64_t k = b * ab + i;
                d[m * K + k] = di;
                if (int4p != NULL) {
                    const int64_t j = k & (width - 1);
                    int4p[m * K + (k & ~(width - 1)) + (j & 1 ? width / 2 + j / 2 : j / 2)] = di;
                }
                total += di;
            }
            dsum[m * nb + b] = total;
        }
}

static inline int32_t a8_weight(int kind, const uint8_t *row, int64_t k) {
    return kind == 0 ? (int32_t)(int8_t)row[k] + 128 : (int32_t)((row[k >> 1] >> ((k & 1) * 4)) & 15);
}
static inline float a8_zero(int kind, const uint8_t *z, int64_t at) { return kind == 0 ? 128.0f : (float)z[at]; }

static void a8_rows_portable(int kind, const int8_t *d, const float *unit, const int32_t *dsum, int64_t M,
                             const uint8_t *q, const float *s, const uint8_t *z, int64_t g, int64_t ab,
                             const float *bias, int64_t n0, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    (void)threads;
    const int64_t sg = K / g, nb = K / ab, row_bytes = kind == 1 ? K / 2 : K;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t n = n0; n < N; ++n) {
        const uint8_t *qr = q + n * row_bytes;
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                int32_t isum = 0;
                for (int64_t k = b * ab; k < (b + 1) * ab; ++k) isum += (int32_t)d[m * K + k] * a8_weight(kind, qr, k);
                const int64_t at = n * sg + b * ab / g;
                const float f = (float)isum - a8_zero(kind, z, at) * (float)dsum[m * nb + b];
                acc = fmaf(f, s[at] * unit[m * nb + b], acc);
            }
            y[m * ys + n] = acc + (bias == NULL ? 0.0f : bias[n]);
        }
    }
}

#if QWEN_AVX512 && defined(__AVX512VNNI__)
#define QWEN_A8_VNNI 1
/* 64 weights of a row from element k as unsigned bytes (int4: even k, then odd k). */
static inline __attribute__((always_inline)) __m512i a8_load64(int kind, const uint8_t *row, int64_t k) {
    if (kind == 0) return _mm512_xor_si512(_mm512_loadu_si512((const void *)(row + k)), _mm512_set1_epi8((char)0x80));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(row + k / 2)), mask = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, mask)),
                              _mm256_and_si256(_mm256_srli_epi16(b, 4), mask), 1);
}

/* Lane sums of four int32 vectors: [sum a0, sum a1, sum a2, sum a3] (exact). */
static inline __attribute__((always_inline)) __m128i a8_sum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Up to 4 rows (MR), 4 weight rows n .. n + 3 a step. xd: the digits in a8_load64's order. kind 2: int4
 * read 64 bytes (128 weights) a load, the low nibbles then the high ones, without a lane insert
 * (ab % 128 == 0; xd permuted per 128): the 32-byte loads' insert made the one-row int4 product
 * shuffle-bound at ~19 GB/s out of L2, too close to DRAM's 12-15 for the two to overlap. */
static inline __attribute__((always_inline)) void a8_stream(
        int kind, int MR, const int8_t *xd, const float *unit, const int32_t *dsum, const uint8_t *q,
        const float *s, const uint8_t *z, int64_t g, int64_t ab, const float *bias, int64_t n0, int64_t n1, int64_t K,
        float *y, int64_t ys) {
    const int64_t sg = K / g, nb = K / ab, row_bytes = kind >= 1 ? K / 2 : K;
    const int64_t ahead = rows_ahead(row_bytes);
    for (int64_t n = n0; n + 4 <= n1; n += 4) {
        const uint8_t *rows[4] = {q + n * row_bytes, q + (n + 1) * row_bytes, q + (n + 2) * row_bytes,
                                  q + (n + 3) * row_bytes};
        __m128 acc[4];
        for (int m = 0; m < MR; ++m) acc[m] = _mm_setzero_ps();
        /* The 4 rows' scales and zeros of 8 groups at a time, [row][8] in two vectors each: one permute
         * a block picks its 4 (the scalar loads and inserts of each block were a fifth of the int4
         * stream's vector work). */
        int64_t chunk = -1;
        __m512 s01 = _mm512_setzero_ps(), s23 = s01, z01 = s01, z23 = s01;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t grp = b * ab / g;
            if (grp >> 3 != chunk) {
                chunk = grp >> 3;
                const int64_t cnt = sg - 8 * chunk < 8 ? sg - 8 * chunk : 8;
                float st[32] = {0};
                uint8_t zt[32] = {0};
                for (int r = 0; r < 4; ++r) {
                    memcpy(st + 8 * r, s + (n + r) * sg + 8 * chunk, (size_t)cnt * sizeof(float));
                    if (kind != 0) memcpy(zt + 8 * r, z + (n + r) * sg + 8 * chunk, (size_t)cnt);
                }
                s01 = _mm512_loadu_ps(st), s23 = _mm512_loadu_ps(st + 16);
                if (kind != 0) {
                    z01 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)zt)));
                    z23 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zt + 16))));
                }
            }
            const __m512i pick = _mm512_zextsi128_si512(_mm_add_epi32(_mm_setr_epi32(0, 8, 16, 24),
                                                                      _mm_set1_epi32((int)(grp & 7))));
            __m512i ia[4][4];
            for (int r = 0; r < 4; ++r)
                for (int m = 0; m < MR; ++m) ia[r][m] = _mm512_setzero_si512();
            if (kind == 2) {
                for (int64_t k = b * ab; k < (b + 1) * ab; k += 128) {
                    if (n + ahead + 4 <= n1)
                        for (int r = 0; r < 4; ++r)
                            _mm_prefetch((const char *)(rows[r] + ahead * row_bytes + k / 2), _MM_HINT_T0);
                    __m512i xlo[4], xhi[4];
                    for (int m = 0; m < MR; ++m) {
                        xlo[m] = _mm512_loadu_si512((const void *)(xd + m * K + k));
                        xhi[m] = _mm512_loadu_si512((const void *)(xd + m * K + k + 64));
                    }
                    const __m512i mask = _mm512_set1_epi8(15);
                    for (int r = 0; r < 4; ++r) {
                        const __m512i v = _mm512_loadu_si512((const void *)(rows[r] + k / 2));
                        const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                        for (int m = 0; m < MR; ++m)
                            ia[r][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ia[r][m], lo, xlo[m]), hi, xhi[m]);
                    }
                }
            } else {
                for (int64_t k = b * ab; k < (b + 1) * ab; k += 64) {
                    if (n + ahead + 4 <= n1 && ((kind == 1 ? k / 2 : k) & 63) == 0)
                        for (int r = 0; r < 4; ++r)
                            _mm_prefetch((const char *)(rows[r] + ahead * row_bytes + (kind == 1 ? k / 2 : k)),
                                         _MM_HINT_T0);
                    __m512i xv[4];
                    for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_si512((const void *)(xd + m * K + k));
                    for (int r = 0; r < 4; ++r) {
                        const __m512i w = a8_load64(kind, rows[r], k);
                        for (int m = 0; m < MR; ++m) ia[r][m] = _mm512_dpbusd_epi32(ia[r][m], w, xv[m]);
                    }
                }
            }
            const __m128 sc = _mm512_castps512_ps128(_mm512_permutex2var_ps(s01, pick, s23));
            const __m128 zc = kind == 0 ? _mm_set1_ps(128.0f)
                                        : _mm512_castps512_ps128(_mm512_permutex2var_ps(z01, pick, z23));
            for (int m = 0; m < MR; ++m) {
                const __m128 f = _mm_fnmadd_ps(zc, _mm_set1_ps((float)dsum[m * nb + b]),
                                               _mm_cvtepi32_ps(a8_sum4(ia[0][m], ia[1][m], ia[2][m], ia[3][m])));
                acc[m] = _mm_fmadd_ps(f, _mm_mul_ps(sc, _mm_set1_ps(unit[m * nb + b])), acc[m]);
            }
        }
        const __m128 bv = bias == NULL ? _mm_setzero_ps() : _mm_loadu_ps(bias + n);
        for (int m = 0; m < MR; ++m) _mm_storeu_ps(y + m * ys + n, _mm_add_ps(acc[m], bv));
    }
}

#define A8_STREAM(KIND, MR)                                                                                   \
    static void a8_stream_##KIND##_##MR(const int8_t *xd, const float *unit, const int32_t *dsum,              \
                                        const uint8_t *q, const float *s, const uint8_t *z, int64_t g,          \
                                        int64_t ab, const float *bias, int64_t n0, int64_t n1, int64_t K,       \
                                        float *y, int64_t ys) {                                                 \
        a8_stream(KIND, MR, xd, unit, dsum, q, s, z, g, ab, bias, n0, n1, K, y, ys);                            \
    }
A8_STREAM(0, 1) A8_STREAM(0, 2) A8_STREAM(0, 3) A8_STREAM(0, 4)
A8_STREAM(1, 1) A8_STREAM(1, 2) A8_STREAM(1, 3) A8_STREAM(1, 4)
A8_STREAM(2, 1) A8_STREAM(2, 2) A8_STREAM(2, 3) A8_STREAM(2, 4)
#undef A8_STREAM
typedef void (*a8_stream_kernel)(const int8_t *, const float *, const int32_t *, const uint8_t *, const float *,
                                 const uint8_t *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t, float *,
                                 int64_t);
static const a8_stream_kernel A8_STREAMS[3][5] = {
    {NULL, a8_stream_0_1, a8_stream_0_2, a8_stream_0_3, a8_stream_0_4},
    {NULL, a8_stream_1_1, a8_stream_1_2, a8_stream_1_3, a8_stream_1_4},
    {NULL, a8_stream_2_1, a8_stream_2_2, a8_stream_2_3, a8_stream_2_4},
};

/* The 64 nibbles of 32 packed int4 bytes, one a byte, in k order (low nibble first). */
static inline __m512i a8_nibbles64(const uint8_t *packed) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)packed));
    return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(15)),
                           _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0xf0)), 4));
}

/* The panel of weight rows n0 .. n0 + 31 (rows past N repeat the last): wt[(k / 4) * 128 + j * 4 + i] =
 * u[n0 + j][k + i]; st / zt [nb][32]: each block's scale and zero (fp32) per row. scratch [32][K]
 * bytes for int4's unpacked rows. */
static void a8_panel(int kind, const uint8_t *q, const float *s, const uint8_t *z, int64_t g, int64_t ab,
                     int64_t n0, int64_t N, int64_t K, uint8_t *wt, float *st, float *zt, uint8_t *scratch) {
    const int64_t sg = K / g, nb = K / ab, row_bytes = kind == 1 ? K / 2 : K;
    const uint8_t *src = q;
    int64_t stride = row_bytes, first = n0;
    if (kind == 1) {          /* unpack the nibbles of the 32 rows in natural order */
        for (int j = 0; j < 32; ++j) {
            const uint8_t *row = q + (n0 + j < N ? n0 + j : N - 1) * row_bytes;
            for (int64_t c = 0; c < row_bytes; c += 32) {
                _mm512_storeu_si512((void *)(scratch + j * K + 2 * c), a8_nibbles64(row + c));
            }
        }
        src = scratch, stride = K, first = 0;
    }
    int32_t idx[32];
    for (int j = 0; j < 32; ++j)
        idx[j] = (int32_t)((kind == 1 ? j : (n0 + j < N ? n0 + j : N - 1) - first) * stride);
    const __m512i i0 = _mm512_loadu_si512((const void *)idx), i1 = _mm512_loadu_si512((const void *)(idx + 16));
    const uint8_t *base = src + first * stride;
    const __m512i flip = _mm512_set1_epi8(kind == 0 ? (char)0x80 : 0);
    for (int64_t k = 0; k < K; k += 4) {
        const __m512i a = _mm512_i32gather_epi32(i0, (const void *)(base + k), 1);
        const __m512i b = _mm512_i32gather_epi32(i1, (const void *)(base + k), 1);
        _mm512_storeu_si512((void *)(wt + k * 32), _mm512_xor_si512(a, flip));
        _mm512_storeu_si512((void *)(wt + k * 32 + 64), _mm512_xor_si512(b, flip));
    }
    for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < 32; ++j) {
            const int64_t at = (n0 + j < N ? n0 + j : N - 1) * sg + b * ab / g;
            st[b * 32 + j] = s[at];
            zt[b * 32 + j] = a8_zero(kind, z, at);
        }
}

/* y rows m .. m + MR - 1 (MR <= 4), outputs n0 .. n0 + cols - 1, against the panel. */
static inline __attribute__((always_inline)) void a8_panel_rows(
        int MR, const int8_t *d, const float *unit, const int32_t *dsum, const uint8_t *wt, const float *st,
        const float *zt, int64_t ab, int64_t K, const float *bias, int64_t n0, int64_t cols, float *y, int64_t ys) {
    const int64_t nb = K / ab;
    __m512 acc[4][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i ia[4][2];
        for (int m = 0; m < MR; ++m) ia[m][0] = ia[m][1] = _mm512_setzero_si512();
        for (int64_t k = b * ab; k < (b + 1) * ab; k += 4) {
            const __m512i w0 = _mm512_loadu_si512((const void *)(wt + k * 32));
            const __m512i w1 = _mm512_loadu_si512((const void *)(wt + k * 32 + 64));
            for (int m = 0; m < MR; ++m) {
                int32_t quad;
                memcpy(&quad, d + m * K + k, 4);
                const __m512i xb = _mm512_set1_epi32(quad);
                ia[m][0] = _mm512_dpbusd_epi32(ia[m][0], w0, xb);
                ia[m][1] = _mm512_dpbusd_epi32(ia[m][1], w1, xb);
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m512 sc = _mm512_loadu_ps(st + b * 32 + 16 * h), zc = _mm512_loadu_ps(zt + b * 32 + 16 * h);
            for (int m = 0; m < MR; ++m) {
                const __m512 f = _mm512_fnmadd_ps(zc, _mm512_set1_ps((float)dsum[m * nb + b]),
                                                  _mm512_cvtepi32_ps(ia[m][h]));
                acc[m][h] = _mm512_fmadd_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(unit[m * nb + b])), acc[m][h]);
            }
        }
    }
    const __mmask16 mk[2] = {lanes_left(cols), lanes_left(cols - 16)};
    for (int h = 0; h < 2; ++h) {
        const __m512 bv = bias == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[h], bias + n0 + 16 * h);
        for (int m = 0; m < MR; ++m)
            _mm512_mask_storeu_ps(y + m * ys + n0 + 16 * h, mk[h], _mm512_add_ps(acc[m][h], bv));
    }
}
static void a8_panel_4(const int8_t *d, const float *unit, const int32_t *dsum, const uint8_t *wt, const float *st,
                       const float *zt, int64_t ab, int64_t K, const float *bias, int64_t n0, int64_t cols, float *y,
                       int64_t ys) {
    a8_panel_rows(4, d, unit, dsum, wt, st, zt, ab, K, bias, n0, cols, y, ys);
}
static void a8_panel_rest(int MR, const int8_t *d, const float *unit, const int32_t *dsum, const uint8_t *wt,
                          const float *st, const float *zt, int64_t ab, int64_t K, const float *bias, int64_t n0,
                          int64_t cols, float *y, int64_t ys) {
    if (MR == 1) a8_panel_rows(1, d, unit, dsum, wt, st, zt, ab, K, bias, n0, cols, y, ys);
    else if (MR == 2) a8_panel_rows(2, d, unit, dsum, wt, st, zt, ab, K, bias, n0, cols, y, ys);
    else a8_panel_rows(3, d, unit, dsum, wt, st, zt, ab, K, bias, n0, cols, y, ys);
}

#if QWEN_AMX
/* The many-row products on AMX tiles, the weights as the A operand: C^T [16 features][R rows] =
 * W [16 features][64 k] x D^T, where a weight tile is 16 weight rows of 64 k loaded from the weight
 * as it is stored (int8: q itself, stride K; int4: 32 packed bytes a row, unpacked into a 1 KB tile
 * first) and the B tile is 16 quads of k of the R rows' digits, 4 bytes a row (db: the digits
 * re-laid once per call, [row block][K / 4][R][4]). No panel is built per call: the weights stream
 * once, 16 rows side by side. int8 runs TDPBSSD on q (sum q d = sum (q + 128) d - 128 sum d
 * exactly, so the fp32 step below sees the VNNI path's f); int4 runs TDPBUSD on the nibbles. Each
 * block of ab k is summed into a zeroed C tile, stored, and then takes the VNNI path's fp32 step in
 * its order (f = sum - z dsum, acc = fma(f, s unit, acc), + bias): the same bits (tested). */
static int amx_int8_usable(void) { return __builtin_cpu_supports("amx-int8") && amx_tiles_granted(); }

/* tmm0: C^T, 16 features x R int32; tmm4: A, 16 weight rows x 64 bytes; tmm6: B, 16 quads x R rows. */
static __attribute__((target("amx-tile,amx-int8"))) void a8_amx_configure(int R) {
    amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = (uint16_t)(4 * R);
    c.rows[4] = 16, c.colsb[4] = 64;
    c.rows[6] = 16, c.colsb[6] = (uint16_t)(4 * R);
    AMX_MEMORY();
    _tile_loadconfig(&c);
}

/* y rows 0 .. R - 1 (R <= 16, the tiles configured for R: a8_amx_configure), outputs n0 .. n0 + 15,
 * from the weight rows n0 .. n0 + 15. db: the rows' digits as B tiles (16 quads x R rows a tile);
 * unitT / dsumT [nb][16]: the rows' block units and digit sums, block-major; st / zt [nb][16]: the
 * 16 weight rows' block scales and zeros (fp32); tile: 1 KB scratch for int4's unpacked weights. */
static __attribute__((target("amx-tile,amx-int8"))) void a8_rows_amx(
        int kind, int R, const uint8_t *q, int64_t n0, const int8_t *db, const float *unitT, const int32_t *dsumT,
        const float *st, const float *zt, int64_t ab, int64_t K, const float *bias, float *y, int64_t ys,
        uint8_t *tile, const uint8_t *next) {
    const int64_t nb = K / ab, row_bytes = kind == 1 ? K / 2 : K;
    const uint8_t *w = q + n0 * row_bytes;
    int32_t ct[16 * 16] __attribute__((aligned(64)));
    __m512 acc[16];
    const __mmask16 rows = lanes_left(R);
    for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
    AMX_MEMORY();   /* db was just written */
    for (int64_t b = 0; b < nb; ++b) {
        _tile_zero(0);
        if (next != NULL)   /* the next 16 weight rows' share of this block, into L2 */
            for (int n = 0; n < 16; ++n)
                for (int64_t l = 0; l < ab * row_bytes / K; l += 64)
                    _mm_prefetch((const char *)next + n * row_bytes + b * ab * row_bytes / K + l, _MM_HINT_T1);
        for (int64_t k = b * ab; k < (b + 1) * ab; k += 64) {
            const int8_t *bt = db + (k / 4) * 4 * R;
            if (kind == 0) {
                _tile_loadd(4, w + k, K);
                _tile_loadd(6, bt, 4 * R);
                _tile_dpbssd(0, 4, 6);
            } else {
                for (int n = 0; n < 16; ++n)
                    _mm512_store_si512((void *)(tile + 64 * n), a8_nibbles64(w + n * row_bytes + k / 2));
                AMX_MEMORY();
                _tile_loadd(4, tile, 64);
                _tile_loadd(6, bt, 4 * R);
                _tile_dpbusd(0, 4, 6);
            }
        }
        _tile_stored(0, ct, 64);
        AMX_MEMORY();
        const __m512 unit = _mm512_maskz_loadu_ps(rows, unitT + b * 16);
        const __m512 dsum = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(rows, dsumT + b * 16));
        for (int n = 0; n < 16; ++n) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(ct + 16 * n)));
            const __m512 f = kind == 0 ? sum : _mm512_fnmadd_ps(_mm512_set1_ps(zt[b * 16 + n]), dsum, sum);
            acc[n] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_set1_ps(st[b * 16 + n]), unit), acc[n]);
        }
    }
    float out[16 * 16] __attribute__((aligned(64)));
    for (int n = 0; n < 16; ++n) _mm512_store_ps(out + 16 * n, acc[n]);
    for (int m = 0; m < R; ++m)
        for (int n = 0; n < 16; ++n) y[m * ys + n0 + n] = out[16 * n + m] + (bias == NULL ? 0.0f : bias[n0 + n]);
}

/* y [M, N16] (N16 = N rounded down to 16) of the many-row products on AMX tiles; the caller runs
 * the last N % 16 outputs. Returns -1 (y incomplete) when scratch memory could not be allocated. */
static __attribute__((target("amx-tile,amx-int8"))) int a8_amx(
        int kind, const int8_t *d, const float *unit, const int32_t *dsum, int64_t M, const uint8_t *q, const float *s,
        const uint8_t *z, int64_t g, int64_t ab, const float *bias, int64_t N16, int64_t K, float *y, int64_t ys,
        int threads) {
    const int64_t nb = K / ab, sg = K / g, blocks = (M + 15) / 16;
    /* per block of 16 rows: B tiles [K / 4][R][4], then unitT, dsumT [nb][16] */
    const size_t per = (size_t)(K * 16) + sizeof(float) * (size_t)(32 * nb);
    char *buf = aligned_alloc(64, (per * (size_t)blocks + 63) / 64 * 64);
    if (buf == NULL) return -1;
    for (int64_t mb = 0; mb < blocks; ++mb) {
        const int64_t m0 = 16 * mb, R = M - m0 < 16 ? M - m0 : 16;
        int8_t *db = (int8_t *)(buf + per * mb);
        float *unitT = (float *)(void *)(db + K * 16);
        int32_t *dsumT = (int32_t *)(unitT + 16 * nb);
        for (int64_t kq = 0; kq < K / 4; ++kq)
            for (int64_t m = 0; m < R; ++m) memcpy(db + (kq * R + m) * 4, d + (m0 + m) * K + 4 * kq, 4);
        for (int64_t b = 0; b < nb; ++b)
            for (int64_t m = 0; m < 16; ++m) {
                unitT[b * 16 + m] = m < R ? unit[(m0 + m) * nb + b] : 0.0f;
                dsumT[b * 16 + m] = m < R ? dsum[(m0 + m) * nb + b] : 0;
            }
    }
    const int64_t groups = N16 / 16, row_bytes = kind == 1 ? K / 2 : K;
    int failed = 0;
    (void)threads;   /* without OpenMP */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float stz[2 * 16 * 64];   /* st, zt [nb][16] for nb <= 64; larger K: heap */
        float *st = nb <= 64 ? stz : malloc(sizeof(float) * (size_t)(32 * nb));
        if (st == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        uint8_t tile[1024] __attribute__((aligned(64)));
        int tiles = 0;
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; ++gi) {
            if (st == NULL) continue;
            float *zt = st + 16 * nb;
            const int64_t n0 = 16 * gi;
            for (int64_t b = 0; b < nb; ++b)
                for (int n = 0; n < 16; ++n) {
                    const int64_t at = (n0 + n) * sg + b * ab / g;
                    st[b * 16 + n] = s[at];
                    zt[b * 16 + n] = a8_zero(kind, z, at);
                }
            const uint8_t *next = gi + 1 < groups ? q + (n0 + 16) * row_bytes : NULL;
            for (int64_t mb = 0; mb < blocks; ++mb) {
                const int R = M - 16 * mb < 16 ? (int)(M - 16 * mb) : 16;
                if (R != tiles) a8_amx_configure(tiles = R);
                const int8_t *db = (const int8_t *)(buf + per * mb);
                const float *unitT = (const float *)(const void *)(db + K * 16);
                a8_rows_amx(kind, R, q, n0, db, unitT, (const int32_t *)(unitT + 16 * nb), st, st + 16 * nb, ab, K,
                            bias, y + 16 * mb * ys, ys, tile, mb == 0 ? next : NULL);
            }
        }
        if (tiles) amx_tile_release();
        if (st != stz) free(st);
    }
    free(buf);
    return failed ? -1 : 0;
}
#endif
#else
#define QWEN_A8_VNNI 0
#endif

/* 1 when the *_a8 products run VPDPBUSD here, 0 when they run the portable loop (far slower). */
int qwen_int8_dot_products(void) { return QWEN_A8_VNNI; }

/* 1 when the *_a8 products of more than 4 rows run on AMX tiles (a8_amx), one choice per
 * process: where the CPU has AMX-INT8 and Linux grants it, unless QWEN_OPS_INT8_PRODUCTS=vnni. */
int qwen_int8_amx(void) {
#if QWEN_A8_VNNI && QWEN_AMX
    static int choice = -1;
    if (choice < 0) {
        const char *forced = getenv("QWEN_OPS_INT8_PRODUCTS");
        choice = !(forced != NULL && strcmp(forced, "vnni") == 0) && amx_int8_usable();
    }
    return choice;
#else
    return 0;
#endif
}

/* The entry point of the two ops: kind 0 int8, 1 int4 (z its zeros, else NULL). Returns 0, or -1
 * when scratch memory could not be allocated (nothing written). */
int qwen_linear_quant_a8(int kind, const float *x, int64_t xs, int64_t M, const uint8_t *q, const float *s,
                         const uint8_t *z, int64_t g, const float *bias, int64_t N, int64_t K, float *y, int64_t ys,
                         int64_t threads, int64_t portable) {
    const int64_t ab = a8_block(g), nb = K / ab;
    if (M <= 0 || N <= 0) return 0;
    int8_t *d = malloc((size_t)(2 * M * K) + sizeof(float) * (size_t)(2 * M * nb) + 64);
    if (d == NULL) return -1;
    int8_t *dp = d + M * K;
    float *unit = (float *)(void *)(((uintptr_t)(d + 2 * M * K) + 63) & ~(uintptr_t)63);
    int32_t *dsum = (int32_t *)(unit + M * nb);
    /* int4 at up to 4 rows with blocks of 128: the 64-byte loads of stream kind 2, digits permuted per 128 */
    const int wide = kind == 1 && M <= 4 && ab % 128 == 0 && K % 128 == 0;
    a8_quantize(x, xs, M, K, ab, d, kind == 1 && K % 64 == 0 ? dp : NULL, wide ? 128 : 64, unit, dsum);
    int status = 0;
    int64_t done = 0;    /* outputs 0 .. done - 1 written by the vector paths */
#if QWEN_A8_VNNI
    if (!portable && K % 64 == 0 && ab % 64 == 0) {
        if (M <= 4) {
            const int64_t blocks = N / 4;
            const int8_t *xd = kind == 1 ? dp : d;
#pragma omp parallel num_threads((int)threads) if (threads > 1)
            {
#ifdef _OPENMP
                const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
                const int64_t t = 0, nt = 1;
#endif
                const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
                A8_STREAMS[wide ? 2 : kind][M](xd, unit, dsum, q, s, z, g, ab, bias, 4 * b0, 4 * b1, K, y, ys);
            }
            done = 4 * blocks;
        } else {
            int64_t first = 0;   /* outputs first .. N - 1 run on the VNNI panels below */
#if QWEN_AMX
            if (qwen_int8_amx() && N >= 16) {
                first = N / 16 * 16;
                if (a8_amx(kind, d, unit, dsum, M, q, s, z, g, ab, bias, first, K, y, ys, (int)threads) != 0)
                    status = -1;
            }
#endif
            const int64_t panels = (N - first + 31) / 32;
            int failed = 0;
#pragma omp parallel num_threads((int)threads) if (threads > 1 && panels > 1)
            {
                uint8_t *wt = panels == 0 ? NULL : malloc((size_t)(32 * K * (kind == 1 ? 2 : 1)) + sizeof(float) * (size_t)(64 * nb));
                if (wt == NULL && panels > 0) {
#pragma omp atomic write
                    failed = 1;
                }
                float *st = (float *)(void *)(wt + 32 * K * (kind == 1 ? 2 : 1)), *zt = st + 32 * nb;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; ++p) {
                    if (wt == NULL) continue;
                    const int64_t n0 = first + 32 * p, cols = N - n0 < 32 ? N - n0 : 32;
                    a8_panel(kind, q, s, z, g, ab, n0, N, K, wt, st, zt, wt + 32 * K);
                    int64_t m = 0;
                    for (; m + 4 <= M; m += 4)
                        a8_panel_4(d + m * K, unit + m * nb, dsum + m * nb, wt, st, zt, ab, K, bias, n0, cols,
                                   y + m * ys, ys);
                    if (m < M)
                        a8_panel_rest((int)(M - m), d + m * K, unit + m * nb, dsum + m * nb, wt, st, zt, ab, K, bias,
                                      n0, cols, y + m * ys, ys);
                }
                free(wt);
            }
            if (failed) status = -1;
            done = N;
        }
    }
#endif
    (void)portable;
    if (status == 0 && done < N)
        a8_rows_portable(kind, d, unit, dsum, M, q, s, z, g, ab, bias, done, N, K, y, ys, (int)threads);
    free(d);
    return status;
}

/* ----------------------------------------------------------------------------------------------
 * The int8-activation products on 64-feature panels (linear_a8_panels): the weights laid out with
 * the output features in the vector lanes, so a one-row product is VPDPBUSDs on the weights as
 * stored and a broadcast of four digits of x, with no horizontal sums (the [N, K] rows of
 * linear_*_a8 need a four-row reduction a block, which made their one-row streams compute-bound
 * near the read bandwidth on AMX Xeons). Panel p holds features 64 p .. 64 p + 63:
 *   int8 (kind 0): w [P][K / 4][64][4], w[p][kq][f][i] = q[64 p + f][4 kq + i] + 128;
 *   int4 (kind 1): w [P][K / 8][64][4], w[p][o][f][i] = u[64 p + f][8 o + i] | u[64 p + f][8 o + 4 + i] << 4;
 *   s [P][G][64] fp32 and (int4) z [P][G][64] uint8: feature f's scale and zero of group gi.
 * Features past N are padding (any values; their outputs are not written). The arithmetic per
 * output is linear_*_a8's, in the same order, so the outputs are bit for bit theirs.
 * ---------------------------------------------------------------------------------------------- */
static inline int32_t a8p_weight(int kind, const uint8_t *w, int64_t K, int64_t n, int64_t k) {
    const int64_t p = n / 64, f = n % 64;
    if (kind == 0) return w[((p * (K / 4) + k / 4) * 64 + f) * 4 + k % 4];
    const uint8_t b = w[((p * (K / 8) + k / 8) * 64 + f) * 4 + k % 4];
    return (k & 4) ? b >> 4 : b & 15;
}

static void a8p_rows_portable(int kind, const int8_t *d, const float *unit, const int32_t *dsum, int64_t M,
                              const uint8_t *w, const float *s, const uint8_t *z, int64_t g, int64_t ab,
                              const float *bias, int64_t p0, int64_t N, int64_t K, float *y, int64_t ys,
                              int threads) {
    (void)threads;
    const int64_t G = K / g, nb = K / ab;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t n = 64 * p0; n < N; ++n) {
        const int64_t p = n / 64, f = n % 64;
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                int32_t isum = 0;
                for (int64_t k = b * ab; k < (b + 1) * ab; ++k) isum += (int32_t)d[m * K + k] * a8p_weight(kind, w, K, n, k);
                const int64_t at = (p * G + b * ab / g) * 64 + f;
                const float zero = kind == 0 ? 128.0f : (float)z[at];
                const float fs = (float)isum - zero * (float)dsum[m * nb + b];
                acc = fmaf(fs, s[at] * unit[m * nb + b], acc);
            }
            y[m * ys + n] = acc + (bias == NULL ? 0.0f : bias[n]);
        }
    }
}

#if QWEN_A8_VNNI
#ifndef A8P_AHEAD
#define A8P_AHEAD 32768   /* bytes of the weight stream prefetched ahead, into L2 */
#endif
#ifndef A8P_HINT
#define A8P_HINT _MM_HINT_T1   /* where that prefetch puts them (T0 at 4 KB ahead measured the same) */
#endif
/* One row runs two panels at a time (a8p_vnni with NP = 2): on the AMX Xeon VM a model step's one-row products
 * read 13.8-14.2 GB/s against 12.8-13.0 one panel at a time (int4; int8 +5-8%), 92% of the probe.
 * -DA8P_PAIRS=0 builds the one-panel path for comparison. */
#ifndef A8P_PAIRS
#define A8P_PAIRS 1
#endif
/* Rows m < MR (MR <= 4) of NP (1 or 2) consecutive panels (panel h's weights at wp + h pb, its scales
 * and zeros at sp / zp + h sg), vectors v0 .. v0 + NV - 1 (16 features each): acc[h][m][v] += the
 * panels' products, block by block. One row: NV = 4 and int4's low and high nibbles in accumulators
 * of their own (the high ones masked in place, worth 16x: a shift a block instead of one a load); and
 * two panels side by side (NP = 2): two streams a panel apart, which the L2's streamer follows at once,
 * where one stream alone keeps too few lines in flight to read at the DRAM's rate on one core. Per
 * feature the operations and their order are the same whatever NP. */
static inline __attribute__((always_inline)) void a8p_vnni(
        int kind, int NP, int MR, int NV, int v0, const int8_t *d, const float *unit, const int32_t *dsum, int64_t K,
        int64_t ab, int64_t g, const uint8_t *wp, int64_t pb, const float *sp, const uint8_t *zp, int64_t sg,
        __m512 acc[][4][4]) {
    const int64_t nb = K / ab;
    const __m512i m0f = _mm512_set1_epi8(15), mf0 = _mm512_set1_epi8((char)0xf0);
    for (int64_t b = 0; b < nb; ++b) {
        __m512i lo[2][4][4], hi[2][4];
        for (int h = 0; h < NP; ++h)
            for (int v = 0; v < NV; ++v) {
                hi[h][v] = _mm512_setzero_si512();
                for (int m = 0; m < MR; ++m) lo[h][m][v] = _mm512_setzero_si512();
            }
        if (kind == 0) {
            for (int64_t kq = b * ab / 4; kq < (b + 1) * ab / 4; ++kq) {
                __m512i xb[4];
                for (int m = 0; m < MR; ++m) xb[m] = _mm512_set1_epi32(*(const int32_t *)(const void *)(d + m * K + 4 * kq));
                for (int h = 0; h < NP; ++h) {
                    const uint8_t *wq = wp + h * pb + kq * 256 + 64 * v0;
                    for (int v = 0; v < NV; ++v) _mm_prefetch((const char *)(wq + A8P_AHEAD + 64 * v), A8P_HINT);
                    for (int v = 0; v < NV; ++v) {
                        const __m512i wv = _mm512_loadu_si512((const void *)(wq + 64 * v));
                        for (int m = 0; m < MR; ++m) lo[h][m][v] = _mm512_dpbusd_epi32(lo[h][m][v], wv, xb[m]);
                    }
                }
            }
        } else {
            for (int64_t o = b * ab / 8; o < (b + 1) * ab / 8; ++o) {
                __m512i xl[4], xh[4];
                for (int m = 0; m < MR; ++m) {
                    xl[m] = _mm512_set1_epi32(*(const int32_t *)(const void *)(d + m * K + 8 * o));
                    xh[m] = _mm512_set1_epi32(*(const int32_t *)(const void *)(d + m * K + 8 * o + 4));
                }
                for (int h = 0; h < NP; ++h) {
                    const uint8_t *wo = wp + h * pb + o * 256 + 64 * v0;
                    for (int v = 0; v < NV; ++v) _mm_prefetch((const char *)(wo + A8P_AHEAD + 64 * v), A8P_HINT);
                    for (int v = 0; v < NV; ++v) {
                        const __m512i wv = _mm512_loadu_si512((const void *)(wo + 64 * v));
                        if (MR == 1) {
                            lo[h][0][v] = _mm512_dpbusd_epi32(lo[h][0][v], _mm512_and_si512(wv, m0f), xl[0]);
                            hi[h][v] = _mm512_dpbusd_epi32(hi[h][v], _mm512_and_si512(wv, mf0), xh[0]);
                        } else {
                            const __m512i l = _mm512_and_si512(wv, m0f), hn = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m0f);
                            for (int m = 0; m < MR; ++m)
                                lo[h][m][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo[h][m][v], l, xl[m]), hn, xh[m]);
                        }
                    }
                }
            }
            if (MR == 1)   /* the high nibbles' sums, 16x (exact) */
                for (int h = 0; h < NP; ++h)
                    for (int v = 0; v < NV; ++v) lo[h][0][v] = _mm512_add_epi32(lo[h][0][v], _mm512_srai_epi32(hi[h][v], 4));
        }
        for (int h = 0; h < NP; ++h)
            for (int v = 0; v < NV; ++v) {
                const int64_t at = h * sg + (b * ab / g) * 64 + 16 * (v0 + v);
                const __m512 sv = _mm512_loadu_ps(sp + at);
                const __m512 zv = kind == 0 ? _mm512_set1_ps(128.0f)
                                            : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zp + at))));
                for (int m = 0; m < MR; ++m) {
                    const __m512 f = _mm512_fnmadd_ps(zv, _mm512_set1_ps((float)dsum[m * nb + b]),
                                                      _mm512_cvtepi32_ps(lo[h][m][v]));
                    acc[h][m][v] = _mm512_fmadd_ps(f, _mm512_mul_ps(sv, _mm512_set1_ps(unit[m * nb + b])), acc[h][m][v]);
                }
            }
    }
}

/* acc[m][v] (+ bias) into y[m, 64 p + 16 (v0 + v) ..], the lanes below N. */
static inline void a8p_store(int MR, int NV, int v0, __m512 acc[4][4], const float *bias, int64_t p, int64_t N,
                             float *y, int64_t ys) {
    for (int v = 0; v < NV; ++v) {
        const int64_t n0 = 64 * p + 16 * (v0 + v);
        const __mmask16 mk = lanes_left(N - n0);
        const __m512 bv = bias == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk, bias + n0);
        for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ys + n0, mk, _mm512_add_ps(acc[m][v], bv));
    }
}

#define A8P_PANEL(KIND, MR)                                                                                    \
    static void a8p_panel_##KIND##_##MR(const int8_t *d, const float *unit, const int32_t *dsum, int64_t K,     \
                                        int64_t ab, int64_t g, const uint8_t *w, const float *s, const uint8_t *z, \
                                        const float *bias, int64_t p, int64_t N, float *y, int64_t ys) {          \
        const int64_t G = K / g, panel_bytes = KIND == 0 ? 64 * K : 32 * K;                                        \
        const int NV = MR == 1 ? 4 : 2;                                                                          \
        for (int v0 = 0; v0 < 4; v0 += NV) {                                                                     \
            if (64 * p + 16 * v0 >= N) break;                                                                    \
            __m512 acc[1][4][4];                                                                                 \
            for (int m = 0; m < 4; ++m)                                                                          \
                for (int v = 0; v < 4; ++v) acc[0][m][v] = _mm512_setzero_ps();                                  \
            a8p_vnni(KIND, 1, MR, NV, v0, d, unit, dsum, K, ab, g, w + p * panel_bytes, 0, s + p * G * 64,       \
                     KIND == 0 ? NULL : z + p * G * 64, 0, acc);                                                 \
            a8p_store(MR, NV, v0, acc[0], bias, p, N, y, ys);                                                    \
        }                                                                                                        \
    }
A8P_PANEL(0, 1) A8P_PANEL(0, 2) A8P_PANEL(0, 3) A8P_PANEL(0, 4)
A8P_PANEL(1, 1) A8P_PANEL(1, 2) A8P_PANEL(1, 3) A8P_PANEL(1, 4)
#undef A8P_PANEL
typedef void (*a8p_panel_kernel)(const int8_t *, const float *, const int32_t *, int64_t, int64_t, int64_t,
                                 const uint8_t *, const float *, const uint8_t *, const float *, int64_t, int64_t,
                                 float *, int64_t);
static const a8p_panel_kernel A8P_PANELS[2][5] = {
    {NULL, a8p_panel_0_1, a8p_panel_0_2, a8p_panel_0_3, a8p_panel_0_4},
    {NULL, a8p_panel_1_1, a8p_panel_1_2, a8p_panel_1_3, a8p_panel_1_4},
};
#define A8P_PAIR(KIND)                                                                                          \
    static void a8p_pair_##KIND(const int8_t *d, const float *unit, const int32_t *dsum, int64_t K, int64_t ab,    \
                                int64_t g, const uint8_t *w, const float *s, const uint8_t *z, const float *bias,    \
                                int64_t p, int64_t N, float *y) {                                                   \
        const int64_t G = K / g, panel_bytes = KIND == 0 ? 64 * K : 32 * K;                                        \
        __m512 acc[2][4][4];                                                                                     \
        for (int h = 0; h < 2; ++h)                                                                              \
            for (int v = 0; v < 4; ++v) acc[h][0][v] = _mm512_setzero_ps();                                      \
        a8p_vnni(KIND, 2, 1, 4, 0, d, unit, dsum, K, ab, g, w + p * panel_bytes, panel_bytes, s + p * G * 64,   \
                 KIND == 0 ? NULL : z + p * G * 64, G * 64, acc);                                                \
        for (int h = 0; h < 2; ++h) a8p_store(1, 4, 0, acc[h], bias, p + h, N, y, 0);                            \
    }
A8P_PAIR(0) A8P_PAIR(1)
#undef A8P_PAIR

#if QWEN_AMX
/* tmm0-3: C, R rows x 16 features (int32) each; tmm4: A, R rows x 64 digits; tmm5: B, 16 quads x 16 features. */
static __attribute__((target("amx-tile,amx-int8"))) void a8p_amx_configure(int R) {
    amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; ++t) {
        c.rows[t] = (uint8_t)(t == 5 ? 16 : R);
        c.colsb[t] = 64;
    }
    AMX_MEMORY();
    _tile_loadconfig(&c);
}

/* Rows m0 .. m0 + R - 1 (R <= 16, tiles configured for R) of panel p on AMX: per block of k, the four C
 * tiles (TDPBSUD: signed digits x unsigned weights), then the block's fp32 step in linear_*_a8's order.
 * tile: 1 KB scratch for int4's unpacked B tile; acc: [16][64] fp32. */
static __attribute__((target("amx-tile,amx-int8"))) void a8p_amx_rows(
        int kind, int R, const int8_t *d, const float *unit, const int32_t *dsum, int64_t K, int64_t ab, int64_t g,
        const uint8_t *wp, const float *sp, const uint8_t *zp, uint8_t *tile, float *acc) {
    const int64_t nb = K / ab;
    int32_t ct[4][16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 64; ++i) acc[i] = 0.0f;
    const __m512i m0f = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        amx_zero_c();   /* and the barrier: d was just written, and the A tile loads name no memory */
        for (int64_t k = b * ab; k < (b + 1) * ab; k += 64) {
            _tile_loadd(4, d + k, K);
#define A8P_TDP(V)                                                                                              \
            if (kind == 0) {                                                                                    \
                _tile_loadd(5, wp + (k / 4) * 256 + 64 * V, 256);                                               \
            } else {                                                                                            \
                for (int j = 0; j < 8; ++j) {                                                                   \
                    const __m512i wv = _mm512_loadu_si512((const void *)(wp + (k / 8 + j) * 256 + 64 * V));       \
                    _mm512_store_si512((void *)(tile + 128 * j), _mm512_and_si512(wv, m0f));                     \
                    _mm512_store_si512((void *)(tile + 128 * j + 64), _mm512_and_si512(_mm512_srli_epi16(wv, 4), m0f)); \
                }                                                                                               \
                AMX_MEMORY();                                                                                   \
                _tile_loadd(5, tile, 64);                                                                       \
            }                                                                                                   \
            _tile_dpbsud(V, 4, 5);
            A8P_TDP(0) A8P_TDP(1) A8P_TDP(2) A8P_TDP(3)
#undef A8P_TDP
        }
        _tile_stored(0, ct[0], 64);
        _tile_stored(1, ct[1], 64);
        _tile_stored(2, ct[2], 64);
        _tile_stored(3, ct[3], 64);
        AMX_MEMORY();
        const int64_t at = (b * ab / g) * 64;
        for (int v = 0; v < 4; ++v) {
            const __m512 sv = _mm512_loadu_ps(sp + at + 16 * v);
            const __m512 zv = kind == 0 ? _mm512_set1_ps(128.0f)
                                        : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zp + at + 16 * v))));
            for (int m = 0; m < R; ++m) {
                const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(ct[v] + 16 * m)));
                const __m512 f = _mm512_fnmadd_ps(zv, _mm512_set1_ps((float)dsum[m * nb + b]), sum);
                float *a = acc + 64 * m + 16 * v;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(f, _mm512_mul_ps(sv, _mm512_set1_ps(unit[m * nb + b])),
                                                    _mm512_loadu_ps(a)));
            }
        }
    }
}

static __attribute__((target("amx-tile,amx-int8"))) void a8p_amx(
        int kind, const int8_t *d, const float *unit, const int32_t *dsum, int64_t M, const uint8_t *w, const float *s,
        const uint8_t *z, int64_t g, int64_t ab, const float *bias, int64_t P, int64_t N, int64_t K, float *y,
        int64_t ys, int threads) {
    const int64_t G = K / g, nb = K / ab, panel_bytes = kind == 0 ? 64 * K : 32 * K;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && P > 1)
    {
        uint8_t tile[1024] __attribute__((aligned(64)));
        float acc[16 * 64] __attribute__((aligned(64)));
        int tiles = 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int R = M - m0 < 16 ? (int)(M - m0) : 16;
                if (R != tiles) a8p_amx_configure(tiles = R);
                a8p_amx_rows(kind, R, d + m0 * K, unit + m0 * nb, dsum + m0 * nb, K, ab, g, w + p * panel_bytes,
                             s + p * G * 64, kind == 0 ? NULL : z + p * G * 64, tile, acc);
                for (int v = 0; v < 4; ++v) {
                    const int64_t n0 = 64 * p + 16 * v;
                    const __mmask16 mk = lanes_left(N - n0);
                    const __m512 bv = bias == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk, bias + n0);
                    for (int m = 0; m < R; ++m)
                        _mm512_mask_storeu_ps(y + (m0 + m) * ys + n0, mk, _mm512_add_ps(_mm512_loadu_ps(acc + 64 * m + 16 * v), bv));
                }
            }
        }
        if (tiles) amx_tile_release();
    }
}
#endif
#endif

/* a8_quantize's digits, units and sums (the same bits) of fp32 or (x_bf16) bf16 rows x, vectorized:
 * per call it is a few us of a one-row product that streams 1-6 MB in 70-450 us. */
static int a8p_quantize(const void *x, int x_bf16, int64_t xs, int64_t M, int64_t K, int64_t ab, int8_t *d,
                        float *unit, int32_t *dsum) {
    const int64_t nb = K / ab;
#if QWEN_AVX512
    const __m512 top = _mm512_set1_ps(3.4028234663852886e38f);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t at = m * xs + b * ab;
#define A8P_LOAD(I, MK)                                                                                         \
            (x_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(                               \
                          _mm256_maskz_loadu_epi16(MK, (const uint16_t *)x + at + (I))), 16))                  \
                    : _mm512_maskz_loadu_ps(MK, (const float *)x + at + (I)))
            __m512 amax = _mm512_setzero_ps();
            __mmask16 bad = 0;
            for (int64_t i = 0; i < ab; i += 16) {
                const __mmask16 mk = lanes_left(ab - i);
                const __m512 a = _mm512_abs_ps(A8P_LOAD(i, mk));
                amax = _mm512_max_ps(amax, a);
                bad |= _mm512_mask_cmp_ps_mask(mk, a, top, _CMP_NLE_UQ);    /* NaN or infinite */
            }
            const float am = _mm512_reduce_max_ps(amax);
            unit[m * nb + b] = bad ? NAN : am / 127.0f;
            const __m512 scale = _mm512_set1_ps(!bad && am > 0.0f ? 127.0f / am : 0.0f);
            __m512i total = _mm512_setzero_si512();
            for (int64_t i = 0; i < ab; i += 16) {
                const __mmask16 mk = lanes_left(ab - i);
                __m512i di = _mm512_setzero_si512();
                if (!bad) {
                    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(A8P_LOAD(i, mk), scale),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    di = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)),
                                                          _mm512_set1_ps(127.0f)));
                }
                total = _mm512_add_epi32(total, di);
                _mm512_mask_cvtepi32_storeu_epi8(d + m * K + b * ab + i, mk, di);
            }
#undef A8P_LOAD
            dsum[m * nb + b] = _mm512_reduce_add_epi32(total);
        }
    return 0;
#else
    float *row = malloc(sizeof(float) * (size_t)K);
    if (row == NULL) return -1;
    for (int64_t m = 0; m < M; ++m) {
        if (x_bf16) bf16_row_to_f32((const uint16_t *)x + m * xs, K, row);
        else memcpy(row, (const float *)x + m * xs, sizeof(float) * (size_t)K);
        a8_quantize(row, K, 1, K, ab, d + m * K, NULL, 64, unit + m * nb, dsum + m * nb);
    }
    free(row);
    return 0;
#endif
}

/* The entry point of linear_a8_panels: kind 0 int8, 1 int4 (z its zeros, else NULL); w, s, z as above
 * with P = ceil(N / 64) panels. Returns 0, or -1 when scratch memory could not be allocated. */
int qwen_linear_a8_panels(int kind, const void *x, int64_t xs, int64_t x_bf16, int64_t M, const uint8_t *w,
                          const float *s, const uint8_t *z, int64_t g, const float *bias, int64_t N, int64_t K,
                          void *out, int64_t ys, int64_t out_bf16, int64_t threads, int64_t portable) {
    const int64_t ab = a8_block(g), nb = K / ab, P = (N + 63) / 64;
    if (M <= 0 || N <= 0) return 0;
    /* digits [M][K], unit and dsum [M][nb], and for a bf16 output its fp32 rows [M][N] */
    const size_t dbytes = ((size_t)(M * K) + sizeof(float) * (size_t)(2 * M * nb) + 127) / 64 * 64;
    int8_t *d = malloc(dbytes + (out_bf16 ? sizeof(float) * (size_t)(M * N) : 0) + 64);
    if (d == NULL) return -1;
    float *unit = (float *)(void *)(((uintptr_t)(d + M * K) + 63) & ~(uintptr_t)63);
    int32_t *dsum = (int32_t *)(unit + M * nb);
    float *y = out_bf16 ? (float *)(void *)(((uintptr_t)(dsum + M * nb) + 63) & ~(uintptr_t)63) : (float *)out;
    if (out_bf16) ys = N;
#if QWEN_A8_VNNI
    /* The start of each thread's share of the weights (the split below), on its way while x is quantized:
     * the streams' own prefetch runs A8P_AHEAD bytes ahead of their loads, so their first bytes come late. */
    if (!portable && M <= 4) {
        const int64_t panel_bytes = kind == 0 ? 64 * K : 32 * K;
        for (int64_t t = 0; t < threads; ++t) {
            const int64_t first = P * t / threads * panel_bytes, left = P * panel_bytes - first;
            for (int64_t l = 0; l < (left < A8P_AHEAD ? left : A8P_AHEAD); l += 64)
                _mm_prefetch((const char *)(w + first + l), _MM_HINT_T1);
        }
    }
#endif
    if (a8p_quantize(x, (int)x_bf16, xs, M, K, ab, d, unit, dsum) != 0) {
        free(d);
        return -1;
    }
    int64_t done = 0;   /* panels 0 .. done - 1 written by the vector paths */
#if QWEN_A8_VNNI
    if (!portable && ab % (kind == 0 ? 4 : 8) == 0) {
#if QWEN_AMX
        if (M > 4 && ab % 64 == 0 && qwen_int8_amx()) {
            a8p_amx(kind, d, unit, dsum, M, w, s, z, g, ab, bias, P, N, K, y, ys, (int)threads);
            done = P;
        }
#endif
        if (done == 0) {
#pragma omp parallel num_threads((int)threads) if (threads > 1 && P > 1)
            {
#ifdef _OPENMP
                const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
                const int64_t t = 0, nt = 1;
#endif
                const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
                int64_t p = p0;
                if (M == 1 && A8P_PAIRS)   /* one row: two panels at a time (two streams) */
                    for (; p + 1 < p1; p += 2)
                        (kind == 0 ? a8p_pair_0 : a8p_pair_1)(d, unit, dsum, K, ab, g, w, s, z, bias, p, N, y);
                for (; p < p1; ++p)
                    for (int64_t m = 0; m < M; m += 4) {
                        const int MR = M - m < 4 ? (int)(M - m) : 4;
                        A8P_PANELS[kind][MR](d + m * K, unit + m * nb, dsum + m * nb, K, ab, g, w, s, z, bias, p, N,
                                             y + m * ys, ys);
                    }
            }
            done = P;
        }
    }
#endif
    (void)portable;
    if (done < P) a8p_rows_portable(kind, d, unit, dsum, M, w, s, z, g, ab, bias, done, N, K, y, ys, (int)threads);
    if (out_bf16)
        for (int64_t m = 0; m < M; ++m) f32_row_to_bf16(y + m * N, N, (uint16_t *)out + m * N);
    free(d);
    return 0;
}

/* x permuted per 32 elements as raw32_int4's lanes read them: [x0, x2, ..., x30, x1, x3, ..., x31]. */
static void quant_permute_x(const float *x, int64_t xs, int64_t M, int64_t K, float *xp) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 32)
            for (int i = 0; i < 16; ++i) {
                xp[m * K + k + i] = x[m * xs + k + 2 * i];
                xp[m * K + k + 16 + i] = x[m * xs + k + 2 * i + 1];
            }
}

/* The entry point: kind as above; z only for int4 (else NULL); bn only for fp8 (else 1). Returns
 * 0, or -1 when scratch memory could not be allocated (nothing written). */
int qwen_linear_quant(int kind, const float *x, int64_t xs, int64_t M, const uint8_t *q, const float *s,
                      const uint8_t *z, int64_t g, int64_t bn, const float *bias, int64_t N, int64_t K, float *y,
                      int64_t ys, int64_t threads) {
#if QWEN_AVX512
    const int64_t step = kind == 1 ? 32 : 16;
    if (K % step == 0 && g % step == 0 && M > 0) {
        if (kind != 1)
            return quant_rows_avx512(kind, x, xs, NULL, x, xs, M, q, s, z, g, bn, bias, N, K, y, ys, (int)threads);
#if QWEN_INT4_VNNI
        if (M == 1 && K % 64 == 0 && g % 64 == 0) {
            if (int4_vnni(x, q, s, z, g, bias, N, K, y, (int)threads) != 0) return -1;
            if (N % 4)   /* the last N % 4 weight rows */
                quant_rows_portable(kind, x, xs, M, q, s, z, g, bn, bias, N - N % 4, N, K, y, ys, 1);
            return 0;
        }
#endif
        const int64_t sg = K / g;
        float *xp = malloc(sizeof(float) * (size_t)(M * (K + sg)));
        if (xp == NULL) return -1;
        float *xsum = xp + M * K;
        quant_permute_x(x, xs, M, K, xp);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t grp = 0; grp < sg; ++grp) {
                float t = 0.0f;
                for (int64_t k = grp * g; k < (grp + 1) * g; ++k) t += x[m * xs + k];
                xsum[m * sg + grp] = t;
            }
        const int status = quant_rows_avx512(kind, xp, K, xsum, x, xs, M, q, s, z, g, bn, bias, N, K, y, ys,
                                             (int)threads);
        free(xp);
        return status;
    }
#endif
    quant_rows_portable(kind, x, xs, M, q, s, z, g, bn, bias, 0, N, K, y, ys, (int)threads);
    return 0;
}

#include "qwen_cpu_flash.c"
#include "qwen_cpu_lora.c"
