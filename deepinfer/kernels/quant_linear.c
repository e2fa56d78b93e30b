/*
 * Linear layers straight from GGUF block formats: y[M,N] = x[M,K] @ W^T, fp32 activations and sums.
 *
 * W is [N, K] (N output features, K input features), each row stored as K/32 consecutive blocks of
 * 32 weights along K; row n starts at byte n * (K/32) * block_bytes. Block layouts (little-endian):
 *   Q8_0  34 bytes: f16 d, 32 x int8 q                 w[i] = d * q[i]
 *   Q4_0  18 bytes: f16 d, 16 bytes of nibbles         w[i] = d * (q[i] - 8)
 *   Q4_1  20 bytes: f16 d, f16 m, 16 bytes of nibbles  w[i] = d * q[i] + m
 * Nibble order (as deepinfer/loading/gguf.py): byte j's low nibble is element j, its high nibble is
 * element j + 16 (j = 0..15).
 *
 * x rows are ldx floats apart (x[m][k] = x[m * ldx + k], k contiguous); y rows ldy floats apart.
 * ql_linear_f32 dequantises weights in registers (or into a small per-thread tile), never the whole
 * fp32 matrix:
 *   M <= QL_FEW_M (decode): each weight row is read once and its integer weights converted to fp32
 *     and multiplied with x; the block scale is applied to the block's sum (and Q4_1's minimum to a
 *     precomputed block sum of x). Several weight rows go together, so each x load serves them all.
 *   M <= QL_SMALL_M: each weight row is read and dequantised once, and all M rows of x are
 *     multiplied against it in registers.
 *   larger M: a tile of QL_NR rows x QL_KC columns of W is dequantised into a per-thread fp32 buffer
 *     (L1-sized), then a 3x4 register-blocked dot-product kernel runs every row of x against it.
 * ql_linear_amx (quant_amx.h, included at the end) runs many rows on AMX tiles with exact fp32 products,
 * where the CPU has AMX-BF16. ql_dequantize_f32 writes fp32 rows for a caller that multiplies them with its
 * own GEMM (the Python wrapper does so for many rows without AMX, where torch's AVX-512 GEMM outruns the
 * AVX2 tile kernel).
 * OpenMP over N with an explicit thread count; problems under QL_MIN_PARALLEL_WORK multiply-adds run
 * on one thread, because waking and joining the team costs ~1 us. The decode paths (M <= QL_SMALL_M)
 * give each thread one contiguous run of whole weight-row groups, so every output is summed in the
 * same order, to the same bits, whatever the thread count. In a process that has loaded torch first,
 * the library's libgomp.so.1 resolves to torch's copy (same soname): one OpenMP runtime, and calls
 * from the thread that runs torch's ops reuse torch's team.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#include "dense_tiles.h"
#define QL_512 __attribute__((target("avx512f,avx2,fma,f16c")))
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
#define QL_ERR_AMX -5     /* no AMX tiles on this CPU, or the OS refused them */

/* Below this many multiply-adds per call stay on one thread: waking the team and joining it costs
 * ~1 us (libgomp, threads still spinning from the previous parallel region), which one-row decode
 * work recovers from ~32K multiply-adds on (measured: Q4_1 K=576, N=32 1.1 -> 1.25 us on 2 threads,
 * N=64 2.0 -> 1.7 us, N=128 3.7 -> 2.6 us). */
#ifndef QL_MIN_PARALLEL_WORK
#define QL_MIN_PARALLEL_WORK (64 * 1024)
#endif
/* Up to this many rows take small_rows (8 accumulators + 4 weight vectors fit in 16 ymm), and up to
 * QL_FEW_M of them dot_rows instead. Measured (Q4_1 576 x 576, one thread, 30 layers' weights): 2 rows
 * dot_rows 26.0 us, small_rows 29.3; 3 rows dot_rows 34.2, small_rows 36.6, tiles 42.0; 4 rows dot_rows
 * and small_rows 44 (tiles 61); 8 rows small_rows 71.7, tiles 79.9. */
/* The decode paths prefetch the weight stream QL_PF_BYTES ahead into all cache levels (hint 3).
 * Without it the loads wait on memory and the dequantising arithmetic does not overlap them: one
 * thread read 5.5 GB/s of packed weights from memory against 11 from cache. Measured on SmolLM2's
 * 121 products per token (Q4_1 + Q8_0 LM head, 97 MB, 2 threads): none 9.7 ms, 1 KiB ahead 6.5,
 * 4 KiB 5.8, 8 KiB 6.2, 32 KiB 6.7; the non-temporal hint (0) was no faster than none. */
#ifndef QL_PF_BYTES
#define QL_PF_BYTES 4096
#endif
#ifndef QL_PF_HINT
#define QL_PF_HINT 3
#endif
#define QL_SMALL_M 8
/* Up to this many rows of x, on a CPU with AVX-512F, the group path (see groups512); from the next, the
 * caller dequantises and runs torch's GEMM, which wins once x no longer fits in L2 (SmolLM2's 210 Q4_1/Q8_0
 * products, 2 threads: 256 rows 311 ms against 350, 384 rows 495 against 413). */
#define QL_GROUP_MAX_M 256
#define QL_FEW_M 3
#define QL_NR 16  /* output features per tile of the prefill path */
#define QL_KC 512 /* inputs per tile: 16 x 512 fp32 = 32 KiB */
#define QL_MR 3   /* rows of x per micro-kernel call */

int ql_has_avx2(void) { return QL_AVX2; }

/* The most rows of x the AVX-512 group path takes on this CPU (0: none). */
int ql_group_max_m(void) {
#if QL_AVX2
    return __builtin_cpu_supports("avx512f") ? QL_GROUP_MAX_M : 0;
#else
    return 0;
#endif
}

/* Up to this many rows of x on a CPU with AVX2 but no AVX-512, the kernel (tiles_avx2 from 9 rows) beats the
 * caller's dequantise + torch GEMM, whose fp32 rate is then the same AVX2 FMAs: on SmolLM2's Q4_1/Q8_0
 * products, 2 threads, the 2-core Zen 3 VM, kernel / GEMM time 0.26 at 16 rows, 0.36 at 32, 0.49 at 64, 0.96
 * at 128, 1.00 at 160, 1.13 at 256, 1.25 at 1,024 (the GEMM path dequantises W afresh every call). */
#define QL_AVX2_MAX_M 128

/* The caller's GEMM crossover: the most rows of x the kernel should take on this CPU (0: the caller's own
 * default). */
int ql_kernel_max_m(void) {
#if QL_AVX2
    return __builtin_cpu_supports("avx512f") ? QL_GROUP_MAX_M : QL_AVX2_MAX_M;
#else
    return 0;
#endif
}
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

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Block b's 32 integer weights as fp32 in element order: q[j] lane l is element 8 j + l (Q4_0 already
 * minus 8). Bytes are zero- or sign-extended to 32-bit lanes straight from memory (a shuffle-port
 * op each); a Q4 byte j holds elements j (low nibble) and j + 16 (high nibble), so after widening a
 * mask gives one and a shift by 4 the other, with no cross-lane work. `fmt` is a constant at every
 * call site, so the branches fold away. */
QL_INLINE void block_ints(const int fmt, const uint8_t *b, __m256 q[4]) {
    if (fmt == QL_Q8_0) {
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
        return;
    }
    const uint8_t *nib = b + (fmt == QL_Q4_0 ? 2 : 4);
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)nib));       /* bytes 0-7 */
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nib + 8))); /* bytes 8-15 */
    const __m256i mask = _mm256_set1_epi32(0x0f);
    __m256i qi[4] = {_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask), _mm256_srli_epi32(lo, 4),
                     _mm256_srli_epi32(hi, 4)};
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(fmt == QL_Q4_0 ? _mm256_sub_epi32(qi[j], _mm256_set1_epi32(8)) : qi[j]);
}

/* The block's weights themselves, in element order: d * q (Q8_0, Q4_0 with q - 8), d * q + m (Q4_1;
 * a product then a sum, no FMA, so the values equal the loader's). */
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

/* Decode, few rows of x: R consecutive weight rows (row_bytes apart) against MR rows of x. The block
 * scale comes out of each block's sum, sum_k x_k (d q_k + m) = d (x . q) + m sum_k x_k, which saves
 * dequantising (a multiply, and an add for Q4_1, per weight), and each x load serves R weight rows.
 * xs[i * ldxs + b] = sum of x row i over block b (Q4_1 only). y[i * ldy + r] = x row i . W row r.
 * The R rows' f16 scale words are converted together: dm lane 2r = d of row r, lane 2r + 1 = m (Q4_1;
 * for the other formats it is the first quant byte pair read as f16 and never used), so the m terms
 * of all R rows take one FMA per block, summed in the odd lanes of macc[i].
 * Bound (one row of x, Q4_1): per block and weight row, 2 widening loads (shuffle port), 2 ands, 2
 * shifts, 4 int -> fp32 conversions, 4 multiply/FMAs and the scale FMA: ~11 ops for the two vector
 * ALU ports that do conversions, shifts and FMAs, so ~5.5 cycles per 20-byte block: measured ~12 GB/s
 * of packed weights per core here, about 23 on 2 threads against a ~28 GB/s streaming read from
 * memory. A 16-lane AVX-512 version (nibbles looked up as floats with vpermps, which reads only an
 * index's low 4 bits; scales gathered 16 blocks at a time and fed to the FMAs as memory broadcasts) was
 * bound by the shuffle port at ~3.5 cycles per block and weight row: 10-27% faster than this on the
 * Q4_1 layers alone and 1.2x on the Q8_0 LM head, but batch-1 decode in the engine ran 4% slower
 * (100-104 against 107-109 tok/s, alternated), the rest of each step slowing under 512-bit FMAs. */
QL_INLINE void dot_rows(const int fmt, const int MR, const int R, const uint8_t *w, int64_t row_bytes, int64_t nb,
                        const float *x, int64_t ldx, const float *xs, int64_t ldxs, float *y, int64_t ldy) {
    const int bsz = fmt == QL_Q8_0 ? 34 : fmt == QL_Q4_0 ? 18 : 20;
    __m256 acc[3][4], macc[3]; /* [MR][R], MR <= 3, R <= 4 */
    for (int i = 0; i < MR; i++) {
        macc[i] = _mm256_setzero_ps();
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    }
    /* Software prefetch of the weight rows QL_PF_BYTES ahead, two lines per block step (the R rows
     * take at most 4 x 20 or 2 x 34 bytes a step, so the stream is covered). */
    const int64_t group = R * row_bytes;
    const uint8_t *pf = w + (QL_PF_BYTES + group - 1) / group * group;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bsz;
        if (QL_PF_BYTES) {
            __builtin_prefetch(pf + 128 * b, 0, QL_PF_HINT);
            __builtin_prefetch(pf + 128 * b + 64, 0, QL_PF_HINT);
        }
        __m128i words = _mm_cvtsi32_si128((int)load_u32(blk));
        if (R > 1) words = _mm_insert_epi32(words, (int)load_u32(blk + row_bytes), 1);
        if (R > 2) words = _mm_insert_epi32(words, (int)load_u32(blk + 2 * row_bytes), 2);
        if (R > 3) words = _mm_insert_epi32(words, (int)load_u32(blk + 3 * row_bytes), 3);
        const __m256 dm = _mm256_cvtph_ps(words);
        for (int r = 0; r < R; r++) {
            __m256 q[4];
            block_ints(fmt, blk + r * row_bytes, q);
            const __m256 d = _mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(2 * r));
            for (int i = 0; i < MR; i++) {
                const float *xb = x + i * ldx + b * QK;
                __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), q[0]);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q[1], t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q[2], t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q[3], t);
                acc[i][r] = _mm256_fmadd_ps(d, t, acc[i][r]);
            }
        }
        if (fmt == QL_Q4_1)
            for (int i = 0; i < MR; i++)
                macc[i] = _mm256_fmadd_ps(dm, _mm256_broadcast_ss(xs + i * ldxs + b), macc[i]);
    }
    for (int i = 0; i < MR; i++) {
        float m[8];
        _mm256_storeu_ps(m, macc[i]);
        if (R == 4) {
            const __m128 mv = _mm_setr_ps(m[1], m[3], m[5], m[7]);
            __m128 s = hsum8x4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
            _mm_storeu_ps(y + i * ldy, fmt == QL_Q4_1 ? _mm_add_ps(s, mv) : s);
        } else {
            for (int r = 0; r < R; r++) y[i * ldy + r] = hsum8(acc[i][r]) + (fmt == QL_Q4_1 ? m[2 * r + 1] : 0.0f);
        }
    }
}

/* Decode, more rows of x: one weight row (nb blocks) dequantised once and multiplied against
 * QL_FEW_M < mr <= QL_SMALL_M rows of x in registers; y[i * ldy] = row i's dot product. Up to 4 rows
 * get two accumulators each, so the FMA latency chain does not limit them. */
QL_INLINE void small_rows(const int fmt, const int mr, const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx,
                          float *y, int64_t ldy) {
    const int bsz = fmt == QL_Q8_0 ? 34 : fmt == QL_Q4_0 ? 18 : 20;
    const int A = mr <= 4 ? 2 : 1;
    __m256 acc[QL_SMALL_M][2];
    for (int i = 0; i < mr; i++)
        for (int a = 0; a < A; a++) acc[i][a] = _mm256_setzero_ps();
    const uint8_t *pf = wrow + QL_PF_BYTES; /* see dot_rows; a block is at most 34 bytes, so one line a step */
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        if (QL_PF_BYTES) __builtin_prefetch(pf + 64 * b, 0, QL_PF_HINT);
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

/* Output features [n0, n1) of the decode paths (M <= QL_SMALL_M), on one thread. dot_rows takes
 * QL_DOT_R(fmt, M) weight rows at a time, the last few one at a time: for two or three rows of x 2
 * (the accumulators fill the 16 ymm registers); for one, 4 for Q4 and 2 for Q8_0, whose sign-extending
 * loads already keep the shuffle port busy (measured on the 49152 x 576 LM head, one thread: 4 rows
 * 1.78 ms, 2 rows 1.65 ms, 1 row 1.64 ms; Q4_1 576 x 576 is ~5% faster with 4 than with 2). */
#define QL_DOT_R(fmt, M) ((M) == 1 ? ((fmt) == QL_Q8_0 ? 2 : 4) : 2)

static void decode_range(int fmt, const float *x, int64_t ldx, const float *xs, const uint8_t *w, float *y,
                         int64_t ldy, int64_t M, int64_t K, int64_t n0, int64_t n1) {
    const int bsz = ql_block_bytes(fmt);
    const int64_t nb = K / QK, row_bytes = nb * bsz, ldxs = nb;
    if (M > QL_FEW_M) {
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = w + n * row_bytes;
            float *yn = y + n;
            switch (M) {
#define QL_SMALL_CASE(mr)                                                                                        \
    case mr: QL_BY_FORMAT(fmt, small_rows(F, mr, wr, nb, x, ldx, yn, ldy)); break;
                QL_SMALL_CASE(4) QL_SMALL_CASE(5) QL_SMALL_CASE(6) QL_SMALL_CASE(7)
                default: QL_BY_FORMAT(fmt, small_rows(F, 8, wr, nb, x, ldx, yn, ldy)); break;
#undef QL_SMALL_CASE
            }
        }
        return;
    }
    const int R = QL_DOT_R(fmt, M);
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
        const uint8_t *wn = w + n * row_bytes;
        if (R == 4) QL_BY_FORMAT(fmt, dot_rows(F, 1, 4, wn, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
        else if (M == 1) QL_BY_FORMAT(fmt, dot_rows(F, 1, 2, wn, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
        else if (M == 2) QL_BY_FORMAT(fmt, dot_rows(F, 2, 2, wn, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
        else QL_BY_FORMAT(fmt, dot_rows(F, 3, 2, wn, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
    }
    for (; n < n1; n++) {
        if (M == 1) QL_BY_FORMAT(fmt, dot_rows(F, 1, 1, w + n * row_bytes, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
        else if (M == 2) QL_BY_FORMAT(fmt, dot_rows(F, 2, 1, w + n * row_bytes, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
        else QL_BY_FORMAT(fmt, dot_rows(F, 3, 1, w + n * row_bytes, row_bytes, nb, x, ldx, xs, ldxs, y + n, ldy));
    }
}

_Static_assert(QL_FEW_M == 3 && QL_SMALL_M == 8, "decode_range covers 1..3 (dot_rows) and 4..8 rows");

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

/* Many rows: tiles of QL_NR output features, each dequantised a QL_KC slice at a time. */
static void tiles_avx2(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K, int num_threads) {
    static const float zeros[QL_KC] __attribute__((aligned(32)));
    const int bsz = ql_block_bytes(fmt);
    const int64_t row_bytes = K / QK * bsz, tiles = (N + QL_NR - 1) / QL_NR;
    int nt = work_threads(num_threads, M, N, K, tiles);
    (void)nt;
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

/* ------------------------------------------------------------------------------------ */
/* AVX-512F, 4..QL_GROUP_MAX_M rows: dequantise 16 weight rows, then dense_tiles.h's tiles. */

/* From QL_FEW_M + 1 to QL_GROUP_MAX_M rows of x, on a CPU with AVX-512F, the weight rows are dequantised 16 at
 * a time into a per-thread buffer (16 x K floats, L1/L2-resident) and multiplied with the fp32 kernel's register
 * tiles (dense_tiles.h: 4 x 4 blocks of x rows by weight rows, then 2 x 8 and 1 x 16 for the last rows). The
 * dequantised values are the loader's, so each output is what dense_linear.c computes on the fp32 weights,
 * the same bits whatever M (in that range) and the thread count. Measured on SmolLM2's 210 Q4_1/Q8_0 products,
 * 2 threads, against the AVX2 paths below 32 rows and dequantise + torch GEMM from 32: 8 rows 21.6 -> 14.8 ms,
 * 17 rows 45.1 -> 26.6, 32 rows 58.2 -> 43.5, 128 rows 166 -> 158. */

/* One block's 32 weights as two vectors of 16, in element order (see block_ints), the loader's values:
 * d * q is exact in fp32 (an 11-bit mantissa times a 4- or 8-bit integer), so adding Q4_1's m after it
 * rounds once, as the loader's product-then-sum does. */
QL_512 QL_INLINE void dequant_block512(const int fmt, const uint8_t *b, float *out) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
    __m512 q0, q1;
    if (fmt == QL_Q8_0) {
        q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
        q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
    } else {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (fmt == QL_Q4_0 ? 2 : 4))));
        __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(v, 4);
        if (fmt == QL_Q4_0) {
            lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
            hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
        }
        q0 = _mm512_cvtepi32_ps(lo);
        q1 = _mm512_cvtepi32_ps(hi);
    }
    __m512 w0 = _mm512_mul_ps(d, q0), w1 = _mm512_mul_ps(d, q1);
    if (fmt == QL_Q4_1) {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(b + 2)));
        w0 = _mm512_add_ps(w0, m);
        w1 = _mm512_add_ps(w1, m);
    }
    _mm512_store_ps(out, w0);
    _mm512_store_ps(out + 16, w1);
}

/* Weight-row groups [g0, g1) (16 rows each from row 16 g) on one thread, buf: 16 x K floats, 64-byte aligned. */
QL_512 static void groups_range512(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy,
                                   int64_t M, int64_t N, int64_t K, int64_t g0, int64_t g1, float *buf) {
    const int bsz = ql_block_bytes(fmt);
    const int64_t nb = K / QK, row_bytes = nb * bsz;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = 16 * g, nr = N - n0 < 16 ? N - n0 : 16;
        const uint8_t *wg = w + n0 * row_bytes;
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *row = wg + r * row_bytes;
            float *out = buf + r * K;
            for (int64_t b = 0; b < nb; b++) {
                if (QL_PF_BYTES) __builtin_prefetch(row + b * bsz + QL_PF_BYTES, 0, QL_PF_HINT);
                QL_BY_FORMAT(fmt, dequant_block512(F, row + b * bsz, out + b * QK));
            }
        }
        float *yg = y + n0;
#define QL_TILE512(MR, RR, i, r) tile512(MR, RR, x, ldx, buf, yg, ldy, K, nr, M, i, (r), 0)
        DL_GROUP_TILES(16, M, QL_TILE512);
#undef QL_TILE512
    }
}

static int groups512(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                     int64_t N, int64_t K, int num_threads) {
    const int64_t groups = (N + 15) / 16;
    int nt = work_threads(num_threads, M, N, K, groups), failed = 0;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int64_t t = 0, T = 1;
#endif
        float *buf = aligned_alloc(64, sizeof(float) * 16 * K); /* K is a multiple of 32: a multiple of 64 bytes */
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else {
            groups_range512(fmt, x, ldx, w, y, ldy, M, N, K, groups * t / T, groups * (t + 1) / T, buf);
            free(buf);
        }
    }
    return failed ? QL_ERR_NOMEM : QL_OK;
}

/* Block sums of x for the Q4_1 decode path stay on the stack up to this many floats. */
#define QL_XS_STACK 4096

static int linear_avx2(int fmt, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K, int num_threads) {
    if (M > QL_FEW_M && M <= QL_GROUP_MAX_M && __builtin_cpu_supports("avx512f"))
        return groups512(fmt, x, ldx, w, y, ldy, M, N, K, num_threads);
    if (M > QL_SMALL_M) {
        tiles_avx2(fmt, x, ldx, w, y, ldy, M, N, K, num_threads);
        return QL_OK;
    }
    /* xs[i * nb + b]: the sum of x row i over block b, for the Q4_1 m terms (O(M K) against M N K). */
    const int64_t nb = K / QK;
    const int sums = fmt == QL_Q4_1 && M <= QL_FEW_M;
    float xs_stack[QL_XS_STACK], *xs = NULL;
    if (sums) {
        xs = M * nb <= QL_XS_STACK ? xs_stack : malloc(sizeof(float) * M * nb);
        if (!xs) return QL_ERR_NOMEM;
        for (int64_t i = 0; i < M; i++)
            for (int64_t b = 0; b < nb; b++) {
                const float *v = x + i * ldx + b * QK;
                __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
                xs[i * nb + b] = hsum8(s);
            }
    }
    /* Threads split N into equal runs of whole R-row groups (one contiguous stretch of W each). */
    const int64_t R = M <= QL_FEW_M ? QL_DOT_R(fmt, M) : 1, groups = (N + R - 1) / R;
    int nt = work_threads(num_threads, M, N, K, groups);
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int64_t t = 0, T = 1;
#endif
        const int64_t n0 = groups * t / T * R, n1 = groups * (t + 1) / T * R;
        decode_range(fmt, x, ldx, xs, w, y, ldy, M, K, n0, n1 < N ? n1 : N);
    }
    if (xs != xs_stack) free(xs);
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
    int nt = work_threads(num_threads, 1, nb, 16 * QK, nb); /* parallel from 128 blocks */
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t b = 0; b < nb; b++) {
#if QL_AVX2
        __m256 v[4];
        QL_BY_FORMAT(fmt, dequant_block(F, w + b * bsz, v));
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

#include "quant_amx.h"
