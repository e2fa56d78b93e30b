/*
 * RMS normalisation of fp32 rows, optionally after adding a residual in place (the decoder's
 * "x = x + sublayer(x); h = norm(x)"), CPU. Plain C, loaded with ctypes (see rms_norm.py).
 *
 *   x        [M, K] rows ldx apart; with `res`, x[i] += res[i] first (x is updated in place)
 *   res      [M, K] rows ldr apart, or NULL
 *   w        [K]
 *   out      [M, K] rows ldo apart: out[i][k] = w[k] * (x[i][k] * r_i),
 *            r_i = 1 / sqrtf(mean_k(x[i][k]^2) + eps)
 *
 * The products and the rounding order are transformers' LlamaRMSNorm in fp32 (x times the inverse
 * root, then times the weight); the sum of squares is accumulated in double, one row on one thread in
 * index order, so a row's result does not depend on the thread count or on the other rows.
 * Why a kernel for this: torch's rms_norm on one 576-wide row costs ~9 us of dispatch (more inside a
 * decode step, where it runs cold), 60 times a token; this costs well under a microsecond of work.
 */
#include <math.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows x width below which one thread does it all: a fork/join costs microseconds. */
#define RN_MIN_PARALLEL_WORK (64 * 1024)

int rn_has_avx2(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

int rn_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Four running sums (element k goes to sum k % 4, combined in a fixed order) so the adds do not wait
 * on each other; the order is fixed, so the result is too. */
static void norm_row(float *x, const float *res, const float *w, float *out, int64_t K, float eps) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    if (res)
        for (int64_t k = 0; k < K; k++) x[k] += res[k];
    int64_t k = 0;
    for (; k + 4 <= K; k += 4)
        for (int j = 0; j < 4; j++) s[j] += (double)x[k + j] * (double)x[k + j];
    for (; k < K; k++) s[k & 3] += (double)x[k] * (double)x[k];
    const double ss = (s[0] + s[1]) + (s[2] + s[3]);
    const float r = 1.0f / sqrtf((float)(ss / (double)K) + eps);
    for (k = 0; k < K; k++) {
        const float h = x[k] * r; /* rounded before the weight multiplies it, as in transformers */
        out[k] = w[k] * h;
    }
}

int rn_rms_norm_f32(float *x, int64_t ldx, const float *res, int64_t ldr, const float *w, float *out,
                    int64_t ldo, int64_t M, int64_t K, float eps, int num_threads) {
    if (M < 0 || K <= 0 || ldx < K || ldo < K || (res && ldr < K)) return -1;
    const int nt = (num_threads > 1 && M > 1 && M * K >= RN_MIN_PARALLEL_WORK) ? num_threads : 1;
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t i = 0; i < M; i++) norm_row(x + i * ldx, res ? res + i * ldr : 0, w, out + i * ldo, K, eps);
    return 0;
}
