/* Small math helpers shared by the CPU kernels, written so that loops calling them vectorize. */
#ifndef PAGEDLLM_VEC_MATH_H
#define PAGEDLLM_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (max-subtracted scores), in a form the compiler vectorizes (libm's expf is a
 * scalar call: it took ~30% of the decode attention kernel). exp(x) = 2^r * 2^f with r = round(x * log2 e) and
 * f in [-1/2, 1/2]; 2^f = e^(f ln 2) by its Taylor series to degree 7 (relative error < 1e-8),
 * 2^r by writing r + 127 into a float's exponent field. Inputs below -87 give exp(-87) ~ 1.6e-38,
 * which is zero next to the weight 1 of the maximum. */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float r = floorf(t + 0.5f);
    const float g = (t - r) * 0.693147180559945309f; /* f * ln 2, |g| <= 0.35 */
    float p = 1.0f / 5040.0f;
    p = p * g + 1.0f / 720.0f;
    p = p * g + 1.0f / 120.0f;
    p = p * g + 1.0f / 24.0f;
    p = p * g + 1.0f / 6.0f;
    p = p * g + 0.5f;
    p = p * g + 1.0f;
    p = p * g + 1.0f;
    const int32_t bits = ((int32_t)r + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
