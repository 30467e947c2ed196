/* The vector operations the CPU kernels (kernels.c) are written in, for one instruction set
 * per build: AVX2 + FMA (8 float lanes) by default, AVX-512 F/BW/DQ (16 lanes) with
 * -DMS_AVX512. The kernels are compiled once per instruction set, so the same algorithm runs
 * on every x86 CPU and the one build the CPU can run is the one loaded (cpu_kernels.py).
 *
 * bf16 values are widened to float32 by a 16-bit shift and all arithmetic is float32 FMA:
 * the kernels need no AVX512-BF16 (vdpbf16ps issues only every other cycle on the Xeons we
 * measured, half the rate of float32 FMAs on widened weights) and AVX2-only CPUs run the same
 * code at half the width.
 *
 * With -DMS_SIMDE the AVX-512 build compiles against SIMDe's portable implementations of the
 * same intrinsics: the tests run that build on CPUs without AVX-512.
 */
#ifndef MS_SIMD_H
#define MS_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(MS_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#else
#include <immintrin.h>
#endif

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even; NaNs stay (quiet) NaNs */
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* float32 rounded to bf16 precision, kept as float32: the reference rounds there */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(MS_AVX512)

#define VL 16
typedef __m512 vf;
typedef __m512i vi;

/* x where w > 0, -x where w < 0, 0 where w == 0 (vpsignb, which AVX-512 lacks) */
static inline __m512i _mm512_sign_epi8_emul(__m512i x, __m512i w) {
    const __mmask64 neg = _mm512_movepi8_mask(w), zero = _mm512_cmpeq_epi8_mask(w, _mm512_setzero_si512());
    return _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vi vf_to_vi(vf a) { return _mm512_cvtps_epi32(a); }
static inline vf vi_as_vf(vi a) { return _mm512_castsi512_ps(a); }
static inline vi vf_as_vi(vf a) { return _mm512_castps_si512(a); }
static inline vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline void vi_store(void *p, vi v) { _mm512_storeu_si512(p, v); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vf vi_to_vf(vi a) { return _mm512_cvtepi32_ps(a); }
#define vi_slli(a, n) _mm512_slli_epi32((a), (n))
#define vi_srli(a, n) _mm512_srli_epi32((a), (n))
#define vi_srai(a, n) _mm512_srai_epi32((a), (n))
/* int8 products of 64-byte rows without VNNI (AVX512BW): the 16 dword lanes of w (4 signed
 * bytes each) times the same 4 signed bytes x in every lane -> lane sums, added to acc.
 * |w| (u8) times x carrying w's sign (s8): with both in [-127, 127] a pair of products is
 * at most 32258, so vpmaddubsw never saturates and the sum is exact. */
static inline vi vi_dot4(vi acc, vi w_abs, vi w, vi x) {
    const vi p16 = _mm512_maddubs_epi16(w_abs, _mm512_sign_epi8_emul(x, w));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)));
}
static inline vi vi_abs8(vi w) { return _mm512_abs_epi8(w); }
/* VL int32 in [-127, 127] -> VL int8 */
static inline void vi_store_s8(int8_t *p, vi v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(v)); }

/* a bit per lane where a > b */
static inline unsigned lanes_above(vf a, vf b) { return (unsigned)_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }

static inline float vf_hmax(vf v) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline float vf_sum(vf v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* VL bytes, each zero-extended into its 32-bit lane (through 16 bits: SIMDe lacks vpmovzxbd) */
static inline vi vi_load_u8(const void *p) {
    return _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)));
}

/* VL bf16 -> float32 */
static inline vf vf_load_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* float32 rounded to bf16 precision (nearest even; NaNs stay quiet NaNs), still float32 */
static inline vf vf_round_bf16(vf v) {
    const vi u = _mm512_castps_si512(v);
    const vi lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const vi r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const vi nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                     _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(is_nan, r, nan),
                                                _mm512_set1_epi32((int32_t)0xffff0000u)));
}

/* float32 -> VL bf16 */
static inline void vf_store_bf16(bf16 *p, vf v) {
    /* the high half of each 32-bit lane, in order, into the low 256 bits */
    const vi odd = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                    31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const vi r = _mm512_castps_si512(vf_round_bf16(v));
    _mm256_storeu_si256((__m256i *)p, _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, r)));
}

#else /* AVX2 + FMA */

#define VL 8
typedef __m256 vf;
typedef __m256i vi;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vi vf_to_vi(vf a) { return _mm256_cvtps_epi32(a); }
static inline vf vi_as_vf(vi a) { return _mm256_castsi256_ps(a); }
static inline vi vf_as_vi(vf a) { return _mm256_castps_si256(a); }
static inline vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(void *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vf vi_to_vf(vi a) { return _mm256_cvtepi32_ps(a); }
#define vi_slli(a, n) _mm256_slli_epi32((a), (n))
#define vi_srli(a, n) _mm256_srli_epi32((a), (n))
#define vi_srai(a, n) _mm256_srai_epi32((a), (n))
/* see the AVX-512 version */
static inline vi vi_dot4(vi acc, vi w_abs, vi w, vi x) {
    const vi p16 = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
static inline vi vi_abs8(vi w) { return _mm256_abs_epi8(w); }
static inline void vi_store_s8(int8_t *p, vi v) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256());
    const int32_t lo = _mm256_extract_epi32(b, 0), hi = _mm256_extract_epi32(b, 4);
    memcpy(p, &lo, 4);
    memcpy(p + 4, &hi, 4);
}

static inline unsigned lanes_above(vf a, vf b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }

static inline float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* VL bytes, each zero-extended into its 32-bit lane */
static inline vi vi_load_u8(const void *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

static inline vf vf_load_bf16(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline vf vf_round_bf16(vf v) {
    const vi u = _mm256_castps_si256(v);
    const vi lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const vi r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const vi nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const vi is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_blendv_epi8(r, nan, is_nan),
                                                _mm256_set1_epi32((int32_t)0xffff0000u)));
}

static inline void vf_store_bf16(bf16 *p, vf v) {
    const vi r = _mm256_srli_epi32(_mm256_castps_si256(vf_round_bf16(v)), 16);
    /* packus works within 128-bit lanes: [r0-3 r0-3 | r4-7 r4-7] -> r0-7 in the low lane */
    const vi packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

#endif

/* The sums of 8 vectors, out[r] = sum of the lanes of a[r]: one transposing reduction
 * instead of 8 horizontal ones. */
static inline void vf_sum8(const vf a[8], float out[8]) {
#if defined(MS_AVX512)
    __m256 h[8];
    for (int r = 0; r < 8; r++) h[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
#else
    const __m256 *h = a;
#endif
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    /* t0 lanes: sums of rows 0-3 over the low 128 bits, then over the high 128 bits */
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31)));
}

/* VL packed bf16 pairs (one 32-bit word per column: element 2k in the low half, 2k+1 in the
 * high half) -> the even and the odd elements as float32 */
static inline void vf_load_pairs(const bf16 *p, vf *even, vf *odd) {
    const vi w = vi_load(p);
    *even = vi_as_vf(vi_slli(w, 16));
    *odd = vi_as_vf(vi_and(w, vi_set1((int32_t)0xffff0000u)));
}

/* n < VL bf16 / floats, the other lanes zero; tails only */
static inline vf vf_load_bf16_n(const bf16 *p, int64_t n) {
    bf16 tmp[VL] = {0};
    memcpy(tmp, p, n * sizeof(bf16));
    return vf_load_bf16(tmp);
}

static inline void vf_store_bf16_n(bf16 *p, vf v, int64_t n) {
    bf16 tmp[VL];
    vf_store_bf16(tmp, v);
    memcpy(p, tmp, n * sizeof(bf16));
}

static inline void vf_store_n(float *p, vf v, int64_t n) {
    float tmp[VL];
    vf_store(tmp, v);
    memcpy(p, tmp, n * sizeof(float));
}

/* 8-bit values -> float32. Byte `i` of each 32-bit lane of a packed 8-bit weight row (see
 * kernels.h: 4 inputs of one column per lane) as: */
/* int8 */
#define vf_from_s8(w, i) vi_to_vf(vi_srai(vi_slli((w), 24 - 8 * (i)), 24))
/* fp8 e4m3 (OCP "fn": no infinities), times 2^-120: byte i moved to the top, an arithmetic
 * shift by 4 puts its 7 magnitude bits at float32's exponent/mantissa boundary (bits 20-26)
 * with the sign still at bit 31, and a mask clears the sign copies and the other bytes.
 * Multiplying by 2^120 (folded into the scale) rebiases the exponent, subnormals included. */
static inline vf vf_from_e4m3_raw(vi w, int i) {
    const vi top = i == 3 ? w : vi_slli(w, 24 - 8 * i);
    return vi_as_vf(vi_and(vi_srai(top, 4), vi_set1((int32_t)0x87f00000u)));
}
/* fp8 e5m2, times 2^-112 likewise (its magnitude one bit lower: a shift by 3) */
static inline vf vf_from_e5m2_raw(vi w, int i) {
    const vi top = i == 3 ? w : vi_slli(w, 24 - 8 * i);
    return vi_as_vf(vi_and(vi_srai(top, 3), vi_set1((int32_t)0x8fe00000u)));
}
#define E4M3_UNBIAS 0x1p120f
#define E5M2_UNBIAS 0x1p112f

/* One stage of a Hadamard transform inside a vector: lanes i and i ^ h (h < VL, a power of
 * two) become the low lane's value plus the high one's, and the low one's minus the high
 * one's. The partner lanes come from a permute; fma(x, -1, partner) is exactly partner - x,
 * so the floats are the scalar butterflies' (hadamard_rotate's order). */
static const int32_t butterfly_partner[4][16] = {
    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
};
static const float butterfly_sign[4][16] = {
    {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1},
    {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1},
    {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1},
    {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1},
};
static inline vf vf_butterfly(vf x, int stage /* log2 h */) {
#if defined(MS_AVX512)
    const vf partner = _mm512_permutexvar_ps(_mm512_loadu_si512(butterfly_partner[stage]), x);
#else
    const vf partner = _mm256_permutevar8x32_ps(x, _mm256_loadu_si256((const __m256i *)butterfly_partner[stage]));
#endif
    return vf_fma(x, vf_load(butterfly_sign[stage]), partner);
}

/* a * 2^n (n whole, 2^n normal): one vscalefps on AVX-512, else 2^n built in the exponent bits */
static inline vf vf_times_pow2(vf a, vf n) {
#if defined(MS_AVX512)
    return _mm512_scalef_ps(a, n);
#else
    return vf_mul(a, vi_as_vf(vi_slli(vi_add(vf_to_vi(n), vi_set1(127)), 23)));
#endif
}

/* exp(x) to ~1 ulp: Cody-Waite reduction by ln 2, Cephes' expf polynomial, times 2^n */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.3f)), vf_set1(88.3f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fma(n, vf_set1(-0.693359375f), x);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    const vf y = vf_fma(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_times_pow2(y, n); /* n is in [-126, 127] after the clamp: 2^n is a normal float */
}

#endif
