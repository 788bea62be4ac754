/* Paged flash attention on the CPU: slot_attention's path for sequences with more than one query row
 * (prefill, chunked prefill, the prefill part of a mixed batch, speculative verification). Included by
 * qwen_cpu.c after its AMX helpers; qwen_slot_attention hands it the sequences whose query has
 * FLASH_MIN_QUERY rows or more, and attends the others (decode rows) row by row.
 *
 * The work is (sequence, kv head, range of query blocks), one task each, taken by torch's
 * intra-op threads in turn. A task reads the keys and values its queries can see (positions
 * 0 .. its last query's position) from their pages once, through the block table, into the
 * layout its products take (below: no gathered copy of the cache, no mask tensor), then for each
 * query block of FLASH_ROWS rows (positions x the query heads of its kv head, so a GQA group
 * shares every key it reads) walks the key blocks of FLASH_BK keys up to the causal diagonal
 * only, keeping an online softmax per row (running max and sum, the output rescaled when the max
 * moves). Only blocks that cross the diagonal look at positions.
 *
 * Two sets of products:
 *  - bf16 on AMX tiles (where qwen_bf16_products() chose AMX): S = Q K^T with K^T stored as the
 *    B tiles' pairs of head dims, then O += P V with P rounded to bf16 (as flash-attention's bf16
 *    kernels round it) and V as the B tiles' pairs of keys; fp32 accumulation throughout.
 *  - bf16 by AVX512-BF16 dot products (where qwen_bf16_products() chose them: CPUs with AVX512-BF16
 *    and no tiles, e.g. AMD Zen 4) on the same layouts: a tile row of K^T or V is one vector of 16
 *    pairs, times a broadcast pair of the query row or of P; 4 rows x 64 keys of scores and 4 rows x
 *    64 dims of output per register block. VDPBF16PS does a pair's two products per lane at the FMA
 *    rate: twice the fp32 path's work per instruction.
 *  - fp32 FMAs (fp32 caches, and bf16 where there are neither): K^T [d][keys] and V [keys][d] in
 *    fp32, 4 rows x 64 keys of scores and 2 rows x 128 dims of output per register block.
 * The softmax (max, exp, sums) runs in fp32 on AVX-512 either way, scale applied in fp32.
 * Results do not depend on the thread count: a task's rows are computed the same way whoever
 * takes it. */

#if QWEN_AVX512

#define FLASH_BK 64          /* keys per key block of the packed K / V and of a scores product */
/* Keys per softmax block on the tiles' path: the scores of up to 4 key blocks, one softmax over them,
 * then one P V pass, so the output tiles make one round trip through memory per 256 keys instead of
 * per 64 (the other paths: one key block). */
#ifndef FLASH_AMX_KEYS
#define FLASH_AMX_KEYS 256
#endif
enum { FLASH_F32 = 0, FLASH_DOT = 1, FLASH_AMX = 2 };   /* the products' path (flash_run) */
#ifndef FLASH_ROWS
#define FLASH_ROWS 64        /* query rows per query block: positions x the query heads of one kv head */
#endif
/* Query rows of a sequence from which it takes this path: every prefill row, so a prompt's rows get the
 * same bits however the prompt is chunked or batched (decode rows keep the row path). Measured against
 * the row path (bf16, Qwen3-0.6B's heads, one thread): level at 2 rows (0.08 / 0.06 ms at 40 keys,
 * 3.3 / 3.0 at 2,000), 1.8x faster at 4 rows and 2,000 keys, 5.4x at 15. */
#ifndef FLASH_MIN_QUERY
#define FLASH_MIN_QUERY 2
#endif

typedef struct {
    int64_t token0, q_len, seq_len;   /* the sequence's first query row, query rows, keys after the write */
    const int32_t *blocks;            /* its block-table row */
    int64_t kvh, qb0, qb1;            /* kv head; query blocks qb0 .. qb1 - 1 */
} flash_task;

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Keys per softmax block (W) of a products' path. */
static inline int64_t flash_softmax_keys(int mode) { return mode == FLASH_AMX ? FLASH_AMX_KEYS : FLASH_BK; }

/* r[d] lane k <- r[k] lane d: a 16 x 16 transpose of dwords (unpacks within 128-bit lanes, then two
 * rounds of 128-bit lane shuffles). */
static inline __attribute__((always_inline)) void flash_transpose16(__m512i r[16]) {
    __m512i t[16], u[16], w[4][4];
    for (int i = 0; i < 8; ++i) {   /* lane L of t[2i]: rows 2i, 2i + 1 of dwords 4L, 4L + 1; t[2i + 1]: 4L + 2, + 3 */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {   /* lane L of u[4i + j]: rows 4i .. 4i + 3 of dword 4L + j */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {   /* w[j][0]: rows 0-3 dword j, rows 0-3 dword 8 + j, rows 4-7 j, rows 4-7 8 + j */
        w[j][0] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        w[j][1] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        w[j][2] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        w[j][3] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm512_shuffle_i32x4(w[j][0], w[j][2], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(w[j][0], w[j][2], 0xDD);
        r[4 + j] = _mm512_shuffle_i32x4(w[j][1], w[j][3], 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(w[j][1], w[j][3], 0xDD);
    }
}

/* Keys 0 .. n - 1 of kv head kvh read from their pages into the products' layouts, zero-padded to
 * whole key blocks and Dp head dims. tiled (AMX and dot products): K^T as B tiles kt[kb][s][t][p][k] (dword = head dims
 * 32 s + 2 p, +1 of key 64 kb + 16 t + k; each tile 1 KB) and V as B tiles vv[kb][h][c][p][d][e]
 * (keys 64 kb + 32 h + 2 p + e, head dim 16 c + d). Else fp32: kt[kb][d][64] and vv[key][Dp].
 * K^T's rows are gathered 16 keys at a time (one 64-byte store each: scattered stores were 10x
 * slower); V's pairs of keys are interleaved by permutes. */
static void flash_pack_kv(const attn_args *a, const int32_t *blocks, int64_t kvh, int64_t n, int tiled, int64_t Dp,
                          void *kt, void *vv) {
    const int64_t D = a->D, nkb = (n + FLASH_BK - 1) / FLASH_BK, elem = a->dtype == 0 ? 4 : 2;
    const int64_t S = Dp / 32, C = Dp / 16;
    const int bf16 = a->dtype == 2;
    memset(kt, 0, (size_t)(nkb * FLASH_BK * Dp * (tiled ? 2 : 4)));
    memset(vv, 0, (size_t)(nkb * FLASH_BK * Dp * (tiled ? 2 : 4)));
    /* each key's row offsets (elements from the caches' starts), 64 at a time; past n: key n - 1's */
    int64_t koff[FLASH_BK] __attribute__((aligned(64))), voff[FLASH_BK] __attribute__((aligned(64)));
    const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
    for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * FLASH_BK, nk = n - k0 < FLASH_BK ? n - k0 : FLASH_BK;
        for (int64_t kk = 0; kk < FLASH_BK; ++kk) {
            const int64_t t = k0 + (kk < nk ? kk : nk - 1);
            const int64_t block = blocks[(t / a->block_size) * a->bt_s1], r = t % a->block_size;
            koff[kk] = block * a->k_sb + r * a->k_sr + kvh * a->k_sh;
            voff[kk] = block * a->v_sb + r * a->v_sr + kvh * a->v_sh;
        }
        if (tiled) {
            /* K^T: tile row (s, t, p) = dword 16 s + p of keys 16 t .. 16 t + 15: 16 keys' rows of 16
             * dwords transposed in registers (gathers were about 4x slower) */
            const uint16_t *kbase = (const uint16_t *)a->key_cache;
            uint32_t *kdst = (uint32_t *)kt + kb * S * 4 * 256;
            for (int64_t tt = 0; tt < 4 && 16 * tt < nk; ++tt) {
                const int64_t nkt = nk - 16 * tt < 16 ? nk - 16 * tt : 16;
                for (int64_t c = 0; c < (D / 2 + 15) / 16; ++c) {   /* dwords 16 c .. 16 c + 15 of each key */
                    const int64_t nd = D / 2 - 16 * c < 16 ? D / 2 - 16 * c : 16;
                    const __mmask16 dm = nd >= 16 ? 0xffff : (__mmask16)((1u << nd) - 1);
                    __m512i r[16];
                    for (int k = 0; k < 16; ++k)
                        r[k] = k < nkt ? _mm512_maskz_loadu_epi32(dm, (const int *)(const void *)(kbase + koff[16 * tt + k]) + 16 * c)
                                       : _mm512_setzero_si512();
                    flash_transpose16(r);
                    for (int64_t d = 0; d < nd; ++d) _mm512_store_si512(kdst + (c * 4 + tt) * 256 + d * 16, r[d]);
                }
            }
            /* V: tile row (h, c, p) = head dims 16 c .. of keys 32 h + 2 p, + 1, interleaved */
            const uint16_t *vbase = (const uint16_t *)a->value_cache;
            uint16_t *vdst = (uint16_t *)vv + kb * FLASH_BK * Dp;
            for (int64_t kk = 0; kk < nk; kk += 2) {
                const uint16_t *v0 = vbase + voff[kk], *v1 = vbase + voff[kk + 1];
                const int two = kk + 1 < nk;
                uint16_t *row = vdst + (((kk / 32) * C) * 16 + (kk % 32) / 2) * 32;
                for (int64_t d = 0; d < D; d += 32) {
                    const __mmask32 dm = D - d >= 32 ? 0xffffffffu : (__mmask32)((1u << (D - d)) - 1);
                    const __m512i x0 = _mm512_maskz_loadu_epi16(dm, v0 + d);
                    const __m512i x1 = two ? _mm512_maskz_loadu_epi16(dm, v1 + d) : _mm512_setzero_si512();
                    _mm512_storeu_si512(row + (d / 16) * 512, _mm512_permutex2var_epi16(x0, idx_lo, x1));
                    if (D - d > 16) _mm512_storeu_si512(row + (d / 16 + 1) * 512, _mm512_permutex2var_epi16(x0, idx_hi, x1));
                }
            }
        } else {
            float *kdst = (float *)kt + kb * Dp * FLASH_BK;
            for (int64_t kk = 0; kk < nk; ++kk) {
                const char *v = (const char *)a->value_cache + voff[kk] * elem;
                float *vd = (float *)vv + (k0 + kk) * Dp;
                for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vd + d, cache16_ps(v, d, bf16));
            }
            for (int64_t tt = 0; tt < 4 && 16 * tt < nk; ++tt) {
                const __mmask16 live = nk - 16 * tt >= 16 ? 0xffff : (__mmask16)((1u << (nk - 16 * tt)) - 1);
                if (bf16) {
                    const __m512i o0 = _mm512_load_si512(koff + 16 * tt), o1 = _mm512_load_si512(koff + 16 * tt + 8);
                    const short *kbase = (const short *)a->key_cache;
                    for (int64_t d = 0; d < D; ++d) {
                        /* 32-bit gathers at 2-byte scale read two bf16s: element d and d + 1 (the
                         * last: d - 1 and d), so no read passes the row */
                        const int64_t at = d < D - 1 ? d : d - 1;
                        const __m512i step = _mm512_set1_epi64(at);
                        const __m256i g0 = _mm512_i64gather_epi32(_mm512_add_epi64(o0, step), (const int *)kbase, 2);
                        const __m256i g1 = _mm512_i64gather_epi32(_mm512_add_epi64(o1, step), (const int *)kbase, 2);
                        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(g0), g1, 1);
                        const __m512i x = d < D - 1 ? _mm512_slli_epi32(w, 16)
                                                    : _mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u));
                        _mm512_store_ps(kdst + d * FLASH_BK + 16 * tt, _mm512_maskz_mov_ps(live, _mm512_castsi512_ps(x)));
                    }
                } else {
                    const __m512i o0 = _mm512_load_si512(koff + 16 * tt), o1 = _mm512_load_si512(koff + 16 * tt + 8);
                    const float *kbase = (const float *)a->key_cache;
                    for (int64_t d = 0; d < D; ++d) {
                        const __m512i step = _mm512_set1_epi64(d);
                        const __m256 g0 = _mm512_i64gather_ps(_mm512_add_epi64(o0, step), kbase, 4);
                        const __m256 g1 = _mm512_i64gather_ps(_mm512_add_epi64(o1, step), kbase, 4);
                        const __m512 w = _mm512_insertf32x8(_mm512_castps256_ps512(g0), g1, 1);
                        _mm512_store_ps(kdst + d * FLASH_BK + 16 * tt, _mm512_maskz_mov_ps(live, w));
                    }
                }
            }
        }
    }
}

/* fp32 products. S[r][0:64] = Q[r] . K^T block for rows 0 .. Mp - 1 (Mp a multiple of 4). */
static void flash_scores_f32(const float *q, int64_t Dp, int64_t Mp, const float *kt, float *s) {
    for (int64_t r = 0; r < Mp; r += 4) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
        const float *q0 = q + r * Dp;
        for (int64_t d = 0; d < Dp; ++d) {
            const float *k = kt + d * FLASH_BK;
            const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                         k3 = _mm512_loadu_ps(k + 48);
            for (int i = 0; i < 4; ++i) {
                const __m512 b = _mm512_set1_ps(q0[i * Dp + d]);
                acc[i][0] = _mm512_fmadd_ps(b, k0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(b, k1, acc[i][1]);
                acc[i][2] = _mm512_fmadd_ps(b, k2, acc[i][2]);
                acc[i][3] = _mm512_fmadd_ps(b, k3, acc[i][3]);
            }
        }
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) _mm512_storeu_ps(s + (r + i) * FLASH_BK + 16 * j, acc[i][j]);
    }
}

/* O[r][c0 .. c0 + 16 NV) += sum_k P[r][k] V[k][..] for rows r, r + 1 (keys 0 .. nk - 1). */
static inline __attribute__((always_inline)) void flash_pv_f32_rows(const float *p, const float *vv, int64_t Dp,
                                                                    float *o, int64_t nk, int64_t c0, const int NV) {
    __m512 a0[8], a1[8];
    for (int c = 0; c < NV; ++c) {
        a0[c] = _mm512_loadu_ps(o + c0 + 16 * c);
        a1[c] = _mm512_loadu_ps(o + Dp + c0 + 16 * c);
    }
    for (int64_t k = 0; k < nk; ++k) {
        const __m512 b0 = _mm512_set1_ps(p[k]), b1 = _mm512_set1_ps(p[FLASH_BK + k]);
        const float *v = vv + k * Dp + c0;
        for (int c = 0; c < NV; ++c) {
            const __m512 x = _mm512_loadu_ps(v + 16 * c);
            a0[c] = _mm512_fmadd_ps(b0, x, a0[c]);
            a1[c] = _mm512_fmadd_ps(b1, x, a1[c]);
        }
    }
    for (int c = 0; c < NV; ++c) {
        _mm512_storeu_ps(o + c0 + 16 * c, a0[c]);
        _mm512_storeu_ps(o + Dp + c0 + 16 * c, a1[c]);
    }
}

static void flash_pv_f32(const float *p, const float *vv, int64_t Dp, int64_t Mp, float *o, int64_t nk) {
    for (int64_t r = 0; r < Mp; r += 2)
        for (int64_t c0 = 0; c0 < Dp; c0 += 128) {
            const int64_t left = (Dp - c0) / 16;
            float *orow = o + r * Dp;
            const float *prow = p + r * FLASH_BK;
            switch (left >= 8 ? 8 : left) {   /* Dp is a multiple of 32: 8, 6, 4 or 2 vectors */
                case 8: flash_pv_f32_rows(prow, vv, Dp, orow, nk, c0, 8); break;
                case 6: flash_pv_f32_rows(prow, vv, Dp, orow, nk, c0, 6); break;
                case 4: flash_pv_f32_rows(prow, vv, Dp, orow, nk, c0, 4); break;
                default: flash_pv_f32_rows(prow, vv, Dp, orow, nk, c0, 2); break;
            }
        }
}

#if QWEN_AMX
/* Every tile 16 rows x 64 bytes: tmm0-3 C (fp32), tmm4 A, tmm5-7 B. */
static QWEN_AMX_TARGET void flash_amx_configure(void) {
    amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    AMX_MEMORY();
    _tile_loadconfig(&c);
}

/* S rows 16 i .. 16 i + 15 [16][64] (rows W floats apart) = Q tile row i (qt[i][s][16][32] bf16) times a
 * key block's K^T. */
static QWEN_AMX_TARGET void flash_scores_amx(const uint16_t *qt, int64_t S, int64_t Mp, const uint32_t *kt,
                                             float *s, int64_t W) {
    AMX_MEMORY();
    for (int64_t i = 0; i < Mp / 16; ++i) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t st = 0; st < S; ++st) {
            const uint32_t *b = kt + st * 4 * 256;
            _tile_loadd(4, qt + (i * S + st) * 512, 64);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 256, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        float *si = s + i * 16 * W;
        _tile_stored(0, si, W * 4);
        _tile_stored(1, si + 16, W * 4);
        _tile_stored(2, si + 32, W * 4);
        _tile_stored(3, si + 48, W * 4);
    }
    AMX_MEMORY();
}

/* O [Mp][Dp] fp32 += P (pt[i][h][16][32] bf16: rows 16 i.., keys 32 h.., NH groups of keys a row tile)
 * times the V tiles of keys 0 .. 32 nh - 1 (consecutive key blocks' tiles follow each other). */
static QWEN_AMX_TARGET void flash_pv_amx(const uint16_t *pt, const uint16_t *vv, int64_t Dp, int64_t Mp, float *o,
                                         int64_t NH, int64_t nh) {
    const int64_t C = Dp / 16;
    AMX_MEMORY();
    for (int64_t i = 0; i < Mp / 16; ++i) {
        float *oi = o + i * 16 * Dp;
        for (int64_t c0 = 0; c0 < C; c0 += 4) {
            const int64_t nc = C - c0 < 4 ? C - c0 : 4;
            /* the C tiles that exist in this group; unrolled by hand: tile numbers are immediates */
            _tile_loadd(0, oi + 16 * c0, Dp * 4);
            _tile_loadd(1, oi + 16 * (c0 + 1), Dp * 4);
            if (nc > 2) _tile_loadd(2, oi + 16 * (c0 + 2), Dp * 4);
            if (nc > 3) _tile_loadd(3, oi + 16 * (c0 + 3), Dp * 4);
            for (int64_t h = 0; h < nh; ++h) {
                const uint16_t *b = vv + (h * C + c0) * 512;
                _tile_loadd(4, pt + (i * NH + h) * 512, 64);
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, b + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
                if (nc > 2) {
                    _tile_loadd(7, b + 1024, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (nc > 3) {
                    _tile_loadd(5, b + 1536, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, oi + 16 * c0, Dp * 4);
            _tile_stored(1, oi + 16 * (c0 + 1), Dp * 4);
            if (nc > 2) _tile_stored(2, oi + 16 * (c0 + 2), Dp * 4);
            if (nc > 3) _tile_stored(3, oi + 16 * (c0 + 3), Dp * 4);
        }
    }
    AMX_MEMORY();
}
#endif

#if QWEN_DPBF16
/* S [Mp][64] = Q (bf16 tiles qt[i][s][16][32]) times a key block's K^T tiles (kt[s][t][p][k] dwords),
 * by VDPBF16PS: per 4 rows, 16 accumulators (4 rows x 4 groups of 16 keys); for each pair p of head
 * dims, the 4 key groups' tile rows times the rows' broadcast pair. */
static QWEN_DPBF16_TARGET void flash_scores_dot(const uint16_t *qt, int64_t S, int64_t Mp, const uint32_t *kt,
                                                float *s) {
    const uint32_t *qd = (const uint32_t *)(const void *)qt;
    for (int64_t r = 0; r < Mp; r += 4) {
        __m512 acc[4][4];
        for (int x = 0; x < 4; ++x)
            for (int t = 0; t < 4; ++t) acc[x][t] = _mm512_setzero_ps();
        for (int64_t st = 0; st < S; ++st) {
            const uint32_t *b = kt + st * 4 * 256, *q = qd + ((r / 16) * S + st) * 256 + (r % 16) * 16;
            for (int p = 0; p < 16; ++p) {
                const __m512bh k0 = (__m512bh)_mm512_load_si512(b + p * 16);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(b + 256 + p * 16);
                const __m512bh k2 = (__m512bh)_mm512_load_si512(b + 512 + p * 16);
                const __m512bh k3 = (__m512bh)_mm512_load_si512(b + 768 + p * 16);
                for (int x = 0; x < 4; ++x) {
                    const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q[x * 16 + p]);
                    acc[x][0] = _mm512_dpbf16_ps(acc[x][0], qp, k0);
                    acc[x][1] = _mm512_dpbf16_ps(acc[x][1], qp, k1);
                    acc[x][2] = _mm512_dpbf16_ps(acc[x][2], qp, k2);
                    acc[x][3] = _mm512_dpbf16_ps(acc[x][3], qp, k3);
                }
            }
        }
        for (int x = 0; x < 4; ++x)
            for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + (r + x) * FLASH_BK + 16 * t, acc[x][t]);
    }
}

/* O rows r .. r + 3, head dims 16 c0 .. 16 (c0 + NC) += P (bf16 tiles pt[i][h][16][32]) times the key
 * block's V tiles (vv[h][c][p][16] dwords: the pair of keys 32 h + 2 p, + 1 per head dim), over the
 * first np pairs of keys. */
static inline __attribute__((always_inline)) QWEN_DPBF16_TARGET void flash_pv_dot_rows(
    const uint32_t *pd, const uint32_t *vd, int64_t C, int64_t Dp, int64_t r, int64_t c0, int64_t np, float *o,
    const int NC) {
    __m512 acc[4][4];
    for (int x = 0; x < 4; ++x)
        for (int c = 0; c < NC; ++c) acc[x][c] = _mm512_loadu_ps(o + (r + x) * Dp + 16 * (c0 + c));
    for (int64_t k = 0; k < np; ++k) {
        const int64_t h = k / 16, p = k % 16;
        const uint32_t *prow = pd + (((r / 16) * 2 + h) * 16 + r % 16) * 16 + p;
        __m512bh v[4];
        for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_load_si512(vd + ((h * C + c0 + c) * 16 + p) * 16);
        for (int x = 0; x < 4; ++x) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)prow[x * 16]);
            for (int c = 0; c < NC; ++c) acc[x][c] = _mm512_dpbf16_ps(acc[x][c], pp, v[c]);
        }
    }
    for (int x = 0; x < 4; ++x)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + (r + x) * Dp + 16 * (c0 + c), acc[x][c]);
}

/* O [Mp][Dp] += P times a key block's V, keys 0 .. nk - 1 (nk <= 64; P is 0 past each row's last key). */
static QWEN_DPBF16_TARGET void flash_pv_dot(const uint16_t *pt, const uint16_t *vv, int64_t Dp, int64_t Mp, float *o,
                                            int64_t nk) {
    const uint32_t *pd = (const uint32_t *)(const void *)pt, *vd = (const uint32_t *)(const void *)vv;
    const int64_t C = Dp / 16, np = (nk + 1) / 2;
    for (int64_t r = 0; r < Mp; r += 4)
        for (int64_t c0 = 0; c0 < C; c0 += 4) {   /* C is even (Dp a multiple of 32): groups of 4, then 2 */
            if (C - c0 >= 4) flash_pv_dot_rows(pd, vd, C, Dp, r, c0, np, o, 4);
            else flash_pv_dot_rows(pd, vd, C, Dp, r, c0, np, o, 2);
        }
}
#endif

#if QWEN_AMX
#define flash_scores_amx_any flash_scores_amx
#else
#define flash_scores_amx_any(q, S, Mp, kt, s) ((void)0)
#endif
#if QWEN_DPBF16
#define flash_scores_dot_any flash_scores_dot
#else
#define flash_scores_dot_any(q, S, Mp, kt, s) ((void)0)
#endif

/* 2^t for t <= 0 (and t > -inf), 16 lanes: exp_nonpositive's polynomial on the fraction
 * (exp2_fraction_x16), the power by scalef (which goes to 0 below the normal range instead of wrapping). */
static inline __attribute__((always_inline)) __m512 flash_exp2(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp2_fraction_x16(_mm512_sub_ps(t, n)), n);
}

/* Lane j of the result = op over the 16 lanes of v[j], for 16 vectors at once (a shuffle tree: 15
 * shuffle pairs and ops for 16 rows, where a reduction per row takes about 8 dependent steps). */
#define FLASH_REDUCE16(NAME, OP)                                                                               \
    static inline __attribute__((always_inline)) __m512 NAME(__m512 v[16]) {                                   \
        __m512 w[8], x[4], y[2];                                                                               \
        for (int j = 0; j < 8; ++j) /* 128-bit lanes: [row j: 0-7 | row j + 8: 0-7] after the op */           \
            w[j] = OP(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));   \
        for (int j = 0; j < 4; ++j) /* lanes: j, j + 8, j + 4, j + 12 (4 partials each) */                    \
            x[j] = OP(_mm512_shuffle_f32x4(w[j], w[j + 4], 0x88), _mm512_shuffle_f32x4(w[j], w[j + 4], 0xDD));   \
        for (int j = 0; j < 2; ++j) /* per lane: two rows x 2 partials (j and j + 2, ...) */                   \
            y[j] = OP(_mm512_shuffle_ps(x[j], x[j + 2], 0x44), _mm512_shuffle_ps(x[j], x[j + 2], 0xEE));       \
        const __m512 z = OP(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));         \
        /* z holds rows 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15 */                                      \
        return _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0), z); \
    }
FLASH_REDUCE16(flash_max16, _mm512_max_ps)
FLASH_REDUCE16(flash_sum16, _mm512_add_ps)

/* 2^t for P on the bf16 paths, whose values are rounded to bf16 (8 bits) before P V: a degree-4
 * polynomial on the fraction (relative error 2.7e-6, against 1e-7 for flash_exp2's degree 6; P's
 * rounding is 2e-3), two fused multiply-adds fewer in the softmax's inner loop. */
static inline __attribute__((always_inline)) __m512 flash_exp2_p(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.560510206479063e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591703917486776e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981109537322e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931219676960613e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999991908565828e-1f));
    return _mm512_scalef_ps(p, n);
}

#if QWEN_AMX || QWEN_DPBF16
/* 32 bf16 = lo (words 0-15) and hi (16-31) rounded to nearest even by one VCVTNE2PS2BF16, which every
 * CPU with AMX-BF16 or AVX512-BF16 has (written as asm: the intrinsic would need the avx512bf16 target on every
 * function it is inlined into). It rounds as amx_round_bf16 except that fp32 subnormals become zeros:
 * P's values are in [0, 1], and one below 2^-126 adds nothing a bf16 product keeps. */
static inline __attribute__((always_inline)) __m512i flash_bf16_pair(__m512 hi, __m512 lo) {
    __m512i r;
    __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(hi), "v"(lo));
    return r;
}
#endif

/* The online softmax of 16 rows' block of 16 nv scores (s: rows of W; row j sees keys 0 .. lim[j] - 1,
 * lim[j] <= 0: none, its p all 0 and its state untouched; nv <= W / 16, even where pb is given).
 * Updates the running max m[16] (of score x scale) and sum l[16], rescales the rows' outputs o (row
 * stride Dp) where their max moved, and writes p = exp(score x scale - m) to pb (bf16 tile rows: keys
 * 0-31, then 512 words on, 32-63, ...) or, when pb is NULL, back to s. The reductions and the state
 * updates run on all 16 rows at once. */
static inline void flash_softmax16(float *s, int64_t W, int nv, const int32_t *lim, float scale, float *m, float *l,
                                   uint16_t *pb, float *o, int64_t Dp) {
    const float log2e = 1.44269504088896341f;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 part[16];
    __mmask16 live[16][FLASH_AMX_KEYS / 16 > 4 ? FLASH_AMX_KEYS / 16 : 4];
    /* full: every row sees all 16 nv keys (every block below the diagonal): no masks */
    int full = 1;
    for (int j = 0; j < 16; ++j) full &= lim[j] >= 16 * nv;
    for (int j = 0; j < 16; ++j) {
        const __m512i lj = _mm512_set1_epi32(lim[j]);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        if (full)
            for (int v = 0; v < nv; ++v) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j * W + 16 * v));
        else
            for (int v = 0; v < nv; ++v) {
                live[j][v] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * v)), lj);
                mx = _mm512_mask_max_ps(mx, live[j][v], mx, _mm512_loadu_ps(s + j * W + 16 * v));
            }
        part[j] = mx;
    }
    const __m512 m_old = _mm512_loadu_ps(m);
    const __mmask16 any = _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(lim), _mm512_setzero_si512());
    /* rows that see nothing keep their max (-inf x scale stays -inf) */
    const __m512 m_new = _mm512_mask_max_ps(m_old, any, m_old, _mm512_mul_ps(flash_max16(part), _mm512_set1_ps(scale)));
    /* alpha = exp(m_old - m_new): 0 the first time (m_old = -inf: clamped), 1 where the max stayed */
    const __m512 alpha = flash_exp2(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(log2e)),
                                                  _mm512_set1_ps(-150.0f)));
    float mn[16] __attribute__((aligned(64))), al[16] __attribute__((aligned(64)));
    _mm512_store_ps(mn, m_new);
    _mm512_store_ps(al, alpha);
    const __m512 c = _mm512_set1_ps(scale * log2e);
    for (int j = 0; j < 16; ++j) {
        const __m512 off = _mm512_set1_ps(-mn[j] * log2e);
        __m512 sum = _mm512_setzero_ps();
        /* t <= 0 up to rounding (m is the max of the live scores); other lanes are dropped */
#if QWEN_AMX || QWEN_DPBF16
        if (pb != NULL) {   /* P rounded to bf16 for the tiles, as the products' outputs are */
            for (int v = 0; v < nv; v += 2) {
                __m512 x0 = flash_exp2_p(_mm512_fmadd_ps(_mm512_loadu_ps(s + j * W + 16 * v), c, off));
                __m512 x1 = flash_exp2_p(_mm512_fmadd_ps(_mm512_loadu_ps(s + j * W + 16 * v + 16), c, off));
                if (!full) {
                    x0 = _mm512_maskz_mov_ps(live[j][v], x0);
                    x1 = _mm512_maskz_mov_ps(live[j][v + 1], x1);
                }
                sum = _mm512_add_ps(_mm512_add_ps(sum, x0), x1);
                _mm512_storeu_si512((void *)(pb + j * 32 + (v / 2) * 512), flash_bf16_pair(x1, x0));
            }
        } else
#endif
        {
            for (int v = 0; v < nv; ++v) {
                const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(s + j * W + 16 * v), c, off);
                const __m512 x = full ? flash_exp2(t) : _mm512_maskz_mov_ps(live[j][v], flash_exp2(t));
                sum = _mm512_add_ps(sum, x);
                _mm512_storeu_ps(s + j * W + 16 * v, x);
            }
        }
        part[j] = sum;
        if (al[j] != 1.0f && m[j] != -INFINITY) {   /* the row's output moves with its max (none yet: zero) */
            const __m512 a = _mm512_set1_ps(al[j]);
            float *orow = o + j * Dp;
            for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), a));
        }
    }
    _mm512_storeu_ps(l, _mm512_mask_fmadd_ps(_mm512_loadu_ps(l), any, alpha, flash_sum16(part)));
    _mm512_storeu_ps(m, m_new);
}

/* One query block: rows r = j G + g (position pos0 + j, query head kvh G + g, token token0 + j),
 * j < nq, over keys 0 .. pos0 + nq - 1 already packed. Scratch (floats unless said): q (Mp x Dp,
 * bf16 tiles or fp32), o (Mp x Dp), s (Mp x 64), pb (bf16 Mp x 64), m, l (Mp). */
static void flash_query_block(const attn_args *a, int mode, int64_t Dp, int64_t token0, int64_t pos0, int64_t nq,
                              int64_t kvh, const void *kt, const void *vv, float *q, float *o, float *scores,
                              uint16_t *pb, float *m, float *l) {
    const int tiled = mode != FLASH_F32;
    const int64_t G = a->G, D = a->D, H = a->H, M = nq * G, Mp = round_up(M, 16), S = Dp / 32;
    /* W keys per softmax block (a multiple of FLASH_BK), NH groups of 32 keys in it */
    const int64_t W = flash_softmax_keys(mode), NH = W / 32;
    const int64_t nkeys = pos0 + nq, nkb = (nkeys + W - 1) / W;
    const float scale = a->scale;
    float *s_next[2] = {scores, scores + Mp * W};
    /* Q rows: bf16 tiles qt[i][s][16][32] (zero padding), or fp32 [Mp][Dp] */
    if (!tiled) memset(q, 0, (size_t)(Mp * Dp * 4));
    for (int64_t r = 0; r < (tiled ? Mp : M); ++r) {
        if (tiled) {   /* a tile row of 32 head dims at a time, zeros past D and in the padding rows */
            const uint16_t *src = (const uint16_t *)a->query +
                                  (r < M ? (token0 + r / G) * a->q_s0 + (kvh * G + r % G) * a->q_s1 : 0);
            uint16_t *dst = (uint16_t *)(void *)q + ((r / 16) * S) * 512 + (r % 16) * 32;
            for (int64_t st = 0; st < S; ++st) {
                const int64_t n = r >= M ? 0 : D - 32 * st < 32 ? D - 32 * st : 32;
                const __mmask32 k = n >= 32 ? 0xffffffffu : (__mmask32)((1u << n) - 1);
                _mm512_storeu_si512((void *)(dst + st * 512), _mm512_maskz_loadu_epi16(k, src + 32 * st));
            }
        } else {
            load_row(a->query, (token0 + r / G) * a->q_s0 + (kvh * G + r % G) * a->q_s1, a->dtype, D, q + r * Dp);
        }
    }
    memset(o, 0, sizeof(float) * (size_t)(Mp * Dp));
    /* (P needs no clearing on the tiled paths: the softmax writes every group of keys that P V reads) */
    if (!tiled) memset(scores, 0, sizeof(float) * (size_t)(2 * Mp * W));
    for (int64_t r = 0; r < Mp; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    /* scores one key block ahead, in two buffers: the softmax then never loads rows that tile stores
     * have only just written (measured: docs/design.md, "Long prompts") */
#define FLASH_SCORES(KB, DST)                                                                                   \
    do {                                                                                                       \
        if (mode == FLASH_AMX) {   /* the key blocks of softmax block KB that hold keys before nkeys */        \
            const int64_t kbe = ((KB) * W + W < nkeys ? (KB) * W + W : nkeys);                                 \
            for (int64_t k64 = (KB) * W; k64 < kbe; k64 += FLASH_BK)                                           \
                flash_scores_amx_any((const uint16_t *)(const void *)q, S, Mp,                                 \
                                     (const uint32_t *)kt + k64 * Dp / 2, (DST) + (k64 - (KB) * W), W);       \
        } else if (mode == FLASH_DOT) flash_scores_dot_any((const uint16_t *)(const void *)q, S, Mp,            \
                                                         (const uint32_t *)kt + (KB) * FLASH_BK * Dp / 2, DST); \
        else flash_scores_f32(q, Dp, round_up(M, 4), (const float *)kt + (KB) * FLASH_BK * Dp, DST);          \
    } while (0)
    /* each row's last visible key + 1, from the block's first key (padding rows: none) */
    int32_t row_end[Mp];   /* Mp: FLASH_ROWS, or one kv head's query heads when more (flash_run) */
    for (int64_t r = 0; r < Mp; ++r) row_end[r] = (int32_t)(r < M ? pos0 + r / G + 1 : 0);
    FLASH_SCORES(0, s_next[0]);
    for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * W;
        float *s = s_next[kb & 1];
        if (kb + 1 < nkb) FLASH_SCORES(kb + 1, s_next[(kb + 1) & 1]);
        /* vectors of 16 scores the softmax reads: whole groups of 32 keys up to the last row's key */
        const int nv = mode == FLASH_AMX ? (int)(((nkeys - k0 < W ? nkeys - k0 : W) + 31) / 32 * 2) : 4;
        int64_t nk_used = 0;   /* keys of this block some row sees */
        for (int64_t r0 = 0; r0 < Mp; r0 += 16) {
            /* keys k0 .. k0 + lim - 1 are at or before a row's position (padding rows: none) */
            int32_t lim[16] __attribute__((aligned(64)));
            for (int j = 0; j < 16; ++j) {
                const int64_t n = row_end[r0 + j] - k0;
                lim[j] = (int32_t)(n > W ? W : n < 0 ? 0 : n);
                if (lim[j] > nk_used) nk_used = lim[j];
            }
            flash_softmax16(s + r0 * W, W, nv, lim, scale, m + r0, l + r0, tiled ? pb + (r0 / 16) * NH * 512 : NULL,
                            o + r0 * Dp, Dp);
        }
#if QWEN_AMX
        if (mode == FLASH_AMX) flash_pv_amx(pb, (const uint16_t *)vv + k0 * Dp, Dp, Mp, o, NH, (nk_used + 31) / 32);
        else
#endif
#if QWEN_DPBF16
        if (mode == FLASH_DOT) flash_pv_dot(pb, (const uint16_t *)vv + k0 * Dp, Dp, Mp, o, nk_used);
        else
#endif
            flash_pv_f32(s, (const float *)vv + k0 * Dp, Dp, round_up(M, 2), o, nk_used);
    }
#undef FLASH_SCORES
    float *s = s_next[0];
    for (int64_t r = 0; r < M; ++r) {
        float *orow = o + r * Dp;
        const float inv = a->v_scale / l[r];
        for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
        const int64_t token = token0 + r / G, h = kvh * G + r % G;
        if (a->gate != NULL) {
            float *row = s;   /* the scores are spent: a converted gate row */
            load_row(a->gate, token * a->g_s0 + h * a->g_s1, a->dtype, D, row);
            for (int64_t d = 0; d < D; ++d) orow[d] *= 1.0f / (1.0f + expf(-row[d]));
        }
        store_row(a->out, (token * H + h) * D, a->dtype, D, orow);
    }
}

/* Whether the flash path takes a sequence: fp32 or bf16, head dims of 16s (every Qwen model's). */
static int flash_supported(const attn_args *a) { return (a->dtype == 0 || a->dtype == 2) && a->D % 16 == 0; }

/* Whether the flash path takes a sequence of q_len query rows. */
static int flash_takes(const attn_args *a, int64_t q_len) { return q_len >= FLASH_MIN_QUERY && flash_supported(a); }

/* Attends every live sequence that flash_takes, over threads: tasks of (sequence, kv head, range of
 * query blocks), enough ranges that each thread has about two tasks, taken in turn. Returns 0, or
 * -1 when scratch memory could not be allocated (then nothing of these sequences is written). */
static int flash_run(const attn_args *a, const int32_t *seq_slots, const int32_t *query_start_loc,
                     const int32_t *seq_lens, int64_t num_seqs, int64_t bt_s0, int64_t threads) {
    /* bf16 takes the products' path (qwen_bf16_products: one choice per process). The tiled layouts'
     * K^T gathers read a key row's bf16 pairs as dwords: every row must start at an even element. */
    const int even = ((a->k_sb | a->k_sr | a->k_sh | a->v_sb | a->v_sr | a->v_sh) & 1) == 0;
    const int products = a->dtype == 2 && even ? qwen_bf16_products() : 0;
    const int mode = QWEN_AMX && products == 2 ? FLASH_AMX : QWEN_DPBF16 && products == 1 ? FLASH_DOT : FLASH_F32;
    const int tiled = mode != FLASH_F32;
    const int64_t BQ = FLASH_ROWS / a->G > 0 ? FLASH_ROWS / a->G : 1;
    int64_t n_seqs = 0, max_keys = 0, n_tasks = 0;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_slots[i] >= 0 && flash_takes(a, query_start_loc[i + 1] - query_start_loc[i])) {
            ++n_seqs;
            if (seq_lens[i] > max_keys) max_keys = seq_lens[i];
        }
    if (n_seqs == 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t per_head = (2 * threads + n_seqs * a->num_kv_heads - 1) / (n_seqs * a->num_kv_heads);
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
        if (seq_slots[i] < 0 || !flash_takes(a, q_len)) continue;
        const int64_t nqb = (q_len + BQ - 1) / BQ;
        n_tasks += a->num_kv_heads * (per_head < nqb ? per_head : nqb);
    }
    flash_task *tasks = malloc(sizeof(flash_task) * (size_t)n_tasks);
    if (tasks == NULL) return -1;
    int64_t w = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
        if (seq_slots[i] < 0 || !flash_takes(a, q_len)) continue;
        const int64_t nqb = (q_len + BQ - 1) / BQ, ranges = per_head < nqb ? per_head : nqb;
        /* later ranges first: they see more keys (dynamic scheduling then evens the tail) */
        for (int64_t rg = ranges - 1; rg >= 0; --rg)
            for (int64_t kvh = 0; kvh < a->num_kv_heads; ++kvh) {
                const flash_task t = {query_start_loc[i], q_len, seq_lens[i], a->block_table + seq_slots[i] * bt_s0,
                                      kvh, nqb * rg / ranges, nqb * (rg + 1) / ranges};
                tasks[w++] = t;
            }
    }
    const int64_t Dp = round_up(a->D, 32), Mp = round_up(FLASH_ROWS > a->G ? FLASH_ROWS : a->G, 16);
    const int64_t kv_floats = round_up(max_keys, FLASH_BK) * Dp / (tiled ? 2 : 1);   /* kt or vv, in floats */
    /* per thread: kt, vv, q, o, s (2 x Mp x 64), pb (Mp x 64 bf16), m, l; each 64-byte aligned */
    const int64_t W = flash_softmax_keys(mode);
    const int64_t per_thread = 2 * kv_floats + 2 * Mp * Dp + 2 * Mp * W + Mp * W / 2 + 2 * Mp + 6 * 16;
    if (threads > n_tasks) threads = n_tasks;
    float *scratch = aligned_alloc(64, (size_t)(per_thread * threads) * sizeof(float));
    if (scratch == NULL) {
        free(tasks);
        return -1;
    }
#pragma omp parallel num_threads((int)threads) if (threads > 1)
    {
#ifdef _OPENMP
        float *mine = scratch + per_thread * (int64_t)omp_get_thread_num();
#else
        float *mine = scratch;
#endif
        float *kt = mine, *vv = kt + kv_floats, *q = vv + kv_floats;
        float *o = q + Mp * Dp, *s = o + Mp * Dp;
        uint16_t *pb = (uint16_t *)(void *)(s + 2 * Mp * W);
        float *m = s + 2 * Mp * W + Mp * W / 2, *l = m + Mp;
#if QWEN_AMX
        if (mode == FLASH_AMX) flash_amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < n_tasks; ++k) {
            const flash_task *t = &tasks[k];
            const int64_t last = t->qb1 * BQ < t->q_len ? t->qb1 * BQ : t->q_len;   /* query rows up to its end */
            const int64_t n = t->seq_len - t->q_len + last;                          /* keys it can see */
            flash_pack_kv(a, t->blocks, t->kvh, n, tiled, Dp, kt, vv);
            for (int64_t qb = t->qb0; qb < t->qb1; ++qb) {
                const int64_t j0 = qb * BQ, nq = t->q_len - j0 < BQ ? t->q_len - j0 : BQ;
                flash_query_block(a, mode, Dp, t->token0 + j0, t->seq_len - t->q_len + j0, nq, t->kvh, kt, vv, q, o,
                                  s, pb, m, l);
            }
        }
#if QWEN_AMX
        if (mode == FLASH_AMX) amx_tile_release();
#endif
    }
    free(scratch);
    free(tasks);
    return 0;
}

/* flash_run over an fp8 cache: the pages of the sequences it takes widened (exactly) into a shadow
 * cache in the query's dtype, read through a block table of their own; the fp8 scales are a->scale
 * (times k_scale) and a->v_scale already. A shadow page costs a pass over its bytes, small beside the
 * products over it (each key meets every query row of its sequence). */
static int flash_run_fp8(const attn_args *a, const int32_t *seq_slots, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int64_t num_seqs, int64_t bt_s0, int64_t threads) {
    const int64_t bs = a->block_size, nk = a->num_kv_heads, D = a->D, page = bs * nk * D;
    int64_t total = 0, max_blocks = 1;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_slots[i] >= 0 && flash_takes(a, query_start_loc[i + 1] - query_start_loc[i])) {
            const int64_t nb = (seq_lens[i] + bs - 1) / bs;
            total += nb;
            if (nb > max_blocks) max_blocks = nb;
        }
    if (total == 0) return 0;
    const int64_t elem = a->dtype == 0 ? 4 : 2;
    char *pages = malloc((size_t)(2 * total * page * elem));
    int32_t *table = malloc(sizeof(int32_t) * (size_t)(num_seqs * max_blocks + num_seqs + total));
    if (pages == NULL || table == NULL) {
        free(pages);
        free(table);
        return -1;
    }
    int32_t *slots = table + num_seqs * max_blocks, *src = slots + num_seqs;   /* shadow page w copies src[w] */
    int64_t w = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        slots[i] = -1;
        if (seq_slots[i] < 0 || !flash_takes(a, query_start_loc[i + 1] - query_start_loc[i])) continue;
        slots[i] = (int32_t)i;
        for (int64_t b = 0; b < (seq_lens[i] + bs - 1) / bs; ++b, ++w) {
            table[i * max_blocks + b] = (int32_t)w;
            src[w] = a->block_table[seq_slots[i] * bt_s0 + b * a->bt_s1];
        }
    }
    char *kp = pages, *vp = pages + total * page * elem;
    /* widened exactly (every e4m3 / e5m2 value is a bf16): 16 elements at a time by cache16_ps */
    const int kind = a->kv_dtype, bf16 = a->dtype == 2;
#pragma omp parallel for num_threads((int)(threads < 1 ? 1 : threads)) if (threads > 1 && total > 1) schedule(static)
    for (int64_t p = 0; p < total; ++p)
        for (int64_t r = 0; r < bs; ++r)
            for (int64_t h = 0; h < nk; ++h) {
                const int64_t at = (p * bs + r) * nk * D + h * D;
                const uint8_t *ks = (const uint8_t *)a->key_cache + src[p] * a->k_sb + r * a->k_sr + h * a->k_sh;
                const uint8_t *vs = (const uint8_t *)a->value_cache + src[p] * a->v_sb + r * a->v_sr + h * a->v_sh;
                for (int64_t d = 0; d < D; d += 16) {     /* D % 16 == 0: flash_supported */
                    const __m512 kv = cache16_ps(ks, d, kind), vv = cache16_ps(vs, d, kind);
                    if (bf16) {
                        _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)(void *)kp + at + d),
                                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(kv), 16)));
                        _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)(void *)vp + at + d),
                                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vv), 16)));
                    } else {
                        _mm512_storeu_ps((float *)(void *)kp + at + d, kv);
                        _mm512_storeu_ps((float *)(void *)vp + at + d, vv);
                    }
                }
            }
    attn_args s = *a;
    s.key_cache = kp;
    s.value_cache = vp;
    s.block_table = table;
    s.k_sb = s.v_sb = page;
    s.k_sr = s.v_sr = nk * D;
    s.k_sh = s.v_sh = D;
    s.bt_s1 = 1;
    s.kv_dtype = a->dtype;
    const int rc = flash_run(&s, slots, query_start_loc, seq_lens, num_seqs, max_blocks, threads);
    free(pages);
    free(table);
    return rc;
}
#else
static int flash_takes(const attn_args *a, int64_t q_len) {
    (void)a;
    (void)q_len;
    return 0;
}
static int flash_run(const attn_args *a, const int32_t *seq_slots, const int32_t *query_start_loc,
                     const int32_t *seq_lens, int64_t num_seqs, int64_t bt_s0, int64_t threads) {
    (void)a, (void)seq_slots, (void)query_start_loc, (void)seq_lens, (void)num_seqs, (void)bt_s0, (void)threads;
    return 0;
}
static int flash_run_fp8(const attn_args *a, const int32_t *seq_slots, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int64_t num_seqs, int64_t bt_s0, int64_t threads) {
    return flash_run(a, seq_slots, query_start_loc, seq_lens, num_seqs, bt_s0, threads);
}
#endif
