/*
 * GGUF block formats on the CPU: exact dequantization of rows, and y = x W^T with W kept packed.
 *
 * A packed weight is W [N, K] stored row by row in llama.cpp's block layout: each row is K /
 * block_elems blocks of block_bytes (see ggml-quants.c / the gguf package):
 *   Q4_0 (type 2)  32 weights in 18 bytes: f16 d, 16 bytes of nibbles; w = d * (q - 8)
 *   Q4_1 (type 3)  32 in 20: f16 d, f16 m, nibbles;                       w = d * q + m
 *   Q8_0 (type 8)  32 in 34: f16 d, 32 int8;                             w = q * d
 *   Q4_K (type 12) 256 in 144: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
 *   Q5_K (type 13) 256 in 176: as Q4_K plus 32 bytes holding each weight's fifth bit
 *   Q6_K (type 14) 256 in 210: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d
 *   F32 (0), F16 (1) rows are formats too (one weight per element).
 * Nibble j of a 32-weight group holds weight j (low nibble) and weight j + 16 (high nibble).
 *
 * gguf_dequantize_rows computes each weight with the gguf package's float32 operations in its
 * order, so its output equals gguf.quants.dequantize bit for bit (no FMA contraction, no
 * reassociation in this file's dequantizers: see the pragmas).
 *
 * gguf_matmul: y[m, n] = sum_k x[m, k] W[n, k] for M rows of x. Threads share the N weight rows;
 * each weight row is read once per call (blocks of up to MR = 4 rows of x share one decode).
 * With AVX-512 the Q4_0 / Q4_1 / Q8_0 blocks are decoded into registers (nibbles -> floats ->
 * d * q + m) and multiplied there; other formats (and other CPUs) dequantize one row into a
 * per-thread float buffer (exactly) and take dot products with it. Sums are reassociated, so y
 * equals x @ dequantize(W)^T to float32 rounding, not bit for bit.
 */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#pragma STDC FP_CONTRACT OFF
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_AVX512 1
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

/* IEEE half -> float, exact (subnormals included), without F16C so that every CPU gets it. */
static inline float half_to_float(const uint8_t *p)
{
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do {
            ++e;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Elements and bytes of one block; 0 for a type this file does not know. */
int gguf_block_shape(int type, int64_t *elems, int64_t *bytes)
{
    static const int64_t table[][3] = {{T_F32, 1, 4},   {T_F16, 1, 2},     {T_Q4_0, 32, 18}, {T_Q4_1, 32, 20},
                                       {T_Q8_0, 32, 34}, {T_Q4_K, 256, 144}, {T_Q5_K, 256, 176}, {T_Q6_K, 256, 210}};
    for (size_t i = 0; i < sizeof table / sizeof table[0]; ++i)
        if (table[i][0] == type) {
            *elems = table[i][1];
            *bytes = table[i][2];
            return 1;
        }
    return 0;
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static inline void k_scale_min(const uint8_t *s, int j, float *sc, float *mn)
{
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Dequantize one block (block_elems weights) into out, exactly as the gguf package does. */
static void dequantize_block(int type, const uint8_t *b, float *out)
{
    switch (type) {
    case T_F32:
        memcpy(out, b, 4);
        break;
    case T_F16:
        out[0] = half_to_float(b);
        break;
    case T_Q4_0: {
        const float d = half_to_float(b);
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)((b[2 + j] & 0x0f) - 8);
            out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        break;
    }
    case T_Q4_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int j = 0; j < 16; ++j) {
            const float lo = d * (float)(b[4 + j] & 0x0f), hi = d * (float)(b[4 + j] >> 4);
            out[j] = lo + m;
            out[j + 16] = hi + m;
        }
        break;
    }
    case T_Q8_0: {
        const float d = half_to_float(b);
        for (int j = 0; j < 32; ++j) out[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == T_Q4_K ? 16 : 48);
        for (int j = 0; j < 8; ++j) {
            float sc, mn;
            k_scale_min(scales, j, &sc, &mn);
            const float dl = d * sc, ml = dmin * mn;
            const uint8_t *q = qs + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            for (int i = 0; i < 32; ++i) {
                int v = (q[i] >> shift) & 0x0f;
                if (type == T_Q5_K) v |= ((qh[i] >> j) & 1) << 4;
                const float t = dl * (float)v;
                out[j * 32 + i] = t - ml;
            }
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        for (int i = 0; i < 256; ++i) {
            const int half = i / 128, r = i % 128; /* 128 weights per half */
            const int low = (ql[half * 64 + r % 64] >> ((r / 64) * 4)) & 0x0f;
            const int high = (qh[half * 32 + r % 32] >> ((r / 32) * 2)) & 0x03;
            const float dl = d * (float)scales[i / 16];
            out[i] = dl * (float)((low | (high << 4)) - 32);
        }
        break;
    }
    }
}

static void dequantize_row(int type, const uint8_t *row, int64_t k, float *out)
{
    int64_t elems, bytes;
    gguf_block_shape(type, &elems, &bytes);
    for (int64_t b = 0; b < k / elems; ++b) dequantize_block(type, row + b * bytes, out + b * elems);
}

/* out [rows, k] = the rows of a packed tensor (row stride row_bytes), dequantized exactly.
 * Returns -1 for an unknown type. */
int gguf_dequantize_rows(int type, const uint8_t *packed, int64_t row_bytes, int64_t rows, int64_t k, float *out,
                         int num_threads)
{
    int64_t elems, bytes;
    if (!gguf_block_shape(type, &elems, &bytes)) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * k >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; ++r) dequantize_row(type, packed + r * row_bytes, k, out + r * k);
    return 0;
}

/* Same, for the rows listed in ids (an embedding lookup): out [n_ids, k]. */
int gguf_dequantize_gather(int type, const uint8_t *packed, int64_t row_bytes, const int64_t *ids, int64_t n_ids,
                           int64_t k, float *out, int num_threads)
{
    int64_t elems, bytes;
    if (!gguf_block_shape(type, &elems, &bytes)) return -1;
#pragma omp parallel for num_threads(num_threads) if (n_ids * k >= 65536) schedule(static)
    for (int64_t r = 0; r < n_ids; ++r) dequantize_row(type, packed + ids[r] * row_bytes, k, out + r * k);
    return 0;
}

/* ---- the product ------------------------------------------------------------------------- */
#pragma GCC reset_options
#pragma STDC FP_CONTRACT ON

#define MR 4 /* rows of x sharing one decode of a weight block */

/* y[m, n] for rows [n0, n1) of W and the m-rows [0, mr): dequantize each weight row into buf
 * (k floats), then one dot product per x row. Any format. */
static void rows_generic(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k,
                         const float *x, int64_t ldx, int64_t m_rows, float *y, int64_t ldy, float *buf)
{
    for (int64_t n = n0; n < n1; ++n) {
        dequantize_row(type, w + n * row_bytes, k, buf);
        for (int64_t m = 0; m < m_rows; ++m) {
            const float *xm = x + m * ldx;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < k; ++i) s += buf[i] * xm[i];
            y[m * ldy + n] = s;
        }
    }
}

#ifdef GGUF_AVX512
static inline __m512 bcast_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
}

/* Weights 0..15 and 16..31 of a 32-weight block, as floats. */
static inline __attribute__((always_inline)) void decode32(int type, const uint8_t *b, __m512 *lo, __m512 *hi)
{
    if (type == T_Q8_0) {
        const __m512 d = bcast_half(b);
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
        return;
    }
    const int off = type == T_Q4_1 ? 4 : 2;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + off)));
    const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
    const __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    const __m512 d = bcast_half(b);
    const __m512 m = type == T_Q4_1 ? bcast_half(b + 2) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    *lo = _mm512_fmadd_ps(d, ql, m);
    *hi = _mm512_fmadd_ps(d, qh, m);
}

/* Register path for the 32-weight formats: MRC (compile-time) rows of x per weight row. */
static inline __attribute__((always_inline)) void rows_avx512(
    int type, int64_t block_bytes, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k,
    const float *x, int64_t ldx, float *y, int64_t ldy, const int MRC)
{
    const int64_t nb = k / 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        __m512 acc[MR];
        for (int m = 0; m < MRC; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512 lo, hi;
            decode32(type, row + b * block_bytes, &lo, &hi);
            for (int m = 0; m < MRC; ++m) {
                const float *xb = x + m * ldx + b * 32;
                acc[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[m]);
                acc[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[m]);
            }
        }
        for (int m = 0; m < MRC; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m]);
    }
}

static void rows_fast(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t k,
                      const float *x, int64_t ldx, int64_t m_rows, float *y, int64_t ldy)
{
    const int64_t bb = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34;
    switch (m_rows) {
    case 1: rows_avx512(type, bb, w, row_bytes, n0, n1, k, x, ldx, y, ldy, 1); break;
    case 2: rows_avx512(type, bb, w, row_bytes, n0, n1, k, x, ldx, y, ldy, 2); break;
    case 3: rows_avx512(type, bb, w, row_bytes, n0, n1, k, x, ldx, y, ldy, 3); break;
    default: rows_avx512(type, bb, w, row_bytes, n0, n1, k, x, ldx, y, ldy, 4); break;
    }
}
#endif

static int has_fast_path(int type)
{
#ifdef GGUF_AVX512
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0;
#else
    (void)type;
    return 0;
#endif
}

/* y [M, ldy] columns [0, N) = x [M, K] (row stride ldx) times W^T, W packed [N, K] of `type` with
 * row stride row_bytes. K is a multiple of the block size (the caller checks). Returns -1 for an
 * unknown type or a failed scratch allocation. */
int gguf_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x,
                int64_t ldx, int64_t m_rows, float *y, int64_t ldy, int num_threads)
{
    int64_t elems, bytes;
    if (!gguf_block_shape(type, &elems, &bytes)) return -1;
    const int fast = has_fast_path(type);
    /* Split the weight rows in chunks of 16 (a few KiB of packed rows each) over the threads. */
    const int64_t chunk = 16, n_chunks = (n_rows + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (n_rows * k >= 32768)
    {
        float *buf = fast ? NULL : malloc(sizeof(float) * k);
        if (!fast && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n_chunks; ++c) {
            if (!fast && buf == NULL) continue;
            const int64_t n0 = c * chunk, n1 = n0 + chunk < n_rows ? n0 + chunk : n_rows;
            for (int64_t m0 = 0; m0 < m_rows; m0 += MR) {
                const int64_t mr = m_rows - m0 < MR ? m_rows - m0 : MR;
#ifdef GGUF_AVX512
                if (fast) {
                    rows_fast(type, w, row_bytes, n0, n1, k, x + m0 * ldx, ldx, mr, y + m0 * ldy, ldy);
                    continue;
                }
#endif
                rows_generic(type, w, row_bytes, n0, n1, k, x + m0 * ldx, ldx, mr, y + m0 * ldy, ldy, buf);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
