/*
 * Row-wise float32 ops of a decoder layer on the CPU, one pass over memory each (the torch
 * versions take 3-6 passes and as many dispatches): RMSNorm with the residual add folded in, the
 * SiLU gate, NeoX rotary embedding, and the K/V store of a float32 paged cache. Rows are shared by
 * the OpenMP threads when there are enough of them to pay for waking the pool.
 *
 * Semantics are those of the torch reference in pagedllm/layers (norm.py, activation.py,
 * rotary.py); sums are reassociated, so results match it to float32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* Below this many elements one thread does the work (a pool wake-up costs a few microseconds). */
#define PARALLEL_MIN_ELEMENTS 32768

/* out = weight * (s / sqrt(mean(s^2) + eps)) with s = x (+ residual; then residual_out = s).
 * x, residual: rows of `dim` at `x_stride` / `dim`; out, residual_out: contiguous [rows, dim]. */
void rms_norm(const float *x, int64_t x_stride, const float *residual, const float *weight, float *out,
              float *residual_out, int64_t rows, int64_t dim, float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        const float *src = xr;
        if (residual != NULL) {
            const float *res = residual + r * dim;
            float *ro = residual_out + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ro[d] = xr[d] + res[d];
            src = ro;
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t d = 0; d < dim; ++d) sq += src[d] * src[d];
        const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = weight[d] * (src[d] * inv);
    }
}

/* out[r] = silu(x[r, :inter]) * x[r, inter:], silu(g) = g / (1 + exp(-g)). */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t inter, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float g = gate[i];
            const float e = exp_nonpositive(g < 0.0f ? g : -g); /* exp(-|g|) <= 1: never overflows */
            const float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);
            o[i] = g * sigmoid * up[i];
        }
    }
}

/* NeoX rotary embedding of x [tokens, heads, head_dim] (strides in elements; last dim unit) into
 * out (contiguous): per pair (x1, x2) = (x[i], x[half + i]) for i < half = rotary_dim / 2,
 * (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin rows [half] of the caches at positions[t];
 * dims past rotary_dim are copied. Returns -1 (writing nothing) when a position lies outside
 * [0, max_position), the tables' rows; else 0. */
int rotary_embedding(const float *x, int64_t stride_t, int64_t stride_h, float *out, const int64_t *positions,
                     const float *cos_cache, const float *sin_cache, int64_t max_position, int64_t tokens,
                     int64_t heads, int64_t head_dim, int64_t rotary_dim, int num_threads)
{
    const int64_t half = rotary_dim / 2;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xh = x + t * stride_t + h * stride_h;
            float *o = out + (t * heads + h) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = xh[i], x2 = xh[half + i];
                o[i] = x1 * c[i] - x2 * s[i];
                o[half + i] = x2 * c[i] + x1 * s[i];
            }
            if (rotary_dim < head_dim)
                memcpy(o + rotary_dim, xh + rotary_dim, sizeof(float) * (head_dim - rotary_dim));
        }
    }
    return 0;
}

/* The K/V store of a float32 paged cache: key/value row t (token_elems floats at key + t *
 * key_stride, value + t * value_stride) go to slot slots[t] of k_cache / v_cache (each
 * [num_slots, token_elems], contiguous); a slot < 0 (padding) is skipped. Returns -1 (having
 * written the rows before it) at a slot >= num_slots; else 0. */
int store_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, const int64_t *slots,
                 int64_t tokens, float *k_cache, float *v_cache, int64_t num_slots, int64_t token_elems)
{
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        if (s >= num_slots) return -1;
        memcpy(k_cache + s * token_elems, key + t * key_stride, sizeof(float) * token_elems);
        memcpy(v_cache + s * token_elems, value + t * value_stride, sizeof(float) * token_elems);
    }
    return 0;
}
