/* Multi-LoRA on the CPU: lora_shrink and lora_expand (torch.ops.qwen.*; contracts in torch_library/qwen.schema,
 * references in kernels/reference_lora.py). #included at the end of qwen_cpu.c, whose helpers it uses; called by
 * the C++ dispatcher kernels of qwen_cpu_ops.cpp, which check every argument and index value first.
 *
 * The rows are cut into blocks of at most LORA_ROWS consecutive rows of one adapter slot (a prefill's run of one
 * adapter is a few long blocks, a decode batch with a different adapter per row is blocks of one row). Work
 * items are (row block, output-column block), numbered row block first (a static split gives each thread a
 * contiguous range of rows). Each output element is computed by one item, by the same chain of operations whatever
 * the block it sits in and whatever the thread count: 1 and N threads give the same bits, and a row's result
 * does not depend on the other rows of the batch.
 *
 * lora_shrink: out[t, j] = scale * x[t, :K] . A[i, j, :K], a long sum. With AVX-512 each output is 16 lane chains
 * (lane l: the terms k = l (mod 16) in k order, fused multiply-adds from +0) summed by sum4_avx512's shuffle
 * network. A work item is (row block, 8 A rows); its block's x rows are converted to fp32 once per block (per
 * thread). Short blocks (< LORA_WIDEN_MIN rows, decode) run 4 rows x 4 A rows widened on the fly. Long blocks
 * (prefill) use the slot's A widened to fp32 once per thread and slot (exact), and run 3 rows x 8 A rows (24
 * accumulators, 11 loads per 24 multiply-adds) over k in passes of LORA_KC (the pass's 8 A rows stay in L1; the
 * lane chains go to a per-thread state between passes, exactly): the same chains either way.
 *
 * lora_expand: delta[t, n] = buffer[t, sR : sR + R] . B[i, n, :R], a short sum (R terms), so output columns go
 * across the vector lanes, each output one chain of fused multiply-adds from +0 in r order:
 * delta[t, n0 : n0 + 16] = sum_r buffer[t, r] * Bt[r, n0 : n0 + 16] with Bt B transposed. bf16 tiles are
 * transposed 16 columns x 16 ranks at a time in registers (two ranks per 32-bit element, three vpermt2d stages,
 * then a shift and a mask widen each half exactly). A block of at most 4 rows (decode) multiplies straight from
 * those registers; a block of 5 .. LORA_LONG - 1 rows stores its 64-column tile as fp32 Bt [R][64] (other dtypes:
 * through load_row) and runs 4 rows x 4 vectors over it. A block of at least LORA_LONG rows (prefill) uses the
 * slot's whole B transposed once per thread and slot, fp32 [R][N + pad], and runs 6 rows x 4 vectors (24
 * accumulators) over its 64-column tile (4 KB, in L1), then adds y and rounds in the same pass (bf16 in
 * registers). y + delta is rounded once to y's dtype, the same way on every path.
 *
 * The portable build (no AVX-512) runs the same blocks with plain loops: shrink one omp-simd dot product per
 * output, expand the same transposed tile and r-ordered sums. Dtype codes as qwen_cpu.c: 0 = float32,
 * 1 = float16, 2 = bfloat16.
 */

#define LORA_MR 4            /* rows per register block (short blocks) */
#ifndef LORA_ROWS
#define LORA_ROWS 48         /* rows of one adapter per work item */
#endif
#define LORA_SHRINK_COLS 8   /* A rows (shrink outputs) per work item */
#define LORA_SHRINK_MR 3     /* rows per register block of a long shrink block (3 rows x 8 A rows) */
#ifndef LORA_KC
#define LORA_KC 1024         /* k per pass of a long shrink block (its 8 A rows' pass stays in L1) */
#endif
#define LORA_EXPAND_MR 6     /* rows per register block of a long expand block (6 rows x 4 vectors) */
#define LORA_LONG 16         /* expand blocks of at least this many rows use the slot's whole transposed B */
#define LORA_EXPAND_COLS 64  /* output columns per work item: 4 vectors of 16 */
#define LORA_WIDEN_MIN 16    /* shrink blocks of at least this many rows: the slot's A widened once, 3 x 8 blocks */
#ifndef LORA_PREFETCH_Y
#define LORA_PREFETCH_Y 1    /* long expand blocks: prefetch the next tile's y lines (1: to L1, 2: to L2) */
#endif
#ifndef LORA_PAD
#define LORA_PAD 16          /* floats past K in the rows of shrink's fp32 copies of x and A */
#endif
#define LORA_PARALLEL_MIN (1 << 16)   /* multiply-adds below which one thread does it all */

typedef struct {
    int64_t t0, t1;
    int32_t slot;
} lora_block;

/* Blocks of at most LORA_ROWS consecutive rows of one adapter slot; rows of slot -1 belong to none. Returns the
 * number of blocks; *rows = the rows with an adapter. */
static int64_t lora_blocks(const int32_t *idx, int64_t T, lora_block *blocks, int64_t *rows) {
    int64_t n = 0, t = 0, active = 0;
    while (t < T) {
        const int32_t slot = idx[t];
        int64_t end = t + 1;
        while (end < T && idx[end] == slot && end - t < LORA_ROWS) ++end;
        if (slot >= 0) {
            blocks[n].t0 = t;
            blocks[n].t1 = end;
            blocks[n].slot = slot;
            ++n;
            active += end - t;
        }
        t = end;
    }
    *rows = active;
    return n;
}

static inline int64_t lora_min(int64_t a, int64_t b) { return a < b ? a : b; }

static inline int lora_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#if QWEN_AVX512
/* 16 weights from element k as fp32 (exact widening). */
static inline __attribute__((always_inline)) __m512 lora_w16(const void *w, int64_t k, const int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)w + k);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)w + k));
    if (dtype == 2) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* res[m][c] = xr[m][0:K] . wr[c][0:K] for m < MR, c < 4: lane chains, then sum4_avx512 (see the top). */
static inline __attribute__((always_inline)) void lora_shrink_block(const float *const *xr, const void *const *wr,
                                                                    int64_t K, float (*res)[4], const int dtype,
                                                                    const int MR) {
    __m512 acc[LORA_MR][4];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        for (int c = 0; c < 4; ++c) wv[c] = lora_w16(wr[c], k, dtype);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_loadu_ps(xr[m] + k);
            for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_fmadd_ps(wv[c], xv, acc[m][c]);
        }
    }
    if (k < K) {   /* the tail, weights widened through a zeroed buffer, x masked: zeros past K */
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[4];
        for (int c = 0; c < 4; ++c) {
            float tail[16] = {0};
            load_row(wr[c], k, dtype, K - k, tail);
            wv[c] = _mm512_loadu_ps(tail);
        }
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[m] + k);
            for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_fmadd_ps(wv[c], xv, acc[m][c]);
        }
    }
    for (int m = 0; m < MR; ++m) _mm_storeu_ps(res[m], sum4_avx512(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

#define LORA_SHRINK_SWITCH(D)                                                         \
    switch (mr) {                                                                 \
        case 4: lora_shrink_block(xr, wr, K, res, D, 4); return;                  \
        case 3: lora_shrink_block(xr, wr, K, res, D, 3); return;                  \
        case 2: lora_shrink_block(xr, wr, K, res, D, 2); return;                  \
        default: lora_shrink_block(xr, wr, K, res, D, 1); return;                 \
    }

static void lora_shrink_rows(const float *const *xr, int mr, const void *const *wr, int dtype, int64_t K,
                             float (*res)[4]) {
    if (dtype == 0) { LORA_SHRINK_SWITCH(0) }
    if (dtype == 2) { LORA_SHRINK_SWITCH(2) }
    LORA_SHRINK_SWITCH(1)
}

/* A long block's register block: MR <= 3 rows x 8 fp32 A rows, the lane chains over k in [k0, k1) (k0 a multiple
 * of 16; k1 one too, or K: the masked tail). The chains start from +0 when first, else from state (stored there
 * by the previous pass, exactly); the last pass sums them (sum4_avx512, per output as in lora_shrink_block) into
 * res, the others store them back. Same chains, so the same bits, as lora_shrink_block on the same rows. */
static inline __attribute__((always_inline)) void lora_shrink_long(const float *const *xr, const float *const *wr,
                                                                   int64_t k0, int64_t k1, int64_t K, float *state,
                                                                   int first, int last, float (*res)[8],
                                                                   const int MR) {
    __m512 acc[LORA_SHRINK_MR][8];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < 8; ++c) acc[m][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(state + 16 * (m * 8 + c));
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        __m512 xv[LORA_SHRINK_MR];
        for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(xr[m] + k);
        for (int c = 0; c < 8; ++c) {
            const __m512 wv = _mm512_loadu_ps(wr[c] + k);
            for (int m = 0; m < MR; ++m) acc[m][c] = _mm512_fmadd_ps(wv, xv[m], acc[m][c]);
        }
    }
    if (k < k1) {   /* the tail (k1 = K): zeros past K in both */
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        __m512 xv[LORA_SHRINK_MR];
        for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, xr[m] + k);
        for (int c = 0; c < 8; ++c) {
            const __m512 wv = _mm512_maskz_loadu_ps(mask, wr[c] + k);
            for (int m = 0; m < MR; ++m) acc[m][c] = _mm512_fmadd_ps(wv, xv[m], acc[m][c]);
        }
    }
    if (last) {
        for (int m = 0; m < MR; ++m) {
            _mm_storeu_ps(res[m], sum4_avx512(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
            _mm_storeu_ps(res[m] + 4, sum4_avx512(acc[m][4], acc[m][5], acc[m][6], acc[m][7]));
        }
    } else {
        for (int m = 0; m < MR; ++m)
            for (int c = 0; c < 8; ++c) _mm512_storeu_ps(state + 16 * (m * 8 + c), acc[m][c]);
    }
}

static void lora_shrink_long_rows(const float *const *xr, int mr, const float *const *wr, int64_t k0, int64_t k1,
                                  int64_t K, float *state, int first, int last, float (*res)[8]) {
    switch (mr) {
        case 3: lora_shrink_long(xr, wr, k0, k1, K, state, first, last, res, 3); return;
        case 2: lora_shrink_long(xr, wr, k0, k1, K, state, first, last, res, 2); return;
        default: lora_shrink_long(xr, wr, k0, k1, K, state, first, last, res, 1); return;
    }
}

/* 16 fp32 rounded to bf16 as f32_to_bf16 does (to nearest even; NaN stays NaN), bit for bit. With AVX512-BF16,
 * vcvtneps2bf16 (one instruction; it rounds to nearest even and quiets NaNs the same way) unless a lane is
 * subnormal: the instruction takes those as zeros, so they go the integer way. */
static inline __attribute__((always_inline)) __m256i lora_round_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* A long block's register block: rows t0 .. t0 + MR - 1 (MR <= 6), columns n0 .. n0 + width - 1 (width <= 64):
 * delta = sum_r xr[m][r] * bt[r * ld + 0 .. 63] (r in order, fused multiply-adds from +0: the chains of
 * lora_expand_block), then y + delta rounded once, in the same pass (bf16 in registers; other dtypes through
 * load_row / store_row). bt holds 64 readable columns (past width: discarded). */
static inline __attribute__((always_inline)) void lora_expand_long(const float *const *xr, const float *bt,
                                                                   int64_t ld, int64_t R, void *y, int64_t ys,
                                                                   int64_t t0, int64_t n0, int64_t width,
                                                                   int dtype, const int MR) {
    __m512 acc[LORA_EXPAND_MR][4];
#if LORA_PREFETCH_Y
    if (dtype == 2)   /* the next tile's y lines of these rows (the next item, 8 register blocks later) */
        for (int m = 0; m < MR; ++m) {
            const char *next = (const char *)((const uint16_t *)y + (t0 + m) * ys + n0 + LORA_EXPAND_COLS);
            _mm_prefetch(next, LORA_PREFETCH_Y == 1 ? _MM_HINT_T0 : _MM_HINT_T1);
            _mm_prefetch(next + 64, LORA_PREFETCH_Y == 1 ? _MM_HINT_T0 : _MM_HINT_T1);
        }
#endif
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
        const float *row = bt + r * ld;
        const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16), b2 = _mm512_loadu_ps(row + 32),
                     b3 = _mm512_loadu_ps(row + 48);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_set1_ps(xr[m][r]);
            acc[m][0] = _mm512_fmadd_ps(xv, b0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xv, b1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(xv, b2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(xv, b3, acc[m][3]);
        }
    }
    if (dtype == 2 && width == LORA_EXPAND_COLS) {   /* a whole tile: straight-line, unmasked */
        for (int m = 0; m < MR; ++m) {
            uint16_t *yr = (uint16_t *)y + (t0 + m) * ys + n0;
            __m512 sum[4];
            for (int v = 0; v < 4; ++v) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(yr + 16 * v));
                sum[v] = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)), acc[m][v]);
            }
#if defined(__AVX512BF16__)
            if (__builtin_expect(((_mm512_fpclass_ps_mask(sum[0], 0x20) | _mm512_fpclass_ps_mask(sum[1], 0x20)) |
                                  (_mm512_fpclass_ps_mask(sum[2], 0x20) | _mm512_fpclass_ps_mask(sum[3], 0x20))) == 0,
                                 1)) {   /* no subnormal lane: vcvtneps2bf16 rounds as f32_to_bf16 */
                for (int v = 0; v < 4; ++v)
                    _mm256_storeu_si256((__m256i *)(void *)(yr + 16 * v), (__m256i)_mm512_cvtneps_pbh(sum[v]));
                continue;
            }
#endif
            for (int v = 0; v < 4; ++v) _mm256_storeu_si256((__m256i *)(void *)(yr + 16 * v), lora_round_bf16(sum[v]));
        }
    } else if (dtype == 2) {
        for (int m = 0; m < MR; ++m) {
            uint16_t *yr = (uint16_t *)y + (t0 + m) * ys + n0;
            for (int v = 0; v < 4; ++v) {
                const __mmask16 mk = lanes_left(width - 16 * v);
                if (mk == 0) break;
                const __m256i h = _mm256_maskz_loadu_epi16(mk, yr + 16 * v);
                const __m512 yv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                _mm256_mask_storeu_epi16(yr + 16 * v, mk, lora_round_bf16(_mm512_add_ps(yv, acc[m][v])));
            }
        }
    } else {
        float delta[LORA_EXPAND_COLS], row[LORA_EXPAND_COLS];
        for (int m = 0; m < MR; ++m) {
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(delta + 16 * v, acc[m][v]);
            const int64_t offset = (t0 + m) * ys + n0;
            load_row(y, offset, dtype, width, row);
            for (int64_t n = 0; n < width; ++n) row[n] += delta[n];
            store_row(y, offset, dtype, width, row);
        }
    }
}

static void lora_expand_long_rows(const float *const *xr, int mr, const float *bt, int64_t ld, int64_t R, void *y,
                                  int64_t ys, int64_t t0, int64_t n0, int64_t width, int dtype) {
#define LORA_EXPAND_LONG_MR(D)                                                                  \
    switch (mr) {                                                                               \
        case 6: lora_expand_long(xr, bt, ld, R, y, ys, t0, n0, width, D, 6); return;            \
        case 5: lora_expand_long(xr, bt, ld, R, y, ys, t0, n0, width, D, 5); return;            \
        case 4: lora_expand_long(xr, bt, ld, R, y, ys, t0, n0, width, D, 4); return;            \
        case 3: lora_expand_long(xr, bt, ld, R, y, ys, t0, n0, width, D, 3); return;            \
        case 2: lora_expand_long(xr, bt, ld, R, y, ys, t0, n0, width, D, 2); return;            \
        default: lora_expand_long(xr, bt, ld, R, y, ys, t0, n0, width, D, 1); return;           \
    }
    if (dtype == 2) { LORA_EXPAND_LONG_MR(2) }
    LORA_EXPAND_LONG_MR(dtype)
#undef LORA_EXPAND_LONG_MR
}

/* delta[m][0:64] = sum_r xr[m][r] * bt[r][0:64], r = 0 .. R - 1 in order, fused multiply-adds from +0. */
static inline __attribute__((always_inline)) void lora_expand_block(const float *const *xr, const float *bt,
                                                                    int64_t R, float (*delta)[LORA_EXPAND_COLS],
                                                                    const int MR) {
    __m512 acc[LORA_MR][4];
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
        const float *row = bt + r * LORA_EXPAND_COLS;
        const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16), b2 = _mm512_loadu_ps(row + 32),
                     b3 = _mm512_loadu_ps(row + 48);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_set1_ps(xr[m][r]);
            acc[m][0] = _mm512_fmadd_ps(xv, b0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xv, b1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(xv, b2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(xv, b3, acc[m][3]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(delta[m] + 16 * v, acc[m][v]);
}

static void lora_expand_rows(const float *const *xr, int mr, const float *bt, int64_t R,
                             float (*delta)[LORA_EXPAND_COLS]) {
    switch (mr) {
        case 4: lora_expand_block(xr, bt, R, delta, 4); return;
        case 3: lora_expand_block(xr, bt, R, delta, 3); return;
        case 2: lora_expand_block(xr, bt, R, delta, 2); return;
        default: lora_expand_block(xr, bt, R, delta, 1); return;
    }
}

#if defined(__AVX512BW__)
#define LORA_BT_BF16 1
static const int32_t lora_perm[3][2][16] = {
    {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
     {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
    {{0, 1, 4, 5, 16, 17, 20, 21, 8, 9, 12, 13, 24, 25, 28, 29},
     {2, 3, 6, 7, 18, 19, 22, 23, 10, 11, 14, 15, 26, 27, 30, 31}},
    {{0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30},
     {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31}},
};

/* Ranks r0 .. r0 + 15 of nc <= 16 bf16 rows of R elements (row c at w0 + c * R; rows past nc and ranks past R as
 * zeros), transposed: z[p] lane c = the 32-bit pair (rank r0 + 2p, r0 + 2p + 1) of row c. Register k starts as
 * rows 2k, 2k + 1 (8 pairs each); three vpermt2d stages (registers 4, 2, 1 apart) swap the register and lane
 * bits. */
static inline __attribute__((always_inline)) void lora_t16_bf16(const uint16_t *w0, int64_t nc, int64_t R,
                                                                int64_t r0, __m512i z[8]) {
    __m512i a[8], b[8];
    if (nc == 16 && R == 16) {   /* two rows are one 64-byte vector */
        for (int k = 0; k < 8; ++k) a[k] = _mm512_loadu_si512(w0 + 32 * k);
    } else {
        const __mmask16 mask = (__mmask16)(R - r0 >= 16 ? 0xFFFFu : (1u << (R - r0)) - 1u);
        for (int k = 0; k < 8; ++k) {
            const __m256i lo = 2 * k < nc ? _mm256_maskz_loadu_epi16(mask, w0 + (2 * k) * R + r0) : _mm256_setzero_si256();
            const __m256i hi =
                2 * k + 1 < nc ? _mm256_maskz_loadu_epi16(mask, w0 + (2 * k + 1) * R + r0) : _mm256_setzero_si256();
            a[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
    }
    const __m512i i0 = _mm512_loadu_si512(lora_perm[0][0]), j0 = _mm512_loadu_si512(lora_perm[0][1]);
    for (int k = 0; k < 4; ++k) {
        b[k] = _mm512_permutex2var_epi32(a[k], i0, a[k + 4]);
        b[k + 4] = _mm512_permutex2var_epi32(a[k], j0, a[k + 4]);
    }
    const __m512i i1 = _mm512_loadu_si512(lora_perm[1][0]), j1 = _mm512_loadu_si512(lora_perm[1][1]);
    for (int k = 0; k < 8; k += 4)
        for (int e = 0; e < 2; ++e) {
            a[k + e] = _mm512_permutex2var_epi32(b[k + e], i1, b[k + e + 2]);
            a[k + e + 2] = _mm512_permutex2var_epi32(b[k + e], j1, b[k + e + 2]);
        }
    const __m512i i2 = _mm512_loadu_si512(lora_perm[2][0]), j2 = _mm512_loadu_si512(lora_perm[2][1]);
    for (int k = 0; k < 8; k += 2) {
        z[k] = _mm512_permutex2var_epi32(a[k], i2, a[k + 1]);
        z[k + 1] = _mm512_permutex2var_epi32(a[k], j2, a[k + 1]);
    }
}

/* The fp32 values of ranks 2p (low halves shifted up) and 2p + 1 (high halves) of a transposed pair register. */
static inline __attribute__((always_inline)) __m512 lora_even(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
static inline __attribute__((always_inline)) __m512 lora_odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int32_t)0xFFFF0000u)));
}

/* bt[r * ld + c] = B[c][r] for c < 16, r < R, from nc <= 16 bf16 rows (rows past nc as zeros). */
static void lora_bt_bf16(const uint16_t *w0, int64_t nc, int64_t R, float *bt, int64_t ld) {
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
        __m512i z[8];
        lora_t16_bf16(w0, nc, R, r0, z);
        const int64_t rc = lora_min(16, R - r0);
        for (int p = 0; p < 8 && 2 * p < rc; ++p) {
            _mm512_storeu_ps(bt + (r0 + 2 * p) * ld, lora_even(z[p]));
            if (2 * p + 1 < rc) _mm512_storeu_ps(bt + (r0 + 2 * p + 1) * ld, lora_odd(z[p]));
        }
    }
}

/* A short block (MR <= 4 rows) straight from the bf16 tile: delta[m][0:width] = sum_r xr[m][r] * B[n0 + c][r],
 * the same r-ordered chains as lora_expand_block, 16 columns transposed in registers at a time. */
static inline __attribute__((always_inline)) void lora_expand_direct(const float *const *xr, const uint16_t *w0,
                                                                     int64_t width, int64_t R,
                                                                     float (*delta)[LORA_EXPAND_COLS], const int MR) {
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
        __m512 acc[LORA_MR];
        for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t r0 = 0; r0 < R; r0 += 16) {
            __m512i z[8];
            lora_t16_bf16(w0 + c0 * R, lora_min(16, width - c0), R, r0, z);
            if (R - r0 >= 16) {
                for (int p = 0; p < 8; ++p) {
                    const __m512 ev = lora_even(z[p]), od = lora_odd(z[p]);
                    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xr[m][r0 + 2 * p]), ev, acc[m]);
                    for (int m = 0; m < MR; ++m)
                        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xr[m][r0 + 2 * p + 1]), od, acc[m]);
                }
            } else {
                for (int64_t r = r0; r < R; ++r) {
                    const __m512 bv = ((r - r0) & 1) ? lora_odd(z[(r - r0) >> 1]) : lora_even(z[(r - r0) >> 1]);
                    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xr[m][r]), bv, acc[m]);
                }
            }
        }
        for (int m = 0; m < MR; ++m) _mm512_storeu_ps(delta[m] + c0, acc[m]);
    }
}

static void lora_expand_bf16_rows(const float *const *xr, int mr, const uint16_t *w0, int64_t width, int64_t R,
                                  float (*delta)[LORA_EXPAND_COLS]) {
    switch (mr) {
        case 4: lora_expand_direct(xr, w0, width, R, delta, 4); return;
        case 3: lora_expand_direct(xr, w0, width, R, delta, 3); return;
        case 2: lora_expand_direct(xr, w0, width, R, delta, 2); return;
        default: lora_expand_direct(xr, w0, width, R, delta, 1); return;
    }
}
#endif
#endif

#if !QWEN_AVX512
/* The portable shrink: res = x[0:n] . w[0:n] (w of the dtype). */
static float lora_dot(const float *x, const void *w, int dtype, int64_t n) {
    float s = 0.0f;
    if (dtype == 0) {
        const float *wf = (const float *)w;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < n; ++k) s += x[k] * wf[k];
    } else if (dtype == 2) {
        const uint16_t *wh = (const uint16_t *)w;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < n; ++k) s += x[k] * bf16_to_f32(wh[k]);
    } else {
        const uint16_t *wh = (const uint16_t *)w;
        for (int64_t k = 0; k < n; ++k) s += x[k] * f16_to_f32(wh[k]);
    }
    return s;
}
#endif

/* bt [R][64] fp32: bt[r][c] = B[c][r] for the tile's width columns (rows w + c * R * elem bytes), zeros past width. */
static void lora_bt(const void *w, int64_t width, int64_t R, int dtype, float *bt) {
    for (int64_t r = 0; r < R; ++r) memset(bt + r * LORA_EXPAND_COLS + width, 0, sizeof(float) * (size_t)(LORA_EXPAND_COLS - width));
#if QWEN_AVX512 && defined(LORA_BT_BF16)
    if (dtype == 2) {
        for (int64_t c0 = 0; c0 < width; c0 += 16)
            lora_bt_bf16((const uint16_t *)w + c0 * R, lora_min(16, width - c0), R, bt + c0, LORA_EXPAND_COLS);
        return;
    }
#endif
    float col[64];
    for (int64_t c = 0; c < width; ++c) {
        for (int64_t r0 = 0; r0 < R; r0 += 64) {
            const int64_t rc = lora_min(64, R - r0);
            load_row(w, c * R + r0, dtype, rc, col);
            for (int64_t r = 0; r < rc; ++r) bt[(r0 + r) * LORA_EXPAND_COLS + c] = col[r];
        }
    }
}

#if QWEN_AVX512
/* The slot's whole B transposed: bt [R][ld] fp32, bt[r][n] = B[n][r] for n < N, zeros from N (rounded up to 16 for
 * bf16) to ld; ld >= N + 64, so that any 64-column tile from n0 < N is readable. */
static void lora_bt_all(const void *w, int64_t N, int64_t R, int dtype, float *bt, int64_t ld) {
    int64_t done = 0;
#if QWEN_AVX512 && defined(LORA_BT_BF16)
    if (dtype == 2) {
        for (int64_t c0 = 0; c0 < N; c0 += 16)
            lora_bt_bf16((const uint16_t *)w + c0 * R, lora_min(16, N - c0), R, bt + c0, ld);
        done = (N + 15) / 16 * 16;
    }
#endif
    for (int64_t r = 0; r < R; ++r) memset(bt + r * ld + (done > N ? done : N), 0, sizeof(float) * (size_t)(ld - (done > N ? done : N)));
    if (done > 0) return;
    float col[64];
    for (int64_t c = 0; c < N; ++c) {
        for (int64_t r0 = 0; r0 < R; r0 += 64) {
            const int64_t rc = lora_min(64, R - r0);
            load_row(w, c * R + r0, dtype, rc, col);
            for (int64_t r = 0; r < rc; ++r) bt[(r0 + r) * ld + c] = col[r];
        }
    }
}
#endif

/* dst[0:n] = src[offset:offset + n] as fp32 (load_row's values; bf16 16 at a time with AVX-512). */
static inline void lora_widen(const void *src, int64_t offset, int dtype, int64_t n, float *dst) {
    int64_t k = 0;
#if QWEN_AVX512
    if (dtype == 2) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (; k + 16 <= n; k += 16)
            _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(
                                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(p + k))), 16)));
    }
#endif
    load_row(src, offset + k, dtype, n - k, dst + k);
}

/* out [T, SR] fp32 (contiguous) = scalings[i] * (a[i] @ x[t]) with i = idx[t] (rows of -1: zeros); x [T, K] rows
 * xs elements apart, a [L, SR, K] contiguous, both of the dtype. Work items are (row block, 8 A rows). Per thread:
 * the item's block of x rows as fp32 (converted once per block, not for fp32), and for long blocks the slot's A
 * widened to fp32 (once per slot). Returns -1 when scratch memory fails. */
int qwen_lora_shrink(const void *x, int64_t xs, int64_t T, int64_t K, const void *a, int64_t SR,
                     const int32_t *idx, const float *scalings, int dtype, float *out, int64_t threads) {
    lora_block *blocks = malloc(sizeof(lora_block) * (size_t)(T > 0 ? T : 1));
    if (blocks == NULL) return -1;
    int64_t active;
    const int64_t nb = lora_blocks(idx, T, blocks, &active);
    const int64_t nthreads = threads > 1 ? threads : 1;
    int wide = 0;   /* any long block: the slot's A widened */
    for (int64_t bi = 0; bi < nb; ++bi) wide |= blocks[bi].t1 - blocks[bi].t0 >= LORA_WIDEN_MIN;
    /* fp32 copies' rows LORA_PAD floats longer than K: rows a multiple of 4 KB apart (K = 1024, 2048, 3072) would
     * all fall in the same L1 sets */
    const int64_t kp = K + LORA_PAD;
    const size_t per_x = dtype != 0 ? (size_t)LORA_ROWS * (size_t)kp : 0;
    const size_t per_a = dtype != 0 && wide && QWEN_AVX512 ? (size_t)SR * (size_t)kp : 0;
    const size_t per_state = QWEN_AVX512 ? (size_t)LORA_ROWS * LORA_SHRINK_COLS * 16 : 0;
    const size_t per_thread = per_x + per_a + per_state;
    float *scratch = malloc(sizeof(float) * (per_thread * (size_t)nthreads + 1));
    if (scratch == NULL) {
        free(blocks);
        return -1;
    }
    for (int64_t t = 0; t < T; ++t)
        if (idx[t] < 0) memset(out + t * SR, 0, sizeof(float) * (size_t)SR);
    const int64_t elem = dtype_elem(dtype), ncb = (SR + LORA_SHRINK_COLS - 1) / LORA_SHRINK_COLS;
    const int64_t items = ncb * nb;
    const int parallel = threads > 1 && active * SR * K >= LORA_PARALLEL_MIN;
    (void)parallel;
#pragma omp parallel num_threads((int)threads) if (parallel)
    {
        float *xb = scratch + (size_t)lora_thread() * per_thread, *aw = xb + per_x, *st = aw + per_a;
        (void)aw;
        (void)st;
        int64_t have_block = -1;   /* the block whose x rows xb holds, the slot whose A aw holds */
        int32_t have_slot = -1;
        (void)have_slot;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t cb = item % ncb, bi = item / ncb;
            const lora_block *b = blocks + bi;
            const float scale = scalings[b->slot];
            const int64_t j0 = cb * LORA_SHRINK_COLS, nc = lora_min(SR, j0 + LORA_SHRINK_COLS) - j0;
            const char *a0 = (const char *)a + ((int64_t)b->slot * SR + j0) * K * elem;   /* A[slot, j0] */
            const float *xf = (const float *)x + b->t0 * xs;   /* the block's rows as fp32, xst apart */
            int64_t xst = xs;
            if (dtype != 0) {
                if (bi != have_block) {
                    for (int64_t t = b->t0; t < b->t1; ++t) lora_widen(x, t * xs, dtype, K, xb + (t - b->t0) * kp);
                    have_block = bi;
                }
                xf = xb;
                xst = kp;
            }
#if QWEN_AVX512
            if (b->t1 - b->t0 >= LORA_WIDEN_MIN) {   /* long: 3 rows x 8 fp32 A rows, k in passes of LORA_KC */
                const float *wr[LORA_SHRINK_COLS];
                const float *af = (const float *)a0;
                int64_t ast = K;
                if (dtype != 0) {
                    if (b->slot != have_slot) {
                        for (int64_t j = 0; j < SR; ++j) lora_widen(a, ((int64_t)b->slot * SR + j) * K, dtype, K, aw + j * kp);
                        have_slot = b->slot;
                    }
                    af = aw + j0 * kp;
                    ast = kp;
                }
                for (int c = 0; c < LORA_SHRINK_COLS; ++c) wr[c] = af + lora_min(c, nc - 1) * ast;
                for (int64_t k0 = 0;; k0 += LORA_KC) {
                    const int64_t k1 = lora_min(K, k0 + LORA_KC);
                    const int first = k0 == 0, last = k1 >= K;
                    for (int64_t t0 = b->t0; t0 < b->t1; t0 += LORA_SHRINK_MR) {
                        const int mr = (int)lora_min(LORA_SHRINK_MR, b->t1 - t0);
                        const float *xr[LORA_SHRINK_MR];
                        for (int m = 0; m < mr; ++m) xr[m] = xf + (t0 - b->t0 + m) * xst;
                        float res[LORA_SHRINK_MR][8];
                        lora_shrink_long_rows(xr, mr, wr, k0, k1, K, st + (t0 - b->t0) * LORA_SHRINK_COLS * 16, first,
                                              last, res);
                        if (last)
                            for (int m = 0; m < mr; ++m)
                                for (int c = 0; c < nc; ++c) out[(t0 + m) * SR + j0 + c] = scale * res[m][c];
                    }
                    if (last) break;
                }
                continue;
            }
            for (int64_t t0 = b->t0; t0 < b->t1; t0 += LORA_MR) {   /* short: 4 rows x 4 A rows, widened on the fly */
                const int mr = (int)lora_min(LORA_MR, b->t1 - t0);
                const float *xr[LORA_MR];
                for (int m = 0; m < mr; ++m) xr[m] = xf + (t0 - b->t0 + m) * xst;
                for (int c0 = 0; c0 < nc; c0 += 4) {
                    const void *wr[4];
                    for (int c = 0; c < 4; ++c) wr[c] = a0 + lora_min(c0 + c, nc - 1) * K * elem;
                    float res[LORA_MR][4];
                    lora_shrink_rows(xr, mr, wr, dtype, K, res);
                    for (int m = 0; m < mr; ++m)
                        for (int c = c0; c < lora_min(nc, c0 + 4); ++c) out[(t0 + m) * SR + j0 + c] = scale * res[m][c - c0];
                }
            }
#else
            for (int64_t t = b->t0; t < b->t1; ++t)
                for (int c = 0; c < nc; ++c)
                    out[t * SR + j0 + c] = scale * lora_dot(xf + (t - b->t0) * xst, a0 + c * K * elem, dtype, K);
#endif
        }
    }
    free(scratch);
    free(blocks);
    return 0;
}

/* In place on y [T, N] (rows ys elements apart, the dtype): for column n of slice s (slice_sizes[0:S] cut N in
 * order), y[t, n] = dtype(float(y[t, n]) + buffer[t, sR : sR + R] . b[i, n, :R]) with i = idx[t] (rows of -1
 * untouched); buffer fp32 [T, S R] rows bs apart, b [L, N, R] contiguous of the dtype. Returns -1 when scratch
 * memory fails. */
int qwen_lora_expand(void *y, int64_t ys, int64_t T, int64_t N, const float *buffer, int64_t bs, const void *b,
                     int64_t R, const int32_t *idx, const int64_t *slice_sizes, int64_t S, int dtype,
                     int64_t threads) {
    /* column blocks of at most LORA_EXPAND_COLS inside one slice: (first column, end, slice) */
    int64_t ncb = 0;
    for (int64_t s = 0; s < S; ++s) ncb += (slice_sizes[s] + LORA_EXPAND_COLS - 1) / LORA_EXPAND_COLS;
    const int64_t nthreads = threads > 1 ? threads : 1;
    int64_t *cols = malloc(sizeof(int64_t) * 3 * (size_t)(ncb > 0 ? ncb : 1));
    lora_block *blocks = malloc(sizeof(lora_block) * (size_t)(T > 0 ? T : 1));
    int64_t active = 0;
    const int64_t nb = blocks == NULL ? 0 : lora_blocks(idx, T, blocks, &active);
    int any_long = 0;
    for (int64_t bi = 0; bi < nb; ++bi) any_long |= blocks[bi].t1 - blocks[bi].t0 >= LORA_LONG;
    any_long &= QWEN_AVX512;
    /* per thread: the transposed tile Bt [R][64], and with long blocks the slot's whole B transposed, [R][ld] */
    const int64_t ld = (N + 15) / 16 * 16 + LORA_EXPAND_COLS;
    const size_t per_thread = (size_t)LORA_EXPAND_COLS * (size_t)(R > 0 ? R : 1) + (any_long ? (size_t)ld * (size_t)R : 0);
    float *tiles = malloc(sizeof(float) * per_thread * (size_t)nthreads);
    if (cols == NULL || blocks == NULL || tiles == NULL) {
        free(cols);
        free(blocks);
        free(tiles);
        return -1;
    }
    int64_t c = 0, start = 0;
    for (int64_t s = 0; s < S; ++s) {
        for (int64_t n0 = start; n0 < start + slice_sizes[s]; n0 += LORA_EXPAND_COLS) {
            cols[3 * c] = n0;
            cols[3 * c + 1] = lora_min(n0 + LORA_EXPAND_COLS, start + slice_sizes[s]);
            cols[3 * c + 2] = s;
            ++c;
        }
        start += slice_sizes[s];
    }
    const int64_t items = ncb * nb, elem = dtype_elem(dtype);
    const int parallel = threads > 1 && active * N * R >= LORA_PARALLEL_MIN;
    (void)parallel;
#pragma omp parallel num_threads((int)threads) if (parallel)
    {
        float *bt = tiles + (size_t)lora_thread() * per_thread, *bt_all = bt + LORA_EXPAND_COLS * (size_t)R;
        int64_t have_cb = -1;   /* the column block and slot whose tile bt holds; the slot whose B bt_all holds */
        int32_t have_slot = -1, have_all = -1;
        (void)bt_all;
        (void)have_all;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t icb = item % ncb;
            const int64_t *cb = cols + 3 * icb;
            const lora_block *blk = blocks + item / ncb;
            const int64_t n0 = cb[0], width = cb[1] - cb[0];
            float delta[LORA_MR][LORA_EXPAND_COLS], row[LORA_EXPAND_COLS];
#if QWEN_AVX512
            if (blk->t1 - blk->t0 >= LORA_LONG) {   /* long: 6 rows x 64 columns from the slot's transposed B */
                if (blk->slot != have_all) {
                    lora_bt_all((const char *)b + (int64_t)blk->slot * N * R * elem, N, R, dtype, bt_all, ld);
                    have_all = blk->slot;
                }
                for (int64_t t0 = blk->t0; t0 < blk->t1; t0 += LORA_EXPAND_MR) {
                    const int mr = (int)lora_min(LORA_EXPAND_MR, blk->t1 - t0);
                    const float *xr[LORA_EXPAND_MR];
                    for (int m = 0; m < mr; ++m) xr[m] = buffer + (t0 + m) * bs + cb[2] * R;
                    lora_expand_long_rows(xr, mr, bt_all + n0, ld, R, y, ys, t0, n0, width, dtype);
                }
                continue;
            }
#endif
#if QWEN_AVX512 && defined(LORA_BT_BF16)
            if (dtype == 2 && blk->t1 - blk->t0 <= LORA_MR) {   /* a short block: B's tile transposed in registers */
                const int mr = (int)(blk->t1 - blk->t0);
                const float *xr[LORA_MR];
                for (int m = 0; m < mr; ++m) xr[m] = buffer + (blk->t0 + m) * bs + cb[2] * R;
                lora_expand_bf16_rows(xr, mr, (const uint16_t *)b + ((int64_t)blk->slot * N + n0) * R, width, R, delta);
                for (int m = 0; m < mr; ++m) {   /* y + delta in fp32, rounded once */
                    const int64_t offset = (blk->t0 + m) * ys + n0;
                    load_row(y, offset, dtype, width, row);
                    for (int64_t n = 0; n < width; ++n) row[n] += delta[m][n];
                    store_row(y, offset, dtype, width, row);
                }
                continue;
            }
#endif
            if (icb != have_cb || blk->slot != have_slot) {
                lora_bt((const char *)b + ((int64_t)blk->slot * N + n0) * R * elem, width, R, dtype, bt);
                have_cb = icb;
                have_slot = blk->slot;
            }
            for (int64_t t0 = blk->t0; t0 < blk->t1; t0 += LORA_MR) {
                const int mr = (int)lora_min(LORA_MR, blk->t1 - t0);
                const float *xr[LORA_MR];
                for (int m = 0; m < mr; ++m) xr[m] = buffer + (t0 + m) * bs + cb[2] * R;
#if QWEN_AVX512
                lora_expand_rows(xr, mr, bt, R, delta);
#else
                for (int m = 0; m < mr; ++m) {
                    float *d = delta[m];
                    for (int64_t n = 0; n < LORA_EXPAND_COLS; ++n) d[n] = 0.0f;
                    for (int64_t r = 0; r < R; ++r) {
                        const float xv = xr[m][r], *bv = bt + r * LORA_EXPAND_COLS;
#pragma omp simd
                        for (int64_t n = 0; n < LORA_EXPAND_COLS; ++n) d[n] += xv * bv[n];
                    }
                }
#endif
                for (int m = 0; m < mr; ++m) {   /* y + delta in fp32, rounded once */
                    const int64_t offset = (t0 + m) * ys + n0;
                    load_row(y, offset, dtype, width, row);
                    for (int64_t n = 0; n < width; ++n) row[n] += delta[m][n];
                    store_row(y, offset, dtype, width, row);
                }
            }
        }
    }
    free(tiles);
    free(blocks);
    free(cols);
    return 0;
}
