/*
 * fp32 linear layers for few rows: y[M,N] = x[M,K] @ W^T, W [N,K] row-major (torch's layout).
 *
 * Why: at decode, at a speculative step's verification rows and at small batches, a linear layer is
 * bound by reading W once, and M rows should cost about what one row costs. The CPU BLAS does not get
 * there: on the 2-core AVX-512 VM of 2026-12-02, MKL's sgemm on SmolLM2's projections took 18.7 ms at
 * one row and 35 / 48 / 61 ms at 8 / 17 / 32 rows, far from the weight stream's ~22 ms.
 *
 * How: weight rows are taken NACC at a time (16 with AVX-512, 8 with AVX2) and each output is a dot
 * product over K. A tile of MR rows of x times RR rows of W keeps its MR * RR accumulators in
 * registers (AVX-512: 1 x 16, 2 x 8, 4 x 4; AVX2: 1 x 8, 2 x 4, and MR x 2 for MR = 3..6, up to 12 of
 * its 16 registers); at each step of V floats along K it loads RR weight vectors and MR x vectors and
 * issues MR * RR FMAs. The accumulators are then reduced together to vectors of sums (a
 * transpose-and-add tree, ~2 instructions per output instead of a ~10-instruction horizontal sum
 * each) and stored. On AVX2 the 6 x 2 tile (8 loads for 12 FMAs; a 4 x 2 tile takes 6 for 8) and
 * the 3- to 5-row tiles (one pass over a weight group where a 4 x 2 pass and a 1 x 8 pass took two)
 * made SmolLM2's 30 layers 8-14% faster at 5 to 64 rows than 4 x 2, 2 x 4 and 1 x 8 tiles on the AVX2 VM
 * (2026-12-03; 1-2 rows unchanged), with the same output bits. Every weight row is read from memory once
 * per call; for several blocks of x rows the tiles of one weight-row group run back to back, so the
 * group is re-read from L1/L2, not memory.
 *
 * Invariant (batch invariance): y[i][n] depends only on x row i and W row n, never on M, on which
 * other rows share the call, on the tile shape or on the thread count. Lane l of an accumulator sums
 * x[k] * w[k] for k = l, l + V, l + 2V, ... in increasing k with FMAs (a K tail is loaded masked as
 * zeros), and the reduction adds the lanes in one fixed pattern for every accumulator slot. So a
 * token's logits are the same bits whether it is decoded alone, in a batch, or as a verification row
 * of a speculative step (on one machine and one code path: AVX-512, AVX2 and portable builds differ).
 * The portable path sums each output in order k = 0..K-1 and is batch-invariant too.
 *
 * x rows are ldx floats apart, y rows ldy floats apart; W is contiguous. OpenMP over groups of NACC
 * weight rows, with an explicit thread count; small problems run on the calling thread.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dense_tiles.h"

#define DL_OK 0
#define DL_ERR_SHAPE -3

/* Below this many multiply-adds a call runs on one thread (waking the team costs ~1 us). */
#ifndef DL_MIN_PARALLEL_WORK
#define DL_MIN_PARALLEL_WORK (64 * 1024)
#endif


int dl_has_avx2(void) { return DL_AVX2; }
int dl_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static int work_threads(int num_threads, int64_t M, int64_t N, int64_t K, int64_t groups) {
    if (num_threads < 1 || M * N * K < DL_MIN_PARALLEL_WORK) return 1;
    return groups < num_threads ? (int)(groups > 0 ? groups : 1) : num_threads;
}

#if DL_X86
/* ------------------------------------------------------------------------------------ */
/* AVX-512F: V = NACC = 16. Compiled for the target by attribute and chosen at run time.  */

DL_512 static void range512(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M,
                            int64_t N, int64_t K, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n = g * 16;
#define DL_TILE512(MR, RR, i, r) tile512(MR, RR, x, ldx, w, y, ldy, K, N, M, i, n + (r), (i) == 0)
        DL_GROUP_TILES(16, M, DL_TILE512);
#undef DL_TILE512
    }
}
#endif /* DL_X86 */

#if DL_AVX2
/* ------------------------------------------------------------------------------------ */
/* AVX2 + FMA: V = NACC = 8 (16 ymm registers: 8 accumulators, up to 4 + 4 operands).    */

static void range256(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                     int64_t K, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n = g * 8;
#define DL_TILE256(MR, RR, i, r) tile256(MR, RR, x, ldx, w, y, ldy, K, N, M, i, n + (r), (i) == 0)
        DL_GROUP_TILES8(M, DL_TILE256);
#undef DL_TILE256
    }
}
#endif /* DL_AVX2 */

/* ------------------------------------------------------------------------------------ */
/* Portable C: one output at a time, summed in order.                                    */

static void range_portable(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M,
                           int64_t N, int64_t K, int64_t g0, int64_t g1) {
    for (int64_t n = g0; n < g1 && n < N; n++)
        for (int64_t i = 0; i < M; i++) {
            const float *xi = x + i * ldx, *wn = w + n * K;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += xi[k] * wn[k];
            y[i * ldy + n] = s;
        }
}

typedef void (*range_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t);

/* 2 = AVX-512, 1 = AVX2, 0 = portable: the path dl_linear_f32 takes on this CPU (its one dispatch rule). */
int dl_path(void) {
#if DL_X86
    if (__builtin_cpu_supports("avx512f")) return 2;
#endif
    return DL_AVX2;
}

static int run(range_fn fn, int64_t group, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy,
               int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 0 || N < 0 || K < 1 || ldx < K || ldy < N) return DL_ERR_SHAPE;
    if (M == 0 || N == 0) return DL_OK;
    const int64_t groups = (N + group - 1) / group;
    const int nt = work_threads(num_threads, M, N, K, groups);
    if (nt == 1) {
        fn(x, ldx, w, y, ldy, M, N, K, 0, groups);
        return DL_OK;
    }
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
        fn(x, ldx, w, y, ldy, M, N, K, g0, g1);
    }
    return DL_OK;
}

/* y[M,N] (row stride ldy) = x[M,K] (row stride ldx) @ W^T, W [N,K] contiguous. 0, or DL_ERR_SHAPE. */
int dl_linear_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                  int num_threads) {
    switch (dl_path()) {
#if DL_X86
    case 2: return run(range512, 16, x, ldx, w, y, ldy, M, N, K, num_threads);
#endif
#if DL_AVX2
    case 1: return run(range256, 8, x, ldx, w, y, ldy, M, N, K, num_threads);
#endif
    default: return run(range_portable, 1, x, ldx, w, y, ldy, M, N, K, num_threads);
    }
}

/* The portable path on any build (for tests). */
int dl_linear_f32_portable(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                           int64_t K, int num_threads) {
    return run(range_portable, 1, x, ldx, w, y, ldy, M, N, K, num_threads);
}

/* The AVX2 path where the build has it (for tests on AVX-512 machines); else DL_ERR_SHAPE - 1. */
int dl_linear_f32_avx2(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
#if DL_AVX2
    return run(range256, 8, x, ldx, w, y, ldy, M, N, K, num_threads);
#else
    (void)x; (void)ldx; (void)w; (void)y; (void)ldy; (void)M; (void)N; (void)K; (void)num_threads;
    return DL_ERR_SHAPE - 1;
#endif
}

#include "dense_amx.h"
