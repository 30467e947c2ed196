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

/* The next chunk's key and value rows (all kv heads of a slot: they are adjacent), asked for
 * a few at a time while this chunk's scores are computed (measured faster than all at the
 * chunk's start), kv head g's pass asking for positions [lo, hi) of them, so the requests
 * spread over the whole chunk (bf16 rows asked for in one head's pass were 1.3x slower);
 * last_k / last_v: the line asked for last (consecutive slots share lines) */
typedef struct {
    const char *k[ATT_CHUNK], *v[ATT_CHUNK];
    int64_t n, k_bytes, v_bytes, lo, hi;
    uintptr_t last_k, last_v;
} ahead_rows;

/* the lines of bytes [p, p + n) not yet asked for */
static inline void prefetch_span(const char *p, int64_t n, uintptr_t *last) {
    const uintptr_t end = ((uintptr_t)p + (uintptr_t)n - 1) & ~(uintptr_t)63;
    uintptr_t line = (uintptr_t)p & ~(uintptr_t)63;
    if (line == *last) line += 64;
    for (; line <= end; line += 64) prefetch_line((const void *)line);
    *last = end;
}

/* the share [i0, i1) of ATT_CHUNK of this pass's positions [lo, hi) */
static inline void prefetch_ahead(ahead_rows *a, int64_t i0, int64_t i1) {
    const int64_t j0 = a->lo + i0 * (a->hi - a->lo) / ATT_CHUNK, j1 = a->lo + i1 * (a->hi - a->lo) / ATT_CHUNK;
    for (int64_t i = j0; i < j1 && i < a->n; i++) prefetch_span(a->k[i], a->k_bytes, &a->last_k);
    if (a->v_bytes)
        for (int64_t i = j0; i < j1 && i < a->n; i++) prefetch_span(a->v[i], a->v_bytes, &a->last_v);
}

/* slots of positions [p0, min(p0 + ATT_CHUNK, end)) into out, those past end repeating the
 * last (finite rows that weigh 0): a block's positions at a time (consecutive slots, a loop
 * the compiler vectorizes), one division each */
static void chunk_slots(const int32_t *table, int64_t block_size, int64_t p0, int64_t end, int64_t *out) {
    const int64_t n = end - p0 < ATT_CHUNK ? end - p0 : ATT_CHUNK;
    for (int64_t i = 0, p = p0; i < n;) {
        const int64_t off = p % block_size, m = block_size - off < n - i ? block_size - off : n - i;
        const int64_t base = (int64_t)table[p / block_size] * block_size + off;
        for (int64_t j = 0; j < m; j++) out[i + j] = base + j;
        i += m, p += m;
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

/* the first bytes of the slots' key and value rows (all kv heads) */
static void slot_rows(const int64_t *slots, int64_t n, const void *k_cache, int64_t k_slot, const void *v_cache,
                      int64_t v_slot, int64_t elem, const char **k, const char **v) {
    for (int64_t i = 0; i < n; i++) {
        k[i] = (const char *)k_cache + slots[i] * k_slot * elem;
        v[i] = (const char *)v_cache + slots[i] * v_slot * elem;
    }
}

/* the rows at the n positions of slots (the next chunk's: n may be 0), k_bytes / v_bytes of
 * them each (all kv heads); MLA's values are its keys' rows, asked for once */
static void rows_ahead(ahead_rows *a, const int64_t *slots, int64_t n, const void *k_cache, int64_t k_slot,
                       int64_t k_bytes, const void *v_cache, int64_t v_slot, int64_t v_bytes, int64_t elem) {
    const int same = k_cache == v_cache && k_slot == v_slot;
    a->n = n < ATT_CHUNK ? n : ATT_CHUNK, a->last_k = a->last_v = 0, a->lo = 0, a->hi = ATT_CHUNK;
    a->k_bytes = k_bytes > v_bytes || !same ? k_bytes : v_bytes, a->v_bytes = same ? 0 : v_bytes;
    slot_rows(slots, a->n, k_cache, k_slot, v_cache, v_slot, elem, a->k, a->v);
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
                                                             float *s, ahead_rows *ahead) {
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

/* exp(x) for the softmax's x <= 0 (a score less the running maximum), to 4e-5 relative: 2^n
 * times a degree-4 polynomial for 2^f (Taylor's, |f| <= 1/2; vf_exp's ~1 ulp takes twice the
 * instructions, where the weights are rounded to bf16 or to bytes next). x below -87.3 (-inf
 * past a chunk's end) reads as -87.3: 2^n stays normal. */
static inline vf vf_exp_weight(vf x) {
    const vf t = vf_mul(vf_max(x, vf_set1(-87.3f)), vf_set1(1.44269504088896341f));
    const vf n = vf_round(t), f = vf_sub(t, n);
    vf p = vf_set1(9.6181291e-3f);
    p = vf_fma(p, f, vf_set1(5.5504109e-2f));
    p = vf_fma(p, f, vf_set1(2.4022651e-1f));
    p = vf_fma(p, f, vf_set1(6.9314718e-1f));
    return vf_times_pow2(vf_fma(p, f, vf_set1(1.0f)), n);
}

/* A head's chunk of scores s[0..ATT_CHUNK) (-inf past n) -> its weights exp(s - m) (0 past
 * n), with its running maximum (stats[0]) moved on and the weights' sum as a vector (*sum:
 * the caller adds a chunk's heads up together); returns the factor what the head has
 * accumulated so far takes (exp(old max - m)). */
static inline __attribute__((always_inline)) float softmax_chunk(float *s, int64_t n, float *stats, vf *sum) {
    const int64_t nv = (n + VL - 1) / VL;
    vf vmax = vf_load(s);
    for (int64_t t = 1; t < nv; t++) vmax = vf_max(vmax, vf_load(s + t * VL));
    /* Past a context's first chunks its maximum seldom moves: then exp(0) = 1, without the
     * horizontal maximum or expf */
    float m = stats[0], rescale = 1.0f;
    if (lanes_above(vmax, vf_set1(m))) {
        const float top = vf_hmax(vmax);
        m = top, rescale = expf(stats[0] - m);
    }
    for (int64_t t = 0; t < nv; t++) vf_store(s + t * VL, vf_exp_weight(vf_sub(vf_load(s + t * VL), vf_set1(m))));
    for (int64_t t = n; t < ATT_CHUNK; t++) s[t] = 0.0f; /* vf_exp_weight clamps: exp(-inf) would not be 0 */
    vf vs = vf_zero();
    for (int64_t t = 0; t < nv; t++) vs = vf_add(vs, vf_load(s + t * VL));
    stats[0] = m, *sum = vs;
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
                                                              float *s, ahead_rows *ahead) {
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

#endif

/* ---- int4 rows: integer products (vpdpbusd in the avx512bf16 build, vpmaddubsw in AVX2's) --
 * Rows of d values (d a multiple of 64) in steps of 64: 32 bytes, byte i of group g holding
 * value 32g + i (low nibble) and 32g + i + 16 (high), each level + 8; the two groups' bf16
 * scales a dword at d / 2 + 4 * step. Products are integer, as llama.cpp's Q4 x Q8:
 * - keys: a head's query quantized to int8 per group of 32 (one float scale each, as Q8_0),
 *   its levels times the rows' nibbles (unsigned times signed) in int32 with 8 * sum(q)
 *   taken off, each group's sum then times its two scales in float32;
 * - values: the softmax weights times each row's group scale, quantized to unsigned bytes
 *   per head and group of the chunk (scale: the chunk's largest weight times its largest row
 *   scale / 255), times the values' nibbles less 8 (signed): four positions' bytes of a
 *   column interleaved into each dword, so the products sum over positions. A step's 64
 *   columns come out in the lane order int4_column gives; the results are put back in order
 *   once, when the splits merge.
 * The sums are exact integers in both builds, so they differ only in the order their float32
 * parts add up. The avx512 build has no VNNI in its flags (Skylake-X lacks it): it widens int4
 * rows to float32, and cpu.py builds this file a second time into it with VNNI
 * (MS_AVX512_VNNI; ms_decode_attention_vnni), which its ms_decode_attention hands every call
 * to where the CPU has VNNI (Cascade Lake, Ice Lake, the AMX Xeons). */
#if defined(MS_AVX512_VNNI) || !defined(MS_AVX512)
#define INT4_DOTS
#define INT4_STEP 64 /* values a step reads: 32 bytes, two scale groups */

/* a query head for int4 rows: per group of 32 values its int8 levels (in order), its scale,
 * and -8 times the levels' sum (the nibbles' offset, taken off as the accumulator's start) */
typedef struct {
    int8_t *q;
    float *scale;
    int32_t *offset;
} int4_query;

static inline int4_query int4_query_at(uint32_t *units, int64_t d) {
    int8_t *q = (int8_t *)units;
    float *scale = (float *)(q + d);
    return (int4_query){q, scale, (int32_t *)(scale + d / KV_INT4_GROUP)};
}

/* q (d floats: scaled, rotated) -> its int4_query at units: the int8 rows of the weights'
 * products (quantize_row_s8, a scale per group, unrotated here) and their group sums */
static void int4_query_quantize(float *q, int64_t d, uint32_t *units) {
    const int4_query iq = int4_query_at(units, d);
    quantize_row_s8(q, d, iq.q, d, iq.scale, 0, KV_INT4_GROUP);
    s8_group_sums(iq.q, d, KV_INT4_GROUP, iq.offset);
    for (int64_t g = 0; g < d / KV_INT4_GROUP; g++) iq.offset[g] *= -8;
}

/* the scale dwords (groups 2 * step and 2 * step + 1, bf16 each) of VL rows at byte at */
static inline vi int4_scale_pairs(const uint8_t *const *rows, int64_t at) {
    int32_t w[VL] __attribute__((aligned(64)));
    for (int i = 0; i < VL; i++) memcpy(w + i, rows[i] + at, 4);
    return vi_load(w);
}
static inline vf low_bf16(vi pairs) { return vi_as_vf(vi_slli(pairs, 16)); }
static inline vf high_bf16(vi pairs) { return vi_as_vf(vi_and(pairs, vi_set1((int32_t)0xffff0000u))); }

/* values_int4's start, in both builds: each head's largest weight of the chunk and its
 * inverse (0 where none is above 0: the weights' bytes scale by it), and its accumulators
 * times its rescale where that is not 1 */
static inline __attribute__((always_inline)) void int4_values_start(const int hb, float *const *acc,
                                                                    const float *rescale, const float *w, int64_t d,
                                                                    float *top, float *inv_top) {
    for (int hh = 0; hh < hb; hh++) {
        const float *wh = w + hh * ATT_CHUNK;
        vf most = vf_load(wh);
        for (int64_t i = VL; i < ATT_CHUNK; i += VL) most = vf_max(most, vf_load(wh + i));
        top[hh] = vf_hmax(most);
        inv_top[hh] = top[hh] > 0.0f ? 1.0f / top[hh] : 0.0f;
        if (rescale[hh] != 1.0f)
            for (int64_t c = 0; c < d; c += VL) vf_store(acc[hh] + c, vf_mul(vf_load(acc[hh] + c), vf_set1(rescale[hh])));
    }
}

#if defined(MS_AVX512_VNNI)
/* vpdpbusd: sixteen key positions lie across a vector's lanes (a transpose of their rows'
 * dwords), so each query dword is broadcast and no horizontal sums remain. */

/* the column that value accumulator lane `lane` (of a step's 64) holds: vector a (0-3) of a
 * step, lane 4L + i: group L & 1, byte 8 * (a >> 1) + 4 * (L >> 1) + i, high nibble if a odd */
static inline int64_t int4_column(int64_t lane) {
    const int64_t a = lane / VL, L = (lane % VL) / 4, i = lane % 4;
    return 32 * (L & 1) + 8 * (a >> 1) + 4 * (L >> 1) + i + 16 * (a & 1);
}

/* the query as scores_int4 reads it: the int4_query as it is */
static void int4_query_arrange(float *q, int64_t d, uint32_t *units) { int4_query_quantize(q, d, units); }

static inline vi two_rows(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 16 rows' 8 dwords at byte off -> t[k]: dword k of rows 0..15 across the lanes, in order */
static inline void transpose_rows16(const uint8_t *const *r, int64_t off, vi t[8]) {
    vi z[8], a[8], b[8];
    for (int i = 0; i < 4; i++) z[i] = two_rows(r[i] + off, r[i + 4] + off), z[4 + i] = two_rows(r[8 + i] + off, r[12 + i] + off);
    for (int h = 0; h < 8; h += 4) { /* per 128-bit lane: dword k of z[h..h+3] */
        a[h] = _mm512_unpacklo_epi32(z[h], z[h + 1]), a[h + 1] = _mm512_unpackhi_epi32(z[h], z[h + 1]);
        a[h + 2] = _mm512_unpacklo_epi32(z[h + 2], z[h + 3]), a[h + 3] = _mm512_unpackhi_epi32(z[h + 2], z[h + 3]);
        b[h] = _mm512_unpacklo_epi64(a[h], a[h + 2]), b[h + 1] = _mm512_unpackhi_epi64(a[h], a[h + 2]);
        b[h + 2] = _mm512_unpacklo_epi64(a[h + 1], a[h + 3]), b[h + 3] = _mm512_unpackhi_epi64(a[h + 1], a[h + 3]);
    }
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_i32x4(b[k], b[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
        t[4 + k] = _mm512_shuffle_i32x4(b[k], b[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    }
}

static inline vi bcast4(const int8_t *p) {
    int32_t x;
    memcpy(&x, p, 4);
    return _mm512_set1_epi32(x);
}

/* s [hb][ATT_CHUNK] = hb query heads' scores (qs: their int4_query units, q_units apart)
 * against the n key rows rows[i] (ATT_CHUNK pointers, those past n repeating a row); -inf
 * past n */
static inline __attribute__((always_inline)) void scores_int4(const int hb, const uint8_t *const *rows, int64_t n,
                                                              const uint32_t *qs, int64_t q_units, int64_t d,
                                                              float *s, ahead_rows *ahead) {
    const vi low = _mm512_set1_epi8(0x0f);
    int4_query iq[HB];
    for (int hh = 0; hh < hb; hh++) iq[hh] = int4_query_at((uint32_t *)qs + hh * q_units, d);
    for (int64_t p0 = 0; p0 < n; p0 += VL) {
        if (ahead) prefetch_ahead(ahead, p0, p0 + VL < n ? p0 + VL : ATT_CHUNK);
        const uint8_t *const *r = rows + p0;
        vf sc[HB];
        for (int hh = 0; hh < hb; hh++) sc[hh] = vf_zero();
        for (int64_t step = 0; step < d / INT4_STEP; step++) {
            vi t[8];
            transpose_rows16(r, 32 * step, t);
            const vi pairs = int4_scale_pairs(r, d / 2 + 4 * step);
            const vf sa = low_bf16(pairs), sb = high_bf16(pairs);
            vi acc[HB][2];
            for (int hh = 0; hh < hb; hh++) {
                const int64_t g = 2 * step;
                acc[hh][0] = _mm512_set1_epi32(iq[hh].offset[g]), acc[hh][1] = _mm512_set1_epi32(iq[hh].offset[g + 1]);
            }
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) { /* dword k: group 2 step + k / 4, bytes 4 (k % 4).. */
                const vi lo = _mm512_and_si512(t[k], low), hi = _mm512_and_si512(_mm512_srli_epi32(t[k], 4), low);
                const int64_t at = INT4_STEP * step + 32 * (k / 4) + 4 * (k % 4);
                for (int hh = 0; hh < hb; hh++) {
                    acc[hh][k / 4] = _mm512_dpbusd_epi32(acc[hh][k / 4], lo, bcast4(iq[hh].q + at));
                    acc[hh][k / 4] = _mm512_dpbusd_epi32(acc[hh][k / 4], hi, bcast4(iq[hh].q + at + 16));
                }
            }
            for (int hh = 0; hh < hb; hh++) {
                const float *qsc = iq[hh].scale + 2 * step;
                sc[hh] = vf_fma(vi_to_vf(acc[hh][0]), vf_mul(sa, vf_set1(qsc[0])), sc[hh]);
                sc[hh] = vf_fma(vi_to_vf(acc[hh][1]), vf_mul(sb, vf_set1(qsc[1])), sc[hh]);
            }
        }
        for (int hh = 0; hh < hb; hh++) vf_store(s + hh * ATT_CHUNK + p0, sc[hh]);
    }
    for (int hh = 0; hh < hb; hh++)
        for (int64_t t = n; t < ATT_CHUNK; t++) s[hh * ATT_CHUNK + t] = -INFINITY;
}

/* 32 int32 in [0, 255] (positions 0-15, 16-31) -> 32 bytes in order: packed within 128-bit
 * lanes (lane L: positions 4L.., then 16 + 4L..), their dwords then put in order */
static inline __m256i weight_bytes(vi a, vi b) {
    const vi packed = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_setzero_si512());
    const vi order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, packed));
}

/* acc[hh] (a step's 64 columns in int4_column's order) = acc * rescale + sum_i w[hh][i] *
 * rows[i] for hb heads over the n value rows (width: where their scales are), as the section
 * says */
static inline __attribute__((always_inline)) void values_int4(const int hb, float *const *acc, const float *rescale,
                                                              const float *w, const uint8_t *const *rows, int64_t n,
                                                              int64_t d, int64_t width) {
    const vi low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    /* lanes 4L..4L+3 take dword (L odd: 8 +) of the weights: group a's 8, then group b's */
    const vi pick = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0, 8, 8, 8, 8);
    const __mmask16 odd_lanes = 0xf0f0;
    float top[HB], inv_top[HB];
    int4_values_start(hb, acc, rescale, w, d, top, inv_top);
    for (int64_t step = 0; step < d / INT4_STEP; step++) {
        /* weights as unsigned bytes [hh][group a, b][ATT_CHUNK], and their scales */
        __m256i wq[HB][2];
        float wscale[HB][2];
        vf sv[2][2]; /* the rows' scales: [group][positions 0-15, 16-31] */
        float svmax[2];
        for (int half = 0; half < 2; half++) {
            const vi pairs = int4_scale_pairs(rows + half * VL, width / 2 + 4 * step);
            sv[0][half] = low_bf16(pairs), sv[1][half] = high_bf16(pairs);
        }
        for (int g = 0; g < 2; g++) svmax[g] = vf_hmax(vf_max(sv[g][0], sv[g][1]));
        const float unit[2] = {svmax[0] / 255.0f, svmax[1] / 255.0f}; /* a weight byte's value, times top */
        for (int g = 0; g < 2; g++) {
            const float inv_s = svmax[g] > 0.0f ? 255.0f / svmax[g] : 0.0f;
            for (int hh = 0; hh < hb; hh++) {
                const vf f = vf_set1(inv_top[hh] * inv_s);
                const vf x0 = vf_mul(vf_mul(vf_load(w + hh * ATT_CHUNK), sv[g][0]), f);
                const vf x1 = vf_mul(vf_mul(vf_load(w + hh * ATT_CHUNK + VL), sv[g][1]), f);
                wq[hh][g] = weight_bytes(_mm512_cvtps_epi32(x0), _mm512_cvtps_epi32(x1));
                wscale[hh][g] = top[hh] * unit[g]; /* 0 where top or the rows' scales are */
            }
        }
        vi sum[HB][4];
        for (int hh = 0; hh < hb; hh++)
            for (int a = 0; a < 4; a++) sum[hh][a] = _mm512_setzero_si512();
        vi wv[HB];
        /* dwords: a's 8, b's 8, joined in registers (stored as halves and loaded whole, they
         * waited on the stores: a load wider than the stores before it is not forwarded) */
        for (int hh = 0; hh < hb; hh++) wv[hh] = _mm512_inserti64x4(_mm512_castsi256_si512(wq[hh][0]), wq[hh][1], 1);
        for (int64_t p = 0; p < n; p += 4) {
            const uint8_t *r0 = rows[p] + 32 * step, *r1 = rows[p + 1] + 32 * step, *r2 = rows[p + 2] + 32 * step,
                          *r3 = rows[p + 3] + 32 * step;
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)r0), y1 = _mm256_loadu_si256((const __m256i *)r1);
            const __m256i y2 = _mm256_loadu_si256((const __m256i *)r2), y3 = _mm256_loadu_si256((const __m256i *)r3);
            const __m256i A = _mm256_unpacklo_epi8(y0, y1), B = _mm256_unpackhi_epi8(y0, y1);
            const __m256i C = _mm256_unpacklo_epi8(y2, y3), D = _mm256_unpackhi_epi8(y2, y3);
            const vi x01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(A, C)), _mm256_unpackhi_epi16(A, C), 1);
            const vi x23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(B, D)), _mm256_unpackhi_epi16(B, D), 1);
            const vi x[4] = {_mm512_sub_epi8(_mm512_and_si512(x01, low), eight),
                             _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(x01, 4), low), eight),
                             _mm512_sub_epi8(_mm512_and_si512(x23, low), eight),
                             _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(x23, 4), low), eight)};
            const vi idx = _mm512_add_epi32(pick, _mm512_set1_epi32((int32_t)(p / 4)));
            for (int hh = 0; hh < hb; hh++) {
                const vi wp = _mm512_permutexvar_epi32(idx, wv[hh]);
                for (int a = 0; a < 4; a++) sum[hh][a] = _mm512_dpbusd_epi32(sum[hh][a], wp, x[a]);
            }
        }
        for (int hh = 0; hh < hb; hh++) {
            const vf scale = _mm512_mask_mov_ps(vf_set1(wscale[hh][0]), odd_lanes, vf_set1(wscale[hh][1]));
            float *o = acc[hh] + INT4_STEP * step;
            for (int a = 0; a < 4; a++) vf_store(o + a * VL, vf_fma(vi_to_vf(sum[hh][a]), scale, vf_load(o + a * VL)));
        }
    }
}

#else
/* vpmaddubsw (AVX2 has no vpdpbusd): int16 pair sums, which add up as int16 while they cannot
 * overflow and widen to int32 once (vpmaddwd by ones).
 * - keys: four positions a vector, a step's two groups side by side: transpose4 puts dword k
 *   of group a (bytes 4k..) of the four rows in 128-bit lane 0 and group b's in lane 1, and
 *   the query is arranged to match (int4_query_arrange), whole vectors read as they stand; a
 *   head's eight products of a step add up in int16 (at most 8 x 2 x 15 x 127 = 30480), and
 *   the two lanes' float32 sums of a position add up at the end of the chunk (sum_groups);
 * - values: four positions' bytes of a column in each dword (lane 0 group a's, lane 1 group
 *   b's), a chunk's eight quads of positions adding up in int16 (at most 8 x 2 x 255 x 8 =
 *   32640); the rows' bytes are split into signed levels once and read by each head. */

/* the column that value accumulator lane `lane` (of a step's 64) holds: vector a (0-7) of a
 * step, lane 4h + i: group h, byte 4 * (a >> 1) + i, high nibble if a odd */
static inline int64_t int4_column(int64_t lane) {
    const int64_t a = lane / VL, h = (lane % VL) / 4, i = lane % 4;
    return 32 * h + 4 * (a >> 1) + i + 16 * (a & 1);
}

#define INT4_Q_STEP 80 /* 32-bit units of a step's arranged query: 8 vectors, offsets, scales */

/* q (d floats: scaled, rotated) -> the query scores_int4 reads at units (d * 5 / 4 of them):
 * per step, vector 2k + h (k < 4; h: the high nibbles' values, 16 on) holds in lanes 0-3 the
 * int8 levels' dword 4k of group a (+ 16h) and in lanes 4-7 group b's; then the groups'
 * offsets and scales, four lanes each */
static void int4_query_arrange(float *q, int64_t d, uint32_t *units) {
    uint32_t staged[d / 4 + 2 * (d / KV_INT4_GROUP)];
    int4_query_quantize(q, d, staged);
    const int4_query iq = int4_query_at(staged, d);
    for (int64_t step = 0; step < d / INT4_STEP; step++) {
        uint32_t *o = units + INT4_Q_STEP * step;
        for (int v = 0; v < 8; v++)
            for (int lane = 0; lane < VL; lane++)
                memcpy(o + v * VL + lane, iq.q + INT4_STEP * step + 32 * (lane / 4) + 4 * (v / 2) + 16 * (v % 2), 4);
        for (int lane = 0; lane < VL; lane++) {
            o[8 * VL + lane] = (uint32_t)iq.offset[2 * step + lane / 4];
            memcpy(o + 9 * VL + lane, iq.scale + 2 * step + lane / 4, 4);
        }
    }
}

/* s [hb][ATT_CHUNK] = hb query heads' scores (qs: their arranged queries, q_units apart)
 * against the n key rows rows[i] (ATT_CHUNK pointers, those past n repeating a row); -inf
 * past n */
static inline __attribute__((always_inline)) void scores_int4(const int hb, const uint8_t *const *rows, int64_t n,
                                                              const uint32_t *qs, int64_t q_units, int64_t d,
                                                              float *s, ahead_rows *ahead) {
    const vi low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const vi shift = _mm256_setr_epi32(16, 16, 16, 16, 0, 0, 0, 0), high = vi_set1((int32_t)0xffff0000u);
    const int64_t groups = (n + 3) / 4;
    float part[HB * GROUPS * VL] __attribute__((aligned(32)));
    for (int64_t j = 0; j < groups; j++) {
        if (ahead) prefetch_ahead(ahead, 4 * j, j == groups - 1 ? ATT_CHUNK : 4 * j + 4);
        const uint8_t *const *r4 = rows + 4 * j;
        vf sc[HB];
        for (int hh = 0; hh < hb; hh++) sc[hh] = vf_zero();
        for (int64_t step = 0; step < d / INT4_STEP; step++) {
            vi x[4], t[4];
            for (int r = 0; r < 4; r++) x[r] = vi_load(r4[r] + 32 * step);
            transpose4(x, t);
            /* the rows' scales: lanes 0-3 group a's of rows 0-3, lanes 4-7 group b's */
            int32_t pairs[4];
            for (int r = 0; r < 4; r++) memcpy(pairs + r, r4[r] + d / 2 + 4 * step, 4);
            const vi both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)pairs));
            const vf row_scale = vi_as_vf(vi_and(_mm256_sllv_epi32(both, shift), high));
            vi nibbles[8]; /* dword k's low nibbles, then its high ones */
            for (int k = 0; k < 4; k++) nibbles[2 * k] = vi_and(t[k], low), nibbles[2 * k + 1] = vi_and(vi_srli(t[k], 4), low);
            for (int hh = 0; hh < hb; hh++) {
                const uint32_t *qv = qs + hh * q_units + INT4_Q_STEP * step; /* 8 vectors, offsets, scales */
                vi acc = _mm256_maddubs_epi16(nibbles[0], vi_load(qv));
                for (int v = 1; v < 8; v++) {
                    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(nibbles[v], vi_load(qv + v * VL)));
                    /* one sum in order: GCC otherwise reassociates the integer adds into a tree,
                     * all the products first, and spills them (measured slower) */
                    __asm__("" : "+x"(acc));
                }
                const vi dots = vi_add(_mm256_madd_epi16(acc, ones), vi_load(qv + 8 * VL));
                sc[hh] = vf_fma(vi_to_vf(dots), vf_mul(row_scale, vf_load((const float *)qv + 9 * VL)), sc[hh]);
            }
        }
        for (int hh = 0; hh < hb; hh++) vf_store(part + (hh * GROUPS + j) * VL, sc[hh]);
    }
    finish_scores(hb, groups, n, part, 1.0f, s);
}

/* 32 int32 in [0, 255] (positions 0-7, 8-15, 16-23, 24-31) -> 32 bytes in order: packed
 * within 128-bit lanes (lane 0: each vector's first four, lane 1 their last four), their
 * dwords then put in order */
static inline vi weight_bytes(vi a, vi b, vi c, vi e) {
    const vi packed = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, e));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* acc[hh] (a step's 64 columns in int4_column's order) = acc * rescale + sum_i w[hh][i] *
 * rows[i] for hb heads over the n value rows (width: where their scales are), as the section
 * says */
static inline __attribute__((always_inline)) void values_int4(const int hb, float *const *acc, const float *rescale,
                                                              const float *w, const uint8_t *const *rows, int64_t n,
                                                              int64_t d, int64_t width) {
    const vi low = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
    const int64_t quads = (n + 3) / 4;
    float top[HB], inv_top[HB];
    int4_values_start(hb, acc, rescale, w, d, top, inv_top);
    for (int64_t step = 0; step < d / INT4_STEP; step++) {
        /* per head and quad of positions the weights' bytes: lanes 0-3 group a's, 4-7 b's */
        vi wq[HB][ATT_CHUNK / 4];
        vf wscale[HB]; /* lanes 0-3 group a's scale, 4-7 b's */
        vf sv[2][4];   /* the rows' scales: [group][positions 8u..8u + 7] */
        float svmax[2];
        for (int u = 0; u < 4; u++) {
            const vi pairs = int4_scale_pairs(rows + u * VL, width / 2 + 4 * step);
            sv[0][u] = low_bf16(pairs), sv[1][u] = high_bf16(pairs);
        }
        for (int g = 0; g < 2; g++) svmax[g] = vf_hmax(vf_max(vf_max(sv[g][0], sv[g][1]), vf_max(sv[g][2], sv[g][3])));
        const float unit[2] = {svmax[0] / 255.0f, svmax[1] / 255.0f}; /* a weight byte's value, times top */
        for (int hh = 0; hh < hb; hh++) {
            vi bytes[2];
            float scale[2];
            for (int g = 0; g < 2; g++) {
                const float inv_s = svmax[g] > 0.0f ? 255.0f / svmax[g] : 0.0f;
                const vf f = vf_set1(inv_top[hh] * inv_s);
                vi x[4];
                for (int u = 0; u < 4; u++) x[u] = vf_to_vi(vf_mul(vf_mul(vf_load(w + hh * ATT_CHUNK + u * VL), sv[g][u]), f));
                bytes[g] = weight_bytes(x[0], x[1], x[2], x[3]);
                scale[g] = top[hh] * unit[g]; /* 0 where top or the rows' scales are */
            }
            wscale[hh] = _mm256_setr_m128(_mm_set1_ps(scale[0]), _mm_set1_ps(scale[1]));
            const vi first = _mm256_permute2x128_si256(bytes[0], bytes[1], 0x20); /* a's 0-15, b's 0-15 */
            const vi last = _mm256_permute2x128_si256(bytes[0], bytes[1], 0x31);
            wq[hh][0] = _mm256_shuffle_epi32(first, 0x00), wq[hh][1] = _mm256_shuffle_epi32(first, 0x55);
            wq[hh][2] = _mm256_shuffle_epi32(first, 0xaa), wq[hh][3] = _mm256_shuffle_epi32(first, 0xff);
            wq[hh][4] = _mm256_shuffle_epi32(last, 0x00), wq[hh][5] = _mm256_shuffle_epi32(last, 0x55);
            wq[hh][6] = _mm256_shuffle_epi32(last, 0xaa), wq[hh][7] = _mm256_shuffle_epi32(last, 0xff);
        }
        /* each quad's values as signed levels: vector 2k + h, dword i of lane g: byte 4k + i
         * of group g (high nibbles if h) of the quad's four rows */
        vi levels[ATT_CHUNK / 4][8];
        for (int64_t qd = 0; qd < quads; qd++) {
            vi y[4];
            for (int r = 0; r < 4; r++) y[r] = vi_load(rows[4 * qd + r] + 32 * step);
            const vi A = _mm256_unpacklo_epi8(y[0], y[1]), B = _mm256_unpackhi_epi8(y[0], y[1]);
            const vi C = _mm256_unpacklo_epi8(y[2], y[3]), D = _mm256_unpackhi_epi8(y[2], y[3]);
            const vi x[4] = {_mm256_unpacklo_epi16(A, C), _mm256_unpackhi_epi16(A, C), _mm256_unpacklo_epi16(B, D),
                             _mm256_unpackhi_epi16(B, D)};
            for (int k = 0; k < 4; k++) {
                levels[qd][2 * k] = _mm256_sub_epi8(vi_and(x[k], low), eight);
                levels[qd][2 * k + 1] = _mm256_sub_epi8(vi_and(vi_srli(x[k], 4), low), eight);
            }
        }
        for (int hh = 0; hh < hb; hh++) {
            vi sum[8];
            for (int a = 0; a < 8; a++) sum[a] = _mm256_setzero_si256();
            for (int64_t qd = 0; qd < quads; qd++) {
                const vi wp = wq[hh][qd];
                for (int a = 0; a < 8; a++) sum[a] = _mm256_add_epi16(sum[a], _mm256_maddubs_epi16(wp, levels[qd][a]));
            }
            float *o = acc[hh] + INT4_STEP * step;
            for (int a = 0; a < 8; a++)
                vf_store(o + a * VL, vf_fma(vi_to_vf(_mm256_madd_epi16(sum[a], ones)), wscale[hh], vf_load(o + a * VL)));
        }
    }
}
#endif /* MS_AVX512_VNNI */
#endif /* INT4_DOTS */

#if defined(MS_AVX512_BF16)

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

/* scores_bf16 over int8 key rows (width d): qa per head the scaled, rotated query as two
 * arranged bf16-pair vectors, its rounding and what that rounding left (hi + lo: the scores
 * as exact as float32 FMAs give them, within the int8 tests' one rounding) */
static inline __attribute__((always_inline)) void scores_int8(const int hb, const uint8_t *const *rows, int64_t n,
                                                              const uint32_t *qa, int64_t d, float *part, float *s,
                                                              ahead_rows *ahead) {
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
            _mm_setr_ps(row_scale(r4[0], d), row_scale(r4[1], d), row_scale(r4[2], d), row_scale(r4[3], d)));
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
    for (int64_t i = 0; i < ATT_CHUNK; i++) sr[i] = row_scale(rows[i], width);
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

/* How a chunk's rows are read: bf16 or int8 cache rows on vdpbf16ps (the avx512bf16 build),
 * int4 ones in integer products (INT4_DOTS: the avx512bf16 and AVX2 builds), bf16 cache rows
 * widened as they are read, or float32 rows a quantized cache was widened into. */
enum { ROWS_BF16_DOTS, ROWS_INT4_DOTS, ROWS_INT8_DOTS, ROWS_BF16, ROWS_F32, ROWS_PER_HEAD };

/* One chunk of n positions for hb (<= HB) query heads of one kv head: scores, softmax and
 * the weighted values into each head's partial result (res: [max, sum, dv values] per head,
 * stride part); krows / vrows: ATT_CHUNK row pointers (those past n repeat a row), read as
 * `rows` says; qa: the heads' queries arranged, q_units 32-bit units apart (ROWS_BF16_DOTS: bf16
 * pairs, unscaled; ROWS_INT4_DOTS: int4_query_arrange's; else float32, scaled, rotated for a quantized
 * cache). */
static inline __attribute__((always_inline)) void heads_chunk(const int hb, const int rows, const void *const *krows,
                                                              const void *const *vrows, int64_t n, const uint32_t *qa,
                                                              int64_t q_units, int64_t dk, int64_t dv, int64_t v_width, float scale,
                                                              float *res, int64_t part, float *parts, float *s,
                                                              ahead_rows *ahead) {
    float rescale[HB], *acc[HB];
#if defined(MS_AVX512_BF16)
    if (rows == ROWS_BF16_DOTS)
        scores_bf16(hb, (const bf16 *const *)krows, n, qa, dk, scale, parts, s, ahead);
    else if (rows == ROWS_INT8_DOTS)
        scores_int8(hb, (const uint8_t *const *)krows, n, qa, dk, parts, s, ahead);
    else
#endif
#if defined(INT4_DOTS)
    if (rows == ROWS_INT4_DOTS)
        scores_int4(hb, (const uint8_t *const *)krows, n, qa, q_units, dk, s, ahead);
    else
#endif
        scores_f32(hb, rows == ROWS_BF16, krows, n, (const float *)qa, dk, parts, s, ahead);
    (void)scale, (void)v_width;
    vf sums[8];
    float sum[8];
    for (int hh = 0; hh < hb; hh++) {
        rescale[hh] = softmax_chunk(s + hh * ATT_CHUNK, n, res + hh * part, sums + hh);
        acc[hh] = res + hh * part + 2;
    }
    for (int hh = hb; hh < 8; hh++) sums[hh] = vf_zero();
    vf_sum8(sums, sum); /* the heads' horizontal sums at once */
    for (int hh = 0; hh < hb; hh++) res[hh * part + 1] = res[hh * part + 1] * rescale[hh] + sum[hh];
#if defined(INT4_DOTS)
    if (rows == ROWS_INT4_DOTS) {
        values_int4(hb, acc, rescale, s, (const uint8_t *const *)vrows, n, dv, v_width);
        return;
    }
#endif
#if defined(MS_AVX512_BF16)
    if (rows == ROWS_BF16_DOTS) {
        values_bf16(hb, acc, rescale, s, (const bf16 *const *)vrows, n, dv);
        return;
    }
    if (rows == ROWS_INT8_DOTS) {
        values_int8(hb, acc, rescale, s, (const uint8_t *const *)vrows, n, dv, v_width);
        return;
    }
#endif
    values_f32(hb, rows == ROWS_BF16, acc, rescale, s, vrows, n, dv);
}

/* the next work item to take: handed counts those taken by all threads */
static inline int64_t take_item(int64_t *handed) { return __atomic_fetch_add(handed, 1, __ATOMIC_RELAXED); }

/* work item it's row b and positions [c0, c1): split s of its row's context (the last
 * `window` positions where window > 0), the splits of equal spans */
static inline void item_span(int64_t it, const int64_t *owner, const int64_t *first, const int32_t *context_lens,
                             int64_t window, int64_t *b, int64_t *c0, int64_t *c1) {
    const int64_t row = owner[it], s = it - first[row], len = context_lens[row];
    const int64_t lo = window > 0 && len > window ? len - window : 0; /* first position read */
    const int64_t splits = first[row + 1] - first[row], span = (len - lo + splits - 1) / splits;
    *b = row, *c0 = lo + s * span, *c1 = *c0 + span < len ? *c0 + span : len;
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
 * the query heads of their kv head (bf16 and int8 rows on vdpbf16ps, int4 ones in integer
 * products, where the build has them, else widened to float32), with an online softmax (flash-decoding), and the
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
#if defined(MS_AVX512) && !defined(MS_AVX512_VNNI)
    if (attention_vnni) /* this file again, with VNNI: int4 rows on vpdpbusd */
        return attention_vnni(q, ldq, B, H, G, kv_kind, k_cache, k_slot, k_head, dk, v_cache, v_slot, v_head, dv,
                              v_scale_at, block_tables, bt_stride, context_lens, block_size, scale, sinks, window,
                              out, ldo, nthreads);
#endif
    const int64_t hpg = H / G;
    /* bytes of a slot's rows (all kv heads) and of a cache element (bf16 or a byte), for
     * prefetching */
    const int64_t elem = kv_kind == KV_BF16 ? 2 : 1, tail = kv_kind == KV_BF16 ? 0 : 2;
    const int64_t k_bytes = ((G - 1) * k_head + dk) * elem + tail, v_bytes = ((G - 1) * v_head + dv) * elem + tail;
    /* bytes of one kv head's key and value rows (int4: half a byte a value, a bf16 scale a group) */
    const int64_t k_row = kv_row_bytes(kv_kind, dk), v_row = kv_row_bytes(kv_kind, v_scale_at);
    const int64_t k_all = (G - 1) * k_head * elem + k_row, v_all = (G - 1) * v_head * elem + v_row; /* a slot's */
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
    if (kv_kind == KV_INT8 && dk % (2 * VL) == 0 && dv % (2 * VL) == 0) rows = ROWS_INT8_DOTS;
#endif
#if defined(INT4_DOTS)
    if (kv_kind == KV_INT4 && dk % INT4_STEP == 0 && dv % INT4_STEP == 0) rows = ROWS_INT4_DOTS;
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
    int64_t handed = 0; /* work items handed out so far (each thread reserves its next one early) */
#pragma omp parallel num_threads(nthreads)
    {
        float *qf = (float *)(scratch + partial_bytes + index_bytes + (size_t)omp_get_thread_num() * local_bytes);
        uint32_t *qa = (uint32_t *)(qf + H * dk); /* per head: 4 dk floats, or 2 dk bf16 pairs */
        float *sh = qf + 5 * H * dk, *gsum = sh + HB * ATT_CHUNK, *kf = gsum + HB * GROUPS * VL;
        float *vfl = kf + G * ATT_CHUNK * dk, *merged = vfl + G * ATT_CHUNK * dv;
        const int64_t q_units = rows == ROWS_INT4_DOTS || rows == ROWS_BF16_DOTS ? 2 * dk : 4 * dk; /* a head's arranged query, in 32-bit units (int4_query: fewer) */
        /* Items go out one at a time, as dynamic scheduling hands them, but a thread takes its
         * next item as it starts the last chunk of one, so that item's first rows load during
         * that chunk: otherwise each item waited on all of its first chunk's rows (at 32 rows
         * of 128-256 positions, a quarter of the kernel's time). */
        int64_t it = take_item(&handed), first_loaded = 0;
        while (it < total) {
            int64_t next = -1, b, c0, c1;
            item_span(it, owner, first, context_lens, window, &b, &c0, &c1);
            float *res = partials + it * H * part;
            for (int64_t h = 0; h < H; h++) {
                res[h * part] = -INFINITY, res[h * part + 1] = 0.0f;
                memset(res + h * part + 2, 0, dv * sizeof(float));
            }
            if (c0 >= c1) {
                it = take_item(&handed), first_loaded = 0;
                continue;
            }
            for (int64_t h = 0; h < H; h++) {
                const bf16 *qh = q + b * ldq + h * dk;
                if (rows == ROWS_BF16_DOTS) { /* the bf16 pairs as they are */
                    memcpy(qf + h * dk, qh, dk * sizeof(bf16));
                    arrange_q((const uint32_t *)(qf + h * dk), dk / 2, qa + h * q_units);
                    continue;
                }
                for (int64_t c = 0; c < dk; c++) qf[h * dk + c] = bf16_to_f32(qh[c]) * scale;
                if (kv_kind != KV_BF16) hadamard_rotate(qf + h * dk, dk); /* q . k = Rq . Rk: the rows stored rotated */
                if (rows == ROWS_INT4_DOTS) {
#if defined(INT4_DOTS)
                    int4_query_arrange(qf + h * dk, dk, qa + h * q_units);
#endif
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
            int cur = 0, asked_next = 0;
            chunk_slots(table, block_size, c0, c1, slots[cur]);
            if (rows != ROWS_PER_HEAD) { /* the first chunk's rows (unless the last item asked); each chunk asks for the next one's */
                if (!first_loaded) {
                    ahead_rows first_rows;
                    rows_ahead(&first_rows, slots[cur], c1 - c0, k_cache, k_slot, k_all, v_cache, v_slot, v_all, elem);
                    prefetch_ahead(&first_rows, 0, ATT_CHUNK);
                }
            } else
                prefetch_rows(table, block_size, c0, c1, k_cache, k_slot, k_bytes, v_cache, v_slot, v_bytes, elem);
            for (int64_t p0 = c0; p0 < c1; p0 += ATT_CHUNK, cur ^= 1) {
                const int64_t n = c1 - p0 < ATT_CHUNK ? c1 - p0 : ATT_CHUNK, n_next = c1 - p0 - n;
                const int64_t *slot = slots[cur];
                int64_t ahead_n = n_next; /* rows the next chunk reads: this item's, or the next item's first */
                if (n_next > 0)
                    chunk_slots(table, block_size, p0 + ATT_CHUNK, c1, slots[cur ^ 1]);
                else if (rows != ROWS_PER_HEAD && (next = take_item(&handed)) < total) {
                    int64_t nb, n0, n1;
                    item_span(next, owner, first, context_lens, window, &nb, &n0, &n1);
                    if (n0 < n1) {
                        chunk_slots(block_tables + nb * bt_stride, block_size, n0, n1, slots[cur ^ 1]);
                        ahead_n = n1 - n0, asked_next = 1;
                    }
                }
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
                    const char *kslot[ATT_CHUNK], *vslot[ATT_CHUNK]; /* the slots' rows (repeating past n) */
                    slot_rows(slot, ATT_CHUNK, k_cache, k_slot, v_cache, v_slot, elem, kslot, vslot);
                    ahead_rows ahead;
                    rows_ahead(&ahead, slots[cur ^ 1], ahead_n, k_cache, k_slot, k_all, v_cache, v_slot, v_all, elem);
                    for (int64_t g = 0; g < G; g++) {
                        const void *krows[ATT_CHUNK], *vrows[ATT_CHUNK];
                        ahead.lo = g * ATT_CHUNK / G, ahead.hi = (g + 1) * ATT_CHUNK / G;
                        if (rows == ROWS_F32) /* a quantized cache: kv head g's rows widened for its heads */
                            for (int64_t i = 0; i < ATT_CHUNK; i++) {
                                const int64_t r = i < n ? i : n - 1;
                                krows[i] = kf + r * dk, vrows[i] = vfl + r * dv;
                                if (i == r) {
                                    kv_widen_row(kslot[i] + g * k_head, kv_kind, dk, dk, kf + i * dk);
                                    kv_widen_row(vslot[i] + g * v_head, kv_kind, dv, v_scale_at, vfl + i * dv);
                                }
                            }
                        else
                            for (int64_t i = 0; i < ATT_CHUNK; i++)
                                krows[i] = kslot[i] + g * k_head * elem, vrows[i] = vslot[i] + g * v_head * elem;
                        for (int64_t h0 = g * hpg; h0 < (g + 1) * hpg; h0 += HB) {
                            const int64_t left = (g + 1) * hpg - h0;
                            const uint32_t *qh = qa + h0 * q_units;
                            float *rh = res + h0 * part;
#define HEADS(hb, how) heads_chunk(hb, how, krows, vrows, n, qh, q_units, dk, dv, v_scale_at, scale, rh, part, gsum, sh, \
                                  h0 == g * hpg && ahead.n > ahead.lo ? &ahead : NULL)
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
            it = next >= 0 ? next : take_item(&handed), first_loaded = asked_next;
        }
#pragma omp barrier
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
#if defined(INT4_DOTS)
            if (rows == ROWS_INT4_DOTS) { /* each step's columns back in order (int4_column) */
                for (int64_t c = 0; c < dv; c++) kf[c - c % INT4_STEP + int4_column(c % INT4_STEP)] = merged[c];
                memcpy(merged, kf, dv * sizeof(float));
            }
#endif
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
