/* Decode attention over the paged KV cache (see ms_decode_attention). */
#include <omp.h>

#include "kernels.h"

/* ---- decode attention ---------------------------------------------------------------- */

#define ATT_CHUNK 32 /* context positions per pass: their K and V rows widened once for all heads */
#define SPLIT_BYTES ((size_t)64 << 20) /* the most the splits' partial results may take */

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
        for (int64_t o = 0; o < k_bytes; o += 64) __builtin_prefetch(k + o, 0, 1);
        __builtin_prefetch(k + k_bytes - 1, 0, 1); /* a row across one more line than its length */
        for (int64_t o = 0; o < v_bytes; o += 64) __builtin_prefetch(v + o, 0, 1);
        __builtin_prefetch(v + v_bytes - 1, 0, 1);
    }
}

/* One query token per row over its paged context, for all rows of a step, read straight from
 * the cache by block table (no gathered copy). A sequence may bring several queries: rows
 * sharing its block table, at consecutive positions, each row's context its own length
 * (causal: speculative verification's k + 1 positions). Work items are (row, context
 * split); each walks its positions in chunks whose key and value rows (all kv heads of a
 * slot: adjacent in the cache, so the chunk is read in whole lines) are widened to float32
 * once for every query head, with an online softmax (flash-decoding), and the
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
    const size_t local_bytes = round64((size_t)(H * dk + ATT_CHUNK + G * ATT_CHUNK * (dk + dv) + dv) * sizeof(float));
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
        float *sh = qf + H * dk, *kf = sh + ATT_CHUNK, *vfl = kf + G * ATT_CHUNK * dk, *merged = vfl + G * ATT_CHUNK * dv;
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
                for (int64_t c = 0; c < dk; c++) qf[h * dk + c] = bf16_to_f32(qh[c]) * scale;
                if (kv_kind != KV_BF16) hadamard_rotate(qf + h * dk, dk); /* q . k = Rq . Rk: the rows stored rotated */
            }
            const int32_t *table = block_tables + b * bt_stride;
            prefetch_rows(table, block_size, c0, c1, k_cache, k_slot, k_bytes, v_cache, v_slot, v_bytes, elem);
            for (int64_t p0 = c0; p0 < c1; p0 += ATT_CHUNK) {
                const int64_t n = c1 - p0 < ATT_CHUNK ? c1 - p0 : ATT_CHUNK;
                /* the next chunk's rows are on their way while this one is computed */
                prefetch_rows(table, block_size, p0 + ATT_CHUNK, c1, k_cache, k_slot, k_bytes, v_cache, v_slot,
                              v_bytes, elem);
                for (int64_t i = 0; i < n; i++) { /* kv head g's rows at kf/vfl + g * ATT_CHUNK rows */
                    const int64_t p = p0 + i, slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t ko = slot * k_slot + g * k_head, vo = slot * v_slot + g * v_head;
                        float *kr = kf + (g * ATT_CHUNK + i) * dk, *vr = vfl + (g * ATT_CHUNK + i) * dv;
                        if (kv_kind == KV_BF16) {
                            widen_row((const bf16 *)k_cache + ko, dk, kr, dk);
                            widen_row((const bf16 *)v_cache + vo, dv, vr, dv);
                        } else {
                            kv_widen_row((const uint8_t *)k_cache + ko, kv_kind, dk, dk, kr);
                            kv_widen_row((const uint8_t *)v_cache + vo, kv_kind, dv, v_scale_at, vr);
                        }
                    }
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
