/*
 * Linear layers straight from GGUF block formats: y[M,N] = x[M,K] @ W^T, fp32 activations and sums.
 *
 * W is [N, K] (N output features, K input features), each row stored as K/32 consecutive blocks of
 * 32 weights along K; row n starts at byte n * (K/32) * block_bytes. Block layouts (little-endian):
 *   Q8_0  34 bytes: f16 d, 32 x int8 q                 w[i] = d * q[i]
 *   Q4_0  18 bytes: f16 d, 16 bytes of nibbles         w[i] = d * (q[i] - 8)
 *   Q4_1  20 bytes: f16 d, f16 m, 16 bytes of nibbles  w[i] = d * q[i] + m
 * Nibble order (as deepinfer/engine/gguf.py): byte j's low nibble is element j, its high nibble is
 * element j + 16 (j = 0..15).
 *
 * x rows are ldx floats apart (x[m][k] = x[m * ldx + k], k contiguous); y rows ldy floats apart.
 * ql_linear_f32 dequantises weights in registers (or into a small per-thread tile), never the whole
 * fp32 matrix:
 *   M <= QL_FEW_M: each weight row is read once; the block scale is applied to the block's sum.
 *   M <= QL_SMALL_M (decode): each weight row is read and dequantised once, and all M rows of x are
 *     multiplied against it in registers.
 *   larger M: a tile of QL_NR rows x QL_KC columns of W is dequantised into a per-thread fp32 buffer
 *     (L1-sized), then a 3x4 register-blocked dot-product kernel runs every row of x against it.
 * ql_dequantize_f32 writes fp32 rows for a caller that multiplies them with its own GEMM (the Python
 * wrapper does so for many rows, where torch's AVX-512 GEMM outruns the AVX2 tile kernel).
 * OpenMP over N with an explicit thread count; small problems run on one thread, because forking
 * the team costs microseconds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#else
#define QL_AVX2 0
#endif

#define QK 32

/* Formats and return codes (kept in sync with quant_linear.py). */
#define QL_Q8_0 0
#define QL_Q4_0 1
#define QL_Q4_1 2
#define QL_OK 0
#define QL_ERR_K -1      /* K is not a positive multiple of 32 */
#define QL_ERR_FORMAT -2 /* unknown format code */
#define QL_ERR_SHAPE -3  /* M or N negative, ldx < K or ldy < N */
#define QL_ERR_NOMEM -4

/* Below this many multiply-adds per call stay on one thread. */
#ifndef QL_MIN_PARALLEL_WORK
#define QL_MIN_PARALLEL_WORK (256 * 1024)
#endif
/* Up to this many rows take the decode path (8 accumulators + 4 weight vectors fit in 16 ymm). */
#define QL_SMALL_M 8
/* Up to this many rows take out the block scale after the sum (few_rows). */
#define QL_FEW_M 2
#define QL_NR 16  /* output features per tile of the prefill path */
#define QL_KC 512 /* inputs per tile: 16 x 512 fp32 = 32 KiB */
#define QL_MR 3   /* rows of x per micro-kernel call */

int ql_has_avx2(void) { return QL_AVX2; }
int ql_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int ql_block_bytes(int fmt) {
    switch (fmt) {
    case QL_Q8_0: return 2 + QK;
    case QL_Q4_0: return 2 + QK / 2;
    case QL_Q4_1: return 4 + QK / 2;
    default: return 0;
    }
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2); /* blocks are byte-aligned; GGUF and every supported host are little-endian */
    return v;
}

/* IEEE half to float, exact for every input (subnormals, infinities, NaN payloads). */
static inline float half_to_float(uint16_t h) {
#if QL_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24: exact */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* One block's 32 weights as fp32, the same values as gguf.py's dequantiser (Q4_1: product, then sum). */
static inline void dequant_block_scalar(int fmt, const uint8_t *b, float *out) {
    float d = half_to_float(load_u16(b));
    if (fmt == QL_Q8_0) {
        for (int i = 0; i < QK; i++) out[i] = d * (float)(int8_t)b[2 + i];
    } else if (fmt == QL_Q4_0) {
        for (int i = 0; i < QK / 2; i++) {
            out[i] = d * (float)((b[2 + i] & 0x0f) - 8);
            out[i + QK / 2] = d * (float)((b[2 + i] >> 4) - 8);
        }
    } else {
        float m = half_to_float(load_u16(b + 2));
        for (int i = 0; i < QK / 2; i++) {
            volatile float lo = d * (float)(b[4 + i] & 0x0f), hi = d * (float)(b[4 + i] >> 4); /* no FMA */
            out[i] = lo + m;
            out[i + QK / 2] = hi + m;
        }
    }
}

/* Which element of a block the SIMD path keeps at position p (0..31); see dequant_block. */
static const int32_t Q4_SHIFT[4][8] = {
    {0, 0, 0, 0, 8, 8, 8, 8}, {16, 16, 16, 16, 24, 24, 24, 24}, {4, 4, 4, 4, 12, 12, 12, 12},
    {20, 20, 20, 20, 28, 28, 28, 28}};

static inline int lane_element(int fmt, int p) {
    if (!QL_AVX2 || fmt == QL_Q8_0) return p;
    int j = p >> 3, l = p & 7; /* byte 4 * (l % 4) + shift / 8; high nibble (+16) when shift % 8 */
    return 4 * (l & 3) + Q4_SHIFT[j][l] / 8 + (Q4_SHIFT[j][l] % 8 ? QK / 2 : 0);
}

/* Runs `stmt` with F a compile-time constant equal to fmt, so the always-inline helpers it calls are
 * specialised per format (their format branches fold away). */
#define QL_BY_FORMAT(fmt, stmt)                                                                          \
    do {                                                                                                 \
        if ((fmt) == QL_Q8_0) {                                                                          \
            enum { F = QL_Q8_0 };                                                                        \
            stmt;                                                                                        \
        } else if ((fmt) == QL_Q4_0) {                                                                   \
            enum { F = QL_Q4_0 };                                                                        \
            stmt;                                                                                        \
        } else {                                                                                         \
            enum { F = QL_Q4_1 };                                                                        \
            stmt;                                                                                        \
        }                                                                                                \
    } while (0)

static int work_threads(int num_threads, int64_t M, int64_t N, int64_t K, int64_t items) {
    if (num_threads < 1 || M * N * K < QL_MIN_PARALLEL_WORK) return 1;
    return items < num_threads ? (int)(items > 0 ? items : 1) : num_threads;
}

#if QL_AVX2
/* ------------------------------------------------------------------------------------ */
/* AVX2 + FMA + F16C                                                                    */

#define QL_INLINE static inline __attribute__((always_inline))

/* xp[m][32 b + p] = x[m][32 b + lane_element(fmt, p)]: x in the lane order of the weights. */
static void permute_x(int fmt, const float *x, int64_t ldx, int64_t M, int64_t K, float *xp) {
    int perm[QK];
    for (int p = 0; p < QK; p++) perm[p] = lane_element(fmt, p);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k0 = 0; k0 < K; k0 += QK)
            for (int p = 0; p < QK; p++) xp[m * K + k0 + p] = x[m * ldx + k0 + perm[p]];
}

/* Block b's 32 weights in four vectors, in "lane order": vector j, lane l holds element
 * lane_element(fmt, 8 * j + l). Q8_0 is in element order (one sign-extending shuffle per vector);
 * Q4 nibbles are pulled out of a broadcast 16-byte load with per-lane variable shifts (no shuffle
 * port): lane l of vector j reads dword l % 4, shifted by Q4_SHIFT[j][l]. Callers permute x to
 * match (`permute_x`), since a dot product does not care in which order its terms come. `fmt` is a
 * constant at every call site, so the branches fold away. */
QL_INLINE void block_ints(const int fmt, const uint8_t *b, __m256 q[4]) {
    if (fmt == QL_Q8_0) {
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
        return;
    }
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + (fmt == QL_Q4_0 ? 2 : 4))));
    const __m256i mask = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
    for (int j = 0; j < 4; j++) {
        __m256i qi = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_loadu_si256((const __m256i *)Q4_SHIFT[j])), mask);
        q[j] = _mm256_cvtepi32_ps(fmt == QL_Q4_0 ? _mm256_sub_epi32(qi, eight) : qi);
    }
}

/* The block's weights themselves: d * q (Q8_0, Q4_0 with q - 8), d * q + m (Q4_1; a product then a
 * sum, no FMA, so the values equal the loader's). */
QL_INLINE void dequant_block(const int fmt, const uint8_t *b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
    block_ints(fmt, b, w);
    if (fmt == QL_Q4_1) {
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
        for (int j = 0; j < 4; j++) w[j] = _mm256_add_ps(_mm256_mul_ps(d, w[j]), m);
    } else {
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(d, w[j]);
    }
}

/* The block's weights in element order (for ql_dequantize_f32): Q4 nibbles widened with shuffles. */
QL_INLINE void dequant_block_natural(const int fmt, const uint8_t *b, __m256 w[4]) {
    if (fmt == QL_Q8_0) {
        dequant_block(fmt, b, w); /* its lane order is element order */
        return;
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + (fmt == QL_Q4_0 ? 2 : 4))), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m256i q[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                          _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
    if (fmt == QL_Q4_0) {
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], _mm256_set1_epi32(8))));
    } else {
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
        for (int j = 0; j < 4; j++) w[j] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[j])), m);
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Decode: one weight row (nb blocks) against 2 < mr <= 8 rows of x; y[i * ldy] = row i's dot product.
 * Up to 4 rows get two accumulators each, so the FMA latency chain does not limit them. */
QL_INLINE void small_rows(const int fmt, const int mr, const uint8_t *wrow, int64_t nb, int bsz, const float *x,
                          int64_t ldx, float *y, int64_t ldy) {
    const int A = mr <= 4 ? 2 : 1;
    __m256 acc[QL_SMALL_M][2];
    for (int i = 0; i < mr; i++)
        for (int a = 0; a < A; a++) acc[i][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        dequant_block(fmt, wrow + b * bsz, w);
        const float *xb = x + b * QK;
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < 4; j++)
                acc[i][j % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * ldx + 8 * j), w[j], acc[i][j % A]);
    }
    for (int i = 0; i < mr; i++) {
        __m256 s = acc[i][0];
        for (int a = 1; a < A; a++) s = _mm256_add_ps(s, acc[i][a]);
        y[i * ldy] = hsum8(s);
    }
}

/* One or two rows: the scale comes out of the block's sum, sum_k x_k (d q_k + m) = d (x . q) + m sum_k x_k,
 * which saves the per-weight multiply (and add) of dequantising. xs holds, per row and block, the
 * 8-lane partial sums of x over the block (Q4_1 only). */
QL_INLINE void few_rows(const int fmt, const int mr, const uint8_t *wrow, int64_t nb, int bsz, const float *x,
                        int64_t ldx, const float *xs, int64_t ldxs, float *y, int64_t ldy) {
    __m256 acc[2][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * bsz;
        __m256 q[4];
        block_ints(fmt, blk, q);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
        for (int i = 0; i < mr; i++) {
            const float *xb = x + i * ldx + b * QK;
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], t);
            acc[i][0] = _mm256_fmadd_ps(d, t, acc[i][0]);
            if (fmt == QL_Q4_1)
                acc[i][1] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2))),
                                            _mm256_loadu_ps(xs + i * ldxs + b * 8), acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
}

/* One specialised copy per (format, row count). */
static void few_dispatch(int fmt, int mr, const uint8_t *wrow, int64_t nb, int bsz, const float *x, int64_t ldx,
                         const float *xs, int64_t ldxs, float *y, int64_t ldy) {
    if (mr == 1) QL_BY_FORMAT(fmt, few_rows(F, 1, wrow, nb, bsz, x, ldx, xs, ldxs, y, ldy));
    else QL_BY_FORMAT(fmt, few_rows(F, 2, wrow, nb, bsz, x, ldx, xs, ldxs, y, ldy));
}

_Static_assert(QL_FEW_M == 2 && QL_SMALL_M == 8, "small_dispatch covers 3..8 rows");

static void small_dispatch(int fmt, int mr, const uint8_t *wrow, int64_t nb, int bsz, const float *x, int64_t ldx,
                           float *y, int64_t ldy) {
    switch (mr) {
    case 3: QL_BY_FORMAT(fmt, small_rows(F, 3, wrow, nb, bsz, x, ldx, y, ldy)); break;
    case 4: QL_BY_FORMAT(fmt, small_rows(F, 4, wrow, nb, bsz, x, ldx, y, ldy)); break;
    case 5: QL_BY_FORMAT(fmt, small_rows(F, 5, wrow, nb, bsz, x, ldx, y, ldy)); break;
    case 6: QL_BY_FORMAT(fmt, small_rows(F, 6, wrow, nb, bsz, x, ldx, y, ldy)); break;
    case 7: QL_BY_FORMAT(fmt, small_rows(F, 7, wrow, nb, bsz, x, ldx, y, ldy)); break;
    default: QL_BY_FORMAT(fmt, small_rows(F, 8, wrow, nb, bsz, x, ldx, y, ldy)); break;
    }
}

/* Dequantise W rows [n0, n0 + nr) x inputs [k0, k0 + kc) into tile[QL_NR][kc]; rows past nr are zero. */
static void fill_tile(int fmt, const uint8_t *w, int64_t row_bytes, int bsz, int64_t n0, int nr, int64_t k0,
                      int kc, float *tile) {
    for (int j = 0; j < QL_NR; j++) {
        float *t = tile + (int64_t)j * kc;
        if (j >= nr) {
            memset(t, 0, sizeof(float) * kc);
            continue;
        }
        const uint8_t *blk = w + (n0 + j) * row_bytes + (k0 / QK) * bsz;
        for (int b = 0; b < kc / QK; b++, blk += bsz) {
            __m256 v[4];
            QL_BY_FORMAT(fmt, dequant_block(F, blk, v));
            for (int q = 0; q < 4; q++) _mm256_store_ps(t + b * QK + 8 * q, v[q]);
        }
    }
}

/* y[i][0..3] += dot(x row i, tile rows c0..c0+3) over kc inputs, for QL_MR rows (pointers may
 * repeat a zero row for padding; `nvalid` rows and `ncols` columns are stored). */
static inline void micro_3x4(const float *const xr[QL_MR], const float *tile, int kc, float *y, int64_t ldy,
                             int nvalid, int ncols) {
    const float *t0 = tile, *t1 = tile + kc, *t2 = tile + 2 * kc, *t3 = tile + 3 * kc;
    __m256 acc[QL_MR][4];
    for (int i = 0; i < QL_MR; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int k = 0; k < kc; k += 8) {
        __m256 w0 = _mm256_load_ps(t0 + k), w1 = _mm256_load_ps(t1 + k), w2 = _mm256_load_ps(t2 + k),
               w3 = _mm256_load_ps(t3 + k);
        for (int i = 0; i < QL_MR; i++) {
            __m256 xv = _mm256_loadu_ps(xr[i] + k);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm256_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    for (int i = 0; i < nvalid; i++) {
        __m128 s = hsum8x4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        float *yi = y + i * ldy;
        if (ncols == 4) {
            _mm_storeu_ps(yi, _mm_add_ps(_mm_loadu_ps(yi), s));
        } else {
            float tmp[4];
            _mm_storeu_ps(tmp, s);
            for (int j = 0; j < ncols; j++) yi[j] += tmp[j];
        }
    }
}

/* x must already be in the weights' lane order (permute_x). */
static void linear_avx2_lanes(int fmt, const float *x, int64_t ldx, const float *xs, const uint8_t *w, float *y,
                              int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int bsz = ql_block_bytes(fmt);
    const int64_t nb = K / QK, row_bytes = nb * bsz;
    if (M <= QL_FEW_M) {
        int nt = work_threads(num_threads, M, N, K, N);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t n = 0; n < N; n++)
            few_dispatch(fmt, (int)M, w + n * row_bytes, nb, bsz, x, ldx, xs, K / 4, y + n, ldy);
        return;
    }
    if (M <= QL_SMALL_M) {
        int nt = work_threads(num_threads, M, N, K, N);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t n = 0; n < N; n++) small_dispatch(fmt, (int)M, w + n * row_bytes, nb, bsz, x, ldx, y + n, ldy);
        return;
    }
    static const float zeros[QL_KC] __attribute__((aligned(32)));
    const int64_t tiles = (N + QL_NR - 1) / QL_NR;
    int nt = work_threads(num_threads, M, N, K, tiles);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float tile[QL_NR * QL_KC] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * QL_NR;
            const int nr = N - n0 < QL_NR ? (int)(N - n0) : QL_NR;
            for (int64_t m = 0; m < M; m++) memset(y + m * ldy + n0, 0, sizeof(float) * nr);
            for (int64_t k0 = 0; k0 < K; k0 += QL_KC) {
                const int kc = K - k0 < QL_KC ? (int)(K - k0) : QL_KC; /* a multiple of 32 */
                fill_tile(fmt, w, row_bytes, bsz, n0, nr, k0, kc, tile);
                for (int64_t m0 = 0; m0 < M; m0 += QL_MR) {
                    const int mv = M - m0 < QL_MR ? (int)(M - m0) : QL_MR;
                    const float *xr[QL_MR];
                    for (int i = 0; i < QL_MR; i++) xr[i] = i < mv ? x + (m0 + i) * ldx + k0 : zeros;
                    for (int c = 0; c < nr; c += 4)
                        micro_3x4(xr, tile + (int64_t)c * kc, kc, y + m0 * ldy + n0 + c, ldy, mv,
                                  nr - c < 4 ? nr - c : 4);
                }
            }
        }
    }
}

static int linear_avx2(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K, int num_threads) {
    if (fmt == QL_Q8_0) { /* element order: x as it is */
        linear_avx2_lanes(fmt, x, ldx, NULL, w, y, ldy, M, N, K, num_threads);
        return QL_OK;
    }
    /* One permuted copy of x per call (M x K floats; for Q4_1 on the few-rows path also its block
     * partial sums, M x K/4), against M x N x K multiply-adds. */
    const int sums = fmt == QL_Q4_1 && M <= QL_FEW_M;
    float *xp = aligned_alloc(32, (size_t)((M * (K + (sums ? K / 4 : 0)) * sizeof(float) + 31) / 32 * 32));
    if (!xp) return QL_ERR_NOMEM;
    permute_x(fmt, x, ldx, M, K, xp);
    float *xs = sums ? xp + M * K : NULL;
    for (int64_t i = 0; sums && i < M; i++)
        for (int64_t b = 0; b < K / QK; b++)
            for (int l = 0; l < 8; l++) {
                const float *v = xp + i * K + b * QK + l;
                xs[i * (K / 4) + b * 8 + l] = (v[0] + v[8]) + (v[16] + v[24]);
            }
    linear_avx2_lanes(fmt, xp, K, xs, w, y, ldy, M, N, K, num_threads);
    free(xp);
    return QL_OK;
}
#endif /* QL_AVX2 */

/* ------------------------------------------------------------------------------------ */
/* Portable C: dequantise one weight row into a per-thread buffer, then M dot products.   */

static int linear_portable(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                           int64_t N, int64_t K, int num_threads) {
    const int bsz = ql_block_bytes(fmt);
    const int64_t nb = K / QK, row_bytes = nb * bsz;
    int nt = work_threads(num_threads, M, N, K, N), failed = 0;
    (void)nt; /* unused in a build without OpenMP */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *row = malloc(sizeof(float) * K);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!row) continue;
            for (int64_t b = 0; b < nb; b++) dequant_block_scalar(fmt, w + n * row_bytes + b * bsz, row + b * QK);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * ldx;
                float s = 0.0f;
                for (int64_t k = 0; k < K; k++) s += xm[k] * row[k];
                y[m * ldy + n] = s;
            }
        }
        free(row);
    }
    return failed ? QL_ERR_NOMEM : QL_OK;
}

static int check_args(int64_t ldx, int64_t ldy, int64_t M, int64_t N, int64_t K, int fmt) {
    if (K <= 0 || K % QK) return QL_ERR_K;
    if (ql_block_bytes(fmt) == 0) return QL_ERR_FORMAT;
    if (M < 0 || N < 0 || (M > 1 && ldx < K) || (M > 1 && ldy < N)) return QL_ERR_SHAPE;
    return QL_OK;
}

/* y[M,N] (row stride ldy) = x[M,K] (row stride ldx) @ W^T, W [N,K] in format `fmt` (see the top). */
int ql_linear_f32(const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M, int64_t N,
                  int64_t K, int fmt, int num_threads) {
    int rc = check_args(ldx, ldy, M, N, K, fmt);
    if (rc != QL_OK || M == 0 || N == 0) return rc;
#if QL_AVX2
    return linear_avx2(fmt, x, ldx, w, y, ldy, M, N, K, num_threads);
#else
    return linear_portable(fmt, x, ldx, w, y, ldy, M, N, K, num_threads);
#endif
}

/* out[N][K] = W as fp32, the same values as gguf.py's dequantiser (for a caller that runs its own GEMM on
 * a chunk of rows: w points at the chunk's first row). */
int ql_dequantize_f32(const uint8_t *w, float *out, int64_t N, int64_t K, int fmt, int num_threads) {
    int rc = check_args(K, N, 1, N, K, fmt);
    if (rc != QL_OK) return rc;
    const int bsz = ql_block_bytes(fmt);
    const int64_t nb = N * (K / QK);
    int nt = work_threads(num_threads, 1, nb, 64 * QK, nb); /* ~64 multiply-adds' worth per weight */
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t b = 0; b < nb; b++) {
#if QL_AVX2
        __m256 v[4];
        QL_BY_FORMAT(fmt, dequant_block_natural(F, w + b * bsz, v));
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + b * QK + 8 * j, v[j]);
#else
        dequant_block_scalar(fmt, w + b * bsz, out + b * QK);
#endif
    }
    return QL_OK;
}

/* The portable path on any build (for tests: the two must agree). */
int ql_linear_f32_portable(const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                           int64_t N, int64_t K, int fmt, int num_threads) {
    int rc = check_args(ldx, ldy, M, N, K, fmt);
    if (rc != QL_OK || M == 0 || N == 0) return rc;
    return linear_portable(fmt, x, ldx, w, y, ldy, M, N, K, num_threads);
}
