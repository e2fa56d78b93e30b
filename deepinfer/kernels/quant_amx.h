/*
 * Many-row products on AMX tiles, exact to fp32 products: y[M,N] = x[M,K] @ W^T for the GGUF block formats.
 *
 * Included by quant_linear.c (its block layouts, `block_ints`, `half_to_float`, `check_args`, QL_* codes);
 * compiled for AMX-BF16 through a target attribute, and run only where the CPU has it and Linux grants the
 * process the tile state (`ql_amx_ready`).
 *
 * Why bf16 tiles give fp32 products here. A bf16 holds 8 significant bits. Each fp32 activation is split
 * into three bf16 pieces, x = x1 + x2 + x3 exactly: x1 is x with its low 16 bits cleared, x2 the same of
 * the exact remainder, x3 what remains (at most 8 significant bits). A weight d * q (Q8_0, Q4_0) is a
 * product of an f16 (11 significant bits) and a small integer, so it has at most 15 significant bits for
 * the 4-bit formats (two pieces) and 19 for Q8_0 (three); it is exact in fp32, and the pieces sum to it
 * exactly. Every piece-by-piece product has at most 16 significant bits, exact in the tile unit's fp32
 * accumulators, so the tiles compute the same products as the fp32 layer on the dequantised weights and
 * differ from it only in the order of the fp32 sums (as the kernel's other paths do). Q4_1's w = d * q + m
 * is taken as d * q plus m * (the block's sum of x): x is extended by its block sums and W by its
 * minimums, both split the same way, as extra input tiles ("x' = [x, sums]", "w' = [d q, m]"). The cost is
 * 6 tile products (9 for Q8_0) where plain bf16 would take one: AMX-BF16 runs about 16x the fp32 FMA rate
 * per core, so this still beats the fp32 GEMM (bench/bench_quant_linear.py).
 * Limits, both far from any real layer: the tile unit reads bf16 subnormals as zero, so pieces below 2^-126
 * are lost (activations under about 2^-110); an infinite activation gives NaN in its row's outputs (inf
 * times a zero piece) where the fp32 layer may give an infinity. A NaN stays a NaN.
 *
 * Layouts (every tile 16 rows x 64 bytes; kt input tiles of 32 = K / 32, plus ceil(K / 1024) for Q4_1):
 *   xp [mt][kt][3 pieces][16 rows][32 inputs] bf16, rows past M zero; shared by the threads.
 *   wp [run's feature tiles][kt][np pieces][16 input pairs][16 features][2] bf16: the pairing TDPBF16PS
 *     reads (inputs 2i and 2i + 1 of a feature side by side); each thread packs the run it works on into
 *     its own buffer, which stays in its L2.
 * Work items are (a run of QL_AMX_NJ feature tiles, a run of up to QL_AMX_MG row tiles), run-major, split
 * statically over the threads. Each output tile is summed by one thread in one fixed order, so results do
 * not depend on the thread count. Each thread configures the tiles on entry and releases them on exit.
 */

#if QL_AVX2 && defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define QL_AMX_BUILD 1
#include "amx_common.h"

#define QL_AMX AMX_TARGET
#define QL_AMX_NJ 9  /* feature tiles (16 each) per work item */
#define QL_AMX_MG 16 /* row tiles (16 each) per work item at most */

/* 1 when this CPU has AMX-BF16 and AVX512-BF16 and the kernel gave this process the tile data state. */
int ql_amx_ready(void) { return amx_request_tiles(); }

/* Rows t*16 .. t*16+15 of x' = [x, block sums of x (Q4_1)]: kt tiles of 32 inputs, three pieces each. */
QL_AMX static void amx_pack_x(const float *x, int64_t ldx, int64_t M, int64_t nb, int64_t kt, int sums, int64_t t,
                              uint16_t *xp) {
    for (int r = 0; r < 16; r++) {
        const int64_t m = t * 16 + r;
        float s[64] __attribute__((aligned(64))); /* block sums of this row for one tile of 32 blocks */
        for (int64_t k = 0; k < kt; k++) {
            uint16_t *dst = xp + (t * kt + k) * 3 * 512 + r * 32;
            if (m >= M || (k >= nb && !sums)) {
                for (int p = 0; p < 3; p++) _mm512_storeu_si512(dst + p * 512, _mm512_setzero_si512());
                continue;
            }
            const float *v = x + m * ldx + k * QK;
            if (k >= nb) { /* sums of blocks 32 (k - nb) .. + 31 */
                const int64_t b0 = (k - nb) * QK;
                for (int i = 0; i < QK; i++) {
                    const float *blk = x + m * ldx + (b0 + i) * QK;
                    s[i] = b0 + i < nb ? _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(blk),
                                                                            _mm512_loadu_ps(blk + 16)))
                                       : 0.0f;
                }
                v = s;
            }
            __m512i lo[3], hi[3];
            amx_split(_mm512_loadu_ps(v), 3, lo);
            amx_split(_mm512_loadu_ps(v + 16), 3, hi);
            for (int p = 0; p < 3; p++) _mm512_storeu_si512(dst + p * 512, amx_bf16_words(lo[p], hi[p]));
        }
    }
}

/* Output features j*16 .. j*16+15 of w' = [d * q, m (Q4_1)]: kt tiles of 32 inputs, `np` pieces each, in the
 * pair layout TDPBF16PS reads (inputs 2i and 2i + 1 of feature n side by side). */
QL_AMX static void amx_pack_w(const int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nb, int64_t kt,
                              int np, int64_t j, uint16_t *wp) {
    const int bsz = ql_block_bytes(fmt);
    __m512i rows[3][16]; /* [piece][feature]: 16 input pairs */
    for (int64_t k = 0; k < kt; k++) {
        for (int r = 0; r < 16; r++) {
            const int64_t n = j * 16 + r;
            if (n >= N) {
                for (int p = 0; p < np; p++) rows[p][r] = _mm512_setzero_si512();
                continue;
            }
            __m512 lo, hi;
            if (k < nb) { /* d * q: exact in fp32 (11 significant bits times at most 8) */
                const uint8_t *blk = w + n * row_bytes + k * bsz;
                __m256 q[4];
                QL_BY_FORMAT(fmt, block_ints(F, blk, q));
                const __m512 d = _mm512_set1_ps(half_to_float(load_u16(blk)));
                lo = _mm512_mul_ps(d, _mm512_insertf32x8(_mm512_castps256_ps512(q[0]), q[1], 1));
                hi = _mm512_mul_ps(d, _mm512_insertf32x8(_mm512_castps256_ps512(q[2]), q[3], 1));
            } else { /* Q4_1's minimum of blocks 32 (k - nb) .. + 31 (11 significant bits) */
                float mv[32] __attribute__((aligned(64)));
                for (int i = 0; i < QK; i++) {
                    const int64_t b = (k - nb) * QK + i;
                    mv[i] = b < nb ? half_to_float(load_u16(w + n * row_bytes + b * bsz + 2)) : 0.0f;
                }
                lo = _mm512_load_ps(mv);
                hi = _mm512_load_ps(mv + 16);
            }
            __m512i pl[3], ph[3];
            amx_split(lo, np, pl);
            amx_split(hi, np, ph);
            for (int p = 0; p < np; p++) rows[p][r] = amx_bf16_words(pl[p], ph[p]);
        }
        for (int p = 0; p < np; p++) amx_transpose16(rows[p], (uint32_t *)(wp + (k * np + p) * 512));
    }
}

/* C tile c of rows t*16.., features j*16.. into y: straight when whole, else through a buffer, masked. */
#define QL_AMX_STORE(c, t, j)                                                                                   \
    do {                                                                                                       \
        const int64_t m0 = (t) * 16, n0 = (j) * 16;                                                            \
        if (m0 < M && n0 < N) {                                                                                \
            if (m0 + 16 <= M && n0 + 16 <= N) {                                                                \
                _tile_stored(c, y + m0 * ldy + n0, ldy * 4);                                                   \
            } else {                                                                                           \
                float buf[256] __attribute__((aligned(64)));                                                   \
                _tile_stored(c, buf, 64);                                                                      \
                const __mmask16 keep = (__mmask16)((1u << (N - n0 < 16 ? N - n0 : 16)) - 1u);                  \
                for (int64_t r = 0; r < 16 && m0 + r < M; r++)                                                 \
                    _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, keep, _mm512_load_ps(buf + 16 * r));        \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)

/* Row tiles t0 .. t1-1 against feature tiles j0 .. j1-1 (a multiple of 3): for each row tile, the three
 * pieces of x in tiles 0-2 and three accumulators (tiles 5-7, feature tiles j .. j+2) over every input tile;
 * the pieces of w go to tiles 3 and 4 in turn. (Variants timed no faster here: one w tile, four accumulators;
 * prefetching the next input tile; accumulators kept in L1 across chunks of K. A tile product takes ~8 ns in
 * this loop against 5.2 ns back to back, ~6.4 ns with every tile in L1: the rest is L2 traffic.) */
QL_AMX static void amx_item(const uint16_t *xp, const uint16_t *wp, float *y, int64_t ldy, int64_t M, int64_t N,
                            int64_t kt, int np, int64_t j0, int64_t j1, int64_t t0, int64_t t1) {
    const int64_t xs = 3 * 512, ws = (int64_t)np * 512, wj = kt * ws; /* bf16 per input tile, feature tile */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t j = j0; j < j1; j += 3) {
            const uint16_t *a = xp + t * kt * xs, *b = wp + (j - j0) * wj;
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t k = 0; k < kt; k++, a += xs, b += ws) {
                _tile_loadd(0, a, 64);
                _tile_loadd(1, a + 512, 64);
                _tile_loadd(2, a + 1024, 64);
#define QL_AMX_PIECE(c, bt, src)                                                                               \
    _tile_loadd(bt, src, 64);                                                                                  \
    _tile_dpbf16ps(c, 0, bt);                                                                                  \
    _tile_dpbf16ps(c, 1, bt);                                                                                  \
    _tile_dpbf16ps(c, 2, bt);
                if (np == 2) {
                    QL_AMX_PIECE(5, 3, b)
                    QL_AMX_PIECE(5, 4, b + 512)
                    QL_AMX_PIECE(6, 3, b + wj)
                    QL_AMX_PIECE(6, 4, b + wj + 512)
                    QL_AMX_PIECE(7, 3, b + 2 * wj)
                    QL_AMX_PIECE(7, 4, b + 2 * wj + 512)
                } else {
                    QL_AMX_PIECE(5, 3, b)
                    QL_AMX_PIECE(5, 4, b + 512)
                    QL_AMX_PIECE(5, 3, b + 1024)
                    QL_AMX_PIECE(6, 4, b + wj)
                    QL_AMX_PIECE(6, 3, b + wj + 512)
                    QL_AMX_PIECE(6, 4, b + wj + 1024)
                    QL_AMX_PIECE(7, 3, b + 2 * wj)
                    QL_AMX_PIECE(7, 4, b + 2 * wj + 512)
                    QL_AMX_PIECE(7, 3, b + 2 * wj + 1024)
                }
#undef QL_AMX_PIECE
            }
            QL_AMX_STORE(5, t, j);
            QL_AMX_STORE(6, t, j + 1);
            QL_AMX_STORE(7, t, j + 2);
        }
    }
}

QL_AMX static int linear_amx(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                             int64_t N, int64_t K, int num_threads) {
    const int sums = fmt == QL_Q4_1, np = fmt == QL_Q8_0 ? 3 : 2;
    const int64_t nb = K / QK, kt = nb + (sums ? (nb + QK - 1) / QK : 0), row_bytes = nb * ql_block_bytes(fmt);
    const int64_t mt = (M + 15) / 16, nt = (N + 47) / 48 * 3; /* feature tiles rounded up to a multiple of 3 */
    const int64_t runs = (nt + QL_AMX_NJ - 1) / QL_AMX_NJ, groups = (mt + QL_AMX_MG - 1) / QL_AMX_MG;
    uint16_t *xp = amx_buffer(0, (size_t)(mt * kt * 3 * AMX_TILE_BYTES));
    if (!xp) return QL_ERR_NOMEM;
    int nthr = work_threads(num_threads, M, N, K, runs * groups), failed = 0;
    (void)nthr;
#pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        /* This thread's weights for one run of feature tiles, packed when its items move to another run
         * (items are run-major, so once per run per thread): they stay in its L2 and never go to memory. */
        uint16_t *wp = amx_buffer(1, (size_t)(QL_AMX_NJ * kt * np * AMX_TILE_BYTES));
        int64_t packed = -1;
        if (!wp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < mt; t++) amx_pack_x(x, ldx, M, nb, kt, sums, t, xp);
        amx_configure_tiles();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < runs * groups; item++) {
            if (!wp) continue;
            const int64_t run = item / groups, g = item % groups;
            const int64_t j0 = run * QL_AMX_NJ, j1 = j0 + QL_AMX_NJ < nt ? j0 + QL_AMX_NJ : nt;
            const int64_t t0 = g * QL_AMX_MG, t1 = t0 + QL_AMX_MG < mt ? t0 + QL_AMX_MG : mt;
            if (packed != run) {
                for (int64_t j = j0; j < j1; j++)
                    amx_pack_w(fmt, w, row_bytes, N, nb, kt, np, j, wp + (j - j0) * kt * np * 512);
                packed = run;
            }
            amx_item(xp, wp, y, ldy, M, N, kt, np, j0, j1, t0, t1);
        }
        _tile_release();
        if (wp) amx_buffer_done(1, wp);
    }
    amx_buffer_done(0, xp);
    return failed ? QL_ERR_NOMEM : QL_OK;
}

/* y = x @ W^T on AMX tiles (see the top of this file); QL_ERR_AMX when the CPU or the OS cannot run them. */
int ql_linear_amx(const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M, int64_t N,
                  int64_t K, int fmt, int num_threads) {
    int rc = check_args(ldx, ldy, M, N, K, fmt);
    if (rc != QL_OK || M == 0 || N == 0) return rc;
    if (!ql_amx_ready()) return QL_ERR_AMX;
    return linear_amx(fmt, x, ldx, w, y, ldy, M, N, K, num_threads);
}

#else
int ql_amx_ready(void) { return 0; }
int ql_linear_amx(const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M, int64_t N,
                  int64_t K, int fmt, int num_threads) {
    (void)x, (void)ldx, (void)w, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)fmt, (void)num_threads;
    return QL_ERR_AMX;
}
#endif
