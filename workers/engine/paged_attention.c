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

static inline v8f load_f32(const void *p) { return *(const v8f_u *)p; }

static inline v8f load_bf16(const void *p) {
    v8u bits = __builtin_convertvector(*(const v8h_u *)p, v8u) << 16;
    v8f x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* a where `take` (all ones), else b */
static inline v8f blend(v8i take, v8f a, v8f b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    v8i r = (take & ai) | (~take & bi);
    v8f x;
    memcpy(&x, &r, sizeof x);
    return x;
}

static inline float lane_sum(v8f a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* e^x for x <= 0 (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, degree-6 polynomial); the
   same arithmetic in every lane, below -87 it gives e^-87 instead of a subnormal. */
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
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

#define DEFINE_ATTEND(NAME, LOAD, ELEM)                                                     \
    int NAME(const float *q, const ELEM *k_pool, const ELEM *v_pool, const int64_t *keys,  \
             const int64_t *starts, float *out, int64_t n_tokens, int64_t heads,            \
             int64_t kv_heads, int64_t pool, int64_t dim, float scale) {                    \
        if (dim % LANES || dim > MAX_DIM || heads % kv_heads) return 1;                     \
        const int64_t rep = heads / kv_heads, vecs = dim / LANES;                           \
        int64_t most = 0;                                                                   \
        for (int64_t n = 0; n < n_tokens; n++)                                              \
            if (starts[n + 1] - starts[n] > most) most = starts[n + 1] - starts[n];         \
        float *p = aligned_alloc(32, (size_t)(most / LANES + 1) * LANES * sizeof(float));     \
        if (!p) return 2;                                                                   \
        for (int64_t n = 0; n < n_tokens; n++) {                                            \
            const int64_t *pos = keys + starts[n], count = starts[n + 1] - starts[n];      \
            const int64_t padded = (count + LANES - 1) / LANES * LANES;                     \
            for (int64_t h = 0; h < heads; h++) {                                           \
                const ELEM *k = k_pool + (h / rep) * pool * dim;                            \
                const ELEM *v = v_pool + (h / rep) * pool * dim;                            \
                const float *qh = q + (n * heads + h) * dim;                                \
                float *o = out + (n * heads + h) * dim;                                     \
                v8f qs[MAX_DIM / LANES], acc[MAX_DIM / LANES];                              \
                for (int64_t i = 0; i < vecs; i++) {                                        \
                    qs[i] = load_f32(qh + i * LANES) * splat(scale);                        \
                    acc[i] = splat(0.0f);                                                   \
                }                                                                           \
                float top = -__builtin_inff();                                              \
                for (int64_t j = 0; j < count; j++) { /* scores: q . k_j */                 \
                    const ELEM *kj = k + pos[j] * dim;                                      \
                    v8f dot = splat(0.0f);                                                  \
                    for (int64_t i = 0; i < vecs; i++) dot += qs[i] * LOAD(kj + i * LANES); \
                    p[j] = lane_sum(dot);                                                   \
                    top = p[j] > top ? p[j] : top;                                          \
                }                                                                           \
                v8f total = splat(0.0f);                                                    \
                for (int64_t j = 0; j < padded; j += LANES) { /* exp(s - max), masked 0 */ \
                    const v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)j;           \
                    v8f e = exp8(*(v8f *)(p + j) - splat(top));                             \
                    e = blend(lane < (int32_t)count, e, splat(0.0f));                       \
                    *(v8f *)(p + j) = e;                                                    \
                    total += e;                                                             \
                }                                                                           \
                for (int64_t j = 0; j < count; j++) { /* sum of p_j v_j, key after key */   \
                    const ELEM *vj = v + pos[j] * dim;                                      \
                    const v8f pj = splat(p[j]);                                             \
                    for (int64_t i = 0; i < vecs; i++) acc[i] += pj * LOAD(vj + i * LANES); \
                }                                                                           \
                const v8f sum = splat(lane_sum(total));                                     \
                for (int64_t i = 0; i < vecs; i++) *(v8f_u *)(o + i * LANES) = acc[i] / sum; \
            }                                                                               \
        }                                                                                   \
        free(p);                                                                            \
        return 0;                                                                           \
    }

DEFINE_ATTEND(attend_f32, load_f32, float)
DEFINE_ATTEND(attend_bf16, load_bf16, uint16_t)
