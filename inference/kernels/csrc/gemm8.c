/* Products of packed 8-bit blocks (int8, fp8 e4m3) and the quantizer of int8 products'
 * activation rows. wmat.c's wblock_gemm hands 8-bit weights here (wblock8_gemm); the KV
 * cache's 8-bit rows are kv_rows.c's, the Hadamard rotation hadamard.c's.
 *
 * int8 weights (W8A8): the weights' rows were rotated at load (quant.py); activation rows
 * are rotated alike (hadamard_rotate) and quantized symmetrically (scale amax / 127) per group
 * of ACT_GROUP inputs (llama.cpp's Q8_0 blocks; or per row where groups are off,
 * rows_s8_group), multiplied in integers: each group's exact int32 sums (at most 32 * 127 *
 * 127 = 516,128 in magnitude: exact in float32 too) times the row's group scale, added up in
 * order by FMAs (one scale a row: the row's exact sums times its scale), then the column's
 * scale. The integer products of a block run, best first: AMX int8 tiles (amx.c, from 4 rows
 * with whole tiles), VNNI's vpdpbusd (int8_vnni.c), or AVX2/AVX512BW vpmaddubsw on |w| and
 * the activation carrying w's sign (here, every build; a pair's sum at most 2 * 127 * 127 =
 * 32,258, below int16's saturation): the same integers and floats on every CPU.
 *
 * fp8 weights run weight-only on the CPU: each weight widened to float32 in registers (shift
 * and mask, the exponent rebias folded into the scale) times its group's scale, float32 FMAs
 * with the widened activations; products of many rows dequantize the block to bf16 once and
 * take the bf16 tiles (AMX where the CPU has it).
 */
#include <string.h>

#include "kernels.h"

#if defined(MS_AVX512)
#define MR8 8 /* rows per register tile of the int8 and fp8 products */
#else
#define MR8 4
#endif
#define DEQUANT_MIN_ROWS 16 /* fp8: from this many rows, dequantize the block to bf16 once */

/* ---- packed 8-bit blocks ----------------------------------------------------------- */

/* Block j of a packed 8-bit [N, K] weight as a full 16-column block (the narrow last one
 * copied into pad, Kq * 16 bytes, zero columns); *cols its real width. */
static const uint8_t *weight_block8(const uint8_t *w, int64_t N, int64_t Kq, int64_t j, uint8_t *pad, int64_t *cols) {
    const int64_t full = N / BLOCK;
    if (j < full) {
        *cols = BLOCK;
        return w + j * BLOCK * Kq;
    }
    const int64_t t = N - full * BLOCK;
    const uint32_t *src = (const uint32_t *)(w + full * BLOCK * Kq);
    uint32_t *dst = (uint32_t *)pad;
    for (int64_t kq = 0; kq < Kq / 4; kq++)
        for (int64_t c = 0; c < BLOCK; c++) dst[kq * BLOCK + c] = c < t ? src[kq * t + c] : 0;
    *cols = t;
    return pad;
}

/* block j's 16 column sums of a packed int8 [N, K] */
static inline const int32_t *block_colsum(const wmat *w, int64_t j) { return w->colsum + j * BLOCK; }

/* ---- int8 x int8 ------------------------------------------------------------------- */

/* rows x quads [q0, q1) of one block without VNNI, added into the exact int32 sums: vpmaddubsw
 * on |w| and x carrying w's sign (simd.h vi_dot4) */
static inline __attribute__((always_inline)) void int8_quads(const int rows, const int8_t *A, int64_t lda,
                                                             const int8_t *B, int64_t q0, int64_t q1,
                                                             vi sums[MR8][VPB]) {
    for (int64_t kq = q0; kq < q1; kq++) {
        vi w[VPB], wa[VPB];
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) {
            w[v] = vi_load(B + kq * 4 * BLOCK + v * 4 * VL);
            wa[v] = vi_abs8(w[v]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            int32_t x4;
            memcpy(&x4, A + m * lda + 4 * kq, 4);
            const vi x = vi_set1(x4);
#pragma GCC unroll 2
            for (int v = 0; v < VPB; v++) sums[m][v] = vi_dot4(sums[m][v], wa[v], w[v], x);
        }
    }
}

/* rows x one block without VNNI, the exact int32 sums stored */
static inline __attribute__((always_inline)) void int8_tile(const int rows, const int8_t *A, int64_t lda,
                                                            const int8_t *B, int64_t Kq, int32_t *C, int64_t ldc) {
    vi acc[MR8][VPB];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) acc[m][v] = vi_set1(0);
    int8_quads(rows, A, lda, B, 0, Kq / 4, acc);
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) vi_store(C + m * ldc + v * VL, acc[m][v]);
}

/* rows x one block with a scale per ACT_GROUP inputs (int8g_fn): each group's exact sums
 * (int8_quads), then acc = fma(float(sums), the row's group scale, acc) */
#define GROUP_QUADS (ACT_GROUP / 4)
static inline __attribute__((always_inline)) void int8_tile_grouped(const int rows, const int8_t *A, int64_t lda,
                                                                    const int8_t *B, int64_t Kq, const float *sa,
                                                                    int64_t lds, float *C, int64_t ldc) {
    vf acc[MR8][VPB];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) acc[m][v] = vf_zero();
    for (int64_t q0 = 0, g = 0; q0 < Kq / 4; q0 += GROUP_QUADS, g++) {
        const int64_t q1 = q0 + GROUP_QUADS < Kq / 4 ? q0 + GROUP_QUADS : Kq / 4;
        vi sums[MR8][VPB];
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
            for (int v = 0; v < VPB; v++) sums[m][v] = vi_set1(0);
        int8_quads(rows, A, lda, B, q0, q1, sums);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            const vf s = vf_set1(sa[m * lds + g]);
#pragma GCC unroll 2
            for (int v = 0; v < VPB; v++) acc[m][v] = vf_fma(vi_to_vf(sums[m][v]), s, acc[m][v]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) vf_store(C + m * ldc + v * VL, acc[m][v]);
}

void int8_block_grouped(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const float *sa, int64_t lds,
                        const int8_job *jobs, int64_t count, int64_t ldc) {
    if (int8g_amx && rows >= 4 && Kq % ACT_GROUP == 0) {
        int8g_amx(A, lda, rows, Kq, sa, lds, jobs, count, ldc);
        return;
    }
    if (int8g_vnni) {
        int8g_vnni(A, lda, rows, Kq, sa, lds, jobs, count, ldc);
        return;
    }
    for (int64_t b = 0; b < count; b++)
        for (int64_t m0 = 0; m0 < rows; m0 += MR8) {
            const int8_t *a = A + m0 * lda, *B = jobs[b].B;
            const float *s = sa + m0 * lds;
            float *c = (float *)jobs[b].C + m0 * ldc;
            switch (rows - m0 < MR8 ? rows - m0 : MR8) {
            case 1: int8_tile_grouped(1, a, lda, B, Kq, s, lds, c, ldc); break;
            case 2: int8_tile_grouped(2, a, lda, B, Kq, s, lds, c, ldc); break;
            case 3: int8_tile_grouped(3, a, lda, B, Kq, s, lds, c, ldc); break;
            case 4: int8_tile_grouped(4, a, lda, B, Kq, s, lds, c, ldc); break;
#if MR8 > 4
            case 5: int8_tile_grouped(5, a, lda, B, Kq, s, lds, c, ldc); break;
            case 6: int8_tile_grouped(6, a, lda, B, Kq, s, lds, c, ldc); break;
            case 7: int8_tile_grouped(7, a, lda, B, Kq, s, lds, c, ldc); break;
            case 8: int8_tile_grouped(8, a, lda, B, Kq, s, lds, c, ldc); break;
#endif
            }
        }
}

void int8_block(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const int8_job *jobs, int64_t count,
                int64_t ldc) {
    if (int8_amx && rows >= 4 && Kq % 64 == 0) {
        int8_amx(A, lda, rows, Kq, jobs, count, ldc);
        return;
    }
    if (int8_vnni) {
        int8_vnni(A, lda, rows, Kq, jobs, count, ldc);
        return;
    }
    for (int64_t b = 0; b < count; b++)
        for (int64_t m0 = 0; m0 < rows; m0 += MR8) {
            const int8_t *a = A + m0 * lda, *B = jobs[b].B;
            int32_t *c = jobs[b].C + m0 * ldc;
            switch (rows - m0 < MR8 ? rows - m0 : MR8) {
            case 1: int8_tile(1, a, lda, B, Kq, c, ldc); break;
            case 2: int8_tile(2, a, lda, B, Kq, c, ldc); break;
            case 3: int8_tile(3, a, lda, B, Kq, c, ldc); break;
            case 4: int8_tile(4, a, lda, B, Kq, c, ldc); break;
#if MR8 > 4
            case 5: int8_tile(5, a, lda, B, Kq, c, ldc); break;
            case 6: int8_tile(6, a, lda, B, Kq, c, ldc); break;
            case 7: int8_tile(7, a, lda, B, Kq, c, ldc); break;
            case 8: int8_tile(8, a, lda, B, Kq, c, ldc); break;
#endif
            }
        }
}

/* x[0..n) -> q (symmetric int8, one scale: amax / 127) */
static float quantize_span_s8(const float *x, int64_t n, int8_t *q) {
    const float amax = row_amax(x, n);
    int64_t k;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const vf vinv = vf_set1(inv), lim = vf_set1(127.0f), neg = vf_set1(-127.0f);
    for (k = 0; k + VL <= n; k += VL) /* cvtps2dq rounds to nearest even, as nearbyintf */
        vi_store_s8(q + k, vf_to_vi(vf_max(vf_min(vf_mul(vf_load(x + k), vinv), lim), neg)));
    for (; k < n; k++) {
        float r = nearbyintf(x[k] * inv);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[k] = (int8_t)r;
    }
    return amax / 127.0f;
}

void quantize_row_s8(float *x, int64_t K, int8_t *q, int64_t Kq, float *scale, int rotate, int64_t group) {
    if (rotate) hadamard_rotate(x, K);
    const int64_t span = group ? group : K;
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += span, g++) scale[g] = quantize_span_s8(x + k0, K - k0 < span ? K - k0 : span, q + k0);
    if (K == 0) scale[0] = 0.0f;
    for (int64_t k = K; k < Kq; k++) q[k] = 0;
}

void s8_group_sums(const int8_t *q, int64_t K, int64_t group, int32_t *sums) {
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        const int64_t k1 = k0 + group < K ? k0 + group : K;
        int32_t total = 0;
        for (int64_t k = k0; k < k1; k++) total += q[k];
        sums[g] = total;
    }
}

/* ---- fp8 weight-only ----------------------------------------------------------------- */

/* rows x one fp8 block: weights widened in registers (3 instructions a vector), float32 FMAs
 * with the widened rows (their K inputs: not read past them, into the block's padding); the
 * scale (and the exponent rebias) multiplies each group's sums once, not every weight (sc:
 * the block's scales per group, 16 each, times 2^120). */
static inline __attribute__((always_inline)) void fp8_tile(const int rows, const float *A, int64_t lda,
                                                           const uint8_t *B, int64_t K, const float *sc,
                                                           int64_t group, float *C, int64_t ldc) {
    const int64_t Kq = quad(K);
    vf acc[MR8][VPB], part[MR8][VPB];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) acc[m][v] = part[m][v] = vf_zero();
    for (int64_t k0 = 0; k0 < Kq; k0 += group) {
        const int64_t k1 = k0 + group < Kq ? k0 + group : Kq;
        for (int64_t kq = k0 / 4; kq < k1 / 4; kq++) {
            vi raw[VPB];
#pragma GCC unroll 2
            for (int v = 0; v < VPB; v++) raw[v] = vi_load(B + kq * 4 * BLOCK + v * 4 * VL);
            const int inputs = 4 * kq + 4 <= K ? 4 : (int)(K - 4 * kq);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                if (i == inputs) break;
                vf w[VPB];
#pragma GCC unroll 2
                for (int v = 0; v < VPB; v++) w[v] = vf_from_e4m3_raw(raw[v], i);
#pragma GCC unroll 8
                for (int m = 0; m < rows; m++) {
                    const vf a = vf_set1(A[m * lda + 4 * kq + i]);
#pragma GCC unroll 2
                    for (int v = 0; v < VPB; v++) part[m][v] = vf_fma(w[v], a, part[m][v]);
                }
            }
        }
        const float *s = sc + (k0 / group) * BLOCK;
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
            for (int v = 0; v < VPB; v++) {
                acc[m][v] = vf_fma(part[m][v], vf_load(s + v * VL), acc[m][v]);
                part[m][v] = vf_zero();
            }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) vf_store(C + m * ldc + v * VL, acc[m][v]);
}

static void fp8_gemm(const float *A, int64_t lda, int64_t rows, const uint8_t *B, int64_t K, const float *sc,
                     int64_t group, float *C, int64_t ldc) {
    for (int64_t m0 = 0; m0 < rows; m0 += MR8) {
        const float *a = A + m0 * lda;
        float *c = C + m0 * ldc;
        switch (rows - m0 < MR8 ? rows - m0 : MR8) {
        case 1: fp8_tile(1, a, lda, B, K, sc, group, c, ldc); break;
        case 2: fp8_tile(2, a, lda, B, K, sc, group, c, ldc); break;
        case 3: fp8_tile(3, a, lda, B, K, sc, group, c, ldc); break;
        case 4: fp8_tile(4, a, lda, B, K, sc, group, c, ldc); break;
#if MR8 > 4
        case 5: fp8_tile(5, a, lda, B, K, sc, group, c, ldc); break;
        case 6: fp8_tile(6, a, lda, B, K, sc, group, c, ldc); break;
        case 7: fp8_tile(7, a, lda, B, K, sc, group, c, ldc); break;
        case 8: fp8_tile(8, a, lda, B, K, sc, group, c, ldc); break;
#endif
        }
    }
}

/* an fp8 block -> the bf16 pairs layout of the same 16 columns (Kp = even(K) inputs), each
 * weight rounded to bf16 once, so products of many rows run on the bf16 tiles: a quad row
 * of bytes becomes two pair rows, (input 4kq, 4kq + 1) and (4kq + 2, 4kq + 3) */
static void dequantize_block(const uint8_t *B, int64_t Kp, const float *sc, int64_t group, bf16 *out) {
    const vi high = vi_set1((int32_t)0xffff0000u);
    for (int64_t kq = 0; kq < (Kp + 3) / 4; kq++) {
        const float *s = sc + (4 * kq / group) * BLOCK;
        for (int v = 0; v < VPB; v++) {
            const vi raw = vi_load(B + kq * 4 * BLOCK + v * 4 * VL);
            const vf scale = vf_load(s + v * VL);
            for (int pair = 0; pair < 2 && 4 * kq + 2 * pair < Kp; pair++) {
                const vi even = vf_as_vi(vf_round_bf16(vf_mul(vf_from_e4m3_raw(raw, 2 * pair), scale)));
                const vi odd = vf_as_vi(vf_round_bf16(vf_mul(vf_from_e4m3_raw(raw, 2 * pair + 1), scale)));
                vi_store(out + (2 * kq + pair) * 2 * BLOCK + v * 2 * VL, vi_or(vi_and(odd, high), vi_srli(even, 16)));
            }
        }
    }
}

/* ---- the products of a block ---------------------------------------------------------- */

/* int8 blocks js[0..count) of w (jobs: their data, sums and results, the results' memory
 * taking the integer sums first) times rows [m0, m0 + rows) of a: each row's exact sums times
 * its activation scale, then each column's weight scale */
static void int8_blocks(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K,
                        const int8_job *jobs, const int64_t *js, int64_t count, int64_t ldc) {
    const int grouped = a->lds > 1; /* else one scale a row (or one group: the same floats) */
    if (grouped)
        int8_block_grouped(a->s8 + m0 * a->ld8, a->ld8, rows, quad(K), a->s8_scale + m0 * a->lds, a->lds, jobs, count,
                           ldc);
    else
        int8_block(a->s8 + m0 * a->ld8, a->ld8, rows, quad(K), jobs, count, ldc);
    const float *sa = a->s8_scale + m0;
    for (int64_t b = 0; b < count; b++) {
        const int64_t n0 = js[b] * BLOCK, nc = N - n0 < BLOCK ? N - n0 : BLOCK;
        float narrow_scale[BLOCK] = {0};
        const float *ws = w->scale + n0;
        if (nc < BLOCK) {
            memcpy(narrow_scale, ws, nc * sizeof(float));
            ws = narrow_scale;
        }
        int32_t *sums = jobs[b].C;
        float *C = (float *)sums; /* vector loads and stores: no aliasing between the two views */
        for (int64_t m = 0; m < rows; m++) {
            if (grouped) { /* the groups' scaled sums, times the column's scale */
                for (int v = 0; v < VPB; v++)
                    vf_store(C + m * ldc + v * VL, vf_mul(vf_load(C + m * ldc + v * VL), vf_load(ws + v * VL)));
                continue;
            }
            const vf s = vf_set1(sa[m]);
            for (int v = 0; v < VPB; v++) {
                const vf exact = vi_to_vf(vi_load(sums + m * ldc + v * VL));
                vf_store(C + m * ldc + v * VL, vf_mul(vf_mul(exact, s), vf_load(ws + v * VL)));
            }
        }
    }
}

/* wblock_gemm (wmat.c) for an 8-bit weight: block j (the narrow last one copied into the pad)
 * times rows [m0, m0 + rows) of a, scaled. pad (pad_bytes(K), wmat.c): the narrow block, a
 * dequantized bf16 block, the block's scales per group (fp8). */
void wblock8_gemm(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j,
                  void *pad, float *C, int64_t ldc, int64_t *cols) {
    const int64_t Kq = quad(K), groups = (K + w->group - 1) / w->group;
    uint8_t *narrow = pad;
    bf16 *deq = (bf16 *)((char *)pad + round64((size_t)Kq * BLOCK));
    float *sc = (float *)((char *)deq + round64((size_t)Kq * BLOCK * sizeof(bf16)));
    const uint8_t *B = weight_block8(w->data, N, Kq, j, narrow, cols);
    const int64_t n0 = j * BLOCK, nc = *cols;
    if (w->kind == W_INT8) {
        const int8_job job = {(const int8_t *)B, block_colsum(w, j), (int32_t *)C};
        int8_blocks(a, m0, rows, w, N, K, &job, &j, 1, ldc);
        return;
    }
    /* fp8: the block's scales (times the exponent rebias) per group, zero past its width */
    const int64_t needed = (Kq - 1) / w->group + 1; /* groups the block's inputs (padding too) fall in */
    for (int64_t g = 0; g < needed; g++) { /* padding inputs (zero weights) take the last group's */
        const int64_t src = g < groups ? g : groups - 1;
        for (int64_t c = 0; c < BLOCK; c++) sc[g * BLOCK + c] = c < nc ? w->scale[src * N + n0 + c] * E4M3_UNBIAS : 0.0f;
    }
    if (rows >= DEQUANT_MIN_ROWS) {
        const int64_t Kp = even(K);
        dequantize_block(B, Kp, sc, w->group, deq);
        block_gemm(a->f32 ? a->f32 + m0 * a->ld32 : NULL, a->ld32, rows, deq, Kp, C, ldc,
                   a->b16 ? a->b16 + m0 * a->ld16 : NULL, a->ld16);
        return;
    }
    fp8_gemm(a->f32 + m0 * a->ld32, a->ld32, rows, B, K, sc, w->group, C, ldc);
}

/* wblock_gemm_pair (wmat.c) for an int8 weight: full blocks j1 and j2 in one pass over the rows */
void wblock8_gemm_pair(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j1,
                       int64_t j2, float *C1, float *C2, int64_t ldc) {
    const int64_t Kq = quad(K), js[2] = {j1, j2};
    const int8_job jobs[2] = {
        {(const int8_t *)w->data + j1 * BLOCK * Kq, block_colsum(w, j1), (int32_t *)C1},
        {(const int8_t *)w->data + j2 * BLOCK * Kq, block_colsum(w, j2), (int32_t *)C2},
    };
    int8_blocks(a, m0, rows, w, N, K, jobs, js, 2, ldc);
}
