/*
 * The expert-parallel executor's bookkeeping around its all-to-alls, CPU. Plain C, loaded with ctypes
 * (see ep_route.py, which holds the torch path of each function beside it and the contracts).
 *
 * One MoE layer call of one rank does, around its two exchanges: split its assignments by where they
 * are computed (ep_split), pack the rows it sends (ep_pack_dense), unpack the rows it received
 * (ep_unpack) and order the terms it adds back (ep_combine_order). Each is a few passes over a few
 * hundred assignments; as tens of small torch ops each (5-10 us apiece on the 2-core VM measured) they
 * cost more per layer than the exchanges. Every output is what the torch path gives, value for value:
 * the same indices in the same order, the same bytes on the wire.
 *
 * Nothing here trusts its indices: a token, expert, rank or slot out of range returns an error code
 * before any output a caller keeps is written.
 */
#include <stdint.h>
#include <string.h>

#define EP_OK 0
#define EP_ERR_INDEX -2 /* a token or expert outside its range */
#define EP_ERR_TABLE -3 /* a replica table or slot map that does not fit the routing */
#define EP_ERR_WIDTH -4 /* more assignments of one token to one rank than the row's width */
#define EP_ERR_ID -5    /* a received expert id outside [-1, E) */
#define EP_ERR_ROWS -6  /* the assignments' rows do not cover each assignment exactly once */

int ep_has_avx2(void) { return 0; } /* scalar code: no SIMD build needed */

int ep_has_openmp(void) { return 0; }

/* Assignment i goes to rank dest[i] = replica_ranks[e][(t + rank) % num_replicas[e]] (e = expert[i],
 * t = token[i]). Those this rank computes are listed in at_early (their expert's local slot below
 * half) or at_late, the others in at_far; each list in ascending i. sizes = {early, late, far}.
 * counts[e] gains the assignments to e, only once everything was valid. */
int ep_split(const int64_t *token, const int64_t *expert, int64_t A, int64_t T, const int64_t *replica_ranks,
             const int64_t *num_replicas, const int64_t *slot_of, int64_t E, int64_t n, int64_t rank, int64_t half,
             int64_t *dest, int64_t *at_early, int64_t *at_late, int64_t *at_far, int64_t *sizes, int64_t *counts) {
    if (A < 0 || T < 0 || E < 1 || n < 1 || rank < 0 || rank >= n) return EP_ERR_INDEX;
    int64_t ne = 0, nl = 0, nf = 0;
    for (int64_t i = 0; i < A; i++) {
        const int64_t t = token[i], e = expert[i];
        if (t < 0 || t >= T || e < 0 || e >= E) return EP_ERR_INDEX;
        const int64_t c = num_replicas[e];
        if (c < 1 || c > n) return EP_ERR_TABLE;
        const int64_t r = replica_ranks[e * n + (t + rank) % c];
        if (r < 0 || r >= n) return EP_ERR_TABLE;
        dest[i] = r;
        if (r != rank) {
            at_far[nf++] = i;
        } else {
            const int64_t s = slot_of[e];
            if (s < 0) return EP_ERR_TABLE; /* routed here, but this rank's bank does not hold e */
            if (s < half) at_early[ne++] = i;
            else at_late[nl++] = i;
        }
    }
    for (int64_t i = 0; i < A; i++) counts[expert[i]]++;
    sizes[0] = ne;
    sizes[1] = nl;
    sizes[2] = nf;
    return EP_OK;
}

/* The dense layout's send rows: for each peer p (the ranks but this one, ascending) and each token t,
 * a row of row_bytes = 4 H + 8 w bytes: x[t] (H floats), then w int32 expert ids (-1 = none), then w
 * fp32 weights (0 = none). The far assignments at_far[0..F) fill their (dest, token) row's columns in
 * that order. sent_at[j] is far assignment j's place in the order the peers return the terms: (row,
 * column) order. sent_terms[r] counts far assignments to rank r; *rows_sent the rows with any.
 * fill: scratch of (n - 1) T int64. */
int ep_pack_dense_f32(const float *x, int64_t ldx, int64_t T, int64_t H, const int64_t *token, const int64_t *expert,
                      const float *weight, const int64_t *dest, int64_t A, const int64_t *at_far, int64_t F, int64_t n,
                      int64_t rank, int64_t w, uint8_t *send, int64_t *fill, int64_t *sent_at, int64_t *sent_terms,
                      int64_t *rows_sent) {
    if (T < 0 || H < 0 || ldx < H || w < 1 || n < 1 || rank < 0 || rank >= n || F < 0) return EP_ERR_INDEX;
    const int64_t peers = n - 1, keys = peers * T, row_bytes = 4 * H + 8 * w;
    for (int64_t j = 0; j < F; j++) {
        const int64_t i = at_far[j];
        if (i < 0 || i >= A || token[i] < 0 || token[i] >= T || dest[i] < 0 || dest[i] >= n || dest[i] == rank)
            return EP_ERR_INDEX;
    }
    memset(fill, 0, sizeof(int64_t) * (size_t)keys);
    memset(sent_terms, 0, sizeof(int64_t) * (size_t)n);
    for (int64_t k = 0; k < keys; k++) {
        uint8_t *row = send + k * row_bytes;
        memcpy(row, x + (k % (T ? T : 1)) * ldx, sizeof(float) * (size_t)H);
        int32_t *ids = (int32_t *)(row + 4 * H);
        float *wts = (float *)(row + 4 * H + 4 * w);
        for (int64_t c = 0; c < w; c++) {
            ids[c] = -1;
            wts[c] = 0.0f;
        }
    }
    for (int64_t j = 0; j < F; j++) {
        const int64_t i = at_far[j], d = dest[i], k = (d - (d > rank)) * T + token[i], place = fill[k]++;
        if (place >= w) return EP_ERR_WIDTH;
        uint8_t *row = send + k * row_bytes;
        ((int32_t *)(row + 4 * H))[place] = (int32_t)expert[i];
        ((float *)(row + 4 * H + 4 * w))[place] = weight[i];
        sent_at[j] = place;
        sent_terms[d]++;
    }
    int64_t start = 0, rows = 0;
    for (int64_t k = 0; k < keys; k++) {
        const int64_t c = fill[k];
        fill[k] = start;
        start += c;
        rows += c > 0;
    }
    for (int64_t j = 0; j < F; j++) {
        const int64_t i = at_far[j], d = dest[i];
        sent_at[j] += fill[(d - (d > rank)) * T + token[i]];
    }
    *rows_sent = rows;
    return EP_OK;
}

/* Received rows of one width (row_bytes = 4 H + 8 w; rows[s] of them from rank s, in rank order): the
 * assignments they carry in (row, column) order, padding (id -1) skipped: token = the row, expert,
 * weight; per_rank[s] counts rank s's. *count = the total. */
int ep_unpack_f32(const uint8_t *got, int64_t R, int64_t H, int64_t w, int64_t E, const int64_t *rows, int64_t n,
                  int64_t *token, int64_t *expert, float *weight, int64_t *per_rank, int64_t *count) {
    if (R < 0 || H < 0 || w < 0 || n < 1) return EP_ERR_INDEX;
    int64_t total = 0;
    for (int64_t s = 0; s < n; s++) {
        if (rows[s] < 0) return EP_ERR_INDEX;
        total += rows[s];
    }
    if (total != R) return EP_ERR_INDEX;
    const int64_t row_bytes = 4 * H + 8 * w;
    for (int64_t r = 0; r < R; r++) {
        const int32_t *ids = (const int32_t *)(got + r * row_bytes + 4 * H);
        for (int64_t c = 0; c < w; c++)
            if (ids[c] < -1 || ids[c] >= E) return EP_ERR_ID;
    }
    int64_t k = 0, r = 0;
    for (int64_t s = 0; s < n; s++) {
        const int64_t first = k;
        for (int64_t end = r + rows[s]; r < end; r++) {
            const int32_t *ids = (const int32_t *)(got + r * row_bytes + 4 * H);
            const float *wts = (const float *)(got + r * row_bytes + 4 * H + 4 * w);
            for (int64_t c = 0; c < w; c++) {
                if (ids[c] < 0) continue;
                token[k] = r;
                expert[k] = ids[c];
                weight[k] = wts[c];
                k++;
            }
        }
        per_rank[s] = k - first;
    }
    *count = k;
    return EP_OK;
}

/* Where each assignment's term lies among (this rank's early terms, its late terms, the peers' returned
 * terms) end to end: early_order[j] is the at_early entry whose term is the j-th early term (late alike),
 * far assignment j's term is returned at sent_at[j]. Writes the assignments sorted by (token, expert)
 * as out_token / out_row: a token's terms in ascending expert id. row: scratch [A]; start: [T + 1]. */
int ep_combine_order(const int64_t *token, const int64_t *expert, int64_t A, int64_t T, const int64_t *at_early,
                     const int64_t *early_order, int64_t ne, const int64_t *at_late, const int64_t *late_order,
                     int64_t nl, const int64_t *at_far, const int64_t *sent_at, int64_t nf, int64_t *row,
                     int64_t *start, int64_t *out_token, int64_t *out_row) {
    if (A < 0 || T < 0 || ne < 0 || nl < 0 || nf < 0 || ne + nl + nf != A) return EP_ERR_ROWS;
    for (int64_t i = 0; i < A; i++) row[i] = -1;
    const int64_t *at[3] = {at_early, at_late, at_far};
    const int64_t *pos[3] = {early_order, late_order, sent_at};
    const int64_t len[3] = {ne, nl, nf}, base[3] = {0, ne, ne + nl};
    for (int part = 0; part < 3; part++) {
        for (int64_t j = 0; j < len[part]; j++) {
            /* early/late: the j-th term is at_*[order[j]]; far: at_far[j]'s term is the sent_at[j]-th */
            const int64_t src = part < 2 ? pos[part][j] : j, slot = part < 2 ? j : pos[part][j];
            if (src < 0 || src >= len[part] || slot < 0 || slot >= len[part]) return EP_ERR_ROWS;
            const int64_t i = at[part][src];
            if (i < 0 || i >= A || row[i] >= 0) return EP_ERR_ROWS;
            row[i] = base[part] + slot;
        }
    }
    for (int64_t t = 0; t <= T; t++) start[t] = 0;
    for (int64_t i = 0; i < A; i++) {
        if (token[i] < 0 || token[i] >= T) return EP_ERR_INDEX;
        start[token[i] + 1]++;
    }
    for (int64_t t = 0; t < T; t++) start[t + 1] += start[t];
    /* Counting sort by token (stable), then each token's few assignments by expert (insertion sort). */
    for (int64_t i = 0; i < A; i++) {
        const int64_t p = start[token[i]]++;
        out_token[p] = i; /* the assignment for now; replaced by its token below */
    }
    for (int64_t t = T; t > 0; t--) start[t] = start[t - 1];
    start[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t *seg = out_token + start[t];
        const int64_t m = start[t + 1] - start[t];
        for (int64_t a = 1; a < m; a++) {
            const int64_t v = seg[a];
            int64_t b = a - 1;
            while (b >= 0 && expert[seg[b]] > expert[v]) {
                seg[b + 1] = seg[b];
                b--;
            }
            seg[b + 1] = v;
        }
    }
    for (int64_t p = 0; p < A; p++) {
        const int64_t i = out_token[p];
        out_row[p] = row[i];
        out_token[p] = token[i];
    }
    return EP_OK;
}
