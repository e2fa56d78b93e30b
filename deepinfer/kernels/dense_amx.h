/*
 * fp32 linear layers of many rows on AMX tiles: y[M,N] = x[M,K] @ W^T, W fp32 [N,K] (dl_linear_amx, exported by
 * dense_linear.c, which includes this file at its end). The prefill path for fp32 weights, beside
 * quant_amx.h's for GGUF blocks.
 *
 * Accuracy. x and W are each split into three bf16 pieces that sum to them exactly (amx_common.h); a product
 * x w is taken as the six piece products x1 w1, x1 w2, x2 w1, x1 w3, x2 w2, x3 w1 (AMX_SIX). The three left out
 * are below 2^-21 |x w| together at worst (a few fp32 ulps of the product, far less on average), the size of
 * the rounding an fp32 GEMM's sums add anyway: against float64 the outputs' errors are torch's GEMM's
 * (tests/unit/test_dense_amx.py). Not bit-identical to torch's GEMM, which no two
 * BLAS builds are either; the layer is the decode kernel's above DL's batch-invariant row range, where torch's
 * GEMM ran before. bf16 subnormals read as zero: pieces below 2^-126 are lost (values under ~2^-110).
 *
 * Layouts (tiles of 16 rows x 64 bytes; kt = ceil(K / 32) input tiles, the last zero-padded):
 *   xp [mt][kt][3 pieces][16 rows][32 inputs] bf16, shared by the threads;
 *   wp [run's feature tiles][kt][3 pieces][16 input pairs][16 features][2] bf16, per thread, for the run of
 *     DL_AMX_NJ feature tiles it works on (items are run-major, so each thread packs a run once).
 * Work items (a run of feature tiles, up to DL_AMX_MG row tiles) are split statically; each output tile is
 * summed by one thread in one order, so results do not depend on the thread count.
 */

#if DL_X86 && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#include "amx_common.h"

#define DL_AMX_NJ 9  /* feature tiles per work item (a multiple of 3: three accumulators) */
#define DL_AMX_MG 16 /* row tiles per work item at most */
#define DL_ERR_NOMEM -4
#define DL_ERR_AMX -5

int dl_amx_ready(void) { return amx_request_tiles(); }

/* 32 floats of row `src` from input 32 k (zeros past K), as three pieces of 32 bf16 words in input order. */
AMX_TARGET static inline void dl_pieces(const float *src, int64_t K, int64_t k, __m512i out[3]) {
    const int64_t left = K - 32 * k;
    const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
    const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
    __m512i lo[3], hi[3];
    amx_split(_mm512_maskz_loadu_ps(m0, src + 32 * k), 3, lo);
    amx_split(_mm512_maskz_loadu_ps(m1, src + 32 * k + 16), 3, hi);
    for (int p = 0; p < 3; p++) out[p] = amx_bf16_words(lo[p], hi[p]);
}

/* Row tile t of x into xp. */
AMX_TARGET static void dl_pack_x(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t kt, int64_t t,
                                 uint16_t *xp) {
    for (int r = 0; r < 16; r++) {
        const int64_t m = 16 * t + r;
        for (int64_t k = 0; k < kt; k++) {
            uint16_t *dst = xp + (t * kt + k) * 3 * 512 + 32 * r;
            __m512i pc[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            if (m < M) dl_pieces(x + m * ldx, K, k, pc);
            for (int p = 0; p < 3; p++) _mm512_store_si512(dst + p * 512, pc[p]);
        }
    }
}

/* Feature tile j of W into wp (its kt x 3 tiles), in the pair layout TDPBF16PS reads. */
AMX_TARGET static void dl_pack_w(const float *w, int64_t ldw, int64_t N, int64_t K, int64_t kt, int64_t j,
                                 uint16_t *wp) {
    for (int64_t k = 0; k < kt; k++) {
        __m512i rows[3][16];
        for (int r = 0; r < 16; r++) {
            const int64_t n = 16 * j + r;
            __m512i pc[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            if (n < N) dl_pieces(w + n * ldw, K, k, pc);
            for (int p = 0; p < 3; p++) rows[p][r] = pc[p];
        }
        for (int p = 0; p < 3; p++) amx_transpose16(rows[p], (uint32_t *)(wp + (k * 3 + p) * 512));
    }
}

/* Output tile c (rows 16 t.., features 16 j..) into y: whole, or masked through a buffer at the edges. */
AMX_TARGET static inline void dl_amx_store(int c, float *y, int64_t ldy, int64_t M, int64_t N, int64_t t, int64_t j) {
    const int64_t m0 = 16 * t, n0 = 16 * j;
    if (m0 >= M || n0 >= N) return;
    float buf[256] __attribute__((aligned(64)));
    const int whole = m0 + 16 <= M && n0 + 16 <= N;
    float *dst = whole ? y + m0 * ldy + n0 : buf;
    const int64_t stride = whole ? ldy * 4 : 64;
    if (c == 5) /* the tile number must be an immediate */
        _tile_stored(5, dst, stride);
    else if (c == 6)
        _tile_stored(6, dst, stride);
    else
        _tile_stored(7, dst, stride);
    if (whole) return;
    const __mmask16 keep = (__mmask16)((1u << (N - n0 < 16 ? N - n0 : 16)) - 1u);
    for (int64_t r = 0; r < 16 && m0 + r < M; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, keep, _mm512_load_ps(buf + 16 * r));
}

/* Row tiles t0 .. t1-1 against feature tiles j0 .. j1-1 (a multiple of 3) of the packed run at wp. */
AMX_TARGET static void dl_amx_item(const uint16_t *xp, const uint16_t *wp, float *y, int64_t ldy, int64_t M,
                                   int64_t N, int64_t kt, int64_t j0, int64_t j1, int64_t t0, int64_t t1) {
    const int64_t wj = kt * 3 * 512; /* bf16 per feature tile */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t j = j0; j < j1; j += 3) {
            const uint16_t *a = xp + t * kt * 3 * 512, *b = wp + (j - j0) * wj;
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t k = 0; k < kt; k++, a += 3 * 512, b += 3 * 512) {
                _tile_loadd(0, a, 64);
                _tile_loadd(1, a + 512, 64);
                _tile_loadd(2, a + 1024, 64);
                AMX_SIX(5, b);
                AMX_SIX(6, b + wj);
                AMX_SIX(7, b + 2 * wj);
            }
            dl_amx_store(5, y, ldy, M, N, t, j);
            dl_amx_store(6, y, ldy, M, N, t, j + 1);
            dl_amx_store(7, y, ldy, M, N, t, j + 2);
        }
    }
}

AMX_TARGET static int dl_amx_run(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                                 int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t kt = (K + 31) / 32, mt = (M + 15) / 16, nt = (N + 47) / 48 * 3;
    const int64_t runs = (nt + DL_AMX_NJ - 1) / DL_AMX_NJ, groups = (mt + DL_AMX_MG - 1) / DL_AMX_MG;
    uint16_t *xp = amx_buffer(0, (size_t)(mt * kt * 3) * AMX_TILE_BYTES);
    if (!xp) return DL_ERR_NOMEM;
    int nthr = work_threads(num_threads, M, N, K, runs * groups), failed = 0;
    (void)nthr;
#pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        uint16_t *wp = amx_buffer(1, (size_t)(DL_AMX_NJ * kt * 3) * AMX_TILE_BYTES);
        int64_t packed = -1;
        if (!wp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < mt; t++) dl_pack_x(x, ldx, M, K, kt, t, xp);
        amx_configure_tiles();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < runs * groups; item++) {
            if (!wp) continue;
            const int64_t run = item / groups, g = item % groups;
            const int64_t j0 = run * DL_AMX_NJ, j1 = j0 + DL_AMX_NJ < nt ? j0 + DL_AMX_NJ : nt;
            const int64_t t0 = g * DL_AMX_MG, t1 = t0 + DL_AMX_MG < mt ? t0 + DL_AMX_MG : mt;
            if (packed != run) {
                for (int64_t j = j0; j < j1; j++) dl_pack_w(w, ldw, N, K, kt, j, wp + (j - j0) * kt * 3 * 512);
                packed = run;
            }
            dl_amx_item(xp, wp, y, ldy, M, N, kt, j0, j1, t0, t1);
        }
        _tile_release();
        if (wp) amx_buffer_done(1, wp);
    }
    amx_buffer_done(0, xp);
    return failed ? DL_ERR_NOMEM : DL_OK;
}

/* y = x @ W^T on AMX tiles (see the top of this file); DL_ERR_AMX when the CPU or the OS cannot run them. */
int dl_linear_amx(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                  int64_t K, int num_threads) {
    if (M < 0 || N < 0 || K < 1 || (M > 1 && ldx < K) || (M > 1 && ldy < N)) return DL_ERR_SHAPE;
    if (M == 0 || N == 0) return DL_OK;
    if (!amx_request_tiles()) return DL_ERR_AMX;
    return dl_amx_run(x, ldx, w, K, y, ldy, M, N, K, num_threads);
}

#else
int dl_amx_ready(void) { return 0; }
int dl_linear_amx(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                  int64_t K, int num_threads) {
    (void)x, (void)ldx, (void)w, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)num_threads;
    return -5;
}
#endif
