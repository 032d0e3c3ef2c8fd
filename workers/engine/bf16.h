/* bfloat16 <-> float32 for the CPU engine's kernels, as torch converts them. */

#ifndef SPECSPLIT_BF16_H
#define SPECSPLIT_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) { /* exact */
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t float_to_bf16(float x) { /* nearest, ties to even */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
