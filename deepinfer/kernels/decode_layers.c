/*
 * A decode step's decoder layers in one native call, and the SwiGLU activation (CPU, fp32).
 * Loaded with ctypes (see decode_layers.py).
 *
 * dk_decode_layers runs, for every layer of a Llama-family decoder whose MLP is dense SwiGLU, exactly the
 * calls the model's per-op forward (models/llama.py) makes for a step of decode rows, in the same order, on
 * the same kernels: rms_norm.c's norm (with the residual add), quant_linear.c's or dense_linear.c's
 * products, paged_attention.c's fused rotary + K/V store + decode attention, and dk_silu_mul below.
 * It reaches those kernels through the function pointers in `dk_kernels`, the very entry points the
 * Python wrappers call, so a step run here is bit for bit the per-op step (the tests hold both to it).
 * What it saves is the per-op forward's Python: ~75 us a layer of argument checks, tensor allocations and
 * ctypes conversions at batch 1, 20-30% of a step of SmolLM2 on 2 cores.
 *
 * State carried between layers, as in the per-op forward: x [M, hidden] is the residual stream; `pending`
 * [M, hidden] is the last MLP's output, added to x inside the next layer's first norm. On return x and
 * pending hold what the per-op loop leaves (the caller adds pending inside the final norm).
 *
 * dk_silu_mul: out[i][j] = silu(gu[i][j]) * gu[i][I + j], silu(g) = g / (1 + exp(-g)), rounded after the
 * silu as torch's F.silu(gate) * up is. exp is a Cephes-style polynomial (within ~2 ulp of expf), computed
 * with the same fused operations in the AVX2 lanes and in the scalar tail, so a value's result does not
 * depend on its column or on the row's width. Both the per-op path and the loop call it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DK_AVX2 1
#else
#define DK_AVX2 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

int dk_has_avx2(void) { return DK_AVX2; }

int dk_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * SwiGLU activation */

#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504f /* exp(EXP_LO) is the smallest normal float: 2^n below stays a normal */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f

static inline float exp_scalar(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = floorf(fmaf(x, LOG2E, 0.5f));
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = fmaf(1.9875691500e-4f, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float silu_mul_scalar(float g, float u) {
    const float s = g / (1.0f + exp_scalar(-g));
    return s * u;
}

#if DK_AVX2
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static void silu_mul_row(const float *gu, float *out, int64_t I) {
    int64_t j = 0;
#if DK_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; j + 8 <= I; j += 8) {
        const __m256 g = _mm256_loadu_ps(gu + j);
        const __m256 e = exp_avx2(_mm256_sub_ps(zero, g));
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_loadu_ps(gu + I + j)));
    }
#endif
    for (; j < I; j++) out[j] = silu_mul_scalar(gu[j], gu[I + j]);
}

/* gu [M, 2I] rows ldg apart, out [M, I] rows ldo apart. One thread: at decode sizes a fork costs more than
 * the work, and a row's values do not depend on how rows are split. */
int dk_silu_mul_f32(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t M, int64_t I) {
    if (M < 0 || I <= 0 || ldg < 2 * I || ldo < I) return -1;
    for (int64_t i = 0; i < M; i++) silu_mul_row(gu + i * ldg, out + i * ldo, I);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The layer loop */

typedef int (*dk_quant_fn)(const float *x, int64_t ldx, const void *w, float *y, int64_t ldy, int64_t M, int64_t N,
                           int64_t K, int fmt, int num_threads);
typedef int (*dk_dense_fn)(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                           int64_t K, int num_threads);
typedef int (*dk_norm_fn)(float *x, int64_t ldx, const float *res, int64_t ldr, const float *w, float *out,
                          int64_t ldo, int64_t M, int64_t K, float eps, int num_threads);
typedef int (*dk_attn_fn)(float *qkv, const float *cos, const float *sin, const int64_t *positions,
                          const int64_t *slot_blocks, const int64_t *slot_offsets, void *k_cache, void *v_cache,
                          const int32_t *block_tables, const int32_t *context_lens, float *out,
                          const int64_t *params, float scale, int num_threads);

/* The wrappers' entry points (the same functions their Python callers reach). */
typedef struct {
    dk_quant_fn quant;
    dk_dense_fn dense;
    dk_norm_fn norm;
    dk_attn_fn attn;
} dk_kernels;

/* One projection: packed GGUF blocks (format >= 0, quant_linear's code) or contiguous fp32 (format -1). */
typedef struct {
    const void *data;
    const float *bias; /* [n] or NULL */
    int64_t format, n, k;
} dk_weight;

typedef struct {
    const float *input_norm, *post_norm;
    dk_weight qkv, o, gate_up, down;
} dk_layer;

/* One step's rows and buffers. Sizes: hidden H, q width Q = heads * head_dim, qkv width, intermediate I. */
typedef struct {
    int64_t M, hidden, q_width, qkv_width, intermediate, num_threads;
    float eps, scale;
    float *x, *pending;          /* [M, H] each: the residual stream, the last MLP's output */
    float *h, *qkv, *attn, *o;   /* scratch: [M, H], [M, qkv_width], [M, Q], [M, H] */
    float *gu, *act;             /* scratch: [M, 2I], [M, I] */
    const float *cos, *sin;
    const int64_t *positions, *slot_blocks, *slot_offsets;
    const int32_t *block_tables, *context_lens;
    const int64_t *attn_params;  /* paged_attention's fused parameter block, the same for every layer */
    char *kv;                    /* the pool; layer l's K view starts at kv + l * layer_bytes, V at + v_bytes */
    int64_t layer_bytes, v_bytes;
    int64_t fail_layer, fail_stage; /* out: where a kernel refused (stage 0 norm .. 7 down) */
} dk_step;

static int project(const dk_kernels *kn, const dk_weight *w, const float *x, float *y, int64_t M, int nt) {
    const int rc = w->format >= 0 ? kn->quant(x, w->k, w->data, y, w->n, M, w->n, w->k, (int)w->format, nt)
                                  : kn->dense(x, w->k, (const float *)w->data, y, w->n, M, w->n, w->k, nt);
    if (rc == 0 && w->bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < w->n; j++) y[i * w->n + j] += w->bias[j];
    return rc;
}

#define DK_RUN(stage, call)                     \
    do {                                        \
        const int rc_ = (call);                 \
        if (rc_) {                              \
            s->fail_layer = l;                  \
            s->fail_stage = (stage);            \
            return rc_;                         \
        }                                       \
    } while (0)

int dk_decode_layers(const dk_kernels *kn, const dk_layer *layers, int64_t num_layers, dk_step *s) {
    const int64_t M = s->M, H = s->hidden;
    const int nt = (int)s->num_threads;
    s->fail_layer = s->fail_stage = -1;
    if (M <= 0 || num_layers < 0 || nt < 1) return -100;
    for (int64_t l = 0; l < num_layers; l++) {
        const dk_layer *L = layers + l;
        const float *res = l > 0 ? s->pending : NULL;
        DK_RUN(0, kn->norm(s->x, H, res, H, L->input_norm, s->h, H, M, H, s->eps, nt));
        DK_RUN(1, project(kn, &L->qkv, s->h, s->qkv, M, nt));
        char *k_view = s->kv + l * s->layer_bytes;
        DK_RUN(2, kn->attn(s->qkv, s->cos, s->sin, s->positions, s->slot_blocks, s->slot_offsets, k_view,
                           k_view + s->v_bytes, s->block_tables, s->context_lens, s->attn, s->attn_params, s->scale,
                           nt));
        DK_RUN(3, project(kn, &L->o, s->attn, s->o, M, nt));
        DK_RUN(4, kn->norm(s->x, H, s->o, H, L->post_norm, s->h, H, M, H, s->eps, nt));
        DK_RUN(5, project(kn, &L->gate_up, s->h, s->gu, M, nt));
        DK_RUN(6, dk_silu_mul_f32(s->gu, 2 * s->intermediate, s->act, s->intermediate, M, s->intermediate));
        DK_RUN(7, project(kn, &L->down, s->act, s->pending, M, nt));
    }
    return 0;
}
