/*
 * Causal prefill attention on AMX tiles at fp32's accuracy (attention_amx.py wraps it).
 *
 * out[i, h] = softmax_j(scale * q[h, i] . k[g, j]) v[g, j] over keys j <= (Tk - Tq) + i, g = h / (H / Hkv):
 * a chunk's Tq queries are the last Tq of its Tk positions (Tq == Tk for a prompt with no earlier context).
 *
 * Accuracy. TDPBF16PS multiplies bf16 pairs exactly and accumulates in fp32. Every fp32 input (q, k, the
 * probabilities p, v) is split into three bf16 pieces that sum to it exactly (amx_common.h), a = a1 + a2 + a3,
 * |a2| < 2^-7 |a| and |a3| < 2^-15 |a|. A product a b is taken as the six piece products a1 b1, a1 b2, a2 b1,
 * a1 b3, a2 b2, a3 b1 (AMX_SIX); the three left out are below 2^-21 |a b| together at worst (a few fp32 ulps of
 * the product; far less on average), the size of the rounding an fp32 dot product's sums add anyway: against
 * float64 the outputs' errors are SDPA's or smaller (tests/unit/test_attention_amx.py). A
 * bf16 subnormal reads as zero, so pieces below 2^-126 are lost (inputs under ~2^-110, far from any real
 * activation).
 *
 * Per work item (a head and a tile of 16 queries) the kernel makes three passes over the keys the tile
 * sees: every score into a per-thread panel (16 x keys, fp32), the softmax of each row with its exact
 * maximum (exp is a degree-6 polynomial on the reduced argument with vscalefps, within ~1 ulp; keys a row
 * does not see get probability exactly 0), then O = P V accumulated in tiles across all keys, normalised
 * at the end. Unlike the online (flash) form, no rescaling of O between key blocks, so O never leaves the
 * tiles until it is done (the online form, tried first, spent half its time moving O through memory).
 *
 * Layouts (bf16 tiles of 16 rows x 64 bytes):
 *   kp [Hkv][Tk32 / 16 key tiles][D / 32][3 pieces][16 dim pairs][16 keys][2]   B tiles of S = Q K^T
 *   vp [Hkv][Tk32 / 32 key blocks][D / 16][3 pieces][16 key pairs][16 dims][2]  B tiles of O = P V
 *   per work item (fa_scratch): qp [D / 32][3][16 rows][32 dims] and pp [key blocks][3][16 rows][32 keys],
 *   the A tiles; sp [16][keys seen] fp32, the scores and then the probabilities; ob [16][D], the output
 * Tk32 is Tk rounded up to 32; keys past Tk are zero and masked. Work items are handed out dynamically,
 * longest first; each is computed by one thread in one fixed order, so results do not depend on the thread
 * count. Memory per call: the packed K and V (12 bytes per key and dim per KV head) and ~160 bytes per
 * key per thread, kept between calls up to AMX_KEEP_BYTES (amx_common.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define FA_OK 0
#define FA_ERR_SHAPE -1 /* D not a multiple of 32 in 32..256, H not a multiple of Hkv, Tq > Tk, a bad stride */
#define FA_ERR_NOMEM -4
#define FA_ERR_AMX -5   /* no AMX tiles on this CPU, or the OS refused them */
#define FA_MAX_D 256
/* Key blocks (of 32) per chunk: the score panel (16 x 32 FA_CHUNK fp32, 64 KiB) and the probability pieces
 * (96 KiB) of one chunk stay in L2 however long the context. */
#ifndef FA_CHUNK
#define FA_CHUNK 32
#endif

int fa_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

int fa_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int fa_max_head_dim(void) { return FA_MAX_D; }

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#include "amx_common.h"

int fa_amx_ready(void) { return amx_request_tiles(); }

/* e^x for x <= 0 (the arguments here are s - max); lanes below -87 give ~e^-87, which callers mask to 0. */
AMX_TARGET static inline __m512 fa_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln 2, high bits: n * it is exact */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);   /* the rest of ln 2 */
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One row of 32 fp32 values (NULL: zeros) as the three pieces' bf16 words, each 32 wide in element order. */
AMX_TARGET static inline void fa_pieces32(const float *src, __m512i out[3]) {
    __m512i lo[3], hi[3];
    if (!src) {
        for (int p = 0; p < 3; p++) out[p] = _mm512_setzero_si512();
        return;
    }
    amx_split(_mm512_loadu_ps(src), 3, lo);
    amx_split(_mm512_loadu_ps(src + 16), 3, hi);
    for (int p = 0; p < 3; p++) out[p] = amx_bf16_words(lo[p], hi[p]);
}

/* Key block kb (32 keys from 32 kb) of one KV head into its kp and vp tiles. */
AMX_TARGET static void fa_pack_kv(const float *k, const float *v, int64_t rs, int64_t Tk, int64_t D, int64_t kb,
                                  uint16_t *kp, uint16_t *vp) {
    const int64_t dh = D / 32;
    for (int c = 0; c < 2; c++) { /* two key tiles of 16 */
        uint16_t *dst = kp + (2 * kb + c) * dh * 3 * 512;
        for (int64_t h = 0; h < dh; h++) {
            __m512i rows[3][16];
            for (int j = 0; j < 16; j++) {
                const int64_t key = 32 * kb + 16 * c + j;
                __m512i w[3];
                fa_pieces32(key < Tk ? k + key * rs + 32 * h : NULL, w);
                for (int p = 0; p < 3; p++) rows[p][j] = w[p];
            }
            for (int p = 0; p < 3; p++) amx_transpose16(rows[p], (uint32_t *)(dst + (h * 3 + p) * 512));
        }
    }
    /* vp: unit [r][c] = (v[2r][c], v[2r + 1][c]): the even key's bf16 in the low half */
    const __m512i low_half = _mm512_set1_epi32(0xffff);
    for (int64_t n = 0; n < D / 16; n++) {
        uint16_t *dst = vp + (kb * (D / 16) + n) * 3 * 512;
        for (int r = 0; r < 16; r++) {
            const int64_t k0 = 32 * kb + 2 * r;
            __m512i a[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            __m512i b[3] = {a[0], a[1], a[2]};
            if (k0 < Tk) amx_split(_mm512_loadu_ps(v + k0 * rs + 16 * n), 3, a);
            if (k0 + 1 < Tk) amx_split(_mm512_loadu_ps(v + (k0 + 1) * rs + 16 * n), 3, b);
            for (int p = 0; p < 3; p++)
                _mm512_store_si512(dst + p * 512 + 32 * r,
                                   _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a[p], 16), low_half),
                                                   _mm512_andnot_si512(low_half, b[p])));
        }
    }
}

/* C tile c += the six piece products (AMX_SIX in amx_common.h), with the B pieces loaded through tile 3 alone,
 * where tiles 4-7 hold accumulators. */
#define FA_SIX1(c, b)                                                                                          \
    do {                                                                                                       \
        _tile_loadd(3, (b), 64);                                                                               \
        _tile_dpbf16ps(c, 0, 3);                                                                               \
        _tile_dpbf16ps(c, 1, 3);                                                                               \
        _tile_dpbf16ps(c, 2, 3);                                                                               \
        _tile_loadd(3, (b) + 512, 64);                                                                         \
        _tile_dpbf16ps(c, 0, 3);                                                                               \
        _tile_dpbf16ps(c, 1, 3);                                                                               \
        _tile_loadd(3, (b) + 1024, 64);                                                                        \
        _tile_dpbf16ps(c, 0, 3);                                                                               \
    } while (0)

typedef struct {
    const float *q;
    int64_t q_hs, q_rs; /* q[h][i][d] at q + h q_hs + i q_rs + d */
    float *out;
    int64_t o_hs, o_rs;
    int64_t H, Hkv, Tq, Tk, D;
    float scale;
} fa_args;

/* Per-thread scratch for one work item, in floats-or-bf16 units as laid out by fa_scratch_bytes. */
typedef struct {
    uint16_t *qp; /* [D / 32][3][16][32]: the item's queries, A tiles */
    float *sp;    /* [16][32 chunk blocks]: a chunk's scores, then its probabilities */
    uint16_t *pp; /* [chunk blocks][3][16][32]: the probabilities' pieces, A tiles */
    float *ob;    /* [16][D]: the output tiles */
} fa_scratch;

static size_t fa_scratch_bytes(int64_t D, int64_t kblocks) {
    return (size_t)((D / 32) * 3) * AMX_TILE_BYTES + (size_t)(16 * 32 * 4) * kblocks +
           (size_t)(3 * kblocks) * AMX_TILE_BYTES + (size_t)(16 * 4) * D;
}

static fa_scratch fa_scratch_at(uint8_t *mem, int64_t D, int64_t kblocks) {
    fa_scratch w;
    w.qp = (uint16_t *)mem;
    w.sp = (float *)(mem + (D / 32) * 3 * AMX_TILE_BYTES);
    w.pp = (uint16_t *)(w.sp + 16 * 32 * kblocks);
    w.ob = (float *)(w.pp + kblocks * 3 * 512);
    return w;
}

/* Queries 16 t .. 16 t + 15 of head h. The keys they see are taken in chunks of FA_CHUNK blocks of 32, each in
 * three passes: every score of the chunk to the sp panel (tiles 5-6 per block); each row's softmax over the
 * chunk against the row's running maximum (exact within one chunk; across chunks the online rescaling, by
 * exp(m_old - m_new), of the row's sum and of its output rows, which are in memory between chunks); then
 * O += P V in tiles 4-7 over the chunk's blocks, up to 64 output dims a pass. Within a chunk O stays in the
 * tiles, so it goes through memory once a chunk instead of once a block (the per-block online form, tried
 * first, spent half its time doing that), and the panels stay cache-sized however long the context. */
AMX_TARGET static void fa_item(const fa_args *a, const uint16_t *kp, const uint16_t *vp, int64_t h, int64_t t,
                               const fa_scratch *w) {
    const int64_t D = a->D, dh = D / 32, dt = D / 16, g = h / (a->H / a->Hkv), offset = a->Tk - a->Tq;
    const int64_t kblocks_all = (a->Tk + 31) / 32;
    const uint16_t *kph = kp + g * kblocks_all * 2 * dh * 3 * 512, *vph = vp + g * kblocks_all * dt * 3 * 512;
    for (int r = 0; r < 16; r++) {
        const int64_t i = 16 * t + r;
        for (int64_t c = 0; c < dh; c++) {
            __m512i pc[3];
            fa_pieces32(i < a->Tq ? a->q + h * a->q_hs + i * a->q_rs + 32 * c : NULL, pc);
            for (int p = 0; p < 3; p++) _mm512_store_si512(w->qp + (c * 3 + p) * 512 + 32 * r, pc[p]);
        }
    }
    const int64_t last = 16 * t + 15 < a->Tq ? 16 * t + 15 : a->Tq - 1; /* the tile's last real query */
    const int64_t nblocks = (offset + last) / 32 + 1;
    const __m512 scale = _mm512_set1_ps(a->scale);
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                           25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    float m[16], l[16];
    for (int r = 0; r < 16; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(w->ob, 0, sizeof(float) * 16 * D);
    for (int64_t c0 = 0; c0 < nblocks; c0 += FA_CHUNK) {
        const int64_t c1 = c0 + FA_CHUNK < nblocks ? c0 + FA_CHUNK : nblocks, W = 32 * (c1 - c0);
        /* 1. scores of keys 32 c0 .. 32 c1 - 1 */
        for (int64_t kb = c0; kb < c1; kb++) {
            _tile_zero(5);
            _tile_zero(6);
            for (int64_t c = 0; c < dh; c++) {
                _tile_loadd(0, w->qp + c * 3 * 512, 64);
                _tile_loadd(1, w->qp + (c * 3 + 1) * 512, 64);
                _tile_loadd(2, w->qp + (c * 3 + 2) * 512, 64);
                AMX_SIX(5, kph + ((2 * kb) * dh + c) * 3 * 512);
                AMX_SIX(6, kph + ((2 * kb + 1) * dh + c) * 3 * 512);
            }
            _tile_stored(5, w->sp + 32 * (kb - c0), W * 4);
            _tile_stored(6, w->sp + 32 * (kb - c0) + 16, W * 4);
        }
        /* 2. softmax per row over the chunk's keys it sees (up to offset + its index, below Tk), and the pieces
         * of p; a row past Tq, or one that sees none of the chunk, gets p = 0. Scores are finite (finite
         * inputs) and p is in [0, 1], so the split needs none of amx_split's care for infinities and NaNs. */
        for (int r = 0; r < 16; r++) {
            const int64_t i = 16 * t + r, lim = i < a->Tq ? offset + i + 1 - 32 * c0 : 0;
            const int64_t seen = lim < 0 ? 0 : lim < W ? lim : W; /* the chunk's keys 0 .. seen - 1 */
            float *row = w->sp + r * W;
            const int64_t full = seen / 16;
            const __mmask16 tail = (__mmask16)((1u << (seen % 16)) - 1u);
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t v = 0; v < full; v++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + 16 * v));
            if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(row + 16 * full));
            /* scale > 0, so the scaled maximum is the maximum of the scaled scores */
            const float chunk_max = seen ? _mm512_reduce_max_ps(mx) * a->scale : -INFINITY;
            const float m_new = chunk_max > m[r] ? chunk_max : m[r];
            if (m_new > m[r] && m[r] != -INFINITY) { /* the running maximum grew: rescale what came before */
                const float alpha = _mm512_cvtss_f32(fa_exp(_mm512_set1_ps(m[r] - m_new)));
                l[r] *= alpha;
                const __m512 av = _mm512_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(w->ob + r * D + d, _mm512_mul_ps(_mm512_load_ps(w->ob + r * D + d), av));
            }
            m[r] = m_new;
            const __m512 mv = _mm512_set1_ps(m_new == -INFINITY ? 0.0f : m_new);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t kb = 0; kb < c1 - c0; kb++) {
                __m512i lo[3], hi[3];
                for (int half = 0; half < 2; half++) {
                    const int64_t v = 2 * kb + half;
                    __m512 p = _mm512_setzero_ps();
                    if (v < full) p = fa_exp(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v), scale, mv));
                    else if (v == full && tail)
                        p = _mm512_maskz_mov_ps(tail, fa_exp(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v), scale, mv)));
                    sum = _mm512_add_ps(sum, p);
                    __m512i *out = half ? hi : lo;
                    out[0] = _mm512_and_si512(_mm512_castps_si512(p), hi16);
                    const __m512 r1 = _mm512_sub_ps(p, _mm512_castsi512_ps(out[0])); /* exact, as the two below */
                    out[1] = _mm512_and_si512(_mm512_castps_si512(r1), hi16);
                    out[2] = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(out[1])));
                }
                for (int q = 0; q < 3; q++)
                    _mm512_store_si512(w->pp + (kb * 3 + q) * 512 + 32 * r, _mm512_permutex2var_epi16(lo[q], words, hi[q]));
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        /* 3. O += P V, output dims 64 n0 .. + 63 in tiles 4-7, loaded from and stored back to ob */
        for (int64_t n0 = 0; n0 < dt; n0 += 4) {
            const int64_t nn = dt - n0 < 4 ? dt - n0 : 4;
            _tile_loadd(4, w->ob + 16 * n0, D * 4);
            if (nn > 1) _tile_loadd(5, w->ob + 16 * (n0 + 1), D * 4);
            if (nn > 2) _tile_loadd(6, w->ob + 16 * (n0 + 2), D * 4);
            if (nn > 3) _tile_loadd(7, w->ob + 16 * (n0 + 3), D * 4);
            for (int64_t kb = c0; kb < c1; kb++) {
                _tile_loadd(0, w->pp + (kb - c0) * 3 * 512, 64);
                _tile_loadd(1, w->pp + ((kb - c0) * 3 + 1) * 512, 64);
                _tile_loadd(2, w->pp + ((kb - c0) * 3 + 2) * 512, 64);
                const uint16_t *b = vph + (kb * dt + n0) * 3 * 512;
                FA_SIX1(4, b);
                if (nn > 1) FA_SIX1(5, b + 3 * 512);
                if (nn > 2) FA_SIX1(6, b + 6 * 512);
                if (nn > 3) FA_SIX1(7, b + 9 * 512);
            }
            _tile_stored(4, w->ob + 16 * n0, D * 4);
            if (nn > 1) _tile_stored(5, w->ob + 16 * (n0 + 1), D * 4);
            if (nn > 2) _tile_stored(6, w->ob + 16 * (n0 + 2), D * 4);
            if (nn > 3) _tile_stored(7, w->ob + 16 * (n0 + 3), D * 4);
        }
    }
    for (int r = 0; r < 16 && 16 * t + r < a->Tq; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        float *dst = a->out + h * a->o_hs + (16 * t + r) * a->o_rs;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w->ob + r * D + d), inv));
    }
}

AMX_TARGET static int fa_run(const fa_args *a, const float *k, const float *v, int64_t kv_hs, int64_t kv_rs,
                             int num_threads) {
    const int64_t D = a->D, kblocks = (a->Tk + 31) / 32, qtiles = (a->Tq + 15) / 16;
    const size_t kv_half = (size_t)(a->Hkv * kblocks * 32 * D * 3) * sizeof(uint16_t);
    uint16_t *kp = amx_buffer(0, 2 * kv_half), *vp = kp ? kp + kv_half / sizeof(uint16_t) : NULL;
    int failed = !kp;
    const int64_t items = a->H * qtiles;
    const int nthr = num_threads < 1 ? 1 : (int64_t)num_threads > items ? (int)items : num_threads;
    (void)nthr;
    /* kp is the same for every thread, so all of them meet both worksharing loops or none does; a thread whose
     * scratch could not be allocated still takes its turn in the item loop, doing nothing. */
#pragma omp parallel num_threads(nthr) if (nthr > 1 && kp)
    {
        if (kp) {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < a->Hkv * kblocks; it++) {
                const int64_t g = it / kblocks, kb = it % kblocks;
                fa_pack_kv(k + g * kv_hs, v + g * kv_hs, kv_rs, a->Tk, D, kb, kp + g * kblocks * 2 * (D / 32) * 3 * 512,
                           vp + g * kblocks * (D / 16) * 3 * 512);
            }
            const int64_t chunk = kblocks < FA_CHUNK ? kblocks : FA_CHUNK;
            uint8_t *mem = amx_buffer(1, fa_scratch_bytes(D, chunk));
            if (!mem) {
#pragma omp atomic write
                failed = 1;
            }
            const fa_scratch w = mem ? fa_scratch_at(mem, D, chunk) : (fa_scratch){0};
            if (mem) amx_configure_tiles();
            /* KV head by KV head (its packed K and V, 12 bytes per key and dim, stay in the threads' L2 while its
             * heads' items run: with the heads of all KV heads interleaved, 2,048 keys ran at 1.46x SDPA against
             * 1.83x at 1,024), and within one its longest items first: query tile qtiles - 1 of each of its
             * heads, then qtiles - 2, ... */
            const int64_t group = a->H / a->Hkv;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                if (!mem) continue;
                const int64_t g = it / (qtiles * group), r = it % (qtiles * group);
                fa_item(a, kp, vp, g * group + r % group, qtiles - 1 - r / group, &w);
            }
            if (mem) {
                _tile_release();
                amx_buffer_done(1, mem);
            }
        }
    }
    if (kp) amx_buffer_done(0, kp);
    return failed ? FA_ERR_NOMEM : FA_OK;
}

/* See the top of this file. q rows are q_rs floats apart within a head, heads q_hs apart (k and v: kv_rs,
 * kv_hs; out: o_rs, o_hs); the last dimension is contiguous everywhere. */
int fa_prefill_f32(const float *q, int64_t q_hs, int64_t q_rs, const float *k, const float *v, int64_t kv_hs,
                   int64_t kv_rs, float *out, int64_t o_hs, int64_t o_rs, int64_t H, int64_t Hkv, int64_t Tq,
                   int64_t Tk, int64_t D, float scale, int num_threads) {
    if (D < 32 || D > FA_MAX_D || D % 32 || H < 1 || Hkv < 1 || H % Hkv || Tq < 0 || Tq > Tk || q_rs < D ||
        kv_rs < D || o_rs < D)
        return FA_ERR_SHAPE;
    if (Tq == 0) return FA_OK;
    if (!amx_request_tiles()) return FA_ERR_AMX;
    const fa_args a = {q, q_hs, q_rs, out, o_hs, o_rs, H, Hkv, Tq, Tk, D, scale};
    return fa_run(&a, k, v, kv_hs, kv_rs, num_threads);
}

#else
int fa_amx_ready(void) { return 0; }
int fa_prefill_f32(const float *q, int64_t q_hs, int64_t q_rs, const float *k, const float *v, int64_t kv_hs,
                   int64_t kv_rs, float *out, int64_t o_hs, int64_t o_rs, int64_t H, int64_t Hkv, int64_t Tq,
                   int64_t Tk, int64_t D, float scale, int num_threads) {
    (void)q, (void)q_hs, (void)q_rs, (void)k, (void)v, (void)kv_hs, (void)kv_rs, (void)out, (void)o_hs, (void)o_rs;
    (void)H, (void)Hkv, (void)Tq, (void)Tk, (void)D, (void)scale, (void)num_threads;
    return FA_ERR_AMX;
}
#endif
