/* Native CPU kernels of torch.ops.qwen.kv_write and torch.ops.qwen.slot_attention, and the fp32
 * pieces of the models' eager CPU forward (from the middle of the file on): fused norms, RoPE and
 * SiLU * up, a packed-panel matrix product, one layer's attention block, and the whole dense
 * forward in one call.
 *
 * Plain C, no torch headers: qwen_ops/kernels/cpu.py compiles this file with the system C
 * compiler on first use (about a second), caches the shared library, and calls it through
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
 * Dtype codes: 0 = float32, 1 = float16, 2 = bfloat16.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static inline void load_row(const void *base, int64_t offset, int dtype, int64_t n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    } else if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) dst[d] = f16_to_f32(p[d]);
    } else {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_f32(p[d]);
    }
}

static inline void store_row(void *base, int64_t offset, int dtype, int64_t n, const float *src) {
    if (dtype == 0) {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    } else if (dtype == 1) {
        uint16_t *p = (uint16_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) p[d] = f32_to_f16(src[d]);
    } else {
        uint16_t *p = (uint16_t *)base + offset;
        for (int64_t d = 0; d < n; ++d) p[d] = f32_to_bf16(src[d]);
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

/* Positions t .. of a sequence of n that lie in the block holding position t (t is a block start). */
static inline int64_t rows_in_block(int64_t n, int64_t t, int64_t block_size) {
    return n - t < block_size ? n - t : block_size;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512 paths for fp32 caches with head_dim a multiple of 16 (every Qwen head dim). */

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

/* The four dot products q4[g*D ..] . k for g < 4 at once: one FMA chain per head, then a
 * shuffle network that sums the four vectors into [s0, s1, s2, s3] (no scalar reduction chains). */
static inline __attribute__((always_inline)) __m128 dot4_avx512(const float *q4, const float *k, int64_t D) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 kv = _mm512_loadu_ps(k + d);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q4 + d), kv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q4 + D + d), kv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q4 + 2 * D + d), kv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q4 + 3 * D + d), kv, a3);
    }
    return sum4_avx512(a0, a1, a2, a3);
}

/* out[0:D] = sum_t p[t] v_t over t < n, v_t = the row of head offset off_h at position t, read
 * through the block table; the accumulator stays in registers (NV = D / 16 of them). */
static inline __attribute__((always_inline)) void wsum_avx512(float *out, const float *p, const float *cache,
                                                              const int32_t *blocks, int64_t bt_s1, int64_t block_size,
                                                              int64_t sb, int64_t sr, int64_t off_h, int64_t n,
                                                              const int NV) {
    __m512 acc[16];
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0, b = 0; t < n; ++b) {
        const float *base = cache + blocks[b * bt_s1] * sb + off_h;
        const int64_t rows = rows_in_block(n, t, block_size);
        for (int64_t r = 0; r < rows; ++r, ++t) {
            const float *v = base + r * sr;
            const __m512 pt = _mm512_set1_ps(p[t]);
            for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
    }
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

static void wsum_any_avx512(float *out, const float *p, const float *cache, const int32_t *blocks, int64_t bt_s1,
                            int64_t block_size, int64_t sb, int64_t sr, int64_t off_h, int64_t n, int64_t D) {
    switch (D) {   /* constant trip counts: the accumulators are registers */
        case 32: wsum_avx512(out, p, cache, blocks, bt_s1, block_size, sb, sr, off_h, n, 2); return;
        case 64: wsum_avx512(out, p, cache, blocks, bt_s1, block_size, sb, sr, off_h, n, 4); return;
        case 128: wsum_avx512(out, p, cache, blocks, bt_s1, block_size, sb, sr, off_h, n, 8); return;
        case 256: wsum_avx512(out, p, cache, blocks, bt_s1, block_size, sb, sr, off_h, n, 16); return;
        default: break;
    }
    memset(out, 0, sizeof(float) * (size_t)D);
    for (int64_t t = 0, b = 0; t < n; ++b) {
        const float *base = cache + blocks[b * bt_s1] * sb + off_h;
        const int64_t rows = rows_in_block(n, t, block_size);
        for (int64_t r = 0; r < rows; ++r, ++t) axpy_n(out, p[t], base + r * sr, D);
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

/* Prefetch the rows of a key/value block: a block is the unit of contiguity in a paged cache,
 * and a decode step reads many short sequences' blocks scattered over the cache, which the
 * hardware prefetcher cannot guess across. */
static inline void prefetch_block(const void *base, int64_t offset, int64_t rows, int64_t row_stride,
                                  int64_t row_elems, int64_t elem) {
    const char *p = (const char *)base + offset * elem;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < row_elems * elem; b += 64) __builtin_prefetch(p + r * row_stride * elem + b, 0, 1);
}

/* Causal GQA attention of each sequence's query rows over its slot's paged keys and values.
 * out is contiguous [num_tokens, num_heads, head_dim] in the query dtype. Returns 0, or -1 when
 * scratch memory could not be allocated (nothing is then written).
 *
 * Per query row: one pass over the keys computes the scores of every head (each cache row,
 * all kv heads, is read once and whole), a softmax per head, then one pass over the values. */
int qwen_slot_attention(const void *query, void *out, const void *key_cache, const void *value_cache,
                        const int32_t *block_table, const int32_t *seq_slots, const int32_t *query_start_loc,
                        const int32_t *seq_lens, const void *gate,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int dtype, float scale,
                        int64_t q_s0, int64_t q_s1, int64_t g_s0, int64_t g_s1,
                        int64_t k_sb, int64_t k_sr, int64_t k_sh, int64_t v_sb, int64_t v_sr, int64_t v_sh,
                        int64_t bt_s0, int64_t bt_s1) {
    const int64_t H = num_heads, G = num_heads / num_kv_heads, D = head_dim;
    const int64_t elem = dtype == 0 ? 4 : 2;
    const int64_t row_elems = num_kv_heads * D;   /* one cache row, when its heads are packed */
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_slots[i] >= 0 && seq_lens[i] > max_len) max_len = seq_lens[i];
    /* scores [H][max_len], q [H][D], acc [H][D], one converted row [D] */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(H * max_len + 2 * H * D + D));
    if (scratch == NULL) return -1;
    float *scores = scratch;
    float *q = scores + H * max_len;
    float *acc = q + H * D;
    float *row = acc + H * D;
#if QWEN_AVX512
    const int fast = dtype == 0 && D % 16 == 0;
#endif

    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t start = query_start_loc[i], end = query_start_loc[i + 1];
        const int32_t slot = seq_slots[i];
        if (slot < 0) {
            memset((char *)out + start * H * D * elem, 0, (size_t)((end - start) * H * D * elem));
            continue;
        }
        const int64_t seq_len = seq_lens[i];
        const int64_t q_len = end - start;
        const int32_t *blocks = block_table + slot * bt_s0;
        for (int64_t j = 0; j < q_len; ++j) {
            const int64_t token = start + j;
            const int64_t n = seq_len - q_len + j + 1;        /* keys 0 .. position of this row */
            for (int64_t h = 0; h < H; ++h) {
                load_row(query, token * q_s0 + h * q_s1, dtype, D, q + h * D);
                for (int64_t d = 0; d < D; ++d) q[h * D + d] *= scale;
            }
            /* scores[h][t] = q_h . k_t */
            for (int64_t t = 0, b = 0; t < n; ++b) {       /* block by block: no division per key */
                const int64_t block = blocks[b * bt_s1];
                const int64_t rows = rows_in_block(n, t, block_size);
                if (t + rows < n)
                    prefetch_block(key_cache, blocks[(b + 1) * bt_s1] * k_sb, rows_in_block(n, t + rows, block_size),
                                   k_sr, row_elems, elem);
                for (int64_t r = 0; r < rows; ++r, ++t) {
                    for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
                        const float *k = cache_row(key_cache, block * k_sb + r * k_sr + kh * k_sh, dtype, D, row);
                        int64_t g = 0;
#if QWEN_AVX512
                        if (fast)
                            for (; g + 4 <= G; g += 4) {
                                float s4[4];
                                _mm_storeu_ps(s4, dot4_avx512(q + (kh * G + g) * D, k, D));
                                for (int64_t e = 0; e < 4; ++e) scores[(kh * G + g + e) * max_len + t] = s4[e];
                            }
#endif
                        for (; g < G; ++g)
                            scores[(kh * G + g) * max_len + t] = dot(q + (kh * G + g) * D, k, D);
                    }
                }
            }
            /* softmax per head, in place */
            for (int64_t h = 0; h < H; ++h) {
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
            /* acc[h] = sum_t p[h][t] v_t */
#if QWEN_AVX512
            if (fast) {
                for (int64_t h = 0; h < H; ++h)
                    wsum_any_avx512(acc + h * D, scores + h * max_len, (const float *)value_cache, blocks, bt_s1,
                                    block_size, v_sb, v_sr, (h / G) * v_sh, n, D);
                goto weighted_sum_done;
            }
#endif
            memset(acc, 0, sizeof(float) * (size_t)(H * D));
            for (int64_t t = 0, b = 0; t < n; ++b) {
                const int64_t block = blocks[b * bt_s1];
                const int64_t rows = rows_in_block(n, t, block_size);
                if (t + rows < n)
                    prefetch_block(value_cache, blocks[(b + 1) * bt_s1] * v_sb, rows_in_block(n, t + rows, block_size),
                                   v_sr, row_elems, elem);
                for (int64_t r = 0; r < rows; ++r, ++t) {
                    for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
                        const float *v = cache_row(value_cache, block * v_sb + r * v_sr + kh * v_sh, dtype, D, row);
                        for (int64_t g = 0; g < G; ++g)
                            axpy(acc + (kh * G + g) * D, scores[(kh * G + g) * max_len + t], v, D);
                    }
                }
            }
#if QWEN_AVX512
        weighted_sum_done:
#endif
            for (int64_t h = 0; h < H; ++h) {
                float *a = acc + h * D;
                if (gate != NULL) {
                    load_row(gate, token * g_s0 + h * g_s1, dtype, D, row);
                    for (int64_t d = 0; d < D; ++d) a[d] *= 1.0f / (1.0f + expf(-row[d]));
                }
                store_row(out, (token * H + h) * D, dtype, D, a);
            }
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

/* exp(x) for any float x (clamped to [-87, 88]): exp_nonpositive's reduction, which is valid on
 * both sides of zero. */
static inline float exp_any(float x) {
    x = x > 88.0f ? 88.0f : x;
    return exp_nonpositive(x);
}

/* out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up over rows of dim (the gated MLP);
 * silu rounded before the product, as F.silu(gate) * up rounds it. */
void qwen_silu_mul(const float *gate, int64_t g_s0, const float *up, int64_t u_s0, float *out, int64_t rows,
                   int64_t dim) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate + r * g_s0, *u = up + r * u_s0;
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) {
            const float silu = g[i] / (1.0f + exp_any(-g[i]));
            o[i] = silu * u[i];
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * Fused fp32 pieces of a dense Qwen decoder layer for eager CPU decode, where each torch op
 * costs microseconds of dispatch: RMSNorm (optionally after a residual add) replaces ~9 ops,
 * q/k RMSNorm + RoPE replaces ~34 per layer. Same math as qwen_ops/model.py (mean square in
 * fp32, x * rsqrt(ms + eps) then * weight; RoPE halves: x1 cos - x2 sin, x2 cos + x1 sin);
 * summation order differs from torch's, so results agree to fp32 rounding.
 * ---------------------------------------------------------------------------------------------- */

/* Each product and sum rounded on its own, as torch's separate mul/sub/add ops round them (GCC
 * would otherwise contract a * b - c * d into fused multiply-adds). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

static inline float inv_rms(const float *x, int64_t dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < dim; ++d) ss += x[d] * x[d];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* out[r] = w * (s / rms(s)), s = x[r] + add[r] when add is given (s is then written to sum[r]),
 * else s = x[r]. Rows of dim floats, contiguous within the row. */
void qwen_rms_norm(const float *x, int64_t x_s0, const float *add, int64_t add_s0, float *sum, int64_t sum_s0,
                   const float *w, float *out, int64_t out_s0, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *s = x + r * x_s0;
        if (add != NULL) {
            float *dst = sum + r * sum_s0;
            const float *a = add + r * add_s0;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) dst[d] = s[d] + a[d];
            s = dst;
        }
        const float inv = inv_rms(s, dim, eps);
        float *o = out + r * out_s0;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = w[d] * (s[d] * inv);
    }
}

/* One head row: optional RMSNorm (w != NULL), then RoPE with cs = [cos | sin] of the position. */
static inline void norm_rope_row(const float *x, const float *w, float eps, const float *cs, int64_t D,
                                 float *tmp, float *out) {
    const int64_t half = D / 2;
    if (w != NULL) {
        const float inv = inv_rms(x, D, eps);
        for (int64_t d = 0; d < D; ++d) tmp[d] = w[d] * (x[d] * inv);
        x = tmp;
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
 * table [max_pos, D] (cos in the first half of a row, sin in the second). */
void qwen_qk_norm_rope(const float *q, int64_t q_s0, int64_t q_s1, int64_t nq,
                       const float *k, int64_t k_s0, int64_t k_s1, int64_t nk,
                       const float *q_w, const float *k_w, float eps,
                       const float *table, int64_t table_s0, const int32_t *positions,
                       float *qo, float *ko, int64_t T, int64_t D, float *tmp) {
    for (int64_t t = 0; t < T; ++t) {
        const float *cs = table + (int64_t)positions[t] * table_s0;
        for (int64_t h = 0; h < nq; ++h) norm_rope_row(q + t * q_s0 + h * q_s1, q_w, eps, cs, D, tmp, qo + (t * nq + h) * D);
        for (int64_t h = 0; h < nk; ++h) norm_rope_row(k + t * k_s0 + h * k_s1, k_w, eps, cs, D, tmp, ko + (t * nk + h) * D);
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* ----------------------------------------------------------------------------------------------
 * Linear layers on packed weights, and the whole dense forward of an fp32 batch in one call.
 *
 * A decode step of a small model on one CPU core is a chain of matrix-vector products over
 * weights that live in the L2/L3 caches, with ~150 torch ops around them whose dispatch costs
 * more than their arithmetic. qwen_dense_forward runs the complete stack (norms, projections,
 * q/k-norm + RoPE, kv write, attention, MLP, final norm, lm_head) in one call, with the same
 * math as qwen_ops/model.py and the kernels above; qwen_linear_packed is its matrix product, on
 * weights packed once into 32-feature panels: at 1 row it streams the weight at about 70 GB/s
 * (MKL's sgemv on these AMD CPUs: about 25), at 16+ rows it runs at oneDNN's speed.
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
/* The sum over k runs in blocks of PANEL_KB, each summed in registers, then added to the output:
 * one sequential fp32 chain over all of K would round K times in a row (max error 6x MKL's at
 * K = 3072, measured), blocks bound it by PANEL_KB + K / PANEL_KB (as close to MKL as measured). */
#define PANEL_KB 128

#if QWEN_AVX512
/* y[m, 0:cols] (+ bias) for m < MR against one panel; cols <= 32. */
static inline __attribute__((always_inline)) void panel_block_avx512(const float *x, int64_t xs, const float *wp,
                                                                     int64_t K, const float *bias, float *y,
                                                                     int64_t ys, int64_t cols, const int MR) {
    const __mmask16 lo = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1u);
    const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1u);
    __m512 acc[PANEL_MR][2];
    for (int64_t k0 = 0; k0 < K; k0 += PANEL_KB) {
        const int64_t k1 = K - k0 < PANEL_KB ? K : k0 + PANEL_KB;
        for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; ++k) {
            const __m512 b0 = _mm512_loadu_ps(wp + k * 32), b1 = _mm512_loadu_ps(wp + k * 32 + 16);
            for (int m = 0; m < MR; ++m) {
                const __m512 a = _mm512_set1_ps(x[m * xs + k]);
                acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
            }
        }
        if (k0 > 0)
            for (int m = 0; m < MR; ++m) {
                acc[m][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(lo, y + m * ys), acc[m][0]);
                acc[m][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(hi, y + m * ys + 16), acc[m][1]);
            }
        if (k1 == K && bias != NULL) {
            const __m512 bias0 = _mm512_maskz_loadu_ps(lo, bias), bias1 = _mm512_maskz_loadu_ps(hi, bias + 16);
            for (int m = 0; m < MR; ++m) {
                acc[m][0] = _mm512_add_ps(acc[m][0], bias0);
                acc[m][1] = _mm512_add_ps(acc[m][1], bias1);
            }
        }
        for (int m = 0; m < MR; ++m) {
            _mm512_mask_storeu_ps(y + m * ys, lo, acc[m][0]);
            _mm512_mask_storeu_ps(y + m * ys + 16, hi, acc[m][1]);
        }
    }
}
#endif

/* y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < M, n < N, from the packed wp (qwen_pack_panels);
 * x rows of stride xs, y rows of stride ys. Panel by panel, PANEL_MR input rows at a time. */
void qwen_linear_packed(const float *x, int64_t xs, int64_t M, const float *wp, const float *bias, int64_t N,
                        int64_t K, float *y, int64_t ys) {
    const int64_t P = (N + 31) / 32;
    for (int64_t p = 0; p < P; ++p) {
        const float *panel = wp + p * K * 32;
        const int64_t n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
        const float *b = bias == NULL ? NULL : bias + n0;
#if QWEN_AVX512
        int64_t m = 0;
        for (; m + PANEL_MR <= M; m += PANEL_MR)
            panel_block_avx512(x + m * xs, xs, panel, K, b, y + m * ys + n0, ys, cols, PANEL_MR);
        const float *xm = x + m * xs;
        float *ym = y + m * ys + n0;
        switch (M - m) {   /* constant row counts: the accumulators stay in registers */
            case 11: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 11); break;
            case 10: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 10); break;
            case 9: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 9); break;
            case 8: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 8); break;
            case 7: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 7); break;
            case 6: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 6); break;
            case 5: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 5); break;
            case 4: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 4); break;
            case 3: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 3); break;
            case 2: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 2); break;
            case 1: panel_block_avx512(xm, xs, panel, K, b, ym, ys, cols, 1); break;
            default: break;
        }
#else
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
#endif
    }
}

/* The attention of one layer after its q/k/v projections, fp32: per-head q/k RMSNorm (q_w / k_w;
 * none when NULL) and RoPE at positions (checked by the caller against the table), the keys and
 * values written to the caches (qwen_kv_write), then qwen_slot_attention into out [T, num_heads *
 * head_dim], contiguous. q, k, v: rows of the projections (strides q_s0, k_s0, v_s0; heads
 * contiguous within a row). Both caches have the strides (c_sb, c_sr, c_sh). Metadata trusted.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int qwen_attention_block(const float *q, int64_t q_s0, const float *k, int64_t k_s0, const float *v, int64_t v_s0,
                         int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         const float *q_w, const float *k_w, float eps, const float *rope, int64_t rope_s0,
                         const int32_t *positions, float *key_cache, float *value_cache, int64_t block_size,
                         int64_t c_sb, int64_t c_sr, int64_t c_sh, const int32_t *slot_ids,
                         const int32_t *block_table, int64_t bt_s0, int64_t bt_s1, const int32_t *seq_slots,
                         const int32_t *query_start_loc, const int32_t *seq_lens, int64_t num_seqs, float scale,
                         float *out) {
    const int64_t D = head_dim, QD = num_heads * D, KD = num_kv_heads * D;
    float *buf = malloc(sizeof(float) * (size_t)(T * (QD + KD) + D));
    if (buf == NULL) return -1;
    float *qr = buf, *kr = qr + T * QD, *tmp = kr + T * KD;
    qwen_qk_norm_rope(q, q_s0, D, num_heads, k, k_s0, D, num_kv_heads, q_w, k_w, eps, rope, rope_s0, positions,
                      qr, kr, T, D, tmp);
    qwen_kv_write(kr, v, key_cache, value_cache, slot_ids, positions, block_table, T, num_kv_heads, D, 4,
                  KD, D, v_s0, D, block_size, c_sb, c_sr, c_sh, c_sb, c_sr, c_sh, bt_s0, bt_s1);
    const int status = qwen_slot_attention(qr, out, key_cache, value_cache, block_table, seq_slots, query_start_loc,
                                           seq_lens, NULL, num_seqs, num_heads, num_kv_heads, D, block_size, 0,
                                           scale, QD, D, 0, 0, c_sb, c_sr, c_sh, c_sb, c_sr, c_sh, bt_s0, bt_s1);
    free(buf);
    return status;
}

/* Per-layer weight addresses, in this order, NULL where the model has none (biases of Qwen3,
 * q/k norms of Qwen2). Every matrix [out_features, in_features] is packed (qwen_pack_panels). */
enum {
    W_INPUT_NORM, W_Q, B_Q, W_K, B_K, W_V, B_V, W_Q_NORM, W_K_NORM, W_O, B_O, W_POST_NORM, W_GATE, W_UP, W_DOWN,
    W_PER_LAYER
};

int64_t qwen_dense_weights_per_layer(void) { return W_PER_LAYER; }

/* The dense Qwen2/Qwen3 forward of T tokens (fp32 weights, activations and caches), in place on
 * the residual stream h [T, hidden] (the embeddings in; overwritten), ending in the logits
 * [num_rows, vocab] of the rows h[rows[r]]. weights: [num_layers, W_PER_LAYER] addresses;
 * caches: [num_layers, 2] addresses of each layer's key and value cache, all of one shape and
 * these strides (elements): [num_blocks, block_size, num_kv_heads, head_dim]. Attention metadata
 * as for qwen_kv_write and qwen_slot_attention, trusted (the caller validates it).
 *
 * Returns 0; -1 when scratch memory could not be allocated, -2 when a position is outside the
 * RoPE table [0, max_pos), -3 when a row index is outside [0, T): both checked before anything
 * is written. */
int qwen_dense_forward(const int64_t *weights, int64_t num_layers, const int64_t *caches,
                       int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                       float eps, float scale, float *h, int64_t T, const int32_t *positions,
                       const float *rope, int64_t rope_s0, int64_t max_pos,
                       const int32_t *slot_ids, const int32_t *block_table, int64_t bt_s0, int64_t bt_s1,
                       const int32_t *seq_slots, const int32_t *query_start_loc, const int32_t *seq_lens,
                       int64_t num_seqs, int64_t block_size, int64_t c_sb, int64_t c_sr, int64_t c_sh,
                       const int64_t *rows, int64_t num_rows, const float *final_norm, const float *lm_head,
                       int64_t vocab, float *logits) {
    for (int64_t t = 0; t < T; ++t)
        if (positions[t] < 0 || positions[t] >= max_pos) return -2;
    for (int64_t r = 0; r < num_rows; ++r)
        if (rows[r] < 0 || rows[r] >= T) return -3;
    const int64_t H = hidden, QD = num_heads * head_dim, KD = num_kv_heads * head_dim, I = inter;
    /* x: normed rows; q, k, v: projections; o: attention out; proj: o_proj / down_proj out; g, u: MLP */
    const int64_t need = T * (2 * H + 2 * QD + 2 * KD + 2 * I) + num_rows * H;
    float *buf = malloc(sizeof(float) * (size_t)(need > 0 ? need : 1));
    if (buf == NULL) return -1;
    float *x = buf, *q = x + T * H, *k = q + T * QD, *v = k + T * KD, *o = v + T * KD;
    float *proj = o + T * QD, *g = proj + T * H, *u = g + T * I, *xf = u + T * I;
    int status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; ++l) {
        const float *const *W = (const float *const *)(weights + l * W_PER_LAYER);
        float *kc = (float *)caches[2 * l], *vc = (float *)caches[2 * l + 1];
        qwen_rms_norm(h, H, NULL, 0, NULL, 0, W[W_INPUT_NORM], x, H, T, H, eps);
        qwen_linear_packed(x, H, T, W[W_Q], W[B_Q], QD, H, q, QD);
        qwen_linear_packed(x, H, T, W[W_K], W[B_K], KD, H, k, KD);
        qwen_linear_packed(x, H, T, W[W_V], W[B_V], KD, H, v, KD);
        status = qwen_attention_block(q, QD, k, KD, v, KD, T, num_heads, num_kv_heads, head_dim, W[W_Q_NORM],
                                      W[W_K_NORM], eps, rope, rope_s0, positions, kc, vc, block_size, c_sb, c_sr,
                                      c_sh, slot_ids, block_table, bt_s0, bt_s1, seq_slots, query_start_loc,
                                      seq_lens, num_seqs, scale, o);
        qwen_linear_packed(o, QD, T, W[W_O], W[B_O], H, QD, proj, H);
        qwen_rms_norm(proj, H, h, H, h, H, W[W_POST_NORM], x, H, T, H, eps);   /* h = h + attn, x = norm(h) */
        qwen_linear_packed(x, H, T, W[W_GATE], NULL, I, H, g, I);
        qwen_linear_packed(x, H, T, W[W_UP], NULL, I, H, u, I);
        qwen_silu_mul(g, I, u, I, g, T, I);
        qwen_linear_packed(g, I, T, W[W_DOWN], NULL, H, I, proj, H);
        for (int64_t i = 0; i < T * H; ++i) h[i] += proj[i];
    }
    if (status == 0) {
        for (int64_t r = 0; r < num_rows; ++r)
            qwen_rms_norm(h + rows[r] * H, H, NULL, 0, NULL, 0, final_norm, xf + r * H, H, 1, H, eps);
        qwen_linear_packed(xf, H, num_rows, lm_head, NULL, vocab, H, logits, vocab);
    }
    free(buf);
    return status == 0 ? 0 : -1;
}
