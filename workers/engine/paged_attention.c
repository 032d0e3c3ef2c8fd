/* Paged attention for the CPU engine: see workers/engine/paged_attention.py.

   Each (token, query head) reads its own visible keys, listed by pool position in
   sequence order, and nothing else: its output is a function of that list alone,
   whatever the batch around it. Every sum runs in one fixed order over 8 lanes:
   the dot product over the head size, the softmax total and the weighted values
   over the keys in list order.

   Before attending, the same call applies the rotary position embedding to the new
   tokens' queries and keys and writes their keys and values into the pool, each
   element as torch computes x * cos + rotate_half(x) * sin in the cache's dtype: both
   products and the sum rounded to it (bfloat16: to nearest, ties to even).

   A key/value head's query heads (rep of them, up to GROUP) go over its keys together,
   each key and value read once for them all, every head's sums as if it were alone. The
   (token, group) items are shared between the caller and the helpers of a pool (pool.h),
   an item whole to one thread, so the output does not depend on the threads.

   The blocks' other small ops are here too (RMS norm, the residual add fused with the next
   norm, SwiGLU), and `blocks_bf16`, every decoder block of a bfloat16 forward in one call,
   which calls the bfloat16 kernel's products (bf16_linear.c) through a pointer.

   Shapes: N tokens, H query heads, Hkv key/value heads (rep = H / Hkv query heads
   each), P pool positions, D head size (a multiple of 8, at most MAX_DIM), M
   listed keys in all; E hidden size, F MLP width. */

#define _GNU_SOURCE /* pool.h names its threads */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"

#define LANES 8
#define MAX_DIM 512

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f bits_to_float(v8i bits) {
    v8f x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline v8i float_to_bits(v8f x) {
    v8i bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* 8 values of a pool (float32, or bfloat16 widened exactly) from element `at` on */
static inline __attribute__((always_inline)) v8f load(const void *pool, int64_t at, int bf16) {
    if (!bf16) return *(const v8f_u *)((const float *)pool + at);
    v8u wide = __builtin_convertvector(*(const v8h_u *)((const uint16_t *)pool + at), v8u);
    return bits_to_float((v8i)(wide << 16));
}

/* a where `take` (all ones), else b */
static inline v8f blend(v8i take, v8f a, v8f b) {
    return bits_to_float((take & float_to_bits(a)) | (~take & float_to_bits(b)));
}

static inline float lane_sum(v8f a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* lane_sum of each of LANES vectors, as one vector: the same sums in the same order */
static inline v8f lane_sums(const v8f d[LANES]) {
    v8f t[4], u[2]; /* t: each vector's a_i + a_(i+4), two vectors a t; u: then their pairs */
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(d[2 * i], d[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 1, 3, 5, 7, 9, 11, 13, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* e^x for x <= 0 (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, degree-6 polynomial), the same
   arithmetic in every lane; below -87 it gives e^-87 instead of a subnormal. */
static inline v8f exp8(v8f x) {
    const v8f magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    x = blend(x < splat(-87.0f), splat(-87.0f), x);
    v8f n = (x * splat(1.44269504088896341f) + magic) - magic;
    v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8f y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * (r * r) + r + splat(1.0f);
    return y * bits_to_float((__builtin_convertvector(n, v8i) + 127) << 23);
}

#define GROUP 4 /* most query heads of one key/value head attended together */

/* In the attention every product is rounded before its sum: the compiler fuses none into a
   multiply-add, so a sum's bits never depend on how the code around it is arranged (how
   many heads share a pass over the keys: the threads and the batch decide that). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* `rep` query heads of one key/value head over their keys, each as if alone: o_r =
   softmax(q_r . k_j * scale) . v_j, j in list order; each key and value is read once for
   them all. q, o: (rep, D); k, v: the key/value head's pool (P, D); p: scratch of `stride`
   floats per head, the count rounded up to LANES. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *q, const void *k, const void *v, const int64_t *pos, int64_t count,
    int64_t dim, float scale, float *p, int64_t stride, float *o, int rep, int bf16) {
    const int64_t vecs = dim / LANES;
    v8f qs[GROUP][MAX_DIM / LANES], acc[GROUP][MAX_DIM / LANES], total[GROUP];
    float top[GROUP];
    for (int r = 0; r < rep; r++) {
        for (int64_t i = 0; i < vecs; i++) {
            qs[r][i] = *(const v8f_u *)(q + r * dim + i * LANES) * splat(scale);
            acc[r][i] = splat(0.0f);
        }
        top[r] = -__builtin_inff();
        total[r] = splat(0.0f);
    }
    for (int64_t j0 = 0; j0 < count; j0 += LANES) { /* scores, LANES keys at a time */
        const int64_t keys = count - j0 < LANES ? count - j0 : LANES;
        v8f dots[GROUP][LANES];
        for (int64_t jj = 0; jj < LANES; jj++) {
            v8f dot[GROUP];
            for (int r = 0; r < rep; r++) dot[r] = splat(0.0f);
            for (int64_t i = 0; jj < keys && i < vecs; i++) {
                const v8f key = load(k, pos[j0 + jj] * dim + i * LANES, bf16);
                for (int r = 0; r < rep; r++) dot[r] += qs[r][i] * key;
            }
            for (int r = 0; r < rep; r++) dots[r][jj] = dot[r];
        }
        for (int r = 0; r < rep; r++) {
            const v8f scores = lane_sums(dots[r]);
            *(v8f *)(p + r * stride + j0) = scores;
            for (int64_t jj = 0; jj < keys; jj++)
                top[r] = scores[jj] > top[r] ? scores[jj] : top[r];
        }
    }
    for (int r = 0; r < rep; r++) /* p_j = exp(s_j - top); past the count 0 */
        for (int64_t j = 0; j < count; j += LANES) {
            float *at = p + r * stride + j;
            const v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)j;
            v8f e = blend(lane < (int32_t)count, exp8(*(v8f *)at - splat(top[r])), splat(0.0f));
            *(v8f *)at = e;
            total[r] += e;
        }
    for (int64_t j = 0; j < count; j++) /* sum of p_j v_j, key after key */
        for (int64_t i = 0; i < vecs; i++) {
            const v8f value = load(v, pos[j] * dim + i * LANES, bf16);
            for (int r = 0; r < rep; r++) acc[r][i] += splat(p[r * stride + j]) * value;
        }
    for (int r = 0; r < rep; r++) {
        const v8f sum = splat(lane_sum(total[r]));
        for (int64_t i = 0; i < vecs; i++) *(v8f_u *)(o + r * dim + i * LANES) = acc[r][i] / sum;
    }
}

/* A layer's attention: q, out (N, H, D) float32; k_pool, v_pool (Hkv, P, D); token n reads
   the keys at pool positions keys[starts[n]] .. keys[starts[n + 1] - 1]; p: a scratch of
   GROUP * `scratch` floats per worker of the pool. */
typedef struct {
    const float *q;
    const void *k_pool, *v_pool;
    const int64_t *keys, *starts;
    float *out, *p;
    int64_t heads, kv_heads, pool, dim, scratch, group; /* group: query heads an item takes */
    float scale;
    int bf16;
} attention;

/* a group of up to GROUP query heads, with the count a constant */
static inline __attribute__((always_inline)) void attend_group(
    const attention *a, const float *q, const void *k, const void *v, int64_t n, float *p,
    float *o, int group, int bf16) {
    const int64_t *pos = a->keys + a->starts[n], count = a->starts[n + 1] - a->starts[n];
    switch (group) {
    case 4: attend_heads(q, k, v, pos, count, a->dim, a->scale, p, a->scratch, o, 4, bf16); break;
    case 3: attend_heads(q, k, v, pos, count, a->dim, a->scale, p, a->scratch, o, 3, bf16); break;
    case 2: attend_heads(q, k, v, pos, count, a->dim, a->scale, p, a->scratch, o, 2, bf16); break;
    default: attend_heads(q, k, v, pos, count, a->dim, a->scale, p, a->scratch, o, 1, bf16);
    }
}

/* item (n * Hkv + g) * parts + part: of token n's query heads on key/value head g, the
   part-th run of up to `group` (rep = H / Hkv heads in parts of `group`) */
static void attend_item(const void *arg, int64_t item, int worker) {
    const attention *a = arg;
    const int64_t rep = a->heads / a->kv_heads, parts = (rep + a->group - 1) / a->group;
    const int64_t n = item / parts / a->kv_heads, g = item / parts % a->kv_heads;
    const int64_t h = g * rep + item % parts * a->group;
    const int group = (int)((g + 1) * rep - h < a->group ? (g + 1) * rep - h : a->group);
    const size_t offset = (size_t)(g * a->pool * a->dim) * (a->bf16 ? 2 : 4);
    const void *k = (const char *)a->k_pool + offset, *v = (const char *)a->v_pool + offset;
    float *p = a->p + worker * GROUP * a->scratch;
    const int64_t row = (n * a->heads + h) * a->dim;
    if (a->bf16) attend_group(a, a->q + row, k, v, n, p, a->out + row, group, 1);
    else attend_group(a, a->q + row, k, v, n, p, a->out + row, group, 0);
}

#pragma GCC pop_options

/* x rounded to the cache's dtype. A float32 result goes through memory, so that the
   compiler cannot fuse a product with the sum after it (torch rounds each op). */
static inline float rounded(float x, int bf16) {
    if (bf16) return bf16_to_float(float_to_bf16(x));
    volatile float kept = x;
    return kept;
}

static inline float element(const void *at, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)at)[i]) : ((const float *)at)[i];
}

static inline void store(void *at, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)at)[i] = float_to_bf16(x); /* exact: x is a bfloat16 value */
    else
        ((float *)at)[i] = x;
}

/* y = x * cos + rotate_half(x) * sin for one head of D, rotate_half(x) = (-x2, x1) */
static void rope(const void *x, const void *cos, const void *sin, int64_t dim, int bf16,
                 float *y) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) {
        const float xi = element(x, i, bf16);
        const float turned = i < half ? -element(x, i + half, bf16) : element(x, i - half, bf16);
        const float a = rounded(xi * element(cos, i, bf16), bf16);
        const float b = rounded(turned * element(sin, i, bf16), bf16);
        y[i] = rounded(a + b, bf16);
    }
}

/* qkv: (N, (H + 2 Hkv) D), each token's projected queries, keys and values side by side;
   cos, sin: (N, D); positions: (N,) the pool position each token's key and value go to;
   out: (N, H, D), all in the cache's dtype; helpers: a pool or NULL. 0: done; 1: bad
   arguments; 2: out of memory. */
static inline __attribute__((always_inline)) int rope_attend(
    thread_pool *helpers, const void *qkv, const void *cos, const void *sin, void *k_pool,
    void *v_pool, const int64_t *positions, const int64_t *keys, const int64_t *starts,
    void *out, int64_t n_tokens, int64_t heads, int64_t kv_heads, int64_t pool, int64_t dim,
    float scale, int bf16) {
    if (dim % LANES || dim > MAX_DIM || heads % kv_heads) return 1;
    int64_t most = 0;
    for (int64_t n = 0; n < n_tokens; n++) {
        const int64_t count = starts[n + 1] - starts[n];
        if (count < 1 || positions[n] < 0 || positions[n] >= pool) return 1;
        most = count > most ? count : most; /* every token sees at least itself */
    }
    const size_t values = (size_t)(n_tokens * heads * dim); /* a multiple of LANES */
    const int64_t scratch = (most / LANES + 1) * LANES;
    const int64_t workers = 1 + (helpers ? helpers->helpers : 0);
    float *q = aligned_alloc(32, values * sizeof(float));
    float *o = aligned_alloc(32, values * sizeof(float));
    float *p = aligned_alloc(32, (size_t)(workers * GROUP * scratch) * sizeof(float));
    if (!q || !o || !p) {
        free(q), free(o), free(p);
        return 2;
    }
    const int64_t width = (heads + 2 * kv_heads) * dim, size = bf16 ? 2 : 4;
    float key[MAX_DIM];
    for (int64_t n = 0; n < n_tokens; n++) { /* every key is written before any token reads */
        const char *row = (const char *)qkv + n * width * size;
        const char *c = (const char *)cos + n * dim * size, *s = (const char *)sin + n * dim * size;
        for (int64_t h = 0; h < heads; h++)
            rope(row + h * dim * size, c, s, dim, bf16, q + (n * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = (h * pool + positions[n]) * dim;
            rope(row + (heads + h) * dim * size, c, s, dim, bf16, key);
            const void *value = row + (heads + kv_heads + h) * dim * size;
            for (int64_t i = 0; i < dim; i++) {
                store(k_pool, at + i, key[i], bf16);
                store(v_pool, at + i, element(value, i, bf16), bf16);
            }
        }
    }
    /* a key/value head's query heads together (each key read once for them), unless that
       leaves too few items to share between the threads (a decode step's one token) */
    const int64_t rep = heads / kv_heads, few = n_tokens * kv_heads < 4 * workers;
    const int64_t group = workers > 1 && few ? 1 : (rep < GROUP ? rep : GROUP);
    const attention job = {q, k_pool, v_pool, keys, starts, o, p, heads, kv_heads, pool, dim,
                           scratch, group, scale, bf16};
    pool_run(helpers, attend_item, &job, n_tokens * kv_heads * ((rep + group - 1) / group));
    for (size_t i = 0; i < values; i++) store(out, (int64_t)i, o[i], bf16);
    free(q), free(o), free(p);
    return 0;
}

int rope_attend_f32(thread_pool *helpers, const float *qkv, const float *cos, const float *sin,
                    float *k_pool, float *v_pool, const int64_t *positions, const int64_t *keys,
                    const int64_t *starts, float *out, int64_t n_tokens, int64_t heads,
                    int64_t kv_heads, int64_t pool, int64_t dim, float scale) {
    return rope_attend(helpers, qkv, cos, sin, k_pool, v_pool, positions, keys, starts, out,
                       n_tokens, heads, kv_heads, pool, dim, scale, 0);
}

int rope_attend_bf16(thread_pool *helpers, const uint16_t *qkv, const uint16_t *cos,
                     const uint16_t *sin, uint16_t *k_pool, uint16_t *v_pool,
                     const int64_t *positions, const int64_t *keys, const int64_t *starts,
                     uint16_t *out, int64_t n_tokens, int64_t heads, int64_t kv_heads,
                     int64_t pool, int64_t dim, float scale) {
    return rope_attend(helpers, qkv, cos, sin, k_pool, v_pool, positions, keys, starts, out,
                       n_tokens, heads, kv_heads, pool, dim, scale, 1);
}

/* x rounded to the dtype in every lane, as `rounded` rounds one */
static inline v8f rounded8(v8f x, int bf16) {
    if (!bf16) return x;
    const v8u bits = (v8u)float_to_bits(x);
    const v8i nan = (v8i)((bits & 0x7fffffffu) > 0x7f800000u);
    const v8u near = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return blend(nan, splat(__builtin_nanf("")), bits_to_float((v8i)near));
}

/* 8 values from element `at` on, each already of the dtype (bfloat16: exactly) */
static inline __attribute__((always_inline)) void store8(void *at, int64_t i, v8f x, int bf16) {
    if (!bf16) {
        *(v8f_u *)((float *)at + i) = x;
        return;
    }
    const v8u bits = (v8u)float_to_bits(x) >> 16;
    *(v8h_u *)((uint16_t *)at + i) = __builtin_convertvector(bits, v8h_u);
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)) for one row of E, each product rounded to the
   dtype as transformers' Llama RMS norm rounds it; the mean of squares in float32 over 8
   lanes, then the lanes and the last width % 8 in one fixed order. */
static inline __attribute__((always_inline)) void rms_norm_row(const void *row, const void *weight,
                                                               void *out, int64_t width, float eps,
                                                               int bf16) {
    const int64_t vectors = width - width % LANES;
    v8f squares = splat(0.0f);
    for (int64_t i = 0; i < vectors; i += LANES) {
        const v8f v = load(row, i, bf16);
        squares += v * v;
    }
    float total = lane_sum(squares);
    for (int64_t i = vectors; i < width; i++) {
        const float v = element(row, i, bf16);
        total += v * v;
    }
    const float scale = 1.0f / __builtin_sqrtf(total / (float)width + eps);
    for (int64_t i = 0; i < vectors; i += LANES) {
        const v8f normed = rounded8(load(row, i, bf16) * splat(scale), bf16);
        store8(out, i, rounded8(load(weight, i, bf16) * normed, bf16), bf16);
    }
    for (int64_t i = vectors; i < width; i++) {
        const float normed = rounded(element(row, i, bf16) * scale, bf16);
        store(out, i, rounded(element(weight, i, bf16) * normed, bf16), bf16);
    }
}

/* the norm of each row of x (R, E) */
static inline __attribute__((always_inline)) void rms_norm(const void *x, const void *weight,
                                                           void *out, int64_t rows,
                                                           int64_t width, float eps, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row((const char *)x + r * width * size, weight, (char *)out + r * width * size,
                     width, eps, bf16);
}

void rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t width,
                  float eps) {
    rms_norm(x, weight, out, rows, width, eps, 0);
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t width, float eps) {
    rms_norm(x, weight, out, rows, width, eps, 1);
}

/* sum = x + delta over `count` elements, each rounded to the dtype (torch's add) */
static inline __attribute__((always_inline)) void add(const void *x, const void *delta, void *sum,
                                                      int64_t count, int bf16) {
    const int64_t vectors = count - count % LANES;
    for (int64_t i = 0; i < vectors; i += LANES)
        store8(sum, i, rounded8(load(x, i, bf16) + load(delta, i, bf16), bf16), bf16);
    for (int64_t i = vectors; i < count; i++)
        store(sum, i, rounded(element(x, i, bf16) + element(delta, i, bf16), bf16), bf16);
}

/* sum = x + delta (`add`) and out = the norm of sum, row after row of (R, E): a block's
   residual add and the next norm in one pass over the rows */
static inline __attribute__((always_inline)) void add_rms_norm(const void *x, const void *delta,
                                                               const void *weight, void *sum,
                                                               void *out, int64_t rows,
                                                               int64_t width, float eps,
                                                               int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * width * size; /* bytes */
        add((const char *)x + at, (const char *)delta + at, (char *)sum + at, width, bf16);
        rms_norm_row((char *)sum + at, weight, (char *)out + at, width, eps, bf16);
    }
}

void add_rms_norm_f32(const float *x, const float *delta, const float *weight, float *sum,
                      float *out, int64_t rows, int64_t width, float eps) {
    add_rms_norm(x, delta, weight, sum, out, rows, width, eps, 0);
}

void add_rms_norm_bf16(const uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *sum, uint16_t *out, int64_t rows, int64_t width, float eps) {
    add_rms_norm(x, delta, weight, sum, out, rows, width, eps, 1);
}

/* silu(g) = g / (1 + e^-g), as g / (1 + e^-g) for g >= 0 and g e^g / (1 + e^g) below, so
   that exp8 only sees x <= 0; rounded to the dtype */
static inline v8f silu8(v8f g, int bf16) {
    const v8f e = exp8(bits_to_float(float_to_bits(g) | (v8i)splat(-0.0f))); /* e^-|g| */
    const v8i positive = (v8i)(g >= splat(0.0f));
    return rounded8(blend(positive, g, g * e) / (splat(1.0f) + e), bf16);
}

/* out = silu(gate) * up row after row, gate and up side by side in gu (R, 2F) -> (R, F); each
   of torch's two ops rounded to the dtype. Every element goes through the same vector
   arithmetic (a row's last F % 8 through a padded vector), so its bits depend on its own
   gate and up alone. */
static inline __attribute__((always_inline)) void swiglu(const void *gu, void *out, int64_t rows,
                                                         int64_t width, int bf16) {
    const int64_t vectors = width - width % LANES;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g0 = 2 * r * width, u0 = g0 + width, o0 = r * width;
        for (int64_t i = 0; i < vectors; i += LANES) {
            const v8f s = silu8(load(gu, g0 + i, bf16), bf16);
            store8(out, o0 + i, rounded8(s * load(gu, u0 + i, bf16), bf16), bf16);
        }
        if (vectors == width) continue;
        v8f g = splat(0.0f), u = splat(0.0f);
        for (int64_t i = vectors; i < width; i++) {
            g[i - vectors] = element(gu, g0 + i, bf16);
            u[i - vectors] = element(gu, u0 + i, bf16);
        }
        const v8f y = rounded8(silu8(g, bf16) * u, bf16);
        for (int64_t i = vectors; i < width; i++) store(out, o0 + i, y[i - vectors], bf16);
    }
}

void swiglu_f32(const float *gu, float *out, int64_t rows, int64_t width) {
    swiglu(gu, out, rows, width, 0);
}

void swiglu_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t width) {
    swiglu(gu, out, rows, width, 1);
}

/* A row-wise op over rows of bfloat16 (x and delta (R, E) -> sum and out; or gate_up (R, 2F)
   in x -> out (R, F)), ROWS_ITEM rows an item of a pool's job: rows never share a sum, so
   the threads change no bit. */
#define ROWS_ITEM 4

typedef struct {
    const uint16_t *x, *delta, *weight;
    uint16_t *sum, *out;
    int64_t rows, width;
    float eps;
} rows_job;

static void add_rms_norm_item(const void *arg, int64_t item, int worker) {
    const rows_job *j = arg;
    const int64_t r0 = item * ROWS_ITEM, at = r0 * j->width;
    const int64_t rows = j->rows - r0 < ROWS_ITEM ? j->rows - r0 : ROWS_ITEM;
    (void)worker;
    add_rms_norm(j->x + at, j->delta + at, j->weight, j->sum + at, j->out + at, rows, j->width,
                 j->eps, 1);
}

static void swiglu_item(const void *arg, int64_t item, int worker) {
    const rows_job *j = arg;
    const int64_t r0 = item * ROWS_ITEM;
    const int64_t rows = j->rows - r0 < ROWS_ITEM ? j->rows - r0 : ROWS_ITEM;
    (void)worker;
    swiglu(j->x + 2 * r0 * j->width, j->out + r0 * j->width, rows, j->width, 1);
}

static void rows_run(thread_pool *helpers, pool_item item, const rows_job *job) {
    pool_run(helpers, item, job, (job->rows + ROWS_ITEM - 1) / ROWS_ITEM);
}

/* The bfloat16 kernel's `linear` (bf16_linear.c, a library of its own): y (R, N) = x (R, K)
   times a packed weight, plus bias (or NULL); 0: done. */
typedef int (*linear_fn)(thread_pool *helpers, const uint16_t *x, const uint16_t *panels,
                         const uint16_t *bias, uint16_t *y, int64_t rows, int64_t n_dim,
                         int64_t k_dim, int amx);

/* a block's weights, in this order, in `weights` (LAYER_WEIGHTS pointers a block) */
enum { NORM_ATTN, QKV, QKV_BIAS, O, O_BIAS, NORM_MLP, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS,
       LAYER_WEIGHTS };

int layer_weights(void) { return LAYER_WEIGHTS; }

/* Every decoder block of a bfloat16 Llama forward, as workers/engine/llama.py's Block runs
   them op after op, in one call: for each block, x + attention(norm(x)) then x + mlp(norm(x)),
   each residual add done with the norm after it, the last block's MLP added at the end.
   x: (N, E) the embeddings in, the last block's output out; cos, sin: (N, D); k_pool,
   v_pool: (blocks, Hkv, P, D); positions, keys, starts: as rope_attend's; weights: `layers`
   blocks' LAYER_WEIGHTS pointers (packed panels from the bf16 kernel's `pack`). 0: done;
   1: bad arguments; 2: out of memory. */
int blocks_bf16(linear_fn linear, thread_pool *helpers, int amx, const void *const *weights,
                int64_t layers, uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                uint16_t *k_pool, uint16_t *v_pool, const int64_t *positions,
                const int64_t *keys, const int64_t *starts, int64_t n_tokens, int64_t width,
                int64_t ffn, int64_t heads, int64_t kv_heads, int64_t pool, int64_t dim,
                float eps, float scale) {
    const int64_t n = n_tokens, qkv_width = (heads + 2 * kv_heads) * dim;
    const int64_t layer = kv_heads * pool * dim; /* one block's keys (or values) in the pools */
    uint16_t *h = malloc((size_t)(n * width) * 2), *delta = malloc((size_t)(n * width) * 2);
    uint16_t *qkv = malloc((size_t)(n * qkv_width) * 2);
    uint16_t *attended = malloc((size_t)(n * heads * dim) * 2);
    uint16_t *gate_up = malloc((size_t)(n * 2 * ffn) * 2), *gated = malloc((size_t)(n * ffn) * 2);
    int status = h && delta && qkv && attended && gate_up && gated ? 0 : 2;
    for (int64_t l = 0; l < layers && !status; l++) {
        const uint16_t *const *w = (const uint16_t *const *)weights + l * LAYER_WEIGHTS;
        const rows_job attn_norm = {x, delta, w[NORM_ATTN], x, h, n, width, eps};
        if (l > 0)
            rows_run(helpers, add_rms_norm_item, &attn_norm);
        else /* nothing to add yet */
            rms_norm(x, w[NORM_ATTN], h, n, width, eps, 1);
        status = linear(helpers, h, w[QKV], w[QKV_BIAS], qkv, n, qkv_width, width, amx);
        if (!status)
            status = rope_attend(helpers, qkv, cos, sin, k_pool + l * layer, v_pool + l * layer,
                                 positions, keys, starts, attended, n, heads, kv_heads, pool, dim,
                                 scale, 1);
        if (!status)
            status = linear(helpers, attended, w[O], w[O_BIAS], delta, n, width, heads * dim, amx);
        if (status) break;
        const rows_job mlp_norm = {x, delta, w[NORM_MLP], x, h, n, width, eps};
        rows_run(helpers, add_rms_norm_item, &mlp_norm);
        status = linear(helpers, h, w[GATE_UP], w[GATE_UP_BIAS], gate_up, n, 2 * ffn, width, amx);
        const rows_job gate = {gate_up, NULL, NULL, NULL, gated, n, ffn, 0.0f};
        if (!status) rows_run(helpers, swiglu_item, &gate);
        if (!status)
            status = linear(helpers, gated, w[DOWN], w[DOWN_BIAS], delta, n, width, ffn, amx);
    }
    if (!status && layers > 0) add(x, delta, x, n * width, 1); /* the last block's MLP */
    free(h), free(delta), free(qkv), free(attended), free(gate_up), free(gated);
    return status;
}
