/* bench_quant.py --one-row's kernel-only timing: the library's own qwen_linear_a8_panels (a function
 * pointer taken from the loaded libqwen_cpu), called back to back from C on each of `count` weights, so
 * that the figure is the kernel's (quantizing x, the threads' fork and join, streaming the weights)
 * without the Python call and the dispatcher of a torch.ops call. Compiled by the benchmark. */
#include <stdint.h>
#include <time.h>

typedef int (*a8_panels_fn)(int kind, const void *x, int64_t xs, int64_t x_bf16, int64_t M, const uint8_t *w,
                            const float *s, const uint8_t *z, int64_t g, const float *bias, int64_t N, int64_t K,
                            void *out, int64_t ys, int64_t out_bf16, int64_t threads, int64_t portable);

/* Seconds for one one-row fp32 call on each of the weights ws[0 .. count - 1] (scales s, int4 zeros z or
 * NULL), or -1.0 when a call fails. y [N] holds the last call's output. */
double qwen_time_a8_panels(void *fn, int kind, const float *x, const uint8_t *const *ws, int64_t count,
                           const float *s, const uint8_t *z, int64_t g, int64_t N, int64_t K, float *y,
                           int64_t threads) {
    const a8_panels_fn call = (a8_panels_fn)fn;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t c = 0; c < count; ++c)
        if (call(kind, x, K, 0, 1, ws[c], s, z, g, (const float *)0, N, K, y, N, 0, threads, 0) != 0) return -1.0;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
