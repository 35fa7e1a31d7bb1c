/*
 * Decode attention on the CPU that reads K/V in place from the paged cache.
 *
 * The torch path gathers each request's pages into a contiguous copy and then runs SDPA on it, so
 * every key and value crosses memory three times (read, write, read again). This kernel reads each
 * once: per request it scores every query head against each key of the context, takes a
 * max-subtracted softmax per head, and sums the values, walking the pages of the block table.
 *
 * Layout (see pagedllm/attention/backend.py): the cache is [2, num_blocks, block_size, num_kv_heads,
 * head_dim] float32, or one byte an element (a float8 cache, kv_cache_dtype "fp8*") with `lut` the
 * float value of each of the 256 bytes; query and out are [num_tokens, num_heads, head_dim] float32,
 * contiguous. Query head h uses KV head h / (num_heads / num_kv_heads). A float8 cache is upcast a
 * row at a time through the table into a per-thread buffer (correct, not fast: values are
 * converted once per query head instead of once per KV head).
 *
 * Work: one item per (decode request, slice of its query heads). A slice holds all heads unless
 * there are fewer requests than threads (then whole KV groups); whole-token rows (all KV heads,
 * contiguous) stream from memory best. Items are shared by OpenMP threads (torch's libgomp, so torch's pool). Scratch per
 * thread: heads * max_seq_len scores + heads * head_dim sums. Head sizes 64 and 128 get code with
 * the size fixed at compile time (unrolled dot products); a float8 cache takes the generic code.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

typedef struct {
    const float *query;
    const void *k_cache, *v_cache; /* float32, or bytes decoded by lut */
    const float *lut;              /* NULL for a float32 cache */
    float *out;
    const int32_t *block_tables;
    int64_t block_table_stride, block_stride, token_stride, block_size, num_heads, rep;
    float scale;
} Problem;

/* n float8 bytes decoded through the table into buf. */
static inline const float *decode_row(const float *lut, const uint8_t *src, int64_t n, float *buf)
{
    for (int64_t j = 0; j < n; ++j) buf[j] = lut[src[j]];
    return buf;
}

/* Attention of query heads [h0, h1) of one request with context length len; row_buf holds one
 * token's decoded row (token_stride floats) for a float8 cache. */
static inline __attribute__((always_inline)) void attend(
    const Problem *p, int64_t query_row, const int32_t *table, int64_t len, int64_t h0, int64_t h1,
    const int64_t head_dim, float *scores, float *row_buf, const int fp8)
{
    const int64_t block_bytes = p->block_stride * (fp8 ? 1 : (int64_t)sizeof(float)); /* fp8: a constant here */
    const int64_t nh = h1 - h0, ls = len + 1; /* score row stride: len scores + the normaliser */
    const float *q = p->query + (query_row * p->num_heads + h0) * head_dim;
    /* Scores: s[h][t] = scale * <q_h, k_t of h's KV head>. */
    for (int64_t t0 = 0; t0 < len; t0 += p->block_size) {
        const char *kb = (const char *)p->k_cache + (int64_t)table[t0 / p->block_size] * block_bytes;
        const int64_t n = len - t0 < p->block_size ? len - t0 : p->block_size;
        for (int64_t i = 0; i < n; ++i) {
            const float *k = fp8 ? decode_row(p->lut, (const uint8_t *)kb + i * p->token_stride, p->token_stride, row_buf)
                                 : (const float *)kb + i * p->token_stride;
            for (int64_t h = 0; h < nh; ++h) {
                const float *qh = q + h * head_dim, *kh = k + ((h0 + h) / p->rep) * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
                scores[h * ls + t0 + i] = s * p->scale;
            }
        }
    }
    /* Softmax per head; the normaliser is applied to the output. */
    for (int64_t h = 0; h < nh; ++h) {
        float *s = scores + h * ls;
        float m = s[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            s[t] = exp_nonpositive(s[t] - m);
            sum += s[t];
        }
        s[len] = 1.0f / sum;
    }
    /* Weighted sum of the values, one head at a time so that its sums stay in registers (updating
     * a sums array in memory per token chained every update through a store: 3x slower). The heads
     * of a KV group re-read the same values, from L2. */
    float *o = p->out + (query_row * p->num_heads + h0) * head_dim;
    for (int64_t h = 0; h < nh; ++h) {
        const float *w = scores + h * ls;
        const int64_t kv_offset = ((h0 + h) / p->rep) * head_dim;
        float a[head_dim];
        for (int64_t d = 0; d < head_dim; ++d) a[d] = 0.0f;
        for (int64_t t0 = 0; t0 < len; t0 += p->block_size) {
            const char *vb = (const char *)p->v_cache + (int64_t)table[t0 / p->block_size] * block_bytes;
            const int64_t n = len - t0 < p->block_size ? len - t0 : p->block_size;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t at = i * p->token_stride + kv_offset;
                const float wt = w[t0 + i];
                const float *v = fp8 ? decode_row(p->lut, (const uint8_t *)vb + at, head_dim, row_buf)
                                     : (const float *)vb + at;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += wt * v[d];
            }
        }
        const float inv = w[len];
        for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = a[d] * inv;
    }
}

int paged_decode_attention(
    const float *query, const void *kv_cache, const float *lut, float *out,
    const int32_t *block_tables, int64_t block_table_stride,
    const int64_t *query_rows, const int64_t *table_rows, const int64_t *seq_lens, int64_t num_reqs,
    int64_t num_blocks, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int num_threads)
{
    const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
    const int64_t elem_bytes = lut == NULL ? (int64_t)sizeof(float) : 1;
    const Problem p = {query, kv_cache, (const char *)kv_cache + num_blocks * block_stride * elem_bytes, lut, out,
                       block_tables, block_table_stride, block_stride, token_stride, block_size, num_heads,
                       num_heads / num_kv_heads, scale};
    /* Split each request's heads into whole KV groups when there are too few requests to share
     * (any divisor of the KV heads: 3 KV heads on 2 threads make 3 items); never more threads than
     * items (an idle thread still costs its wake-up and the barrier). */
    int64_t slices = 1;
    while (num_reqs * slices < num_threads) {
        int64_t next = slices + 1;
        while (next <= num_kv_heads && num_kv_heads % next) ++next;
        if (next > num_kv_heads) break;
        slices = next;
    }
    if (num_reqs * slices < num_threads) num_threads = (int)(num_reqs * slices);
    if (num_threads < 1) num_threads = 1;
    const int64_t slice_heads = num_heads / slices;
    int64_t max_len = 1;
    for (int64_t r = 0; r < num_reqs; ++r)
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (slice_heads * (max_len + 1) + token_stride));
        float *row_buf = scores + slice_heads * (max_len + 1);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_reqs * slices; ++item) {
            if (scores == NULL) continue;
            const int64_t r = item / slices, h0 = (item % slices) * slice_heads, h1 = h0 + slice_heads;
            const int32_t *table = block_tables + table_rows[r] * block_table_stride;
            if (lut != NULL)
                attend(&p, query_rows[r], table, seq_lens[r], h0, h1, head_dim, scores, row_buf, 1);
            else if (head_dim == 64)
                attend(&p, query_rows[r], table, seq_lens[r], h0, h1, 64, scores, row_buf, 0);
            else if (head_dim == 128)
                attend(&p, query_rows[r], table, seq_lens[r], h0, h1, 128, scores, row_buf, 0);
            else
                attend(&p, query_rows[r], table, seq_lens[r], h0, h1, head_dim, scores, row_buf, 0);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
