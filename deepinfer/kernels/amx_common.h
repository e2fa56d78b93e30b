/*
 * What the AMX kernels share (quant_amx.h's and dense_amx.h's linear layers, attention_amx.c's prefill attention):
 * asking Linux for the tile state, the tile configuration they all run (8 tiles of 16 rows x 64 bytes), the
 * bf16 packing helpers (splitting fp32 values into bf16 pieces that sum to them exactly, gathering the pieces'
 * bf16 words, the 16 x 16 transpose of 32-bit units that puts pairs in the layout TDPBF16PS reads for its B
 * tile) and AMX_SIX, the product step of the two kernels that work at fp32's accuracy rather than exactly.
 *
 * An includer compiles the functions it calls for AMX_TARGET and calls `amx_request_tiles()` (once per process
 * is enough; each library keeps its own answer) before any tile op.
 */
#ifndef DEEPINFER_AMX_COMMON_H
#define DEEPINFER_AMX_COMMON_H

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")))
#define AMX_TILE_BYTES 1024 /* 16 rows x 64 bytes: 16 x 32 bf16, or 16 x 16 fp32 */

static int amx_state = -1; /* -1 not asked yet, 0 unusable, 1 usable */

/* 1 when this CPU has AMX-BF16, AVX512-BF16 (and F, BW, DQ) and the kernel gave this process the tile data
 * state; 0 otherwise. */
static int amx_request_tiles(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    unsigned a, b, c, d;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 22)) /* tile, bf16 */
             && (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 17));                    /* avx512 f, bw, dq */
    ok = ok && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));                  /* avx512_bf16 */
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): process-wide, idempotent. */
    ok = ok && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    __atomic_store_n(&amx_state, ok, __ATOMIC_RELEASE);
    return ok;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_tilecfg_t;

/* This thread's tiles 0-7 as 16 rows x 64 bytes (release with _tile_release() when done). */
AMX_TARGET static inline void amx_configure_tiles(void) {
    amx_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* v (16 finite or not) split into `n` bf16-exact pieces, high first: each piece but the last is the
 * remainder so far with its low 16 bits cleared; the last is what remains (exact in bf16 when v has at most
 * 8 * n significant bits, as every caller's values do). A non-finite lane keeps its value (a NaN stays a
 * NaN) in the first piece and is zero in the others. */
AMX_TARGET static inline void amx_split(__m512 v, int n, __m512i out[3]) {
    const __m512i hi_half = _mm512_set1_epi32((int)0xffff0000u), quiet = _mm512_set1_epi32(0x00400000);
    const __mmask16 finite = (__mmask16)~_mm512_fpclass_ps_mask(v, 0x99), nan = _mm512_fpclass_ps_mask(v, 0x81);
    __m512i p = _mm512_and_si512(_mm512_castps_si512(v), hi_half);
    out[0] = _mm512_mask_or_epi32(p, nan, p, quiet); /* a NaN whose payload was in the low bits */
    __m512 rem = _mm512_maskz_sub_ps(finite, v, _mm512_castsi512_ps(p));
    for (int i = 1; i < n; i++) {
        p = i == n - 1 ? _mm512_castps_si512(rem) : _mm512_and_si512(_mm512_castps_si512(rem), hi_half);
        out[i] = p;
        rem = _mm512_sub_ps(rem, _mm512_castsi512_ps(p)); /* exact */
    }
}

/* The bf16 (high) words of 32 floats, lo = elements 0-15, hi = 16-31, in element order. */
AMX_TARGET static inline __m512i amx_bf16_words(__m512i lo, __m512i hi) {
    const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(lo, idx, hi);
}

/* tile[i][r] = rows[r][i] for a 16 x 16 matrix of 32-bit values (two unpack stages within 128-bit lanes,
 * then two lane shuffles: 64 shuffles instead of 256 scalar moves). */
AMX_TARGET static inline void amx_transpose16(const __m512i r[16], uint32_t *tile) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c], lane l: rows i..i+3 of column 4 l + c */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        _mm512_store_si512(tile + 16 * c, _mm512_shuffle_i32x4(v0, w0, 0x88));
        _mm512_store_si512(tile + 16 * (8 + c), _mm512_shuffle_i32x4(v0, w0, 0xdd));
        _mm512_store_si512(tile + 16 * (4 + c), _mm512_shuffle_i32x4(v1, w1, 0x88));
        _mm512_store_si512(tile + 16 * (12 + c), _mm512_shuffle_i32x4(v1, w1, 0xdd));
    }
}

/* Buffers a thread keeps between calls (slot 0: what the calling thread packs for the whole call; slot 1: each
 * team thread's own), so a prefill's hundreds of calls do not map, fault in and unmap fresh pages each time
 * (a 1,024-row layer's packed x is ~3.5 MB, past malloc's mmap threshold; faulting it in cost ~0.5 ms a call).
 * Each library that includes this file has its own. A request over AMX_KEEP_BYTES gets a buffer of its own,
 * which amx_buffer_done frees; a kept buffer lives as long as its thread (OpenMP's team threads persist). */
#define AMX_KEEP_BYTES ((size_t)64 << 20)
static __thread void *amx_kept[2];
static __thread size_t amx_kept_bytes[2];

static inline void *amx_buffer(int slot, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes > AMX_KEEP_BYTES) return aligned_alloc(64, bytes);
    if (bytes > amx_kept_bytes[slot]) {
        free(amx_kept[slot]);
        amx_kept[slot] = aligned_alloc(64, bytes);
        amx_kept_bytes[slot] = amx_kept[slot] ? bytes : 0;
    }
    return amx_kept[slot];
}

static inline void amx_buffer_done(int slot, void *p) {
    if (p != amx_kept[slot]) free(p);
}

/* C tile c += the six piece products of A pieces in tiles 0-2 (a1, a2, a3) and the three B pieces at b, b + 512
 * and b + 1024 (bf16 elements): a1 b1, a2 b1, a3 b1, a1 b2, a2 b2, a1 b3. With pieces from amx_split
 * (|a2| < 2^-7 |a|, |a3| < 2^-15 |a|) the three left out are below 2^-21 |a b| together at worst. B pieces go
 * through tiles 3 and 4. */
#define AMX_SIX(c, b)                                                                                          \
    do {                                                                                                       \
        _tile_loadd(3, (b), 64);                                                                               \
        _tile_dpbf16ps(c, 0, 3);                                                                               \
        _tile_dpbf16ps(c, 1, 3);                                                                               \
        _tile_dpbf16ps(c, 2, 3);                                                                               \
        _tile_loadd(4, (b) + 512, 64);                                                                         \
        _tile_dpbf16ps(c, 0, 4);                                                                               \
        _tile_dpbf16ps(c, 1, 4);                                                                               \
        _tile_loadd(3, (b) + 1024, 64);                                                                        \
        _tile_dpbf16ps(c, 0, 3);                                                                               \
    } while (0)

#endif /* DEEPINFER_AMX_COMMON_H */
