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
 * lora_shrink: out[t, j] = scale * x[t, :K] . A[i, j, :K], a long sum. With AVX-512 each output is 16 lane chains (lane l: the terms k = l (mod 16) in k order, fused multiply-adds from +0) summed by sum4_avx512's
 * shuffle network; a register block is up to 4 rows x 4 A rows (16 accumulators: each x vector and each A
 * vector loaded once for 4 multiply-adds). Blocks of at least LORA_WIDEN_MIN rows widen their 4 bf16 / fp16 A
 * rows to fp32 once (exact), shorter ones widen on the fly: the same values either way.
 *
 * lora_expand: delta[t, n] = buffer[t, sR : sR + R] . B[i, n, :R], a short sum (R terms), so output columns go
 * across the vector lanes, each output one chain of fused multiply-adds from +0 in r order:
 * delta[t, n0 : n0 + 16] = sum_r buffer[t, r] * Bt[r, n0 : n0 + 16] with Bt B's tile transposed. bf16 tiles are
 * transposed 16 columns x 16 ranks at a time in registers (two ranks per 32-bit element, three vpermt2d stages,
 * then a shift and a mask widen each half exactly). A block of at most 4 rows (decode) multiplies straight from
 * those registers; a longer block (prefill) stores its 64-column tile once as fp32 Bt [R][64] (other dtypes:
 * always, through load_row) and runs 4 rows x 4 vectors at a time over it. y + delta is rounded once to y's
 * dtype.
 *
 * The portable build (no AVX-512) runs the same blocks with plain loops: shrink one omp-simd dot product per
 * output, expand the same transposed tile and r-ordered sums. Dtype codes as qwen_cpu.c: 0 = float32,
 * 1 = float16, 2 = bfloat16.
 */

#define LORA_MR 4            /* rows per register block */
#define LORA_ROWS 32         /* rows of one adapter per work item */
#define LORA_SHRINK_COLS 4   /* A rows (shrink outputs) per work item */
#define LORA_EXPAND_COLS 64  /* output columns per work item: 4 vectors of 16 */
#define LORA_WIDEN_MIN 8     /* shrink blocks of at least this many rows widen their A rows once */
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

#define LORA_SHRINK_MR(D)                                                         \
    switch (mr) {                                                                 \
        case 4: lora_shrink_block(xr, wr, K, res, D, 4); return;                  \
        case 3: lora_shrink_block(xr, wr, K, res, D, 3); return;                  \
        case 2: lora_shrink_block(xr, wr, K, res, D, 2); return;                  \
        default: lora_shrink_block(xr, wr, K, res, D, 1); return;                 \
    }

static void lora_shrink_rows(const float *const *xr, int mr, const void *const *wr, int dtype, int64_t K,
                             float (*res)[4]) {
    if (dtype == 0) { LORA_SHRINK_MR(0) }
    if (dtype == 2) { LORA_SHRINK_MR(2) }
    LORA_SHRINK_MR(1)
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

/* bt[r][c0 + c] = B[c][r] for c < 16, r < R, from nc <= 16 bf16 rows (rows past nc as zeros). */
static void lora_bt_bf16(const uint16_t *w0, int64_t nc, int64_t R, float *bt) {
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
        __m512i z[8];
        lora_t16_bf16(w0, nc, R, r0, z);
        const int64_t rc = lora_min(16, R - r0);
        for (int p = 0; p < 8 && 2 * p < rc; ++p) {
            _mm512_storeu_ps(bt + (r0 + 2 * p) * LORA_EXPAND_COLS, lora_even(z[p]));
            if (2 * p + 1 < rc) _mm512_storeu_ps(bt + (r0 + 2 * p + 1) * LORA_EXPAND_COLS, lora_odd(z[p]));
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
            lora_bt_bf16((const uint16_t *)w + c0 * R, lora_min(16, width - c0), R, bt + c0);
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

/* out [T, SR] fp32 (contiguous) = scalings[i] * (a[i] @ x[t]) with i = idx[t] (rows of -1: zeros); x [T, K] rows
 * xs elements apart, a [L, SR, K] contiguous, both of the dtype. Returns -1 when scratch memory fails. */
int qwen_lora_shrink(const void *x, int64_t xs, int64_t T, int64_t K, const void *a, int64_t SR,
                     const int32_t *idx, const float *scalings, int dtype, float *out, int64_t threads) {
    lora_block *blocks = malloc(sizeof(lora_block) * (size_t)(T > 0 ? T : 1));
    if (blocks == NULL) return -1;
    int64_t active;
    const int64_t nb = lora_blocks(idx, T, blocks, &active);
    const int64_t nthreads = threads > 1 ? threads : 1;
    /* fp32 rows of x: in place for fp32, else converted once (only the rows with an adapter); per thread, 4 A
     * rows widened to fp32 */
    const float *xf = (const float *)x;
    float *xbuf = NULL, *wide = NULL;
    if (dtype != 0) {
        xbuf = malloc(sizeof(float) * (size_t)(T * K > 0 ? T * K : 1));
        wide = malloc(sizeof(float) * (size_t)(nthreads * LORA_SHRINK_COLS * (K > 0 ? K : 1)));
        if (xbuf == NULL || wide == NULL) {
            free(xbuf);
            free(wide);
            free(blocks);
            return -1;
        }
        for (int64_t t = 0; t < T; ++t)
            if (idx[t] >= 0) load_row(x, t * xs, dtype, K, xbuf + t * K);
        xf = xbuf;
        xs = K;
    }
    for (int64_t t = 0; t < T; ++t)
        if (idx[t] < 0) memset(out + t * SR, 0, sizeof(float) * (size_t)SR);
    const int64_t elem = dtype_elem(dtype), ncb = (SR + LORA_SHRINK_COLS - 1) / LORA_SHRINK_COLS;
    const int64_t items = ncb * nb;
    const int parallel = threads > 1 && active * SR * K >= LORA_PARALLEL_MIN;
    (void)parallel;
    (void)elem;
#pragma omp parallel num_threads((int)threads) if (parallel)
    {
        float *mine = wide == NULL ? NULL : wide + (size_t)lora_thread() * LORA_SHRINK_COLS * (size_t)K;
        (void)mine;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t cb = item % ncb;
            const lora_block *b = blocks + item / ncb;
            const float scale = scalings[b->slot];
            const int64_t j0 = cb * LORA_SHRINK_COLS, nc = lora_min(SR, j0 + LORA_SHRINK_COLS) - j0;
            const char *a0 = (const char *)a + ((int64_t)b->slot * SR + j0) * K * elem;   /* A[slot, j0] */
#if QWEN_AVX512
            /* the item's 4 A rows (the last one repeated past SR), widened once for a long block */
            const void *wr[LORA_SHRINK_COLS];
            int wdtype = dtype;
            for (int c = 0; c < LORA_SHRINK_COLS; ++c) wr[c] = a0 + lora_min(c, nc - 1) * K * elem;
            if (dtype != 0 && b->t1 - b->t0 >= LORA_WIDEN_MIN) {
                for (int c = 0; c < nc; ++c) load_row(wr[c], 0, dtype, K, mine + c * K);
                for (int c = 0; c < LORA_SHRINK_COLS; ++c) wr[c] = mine + lora_min(c, nc - 1) * K;
                wdtype = 0;
            }
            for (int64_t t0 = b->t0; t0 < b->t1; t0 += LORA_MR) {
                const int mr = (int)lora_min(LORA_MR, b->t1 - t0);
                const float *xr[LORA_MR];
                for (int m = 0; m < mr; ++m) xr[m] = xf + (t0 + m) * xs;
                float res[LORA_MR][4];
                lora_shrink_rows(xr, mr, wr, wdtype, K, res);
                for (int m = 0; m < mr; ++m)
                    for (int c = 0; c < nc; ++c) out[(t0 + m) * SR + j0 + c] = scale * res[m][c];
            }
#else
            for (int64_t t = b->t0; t < b->t1; ++t)
                for (int c = 0; c < nc; ++c)
                    out[t * SR + j0 + c] = scale * lora_dot(xf + t * xs, a0 + c * K * elem, dtype, K);
#endif
        }
    }
    free(wide);
    free(xbuf);
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
    /* per thread: the transposed tile Bt [R][64] */
    float *tiles = malloc(sizeof(float) * LORA_EXPAND_COLS * (size_t)(nthreads * (R > 0 ? R : 1)));
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
    int64_t active;
    const int64_t nb = lora_blocks(idx, T, blocks, &active), items = ncb * nb, elem = dtype_elem(dtype);
    const int parallel = threads > 1 && active * N * R >= LORA_PARALLEL_MIN;
    (void)parallel;
#pragma omp parallel num_threads((int)threads) if (parallel)
    {
        float *bt = tiles + (size_t)lora_thread() * LORA_EXPAND_COLS * (size_t)R;
        int64_t have_cb = -1;   /* the column block and slot whose tile bt holds */
        int32_t have_slot = -1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t icb = item % ncb;
            const int64_t *cb = cols + 3 * icb;
            const lora_block *blk = blocks + item / ncb;
            const int64_t n0 = cb[0], width = cb[1] - cb[0];
            float delta[LORA_MR][LORA_EXPAND_COLS], row[LORA_EXPAND_COLS];
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
