/*
 * Ordered scatter-add of fp32 rows from several sources, CPU. Plain C, loaded with ctypes (see
 * ordered_add.py).
 *
 *   out      [T, H] rows ldo apart
 *   entries  i = 0 .. A-1, in order: out[token[i]] += row row[i] of the sources taken end to end
 *            (source s holds rows start[s] .. start[s+1]-1, rows lds[s] apart)
 *
 * Every element out[t][h] receives its entries' additions one at a time in entry order, so the result
 * is what torch's index_add_ over the rows gathered into one tensor gives, without that tensor. The
 * expert-parallel combine uses it to add each token's expert outputs in ascending expert id from
 * zero, the outputs lying in three tensors (this rank's two halves and what came back from peers).
 * Threads split the columns, never the entries, so the order holds whatever the thread count.
 */
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define OA_OK 0
#define OA_ERR_SHAPE -1
#define OA_ERR_INDEX -2
#define OA_MAX_SOURCES 8
/* Entries x columns below which one thread does it all: a fork/join costs microseconds. */
#define OA_MIN_PARALLEL_WORK (256 * 1024)
/* Columns per thread chunk: whole cache lines. */
#define OA_COLUMN_CHUNK 64

int oa_has_avx2(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

int oa_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static void add_columns(float *out, int64_t ldo, const float *const *src, const int64_t *lds, const int64_t *start,
                        int nsrc, const int64_t *token, const int64_t *row, int64_t A, int64_t h0, int64_t h1) {
    for (int64_t i = 0; i < A; i++) {
        int s = 0;
        while (s + 1 < nsrc && row[i] >= start[s + 1]) s++;
        const float *in = src[s] + (row[i] - start[s]) * lds[s];
        float *o = out + token[i] * ldo;
        for (int64_t h = h0; h < h1; h++) o[h] += in[h];
    }
}

int oa_ordered_add_f32(float *out, int64_t ldo, int64_t T, int64_t H, const float *const *src, const int64_t *lds,
                       const int64_t *start, int nsrc, const int64_t *token, const int64_t *row, int64_t A,
                       int num_threads) {
    if (T < 0 || H < 0 || A < 0 || ldo < H || nsrc < 1 || nsrc > OA_MAX_SOURCES || start[0] != 0)
        return OA_ERR_SHAPE;
    for (int s = 0; s < nsrc; s++)
        if (start[s + 1] < start[s] || (start[s + 1] - start[s] > 1 && lds[s] < H)) return OA_ERR_SHAPE;
    for (int64_t i = 0; i < A; i++)
        if (token[i] < 0 || token[i] >= T || row[i] < 0 || row[i] >= start[nsrc]) return OA_ERR_INDEX;
    const int64_t chunks = (H + OA_COLUMN_CHUNK - 1) / OA_COLUMN_CHUNK;
    const int nt = (num_threads > 1 && chunks > 1 && A * H >= OA_MIN_PARALLEL_WORK) ? num_threads : 1;
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t h0 = c * OA_COLUMN_CHUNK, h1 = h0 + OA_COLUMN_CHUNK < H ? h0 + OA_COLUMN_CHUNK : H;
        add_columns(out, ldo, src, lds, start, nsrc, token, row, A, h0, h1);
    }
    return OA_OK;
}
