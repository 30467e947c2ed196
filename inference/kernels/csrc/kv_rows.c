/* The paged KV cache's row formats (kernels.h KV_*): a row of bf16 values, or of 8-bit ones
 * (int8, fp8 e4m3 or e5m2) held rotated (hadamard_rotate) with a bf16 scale after them, or of
 * int4 ones held rotated, two a byte, with a bf16 scale per group after them; the rope kernel
 * writes rows (kv_store_row), decode attention reads them (kv_widen_row). */
#include <string.h>

#include "kernels.h"

static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t u = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
    float f;
    memcpy(&f, &u, 4);
    return f * E4M3_UNBIAS;
}

static inline float e5m2_to_f32(uint8_t b) {
    const uint32_t u = ((b & 0x80u) << 24) | ((b & 0x7fu) << 21);
    float f;
    memcpy(&f, &u, 4);
    return f * E5M2_UNBIAS;
}

/* float32 -> fp8 (e4m3: mbits 3, bias 7; e5m2: 2, 15), round to nearest even, saturating at
 * the format's largest finite value `max` (what torch gives for values clamped to the range):
 * normals by rounding float32's bits at the fp8 mantissa's last place (a carry moves into the
 * exponent correctly), subnormals as a multiple of the smallest step. */
static inline uint8_t f32_to_fp8(float x, int mbits, int bias, float max) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(x);
    if (!(a == a)) return sign | 0x7f; /* NaN */
    a = a > max ? max : a;
    const float smallest_normal = ldexpf(1.0f, 1 - bias);
    if (a < smallest_normal) /* 2^(1 - bias - mbits) steps; rounding up to the normal is code 1 << mbits */
        return sign | (uint8_t)nearbyintf(ldexpf(a, bias - 1 + mbits));
    memcpy(&u, &a, 4);
    const int shift = 23 - mbits;
    u += ((1u << (shift - 1)) - 1) + ((u >> shift) & 1u);
    return sign | (uint8_t)((u >> shift) - ((uint32_t)(127 - bias) << mbits));
}

/* An int4 row (models/paged_cache.py's layout): the values of a group of n at row + first / 2,
 * value i and i + n / 2 in the low and high nibble of byte i, each as q + 8; the groups' bf16
 * scales after the width / 2 bytes of values. */
static inline float int4_value(uint8_t byte, int high, float s) {
    return (float)((high ? byte >> 4 : byte & 15) - 8) * s;
}

/* A vector of bytes is two runs of a group's values: its low nibbles, then its high ones;
 * (nibble - 8) * s as one fma (nibble * s - 8 * s: both exact but the one rounding). */
static void widen_int4(const uint8_t *b, int64_t d, int64_t width, float *out) {
    const uint8_t *scales = b + width / 2;
    for (int64_t g0 = 0; g0 < d; g0 += KV_INT4_GROUP) {
        const int64_t left = width - g0, n = left < KV_INT4_GROUP ? left : KV_INT4_GROUP, half = n / 2;
        const float s = row_scale(scales, 2 * (g0 / KV_INT4_GROUP));
        const uint8_t *q = b + g0 / 2;
        float *o = out + g0;
        int64_t i = 0;
        if (g0 + n <= d) { /* a whole group read (the only case kernels.h allows) */
            const vf vs = vf_set1(s), bias = vf_set1(-8.0f * s);
            for (; i + VL <= half; i += VL) {
                const vi w = vi_load_u8(q + i);
                vf_store(o + i, vf_fma(vi_to_vf(vi_and(w, vi_set1(15))), vs, bias));
                vf_store(o + half + i, vf_fma(vi_to_vf(vi_srli(w, 4)), vs, bias));
            }
        }
        for (; i < half; i++) {
            if (g0 + i < d) o[i] = int4_value(q[i], 0, s);
            if (g0 + half + i < d) o[half + i] = int4_value(q[i], 1, s);
        }
    }
}

/* A group's candidate scales, amax * f / 7 (paged_cache.INT4_SCALE_FACTORS, the same floats) */
static const float INT4_SCALE_FACTORS[] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f};

/* x[0..n) at scale s -> levels q (+ 8) in [0, 15], rounded to nearest even; returns their
 * squared error: each value's error in float32 (level times scale is exact there, so no
 * contraction into an fma changes it), squared and summed in double (each square exact
 * there), as paged_cache._int4_group computes it */
static double int4_levels(const float *x, int64_t n, float s, uint8_t *q) {
    double lanes[VL] = {0};
    float e[VL];
    int32_t level[VL];
    int64_t i = 0;
    if (s > 0.0f) {
        const vf vs = vf_set1(s), lo = vf_set1(-8.0f), hi = vf_set1(7.0f);
        for (; i + VL <= n; i += VL) {
            const vf v = vf_load(x + i), l = vf_round(vf_min(vf_max(vf_div(v, vs), lo), hi));
            vf_store(e, vf_sub(vf_mul(l, vs), v));
            vi_store(level, vf_to_vi(l));
            for (int j = 0; j < VL; j++) {
                lanes[j] += (double)e[j] * (double)e[j];
                q[i + j] = (uint8_t)(level[j] + 8);
            }
        }
    }
    double err = 0.0;
    for (int j = 0; j < VL; j++) err += lanes[j];
    for (; i < n; i++) {
        float r = s > 0.0f ? x[i] / s : 0.0f;
        r = r > 7.0f ? 7.0f : r < -8.0f ? -8.0f : r;
        const float l = nearbyintf(r), d = l * s - x[i];
        err += (double)d * (double)d;
        q[i] = (uint8_t)((int)l + 8);
    }
    return err;
}

/* Levels of a rotated row x[0..d) at its values' group scales s[d / KV_INT4_GROUP rounded
 * up], as GPTQ rounds a weight row: value by value to nearest even, each error carried into
 * the values after it through hinv [d, d] (the upper Cholesky factor of the inverse of the
 * head's query second moment: executor/key_calibration.py). Carried in double with each
 * error rounded to float first, so every product is exact and contracting it into an fma
 * changes nothing: paged_cache._weighted_levels gives the same levels. */
static void int4_weighted_levels(const float *x, int64_t d, const float *s, const float *hinv, uint8_t *q) {
    double w[d];
    for (int64_t i = 0; i < d; i++) w[i] = x[i];
    for (int64_t i = 0; i < d; i++) {
        const double si = s[i / KV_INT4_GROUP];
        double r = si > 0.0 ? w[i] / si : 0.0;
        r = r > 7.0 ? 7.0 : r < -8.0 ? -8.0 : r;
        const double l = nearbyint(r);
        q[i] = (uint8_t)((int)l + 8);
        const float err = (float)((w[i] - l * si) / (double)hinv[i * d + i]);
        const float *h = hinv + i * d;
        for (int64_t j = i + 1; j < d; j++) w[j] -= (double)err * (double)h[j];
    }
}

/* d values (even) -> an int4 row: per group, of the candidate bf16 scales the first whose
 * levels hold the group with the least squared error (as stored: quantizing divides by what
 * reading multiplies by); hinv (or NULL): the levels then rounded for the error a query sees
 * (int4_weighted_levels) */
static void store_int4(const float *x, int64_t d, const float *hinv, uint8_t *b) {
    uint8_t *scales = b + d / 2;
    const int candidates = (int)(sizeof INT4_SCALE_FACTORS / sizeof INT4_SCALE_FACTORS[0]);
    uint8_t levels[d];
    float chosen[(d + KV_INT4_GROUP - 1) / KV_INT4_GROUP];
    for (int64_t g0 = 0; g0 < d; g0 += KV_INT4_GROUP) {
        const int64_t left = d - g0, n = left < KV_INT4_GROUP ? left : KV_INT4_GROUP;
        const float amax = row_amax(x + g0, n);
        uint8_t q[KV_INT4_GROUP];
        bf16 best_s16 = 0;
        double best_err = 0.0;
        for (int c = 0; c < candidates; c++) {
            const bf16 s16 = f32_to_bf16(amax * INT4_SCALE_FACTORS[c] / 7.0f);
            const double err = int4_levels(x + g0, n, bf16_to_f32(s16), q);
            if (c == 0 || err < best_err) {
                best_err = err;
                best_s16 = s16;
                memcpy(levels + g0, q, (size_t)n);
            }
        }
        chosen[g0 / KV_INT4_GROUP] = bf16_to_f32(best_s16);
        memcpy(scales + 2 * (g0 / KV_INT4_GROUP), &best_s16, 2);
    }
    if (hinv) int4_weighted_levels(x, d, chosen, hinv, levels);
    for (int64_t g0 = 0; g0 < d; g0 += KV_INT4_GROUP) {
        const int64_t left = d - g0, half = (left < KV_INT4_GROUP ? left : KV_INT4_GROUP) / 2;
        for (int64_t i = 0; i < half; i++) b[g0 / 2 + i] = (uint8_t)(levels[g0 + i] | levels[g0 + half + i] << 4);
    }
}

void kv_widen_row(const void *row, int kind, int64_t d, int64_t scale_at, float *out) {
    const uint8_t *b = row;
    if (kind == KV_BF16) {
        widen_row(row, d, out, d);
        return;
    }
    if (kind == KV_INT4) {
        widen_int4(b, d, scale_at, out);
        return;
    }
    const float s = row_scale(b, scale_at);
    /* VL values a vector: each byte into the top of its lane, widened as the 8-bit weights are */
    const vf scale = vf_set1(kind == KV_INT8 ? s : s * (kind == KV_E4M3 ? E4M3_UNBIAS : E5M2_UNBIAS));
    int64_t i = 0;
    for (; i + VL <= d; i += VL) {
        const vi w = vi_load_u8(b + i);
        const vf v = kind == KV_INT8 ? vf_from_s8(w, 0) : kind == KV_E4M3 ? vf_from_e4m3_raw(w, 0) : vf_from_e5m2_raw(w, 0);
        vf_store(out + i, vf_mul(v, scale));
    }
    for (; i < d; i++)
        out[i] = kind == KV_INT8 ? (float)(int8_t)b[i] * s : (kind == KV_E4M3 ? e4m3_to_f32(b[i]) : e5m2_to_f32(b[i])) * s;
}

void kv_store_row(float *x, int kind, int64_t d, const float *hinv, void *row) {
    uint8_t *b = row;
    if (kind == KV_BF16) {
        for (int64_t i = 0; i < d; i++) ((bf16 *)row)[i] = f32_to_bf16(x[i]);
        return;
    }
    hadamard_rotate(x, d);
    if (kind == KV_INT4) {
        store_int4(x, d, hinv, b);
        return;
    }
    const float limit = kind == KV_INT8 ? 127.0f : kind == KV_E4M3 ? 448.0f : 57344.0f;
    const float amax = row_amax(x, d);
    /* the scale is stored as bf16: quantize with the stored value, so reading is exact */
    const bf16 s16 = f32_to_bf16(amax / limit);
    const float s = bf16_to_f32(s16);
    for (int64_t i = 0; i < d; i++) {
        float r = s > 0.0f ? x[i] / s : 0.0f;
        r = r > limit ? limit : r < -limit ? -limit : r;
        b[i] = kind == KV_INT8 ? (uint8_t)(int8_t)nearbyintf(r) : kind == KV_E4M3 ? f32_to_fp8(r, 3, 7, limit)
                                                                                  : f32_to_fp8(r, 2, 15, limit);
    }
    memcpy(b + d, &s16, 2);
}
