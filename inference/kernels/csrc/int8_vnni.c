/* The integer products of int8 weight blocks on VNNI (vpdpbusd: unsigned bytes times signed
 * bytes, four products summed into each 32-bit lane per instruction, a quarter of the
 * instructions of vpmaddubsw's sequence). Built as a library of its own, with -mavx512vnni
 * (on the AVX-512 build's flags) or -mavxvnni (on AVX2's), and loaded only where the CPU
 * reports the extension; gemm8.c calls it through the pointer cpu_kernels.enable sets.
 *
 * vpdpbusd wants one operand unsigned: the activations' signed bytes plus 128 (a flip of the
 * top bit), and the extra 128 * (the column's sum of weights) taken off at the end, so the
 * sums are the exact signed ones every other int8 path gives. With an activation scale per
 * ACT_GROUP (32) inputs (ms_int8_vnni_grouped), each group's sums are made exact the same way,
 * the group's column sums counted on the way (vpdpbusd of bytes of 1 and the weights, once a
 * weight vector for all the rows): a biased group sum is at most 32 * 255 * 127 = 1,036,320
 * in magnitude and the exact one 32 * 127 * 127 = 516,128, both exact in int32 and the second
 * in float32; then acc = fma(float(sum), scale, acc), group by group, as gemm8.c's
 * vpmaddubsw path does, so the floats are the same. With -DMS_SIMDE the
 * AVX-512 source compiles against SIMDe's portable intrinsics (tests on CPUs without it).
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define BLOCK 16
#define VPB (BLOCK / VL)
#if defined(MS_AVX512)
#define MR 8
static inline vi dpbusd(vi acc, vi u8, vi s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#else
#define MR 4
#if defined(MS_SIMDE)
static inline vi dpbusd(vi acc, vi u8, vi s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#else
static inline vi dpbusd(vi acc, vi u8, vi s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#endif
#endif

/* the four bytes at a, each + 128, in every lane: a broadcast load and a vector xor with
 * flip (the top bits). flip is opaque to the compiler, which would otherwise fold the xor into
 * the scalar before the broadcast: a load, an xor and a move from a general register, three
 * times the work where the products are bound by the instructions issued (8 rows). */
static inline vi unsigned_quad(const int8_t *a, vi flip) {
    int32_t x4;
    memcpy(&x4, a, 4);
    return vi_xor(vi_set1(x4), flip);
}

static inline vi top_bits(void) {
    vi flip = vi_set1((int32_t)0x80808080u);
#if !defined(MS_SIMDE) /* SIMDe's emulated AVX-512 vectors are structs, in no register */
    __asm__("" : "+v"(flip));
#endif
    return flip;
}

/* the exact signed sums: acc - 128 * the column sums */
static inline void store_exact(int32_t *c, const vi acc[VPB], const int32_t *colsum) {
    for (int v = 0; v < VPB; v++) vi_store(c + v * VL, vi_sub(acc[v], vi_slli(vi_load(colsum + v * VL), 7)));
}

static inline __attribute__((always_inline)) void tile(const int rows, const int8_t *A, int64_t lda, const int8_t *B,
                                                       int64_t Kq, const int32_t *colsum, int32_t *C, int64_t ldc) {
    vi acc[MR][VPB];
    const vi flip = top_bits();
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < VPB; v++) acc[m][v] = vi_set1(0);
    for (int64_t kq = 0; kq < Kq / 4; kq++) {
        vi w[VPB];
        for (int v = 0; v < VPB; v++) w[v] = vi_load(B + kq * 4 * BLOCK + v * 4 * VL);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            const vi x = unsigned_quad(A + m * lda + 4 * kq, flip);
            for (int v = 0; v < VPB; v++) acc[m][v] = dpbusd(acc[m][v], x, w[v]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) store_exact(C + m * ldc, acc[m], colsum);
}

/* one row: two accumulators over alternate quads hide vpdpbusd's latency; the weights
 * stream once (bound by memory) */
static void row1(const int8_t *A, const int8_t *B, int64_t Kq, const int32_t *colsum, int32_t *C) {
    vi acc[2][VPB];
    const vi flip = top_bits();
    for (int v = 0; v < VPB; v++) acc[0][v] = acc[1][v] = vi_set1(0);
    const int64_t quads = Kq / 4;
    int64_t kq = 0;
    for (; kq + 2 <= quads; kq += 2) {
        _mm_prefetch((const char *)(B + kq * 4 * BLOCK) + 1024, _MM_HINT_T0);
        for (int u = 0; u < 2; u++) {
            const vi x = unsigned_quad(A + 4 * (kq + u), flip);
            for (int v = 0; v < VPB; v++) acc[u][v] = dpbusd(acc[u][v], x, vi_load(B + (kq + u) * 4 * BLOCK + v * 4 * VL));
        }
    }
    for (; kq < quads; kq++) {
        const vi x = unsigned_quad(A + 4 * kq, flip);
        for (int v = 0; v < VPB; v++) acc[0][v] = dpbusd(acc[0][v], x, vi_load(B + kq * 4 * BLOCK + v * 4 * VL));
    }
    for (int v = 0; v < VPB; v++) acc[0][v] = vi_add(acc[0][v], acc[1][v]);
    store_exact(C, acc[0], colsum);
}

/* 32 inputs a scale (kernels.h ACT_GROUP: this library has no other header of the kernels) */
#define GROUP_QUADS 8

/* rows x one block with a scale per GROUP_QUADS quads (sa[m * lds + g]): C[m] (float32) */
static inline __attribute__((always_inline)) void tile_grouped(const int rows, const int8_t *A, int64_t lda,
                                                               const int8_t *B, int64_t Kq, const float *sa,
                                                               int64_t lds, float *C, int64_t ldc) {
    vf acc[MR][VPB];
    const vi ones = vi_set1(0x01010101), flip = top_bits();
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < VPB; v++) acc[m][v] = vf_zero();
    for (int64_t q0 = 0, g = 0; q0 < Kq / 4; q0 += GROUP_QUADS, g++) {
        const int64_t q1 = q0 + GROUP_QUADS < Kq / 4 ? q0 + GROUP_QUADS : Kq / 4;
        vi sums[MR][VPB], wsum[VPB];
        for (int v = 0; v < VPB; v++) wsum[v] = vi_set1(0);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < VPB; v++) sums[m][v] = vi_set1(0);
        for (int64_t kq = q0; kq < q1; kq++) {
            vi w[VPB];
            for (int v = 0; v < VPB; v++) {
                w[v] = vi_load(B + kq * 4 * BLOCK + v * 4 * VL);
                wsum[v] = dpbusd(wsum[v], ones, w[v]); /* the group's column sums */
            }
#pragma GCC unroll 8
            for (int m = 0; m < rows; m++) {
                const vi x = unsigned_quad(A + m * lda + 4 * kq, flip);
                for (int v = 0; v < VPB; v++) sums[m][v] = dpbusd(sums[m][v], x, w[v]);
            }
        }
        for (int v = 0; v < VPB; v++) wsum[v] = vi_slli(wsum[v], 7);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            const vf s = vf_set1(sa[m * lds + g]);
            for (int v = 0; v < VPB; v++) acc[m][v] = vf_fma(vi_to_vf(vi_sub(sums[m][v], wsum[v])), s, acc[m][v]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < VPB; v++) vf_store(C + m * ldc + v * VL, acc[m][v]);
}

/* the int8_fn of kernels.h (its int8_job, repeated here: this library has no other header
 * of the kernels) */
typedef struct {
    const int8_t *B;
    const int32_t *colsum;
    int32_t *C;
} int8_job;

void ms_int8_vnni_block(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const int8_job *jobs, int64_t count,
                        int64_t ldc) {
    for (int64_t b = 0; b < count; b++)
        for (int64_t m0 = 0; m0 < rows; m0 += MR) {
            const int8_t *a = A + m0 * lda, *B = jobs[b].B;
            const int32_t *colsum = jobs[b].colsum;
            int32_t *c = jobs[b].C + m0 * ldc;
            switch (rows - m0 < MR ? rows - m0 : MR) {
            case 1: row1(a, B, Kq, colsum, c); break;
            case 2: tile(2, a, lda, B, Kq, colsum, c, ldc); break;
            case 3: tile(3, a, lda, B, Kq, colsum, c, ldc); break;
            case 4: tile(4, a, lda, B, Kq, colsum, c, ldc); break;
#if MR > 4
            case 5: tile(5, a, lda, B, Kq, colsum, c, ldc); break;
            case 6: tile(6, a, lda, B, Kq, colsum, c, ldc); break;
            case 7: tile(7, a, lda, B, Kq, colsum, c, ldc); break;
            case 8: tile(8, a, lda, B, Kq, colsum, c, ldc); break;
#endif
            }
        }
}

/* kernels.h's int8g_fn: the products with a scale per 32 inputs, float32 into each job's C */
void ms_int8_vnni_grouped(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const float *sa, int64_t lds,
                          const int8_job *jobs, int64_t count, int64_t ldc) {
    for (int64_t b = 0; b < count; b++)
        for (int64_t m0 = 0; m0 < rows; m0 += MR) {
            const int8_t *a = A + m0 * lda, *B = jobs[b].B;
            const float *s = sa + m0 * lds;
            float *c = (float *)jobs[b].C + m0 * ldc;
            switch (rows - m0 < MR ? rows - m0 : MR) {
            case 1: tile_grouped(1, a, lda, B, Kq, s, lds, c, ldc); break;
            case 2: tile_grouped(2, a, lda, B, Kq, s, lds, c, ldc); break;
            case 3: tile_grouped(3, a, lda, B, Kq, s, lds, c, ldc); break;
            case 4: tile_grouped(4, a, lda, B, Kq, s, lds, c, ldc); break;
#if MR > 4
            case 5: tile_grouped(5, a, lda, B, Kq, s, lds, c, ldc); break;
            case 6: tile_grouped(6, a, lda, B, Kq, s, lds, c, ldc); break;
            case 7: tile_grouped(7, a, lda, B, Kq, s, lds, c, ldc); break;
            case 8: tile_grouped(8, a, lda, B, Kq, s, lds, c, ldc); break;
#endif
            }
        }
}
