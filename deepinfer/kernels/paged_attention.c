/*
 * Paged attention for decode rows (one query token per sequence), CPU. Queries, outputs and all
 * arithmetic are fp32; the cached K/V are fp32 (pa_paged_decode_attention_f32) or IEEE fp16
 * (pa_paged_decode_attention_f16), widened to fp32 as they are loaded (F16C when built with it,
 * else an exact scalar conversion).
 *
 * Reads K/V in place through the block tables: no gather, no copy of the context.
 * pa_rope_write_decode_attention_f32/_f16 first rotate the rows' q and k (rotary embedding) and
 * store their k and v into the cache, bit-identical to the torch ops they replace, then run the
 * same attention: one call per layer for a step's decode rows (see rope_write_decode_attention).
 * Plain C (no torch headers) so it builds in about a second; loaded with ctypes.
 *
 * Layout (element strides, as passed by the Python wrapper):
 *   q            [B, num_heads, head_dim]                 head_dim contiguous, other strides given
 *   k, v         [num_blocks, block_size, num_kv_heads, head_dim] of float or fp16 (uint16_t)
 *                inner three dims contiguous, dim-0 stride given (the layer view of a
 *                [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] tensor)
 *   block_tables [B, bt_stride] int32, row b's first ceil(ctx/block_size) entries are used
 *   context_lens [B] int32
 *   out          [B, num_heads, head_dim]                 head_dim contiguous, other strides given
 *
 * Work is split over (sequence, kv_head[, context partition]) items with OpenMP. An item
 * handles all query heads of its GQA group together, so each K/V row is read from memory
 * once for the whole group. Single pass with an online softmax (running max and sum),
 * processed a block at a time. Contexts longer than PA_PART_MIN_TOKENS are split into partitions
 * (by the row's own length, row_part_tokens) whose partial results (max, sum, unnormalised
 * accumulator) are merged in a second step. The split depends on neither the thread count nor the
 * other rows of the call, so neither do the results.
 *
 * One source for both K/V element types: the functions that read K/V take `half` (0: float,
 * 1: fp16) and are forced inline, and every call chain starts from attend_range_f32 or
 * attend_range_f16, where `half` is a constant, so each type gets its own loops with no
 * per-element test. Offsets and strides are in elements of the K/V type.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PA_AVX2 1
#else
#define PA_AVX2 0
#endif
/* The vector fp16 path needs F16C on top of AVX2 (every AVX2 CPU has it, but the build must ask). */
#if PA_AVX2 && defined(__F16C__)
#define PA_F16C 1
#else
#define PA_F16C 0
#endif

#if defined(__GNUC__)
#define PA_INLINE static inline __attribute__((always_inline))
#else
#define PA_INLINE static inline
#endif

/* Prefetch this many tokens ahead (rounded up to whole blocks); 0 disables. */
#ifndef PA_PREFETCH_TOKENS
#define PA_PREFETCH_TOKENS 16
#endif
/* Below this many multiply-adds per call (context tokens x heads x head_dim, for QK) stay on
 * one thread: a fork/join of the OpenMP team costs microseconds. Inside a decode step the K/V
 * come from memory (the weights just streamed through the caches), so even one sequence of a few
 * hundred tokens is worth two threads: SmolLM2 at batch 1, ~300 tokens, 2 threads, attention per
 * step 3.2 ms at 256 Ki (one thread below ~450 tokens), 2.4 ms at 64 Ki. */
#ifndef PA_MIN_PARALLEL_WORK
#define PA_MIN_PARALLEL_WORK (64 * 1024)
#endif
/* A row's context is split into parts of at least PA_PART_MIN_TOKENS tokens, at most PA_MAX_PARTS of them (see
 * row_part_tokens). Smaller parts let one short sequence's kv heads spread over the threads (3 kv heads on 2
 * threads leave one idle a third of the time); a part costs a merge even when one thread runs them all.
 * SmolLM2 batch 1, ~300 tokens: parts of 512 / 256 / 128 / 64 tokens, 3.2 (one thread) / 2.7 / 2.4 / 2.6 ms
 * of attention a step. */
#ifndef PA_PART_MIN_TOKENS
#define PA_PART_MIN_TOKENS 128
#endif
#ifndef PA_MAX_PARTS
#define PA_MAX_PARTS 8
#endif
#ifndef PA_PREFETCH_LOCALITY
#define PA_PREFETCH_LOCALITY 2
#endif

#define PA_LOG2E 1.4426950408889634f

/* Return codes (kept in sync with paged_attention.py). */
#define PA_OK 0
#define PA_ERR_CONTEXT_LEN -1 /* context_lens[b] < 0 or > max_blocks * block_size */
#define PA_ERR_BLOCK_ID -2    /* a used block table entry is outside [0, num_blocks) */
#define PA_ERR_NOMEM -3
#define PA_ERR_POSITION -4 /* fused: a position outside the rotary table */
#define PA_ERR_SLOT -5     /* fused: a slot block outside [0, num_blocks) or offset outside the block */

int pa_version(void) { return 1; }

int pa_has_avx2(void) { return PA_AVX2; }

int pa_has_f16c(void) { return PA_F16C; }

int pa_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------ */
/* K/V element access. `half` is a compile-time constant wherever these are inlined.     */

/* IEEE binary16 -> float; exact (every half is a float). */
static inline float half_to_float(uint16_t h) {
#if PA_F16C
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu)
        bits = sign | 0x7f800000u | (mant << 13); /* inf / nan, payload kept */
    else if (exp)
        bits = sign | ((exp + (127u - 15u)) << 23) | (mant << 13); /* normal: rebias the exponent */
    else if (!mant)
        bits = sign; /* signed zero */
    else {           /* subnormal: mant * 2^-24, exact in float */
        const float f = (float)mant * 0x1p-24f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Address of element i of a K/V array. */
PA_INLINE const void *kv_at(const void *base, int64_t i, int half) {
    return half ? (const void *)((const uint16_t *)base + i) : (const void *)((const float *)base + i);
}

PA_INLINE float kv_load1(const void *base, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

#if PA_AVX2
/* 8 consecutive elements from element i, as floats. Callers use it for fp16 only when PA_F16C
 * (attend_range's `vec`). */
PA_INLINE __m256 kv_load8(const void *base, int64_t i, int half) {
#if PA_F16C
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#endif
    (void)half;
    return _mm256_loadu_ps((const float *)base + i);
}
#endif

/* ------------------------------------------------------------------------------------ */
/* exp2 of an array, in place.                                                          */

#if PA_AVX2
/* 2^x for x <= 0 (scores minus their max); accurate to a few ulp. Inputs below -126
 * flush to 0. */
static inline __m256 exp2_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 xi = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, xi); /* f in [-0.5, 0.5] */
    /* degree-7 Taylor polynomial of 2^f = e^(f ln2) on [-0.5, 0.5]: truncation error < 1e-8 */
    __m256 p = _mm256_set1_ps(1.5252733804059840e-5f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-4f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(xi), _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    /* exact zero for the -126 clamp (keeps fully masked / -inf inputs at 0) */
    return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GT_OQ));
}
#endif

/* x[i] = 2^(x[i] - m); returns the sum. */
static inline float exp2_sub_sum(float *restrict x, int n, float m) {
    int i = 0;
    float s = 0.0f;
#if PA_AVX2
    __m256 vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    if (i < n) {
        float tmp[8];
        int r = n - i;
        for (int j = 0; j < 8; ++j) tmp[j] = j < r ? x[i + j] - m : -INFINITY;
        __m256 e = exp2_ps(_mm256_loadu_ps(tmp));
        _mm256_storeu_ps(tmp, e);
        vs = _mm256_add_ps(vs, e);
        for (int j = 0; j < r; ++j) x[i + j] = tmp[j];
        i = n;
    }
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    s = _mm_cvtss_f32(lo);
#endif
    for (; i < n; ++i) {
        float e = exp2f(x[i] - m);
        x[i] = e;
        s += e;
    }
    return s;
}

/* Fold one block's scores (n of them, log2 domain, block max bm) into a head's running softmax: a new
 * max rescales the sum *l and the unnormalised accumulator ah [D]; then sc becomes 2^(sc - max) in
 * place and its sum joins *l. */
PA_INLINE void softmax_block(float *restrict sc, int n, float bm, float *restrict m, float *restrict l,
                             float *restrict ah, int D) {
    if (bm > *m) {
        if (*m != -INFINITY) {
            const float corr = exp2f(*m - bm);
            *l *= corr;
            for (int d = 0; d < D; ++d) ah[d] *= corr;
        }
        *m = bm;
    }
    *l += exp2_sub_sum(sc, n, *m);
}

/* ------------------------------------------------------------------------------------ */
/* scores[j] = dot(q, k_j) for n rows k_j = k + j * tok_stride.                          */

/* Prefetch n rows of D elements, tok_stride elements apart. */
PA_INLINE void prefetch_rows(const void *base, int64_t tok_stride, int n, int D, int half) {
#if defined(__GNUC__)
    const int esize = half ? 2 : 4;
    const int row_bytes = D * esize;
    for (int j = 0; j < n; ++j) {
        const char *r = (const char *)base + (int64_t)j * tok_stride * esize;
        for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(r + off, 0, PA_PREFETCH_LOCALITY);
    }
#else
    (void)base; (void)tok_stride; (void)n; (void)D; (void)half;
#endif
}

#if PA_AVX2
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                             __m256 a6, __m256 a7) {
    /* returns [sum(a0), ..., sum(a7)] */
    __m256 t0 = _mm256_hadd_ps(a0, a1);
    __m256 t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5);
    __m256 t3 = _mm256_hadd_ps(a6, a7);
    t0 = _mm256_hadd_ps(t0, t1); /* [a0 a1 a2 a3 | a0 a1 a2 a3] (lo-lane, hi-lane partials) */
    t2 = _mm256_hadd_ps(t2, t3); /* [a4 a5 a6 a7 | a4 a5 a6 a7] */
    __m256 lo = _mm256_permute2f128_ps(t0, t2, 0x20);
    __m256 hi = _mm256_permute2f128_ps(t0, t2, 0x31);
    return _mm256_add_ps(lo, hi);
}

static inline float hmax8(__m256 a) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

static inline float hsum8(__m256 a) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* head_dim % 8 == 0; returns max_j scores[j] (n >= 1) */
PA_INLINE float qk_scores_avx2(const float *restrict q, const void *restrict k, int64_t tok_stride, int n, int D,
                               float *restrict scores, const void *pf, int pf_n, int half) {
    int j = 0, pj = 0;
    const int per_group = pf ? (pf_n + (n + 7) / 8 - 1) / ((n + 7) / 8) : 0; /* spread over groups of 8 */
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) {
        const int64_t k0 = (int64_t)j * tok_stride;
        if (pj < pf_n) {
            const int c = (pf_n - pj) < per_group ? (pf_n - pj) : per_group;
            prefetch_rows(kv_at(pf, (int64_t)pj * tok_stride, half), tok_stride, c, D, half);
            pj += c;
        }
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
               a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(),
               a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + d, half), a0);
            a1 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + tok_stride + d, half), a1);
            a2 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + 2 * tok_stride + d, half), a2);
            a3 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + 3 * tok_stride + d, half), a3);
            a4 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + 4 * tok_stride + d, half), a4);
            a5 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + 5 * tok_stride + d, half), a5);
            a6 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + 6 * tok_stride + d, half), a6);
            a7 = _mm256_fmadd_ps(qd, kv_load8(k, k0 + 7 * tok_stride + d, half), a7);
        }
        const __m256 s = hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
        vmax = _mm256_max_ps(vmax, s);
        _mm256_storeu_ps(scores + j, s);
    }
    float m = hmax8(vmax);
    if (pj < pf_n) prefetch_rows(kv_at(pf, (int64_t)pj * tok_stride, half), tok_stride, pf_n - pj, D, half);
    for (; j < n; ++j) {
        const int64_t kj = (int64_t)j * tok_stride;
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv_load8(k, kj + d, half), a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), kv_load8(k, kj + d + 8, half), b);
        }
        if (d < D) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv_load8(k, kj + d, half), a);
        const float sj = hsum8(_mm256_add_ps(a, b));
        scores[j] = sj;
        m = sj > m ? sj : m;
    }
    return m;
}

/* acc[0:D] += sum_j p[j] * v_j, head_dim % 8 == 0. Keeps >= 8 independent FMA chains in flight
 * (FMA latency 4 x 2 ports): 64 dims at a time, else 32 dims x 2 token phases, else 8 dims x 4
 * token phases. `o` is the element offset of the current row's slice in v. */
PA_INLINE void pv_accum_avx2(const float *restrict p, const void *restrict v, int64_t tok_stride, int n, int D,
                             float *restrict acc, const void *pf, int pf_n, int half) {
    int d = 0;
    if (pf) prefetch_rows(pf, tok_stride, pf_n, D, half);
    for (; d + 64 <= D; d += 64) {
        __m256 c0 = _mm256_loadu_ps(acc + d), c1 = _mm256_loadu_ps(acc + d + 8),
               c2 = _mm256_loadu_ps(acc + d + 16), c3 = _mm256_loadu_ps(acc + d + 24),
               c4 = _mm256_loadu_ps(acc + d + 32), c5 = _mm256_loadu_ps(acc + d + 40),
               c6 = _mm256_loadu_ps(acc + d + 48), c7 = _mm256_loadu_ps(acc + d + 56);
        int64_t o = d;
        for (int j = 0; j < n; ++j, o += tok_stride) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            c0 = _mm256_fmadd_ps(pj, kv_load8(v, o, half), c0);
            c1 = _mm256_fmadd_ps(pj, kv_load8(v, o + 8, half), c1);
            c2 = _mm256_fmadd_ps(pj, kv_load8(v, o + 16, half), c2);
            c3 = _mm256_fmadd_ps(pj, kv_load8(v, o + 24, half), c3);
            c4 = _mm256_fmadd_ps(pj, kv_load8(v, o + 32, half), c4);
            c5 = _mm256_fmadd_ps(pj, kv_load8(v, o + 40, half), c5);
            c6 = _mm256_fmadd_ps(pj, kv_load8(v, o + 48, half), c6);
            c7 = _mm256_fmadd_ps(pj, kv_load8(v, o + 56, half), c7);
        }
        _mm256_storeu_ps(acc + d, c0);
        _mm256_storeu_ps(acc + d + 8, c1);
        _mm256_storeu_ps(acc + d + 16, c2);
        _mm256_storeu_ps(acc + d + 24, c3);
        _mm256_storeu_ps(acc + d + 32, c4);
        _mm256_storeu_ps(acc + d + 40, c5);
        _mm256_storeu_ps(acc + d + 48, c6);
        _mm256_storeu_ps(acc + d + 56, c7);
    }
    if (d + 32 <= D) {
        __m256 c0 = _mm256_loadu_ps(acc + d), c1 = _mm256_loadu_ps(acc + d + 8),
               c2 = _mm256_loadu_ps(acc + d + 16), c3 = _mm256_loadu_ps(acc + d + 24);
        __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps(), e2 = _mm256_setzero_ps(),
               e3 = _mm256_setzero_ps();
        int64_t o = d;
        int j = 0;
        for (; j + 2 <= n; j += 2, o += 2 * tok_stride) {
            const __m256 pa = _mm256_broadcast_ss(p + j), pb = _mm256_broadcast_ss(p + j + 1);
            c0 = _mm256_fmadd_ps(pa, kv_load8(v, o, half), c0);
            c1 = _mm256_fmadd_ps(pa, kv_load8(v, o + 8, half), c1);
            c2 = _mm256_fmadd_ps(pa, kv_load8(v, o + 16, half), c2);
            c3 = _mm256_fmadd_ps(pa, kv_load8(v, o + 24, half), c3);
            e0 = _mm256_fmadd_ps(pb, kv_load8(v, o + tok_stride, half), e0);
            e1 = _mm256_fmadd_ps(pb, kv_load8(v, o + tok_stride + 8, half), e1);
            e2 = _mm256_fmadd_ps(pb, kv_load8(v, o + tok_stride + 16, half), e2);
            e3 = _mm256_fmadd_ps(pb, kv_load8(v, o + tok_stride + 24, half), e3);
        }
        if (j < n) {
            const __m256 pa = _mm256_broadcast_ss(p + j);
            c0 = _mm256_fmadd_ps(pa, kv_load8(v, o, half), c0);
            c1 = _mm256_fmadd_ps(pa, kv_load8(v, o + 8, half), c1);
            c2 = _mm256_fmadd_ps(pa, kv_load8(v, o + 16, half), c2);
            c3 = _mm256_fmadd_ps(pa, kv_load8(v, o + 24, half), c3);
        }
        _mm256_storeu_ps(acc + d, _mm256_add_ps(c0, e0));
        _mm256_storeu_ps(acc + d + 8, _mm256_add_ps(c1, e1));
        _mm256_storeu_ps(acc + d + 16, _mm256_add_ps(c2, e2));
        _mm256_storeu_ps(acc + d + 24, _mm256_add_ps(c3, e3));
        d += 32;
    }
    for (; d < D; d += 8) {
        __m256 c0 = _mm256_loadu_ps(acc + d), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(),
               c3 = _mm256_setzero_ps();
        int64_t o = d;
        int j = 0;
        for (; j + 4 <= n; j += 4, o += 4 * tok_stride) {
            c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), kv_load8(v, o, half), c0);
            c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j + 1), kv_load8(v, o + tok_stride, half), c1);
            c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j + 2), kv_load8(v, o + 2 * tok_stride, half), c2);
            c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j + 3), kv_load8(v, o + 3 * tok_stride, half), c3);
        }
        for (; j < n; ++j, o += tok_stride) c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), kv_load8(v, o, half), c0);
        _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
    }
}
#endif

/* ------------------------------------------------------------------------------------ */
/* GQA: the G query heads of a kv head read the same K/V rows. The grouped steps below take
 * up to 4 heads at a time and load (for fp16: convert) each 8-element chunk of a K or V row
 * once for all of them, instead of once per head as qk_scores_avx2 / pv_accum_avx2 do; with
 * fp16 K/V the conversions share the FMA ports, so this is where a batch of long contexts spends
 * its time. SmolLM2 (G = 3, head_dim 64), 128 sequences x 400 tokens, 2 threads, 30 layers, medians of
 * back-to-back runs: fp16 K/V ~94 -> ~85 ms a step; fp32 ~153 ms either way (it waits on memory, twice
 * the bytes); batch 1, 300 tokens: fp16 ~1.0 -> ~0.9 ms, fp32 ~1.1 ms either way. The FMAs are a
 * fraction of the time even for fp16 (~14 GB/s of K/V in both cases), so the gain stays modest.
 * A version that first widened a whole fp16 block into an fp32 buffer was slower (2.09 -> 2.9 ms a
 * layer): the sharing has to happen in registers, without another pass through memory. For whole
 * blocks of a multiple of 8 tokens and head_dim a multiple of 64 the results equal the per-head
 * path's bit for bit (same dot-product and PV orders). */

#if PA_AVX2
/* [sum(a0), sum(a1), sum(a2), sum(a3)], each summed as ((e0+e1)+(e2+e3)) + ((e4+e5)+(e6+e7)):
 * the order of hsum8x8, so a score does not depend on which path or group computed it. */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* max_j x[j], n >= 1 */
static inline float max_n(const float *x, int n) {
    int j = 0;
    float m = -INFINITY;
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (j = 8; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
        m = hmax8(vm);
    }
    for (; j < n; ++j) m = x[j] > m ? x[j] : m;
    return m;
}

/* Heads in the next group when `rem` heads of the kv head are left (rem >= 2): 4 at most, and
 * never leaving a single head for a group of its own. */
static inline int group_heads(int rem) { return rem <= 4 ? rem : 3; }

/* Scores of NH heads (q rows D apart, scores rows sc_stride apart) for n rows k_j = k + j * tok_stride,
 * head_dim % 8 == 0. T tokens at a time, NH * T accumulators (NH 2, 3: T 4; NH 4: T 2), each
 * K chunk loaded once for the NH heads. Every score is one FMA chain over the chunks in order,
 * then hsum4x8: the same value for any NH, T, or position of the row in the block (the
 * per-head qk_scores_avx2 gives the same for its groups of 8 rows). pf: pf_n rows to
 * prefetch, spread over the token groups. */
PA_INLINE void qk_group_avx2(const float *restrict q, const void *restrict k, int64_t tok_stride, int n, int D,
                             float *restrict sc, int sc_stride, const void *pf, int pf_n, const int NH,
                             const int T, int half) {
    int j = 0, pj = 0;
    const int ngroups = (n + T - 1) / T;
    const int per_group = pf ? (pf_n + ngroups - 1) / ngroups : 0;
    for (; j + T <= n; j += T) {
        if (pj < pf_n) {
            const int c = (pf_n - pj) < per_group ? (pf_n - pj) : per_group;
            prefetch_rows(kv_at(pf, (int64_t)pj * tok_stride, half), tok_stride, c, D, half);
            pj += c;
        }
        const int64_t k0 = (int64_t)j * tok_stride;
        __m256 a[4][4];
        for (int h = 0; h < NH; ++h)
            for (int t = 0; t < T; ++t) a[h][t] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            for (int t = 0; t < T; ++t) {
                const __m256 kt = kv_load8(k, k0 + t * tok_stride + d, half);
                for (int h = 0; h < NH; ++h)
                    a[h][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * D + d), kt, a[h][t]);
            }
        }
        if (T == 4) {
            for (int h = 0; h < NH; ++h)
                _mm_storeu_ps(sc + (size_t)h * sc_stride + j, hsum4x8(a[h][0], a[h][1], a[h][2], a[h][3]));
        } else { /* T == 2, NH even: two heads per sum */
            for (int h = 0; h < NH; h += 2) {
                const __m128 s = hsum4x8(a[h][0], a[h][1], a[h + 1][0], a[h + 1][1]);
                _mm_storel_pi((__m64 *)(sc + (size_t)h * sc_stride + j), s);
                _mm_storeh_pi((__m64 *)(sc + (size_t)(h + 1) * sc_stride + j), s);
            }
        }
    }
    if (pj < pf_n) prefetch_rows(kv_at(pf, (int64_t)pj * tok_stride, half), tok_stride, pf_n - pj, D, half);
    for (; j < n; ++j) {
        const int64_t kj = (int64_t)j * tok_stride;
        __m256 a[4];
        for (int h = 0; h < 4; ++h) a[h] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            const __m256 kt = kv_load8(k, kj + d, half);
            for (int h = 0; h < NH; ++h) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * D + d), kt, a[h]);
        }
        float s[4];
        _mm_storeu_ps(s, hsum4x8(a[0], a[1], a[2], a[3]));
        for (int h = 0; h < NH; ++h) sc[(size_t)h * sc_stride + j] = s[h];
    }
}

/* acc_h[0:D] += sum_j p_h[j] * v_j for NH heads (p rows p_stride apart, acc rows D apart),
 * head_dim % 8 == 0. W ymm (8 W dims) of each head at a time, NH * W accumulators (NH 2, 3: W 4;
 * NH 4: W 2), each V chunk loaded once for the NH heads. Every element accumulates the rows
 * in order with one FMA chain (as pv_accum_avx2 does 64 dims at a time). pf: pf_n rows to
 * prefetch, spread over the dim chunks. */
PA_INLINE void pv_group_avx2(const float *restrict p, int p_stride, const void *restrict v, int64_t tok_stride,
                             int n, int D, float *restrict acc, const void *pf, int pf_n, const int NH, const int W,
                             int half) {
    int d = 0, pj = 0;
    const int nchunks = D / (8 * W) + (D % (8 * W) != 0);
    const int per_chunk = pf ? (pf_n + nchunks - 1) / nchunks : 0;
    for (; d + 8 * W <= D; d += 8 * W) {
        if (pj < pf_n) {
            const int c = (pf_n - pj) < per_chunk ? (pf_n - pj) : per_chunk;
            prefetch_rows(kv_at(pf, (int64_t)pj * tok_stride, half), tok_stride, c, D, half);
            pj += c;
        }
        __m256 c[4][4];
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < W; ++w) c[h][w] = _mm256_loadu_ps(acc + (size_t)h * D + d + 8 * w);
        int64_t o = d;
        for (int j = 0; j < n; ++j, o += tok_stride) {
            __m256 pb[4];
            for (int h = 0; h < NH; ++h) pb[h] = _mm256_broadcast_ss(p + (size_t)h * p_stride + j);
            for (int w = 0; w < W; ++w) {
                const __m256 vv = kv_load8(v, o + 8 * w, half);
                for (int h = 0; h < NH; ++h) c[h][w] = _mm256_fmadd_ps(pb[h], vv, c[h][w]);
            }
        }
        for (int h = 0; h < NH; ++h)
            for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + (size_t)h * D + d + 8 * w, c[h][w]);
    }
    if (pj < pf_n) prefetch_rows(kv_at(pf, (int64_t)pj * tok_stride, half), tok_stride, pf_n - pj, D, half);
    for (; d < D; d += 8) {
        __m256 c[4];
        for (int h = 0; h < NH; ++h) c[h] = _mm256_loadu_ps(acc + (size_t)h * D + d);
        int64_t o = d;
        for (int j = 0; j < n; ++j, o += tok_stride) {
            const __m256 vv = kv_load8(v, o, half);
            for (int h = 0; h < NH; ++h) c[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + (size_t)h * p_stride + j), vv, c[h]);
        }
        for (int h = 0; h < NH; ++h) _mm256_storeu_ps(acc + (size_t)h * D + d, c[h]);
    }
}
#endif

/* Generic versions: any head_dim; written so gcc vectorises the head_dim loops (the fp32 ones). */
PA_INLINE float qk_scores_generic(const float *restrict q, const void *restrict k, int64_t tok_stride, int n,
                                  int D, float *restrict scores, int half) {
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
        const int64_t kj = (int64_t)j * tok_stride;
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += q[d] * kv_load1(k, kj + d, half);
        scores[j] = s;
        m = s > m ? s : m;
    }
    return m;
}

PA_INLINE void pv_accum_generic(const float *restrict p, const void *restrict v, int64_t tok_stride, int n, int D,
                                float *restrict acc, int half) {
    for (int j = 0; j < n; ++j) {
        const int64_t vj = (int64_t)j * tok_stride;
        const float pj = p[j];
        for (int d = 0; d < D; ++d) acc[d] += pj * kv_load1(v, vj + d, half);
    }
}

/* ------------------------------------------------------------------------------------ */

typedef struct {
    const void *k; /* float or fp16, as the attend_range variant says */
    const void *v;
    int64_t k_block_stride, k_tok_stride;
    int64_t v_block_stride, v_tok_stride;
    int block_size, G, D;
    int pf_dist; /* prefetch distance in blocks (0: off) */
} pa_geom;

#if PA_AVX2
/* One block of n tokens (K rows kb, V rows vb) for all G >= 2 heads, head_dim % 8 == 0: the
 * scores of every head (heads in groups of group_heads), then each head's online-softmax update
 * exactly as attend_range's per-head loop, then the PV sums of every group. The prefetch rows
 * (nn of pfk and of pfv) are shared out over the groups as the per-head loop shares them over
 * the heads. */
PA_INLINE void attend_block_grouped(const pa_geom *g, const float *restrict qs, const void *kb, const void *vb,
                                    int n, const void *pfk, const void *pfv, int nn, float *restrict m,
                                    float *restrict l, float *restrict acc, float *restrict scores, int half) {
    const int G = g->G, D = g->D, bs = g->block_size;
    int ng = 0;
    for (int h = 0; h < G; h += group_heads(G - h)) ++ng;
    for (int h0 = 0, gi = 0, nh; h0 < G; h0 += nh, ++gi) {
        nh = group_heads(G - h0);
        const int64_t r0 = (int64_t)gi * nn / ng, r1 = (int64_t)(gi + 1) * nn / ng;
        const void *pf = pfk ? kv_at(pfk, r0 * g->k_tok_stride, half) : NULL;
        const float *qg = qs + (size_t)h0 * D;
        float *sg = scores + (size_t)h0 * bs;
        if (nh == 2)
            qk_group_avx2(qg, kb, g->k_tok_stride, n, D, sg, bs, pf, (int)(r1 - r0), 2, 4, half);
        else if (nh == 3)
            qk_group_avx2(qg, kb, g->k_tok_stride, n, D, sg, bs, pf, (int)(r1 - r0), 3, 4, half);
        else
            qk_group_avx2(qg, kb, g->k_tok_stride, n, D, sg, bs, pf, (int)(r1 - r0), 4, 2, half);
    }
    for (int h = 0; h < G; ++h) {
        float *sc = scores + (size_t)h * bs;
        float *ah = acc + (size_t)h * D;
        softmax_block(sc, n, max_n(sc, n), m + h, l + h, ah, D);
    }
    for (int h0 = 0, gi = 0, nh; h0 < G; h0 += nh, ++gi) {
        nh = group_heads(G - h0);
        const int64_t r0 = (int64_t)gi * nn / ng, r1 = (int64_t)(gi + 1) * nn / ng;
        const void *pf = pfv ? kv_at(pfv, r0 * g->v_tok_stride, half) : NULL;
        const float *pg = scores + (size_t)h0 * bs;
        float *ag = acc + (size_t)h0 * D;
        if (nh == 2)
            pv_group_avx2(pg, bs, vb, g->v_tok_stride, n, D, ag, pf, (int)(r1 - r0), 2, 4, half);
        else if (nh == 3)
            pv_group_avx2(pg, bs, vb, g->v_tok_stride, n, D, ag, pf, (int)(r1 - r0), 3, 4, half);
        else
            pv_group_avx2(pg, bs, vb, g->v_tok_stride, n, D, ag, pf, (int)(r1 - r0), 4, 2, half);
    }
}
#endif

/*
 * Attend G query heads (qs: [G, D], already multiplied by scale * log2(e)) over tokens
 * [tok_begin, tok_end) of one sequence, for one kv head (k/v already offset to it).
 * tok_begin is a multiple of block_size. Output: m[G] (running max, log2 domain),
 * l[G] (sum), acc[G, D] (unnormalised). scores: scratch of G * block_size floats.
 * half: 0 for float K/V, 1 for fp16; a constant at both call sites (attend_range_f32/_f16).
 */
PA_INLINE void attend_range(const pa_geom *g, const float *restrict qs, const int32_t *restrict btab,
                            int tok_begin, int tok_end, float *restrict m, float *restrict l,
                            float *restrict acc, float *restrict scores, int half) {
    const int G = g->G, D = g->D, bs = g->block_size;
    /* the AVX2 loops load fp16 rows with F16C; a build without it reads them with the generic loops */
    const int vec = PA_AVX2 && (D % 8 == 0) && (!half || PA_F16C);
    (void)vec;
#if PA_AVX2
    const int grouped = vec && G >= 2;
#endif
    for (int h = 0; h < G; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    /* the first pf_dist blocks are not covered by the look-ahead below */
    for (int i = 0, t = tok_begin; i < g->pf_dist && t < tok_end; ++i, t += bs) {
        const int64_t nb = btab[t / bs];
        const int nn = (tok_end - t) < bs ? (tok_end - t) : bs;
        prefetch_rows(kv_at(g->k, nb * g->k_block_stride, half), g->k_tok_stride, nn, D, half);
        prefetch_rows(kv_at(g->v, nb * g->v_block_stride, half), g->v_tok_stride, nn, D, half);
    }

    for (int t0 = tok_begin; t0 < tok_end; t0 += bs) {
        const int bi = t0 / bs;
        const int n = (tok_end - t0) < bs ? (tok_end - t0) : bs;
        const int64_t blk = btab[bi];
        const void *kb = kv_at(g->k, blk * g->k_block_stride, half);
        const void *vb = kv_at(g->v, blk * g->v_block_stride, half);

        /* Software prefetch (into L2) of the block pf_dist blocks ahead: blocks are scattered,
         * so the hardware prefetchers cannot see them coming. The rows are shared out over the
         * G heads' passes (K rows spread over each QK pass, V rows at the start of each PV
         * pass) so requests stay in flight while computing instead of arriving in one burst. */
        const void *pfk = NULL, *pfv = NULL;
        int nn = 0;
        const int tp = t0 + g->pf_dist * bs;
        if (g->pf_dist > 0 && tp < tok_end) {
            const int64_t nb = btab[bi + g->pf_dist];
            nn = (tok_end - tp) < bs ? (tok_end - tp) : bs;
            pfk = kv_at(g->k, nb * g->k_block_stride, half);
            pfv = kv_at(g->v, nb * g->v_block_stride, half);
            if (!vec) { /* the generic path takes no prefetch pointers: fetch it all now */
                prefetch_rows(pfk, g->k_tok_stride, nn, D, half);
                prefetch_rows(pfv, g->v_tok_stride, nn, D, half);
            }
        }

#if PA_AVX2
        if (grouped) {
            attend_block_grouped(g, qs, kb, vb, n, pfk, pfv, nn, m, l, acc, scores, half);
            continue;
        }
#endif
        for (int h = 0; h < G; ++h) {
            float *sc = scores + (size_t)h * bs;
            float bm;
            /* this head's share of the rows to prefetch (spread so memory stays busy) */
            const int64_t r0 = (int64_t)h * nn / G, r1 = (int64_t)(h + 1) * nn / G;
            (void)r0;
            (void)r1;
#if PA_AVX2
            if (vec)
                bm = qk_scores_avx2(qs + (size_t)h * D, kb, g->k_tok_stride, n, D, sc,
                                    pfk ? kv_at(pfk, r0 * g->k_tok_stride, half) : NULL, (int)(r1 - r0), half);
            else
#endif
                bm = qk_scores_generic(qs + (size_t)h * D, kb, g->k_tok_stride, n, D, sc, half);
            float *ah = acc + (size_t)h * D;
            softmax_block(sc, n, bm, m + h, l + h, ah, D);
#if PA_AVX2
            if (vec)
                pv_accum_avx2(sc, vb, g->v_tok_stride, n, D, ah, pfv ? kv_at(pfv, r0 * g->v_tok_stride, half) : NULL,
                              (int)(r1 - r0), half);
            else
#endif
                pv_accum_generic(sc, vb, g->v_tok_stride, n, D, ah, half);
        }
    }
}

/* The two specialisations; everything K/V-typed below them is inlined with `half` constant. */
static void attend_range_f32(const pa_geom *g, const float *restrict qs, const int32_t *restrict btab,
                             int tok_begin, int tok_end, float *restrict m, float *restrict l,
                             float *restrict acc, float *restrict scores) {
    attend_range(g, qs, btab, tok_begin, tok_end, m, l, acc, scores, 0);
}

static void attend_range_f16(const pa_geom *g, const float *restrict qs, const int32_t *restrict btab,
                             int tok_begin, int tok_end, float *restrict m, float *restrict l,
                             float *restrict acc, float *restrict scores) {
    attend_range(g, qs, btab, tok_begin, tok_end, m, l, acc, scores, 1);
}

/*
 * params (int64, in this order): B, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
 * max_blocks, q_stride_b, q_stride_h, out_stride_b, out_stride_h, block_table_stride,
 * k_block_stride, k_token_stride, v_block_stride, v_token_stride (strides in elements).
 * Packed in one array so the ctypes call stays cheap (the engine calls this once per layer).
 * Returns PA_OK or a negative error code (nothing is written to out on a validation error).
 * half: K/V element type (0 float, 1 fp16); the strides count elements of it.
 */
#define PA_NUM_PARAMS 16

int pa_num_params(void) { return PA_NUM_PARAMS; }

/* Validate the parts of the block tables that will be read; on success sets the tokens they cover
 * (summed over rows). */
static int check_tables(const int64_t *params, const int32_t *block_tables, const int32_t *context_lens,
                        int64_t *total_tokens) {
    const int64_t B = params[0], block_size = params[4], num_blocks = params[5], max_blocks = params[6],
                  bt_stride = params[11];
    int64_t tt = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t c = context_lens[b];
        if (c < 0 || c > max_blocks * block_size) return PA_ERR_CONTEXT_LEN;
        const int64_t nb = (c + block_size - 1) / block_size;
        const int32_t *row = block_tables + b * bt_stride;
        for (int64_t i = 0; i < nb; ++i)
            if (row[i] < 0 || row[i] >= num_blocks) return PA_ERR_BLOCK_ID;
        tt += c;
    }
    *total_tokens = tt;
    return PA_OK;
}

/* Tokens per part of a row of context length c: by c alone, never by the other rows of the call or the thread
 * count, so a row's output depends only on its query and its context (batch invariance): a token decoded alone,
 * beside other requests, or as one of a speculative step's verification rows gets the same bits. */
static inline int64_t row_part_tokens(int64_t c, int64_t block_size) {
    const int64_t nb = (c + block_size - 1) / block_size, min_pb = (PA_PART_MIN_TOKENS + block_size - 1) / block_size;
    int64_t pb = (nb + PA_MAX_PARTS - 1) / PA_MAX_PARTS;
    if (pb < min_pb) pb = min_pb;
    return pb * block_size;
}

/* Decode attention over block tables that check_tables accepted (the attention both entry points
 * run). The work split depends only on the shapes and context lengths, never on num_threads, and
 * each item and each merge is computed in a fixed order: results do not depend on the thread count. */
static int attend_rows(const float *q, const void *k, const void *v, const int32_t *block_tables,
                       const int32_t *context_lens, float *out, const int64_t *params, float scale,
                       int num_threads, int half, int64_t total_tokens) {
    const int64_t B = params[0], num_heads = params[1], num_kv_heads = params[2], head_dim = params[3],
                  block_size = params[4],
                  q_stride_b = params[7], q_stride_h = params[8], out_stride_b = params[9],
                  out_stride_h = params[10], bt_stride = params[11], k_block_stride = params[12],
                  k_tok_stride = params[13], v_block_stride = params[14], v_tok_stride = params[15];
    const int G = (int)(num_heads / num_kv_heads);
    const int D = (int)head_dim;
    const int bs = (int)block_size;
    if (num_threads < 1) num_threads = 1;

    /* Too little work to pay for waking the thread team: run on the calling thread. */
    if (total_tokens * num_heads * head_dim < PA_MIN_PARALLEL_WORK) num_threads = 1;

    const int64_t pairs = B * num_kv_heads;
    /* Items: per sequence, nparts(b) partitions × num_kv_heads. */
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!item_start) return PA_ERR_NOMEM;
    int64_t n_items = 0, n_split_items = 0;
    for (int64_t b = 0; b < B; ++b) {
        item_start[b] = n_items;
        const int64_t c = context_lens[b], part_tokens = row_part_tokens(c, block_size);
        int64_t np = (c + part_tokens - 1) / part_tokens;
        if (np < 1) np = 1;
        n_items += np * num_kv_heads;
        if (np > 1) n_split_items += np * num_kv_heads;
    }
    item_start[B] = n_items;

    /* Scratch for partial results of split sequences: per item G*(D+2) floats.
     * Indexed by item (simple; only allocated when splitting happens). */
    float *partials = NULL;
    const int64_t pstride = (int64_t)G * (D + 2);
    if (n_split_items > 0) {
        partials = (float *)malloc(sizeof(float) * (size_t)(n_items * pstride));
        if (!partials) {
            free(item_start);
            return PA_ERR_NOMEM;
        }
    }

    pa_geom geom;
    geom.k_block_stride = k_block_stride;
    geom.k_tok_stride = k_tok_stride;
    geom.v_block_stride = v_block_stride;
    geom.v_tok_stride = v_tok_stride;
    geom.block_size = bs;
    geom.G = G;
    geom.D = D;
    geom.pf_dist = PA_PREFETCH_TOKENS > 0 ? (PA_PREFETCH_TOKENS + bs - 1) / bs : 0;
    const float qmul = scale * PA_LOG2E;
    int err = PA_OK;

    /* Bundles: (group of rows, part, kv head); a thread runs a bundle's rows one after another. A group is a
     * run of consecutive rows whose block tables start with the same block: the 1 + k verification rows of
     * a speculating sequence (each with a context one longer than the last), or sequences sharing a cached
     * prefix. Their slices share K/V rows, so the lines the first row pulls from memory serve the others
     * from the thread's cache: a verification step reads each context from memory about once instead of
     * 1 + k times. Where bundles are plentiful a thread takes all kv heads of one (group, part) at a time
     * (the lines the first head pulls, with their neighbours, serve the others: SmolLM2 c=128, 400 tokens,
     * fp16 K/V, 2.09 -> 1.99 ms a layer, fp32 3.09 -> 2.82); where they are few, one kv head at a time, so
     * one speculating sequence's few parts still spread over the threads. Which thread runs an item, and
     * in which order, never changes its result. */
    int64_t *group_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first row of each group */
    if (!group_start) {
        free(partials);
        free(item_start);
        return PA_ERR_NOMEM;
    }
    int64_t n_groups = 0, n_bundles = 0; /* n_bundles: (group, part) pairs */
    {
        int64_t np_max = 0; /* most parts of any row of the current group */
        for (int64_t b = 0; b < B; ++b) {
            const int64_t np = (item_start[b + 1] - item_start[b]) / num_kv_heads;
            const int same = b > 0 && context_lens[b] > 0 && context_lens[b - 1] > 0 &&
                             block_tables[b * bt_stride] == block_tables[(b - 1) * bt_stride];
            if (!same) {
                n_bundles += np_max;
                group_start[n_groups++] = b;
                np_max = 0;
            }
            if (np > np_max) np_max = np;
        }
        n_bundles += np_max;
        group_start[n_groups] = B;
    }
    int64_t *bundles = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * (n_bundles > 0 ? n_bundles : 1)));
    if (!bundles) {
        free(group_start);
        free(partials);
        free(item_start);
        return PA_ERR_NOMEM;
    }
    for (int64_t g = 0, n = 0; g < n_groups; ++g) {
        int64_t np_max = 0;
        for (int64_t b = group_start[g]; b < group_start[g + 1]; ++b) {
            const int64_t np = (item_start[b + 1] - item_start[b]) / num_kv_heads;
            if (np > np_max) np_max = np;
        }
        for (int64_t p = 0; p < np_max; ++p, ++n) {
            bundles[2 * n] = g;
            bundles[2 * n + 1] = p;
        }
    }
    const int64_t n_work = n_bundles * num_kv_heads;
    const int chunk = n_work >= 8 * (int64_t)num_threads * num_kv_heads ? (int)num_kv_heads : 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_items > 1)
    {
        /* per-thread scratch: scaled q [G*D], acc [G*D], m [G], l [G], scores [G*bs] */
        float *buf = (float *)malloc(sizeof(float) * ((size_t)G * (2 * (size_t)D + 2 + (size_t)bs)));
        if (!buf) {
#pragma omp atomic write
            err = PA_ERR_NOMEM;
        }
        float *qs = buf, *acc = buf ? buf + (size_t)G * D : NULL;
        float *m = acc ? acc + (size_t)G * D : NULL, *l = m ? m + G : NULL, *sc = l ? l + G : NULL;
        pa_geom gl = geom;

#pragma omp for schedule(dynamic, chunk)
        for (int64_t wk = 0; wk < n_work; ++wk) {
            if (!buf) continue;
            const int64_t bu = wk / num_kv_heads, kvh = wk % num_kv_heads;
            const int64_t grp = bundles[2 * bu], part = bundles[2 * bu + 1];
            for (int64_t b = group_start[grp]; b < group_start[grp + 1]; ++b) {
                const int64_t nparts = (item_start[b + 1] - item_start[b]) / num_kv_heads;
                if (part >= nparts) continue;
                const int64_t it = item_start[b] + part * num_kv_heads + kvh;
                const int64_t c = context_lens[b], part_tokens = row_part_tokens(c, block_size);
                const int64_t t_begin = part * part_tokens;
                const int64_t t_end = (t_begin + part_tokens) < c ? (t_begin + part_tokens) : c;

                for (int h = 0; h < G; ++h) {
                    const float *qh = q + b * q_stride_b + (kvh * G + h) * q_stride_h;
                    float *qsh = qs + (size_t)h * D;
                    for (int d = 0; d < D; ++d) qsh[d] = qh[d] * qmul;
                }
                gl.k = kv_at(k, kvh * D, half);
                gl.v = kv_at(v, kvh * D, half);

                float *orow = out + b * out_stride_b + kvh * G * out_stride_h;
                if (c == 0) {
                    for (int h = 0; h < G; ++h) memset(orow + h * out_stride_h, 0, sizeof(float) * (size_t)D);
                    continue;
                }
                (half ? attend_range_f16 : attend_range_f32)(&gl, qs, block_tables + b * bt_stride, (int)t_begin,
                                                             (int)t_end, m, l, acc, sc);

                if (nparts == 1) {
                    for (int h = 0; h < G; ++h) {
                        const float inv = 1.0f / l[h];
                        const float *ah = acc + (size_t)h * D;
                        float *oh = orow + h * out_stride_h;
                        for (int d = 0; d < D; ++d) oh[d] = ah[d] * inv;
                    }
                } else {
                    float *pp = partials + it * pstride;
                    memcpy(pp, m, sizeof(float) * G);
                    memcpy(pp + G, l, sizeof(float) * G);
                    memcpy(pp + 2 * G, acc, sizeof(float) * (size_t)G * D);
                }
            }
        }

        /* Merge partitions of split sequences. */
        if (n_split_items > 0) {
#pragma omp for schedule(static)
            for (int64_t pr = 0; pr < pairs; ++pr) {
                const int64_t bb = pr / num_kv_heads, kvh = pr % num_kv_heads;
                const int64_t nparts = (item_start[bb + 1] - item_start[bb]) / num_kv_heads;
                if (nparts <= 1 || !buf) continue;
                float *orow = out + bb * out_stride_b + kvh * G * out_stride_h;
                for (int h = 0; h < G; ++h) {
                    float gm = -INFINITY;
                    for (int64_t p = 0; p < nparts; ++p) {
                        const float *pp = partials + (item_start[bb] + p * num_kv_heads + kvh) * pstride;
                        if (pp[h] > gm) gm = pp[h];
                    }
                    float *oh = orow + h * out_stride_h;
                    float lsum = 0.0f;
                    for (int d = 0; d < D; ++d) oh[d] = 0.0f;
                    for (int64_t p = 0; p < nparts; ++p) {
                        const float *pp = partials + (item_start[bb] + p * num_kv_heads + kvh) * pstride;
                        const float w = exp2f(pp[h] - gm);
                        lsum += w * pp[G + h];
                        const float *ah = pp + 2 * G + (size_t)h * D;
                        for (int d = 0; d < D; ++d) oh[d] += w * ah[d];
                    }
                    const float inv = 1.0f / lsum;
                    for (int d = 0; d < D; ++d) oh[d] *= inv;
                }
            }
        }
        free(buf);
    }

    free(bundles);
    free(group_start);
    free(partials);
    free(item_start);
    return err;
}

static int decode_attention(const float *q, const void *k, const void *v, const int32_t *block_tables,
                            const int32_t *context_lens, float *out, const int64_t *params, float scale,
                            int num_threads, int half) {
    int64_t total_tokens;
    const int rc = check_tables(params, block_tables, context_lens, &total_tokens);
    if (rc != PA_OK) return rc;
    return attend_rows(q, k, v, block_tables, context_lens, out, params, scale, num_threads, half,
                       total_tokens);
}

/* ------------------------------------------------------------------------------------ */
/* Rotary embedding and K/V write of the fused entry point.                             */

/* rope_rows and float_to_half must round every product and sum on its own, as torch's separate
 * ops do: the build's -O3 -mfma would otherwise let the compiler contract a*b + c into an FMA,
 * which rounds once and so differs in the last bit. GCC takes the optimize attribute (noinline:
 * the function keeps its own options), clang the standard pragma. */
#if defined(__clang__)
#define PA_NO_CONTRACT
#define PA_CONTRACT_OFF _Pragma("STDC FP_CONTRACT OFF")
#elif defined(__GNUC__)
#define PA_NO_CONTRACT __attribute__((optimize("fp-contract=off"), noinline))
#define PA_CONTRACT_OFF
#else
#define PA_NO_CONTRACT
#define PA_CONTRACT_OFF
#endif

/* Rotate `heads` consecutive heads of D floats in place: the half-split rotation of
 * rope.apply_rotary, x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1). For the
 * first half a*c + (-b)*s equals a*c - b*s exactly (negation is exact), so both halves are three
 * separately rounded operations, like torch's mul, mul, add. */
PA_NO_CONTRACT static void rope_rows(float *restrict x, int64_t heads, int D, const float *restrict c,
                                     const float *restrict s) {
    PA_CONTRACT_OFF
    const int h = D / 2;
    for (int64_t r = 0; r < heads; ++r, x += D) {
        for (int i = 0; i < h; ++i) {
            const float a = x[i], b = x[i + h];
            const float ac = a * c[i], bs = b * s[i], bc = b * c[i + h], as = a * s[i + h];
            x[i] = ac - bs;
            x[i + h] = bc + as;
        }
    }
}

#if !PA_F16C
/* float -> IEEE binary16, round to nearest even, overflow to inf: the conversion of torch's
 * c10::Half (fp16_ieee_from_fp32_value), which scales into range so that one float addition does
 * the rounding. */
PA_NO_CONTRACT static uint16_t float_to_half(float f) {
    PA_CONTRACT_OFF
    uint32_t w, bits;
    memcpy(&w, &f, sizeof w);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float base = (fabsf(f) * 0x1p+112f) * 0x1p-110f, shifter;
    memcpy(&shifter, &bias_bits, sizeof shifter);
    base = shifter + base;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}
#endif

/* Store n floats at dst (float, or fp16 rounded to nearest even as torch's .to(torch.float16)). */
static void store_row(void *dst, const float *src, int64_t n, int half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    int64_t i = 0;
#if PA_F16C
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) h[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
#else
    for (; i < n; ++i) h[i] = float_to_half(src[i]);
#endif
}

/*
 * The fused decode step of one layer. qkv row b (b < B, qkv_stride_b = params[7] apart) holds the
 * row's q [num_heads, head_dim], then k and v [num_kv_heads, head_dim], contiguous
 * (params[8] = head_dim). For every row: rotate q and k in place by position positions[b]
 * (cos/sin: [max_positions, head_dim] fp32), store k and v at (slot_blocks[b], slot_offsets[b])
 * of the caches; then decode attention exactly as decode_attention. All rows are written before
 * any row attends: rows of one sequence (speculative verification) see each other's fresh K/V
 * through the cache. params: the PA_NUM_PARAMS of decode_attention, then max_positions.
 * Everything is validated before anything is written.
 */
#define PA_NUM_FUSED_PARAMS (PA_NUM_PARAMS + 1)

int pa_num_fused_params(void) { return PA_NUM_FUSED_PARAMS; }

static int rope_write_decode_attention(float *qkv, const float *cos, const float *sin, const int64_t *positions,
                                       const int64_t *slot_blocks, const int64_t *slot_offsets, void *k_cache,
                                       void *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                                       float *out, const int64_t *params, float scale, int num_threads, int half) {
    const int64_t B = params[0], num_heads = params[1], num_kv_heads = params[2], D = params[3],
                  block_size = params[4], num_blocks = params[5], qkv_stride_b = params[7],
                  k_block_stride = params[12], k_tok_stride = params[13], v_block_stride = params[14],
                  v_tok_stride = params[15], max_positions = params[16];
    int64_t total_tokens;
    const int rc = check_tables(params, block_tables, context_lens, &total_tokens);
    if (rc != PA_OK) return rc;
    for (int64_t b = 0; b < B; ++b) {
        if (positions[b] < 0 || positions[b] >= max_positions) return PA_ERR_POSITION;
        if (slot_blocks[b] < 0 || slot_blocks[b] >= num_blocks || slot_offsets[b] < 0 || slot_offsets[b] >= block_size)
            return PA_ERR_SLOT;
    }
    const int64_t kv_row = num_kv_heads * D, esize = half ? 2 : 4;
    for (int64_t b = 0; b < B; ++b) {
        float *row = qkv + b * qkv_stride_b;
        rope_rows(row, num_heads + num_kv_heads, (int)D, cos + positions[b] * D, sin + positions[b] * D);
        char *kd = (char *)k_cache + (slot_blocks[b] * k_block_stride + slot_offsets[b] * k_tok_stride) * esize;
        char *vd = (char *)v_cache + (slot_blocks[b] * v_block_stride + slot_offsets[b] * v_tok_stride) * esize;
        store_row(kd, row + num_heads * D, kv_row, half);
        store_row(vd, row + num_heads * D + kv_row, kv_row, half);
    }
    return attend_rows(qkv, k_cache, v_cache, block_tables, context_lens, out, params, scale, num_threads, half,
                       total_tokens);
}

/*
 * Prefill rows: rotate each row's q and k heads as rope_rows does, store k and v at (slot_blocks[t],
 * slot_offsets[t]) of the caches, and write q, k, v head-major for the attention that follows:
 * q_out [num_heads][T][D], k_out and v_out [num_kv_heads][T][D], contiguous, with k and v as the cache holds
 * them (rounded to fp16 and widened back for an fp16 cache). qkv is read, not changed. params: T, num_heads,
 * num_kv_heads, D, block_size, num_blocks, qkv_stride (floats between rows), k_block_stride, k_tok_stride,
 * v_block_stride, v_tok_stride, max_positions. Everything is validated before anything is written.
 */
#define PA_NUM_PREFILL_PARAMS 12

int pa_num_prefill_params(void) { return PA_NUM_PREFILL_PARAMS; }

/* dst = src as a cache of that precision holds it (fp16: rounded to nearest even, widened back). */
static void cached_row(float *dst, const float *src, int64_t n, int half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    int64_t i = 0;
#if PA_F16C
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
#else
    for (; i < n; ++i) dst[i] = half_to_float(float_to_half(src[i]));
#endif
}

static int rope_write_prefill(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                              const int64_t *slot_blocks, const int64_t *slot_offsets, void *k_cache, void *v_cache,
                              float *q_out, float *k_out, float *v_out, const int64_t *params, int num_threads,
                              int half) {
    const int64_t T = params[0], H = params[1], KVH = params[2], D = params[3], block_size = params[4],
                  num_blocks = params[5], stride = params[6], k_block_stride = params[7], k_tok_stride = params[8],
                  v_block_stride = params[9], v_tok_stride = params[10], max_positions = params[11];
    for (int64_t t = 0; t < T; ++t) {
        if (positions[t] < 0 || positions[t] >= max_positions) return PA_ERR_POSITION;
        if (slot_blocks[t] < 0 || slot_blocks[t] >= num_blocks || slot_offsets[t] < 0 || slot_offsets[t] >= block_size)
            return PA_ERR_SLOT;
    }
    const int64_t width = (H + KVH) * D, kv_row = KVH * D, esize = half ? 2 : 4;
    int nt = num_threads > 1 && T * width >= (1 << 15) ? num_threads : 1, failed = 0;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *row = malloc(sizeof(float) * (size_t)(width + kv_row));
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            if (!row) continue;
            const float *src = qkv + t * stride;
            memcpy(row, src, sizeof(float) * (size_t)width);
            rope_rows(row, H + KVH, (int)D, cos + positions[t] * D, sin + positions[t] * D);
            for (int64_t h = 0; h < H; ++h) memcpy(q_out + (h * T + t) * D, row + h * D, sizeof(float) * (size_t)D);
            char *kd = (char *)k_cache + (slot_blocks[t] * k_block_stride + slot_offsets[t] * k_tok_stride) * esize;
            char *vd = (char *)v_cache + (slot_blocks[t] * v_block_stride + slot_offsets[t] * v_tok_stride) * esize;
            store_row(kd, row + H * D, kv_row, half);
            store_row(vd, src + width, kv_row, half);
            float *kc = row + width; /* k as cached, then v as cached */
            cached_row(kc, row + H * D, kv_row, half);
            for (int64_t g = 0; g < KVH; ++g) memcpy(k_out + (g * T + t) * D, kc + g * D, sizeof(float) * (size_t)D);
            cached_row(kc, src + width, kv_row, half);
            for (int64_t g = 0; g < KVH; ++g) memcpy(v_out + (g * T + t) * D, kc + g * D, sizeof(float) * (size_t)D);
        }
        free(row);
    }
    return failed ? PA_ERR_NOMEM : PA_OK;
}

int pa_rope_write_prefill_f32(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                              const int64_t *slot_blocks, const int64_t *slot_offsets, float *k_cache, float *v_cache,
                              float *q_out, float *k_out, float *v_out, const int64_t *params, int num_threads) {
    return rope_write_prefill(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache, q_out, k_out,
                              v_out, params, num_threads, 0);
}

/* k_cache, v_cache: IEEE binary16 bit patterns (torch.float16's storage). */
int pa_rope_write_prefill_f16(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                              const int64_t *slot_blocks, const int64_t *slot_offsets, uint16_t *k_cache,
                              uint16_t *v_cache, float *q_out, float *k_out, float *v_out, const int64_t *params,
                              int num_threads) {
    return rope_write_prefill(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache, q_out, k_out,
                              v_out, params, num_threads, 1);
}

int pa_paged_decode_attention_f32(const float *q, const float *k, const float *v, const int32_t *block_tables,
                                  const int32_t *context_lens, float *out, const int64_t *params, float scale,
                                  int num_threads) {
    return decode_attention(q, k, v, block_tables, context_lens, out, params, scale, num_threads, 0);
}

/* k, v: IEEE binary16 bit patterns (torch.float16's storage). */
int pa_paged_decode_attention_f16(const float *q, const uint16_t *k, const uint16_t *v,
                                  const int32_t *block_tables, const int32_t *context_lens, float *out,
                                  const int64_t *params, float scale, int num_threads) {
    return decode_attention(q, k, v, block_tables, context_lens, out, params, scale, num_threads, 1);
}

int pa_rope_write_decode_attention_f32(float *qkv, const float *cos, const float *sin, const int64_t *positions,
                                       const int64_t *slot_blocks, const int64_t *slot_offsets, float *k_cache,
                                       float *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                                       float *out, const int64_t *params, float scale, int num_threads) {
    return rope_write_decode_attention(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache,
                                       block_tables, context_lens, out, params, scale, num_threads, 0);
}

/* k_cache, v_cache: IEEE binary16 bit patterns (torch.float16's storage). */
int pa_rope_write_decode_attention_f16(float *qkv, const float *cos, const float *sin, const int64_t *positions,
                                       const int64_t *slot_blocks, const int64_t *slot_offsets, uint16_t *k_cache,
                                       uint16_t *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                                       float *out, const int64_t *params, float scale, int num_threads) {
    return rope_write_decode_attention(qkv, cos, sin, positions, slot_blocks, slot_offsets, k_cache, v_cache,
                                       block_tables, context_lens, out, params, scale, num_threads, 1);
}
