/* Prefill attention over the paged KV cache on AVX512-BF16 (see ms_prefill_attention). */
#include <omp.h>
#include <string.h>

#include "kernels.h"

#if defined(MS_AVX512_BF16)

#define ROWV 6            /* vectors of 16 (query, head) rows per work item */
#define ROWS (16 * ROWV)  /* those rows: a kv head's query heads times a few queries */
#define KEYS 64           /* keys per block: scores, softmax, then the values' products */
#define KT 4              /* keys per score tile: KT x ROWV accumulators */
#define CT 4              /* value columns per output tile: CT x ROWV accumulators */
#define MAX_D 256
#define SETS 2           /* sets of rows a work item takes over the same keys */

static const bf16 zeros[MAX_D]; /* the key and value row of a position past the last key */

static inline __m512bh as_pairs(__m512i x) {
    __m512bh r;
    memcpy(&r, &x, 64);
    return r;
}

/* float32 lanes rounded to bf16 (to nearest even; the probabilities are finite), in each
 * lane's low 16 bits */
static inline __m512i bf16_bits(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
}

/* lanes 2t and 2t + 1 from lanes t and 16 + t: two rows' halves interleaved into pairs */
static inline __m512i pair_index(void) {
    int16_t idx[32];
    for (int t = 0; t < 16; t++) idx[2 * t] = (int16_t)t, idx[2 * t + 1] = (int16_t)(16 + t);
    return _mm512_loadu_si512(idx);
}

/* ROWS (query, head) rows of one kv head — query i0 + r / hpg, head g * hpg + r % hpg — and
 * their online softmax's state over the keys seen so far. The rows lie across the vectors'
 * lanes, so a key's scores for all rows are one vector: the softmax's maxima and sums run
 * down the keys, with no horizontal reductions. */
typedef struct {
    uint32_t *qp;            /* [d / 2][ROWS] the rows' query pairs */
    int32_t *pos;            /* [ROWS] each row's position (a padding row's: last) */
    float *o, *m, *l;        /* [d][ROWS] weighted values; [ROWS] running maximum and sum */
    int64_t last, first_pos; /* the last key any row sees; the earliest row's position */
} rowset;

/* One block of keys [k0, k0 + KEYS) for a set of rows (k0 <= rs->last): scores from each
 * key's bf16 pairs broadcast from its cache row against the queries' pairs, the online
 * softmax, the probabilities as bf16 pairs of keys (pp, [KEYS / 2][ROWS]) against the block's
 * value pairs (vp, [KEYS / 2][d], packed by the caller). */
static void key_block(const rowset *rs, int64_t k0, int64_t window, const bf16 *const *krow, int64_t d,
                      float scale, float *s, uint32_t *pp, const uint32_t *vp) {
    const int64_t nk = rs->last + 1 - k0 < KEYS ? rs->last + 1 - k0 : KEYS, half = d / 2;
    /* scores, scaled: s[j][r] */
    for (int64_t j0 = 0; j0 < nk; j0 += KT) {
        const uint32_t *kr[KT];
        for (int t = 0; t < KT; t++) {
            const int64_t p = k0 + j0 + t;
            kr[t] = (const uint32_t *)(p <= rs->last ? krow[p - k0] : zeros);
        }
        __m512 acc[KT][ROWV];
        for (int t = 0; t < KT; t++)
            for (int v = 0; v < ROWV; v++) acc[t][v] = _mm512_setzero_ps();
        for (int64_t c = 0; c < half; c++) {
            __m512bh qv[ROWV];
            for (int v = 0; v < ROWV; v++) qv[v] = as_pairs(_mm512_loadu_si512(rs->qp + c * ROWS + 16 * v));
            for (int t = 0; t < KT; t++) {
                const __m512bh kv = as_pairs(_mm512_set1_epi32((int32_t)kr[t][c]));
                for (int v = 0; v < ROWV; v++) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], qv[v], kv);
            }
        }
        const int64_t n = nk - j0 < KT ? nk - j0 : KT;
        for (int64_t t = 0; t < n; t++)
            for (int v = 0; v < ROWV; v++)
                _mm512_storeu_ps(s + (j0 + t) * ROWS + 16 * v, _mm512_mul_ps(acc[t][v], _mm512_set1_ps(scale)));
    }
    /* causal: key p is seen by the rows at positions >= p (a block past the earliest row's
     * position has keys some rows do not see); with a window, only by those below p + window
     * (a block before the latest row's first key has keys it does not see) */
    const int masked = k0 + nk - 1 > rs->first_pos || (window > 0 && k0 <= rs->last - window);
    __m512 top[ROWV], m[ROWV], alpha[ROWV], sum[ROWV];
    __m512i posv[ROWV];
    for (int v = 0; v < ROWV; v++) {
        top[v] = _mm512_set1_ps(-INFINITY), sum[v] = _mm512_setzero_ps();
        posv[v] = _mm512_loadu_si512(rs->pos + 16 * v);
    }
    for (int64_t j = 0; j < nk; j++)
        for (int v = 0; v < ROWV; v++) {
            __m512 x = _mm512_loadu_ps(s + j * ROWS + 16 * v);
            if (masked) {
                __mmask16 seen = _mm512_cmpge_epi32_mask(posv[v], _mm512_set1_epi32((int32_t)(k0 + j)));
                if (window > 0) /* and not by those at p + window or later */
                    seen &= (__mmask16)~_mm512_cmpge_epi32_mask(posv[v], _mm512_set1_epi32((int32_t)(k0 + j + window)));
                x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, x);
                _mm512_storeu_ps(s + j * ROWS + 16 * v, x);
            }
            top[v] = _mm512_max_ps(top[v], x);
        }
    for (int v = 0; v < ROWV; v++) {
        const __m512 m_old = _mm512_loadu_ps(rs->m + 16 * v);
        /* -inf while a row has seen no key (a window's first blocks): exp's clamp then makes
         * alpha tiny instead of NaN, times a row still empty */
        m[v] = _mm512_max_ps(m_old, top[v]);
        alpha[v] = vf_exp(_mm512_sub_ps(m_old, m[v]));
        _mm512_storeu_ps(rs->m + 16 * v, m[v]);
    }
    /* probabilities, their sums, and their bf16 pairs (keys 2jp and 2jp + 1 of each row) */
    for (int64_t j = 0; j < nk; j++)
        for (int v = 0; v < ROWV; v++) {
            const __m512 x = _mm512_loadu_ps(s + j * ROWS + 16 * v);
            const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, vf_exp(_mm512_sub_ps(x, m[v])));
            sum[v] = _mm512_add_ps(sum[v], e);
            _mm512_storeu_ps(s + j * ROWS + 16 * v, e);
        }
    for (int v = 0; v < ROWV; v++)
        _mm512_storeu_ps(rs->l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(rs->l + 16 * v), alpha[v], sum[v]));
    const int64_t np = (nk + 1) / 2;
    for (int64_t jp = 0; jp < np; jp++)
        for (int v = 0; v < ROWV; v++) {
            const __m512 a = _mm512_loadu_ps(s + 2 * jp * ROWS + 16 * v);
            const __m512 b = 2 * jp + 1 < nk ? _mm512_loadu_ps(s + (2 * jp + 1) * ROWS + 16 * v) : _mm512_setzero_ps();
            _mm512_storeu_si512(pp + jp * ROWS + 16 * v, _mm512_or_si512(bf16_bits(a), _mm512_slli_epi32(bf16_bits(b), 16)));
        }
    /* o = o * alpha + p v, o [d][ROWS] */
    for (int64_t c0 = 0; c0 < d; c0 += CT) {
        __m512 acc[CT][ROWV];
        for (int t = 0; t < CT; t++)
            for (int v = 0; v < ROWV; v++)
                acc[t][v] = _mm512_mul_ps(_mm512_loadu_ps(rs->o + (c0 + t) * ROWS + 16 * v), alpha[v]);
        for (int64_t jp = 0; jp < np; jp++) {
            __m512bh pv[ROWV];
            for (int v = 0; v < ROWV; v++) pv[v] = as_pairs(_mm512_loadu_si512(pp + jp * ROWS + 16 * v));
            for (int t = 0; t < CT; t++) {
                const __m512bh vv = as_pairs(_mm512_set1_epi32((int32_t)vp[jp * d + c0 + t]));
                for (int v = 0; v < ROWV; v++) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], pv[v], vv);
            }
        }
        for (int t = 0; t < CT; t++)
            for (int v = 0; v < ROWV; v++) _mm512_storeu_ps(rs->o + (c0 + t) * ROWS + 16 * v, acc[t][v]);
    }
}

/* The value pairs of the block's nk keys (later ones zero): vp[jp][c] = (v[2jp][c],
 * v[2jp + 1][c]) as bf16 pairs, from the block's value rows vrow. */
static void value_pairs(const bf16 *const *vrow, int64_t nk, int64_t d, uint32_t *vp) {
    const __m512i pairs = pair_index();
    for (int64_t jp = 0; jp < (nk + 1) / 2; jp++) {
        const bf16 *va = vrow[2 * jp], *vb = 2 * jp + 1 < nk ? vrow[2 * jp + 1] : zeros;
        for (int64_t c = 0; c < d; c += 16) {
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(va + c))),
                                                  _mm256_loadu_si256((const __m256i *)(vb + c)), 1);
            _mm512_storeu_si512(vp + jp * d + c, _mm512_permutexvar_epi16(pairs, ab));
        }
    }
}

/* The bf16 key and value rows of keys [k0, k0 + nk) into krow / vrow: a bf16 cache's rows in
 * place; a quantized cache's dequantized into kbuf / vbuf ([KEYS][d]), rotated back and
 * rounded to bf16, as models/paged_cache.py's dequantize reads them for the parts. And the
 * next block's rows asked for (their slots need not be adjacent). `cache` rows of (slot, this
 * kv head) at base + slot * stride bytes, `bytes` long. */
static void block_rows(int64_t k0, int64_t nk, int64_t last, int kind, const int64_t *slots, int64_t d,
                       const char *kbase, const char *vbase, int64_t stride_k, int64_t stride_v, int64_t bytes,
                       float *row32, bf16 *kbuf, bf16 *vbuf, const bf16 **krow, const bf16 **vrow) {
    for (int64_t p = k0 + KEYS; p < k0 + 2 * KEYS && p <= last; p++) {
        const char *kr = kbase + slots[p] * stride_k, *vr = vbase + slots[p] * stride_v;
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(kr + b, _MM_HINT_T0), _mm_prefetch(vr + b, _MM_HINT_T0);
    }
    for (int64_t j = 0; j < nk; j++) {
        const char *kr = kbase + slots[k0 + j] * stride_k, *vr = vbase + slots[k0 + j] * stride_v;
        if (kind == KV_BF16) {
            krow[j] = (const bf16 *)kr, vrow[j] = (const bf16 *)vr;
            continue;
        }
        for (int side = 0; side < 2; side++) {
            bf16 *dst = (side ? vbuf : kbuf) + j * d;
            kv_widen_row(side ? vr : kr, kind, d, d, row32);
            hadamard_rotate(row32, d); /* stored rotated: R R = I */
            for (int64_t c = 0; c < d; c += VL) vf_store_bf16(dst + c, vf_load(row32 + c));
        }
        krow[j] = kbuf + j * d, vrow[j] = vbuf + j * d;
    }
}
#endif

/* Causal attention of a prompt chunk's C queries, at positions ctx .. ctx + C - 1 of one
 * sequence, over that sequence's keys and values in the paged cache (the chunk's own already
 * written), read in place by slot: no gathered copy, one pass over the whole context (no
 * parts to merge). Products on vdpbf16ps (q and the cached rows are bf16 already), scores
 * and softmax in float32, the probabilities rounded to bf16 for the values' products as
 * ATen's flash kernel rounds them for bf16 inputs.
 * q [C, H, d] (row stride ldq, heads d apart); caches in format kv_kind (a quantized one's rows
 * dequantized and rotated back a block of keys at a time, into bf16), key row of (slot, kv
 * head g) at k_cache + slot * k_slot + g * k_head (in its elements: bf16 or bytes), value rows
 * likewise; slots [ctx + C]: each position's
 * cache slot; out [C, H, d] (row stride ldo). Query heads [g * H / G, (g + 1) * H / G) share
 * kv head g. window > 0: each query sees its last `window` positions (itself included);
 * sinks (NULL: none) [H] float32: a logit per head joining each softmax's denominator with
 * no value (gpt-oss). Returns 2 where this build has no AVX512-BF16 (cpu.py calls it only where it
 * has), 1 for shapes it does not take (d a multiple of 32 up to 256, at most 96 query heads
 * a kv head), -1 when out of scratch memory. */
int ms_prefill_attention(const bf16 *q, int64_t ldq, int64_t C, int64_t H, int64_t G, int64_t d, int kv_kind,
                         const void *k_cache, int64_t k_slot, int64_t k_head, const void *v_cache, int64_t v_slot,
                         int64_t v_head, const int64_t *slots, int64_t ctx, float scale, const float *sinks,
                         int64_t window, bf16 *out, int64_t ldo, int nthreads) {
#if !defined(MS_AVX512_BF16)
    (void)q, (void)ldq, (void)C, (void)H, (void)G, (void)d, (void)kv_kind, (void)k_cache, (void)k_slot, (void)k_head;
    (void)v_cache, (void)v_slot, (void)v_head, (void)slots, (void)ctx, (void)scale, (void)sinks, (void)window;
    (void)out, (void)ldo;
    (void)nthreads;
    return 2;
#else
    if (d % 32 || d > MAX_D || G < 1 || H % G || H / G > ROWS) return 1;
    if (C <= 0) return 0;
    const int64_t hpg = H / G, per = ROWS / hpg; /* queries a set of rows */
    /* a work item: SETS sets of rows of one kv head, consecutive queries, sharing each block
     * of keys while it is in cache */
    const int64_t sets = (C + per - 1) / per, blocks = (sets + SETS - 1) / SETS, items = G * blocks;
    const size_t qp_bytes = round64((size_t)d / 2 * ROWS * 4), o_bytes = round64((size_t)d * ROWS * 4);
    const size_t state_bytes = round64((size_t)3 * ROWS * 4), set_bytes = qp_bytes + o_bytes + state_bytes;
    const size_t s_bytes = round64((size_t)KEYS * ROWS * 4), pp_bytes = round64((size_t)KEYS / 2 * ROWS * 4);
    const size_t vp_bytes = round64((size_t)KEYS / 2 * d * 4), buf_bytes = round64((size_t)KEYS * d * 2);
    const size_t local = SETS * set_bytes + s_bytes + pp_bytes + vp_bytes + 2 * buf_bytes + round64((size_t)d * 4);
    /* bytes of a cache element (bf16 or a byte) and of a row (int8/fp8: its scale after it) */
    const int64_t elem = kv_kind == KV_BF16 ? 2 : 1;
    const int64_t row_bytes = kv_kind == KV_BF16 ? 2 * d : kv_kind == KV_INT4 ? d / 2 + 2 * (d / KV_INT4_GROUP) : d + 2;
    region_enter();
    char *scratch = region_alloc((size_t)nthreads * local);
    if (!scratch) {
        region_leave();
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        char *mine = scratch + (size_t)omp_get_thread_num() * local;
        float *s = (float *)(mine + SETS * set_bytes);
        uint32_t *pp = (uint32_t *)(mine + SETS * set_bytes + s_bytes);
        uint32_t *vp = (uint32_t *)(mine + SETS * set_bytes + s_bytes + pp_bytes);
        bf16 *kbuf = (bf16 *)(mine + SETS * set_bytes + s_bytes + pp_bytes + vp_bytes), *vbuf = kbuf + KEYS * d;
        float *row32 = (float *)((char *)kbuf + 2 * buf_bytes);
        const bf16 *krow[KEYS], *vrow[KEYS];
        rowset rs[SETS];
        /* the latest queries (the most keys) first, so the last items to finish are short */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t g = it % G, b = blocks - 1 - it / G;
            int n = 0;
            int64_t last = 0, first = INT64_MAX; /* the keys any set sees */
            for (int64_t set = b * SETS; set < (b + 1) * SETS && set < sets; set++, n++) {
                rowset *r = &rs[n];
                char *at = mine + n * set_bytes;
                r->qp = (uint32_t *)at, r->o = (float *)(at + qp_bytes), r->m = (float *)(at + qp_bytes + o_bytes);
                r->l = r->m + ROWS, r->pos = (int32_t *)(r->l + ROWS);
                const int64_t i0 = set * per, nq = C - i0 < per ? C - i0 : per;
                r->last = ctx + i0 + nq - 1, r->first_pos = ctx + i0;
                for (int64_t row = 0; row < ROWS; row++) {
                    const int64_t i = row / hpg, h = g * hpg + row % hpg;
                    const int real = i < nq;
                    r->pos[row] = (int32_t)(real ? ctx + i0 + i : r->last); /* a padding row sees every key */
                    r->m[row] = -INFINITY, r->l[row] = 0.0f;
                    const uint32_t *qr = (const uint32_t *)(q + (i0 + i) * ldq + h * d);
                    for (int64_t c = 0; c < d / 2; c++) r->qp[c * ROWS + row] = real ? qr[c] : 0;
                }
                memset(r->o, 0, (size_t)d * ROWS * sizeof(float));
                last = r->last > last ? r->last : last;
                const int64_t lo = window > 0 && r->first_pos >= window ? r->first_pos - window + 1 : 0;
                first = lo < first ? lo : first;
            }
            const char *kbase = (const char *)k_cache + g * k_head * elem, *vbase = (const char *)v_cache + g * v_head * elem;
            for (int64_t k0 = first / KEYS * KEYS; k0 <= last; k0 += KEYS) {
                const int64_t nk = last + 1 - k0 < KEYS ? last + 1 - k0 : KEYS;
                block_rows(k0, nk, last, kv_kind, slots, d, kbase, vbase, k_slot * elem, v_slot * elem, row_bytes, row32,
                           kbuf, vbuf, krow, vrow);
                value_pairs(vrow, nk, d, vp);
                for (int j = 0; j < n; j++) /* a set's keys: [its first row's window start, its last] */
                    if (k0 <= rs[j].last && (window <= 0 || k0 + KEYS > rs[j].first_pos - window + 1))
                        key_block(&rs[j], k0, window, krow, d, scale, s, pp, vp);
            }
            for (int j = 0; j < n; j++) {
                const int64_t i0 = (b * SETS + j) * per;
                for (int64_t row = 0; row < (rs[j].last - rs[j].first_pos + 1) * hpg; row++) {
                    const int64_t i = row / hpg, h = g * hpg + row % hpg;
                    bf16 *dst = out + (i0 + i) * ldo + h * d;
                    float m = rs[j].m[row], keep = 1.0f, total = rs[j].l[row];
                    if (sinks) { /* the sink's logit joins the denominator with no value */
                        const float top = sinks[h] > m ? sinks[h] : m;
                        keep = expf(m - top), total = total * keep + expf(sinks[h] - top);
                    }
                    const float f = keep / total;
                    for (int64_t c = 0; c < d; c++) dst[c] = f32_to_bf16(rs[j].o[c * ROWS + row] * f);
                }
            }
        }
    }
    region_leave();
    return 0;
#endif
}
