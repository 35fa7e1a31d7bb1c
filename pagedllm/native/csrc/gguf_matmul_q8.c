/*
 * y = x W^T for GGUF Q4_0 / Q4_1 / Q8_0 weights W kept packed, with the activations x quantized to
 * 8 bits first (llama.cpp's scheme: blocks of 32 values, one float scale each) so that the inner
 * products are integer dot products of bytes: VNNI `vpdpbusd` (AVX512-VNNI + VL, or AVX-VNNI) where
 * the CPU has it, else AVX2 `vpmaddubsw` + `vpmaddwd`. The library is compiled with -march=native on
 * the machine that runs it (kernels.py), so the choice is made per CPU; a CPU without AVX2 / F16C /
 * FMA gets no Q8 path (gguf_q8_supported says 0) and the caller keeps the float-activation kernel.
 *
 * Arithmetic. A weight block is w = dw * u + mw with u unsigned: Q4_1 u = nibble, mw = its min;
 * Q4_0 u = nibble, mw = -8 dw; Q8_0 u = q + 128 (VNNI) and mw = -128 dw. An activation block is
 * x ~ dx * q with q = round(x / dx) in [-127, 127], dx = max|x| / 127. So one block contributes
 *     sum_i w_i x_i ~ dw dx sum_i u_i q_i + mw dx sum_i q_i,
 * the first sum exact in int32 and the second precomputed per activation block (sx = dx sum q).
 * Without VNNI, Q8_0 uses the sign trick instead (|w| times sign(w) q: u8 x s8 pairs must fit
 * int16 in vpmaddubsw) and mw = 0. The only approximation is q (relative error <= 1/254 of the
 * block's largest value); the rest is float32 rounding.
 *
 * Layout. Blocks are taken four at a time (a "group", 128 weights): lane pair 2i, 2i+1 of a
 * 256-bit int32 accumulator sums block i of the group, so one int -> float conversion and one
 * fused multiply-add apply four blocks' scales. The activations are stored in that interleaved
 * order (XGroup); the weights are shuffled into it in registers (load4), once per weight row and
 * group, and shared by all the activation rows of the tile.
 *
 * Threads: the activation rows are quantized in parallel, then the work items (a block of MB
 * activation rows, a chunk of 16 weight rows) are split over the threads. Within an item,
 * activation rows go MR at a time, each weight group decoded once per MR rows; with 1-3 rows,
 * 4 or 2 Q4 weight rows go side by side (independent dependency chains for the out-of-order core).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q_Q4_0 = 2, Q_Q4_1 = 3, Q_Q8_0 = 8 };

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define Q8_AVAILABLE 1

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define Q8_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define Q8_VNNI 0
/* u8 x s8 products summed by fours into int32 lanes; pairs must fit int16 (|u s| <= 16256). */
static inline __m256i dpbusd_avx2(__m256i acc, __m256i u, __m256i s)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define DPBUSD(acc, u, s) dpbusd_avx2((acc), (u), (s))
#endif

#define MR 8  /* activation rows sharing one decode of a weight group */
#define MB 64 /* activation rows per work item (a multiple of MR) */

/* Four activation blocks: q[j] holds values 8j..8j+7 of blocks 0, 1, 2, 3 (8 bytes each); d and s
 * hold each block's dx and dx * sum(q) / 2, twice (one per lane of its lane pair). */
typedef struct {
    int8_t q[4][32];
    float d[8];
    float s[8];
} XGroup;

static inline float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int hsum8i(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One activation row (k values, k a multiple of 32) into ceil(k / 128) groups; blocks past the row
 * are zero (they contribute nothing, whatever the weights there). */
static void quantize_row(const float *x, int64_t k, XGroup *out)
{
    const int64_t nb = k / 32, ng = (nb + 3) / 4;
    memset(out + nb / 4, 0, sizeof(XGroup) * (size_t)(ng - nb / 4));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + 32 * b;
        XGroup *g = out + b / 4;
        const int i = (int)(b % 4);
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        const float a = hmax8(amax), d = a / 127.0f, id = a > 0.0f ? 127.0f / a : 0.0f;
        __m256i q[4];
        for (int j = 0; j < 4; ++j)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const int isum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        /* int32 -> int8: bytes come out as [q0, q2 | q1, q3], 8 each. */
        const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
        const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
        const __m256i bytes = _mm256_packs_epi16(p01, p23);
        const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
        _mm_storel_epi64((__m128i *)(g->q[0] + 8 * i), lo);
        _mm_storel_epi64((__m128i *)(g->q[2] + 8 * i), _mm_unpackhi_epi64(lo, lo));
        _mm_storel_epi64((__m128i *)(g->q[1] + 8 * i), hi);
        _mm_storel_epi64((__m128i *)(g->q[3] + 8 * i), _mm_unpackhi_epi64(hi, hi));
        g->d[2 * i] = g->d[2 * i + 1] = d;
        g->s[2 * i] = g->s[2 * i + 1] = d * (float)isum * 0.5f;
    }
}

/* [h0, h0, h1, h1, h2, h2, h3, h3] as floats, h_i the f16 at byte off of block p[i]. */
static inline __m256 scales4(const uint8_t *const p[4], int off)
{
    /* One 64-bit integer, then a register unpack: going through a stack array instead stalls on
     * store forwarding (16-bit stores read back by vpinsrw), which cost 3x the whole product. */
    uint64_t h = 0;
    for (int i = 0; i < 4; ++i) h |= (uint64_t)(p[i][off] | (p[i][off + 1] << 8)) << (16 * i);
    const __m128i v = _mm_cvtsi64_si128((long long)h);
    return _mm256_cvtph_ps(_mm_unpacklo_epi16(v, v));
}

/* Weight group: u[j] = values 8j..8j+7 of blocks b[0..3] (XGroup's order), dw and mw per lane. */
typedef struct {
    __m256i u[4];
    __m256 dw, mw;
} WGroup;

static inline __m256i pair_lo(__m128i a, __m128i b, __m128i c, __m128i d)
{
    return _mm256_set_m128i(_mm_unpacklo_epi64(c, d), _mm_unpacklo_epi64(a, b));
}

static inline __m256i pair_hi(__m128i a, __m128i b, __m128i c, __m128i d)
{
    return _mm256_set_m128i(_mm_unpackhi_epi64(c, d), _mm_unpackhi_epi64(a, b));
}

/* Decode blocks g0 .. g0+3 of a row (indices past nb repeat the last block: its x is zero). */
static inline __attribute__((always_inline)) WGroup load4(int type, const uint8_t *row, int64_t bb, int64_t g0,
                                                          int64_t nb)
{
    const uint8_t *p[4];
    for (int i = 0; i < 4; ++i) p[i] = row + (g0 + i < nb ? g0 + i : nb - 1) * bb;
    WGroup w;
    if (type == Q_Q8_0) {
        __m128i l[4], h[4];
        for (int i = 0; i < 4; ++i) {
            l[i] = _mm_loadu_si128((const __m128i *)(p[i] + 2));
            h[i] = _mm_loadu_si128((const __m128i *)(p[i] + 18));
        }
        w.u[0] = pair_lo(l[0], l[1], l[2], l[3]);
        w.u[1] = pair_hi(l[0], l[1], l[2], l[3]);
        w.u[2] = pair_lo(h[0], h[1], h[2], h[3]);
        w.u[3] = pair_hi(h[0], h[1], h[2], h[3]);
        w.dw = scales4(p, 0);
#if Q8_VNNI
        const __m256i bias = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < 4; ++j) w.u[j] = _mm256_xor_si256(w.u[j], bias); /* q + 128, unsigned */
        w.mw = _mm256_mul_ps(w.dw, _mm256_set1_ps(-128.0f));
#else
        w.mw = _mm256_setzero_ps(); /* signed weights: dot_group uses the sign trick */
#endif
        return w;
    }
    const int off = type == Q_Q4_1 ? 4 : 2;
    __m128i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm_loadu_si128((const __m128i *)(p[i] + off));
    const __m256i a = pair_lo(n[0], n[1], n[2], n[3]), b = pair_hi(n[0], n[1], n[2], n[3]);
    const __m256i f = _mm256_set1_epi8(0x0f);
    w.u[0] = _mm256_and_si256(a, f);
    w.u[1] = _mm256_and_si256(b, f);
    w.u[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), f);
    w.u[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), f);
    w.dw = scales4(p, 0);
    w.mw = type == Q_Q4_1 ? scales4(p, 2) : _mm256_mul_ps(w.dw, _mm256_set1_ps(-8.0f));
    return w;
}

/* acc += this group's contribution for one activation group (per lane; lanes summed at the end). */
static inline __attribute__((always_inline)) __m256 dot_group(int type, const WGroup *w, const XGroup *x,
                                                              __m256 acc)
{
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        __m256i xq = _mm256_loadu_si256((const __m256i *)x->q[j]);
        __m256i u = w->u[j];
        if (!Q8_VNNI && type == Q_Q8_0) { /* |w| times sign(w) x keeps each pair within int16 */
            xq = _mm256_sign_epi8(xq, u);
            u = _mm256_abs_epi8(u);
        }
        s = DPBUSD(s, u, xq);
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w->dw, _mm256_loadu_ps(x->d)), acc);
    return _mm256_fmadd_ps(w->mw, _mm256_loadu_ps(x->s), acc);
}

/* y[m, n] for weight rows [n0, n1) and MRC (compile-time) activation rows of xq (ng groups a row),
 * RN weight rows at a time: with few activation rows, several weight rows give the core
 * independent dependency chains (the four vpdpbusd of a group form one). */
static inline __attribute__((always_inline)) void tile(int type, const uint8_t *w, int64_t row_bytes, int64_t bb,
                                                       int64_t n0, int64_t n1, int64_t nb, const XGroup *xq,
                                                       float *y, int64_t ldy, const int MRC, const int RN)
{
    const int64_t ng = (nb + 3) / 4;
    int64_t n = n0;
    for (; n + RN <= n1; n += RN) {
        __m256 acc[4][MR];
        for (int r = 0; r < RN; ++r)
            for (int m = 0; m < MRC; ++m) acc[r][m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g)
            for (int r = 0; r < RN; ++r) {
                const WGroup wg = load4(type, w + (n + r) * row_bytes, bb, 4 * g, nb);
                for (int m = 0; m < MRC; ++m) acc[r][m] = dot_group(type, &wg, xq + m * ng + g, acc[r][m]);
            }
        for (int r = 0; r < RN; ++r)
            for (int m = 0; m < MRC; ++m) y[m * ldy + n + r] = hsum8(acc[r][m]);
    }
    for (; n < n1; ++n) { /* the rows left over */
        __m256 acc[MR];
        for (int m = 0; m < MRC; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g) {
            const WGroup wg = load4(type, w + n * row_bytes, bb, 4 * g, nb);
            for (int m = 0; m < MRC; ++m) acc[m] = dot_group(type, &wg, xq + m * ng + g, acc[m]);
        }
        for (int m = 0; m < MRC; ++m) y[m * ldy + n] = hsum8(acc[m]);
    }
}

/* Specialised per tile height and format (constants), so that each has its accumulators in
 * registers and no format test in its loops. Q8_0 rows side by side ran 3x slower (measured: the
 * LM head at batch 1), Q4 rows 1.3-1.7x faster at 1-3 activation rows. */
#define TILES(T, BB, RN_SMALL)                                                                       \
    switch (mr) {                                                                                    \
    case 1: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 1, RN_SMALL); break;                   \
    case 2: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 2, RN_SMALL > 2 ? 2 : RN_SMALL); break; \
    case 3: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 3, RN_SMALL > 2 ? 2 : RN_SMALL); break; \
    case 4: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 4, 1); break;                          \
    case 5: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 5, 1); break;                          \
    case 6: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 6, 1); break;                          \
    case 7: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 7, 1); break;                          \
    default: tile(T, w, row_bytes, BB, n0, n1, nb, xq, y, ldy, 8, 1); break;                         \
    }

static void tile_any(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb,
                     const XGroup *xq, int64_t mr, float *y, int64_t ldy)
{
    if (type == Q_Q4_0) {
        TILES(Q_Q4_0, 18, 4)
    } else if (type == Q_Q4_1) {
        TILES(Q_Q4_1, 20, 4)
    } else {
        TILES(Q_Q8_0, 34, 1)
    }
}
#undef TILES
#endif /* Q8_AVAILABLE */

/* Whether gguf_matmul_q8 multiplies `type` on this build (1) or not (0: use gguf_matmul). */
int gguf_q8_supported(int type)
{
#ifdef Q8_AVAILABLE
    return type == Q_Q4_0 || type == Q_Q4_1 || type == Q_Q8_0;
#else
    (void)type;
    return 0;
#endif
}

/* Whether the integer dot products use VNNI (2), AVX2 (1), or there is no Q8 path (0). */
int gguf_q8_isa(void)
{
#ifdef Q8_AVAILABLE
    return Q8_VNNI ? 2 : 1;
#else
    return 0;
#endif
}

/* y [M, ldy] columns [0, N) = q8(x [M, K], row stride ldx) times W^T, W packed [N, K] of `type`
 * (Q4_0, Q4_1 or Q8_0) with row stride row_bytes; K a multiple of 32 (the caller checks). Returns
 * -1 for a type without a Q8 path and -2 for a failed scratch allocation. */
int gguf_matmul_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t n_rows, int64_t k, const float *x,
                   int64_t ldx, int64_t m_rows, float *y, int64_t ldy, int num_threads)
{
    if (!gguf_q8_supported(type)) return -1;
#ifdef Q8_AVAILABLE
    const int64_t nb = k / 32, ng = (nb + 3) / 4;
    XGroup *xq = aligned_alloc(64, sizeof(XGroup) * (size_t)(ng * m_rows));
    if (xq == NULL) return -2;
    /* Work items: (block of MB activation rows, chunk of 16 weight rows), weight chunks varying
     * fastest: a block's quantized rows (MB x K bytes) stay in L2 while the weights stream past. */
    const int64_t chunk = 16, n_chunks = (n_rows + chunk - 1) / chunk, n_mblocks = (m_rows + MB - 1) / MB;
#pragma omp parallel num_threads(num_threads) if (n_rows * k >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < m_rows; ++m) quantize_row(x + m * ldx, k, xq + m * ng);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_mblocks * n_chunks; ++item) {
            const int64_t c = item % n_chunks, mb0 = item / n_chunks * MB;
            const int64_t mb1 = mb0 + MB < m_rows ? mb0 + MB : m_rows;
            const int64_t n0 = c * chunk, n1 = n0 + chunk < n_rows ? n0 + chunk : n_rows;
            for (int64_t m0 = mb0; m0 < mb1; m0 += MR) {
                const int64_t mr = mb1 - m0 < MR ? mb1 - m0 : MR;
                tile_any(type, w, row_bytes, n0, n1, nb, xq + m0 * ng, mr, y + m0 * ldy, ldy);
            }
        }
    }
    free(xq);
    return 0;
#else
    (void)w, (void)row_bytes, (void)n_rows, (void)k, (void)x, (void)ldx, (void)m_rows, (void)y, (void)ldy,
        (void)num_threads;
    return -1;
#endif
}
