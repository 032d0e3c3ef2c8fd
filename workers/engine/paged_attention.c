/* Paged attention for the CPU engine: see workers/engine/paged_attention.py.

   Each (token, query head) reads its own visible keys, listed by pool position in
   sequence order, and nothing else: its output is a function of that list alone,
   whatever the batch around it. Every sum runs in one fixed order over 8 lanes:
   the dot product over the head size, the softmax total and the weighted values
   over the keys in list order.

   Shapes: N tokens, H query heads, Hkv key/value heads (rep = H / Hkv query heads
   each), P pool positions, D head size (a multiple of 8, at most MAX_DIM), M
   listed keys in all. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* One query head over its keys: o = softmax(q . k_j * scale) . v_j, j in list order.
   k, v: its key/value head's pool (P, D); p: scratch of the count rounded up to LANES. */
static inline __attribute__((always_inline)) void attend_head(
    const float *q, const void *k, const void *v, const int64_t *pos, int64_t count,
    int64_t dim, float scale, float *p, float *o, int bf16) {
    const int64_t vecs = dim / LANES;
    v8f qs[MAX_DIM / LANES], acc[MAX_DIM / LANES];
    for (int64_t i = 0; i < vecs; i++) {
        qs[i] = *(const v8f_u *)(q + i * LANES) * splat(scale);
        acc[i] = splat(0.0f);
    }
    float top = -__builtin_inff();
    for (int64_t j = 0; j < count; j++) { /* scores */
        v8f dot = splat(0.0f);
        for (int64_t i = 0; i < vecs; i++) dot += qs[i] * load(k, pos[j] * dim + i * LANES, bf16);
        p[j] = lane_sum(dot);
        top = p[j] > top ? p[j] : top;
    }
    v8f total = splat(0.0f);
    for (int64_t j = 0; j < count; j += LANES) { /* p_j = exp(s_j - top); past the count 0 */
        const v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)j;
        v8f e = blend(lane < (int32_t)count, exp8(*(v8f *)(p + j) - splat(top)), splat(0.0f));
        *(v8f *)(p + j) = e;
        total += e;
    }
    for (int64_t j = 0; j < count; j++) { /* sum of p_j v_j, key after key */
        const v8f pj = splat(p[j]);
        for (int64_t i = 0; i < vecs; i++) acc[i] += pj * load(v, pos[j] * dim + i * LANES, bf16);
    }
    const v8f sum = splat(lane_sum(total));
    for (int64_t i = 0; i < vecs; i++) *(v8f_u *)(o + i * LANES) = acc[i] / sum;
}

/* q, out: (N, H, D) float32; k_pool, v_pool: (Hkv, P, D); token n reads the keys at
   pool positions keys[starts[n]] .. keys[starts[n + 1] - 1]. 0: done; 1: bad arguments;
   2: out of memory. One thread: beside torch's OpenMP threads, which spin between
   parallel regions, a second one made prefills and trees slower, not faster. */
static inline __attribute__((always_inline)) int attend(
    const float *q, const void *k_pool, const void *v_pool, const int64_t *keys,
    const int64_t *starts, float *out, int64_t n_tokens, int64_t heads, int64_t kv_heads,
    int64_t pool, int64_t dim, float scale, int bf16) {
    if (dim % LANES || dim > MAX_DIM || heads % kv_heads) return 1;
    int64_t most = 0;
    for (int64_t n = 0; n < n_tokens; n++) {
        const int64_t count = starts[n + 1] - starts[n];
        if (count < 1) return 1; /* every token sees itself */
        most = count > most ? count : most;
    }
    float *p = aligned_alloc(32, (size_t)(most / LANES + 1) * LANES * sizeof(float));
    if (!p) return 2;
    const size_t head_bytes = (size_t)(pool * dim) * (bf16 ? 2 : 4);
    const int64_t rep = heads / kv_heads;
    for (int64_t n = 0; n < n_tokens; n++) {
        for (int64_t h = 0; h < heads; h++) {
            const size_t offset = (size_t)(h / rep) * head_bytes;
            const int64_t row = (n * heads + h) * dim;
            attend_head(q + row, (const char *)k_pool + offset, (const char *)v_pool + offset,
                        keys + starts[n], starts[n + 1] - starts[n], dim, scale, p, out + row,
                        bf16);
        }
    }
    free(p);
    return 0;
}

int attend_f32(const float *q, const float *k_pool, const float *v_pool, const int64_t *keys,
               const int64_t *starts, float *out, int64_t n_tokens, int64_t heads,
               int64_t kv_heads, int64_t pool, int64_t dim, float scale) {
    return attend(q, k_pool, v_pool, keys, starts, out, n_tokens, heads, kv_heads, pool, dim,
                  scale, 0);
}

int attend_bf16(const float *q, const uint16_t *k_pool, const uint16_t *v_pool,
                const int64_t *keys, const int64_t *starts, float *out, int64_t n_tokens,
                int64_t heads, int64_t kv_heads, int64_t pool, int64_t dim, float scale) {
    return attend(q, k_pool, v_pool, keys, starts, out, n_tokens, heads, kv_heads, pool, dim,
                  scale, 1);
}
