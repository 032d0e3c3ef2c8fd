/* bfloat16 linear layers for the CPU engine: see workers/engine/bf16_linear.py.

   y = x W^T + b for bfloat16 x (R, K), W (N, K) and b (N,), W packed once into panels of
   PANEL outputs. Every output is one chain of multiply-adds over k in order, in float32
   (on the tile unit: of steps of 16 pairs of k, below), whichever tile computes it, so a
   row's result never depends on the rows beside it; it is rounded to bfloat16 (to nearest,
   ties to even) once, after the bias.

   Builds, picked by the CPU the library is compiled for:
   - AVX512_BF16: panels (K / 2, PANEL, 2); each step adds the products of two consecutive
     k (vdpbf16ps), weights and inputs read as bfloat16.
   - AVX512_BF16 and AMX (Intel Xeon from Sapphire Rapids on), where Linux grants the tile
     state: the same panels, 16 pairs of k at a time by the tile unit (tdpbf16ps: rows of x
     against 16 pairs of 16 outputs, its sums within a step in an order of the CPU's own),
     the pairs left over (K / 2 not a multiple of 16) added as above. Every call, whatever
     its rows, goes this way once the kernel is loaded with it, and a row's sums never
     touch the other rows of its tile. Decode steps stream the weights as fast as the
     vector instructions do; trees and prompts are 2-4x faster.
   - AVX2 and FMA: panels (K, PANEL); weights and inputs widened exactly to float32, one
     fused multiply-add per k.
   A decode step's few rows stream the panels once (memory-bound); more rows reuse each
   panel from the cache for every tile of rows. A call's panels are shared between the
   caller and the helpers of a pool (pool.h), a panel whole to one thread. */

#define _GNU_SOURCE /* pool.h names its threads */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"

#if !defined(__AVX512BF16__) && !(defined(__AVX2__) && defined(__FMA__))
#error "the bfloat16 linear kernel needs AVX512_BF16, or AVX2 and FMA"
#endif

#define PANEL 64 /* outputs a packed panel holds */

/* y[n0 + i] = bf16(acc[i] + b[n0 + i]) for the outputs below n_dim */
static inline void finish(const float *acc, int count, const uint16_t *bias, int64_t n0,
                          int64_t n_dim, uint16_t *y) {
    for (int i = 0; i < count && n0 + i < n_dim; i++)
        y[n0 + i] = float_to_bf16(bias ? acc[i] + bf16_to_float(bias[n0 + i]) : acc[i]);
}

#if defined(__AVX512BF16__)

#define RT 6 /* rows a tile computes: 6 x 4 accumulators and 4 weight registers of 32 */
#define VECS (PANEL / 16)

/* `finish` for a panel's PANEL sums, 16 at a time: the same bits */
static inline void finish_panel(const float *acc, const uint16_t *bias, int64_t n0,
                                int64_t n_dim, uint16_t *y) {
    const __m512i lsb = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    for (int v = 0; v < VECS && n0 + v * 16 < n_dim; v++) {
        const int64_t n = n0 + v * 16;
        const __mmask16 live = n_dim - n >= 16 ? 0xffff : (__mmask16)((1u << (n_dim - n)) - 1);
        __m512 sum = _mm512_loadu_ps(acc + v * 16);
        if (bias) {
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + n));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
        }
        const __m512i bits = _mm512_castps_si512(sum);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), lsb);
        __m512i out = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, odd)), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q);
        out = _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0x7fc0));
        _mm256_mask_storeu_epi16(y + n, live, _mm512_cvtepi32_epi16(out));
    }
}

int64_t panel_elements(int64_t n_dim, int64_t k_dim) {
    return (n_dim + PANEL - 1) / PANEL * ((k_dim + 1) / 2) * PANEL * 2;
}

/* W (N, K) -> panels (ceil(N / PANEL), ceil(K / 2), PANEL, 2), zero past N and K */
void pack(const uint16_t *w, uint16_t *panels, int64_t n_dim, int64_t k_dim) {
    const int64_t pairs = (k_dim + 1) / 2, count = (n_dim + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < count; p++)
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t j = 0; j < PANEL; j++)
                for (int64_t half = 0; half < 2; half++) {
                    const int64_t n = p * PANEL + j, k = 2 * kk + half;
                    panels[((p * pairs + kk) * PANEL + j) * 2 + half] =
                        n < n_dim && k < k_dim ? w[n * k_dim + k] : 0;
                }
}

/* rows r0 .. r0 + nr of x (pairs of k as 32-bit units) against one panel */
static inline __attribute__((always_inline)) void tile(const uint32_t *x, const uint32_t *panel,
                                                       int64_t pairs, int64_t r0, int nr,
                                                       __m512 acc[RT][VECS]) {
    for (int i = 0; i < RT; i++)
        for (int v = 0; v < VECS; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512bh w[VECS];
        for (int v = 0; v < VECS; v++)
            w[v] = (__m512bh)_mm512_loadu_si512(panel + kk * PANEL + v * 16);
        for (int i = 0; i < nr; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[(r0 + i) * pairs + kk]);
            for (int v = 0; v < VECS; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, w[v]);
        }
    }
}

static void linear_rows(const uint32_t *x, const uint32_t *panels, const uint16_t *bias,
                        uint16_t *y, int64_t n_dim, int64_t pairs, int64_t p, int64_t r0,
                        int nr) {
    __m512 acc[RT][VECS];
    const uint32_t *panel = panels + p * pairs * PANEL;
    switch (nr) { /* a constant row count per tile keeps the accumulators in registers */
    case 6: tile(x, panel, pairs, r0, 6, acc); break;
    case 5: tile(x, panel, pairs, r0, 5, acc); break;
    case 4: tile(x, panel, pairs, r0, 4, acc); break;
    case 3: tile(x, panel, pairs, r0, 3, acc); break;
    case 2: tile(x, panel, pairs, r0, 2, acc); break;
    default: tile(x, panel, pairs, r0, 1, acc);
    }
    for (int i = 0; i < nr; i++) {
        float sums[PANEL];
        for (int v = 0; v < VECS; v++) _mm512_storeu_ps(sums + v * 16, acc[i][v]);
        finish_panel(sums, bias, p * PANEL, n_dim, y + (r0 + i) * n_dim);
    }
}

typedef struct {
    const uint32_t *x, *panels; /* pairs of k as 32-bit units */
    const uint16_t *bias;
    uint16_t *y;
    int64_t rows, n_dim, pairs;
    char *configured; /* the tile unit: per worker, whether its tiles are configured */
} job;

/* every row against panel p */
static void panel_rows(const void *arg, int64_t p, int worker) {
    const job *j = arg;
    (void)worker;
    for (int64_t r0 = 0; r0 < j->rows; r0 += RT)
        linear_rows(j->x, j->panels, j->bias, j->y, j->n_dim, j->pairs, p, r0,
                    j->rows - r0 < RT ? (int)(j->rows - r0) : RT);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of x a tile holds */
#define AMX_PAIRS 16 /* pairs of k a tile step takes: 64 bytes of a row */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where Linux grants this process the tile state (once asked, every thread has it) */
int amx_ready(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* this thread's tiles, rows of 64 bytes: 0-3 the sums of `rows` rows x 16 outputs
   (float32), 4 the rows' 16 pairs of k, 5-7 the weights of 16 pairs x 16 outputs */
static void amx_configure(int rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = t < 5 ? rows : AMX_PAIRS;
    _tile_loadconfig(&config);
}

/* every row against panel p; x holds the rows padded with zero rows to a multiple of
   AMX_ROWS. A thread loads the tile configuration at its first panel of a call: torch's
   own tile code (oneDNN) may have loaded its own on the caller's thread since the last. */
static void amx_panel_rows(const void *arg, int64_t p, int worker) {
    const job *j = arg;
    const int64_t pairs = j->pairs, steps = pairs / AMX_PAIRS, stride = pairs * 4;
    const uint32_t *panel = j->panels + p * pairs * PANEL;
    float sums[AMX_ROWS][PANEL] __attribute__((aligned(64)));
    if (!j->configured[worker]) {
        amx_configure(j->rows < AMX_ROWS ? (int)j->rows : AMX_ROWS);
        j->configured[worker] = 1;
    }
    for (int64_t r0 = 0; r0 < j->rows; r0 += AMX_ROWS) {
        const uint32_t *x = j->x + r0 * pairs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            const uint32_t *w = panel + s * AMX_PAIRS * PANEL; /* rows of PANEL pairs */
            _tile_loadd(4, x + s * AMX_PAIRS, stride);
            _tile_loadd(5, w, PANEL * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, w + 16, PANEL * 4);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, w + 32, PANEL * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, w + 48, PANEL * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, sums[0], PANEL * 4);
        _tile_stored(1, sums[0] + 16, PANEL * 4);
        _tile_stored(2, sums[0] + 32, PANEL * 4);
        _tile_stored(3, sums[0] + 48, PANEL * 4);
        const int nr = j->rows - r0 < AMX_ROWS ? (int)(j->rows - r0) : AMX_ROWS;
        for (int i = 0; i < nr; i++) {
            for (int v = 0; v < VECS && steps * AMX_PAIRS < pairs; v++) { /* the pairs left */
                __m512 acc = _mm512_load_ps(sums[i] + v * 16);
                for (int64_t kk = steps * AMX_PAIRS; kk < pairs; kk++)
                    acc = _mm512_dpbf16_ps(
                        acc, (__m512bh)_mm512_set1_epi32((int)x[i * pairs + kk]),
                        (__m512bh)_mm512_loadu_si512(panel + kk * PANEL + v * 16));
                _mm512_store_ps(sums[i] + v * 16, acc);
            }
            finish_panel(sums[i], j->bias, p * PANEL, j->n_dim, j->y + (r0 + i) * j->n_dim);
        }
    }
}

#else

int amx_ready(void) { return 0; }

#endif

/* x (R, K) bfloat16; panels from `pack`; bias (N,) or NULL; y (R, N); helpers: a pool or
   NULL; amx: by the tile unit (where `amx_ready`). 0: done; 2: out of memory. An odd K is
   padded with a zero column, and for the tile unit more than 16 rows with zero rows to a
   multiple of 16 (x copied). */
int linear(thread_pool *helpers, const uint16_t *x, const uint16_t *panels,
           const uint16_t *bias, uint16_t *y, int64_t rows, int64_t n_dim, int64_t k_dim,
           int amx) {
    const int64_t pairs = (k_dim + 1) / 2, count = (n_dim + PANEL - 1) / PANEL;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int64_t padded_rows =
        amx && rows > AMX_ROWS ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
#else
    const int64_t padded_rows = rows;
    amx = 0;
#endif
    if (!rows) return 0;
    const int copy = k_dim % 2 || padded_rows != rows;
    uint16_t *padded = copy ? calloc((size_t)(padded_rows * pairs * 2), sizeof *padded) : NULL;
    char *configured = amx ? calloc((size_t)(1 + (helpers ? helpers->helpers : 0)), 1) : NULL;
    if ((copy && !padded) || (amx && !configured)) {
        free(padded);
        free(configured);
        return 2;
    }
    if (copy) {
        for (int64_t r = 0; r < rows; r++)
            memcpy(padded + r * pairs * 2, x + r * k_dim, (size_t)k_dim * sizeof *x);
        x = padded;
    }
    const job j = {(const uint32_t *)x, (const uint32_t *)panels, bias, y,
                   rows, n_dim, pairs, configured};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) {
        pool_run(helpers, amx_panel_rows, &j, count);
        _tile_release(); /* the caller's thread; a pool's helpers run only these kernels */
    } else
#endif
        pool_run(helpers, panel_rows, &j, count);
    free(padded);
    free(configured);
    return 0;
}

#else /* AVX2 and FMA */

#define RT 6 /* rows a tile computes: 6 x 2 accumulators of 16 registers */
#define CV 2 /* vectors of 8 outputs a tile computes */
#define WIDE_ROWS 12 /* from this many rows on, a panel is widened to float32 once */
#define VECS (PANEL / 8)

static inline __m256 widen(const uint16_t *at) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)at)), 16));
}

/* `finish` for a panel's PANEL sums, 8 at a time where 8 outputs are left: the same bits */
static inline void finish_panel(const float *acc, const uint16_t *bias, int64_t n0,
                                int64_t n_dim, uint16_t *y) {
    const __m256i lsb = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    int i = 0;
    for (; i + 8 <= PANEL && n0 + i + 8 <= n_dim; i += 8) {
        __m256 sum = _mm256_loadu_ps(acc + i);
        if (bias) sum = _mm256_add_ps(sum, widen(bias + n0 + i));
        const __m256i bits = _mm256_castps_si256(sum);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), lsb);
        __m256i out = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, odd)), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q));
        out = _mm256_blendv_epi8(out, _mm256_set1_epi32(0x7fc0), nan);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
        _mm_storeu_si128((__m128i *)(y + n0 + i), _mm256_castsi256_si128(packed));
    }
    finish(acc + i, PANEL - i, bias, n0 + i, n_dim, y);
}

int64_t panel_elements(int64_t n_dim, int64_t k_dim) {
    return (n_dim + PANEL - 1) / PANEL * k_dim * PANEL;
}

/* W (N, K) -> panels (ceil(N / PANEL), K, PANEL), zero past N */
void pack(const uint16_t *w, uint16_t *panels, int64_t n_dim, int64_t k_dim) {
    const int64_t count = (n_dim + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < count; p++)
        for (int64_t k = 0; k < k_dim; k++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t n = p * PANEL + j;
                panels[(p * k_dim + k) * PANEL + j] = n < n_dim ? w[n * k_dim + k] : 0;
            }
}

/* one row (float32) against one panel read as bfloat16: a decode step's memory-bound case */
static inline void row_panel(const float *x, const uint16_t *panel, int64_t k_dim, float *sums) {
    __m256 acc[VECS];
    for (int v = 0; v < VECS; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_dim; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        for (int v = 0; v < VECS; v++)
            acc[v] = _mm256_fmadd_ps(widen(panel + k * PANEL + v * 8), xb, acc[v]);
    }
    for (int v = 0; v < VECS; v++) _mm256_storeu_ps(sums + v * 8, acc[v]);
}

/* 8 weights of a panel from element `at`: bfloat16 widened, or already widened (float32) */
static inline __attribute__((always_inline)) __m256 weights(const void *panel, int64_t at,
                                                            int wide) {
    return wide ? _mm256_load_ps((const float *)panel + at) : widen((const uint16_t *)panel + at);
}

/* rows r0 .. r0 + nr (float32) against outputs c0 * 8 .. (c0 + CV) * 8 of a panel, each
   weight vector read once for all the tile's rows */
static inline __attribute__((always_inline)) void tile(const float *x, const void *panel,
                                                       int wide, int64_t k_dim, int64_t r0,
                                                       int nr, int c0, float sums[RT][PANEL]) {
    __m256 acc[RT][CV];
    for (int i = 0; i < RT; i++)
        for (int c = 0; c < CV; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_dim; k++) {
        __m256 w[CV];
        for (int c = 0; c < CV; c++) w[c] = weights(panel, k * PANEL + (c0 + c) * 8, wide);
        for (int i = 0; i < nr; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + (r0 + i) * k_dim + k);
            for (int c = 0; c < CV; c++) acc[i][c] = _mm256_fmadd_ps(w[c], xb, acc[i][c]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < CV; c++) _mm256_storeu_ps(sums[i] + (c0 + c) * 8, acc[i][c]);
}

static inline __attribute__((always_inline)) void tiles_of(const float *x, const void *panel,
                                                           int wide, int64_t k_dim, int64_t r0,
                                                           int nr, float sums[RT][PANEL]) {
    for (int c0 = 0; c0 < VECS; c0 += CV) {
        switch (nr) { /* a constant row count per tile keeps the accumulators in registers */
        case 6: tile(x, panel, wide, k_dim, r0, 6, c0, sums); break;
        case 5: tile(x, panel, wide, k_dim, r0, 5, c0, sums); break;
        case 4: tile(x, panel, wide, k_dim, r0, 4, c0, sums); break;
        case 3: tile(x, panel, wide, k_dim, r0, 3, c0, sums); break;
        case 2: tile(x, panel, wide, k_dim, r0, 2, c0, sums); break;
        default: tile(x, panel, wide, k_dim, r0, 1, c0, sums);
        }
    }
}

static void tiles(const float *x, const void *panel, int wide, int64_t k_dim, int64_t r0,
                  int nr, float sums[RT][PANEL]) {
    if (wide) tiles_of(x, panel, 1, k_dim, r0, nr, sums);
    else tiles_of(x, panel, 0, k_dim, r0, nr, sums);
}

typedef struct {
    const float *xs; /* x widened */
    const uint16_t *panels, *bias;
    uint16_t *y;
    float *scratch; /* a panel widened, K * PANEL per worker, when wide */
    int64_t rows, n_dim, k_dim;
    int wide;
} job;

/* every row against panel p */
static void panel_rows(const void *arg, int64_t p, int worker) {
    const job *j = arg;
    const int64_t k_dim = j->k_dim;
    const uint16_t *panel = j->panels + p * k_dim * PANEL;
    float sums[RT][PANEL];
    if (j->rows <= 2) {
        for (int64_t r = 0; r < j->rows; r++) {
            row_panel(j->xs + r * k_dim, panel, k_dim, sums[0]);
            finish_panel(sums[0], j->bias, p * PANEL, j->n_dim, j->y + r * j->n_dim);
        }
        return;
    }
    float *s = j->wide ? j->scratch + worker * k_dim * PANEL : NULL;
    if (s)
        for (int64_t i = 0; i < k_dim * PANEL; i += 8) _mm256_store_ps(s + i, widen(panel + i));
    for (int64_t r0 = 0; r0 < j->rows; r0 += RT) {
        const int nr = j->rows - r0 < RT ? (int)(j->rows - r0) : RT;
        tiles(j->xs, s ? (const void *)s : panel, j->wide, k_dim, r0, nr, sums);
        for (int i = 0; i < nr; i++)
            finish_panel(sums[i], j->bias, p * PANEL, j->n_dim, j->y + (r0 + i) * j->n_dim);
    }
}

/* x (R, K) bfloat16; panels from `pack`; bias (N,) or NULL; y (R, N); helpers: a pool or
   NULL. 0: done; 2: out of memory. Up to 2 rows read a panel in one pass, all its outputs at
   once; more go over it in tiles of rows and 16 outputs, from WIDE_ROWS rows on widened once
   into float32. */
int amx_ready(void) { return 0; }

int linear(thread_pool *helpers, const uint16_t *x, const uint16_t *panels,
           const uint16_t *bias, uint16_t *y, int64_t rows, int64_t n_dim, int64_t k_dim,
           int amx) {
    const int wide = rows >= WIDE_ROWS;
    (void)amx;
    const int64_t workers = 1 + (helpers ? helpers->helpers : 0);
    float *xs = malloc((size_t)(rows * k_dim) * sizeof *xs);
    float *s = wide ? aligned_alloc(32, (size_t)(workers * k_dim * PANEL) * sizeof *s) : NULL;
    if (!xs || (wide && !s)) {
        free(xs);
        free(s);
        return 2;
    }
    for (int64_t i = 0; i < rows * k_dim; i++) xs[i] = bf16_to_float(x[i]);
    const job j = {xs, panels, bias, y, s, rows, n_dim, k_dim, wide};
    pool_run(helpers, panel_rows, &j, (n_dim + PANEL - 1) / PANEL);
    free(xs);
    free(s);
    return 0;
}

#endif
