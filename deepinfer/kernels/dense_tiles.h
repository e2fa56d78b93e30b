/*
 * Register tiles of the fp32 few-rows linear kernel (dense_linear.c), shared with quant_linear.c, which runs
 * them on weight rows it has dequantised. See dense_linear.c for the design and the batch-invariance
 * argument: lane l of an accumulator sums the products at k = l, l + V, ... in order, and the NACC
 * accumulators of a tile are reduced by one fixed transpose-and-add pattern.
 *
 * Include after <immintrin.h> (x86-64 GCC/Clang). Defines, with DL_X86: tile512 (AVX-512F, compiled by
 * target attribute, so the including file needs no -mavx512f and must check the CPU at run time), and with
 * DL_AVX2 (AVX2 + FMA at compile time): tile256; and DL_GROUP_TILES (16 rows) and DL_GROUP_TILES8 (AVX2's 8),
 * the order of tiles over a weight-row group.
 */
#ifndef DEEPINFER_DENSE_TILES_H
#define DEEPINFER_DENSE_TILES_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DL_X86 1
#else
#define DL_X86 0
#endif
#if DL_X86 && defined(__AVX2__) && defined(__FMA__)
#define DL_AVX2 1
#else
#define DL_AVX2 0
#endif

/* Software prefetch distance along the weight stream (bytes). */
#ifndef DL_PF_BYTES
#define DL_PF_BYTES 4096
#endif

#ifndef DL_PF_HINT
#define DL_PF_HINT 2
#endif

#define DL_INLINE static inline __attribute__((always_inline))

/* Calls tile(MR, RR, i, r) for every tile of weight-row group g (NACC rows from n = g * NACC): blocks of
 * 4 x rows with 4 x 4 tiles (each 4-row slice of W stays in L1 across the blocks), then a 2-row block
 * with 2 x 8 tiles, then a last row with one 1 x 16 tile. */
#define DL_GROUP_TILES(NACC, M, TILE)                                                                   \
    do {                                                                                                \
        const int64_t m4 = (M) / 4 * 4;                                                                 \
        for (int r = 0; r < (NACC); r += (NACC) / 4)                                                    \
            for (int64_t i = 0; i < m4; i += 4) TILE(4, (NACC) / 4, i, r);                              \
        int64_t i = m4;                                                                                 \
        if ((M) - i >= 2) {                                                                             \
            for (int r = 0; r < (NACC); r += (NACC) / 2) TILE(2, (NACC) / 2, i, r);                     \
            i += 2;                                                                                     \
        }                                                                                               \
        if ((M) - i == 1) TILE(1, (NACC), i, 0);                                                        \
    } while (0)

/* AVX2's order: blocks of 6 x rows with 6 x 2 tiles (12 accumulators), then the last 3..5 rows in one
 * block of MR x 2 tiles, or 2 rows with 2 x 4 tiles, or 1 row with one 1 x 8 tile. */
#define DL_GROUP_TILES8(M, TILE)                                                                        \
    do {                                                                                                \
        const int64_t m6 = (M) / 6 * 6, rest = (M) - m6;                                                \
        for (int r = 0; r < 8; r += 2)                                                                  \
            for (int64_t i = 0; i < m6; i += 6) TILE(6, 2, i, r);                                       \
        switch (rest) {                                                                                 \
        case 5: for (int r = 0; r < 8; r += 2) TILE(5, 2, m6, r); break;                                \
        case 4: for (int r = 0; r < 8; r += 2) TILE(4, 2, m6, r); break;                                \
        case 3: for (int r = 0; r < 8; r += 2) TILE(3, 2, m6, r); break;                                \
        case 2: for (int r = 0; r < 8; r += 4) TILE(2, 4, m6, r); break;                                \
        case 1: TILE(1, 8, m6, 0); break;                                                               \
        default: break;                                                                                 \
        }                                                                                               \
    } while (0)

#if DL_X86
#define DL_512 __attribute__((target("avx512f,avx2,fma")))

/* s lane t = sum of a[t]'s 16 lanes, the same pattern for every t (see the top of the file). */
DL_512 DL_INLINE __m512 reduce16(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int p = 0; p < 8; p++)
        t[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    for (int q = 0; q < 4; q++)
        u[q] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * q], t[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * q], t[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* MR rows of x (from x + i * ldx) against RR rows of W (from w + n * K), MR * RR = 16. Rows of W past
 * N - 1 read row N - 1 again and their outputs are not stored. */
DL_512 DL_INLINE void tile512(const int MR, const int RR, const float *x, int64_t ldx, const float *w, float *y,
                              int64_t ldy, int64_t K, int64_t N, int64_t M, int64_t i, int64_t n, int prefetch) {
    const float *xr[4], *wr[16];
    for (int a = 0; a < MR; a++) xr[a] = x + (i + a) * ldx;
    for (int r = 0; r < RR; r++) wr[r] = w + (n + r < N ? n + r : N - 1) * K;
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    /* The tile's RR rows are RR * K contiguous floats, and the next tile's follow them: a pointer
     * DL_PF_BYTES ahead of the stream moves RR lines a step (first x block only; later ones hit L1). */
    const char *pf = (const char *)wr[0] + (M > 4 ? (int64_t)RR * K * 4 : DL_PF_BYTES);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (DL_PF_BYTES && prefetch) {
            for (int r = 0; r < RR; r++) __builtin_prefetch(pf + 64 * r, 0, DL_PF_HINT);
            pf += 64 * RR;
        }
        __m512 wv[16];
        for (int r = 0; r < RR; r++) wv[r] = _mm512_loadu_ps(wr[r] + k);
        for (int a = 0; a < MR; a++) {
            const __m512 xv = _mm512_loadu_ps(xr[a] + k);
            for (int r = 0; r < RR; r++) acc[a * RR + r] = _mm512_fmadd_ps(xv, wv[r], acc[a * RR + r]);
        }
    }
    if (k < K) {
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[16];
        for (int r = 0; r < RR; r++) wv[r] = _mm512_maskz_loadu_ps(mask, wr[r] + k);
        for (int a = 0; a < MR; a++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[a] + k);
            for (int r = 0; r < RR; r++) acc[a * RR + r] = _mm512_fmadd_ps(xv, wv[r], acc[a * RR + r]);
        }
    }
    float s[16];
    _mm512_storeu_ps(s, reduce16(acc));
    const int valid = N - n < RR ? (int)(N - n) : RR;
    for (int a = 0; a < MR; a++)
        for (int r = 0; r < valid; r++) y[(i + a) * ldy + n + r] = s[a * RR + r];
}

#endif /* DL_X86 */

#if DL_AVX2
static const int32_t dl_tail_masks[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

DL_INLINE __m256 reduce8(const __m256 a[8]) {
    __m256 t[4], u[2];
    for (int p = 0; p < 4; p++)
        t[p] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm256_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    for (int q = 0; q < 2; q++)
        u[q] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * q], t[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(t[2 * q], t[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

/* 4 accumulators' sums, each added in exactly reduce8's pattern (so a 6 x 2 tile's last 4 outputs are the
 * bits any other tile gives them). */
DL_INLINE __m128 reduce4(const __m256 a[4]) {
    __m256 t[2];
    for (int p = 0; p < 2; p++)
        t[p] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm256_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* MR rows of x times RR rows of W, MR * RR <= 12 with MR <= 6; accumulators past MR * RR stay zero and are
 * not stored. */
DL_INLINE void tile256(const int MR, const int RR, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy,
                       int64_t K, int64_t N, int64_t M, int64_t i, int64_t n, int prefetch) {
    const float *xr[6], *wr[8];
    for (int a = 0; a < MR; a++) xr[a] = x + (i + a) * ldx;
    for (int r = 0; r < RR; r++) wr[r] = w + (n + r < N ? n + r : N - 1) * K;
    __m256 acc[12];
    for (int t = 0; t < 12; t++) acc[t] = _mm256_setzero_ps();
    /* As tile512: a pointer ahead of the stream moves the RR rows' 32 * RR bytes a step, one line per two
     * rows (first x block only). Without it the weight stream and the FMAs did not overlap at a few rows:
     * on the 2-core AVX2 VM, 4 rows of SmolLM2's projections took what reading them plus computing them
     * alone take end to end. */
    const char *pf = (const char *)wr[0] + (M > 4 ? (int64_t)RR * K * 4 : DL_PF_BYTES);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (DL_PF_BYTES && prefetch) {
            for (int r = 0; r < RR; r += 2) __builtin_prefetch(pf + 32 * r, 0, DL_PF_HINT);
            pf += 32 * RR;
        }
        __m256 wv[8];
        for (int r = 0; r < RR; r++) wv[r] = _mm256_loadu_ps(wr[r] + k);
        for (int a = 0; a < MR; a++) {
            const __m256 xv = _mm256_loadu_ps(xr[a] + k);
            for (int r = 0; r < RR; r++) acc[a * RR + r] = _mm256_fmadd_ps(xv, wv[r], acc[a * RR + r]);
        }
    }
    if (k < K) {
        const __m256i mask = _mm256_loadu_si256((const __m256i *)(dl_tail_masks + 8 - (K - k)));
        __m256 wv[8];
        for (int r = 0; r < RR; r++) wv[r] = _mm256_maskload_ps(wr[r] + k, mask);
        for (int a = 0; a < MR; a++) {
            const __m256 xv = _mm256_maskload_ps(xr[a] + k, mask);
            for (int r = 0; r < RR; r++) acc[a * RR + r] = _mm256_fmadd_ps(xv, wv[r], acc[a * RR + r]);
        }
    }
    float s[12];
    _mm256_storeu_ps(s, reduce8(acc));
    if (MR * RR > 8) _mm_storeu_ps(s + 8, reduce4(acc + 8));
    const int valid = N - n < RR ? (int)(N - n) : RR;
    for (int a = 0; a < MR; a++)
        for (int r = 0; r < valid; r++) y[(i + a) * ldy + n + r] = s[a * RR + r];
}

#endif /* DL_AVX2 */

#endif /* DEEPINFER_DENSE_TILES_H */
