/* The paged KV cache's row formats (kernels.h KV_*): a row of bf16 values, or of 8-bit ones
 * (int8, fp8 e4m3 or e5m2) held rotated (hadamard_rotate) with a bf16 scale after them; the
 * rope kernel writes rows (kv_store_row), decode attention reads them (kv_widen_row). */
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

/* the scale written after an 8-bit row's d values */
static inline float row_scale(const uint8_t *b, int64_t scale_at) {
    bf16 s16;
    memcpy(&s16, b + scale_at, 2);
    return bf16_to_f32(s16);
}

void kv_widen_row(const void *row, int kind, int64_t d, int64_t scale_at, float *out) {
    const uint8_t *b = row;
    if (kind == KV_BF16) {
        widen_row(row, d, out, d);
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

void kv_store_row(float *x, int kind, int64_t d, void *row) {
    uint8_t *b = row;
    if (kind == KV_BF16) {
        for (int64_t i = 0; i < d; i++) ((bf16 *)row)[i] = f32_to_bf16(x[i]);
        return;
    }
    hadamard_rotate(x, d);
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
