/* Multi-LoRA on the CPU: lora_shrink and lora_expand (torch.ops.qwen.*; contracts in torch_library/qwen.schema,
 * references in kernels/reference_lora.py). #included at the end of qwen_cpu.c, whose helpers it uses; called by
 * the C++ dispatcher kernels of qwen_cpu_ops.cpp, which check every argument and index value first.
 *
 * Both ops are one fp32 dot product per output element: shrink out[t, j] = scale * x[t, :K] . A[i, j, :K],
 * expand delta[t, n] = buffer[t, sR : sR + R] . B[i, n, :R]. The rows are cut into blocks of at most LORA_MR
 * consecutive rows of one adapter (a prefill's run of one adapter is many blocks of one slot; a decode batch
 * with a different adapter per row, blocks of one row), so each weight row is widened once per block and
 * multiplied into every row of it. Work items are (output-column block, row block), numbered column block
 * first, so a thread's consecutive items reuse one weight tile from its cache. Every element's sum is the
 * same chain of operations whatever the block it sits in and whatever the thread count: 1 and N threads give
 * the same bits. Expand's sums are short (R terms): with AVX-512 four columns share one lane reduction. Dtype codes as qwen_cpu.c: 0 = float32, 1 = float16, 2 = bfloat16.
 */

#ifndef LORA_MR
#define LORA_MR 4            /* rows of one adapter per block */
#endif
#define LORA_SHRINK_COLS 8   /* A rows (shrink outputs) per work item: 8 x K weights, 16 KB at K = 1024 bf16 */
#define LORA_EXPAND_COLS 64  /* output columns per work item */
#define LORA_PARALLEL_MIN (1 << 16)   /* multiply-adds below which one thread does it all */

typedef struct {
    int64_t t0, t1;
    int32_t slot;
} lora_block;

/* Blocks of at most LORA_MR consecutive rows of one adapter slot; rows of slot -1 belong to none. */
static int64_t lora_blocks(const int32_t *idx, int64_t T, lora_block *blocks) {
    int64_t n = 0, t = 0;
    while (t < T) {
        const int32_t slot = idx[t];
        int64_t end = t + 1;
        while (end < T && idx[end] == slot && end - t < LORA_MR) ++end;
        if (slot >= 0) {
            blocks[n].t0 = t;
            blocks[n].t1 = end;
            blocks[n].slot = slot;
            ++n;
        }
        t = end;
    }
    return n;
}

#if QWEN_AVX512
/* 16 weights from element k as fp32 (exact widening). */
static inline __attribute__((always_inline)) __m512 lora_w16(const void *w, int64_t k, const int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)w + k);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)w + k));
    if (dtype == 2) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* res[m] = xr[m][0:n] . w[0:n] for m < MR: 16-lane fp32 partial sums in k order, then one lane reduction. */
static inline __attribute__((always_inline)) void lora_dots_avx512(const float *const *xr, const void *w,
                                                                   int64_t n, float *res, const int dtype,
                                                                   const int MR) {
    __m512 acc[LORA_MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 wv = lora_w16(w, k, dtype);
        for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xr[m] + k), acc[m]);
    }
    if (k < n) {   /* the tail, widened through a zeroed buffer (plain AVX-512F loads) */
        float tail[16] = {0};
        load_row(w, k, dtype, n - k, tail);
        const __m512 wv = _mm512_loadu_ps(tail);
        const __mmask16 mask = (__mmask16)((1u << (n - k)) - 1u);
        for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, xr[m] + k), acc[m]);
    }
    for (int m = 0; m < MR; ++m) res[m] = _mm512_reduce_add_ps(acc[m]);
}

/* res[m][c] = xr[m][0:n] . w_c[0:n] for the 4 weight rows w_c = w + c * wbytes bytes and m < MR: four columns
 * at once, so expand's short rank-R sums share one lane reduction (sum4_avx512) instead of one each. */
static inline __attribute__((always_inline)) void lora_dots4_avx512(const float *const *xr, const void *w,
                                                                    int64_t wbytes, int64_t n, float (*res)[4],
                                                                    const int dtype, const int MR) {
    __m512 acc[LORA_MR][4];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m512 xv[LORA_MR];
        for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(xr[m] + k);
        for (int c = 0; c < 4; ++c) {
            const __m512 wv = lora_w16((const char *)w + c * wbytes, k, dtype);
            for (int m = 0; m < MR; ++m) acc[m][c] = _mm512_fmadd_ps(wv, xv[m], acc[m][c]);
        }
    }
    if (k < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - k)) - 1u);
        __m512 xv[LORA_MR];
        for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, xr[m] + k);
        for (int c = 0; c < 4; ++c) {
            float tail[16] = {0};
            load_row((const char *)w + c * wbytes, k, dtype, n - k, tail);
            const __m512 wv = _mm512_loadu_ps(tail);
            for (int m = 0; m < MR; ++m) acc[m][c] = _mm512_fmadd_ps(wv, xv[m], acc[m][c]);
        }
    }
    for (int m = 0; m < MR; ++m) _mm_storeu_ps(res[m], sum4_avx512(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

#define LORA_DOTS4_MR(D)                                                         \
    switch (mr) {                                                                \
        case 4: lora_dots4_avx512(xr, w, wbytes, n, res, D, 4); return;          \
        case 3: lora_dots4_avx512(xr, w, wbytes, n, res, D, 3); return;          \
        case 2: lora_dots4_avx512(xr, w, wbytes, n, res, D, 2); return;          \
        default: lora_dots4_avx512(xr, w, wbytes, n, res, D, 1); return;         \
    }

static void lora_dots4(const float *const *xr, int mr, const void *w, int64_t wbytes, int dtype, int64_t n,
                       float (*res)[4]) {
    if (dtype == 0) { LORA_DOTS4_MR(0) }
    if (dtype == 2) { LORA_DOTS4_MR(2) }
    LORA_DOTS4_MR(1)
}

#define LORA_DOTS_MR(D)                                                          \
    switch (mr) {                                                                \
        case 4: lora_dots_avx512(xr, w, n, res, D, 4); return;                   \
        case 3: lora_dots_avx512(xr, w, n, res, D, 3); return;                   \
        case 2: lora_dots_avx512(xr, w, n, res, D, 2); return;                   \
        default: lora_dots_avx512(xr, w, n, res, D, 1); return;                  \
    }
#endif

/* res[m] = xr[m][0:n] . w[0:n] (w of the dtype, xr fp32 rows) for m < mr <= LORA_MR. */
static void lora_dots(const float *const *xr, int mr, const void *w, int dtype, int64_t n, float *res) {
#if QWEN_AVX512
    if (dtype == 0) { LORA_DOTS_MR(0) }
    if (dtype == 2) { LORA_DOTS_MR(2) }
    LORA_DOTS_MR(1)
#else
    for (int m = 0; m < mr; ++m) {
        const float *x = xr[m];
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
        res[m] = s;
    }
#endif
}

static inline int64_t lora_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* out [T, SR] fp32 (contiguous) = scalings[i] * (a[i] @ x[t]) with i = idx[t] (rows of -1: zeros); x [T, K] rows
 * xs elements apart, a [L, SR, K] contiguous, both of the dtype. Returns -1 when scratch memory fails. */
int qwen_lora_shrink(const void *x, int64_t xs, int64_t T, int64_t K, const void *a, int64_t SR,
                     const int32_t *idx, const float *scalings, int dtype, float *out, int64_t threads) {
    lora_block *blocks = malloc(sizeof(lora_block) * (size_t)(T > 0 ? T : 1));
    if (blocks == NULL) return -1;
    const int64_t nb = lora_blocks(idx, T, blocks);
    /* fp32 rows of x: in place for fp32, else converted once (only the rows with an adapter) */
    const float *xf = (const float *)x;
    float *xbuf = NULL;
    if (dtype != 0) {
        xbuf = malloc(sizeof(float) * (size_t)(T * K > 0 ? T * K : 1));
        if (xbuf == NULL) {
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
    const int parallel = threads > 1 && nb * LORA_MR * SR * K >= LORA_PARALLEL_MIN;
    (void)parallel;
#pragma omp parallel for num_threads((int)threads) if (parallel) schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t cb = item / nb;
        const lora_block *b = blocks + item % nb;
        const int mr = (int)(b->t1 - b->t0);
        const float *xr[LORA_MR];
        for (int m = 0; m < mr; ++m) xr[m] = xf + (b->t0 + m) * xs;
        const float scale = scalings[b->slot];
        const int64_t j1 = lora_min(SR, (cb + 1) * LORA_SHRINK_COLS);
        for (int64_t j = cb * LORA_SHRINK_COLS; j < j1; ++j) {
            float res[LORA_MR];
            lora_dots(xr, mr, (const char *)a + ((int64_t)b->slot * SR + j) * K * elem, dtype, K, res);
            for (int m = 0; m < mr; ++m) out[(b->t0 + m) * SR + j] = scale * res[m];
        }
    }
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
    int64_t *cols = malloc(sizeof(int64_t) * 3 * (size_t)(ncb > 0 ? ncb : 1));
    lora_block *blocks = malloc(sizeof(lora_block) * (size_t)(T > 0 ? T : 1));
    if (cols == NULL || blocks == NULL) {
        free(cols);
        free(blocks);
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
    const int64_t nb = lora_blocks(idx, T, blocks), items = ncb * nb, elem = dtype_elem(dtype);
    const int parallel = threads > 1 && nb * LORA_MR * N * R >= LORA_PARALLEL_MIN;
    (void)parallel;
#pragma omp parallel for num_threads((int)threads) if (parallel) schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t *cb = cols + 3 * (item / nb);
        const lora_block *blk = blocks + item % nb;
        const int mr = (int)(blk->t1 - blk->t0);
        const int64_t n0 = cb[0], width = cb[1] - cb[0];
        const float *xr[LORA_MR];
        for (int m = 0; m < mr; ++m) xr[m] = buffer + (blk->t0 + m) * bs + cb[2] * R;
        float delta[LORA_MR][LORA_EXPAND_COLS], row[LORA_EXPAND_COLS];
        const char *wb = (const char *)b + ((int64_t)blk->slot * N + n0) * R * elem;   /* B[slot, n0] */
        int64_t n = 0;
#if QWEN_AVX512
        for (; n + 4 <= width; n += 4) {   /* column blocks start at multiples of 4 in their slice */
            float res[LORA_MR][4];
            lora_dots4(xr, mr, wb + n * R * elem, R * elem, dtype, R, res);
            for (int m = 0; m < mr; ++m)
                for (int c = 0; c < 4; ++c) delta[m][n + c] = res[m][c];
        }
#endif
        for (; n < width; ++n) {
            float res[LORA_MR];
            lora_dots(xr, mr, wb + n * R * elem, dtype, R, res);
            for (int m = 0; m < mr; ++m) delta[m][n] = res[m];
        }
        for (int m = 0; m < mr; ++m) {   /* y + delta in fp32, rounded once */
            const int64_t offset = (blk->t0 + m) * ys + n0;
            load_row(y, offset, dtype, width, row);
            for (int64_t n = 0; n < width; ++n) row[n] += delta[m][n];
            store_row(y, offset, dtype, width, row);
        }
    }
    free(blocks);
    free(cols);
    return 0;
}
