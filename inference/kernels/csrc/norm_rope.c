/* RMSNorm with the residual add, and rotary embeddings with the KV-cache write. */
#include "kernels.h"

/* ---- RMSNorm, residual adds, rotary embeddings --------------------------------------- */

/* out = RMSNorm(x) * w, rounded as the reference rounds (normalised in float32, rounded,
 * then times the bf16 weight). With `residual`, first residual = x + residual (rounded, the
 * reference's bf16 add), which is then normalised: one pass for the add and the norm. */
void ms_rmsnorm(const bf16 *x, int64_t ldx, bf16 *residual, int64_t ldr, const bf16 *w, float eps,
                bf16 *out, int64_t ldo, int64_t T, int64_t D, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *xr = x + t * ldx;
        bf16 *src = (bf16 *)xr;
        if (residual) {
            bf16 *rr = residual + t * ldr;
            int64_t d = 0;
            for (; d + VL <= D; d += VL) vf_store_bf16(rr + d, vf_add(vf_load_bf16(xr + d), vf_load_bf16(rr + d)));
            for (; d < D; d++) rr[d] = f32_to_bf16(bf16_to_f32(xr[d]) + bf16_to_f32(rr[d]));
            src = rr;
        }
        vf vs = vf_zero();
        int64_t d = 0;
        for (; d + VL <= D; d += VL) {
            const vf v = vf_load_bf16(src + d);
            vs = vf_fma(v, v, vs);
        }
        float ss = vf_sum(vs);
        for (; d < D; d++) ss += bf16_to_f32(src[d]) * bf16_to_f32(src[d]);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        bf16 *o = out + t * ldo;
        d = 0;
        for (; d + VL <= D; d += VL)
            vf_store_bf16(o + d, vf_mul(vf_round_bf16(vf_mul(vf_load_bf16(src + d), vf_set1(r))), vf_load_bf16(w + d)));
        for (; d < D; d++) o[d] = f32_to_bf16(round_bf16(bf16_to_f32(src[d]) * r) * bf16_to_f32(w[d]));
    }
}

/* Rotary embedding (rotate-half layout) of the H query and G key heads of qkv [T, (H + 2G) d]
 * in place, then the keys and values written to the cache rows slots[t] (k_cache/v_cache
 * [S, G, row] in format kv_kind: row = d elements, or d + 2 bytes for int8 with its scale).
 * Only the first rd dims of each head rotate (rd < d: partial rotary, GLM-4.5 and MiniMax-M2;
 * the rest pass unchanged); cos/sin [T, rd] bf16 (each frequency twice, as the checkpoints'
 * tables). Each product and the sum rounded as the reference's bf16 ops round. key_shift
 * [G, d] float32 (or NULL): taken off each rotated key, in place, before it is written
 * (bf16(k - m) as torch rounds it); key_hinv [G, d, d] (or NULL): each head's int4 key rows
 * rounded through it (kv_store_row). Both from executor/key_calibration.py. */
void ms_rope_cache(bf16 *qkv, int64_t ld, int64_t T, int64_t H, int64_t G, int64_t d, int64_t rd,
                   const bf16 *cos, const bf16 *sin, const float *key_shift, const float *key_hinv,
                   const int64_t *slots, int kv_kind, void *k_cache, void *v_cache, int64_t cache_row,
                   int nthreads) {
    const int64_t half = rd / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *ct = cos + t * rd, *st = sin + t * rd;
        for (int64_t head = 0; head < H + G; head++) {
            bf16 *x = qkv + t * ld + head * d;
            int64_t i = 0;
            for (; i + VL <= half; i += VL) {
                const vf x1 = vf_load_bf16(x + i), x2 = vf_load_bf16(x + half + i);
                const vf lo = vf_add(vf_round_bf16(vf_mul(x1, vf_load_bf16(ct + i))),
                                     vf_round_bf16(vf_mul(vf_sub(vf_zero(), x2), vf_load_bf16(st + i))));
                const vf hi = vf_add(vf_round_bf16(vf_mul(x2, vf_load_bf16(ct + half + i))),
                                     vf_round_bf16(vf_mul(x1, vf_load_bf16(st + half + i))));
                vf_store_bf16(x + i, lo);
                vf_store_bf16(x + half + i, hi);
            }
            for (; i < half; i++) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
                x[i] = f32_to_bf16(round_bf16(x1 * bf16_to_f32(ct[i])) + round_bf16(-x2 * bf16_to_f32(st[i])));
                x[half + i] = f32_to_bf16(round_bf16(x2 * bf16_to_f32(ct[half + i])) +
                                          round_bf16(x1 * bf16_to_f32(st[half + i])));
            }
        }
        for (int64_t g = 0; key_shift && g < G; g++) {
            bf16 *x = qkv + t * ld + (H + g) * d;
            const float *m = key_shift + g * d;
            int64_t i = 0;
            for (; i + VL <= d; i += VL) vf_store_bf16(x + i, vf_sub(vf_load_bf16(x + i), vf_load(m + i)));
            for (; i < d; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) - m[i]);
        }
        if (slots && kv_kind == KV_BF16) {
            memcpy((bf16 *)k_cache + slots[t] * G * d, qkv + t * ld + H * d, G * d * sizeof(bf16));
            memcpy((bf16 *)v_cache + slots[t] * G * d, qkv + t * ld + (H + G) * d, G * d * sizeof(bf16));
        } else if (slots) {
            float row[d];
            for (int64_t g = 0; g < 2 * G; g++) {
                widen_row(qkv + t * ld + (H + g) * d, d, row, d);
                uint8_t *cache = g < G ? k_cache : v_cache;
                const float *hinv = g < G && key_hinv ? key_hinv + g * d * d : NULL;
                kv_store_row(row, kv_kind, d, hinv, cache + (slots[t] * G + g % G) * cache_row);
            }
        }
    }
}
