/* Decode attention over the paged KV cache (see ms_decode_attention). */
#include <omp.h>

#include "kernels.h"

/* ---- decode attention ---------------------------------------------------------------- */

#define ATT_CHUNK 32 /* context positions per pass: their K and V rows read once for all heads */
#define SPLIT_BYTES ((size_t)64 << 20) /* the most the splits' partial results may take */
#define HB 4 /* query heads of one kv head taken together: each key and value load feeds them all */
#define GROUPS (ATT_CHUNK / 4) /* a chunk's groups of 4 positions (see transpose4) */

/* How many work items a row's context splits into: at least 64 positions each, at most cap. */
static inline int64_t row_splits(int64_t len, int64_t window, int64_t cap) {
    const int64_t n = window > 0 && len > window ? window : len, most = (n + 63) / 64;
    return most < 1 ? 1 : most > cap ? cap : most;
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    vf acc = vf_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) acc = vf_fma(vf_load(a + i), vf_load(b + i), acc);
    float s = vf_sum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[i] = q . rows[i] for i < n (rows at stride d): eight rows at a time share each load of
 * q and one transposing reduction. */
static void dots(const float *q, const float *rows, int64_t n, int64_t d, float *out) {
    int64_t i = 0;
    if (d % VL == 0)
        for (; i + 8 <= n; i += 8) {
            vf a[8];
            for (int r = 0; r < 8; r++) a[r] = vf_zero();
            for (int64_t c = 0; c < d; c += VL) {
                const vf qv = vf_load(q + c);
                for (int r = 0; r < 8; r++) a[r] = vf_fma(qv, vf_load(rows + (i + r) * d + c), a[r]);
            }
            vf_sum8(a, out + i);
        }
    for (; i < n; i++) out[i] = dot_f32(q, rows + i * d, d);
}

/* acc[0..n) = acc * scale + sum_i w[i] * rows[i][0..n) (rows at stride ld), a few vectors of
 * acc held in registers across all the rows. */
static void weighted_rows(float *acc, float scale, const float *w, const float *rows, int64_t count, int64_t ld,
                          int64_t n) {
    int64_t c = 0;
    for (; c + 4 * VL <= n; c += 4 * VL) {
        vf r0 = vf_mul(vf_load(acc + c), vf_set1(scale)), r1 = vf_mul(vf_load(acc + c + VL), vf_set1(scale));
        vf r2 = vf_mul(vf_load(acc + c + 2 * VL), vf_set1(scale)), r3 = vf_mul(vf_load(acc + c + 3 * VL), vf_set1(scale));
        for (int64_t i = 0; i < count; i++) {
            const vf wi = vf_set1(w[i]);
            const float *row = rows + i * ld + c;
            r0 = vf_fma(wi, vf_load(row), r0), r1 = vf_fma(wi, vf_load(row + VL), r1);
            r2 = vf_fma(wi, vf_load(row + 2 * VL), r2), r3 = vf_fma(wi, vf_load(row + 3 * VL), r3);
        }
        vf_store(acc + c, r0), vf_store(acc + c + VL, r1), vf_store(acc + c + 2 * VL, r2), vf_store(acc + c + 3 * VL, r3);
    }
    for (; c < n; c++) {
        float r = acc[c] * scale;
        for (int64_t i = 0; i < count; i++) r += w[i] * rows[i * ld + c];
        acc[c] = r;
    }
}

/* Asks for the cache line at p (into L2). An asm statement, not __builtin_prefetch: GCC took a
 * function of nothing but __builtin_prefetch calls for pure and dropped its calls, so the
 * prefetches this file asked for were never compiled in. */
static inline void prefetch_line(const void *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

/* The next chunk's key and value rows of a kv head (n of them), asked for a group at a time
 * while this chunk's scores are computed (measured faster than all at the chunk's start). */
typedef struct {
    const char *k[ATT_CHUNK], *v[ATT_CHUNK];
    int64_t n, k_bytes, v_bytes;
} ahead_rows;

/* the lines of bytes [p, p + n) */
static inline void prefetch_span(const char *p, int64_t n) {
    const uintptr_t last = ((uintptr_t)p + (uintptr_t)n - 1) & ~(uintptr_t)63;
    for (uintptr_t line = (uintptr_t)p & ~(uintptr_t)63; line <= last; line += 64) prefetch_line((const void *)line);
}

static inline void prefetch_ahead(const ahead_rows *a, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1 && i < a->n; i++) {
        prefetch_span(a->k[i], a->k_bytes);
        if (a->v_bytes) prefetch_span(a->v[i], a->v_bytes);
    }
}

/* slots of positions [p0, min(p0 + ATT_CHUNK, end)) into out, those past end repeating the
 * last (finite rows that weigh 0): one division a chunk, not one a position */
static void chunk_slots(const int32_t *table, int64_t block_size, int64_t p0, int64_t end, int64_t *out) {
    const int64_t n = end - p0 < ATT_CHUNK ? end - p0 : ATT_CHUNK;
    int64_t blk = p0 / block_size, off = p0 % block_size;
    for (int64_t i = 0; i < n; i++) {
        out[i] = (int64_t)table[blk] * block_size + off;
        if (++off == block_size) off = 0, blk++;
    }
    for (int64_t i = n; i < ATT_CHUNK; i++) out[i] = out[n - 1];
}

/* the bytes a row of d values takes in the cache (scale_at: where an 8-bit row's scale is, an
 * int4 row's width) */
static inline int64_t kv_row_bytes(int kind, int64_t scale_at) {
    return kind == KV_BF16 ? 2 * scale_at
           : kind == KV_INT4 ? scale_at / 2 + 2 * ((scale_at + KV_INT4_GROUP - 1) / KV_INT4_GROUP)
                             : scale_at + 2;
}

/* kv head g's rows at the n positions of slots (the next chunk's: n may be 0); MLA's values
 * are its keys' rows, asked for once */
static void head_rows_ahead(ahead_rows *a, const int64_t *slots, int64_t n, const void *k_cache, int64_t k_slot,
                            int64_t k_head, int64_t k_row, const void *v_cache, int64_t v_slot, int64_t v_head,
                            int64_t v_row, int64_t elem, int64_t g) {
    const int same = k_cache == v_cache && k_slot == v_slot && k_head == v_head;
    a->n = n < ATT_CHUNK ? n : ATT_CHUNK, a->k_bytes = k_row > v_row || !same ? k_row : v_row;
    a->v_bytes = same ? 0 : v_row;
    for (int64_t i = 0; i < a->n; i++) {
        a->k[i] = (const char *)k_cache + (slots[i] * k_slot + g * k_head) * elem;
        a->v[i] = (const char *)v_cache + (slots[i] * v_slot + g * v_head) * elem;
    }
}

/* ---- all query heads of a kv head at once ----------------------------------------------
 * Each kv head's rows serve H / G query heads: up to HB of them take a chunk together, so a
 * key or value vector, once loaded (and widened), feeds HB products. The scores come out with
 * positions in lanes and no horizontal sum per position: four rows at a time are transposed
 * within each 128-bit lane (transpose4), so lane i of 128-bit lane m holds row i's element
 * 4m + k of the vector in t[k], and the query, arranged to match once per work item
 * (arrange_q), multiplies them as they stand; the 128-bit lanes' partial sums of a group of 4
 * positions add up at the end of the chunk (sum_groups), VL / 4 groups into one vector. */

/* dst[v * 4 + k * VL + 4m + i] = src[v + 4m + k] for each vector v (VL 32-bit units: floats,
 * or bf16 pairs), k < 4, m < VL / 4, i < 4: the query vectors that meet transpose4's t[k]
 * (4 * units in all: each unit once per position of a group) */
static void arrange_q(const uint32_t *src, int64_t units, uint32_t *dst) {
    for (int64_t v = 0; v < units; v += VL)
        for (int k = 0; k < 4; k++)
            for (int m = 0; m < VL / 4; m++)
                for (int i = 0; i < 4; i++) dst[v * 4 + k * VL + 4 * m + i] = src[v + 4 * m + k];
}

/* a 4x4 transpose of 32-bit elements within each 128-bit lane (see above) */
static inline void transpose4(const vi x[4], vi t[4]) {
#if defined(MS_AVX512)
    const vi a0 = _mm512_unpacklo_epi32(x[0], x[1]), a1 = _mm512_unpackhi_epi32(x[0], x[1]);
    const vi a2 = _mm512_unpacklo_epi32(x[2], x[3]), a3 = _mm512_unpackhi_epi32(x[2], x[3]);
    t[0] = _mm512_unpacklo_epi64(a0, a2), t[1] = _mm512_unpackhi_epi64(a0, a2);
    t[2] = _mm512_unpacklo_epi64(a1, a3), t[3] = _mm512_unpackhi_epi64(a1, a3);
#else
    const vi a0 = _mm256_unpacklo_epi32(x[0], x[1]), a1 = _mm256_unpackhi_epi32(x[0], x[1]);
    const vi a2 = _mm256_unpacklo_epi32(x[2], x[3]), a3 = _mm256_unpackhi_epi32(x[2], x[3]);
    t[0] = _mm256_unpacklo_epi64(a0, a2), t[1] = _mm256_unpackhi_epi64(a0, a2);
    t[2] = _mm256_unpacklo_epi64(a1, a3), t[3] = _mm256_unpackhi_epi64(a1, a3);
#endif
}

/* VL / 4 groups' partial sums (consecutive vectors) -> the VL positions' scores, in order */
static inline vf sum_groups(const float *part) {
#if defined(MS_AVX512)
    const vf a0 = vf_load(part), a1 = vf_load(part + VL), a2 = vf_load(part + 2 * VL), a3 = vf_load(part + 3 * VL);
    const vf b01 = vf_add(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
    const vf b23 = vf_add(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
    return vf_add(_mm512_shuffle_f32x4(b01, b23, 0x88), _mm512_shuffle_f32x4(b01, b23, 0xdd));
#else
    const vf a0 = vf_load(part), a1 = vf_load(part + VL);
    return vf_add(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
#endif
}

/* part [hb][GROUPS][VL] (groups 0..groups) -> s [hb][ATT_CHUNK]: n scores times scale, the
 * rest -inf */
static void finish_scores(int hb, int64_t groups, int64_t n, float *part, float scale, float *s) {
    for (int hh = 0; hh < hb; hh++) {
        float *ph = part + hh * GROUPS * VL, *sh = s + hh * ATT_CHUNK;
        for (int64_t j = groups; j % (VL / 4); j++) memset(ph + j * VL, 0, VL * sizeof(float));
        for (int64_t j = 0; j < groups; j += VL / 4) vf_store(sh + 4 * j, vf_mul(sum_groups(ph + j * VL), vf_set1(scale)));
        for (int64_t t = n; t < ATT_CHUNK; t++) sh[t] = -INFINITY;
    }
}

/* a row's VL values from off: bf16 cache rows (widened here) or float32 ones */
static inline vf row_vector(const void *row, int64_t off, const int is_bf16) {
    return is_bf16 ? vf_load_bf16((const bf16 *)row + off) : vf_load((const float *)row + off);
}

/* s [hb][ATT_CHUNK] = the scores of hb query heads (qa: arranged, 4 d floats a head) against
 * the n key rows rows[i] (ATT_CHUNK pointers, those past n repeating a row; bf16 or float32) */
static inline __attribute__((always_inline)) void scores_f32(const int hb, const int is_bf16, const void *const *rows,
                                                             int64_t n, const float *qa, int64_t d, float *part,
                                                             float *s, const ahead_rows *ahead) {
    const int64_t groups = (n + 3) / 4;
    for (int64_t j = 0; j < groups; j++) {
        if (ahead) prefetch_ahead(ahead, 4 * j, j == groups - 1 ? ATT_CHUNK : 4 * j + 4);
        vf acc[HB];
        for (int hh = 0; hh < hb; hh++) acc[hh] = vf_zero();
        for (int64_t v = 0; v < d; v += VL) {
            vi x[4], t[4];
            for (int r = 0; r < 4; r++) x[r] = vf_as_vi(row_vector(rows[4 * j + r], v, is_bf16));
            transpose4(x, t);
            for (int hh = 0; hh < hb; hh++)
                for (int k = 0; k < 4; k++) acc[hh] = vf_fma(vi_as_vf(t[k]), vf_load(qa + hh * 4 * d + v * 4 + k * VL), acc[hh]);
        }
        for (int hh = 0; hh < hb; hh++) vf_store(part + (hh * GROUPS + j) * VL, acc[hh]);
    }
    finish_scores(hb, groups, n, part, 1.0f, s);
}

/* A head's chunk of scores s[0..ATT_CHUNK) (-inf past n) -> its weights exp(s - m) (0 past
 * n), with its running maximum and sum (stats) moved on; returns the factor what the head
 * has accumulated so far takes (exp(old max - m)). */
static float softmax_chunk(float *s, int64_t n, float *stats) {
    const int64_t nv = (n + VL - 1) / VL;
    vf vmax = vf_load(s);
    for (int64_t t = 1; t < nv; t++) vmax = vf_max(vmax, vf_load(s + t * VL));
    const float top = vf_hmax(vmax), m = stats[0] > top ? stats[0] : top, rescale = expf(stats[0] - m);
    for (int64_t t = 0; t < nv; t++) vf_store(s + t * VL, vf_exp(vf_sub(vf_load(s + t * VL), vf_set1(m))));
    for (int64_t t = n; t < ATT_CHUNK; t++) s[t] = 0.0f; /* vf_exp clamps: exp(-inf) would not be 0 */
    vf vs = vf_zero();
    for (int64_t t = 0; t < nv; t++) vs = vf_add(vs, vf_load(s + t * VL));
    stats[0] = m, stats[1] = stats[1] * rescale + vf_sum(vs);
    return rescale;
}

#define VCB (VL == 16 ? 4 : 2) /* value vectors of a row in registers at once, for HB heads */

/* acc[hh][0..d) = acc[hh] * rescale[hh] + sum_i w[hh][i] * rows[i] for hb heads (w [hb][ATT_CHUNK],
 * rows as scores_f32's): each value vector loaded (and widened) once for the hb heads */
static inline __attribute__((always_inline)) void values_f32(const int hb, const int is_bf16, float *const *acc,
                                                             const float *rescale, const float *w,
                                                             const void *const *rows, int64_t n, int64_t d) {
    int64_t c = 0;
    for (; c + VCB * VL <= d; c += VCB * VL) {
        vf r[HB][VCB];
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < VCB; u++) r[hh][u] = vf_mul(vf_load(acc[hh] + c + u * VL), vf_set1(rescale[hh]));
        for (int64_t i = 0; i < n; i++) {
            vf x[VCB];
            for (int u = 0; u < VCB; u++) x[u] = row_vector(rows[i], c + u * VL, is_bf16);
            for (int hh = 0; hh < hb; hh++) {
                const vf wi = vf_set1(w[hh * ATT_CHUNK + i]);
                for (int u = 0; u < VCB; u++) r[hh][u] = vf_fma(wi, x[u], r[hh][u]);
            }
        }
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < VCB; u++) vf_store(acc[hh] + c + u * VL, r[hh][u]);
    }
    for (; c < d; c += VL) {
        vf r[HB];
        for (int hh = 0; hh < hb; hh++) r[hh] = vf_mul(vf_load(acc[hh] + c), vf_set1(rescale[hh]));
        for (int64_t i = 0; i < n; i++) {
            const vf x = row_vector(rows[i], c, is_bf16);
            for (int hh = 0; hh < hb; hh++) r[hh] = vf_fma(vf_set1(w[hh * ATT_CHUNK + i]), x, r[hh]);
        }
        for (int hh = 0; hh < hb; hh++) vf_store(acc[hh] + c, r[hh]);
    }
}

#if defined(MS_AVX512_BF16)
/* The same on vdpbf16ps, straight from a bf16 cache's rows (no widening): the keys' bf16
 * pairs times the query's (bf16 as given, unscaled: the products are exact, the scale
 * multiplies the float32 scores), and the values as pairs of positions (two rows interleaved)
 * times the weights rounded to bf16 (as the reference's bf16 matmul of probabilities and values
 * rounds them), all summed in float32. */
static inline __m512bh as_bh(vi x) {
    __m512bh b;
    memcpy(&b, &x, 64);
    return b;
}

static inline __attribute__((always_inline)) void scores_bf16(const int hb, const bf16 *const *rows, int64_t n,
                                                              const uint32_t *qa, int64_t d, float scale, float *part,
                                                              float *s, const ahead_rows *ahead) {
    const int64_t groups = (n + 3) / 4;
    for (int64_t j = 0; j < groups; j++) {
        if (ahead) prefetch_ahead(ahead, 4 * j, j == groups - 1 ? ATT_CHUNK : 4 * j + 4);
        vf acc[HB];
        for (int hh = 0; hh < hb; hh++) acc[hh] = vf_zero();
        for (int64_t v = 0; v < d; v += 2 * VL) { /* v: in bf16 values, VL pairs a vector */
            vi x[4], t[4];
            for (int r = 0; r < 4; r++) x[r] = vi_load(rows[4 * j + r] + v);
            transpose4(x, t);
            for (int hh = 0; hh < hb; hh++)
                for (int k = 0; k < 4; k++)
                    acc[hh] = _mm512_dpbf16_ps(acc[hh], as_bh(t[k]), as_bh(vi_load(qa + hh * 2 * d + v * 2 + k * VL)));
        }
        for (int hh = 0; hh < hb; hh++) vf_store(part + (hh * GROUPS + j) * VL, acc[hh]);
    }
    finish_scores(hb, groups, n, part, scale, s);
}

/* word j of the result from word idx[j] of (a, b) (64 words): the interleavings of two rows */
static const uint16_t pair_lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t pair_hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
static const uint16_t high_words[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                        33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};

/* values_f32's sum from bf16 rows (rows[i]: ATT_CHUNK pointers, those past n repeating a row;
 * w 0 past n) two positions a product: columns c..c + 2 * VL of positions 2p and 2p + 1
 * interleaved into two vectors of (row 2p, row 2p + 1) pairs */
static inline __attribute__((always_inline)) void values_bf16(const int hb, float *const *acc, const float *rescale,
                                                              const float *w, const bf16 *const *rows, int64_t n,
                                                              int64_t d) {
    uint32_t wp[HB][ATT_CHUNK / 2]; /* the weights as bf16 pairs, positions 2p and 2p + 1 */
    const vi lo = vi_load(pair_lo), hi = vi_load(pair_hi), high = vi_load(high_words);
    for (int hh = 0; hh < hb; hh++) {
        const vi a = vf_as_vi(vf_round_bf16(vf_load(w + hh * ATT_CHUNK)));
        const vi b = vf_as_vi(vf_round_bf16(vf_load(w + hh * ATT_CHUNK + VL)));
        vi_store(wp[hh], _mm512_permutex2var_epi16(a, high, b));
    }
    const int64_t pairs = (n + 1) / 2;
    int64_t c = 0;
    for (; c + 4 * VL <= d; c += 4 * VL) {
        vf r[HB][4];
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < 4; u++) r[hh][u] = vf_mul(vf_load(acc[hh] + c + u * VL), vf_set1(rescale[hh]));
        for (int64_t p = 0; p < pairs; p++) {
            const bf16 *ra = rows[2 * p] + c, *rb = rows[2 * p + 1] + c;
            const vi a0 = vi_load(ra), b0 = vi_load(rb), a1 = vi_load(ra + 2 * VL), b1 = vi_load(rb + 2 * VL);
            const __m512bh x[4] = {as_bh(_mm512_permutex2var_epi16(a0, lo, b0)),
                                   as_bh(_mm512_permutex2var_epi16(a0, hi, b0)),
                                   as_bh(_mm512_permutex2var_epi16(a1, lo, b1)),
                                   as_bh(_mm512_permutex2var_epi16(a1, hi, b1))};
            for (int hh = 0; hh < hb; hh++) {
                const __m512bh wv = as_bh(_mm512_set1_epi32((int32_t)wp[hh][p]));
                for (int u = 0; u < 4; u++) r[hh][u] = _mm512_dpbf16_ps(r[hh][u], x[u], wv);
            }
        }
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < 4; u++) vf_store(acc[hh] + c + u * VL, r[hh][u]);
    }
    for (; c < d; c += 2 * VL) { /* d % (2 * VL) == 0 */
        vf r[HB][2];
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < 2; u++) r[hh][u] = vf_mul(vf_load(acc[hh] + c + u * VL), vf_set1(rescale[hh]));
        for (int64_t p = 0; p < pairs; p++) {
            const vi a0 = vi_load(rows[2 * p] + c), b0 = vi_load(rows[2 * p + 1] + c);
            const __m512bh x[2] = {as_bh(_mm512_permutex2var_epi16(a0, lo, b0)),
                                   as_bh(_mm512_permutex2var_epi16(a0, hi, b0))};
            for (int hh = 0; hh < hb; hh++) {
                const __m512bh wv = as_bh(_mm512_set1_epi32((int32_t)wp[hh][p]));
                for (int u = 0; u < 2; u++) r[hh][u] = _mm512_dpbf16_ps(r[hh][u], x[u], wv);
            }
        }
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < 2; u++) vf_store(acc[hh] + c + u * VL, r[hh][u]);
    }
}

/* ---- int4 rows on vdpbf16ps (the avx512bf16 build) --------------------------------------
 * A group's 16 bytes (values i and i + 16 in byte i's nibbles, each q + 8) become one vector
 * of bf16 pairs (value i, value i + 16): byte i zero-extended into dword i, its high nibble
 * shifted into the upper word, and each word's code looked up in a table of code - 8 (exact in
 * bf16; vpermw reads the low 5 bits, so the table holds the 16 values twice and the low word's
 * high nibble, bit 4, picks the same one). The query's pairs are arranged alike; the group's
 * scale multiplies its float32 partial score, and for the values it is folded into the
 * weights before they round to bf16 (the reference rounds probabilities, here probability
 * times scale: one rounding as well). */
static const uint16_t int4_codes[32] = {
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0,
    0x40e0, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
    0x40c0, 0x40e0};

/* a group's 16 bytes -> its codes as word pairs (code i, code i + 16) (not yet looked up) */
static inline vi int4_code_pairs(const uint8_t *p) {
#if defined(MS_SIMDE) /* SIMDe has no _mm512_cvtepu8_epi32 */
    const vi b = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)));
#else
    const vi b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#endif
    return _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
}

/* a row's scale of group g (its width / 2 bytes of values first) */
static inline float int4_scale(const uint8_t *row, int64_t width, int64_t g) {
    bf16 s;
    memcpy(&s, row + width / 2 + 2 * g, 2);
    return bf16_to_f32(s);
}

/* scores_bf16 over int4 key rows (width d): qa the heads' scaled, rotated queries as bf16
 * pairs (value i, value i + 16) of each group, arranged */
static inline __attribute__((always_inline)) void scores_int4(const int hb, const uint8_t *const *rows, int64_t n,
                                                              const uint32_t *qa, int64_t d, float *part, float *s,
                                                              const ahead_rows *ahead) {
    const int64_t groups = (n + 3) / 4;
    const vi codes = vi_load(int4_codes);
    for (int64_t j = 0; j < groups; j++) {
        if (ahead) prefetch_ahead(ahead, 4 * j, j == groups - 1 ? ATT_CHUNK : 4 * j + 4);
        const uint8_t *const *r4 = rows + 4 * j;
        vf acc[HB];
        for (int hh = 0; hh < hb; hh++) acc[hh] = vf_zero();
        for (int64_t v = 0; v < d; v += 2 * VL) { /* one group of KV_INT4_GROUP (2 * VL) values */
            const int64_t g = v / KV_INT4_GROUP;
            vi x[4], t[4];
            for (int r = 0; r < 4; r++) x[r] = _mm512_permutexvar_epi16(int4_code_pairs(r4[r] + v / 2), codes);
            transpose4(x, t);
            /* lane 4m + i: row i's scale */
            const vf sg = _mm512_broadcast_f32x4(_mm_setr_ps(int4_scale(r4[0], d, g), int4_scale(r4[1], d, g),
                                                             int4_scale(r4[2], d, g), int4_scale(r4[3], d, g)));
            for (int hh = 0; hh < hb; hh++) {
                vf pg = vf_zero();
                for (int k = 0; k < 4; k++)
                    pg = _mm512_dpbf16_ps(pg, as_bh(t[k]), as_bh(vi_load(qa + hh * 2 * d + v * 2 + k * VL)));
                acc[hh] = vf_fma(pg, sg, acc[hh]);
            }
        }
        for (int hh = 0; hh < hb; hh++) vf_store(part + (hh * GROUPS + j) * VL, acc[hh]);
    }
    finish_scores(hb, groups, n, part, 1.0f, s);
}

/* values_bf16 over int4 value rows (width: where their scales are): per group of columns,
 * two positions a product (the two rows' bytes interleaved before their nibbles are looked
 * up: fewer shuffles than interleaving looked-up rows), the weights times each row's group
 * scale as bf16 pairs */
static inline __attribute__((always_inline)) void values_int4(const int hb, float *const *acc, const float *rescale,
                                                              const float *w, const uint8_t *const *rows, int64_t n,
                                                              int64_t d, int64_t width) {
    const vi high = vi_load(high_words), codes = vi_load(int4_codes);
    const int64_t pairs = (n + 1) / 2;
    for (int hh = 0; hh < hb; hh++)
        for (int64_t c = 0; c < d; c += VL) vf_store(acc[hh] + c, vf_mul(vf_load(acc[hh] + c), vf_set1(rescale[hh])));
    for (int64_t c = 0; c < d; c += 2 * VL) { /* one group: 2 * VL columns */
        const int64_t g = c / KV_INT4_GROUP;
        float sg[ATT_CHUNK];
        for (int64_t i = 0; i < ATT_CHUNK; i++) sg[i] = int4_scale(rows[i], width, g);
        uint32_t wp[HB][ATT_CHUNK / 2]; /* weight times scale, as bf16 pairs of positions 2p, 2p + 1 */
        for (int hh = 0; hh < hb; hh++) {
            const vi a = vf_as_vi(vf_round_bf16(vf_mul(vf_load(w + hh * ATT_CHUNK), vf_load(sg))));
            const vi b = vf_as_vi(vf_round_bf16(vf_mul(vf_load(w + hh * ATT_CHUNK + VL), vf_load(sg + VL))));
            vi_store(wp[hh], _mm512_permutex2var_epi16(a, high, b));
        }
        vf r[HB][2];
        for (int hh = 0; hh < hb; hh++) r[hh][0] = vf_load(acc[hh] + c), r[hh][1] = vf_load(acc[hh] + c + VL);
        for (int64_t p = 0; p < pairs; p++) {
            /* the two rows' bytes interleaved, a word each (sign-extended: vpermw reads bits 0-4):
             * word pair i = (byte i of row 2p, of row 2p + 1), its low nibbles column i, its
             * high ones column i + 16 */
            const __m128i a = _mm_loadu_si128((const __m128i *)(rows[2 * p] + c / 2));
            const __m128i b = _mm_loadu_si128((const __m128i *)(rows[2 * p + 1] + c / 2));
            const vi wab = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
            const __m512bh x0 = as_bh(_mm512_permutexvar_epi16(wab, codes));
            const __m512bh x1 = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(wab, 4), codes));
            for (int hh = 0; hh < hb; hh++) {
                const __m512bh wv = as_bh(_mm512_set1_epi32((int32_t)wp[hh][p]));
                r[hh][0] = _mm512_dpbf16_ps(r[hh][0], x0, wv), r[hh][1] = _mm512_dpbf16_ps(r[hh][1], x1, wv);
            }
        }
        for (int hh = 0; hh < hb; hh++) vf_store(acc[hh] + c, r[hh][0]), vf_store(acc[hh] + c + VL, r[hh][1]);
    }
}

/* ---- int8 rows on vdpbf16ps (the avx512bf16 build) --------------------------------------
 * The values (|x| <= 127: exact in bf16) widened to float32 in registers and their high
 * words taken; the row's scale multiplies its float32 score, and for the values it is folded
 * into the weights before they round to bf16, as int4's group scales are. */
static inline vf int8_to_f32(__m128i x) {
#if defined(MS_SIMDE) /* SIMDe has no _mm512_cvtepi8_epi32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(x)));
#else
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
#endif
}

/* a row's scale (after its width values) */
static inline float int8_scale(const uint8_t *row, int64_t width) {
    bf16 s;
    memcpy(&s, row + width, 2);
    return bf16_to_f32(s);
}

/* scores_bf16 over int8 key rows (width d): qa per head the scaled, rotated query as two
 * arranged bf16-pair vectors, its rounding and what that rounding left (hi + lo: the scores
 * as exact as float32 FMAs give them, within the int8 tests' one rounding) */
static inline __attribute__((always_inline)) void scores_int8(const int hb, const uint8_t *const *rows, int64_t n,
                                                              const uint32_t *qa, int64_t d, float *part, float *s,
                                                              const ahead_rows *ahead) {
    const int64_t groups = (n + 3) / 4;
    const vi high = vi_load(high_words);
    for (int64_t j = 0; j < groups; j++) {
        if (ahead) prefetch_ahead(ahead, 4 * j, j == groups - 1 ? ATT_CHUNK : 4 * j + 4);
        const uint8_t *const *r4 = rows + 4 * j;
        vf acc[HB], acc_lo[HB];
        for (int hh = 0; hh < hb; hh++) acc[hh] = vf_zero(), acc_lo[hh] = vf_zero();
        for (int64_t v = 0; v < d; v += 2 * VL) {
            vi x[4], t[4];
            for (int r = 0; r < 4; r++) {
                const vf a = int8_to_f32(_mm_loadu_si128((const __m128i *)(r4[r] + v)));
                const vf b = int8_to_f32(_mm_loadu_si128((const __m128i *)(r4[r] + v + VL)));
                x[r] = _mm512_permutex2var_epi16(vf_as_vi(a), high, vf_as_vi(b));
            }
            transpose4(x, t);
            for (int hh = 0; hh < hb; hh++)
                for (int k = 0; k < 4; k++) {
                    const uint32_t *qk = qa + hh * 4 * d + v * 2 + k * VL;
                    acc[hh] = _mm512_dpbf16_ps(acc[hh], as_bh(t[k]), as_bh(vi_load(qk)));
                    acc_lo[hh] = _mm512_dpbf16_ps(acc_lo[hh], as_bh(t[k]), as_bh(vi_load(qk + 2 * d)));
                }
        }
        for (int hh = 0; hh < hb; hh++) acc[hh] = vf_add(acc[hh], acc_lo[hh]);
        /* lane 4m + i: row i's scale */
        const vf sr = _mm512_broadcast_f32x4(
            _mm_setr_ps(int8_scale(r4[0], d), int8_scale(r4[1], d), int8_scale(r4[2], d), int8_scale(r4[3], d)));
        for (int hh = 0; hh < hb; hh++) vf_store(part + (hh * GROUPS + j) * VL, vf_mul(acc[hh], sr));
    }
    finish_scores(hb, groups, n, part, 1.0f, s);
}

/* values_bf16 over int8 value rows (their scales width bytes in): two positions a product,
 * the rows' bytes interleaved before they widen, the weights times the rows' scales */
static inline __attribute__((always_inline)) void values_int8(const int hb, float *const *acc, const float *rescale,
                                                              const float *w, const uint8_t *const *rows, int64_t n,
                                                              int64_t d, int64_t width) {
    const vi high = vi_load(high_words);
    const int64_t pairs = (n + 1) / 2;
    float sr[ATT_CHUNK];
    for (int64_t i = 0; i < ATT_CHUNK; i++) sr[i] = int8_scale(rows[i], width);
    uint32_t wp[HB][ATT_CHUNK / 2]; /* weight times scale, as bf16 pairs of positions 2p, 2p + 1 */
    for (int hh = 0; hh < hb; hh++) {
        const vi a = vf_as_vi(vf_round_bf16(vf_mul(vf_load(w + hh * ATT_CHUNK), vf_load(sr))));
        const vi b = vf_as_vi(vf_round_bf16(vf_mul(vf_load(w + hh * ATT_CHUNK + VL), vf_load(sr + VL))));
        vi_store(wp[hh], _mm512_permutex2var_epi16(a, high, b));
    }
    for (int64_t c = 0; c < d; c += 2 * VL) { /* d % (2 * VL) == 0 */
        vf r[HB][2];
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < 2; u++) r[hh][u] = vf_mul(vf_load(acc[hh] + c + u * VL), vf_set1(rescale[hh]));
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh x[2];
            for (int u = 0; u < 2; u++) { /* word pair i = (row 2p, row 2p + 1) of column c + u * VL + i */
                const __m128i a = _mm_loadu_si128((const __m128i *)(rows[2 * p] + c + u * VL));
                const __m128i b = _mm_loadu_si128((const __m128i *)(rows[2 * p + 1] + c + u * VL));
                x[u] = as_bh(_mm512_permutex2var_epi16(vf_as_vi(int8_to_f32(_mm_unpacklo_epi8(a, b))), high,
                                                       vf_as_vi(int8_to_f32(_mm_unpackhi_epi8(a, b)))));
            }
            for (int hh = 0; hh < hb; hh++) {
                const __m512bh wv = as_bh(_mm512_set1_epi32((int32_t)wp[hh][p]));
                for (int u = 0; u < 2; u++) r[hh][u] = _mm512_dpbf16_ps(r[hh][u], x[u], wv);
            }
        }
        for (int hh = 0; hh < hb; hh++)
            for (int u = 0; u < 2; u++) vf_store(acc[hh] + c + u * VL, r[hh][u]);
    }
}
#endif

/* How a chunk's rows are read: bf16, int4 or int8 cache rows on vdpbf16ps (the avx512bf16 build),
 * bf16 cache rows widened as they are read, or float32 rows a quantized cache was widened
 * into. */
enum { ROWS_BF16_DOTS, ROWS_INT4_DOTS, ROWS_INT8_DOTS, ROWS_BF16, ROWS_F32, ROWS_PER_HEAD };

/* One chunk of n positions for hb (<= HB) query heads of one kv head: scores, softmax and
 * the weighted values into each head's partial result (res: [max, sum, dv values] per head,
 * stride part); krows / vrows: ATT_CHUNK row pointers (those past n repeat a row), read as
 * `rows` says; qa: the heads' queries arranged (ROWS_BF16_DOTS: bf16 pairs, unscaled; else
 * float32, scaled, rotated for a quantized cache). */
static inline __attribute__((always_inline)) void heads_chunk(const int hb, const int rows, const void *const *krows,
                                                              const void *const *vrows, int64_t n, const uint32_t *qa,
                                                              int64_t dk, int64_t dv, int64_t v_width, float scale,
                                                              float *res, int64_t part, float *parts, float *s,
                                                              const ahead_rows *ahead) {
    float rescale[HB], *acc[HB];
#if defined(MS_AVX512_BF16)
    if (rows == ROWS_BF16_DOTS)
        scores_bf16(hb, (const bf16 *const *)krows, n, qa, dk, scale, parts, s, ahead);
    else if (rows == ROWS_INT4_DOTS)
        scores_int4(hb, (const uint8_t *const *)krows, n, qa, dk, parts, s, ahead);
    else if (rows == ROWS_INT8_DOTS)
        scores_int8(hb, (const uint8_t *const *)krows, n, qa, dk, parts, s, ahead);
    else
#endif
        scores_f32(hb, rows == ROWS_BF16, krows, n, (const float *)qa, dk, parts, s, ahead);
    (void)scale, (void)v_width;
    for (int hh = 0; hh < hb; hh++) {
        rescale[hh] = softmax_chunk(s + hh * ATT_CHUNK, n, res + hh * part);
        acc[hh] = res + hh * part + 2;
    }
#if defined(MS_AVX512_BF16)
    if (rows == ROWS_BF16_DOTS) {
        values_bf16(hb, acc, rescale, s, (const bf16 *const *)vrows, n, dv);
        return;
    }
    if (rows == ROWS_INT4_DOTS) {
        values_int4(hb, acc, rescale, s, (const uint8_t *const *)vrows, n, dv, v_width);
        return;
    }
    if (rows == ROWS_INT8_DOTS) {
        values_int8(hb, acc, rescale, s, (const uint8_t *const *)vrows, n, dv, v_width);
        return;
    }
#endif
    values_f32(hb, rows == ROWS_BF16, acc, rescale, s, vrows, n, dv);
}

/* Asks for the key and value rows of every kv head at positions [p0, min(p0 + ATT_CHUNK,
 * end)): decode attention streams the whole cache from memory, one chunk of rows after
 * another, so the next chunk's lines load while this one is computed. A slot's kv heads are
 * adjacent (k_bytes: all of them, and the scale after the last). Into L2 (a chunk is some
 * 256 lines, more than L1 has room to fetch at once; L2 prefetches measured faster). */
static void prefetch_rows(const int32_t *table, int64_t block_size, int64_t p0, int64_t end, const void *k_cache,
                          int64_t k_slot, int64_t k_bytes, const void *v_cache, int64_t v_slot, int64_t v_bytes,
                          int64_t elem) {
    const int64_t p1 = p0 + ATT_CHUNK < end ? p0 + ATT_CHUNK : end;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
        const char *k = (const char *)k_cache + slot * k_slot * elem, *v = (const char *)v_cache + slot * v_slot * elem;
        for (int64_t o = 0; o < k_bytes; o += 64) prefetch_line(k + o);
        prefetch_line(k + k_bytes - 1); /* a row across one more line than its length */
        for (int64_t o = 0; o < v_bytes; o += 64) prefetch_line(v + o);
        prefetch_line(v + v_bytes - 1);
    }
}

/* One query token per row over its paged context, for all rows of a step, read straight from
 * the cache by block table (no gathered copy). A sequence may bring several queries: rows
 * sharing its block table, at consecutive positions, each row's context its own length
 * (causal: speculative verification's k + 1 positions). Work items are (row, context
 * split); each walks its positions in chunks whose key and value rows (all kv heads of a
 * slot: adjacent in the cache, so the chunk is read in whole lines) are read once for all
 * the query heads of their kv head (bf16, int8 and int4 rows on vdpbf16ps where the build has
 * it, else widened to float32), with an online softmax (flash-decoding), and the
 * splits, which keep every core busy when there are fewer sequences than threads, are
 * merged by their softmax statistics at the end; a row's splits follow from its own length
 * only, so its result does not depend on the other rows.
 * q [B, H, dk] (row stride ldq); key row of (slot, kv head g) at k_cache + slot * k_slot +
 * g * k_head, value row likewise (MLA passes the latent cache as both, dv < dk), in the
 * cache's format kv_kind (strides in its elements: bf16 or bytes; an int8 row's scale at
 * dk elements past a key row's start, v_scale_at past a value row's); slot of
 * position p: block_tables[b][p / block_size] * block_size + p % block_size; out [B, H, dv]
 * (row stride ldo). Query heads [g * H / G, (g + 1) * H / G) share kv head g. An 8-bit cache
 * holds its rows rotated (hadamard_rotate): the queries are rotated alike and the outputs back
 * (dv's blocks are the first of dk's: MLA's 512 of 576).
 * window > 0 (sliding-window layers): only the last `window` positions of each context are
 * read. sinks (NULL: none) [H]: a learned logit per head that joins each softmax's
 * denominator with no value (gpt-oss), merged with the splits' statistics at the end. */
int ms_decode_attention(const bf16 *q, int64_t ldq, int64_t B, int64_t H, int64_t G, int kv_kind,
                        const void *k_cache, int64_t k_slot, int64_t k_head, int64_t dk,
                        const void *v_cache, int64_t v_slot, int64_t v_head, int64_t dv, int64_t v_scale_at,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                        int64_t block_size, float scale, const float *sinks, int64_t window, bf16 *out,
                        int64_t ldo, int nthreads) {
    const int64_t hpg = H / G;
    /* bytes of a slot's rows (all kv heads) and of a cache element (bf16 or a byte), for
     * prefetching */
    const int64_t elem = kv_kind == KV_BF16 ? 2 : 1, tail = kv_kind == KV_BF16 ? 0 : 2;
    const int64_t k_bytes = ((G - 1) * k_head + dk) * elem + tail, v_bytes = ((G - 1) * v_head + dv) * elem + tail;
    /* bytes of one kv head's key and value rows (int4: half a byte a value, a bf16 scale a group) */
    const int64_t k_row = kv_row_bytes(kv_kind, dk), v_row = kv_row_bytes(kv_kind, v_scale_at);
    const int64_t part = dv + 2; /* per head: max score, sum of exponentials, dv weighted values */
    /* Each row's context splits by its own length alone (at least 64 positions a split, at
     * most 4 per thread), never by the rest of the batch: a row rounds alike in any batch, so
     * the k + 1 positions a speculating sequence verifies as k + 1 rows round exactly as its
     * plain decode steps do. Only when the partials would pass SPLIT_BYTES do rows take fewer. */
    int64_t cap = 4 * (int64_t)nthreads, total = 0;
    for (;;) {
        total = 0;
        for (int64_t b = 0; b < B; b++) total += row_splits(context_lens[b], window, cap);
        if (cap == 1 || (size_t)total * H * part * sizeof(float) <= SPLIT_BYTES) break;
        cap /= 2;
    }
    const size_t partial_bytes = round64((size_t)total * H * part * sizeof(float));
    const size_t index_bytes = round64((size_t)(B + 1 + total) * sizeof(int64_t));
    /* all heads of a kv head at once where the dims are whole vectors (on vdpbf16ps where the
     * build has it and the rows are bf16 pairs' whole vectors), else one head at a time */
    int rows = dk % VL || dv % VL ? ROWS_PER_HEAD : kv_kind == KV_BF16 ? ROWS_BF16 : ROWS_F32;
#if defined(MS_AVX512_BF16)
    if (kv_kind == KV_BF16 && dk % (2 * VL) == 0 && dv % (2 * VL) == 0) rows = ROWS_BF16_DOTS;
    if (kv_kind == KV_INT4 && dk % KV_INT4_GROUP == 0 && dv % KV_INT4_GROUP == 0 && KV_INT4_GROUP == 2 * VL)
        rows = ROWS_INT4_DOTS;
    if (kv_kind == KV_INT8 && dk % (2 * VL) == 0 && dv % (2 * VL) == 0) rows = ROWS_INT8_DOTS;
#endif
    /* per thread: queries (float32, and arranged), scores, group sums, widened rows, a merge */
    const size_t local_bytes = round64(
        (size_t)(5 * H * dk + HB * ATT_CHUNK + HB * GROUPS * VL + G * ATT_CHUNK * (dk + dv) + dv) * sizeof(float));
    region_enter();
    char *scratch = region_alloc(partial_bytes + index_bytes + (size_t)nthreads * local_bytes);
    if (!scratch) {
        region_leave();
        return -1;
    }
    float *partials = (float *)scratch;
    /* first[b]: row b's first work item (its splits follow); owner[it]: the row of item it */
    int64_t *first = (int64_t *)(scratch + partial_bytes), *owner = first + B + 1;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        first[b + 1] = first[b] + row_splits(context_lens[b], window, cap);
        for (int64_t it = first[b]; it < first[b + 1]; it++) owner[it] = b;
    }
#pragma omp parallel num_threads(nthreads)
    {
        float *qf = (float *)(scratch + partial_bytes + index_bytes + (size_t)omp_get_thread_num() * local_bytes);
        uint32_t *qa = (uint32_t *)(qf + H * dk); /* per head: 4 dk floats, or 2 dk bf16 pairs */
        float *sh = qf + 5 * H * dk, *gsum = sh + HB * ATT_CHUNK, *kf = gsum + HB * GROUPS * VL;
        float *vfl = kf + G * ATT_CHUNK * dk, *merged = vfl + G * ATT_CHUNK * dv;
        const int64_t q_units = rows == ROWS_INT4_DOTS || rows == ROWS_BF16_DOTS ? 2 * dk : 4 * dk; /* a head's arranged query, in 32-bit units */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < total; it++) {
            const int64_t b = owner[it], s = it - first[b], len = context_lens[b];
            const int64_t lo = window > 0 && len > window ? len - window : 0; /* first position read */
            const int64_t splits = first[b + 1] - first[b], span = (len - lo + splits - 1) / splits;
            const int64_t c0 = lo + s * span, c1 = c0 + span < len ? c0 + span : len;
            float *res = partials + it * H * part;
            for (int64_t h = 0; h < H; h++) {
                res[h * part] = -INFINITY, res[h * part + 1] = 0.0f;
                memset(res + h * part + 2, 0, dv * sizeof(float));
            }
            if (c0 >= c1) continue;
            for (int64_t h = 0; h < H; h++) {
                const bf16 *qh = q + b * ldq + h * dk;
                if (rows == ROWS_BF16_DOTS) { /* the bf16 pairs as they are */
                    memcpy(qf + h * dk, qh, dk * sizeof(bf16));
                    arrange_q((const uint32_t *)(qf + h * dk), dk / 2, qa + h * q_units);
                    continue;
                }
                for (int64_t c = 0; c < dk; c++) qf[h * dk + c] = bf16_to_f32(qh[c]) * scale;
                if (kv_kind != KV_BF16) hadamard_rotate(qf + h * dk, dk); /* q . k = Rq . Rk: the rows stored rotated */
                if (rows == ROWS_INT4_DOTS) { /* bf16 pairs (value i, value i + 16) of each group */
                    uint32_t *qp = (uint32_t *)(qf + h * dk);
                    float rq[KV_INT4_GROUP];
                    for (int64_t g0 = 0; g0 < dk; g0 += KV_INT4_GROUP) {
                        memcpy(rq, qf + h * dk + g0, sizeof(rq));
                        for (int64_t i = 0; i < KV_INT4_GROUP / 2; i++)
                            qp[g0 / 2 + i] = (uint32_t)f32_to_bf16(rq[i]) | (uint32_t)f32_to_bf16(rq[i + KV_INT4_GROUP / 2]) << 16;
                    }
                    arrange_q(qp, dk / 2, qa + h * q_units);
                } else if (rows == ROWS_INT8_DOTS) { /* bf16 pairs in order: q's rounding, then the rest */
                    float qr[dk];
                    memcpy(qr, qf + h * dk, sizeof(qr));
                    uint32_t *qp = (uint32_t *)(qf + h * dk);
                    for (int64_t i = 0; i < dk; i++) {
                        const bf16 hi = f32_to_bf16(qr[i]), lo = f32_to_bf16(qr[i] - bf16_to_f32(hi));
                        ((bf16 *)qp)[i] = hi, ((bf16 *)qp)[dk + i] = lo;
                    }
                    arrange_q(qp, dk / 2, qa + h * q_units);
                    arrange_q(qp + dk / 2, dk / 2, qa + h * q_units + 2 * dk);
                } else if (rows != ROWS_PER_HEAD)
                    arrange_q((const uint32_t *)(qf + h * dk), dk, qa + h * q_units);
            }
            const int32_t *table = block_tables + b * bt_stride;
            int64_t slots[2][ATT_CHUNK]; /* this chunk's slots and the next one's */
            int cur = 0;
            chunk_slots(table, block_size, c0, c1, slots[cur]);
            if (rows != ROWS_PER_HEAD) /* the first chunk's rows; each chunk asks for the next one's as it goes */
                for (int64_t g = 0; g < G; g++) {
                    ahead_rows first_rows;
                    head_rows_ahead(&first_rows, slots[cur], c1 - c0, k_cache, k_slot, k_head, k_row, v_cache, v_slot,
                                    v_head, v_row, elem, g);
                    prefetch_ahead(&first_rows, 0, ATT_CHUNK);
                }
            else
                prefetch_rows(table, block_size, c0, c1, k_cache, k_slot, k_bytes, v_cache, v_slot, v_bytes, elem);
            for (int64_t p0 = c0; p0 < c1; p0 += ATT_CHUNK, cur ^= 1) {
                const int64_t n = c1 - p0 < ATT_CHUNK ? c1 - p0 : ATT_CHUNK, n_next = c1 - p0 - n;
                const int64_t *slot = slots[cur];
                if (n_next > 0) chunk_slots(table, block_size, p0 + ATT_CHUNK, c1, slots[cur ^ 1]);
                /* the next chunk's rows are on their way while this one is computed */
                if (rows == ROWS_PER_HEAD)
                    prefetch_rows(table, block_size, p0 + ATT_CHUNK, c1, k_cache, k_slot, k_bytes, v_cache, v_slot,
                                  v_bytes, elem);
                if (rows == ROWS_PER_HEAD) /* float32 rows: widened once for all heads */
                    for (int64_t i = 0; i < n; i++) /* kv head g's rows at kf/vfl + g * ATT_CHUNK rows */
                        for (int64_t g = 0; g < G; g++) {
                            const int64_t ko = slot[i] * k_slot + g * k_head, vo = slot[i] * v_slot + g * v_head;
                            float *kr = kf + (g * ATT_CHUNK + i) * dk, *vr = vfl + (g * ATT_CHUNK + i) * dv;
                            if (kv_kind == KV_BF16) {
                                widen_row((const bf16 *)k_cache + ko, dk, kr, dk);
                                widen_row((const bf16 *)v_cache + vo, dv, vr, dv);
                            } else {
                                kv_widen_row((const uint8_t *)k_cache + ko, kv_kind, dk, dk, kr);
                                kv_widen_row((const uint8_t *)v_cache + vo, kv_kind, dv, v_scale_at, vr);
                            }
                        }
                if (rows != ROWS_PER_HEAD) {
                    for (int64_t g = 0; g < G; g++) {
                        const void *krows[ATT_CHUNK], *vrows[ATT_CHUNK];
                        for (int64_t i = 0; i < ATT_CHUNK; i++) {
                            const int64_t r = i < n ? i : n - 1;
                            if (rows == ROWS_F32) { /* a quantized cache: kv head g's rows widened for its heads */
                                krows[i] = kf + r * dk, vrows[i] = vfl + r * dv;
                                if (i == r) {
                                    const uint8_t *kq = (const uint8_t *)k_cache + slot[i] * k_slot + g * k_head;
                                    kv_widen_row(kq, kv_kind, dk, dk, kf + i * dk);
                                    kv_widen_row((const uint8_t *)v_cache + slot[i] * v_slot + g * v_head, kv_kind, dv,
                                                 v_scale_at, vfl + i * dv);
                                }
                            } else if (rows == ROWS_INT4_DOTS || rows == ROWS_INT8_DOTS) {
                                krows[i] = (const uint8_t *)k_cache + slot[i] * k_slot + g * k_head;
                                vrows[i] = (const uint8_t *)v_cache + slot[i] * v_slot + g * v_head;
                            } else { /* slot[i] repeats the last slot past n */
                                krows[i] = (const bf16 *)k_cache + slot[i] * k_slot + g * k_head;
                                vrows[i] = (const bf16 *)v_cache + slot[i] * v_slot + g * v_head;
                            }
                        }
                        ahead_rows ahead;
                        head_rows_ahead(&ahead, slots[cur ^ 1], n_next, k_cache, k_slot, k_head, k_row, v_cache, v_slot,
                                        v_head, v_row, elem, g);
                        for (int64_t h0 = g * hpg; h0 < (g + 1) * hpg; h0 += HB) {
                            const int64_t left = (g + 1) * hpg - h0;
                            const uint32_t *qh = qa + h0 * q_units;
                            float *rh = res + h0 * part;
#define HEADS(hb, how) heads_chunk(hb, how, krows, vrows, n, qh, dk, dv, v_scale_at, scale, rh, part, gsum, sh, \
                                  h0 == g * hpg && ahead.n > 0 ? &ahead : NULL)
#define HEADS_ALL(how)                                                                                     \
    switch (left < HB ? left : HB) {                                                                       \
    case 1: HEADS(1, how); break;                                                                          \
    case 2: HEADS(2, how); break;                                                                          \
    case 3: HEADS(3, how); break;                                                                          \
    default: HEADS(4, how); break;                                                                         \
    }
                            if (rows == ROWS_BF16_DOTS) {
                                HEADS_ALL(ROWS_BF16_DOTS);
                            } else if (rows == ROWS_INT4_DOTS) {
                                HEADS_ALL(ROWS_INT4_DOTS);
                            } else if (rows == ROWS_INT8_DOTS) {
                                HEADS_ALL(ROWS_INT8_DOTS);
                            } else if (rows == ROWS_BF16) {
                                HEADS_ALL(ROWS_BF16);
                            } else {
                                HEADS_ALL(ROWS_F32);
                            }
#undef HEADS_ALL
#undef HEADS
                        }
                    }
                    continue;
                }
                for (int64_t h = 0; h < H; h++) {
                    const int64_t g = h / hpg;
                    float top = -INFINITY, *stats = res + h * part;
                    dots(qf + h * dk, kf + g * ATT_CHUNK * dk, n, dk, sh);
                    int64_t t = 0;
                    if (n >= VL) { /* vector maxima: a scalar chain of maxima was a fifth of the kernel */
                        vf vmax = vf_load(sh);
                        for (t = VL; t + VL <= n; t += VL) vmax = vf_max(vmax, vf_load(sh + t));
                        top = vf_hmax(vmax);
                    }
                    for (; t < n; t++) top = sh[t] > top ? sh[t] : top;
                    const float m = stats[0] > top ? stats[0] : top, rescale = expf(stats[0] - m);
                    float sum = 0.0f;
                    int64_t i = 0;
                    vf vs = vf_zero();
                    for (; i + VL <= n; i += VL) {
                        const vf e = vf_exp(vf_sub(vf_load(sh + i), vf_set1(m)));
                        vf_store(sh + i, e);
                        vs = vf_add(vs, e);
                    }
                    sum = vf_sum(vs);
                    for (; i < n; i++) sum += sh[i] = expf(sh[i] - m);
                    stats[0] = m, stats[1] = stats[1] * rescale + sum;
                    weighted_rows(stats + 2, rescale, sh, vfl + g * ATT_CHUNK * dv, n, dv, dv);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t b = bh / H, h = bh % H;
            const float *res = partials + first[b] * H * part + h * part;
            const int64_t splits = first[b + 1] - first[b];
            float top = sinks ? sinks[h] : -INFINITY;
            for (int64_t s = 0; s < splits; s++) top = res[s * H * part] > top ? res[s * H * part] : top;
            float sum = sinks ? expf(sinks[h] - top) : 0.0f; /* the sink's share of the denominator */
            memset(merged, 0, dv * sizeof(float));
            for (int64_t s = 0; s < splits; s++) {
                const float *r = res + s * H * part;
                if (r[1] == 0.0f) continue;
                const float f = expf(r[0] - top);
                sum += f * r[1];
                weighted_rows(merged, 1.0f, &f, r + 2, 1, dv, dv);
            }
            if (kv_kind != KV_BF16) hadamard_rotate(merged, dv); /* the values were rotated: R R = I */
            bf16 *o = out + b * ldo + h * dv;
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            int64_t c = 0;
            for (; c + VL <= dv; c += VL) vf_store_bf16(o + c, vf_mul(vf_load(merged + c), vf_set1(inv)));
            for (; c < dv; c++) o[c] = f32_to_bf16(merged[c] * inv);
        }
    }
    region_leave();
    return 0;
}
