/* Products with 8-bit weights (int8, fp8 e4m3), the generic block product every kernel calls
 * (wblock_gemm: bf16, int8 or fp8 weights), and the 8-bit KV-cache row formats.
 *
 * int8 weights (W8A8): the weights' rows were rotated at load (quant.py); activation rows
 * are rotated alike (hadamard_rotate) and quantized per row (symmetric, scale amax / 127),
 * multiplied in integers, and each row's exact int32 sums scaled by its activation scale,
 * then by the column's. The integer products of a block run, best first: AMX int8 tiles
 * (amx.c, from 4 rows with whole 64-input tiles), VNNI's vpdpbusd (int8_vnni.c), or
 * AVX2/AVX512BW vpmaddubsw on |w| and the activation carrying w's sign (here, every build):
 * the same integers on every CPU, scaled in one place (int8_blocks).
 *
 * fp8 weights run weight-only on the CPU: each weight widened to float32 in registers (shift
 * and mask, the exponent rebias folded into the scale) times its group's scale, float32 FMAs
 * with the widened activations; products of many rows dequantize the block to bf16 once and
 * take the bf16 tiles (AMX where the CPU has it).
 */
#include <omp.h>
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

wmat wmat_expert(const wmat *w, int64_t e, int64_t N, int64_t K) {
    wmat x = *w;
    if (w->kind == W_BF16) {
        x.data = (const bf16 *)w->data + e * N * even(K);
        return x;
    }
    const int64_t groups = (K + w->group - 1) / w->group;
    x.data = (const uint8_t *)w->data + e * N * quad(K);
    x.scale = w->scale + e * groups * N;
    x.colsum = w->colsum ? w->colsum + e * ((N + BLOCK - 1) / BLOCK) * BLOCK : NULL;
    return x;
}

/* scratch per thread for wblock_gemm: a narrow 8-bit block, a dequantized bf16 block, the
 * block's scales per group (fp8) */
size_t pad_bytes(int64_t K) {
    const int64_t Kq = quad(K);
    return round64((size_t)Kq * BLOCK) + round64((size_t)Kq * BLOCK * sizeof(bf16)) +
           round64((size_t)(Kq / 4 + 1) * BLOCK * sizeof(float)) + round64((size_t)even(K) * BLOCK * sizeof(bf16));
}

int rows_need_b16(const wmat *w, int64_t K) {
    (void)K;
    return w->kind != W_INT8 && (tiles_read_bf16() || amx_enabled());
}

int rows_need_s8(const wmat *w) { return w->kind == W_INT8; }

/* ---- int8 x int8 ------------------------------------------------------------------- */

static int8_fn int8_vnni, int8_amx;
void ms_set_int8(void *vnni, void *amx) {
    int8_vnni = (int8_fn)vnni;
    int8_amx = (int8_fn)amx;
}
/* which integer product runs (for the start-up log line): 2 AMX, 1 VNNI, 0 vpmaddubsw */
int ms_int8_path(void) { return int8_amx ? 2 : int8_vnni ? 1 : 0; }

/* rows x one block without VNNI: vpmaddubsw on |w| and x carrying w's sign (simd.h
 * vi_dot4), the exact int32 sums stored */
static inline __attribute__((always_inline)) void int8_tile(const int rows, const int8_t *A, int64_t lda,
                                                            const int8_t *B, int64_t Kq, int32_t *C, int64_t ldc) {
    vi acc[MR8][VPB];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) acc[m][v] = vi_set1(0);
    for (int64_t kq = 0; kq < Kq / 4; kq++) {
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
            for (int v = 0; v < VPB; v++) acc[m][v] = vi_dot4(acc[m][v], wa[v], w[v], x);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 2
        for (int v = 0; v < VPB; v++) vi_store(C + m * ldc + v * VL, acc[m][v]);
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

/* the largest |x[i]|, i < n (the scale of an 8-bit row: activations and KV-cache rows) */
static float row_amax(const float *x, int64_t n) {
    vf vmax = vf_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) vmax = vf_max(vmax, vf_max(vf_load(x + i), vf_sub(vf_zero(), vf_load(x + i))));
    float amax = vf_hmax(vmax);
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

void quantize_row_s8(float *x, int64_t K, int8_t *q, int64_t Kq, float *scale) {
    hadamard_rotate(x, K);
    const float amax = row_amax(x, K);
    int64_t k;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const vf vinv = vf_set1(inv), lim = vf_set1(127.0f), neg = vf_set1(-127.0f);
    for (k = 0; k + VL <= K; k += VL) /* cvtps2dq rounds to nearest even, as nearbyintf */
        vi_store_s8(q + k, vf_to_vi(vf_max(vf_min(vf_mul(vf_load(x + k), vinv), lim), neg)));
    for (; k < K; k++) {
        float r = nearbyintf(x[k] * inv);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[k] = (int8_t)r;
    }
    for (; k < Kq; k++) q[k] = 0;
    *scale = amax / 127.0f;
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

/* ---- any weight ---------------------------------------------------------------------- */

/* int8 blocks js[0..count) of w (jobs: their data, sums and results, the results' memory
 * taking the integer sums first) times rows [m0, m0 + rows) of a: each row's exact sums times
 * its activation scale, then each column's weight scale */
static void int8_blocks(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K,
                        const int8_job *jobs, const int64_t *js, int64_t count, int64_t ldc) {
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
            const vf s = vf_set1(sa[m]);
            for (int v = 0; v < VPB; v++) {
                const vf exact = vi_to_vf(vi_load(sums + m * ldc + v * VL));
                vf_store(C + m * ldc + v * VL, vf_mul(vf_mul(exact, s), vf_load(ws + v * VL)));
            }
        }
    }
}

void wblock_gemm(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j,
                 void *pad, float *C, int64_t ldc, int64_t *cols) {
    if (w->kind == W_BF16) {
        const int64_t Kp = even(K);
        const bf16 *B = weight_block(w->data, N, Kp, j, pad, cols);
        block_gemm(a->f32 ? a->f32 + m0 * a->ld32 : NULL, a->ld32, rows, B, Kp, C, ldc,
                   a->b16 ? a->b16 + m0 * a->ld16 : NULL, a->ld16);
        return;
    }
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

void wblock_gemm_pair(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j1,
                      int64_t j2, void *pad, float *C1, float *C2, int64_t ldc) {
    if (w->kind != W_INT8) {
        int64_t cols;
        wblock_gemm(a, m0, rows, w, N, K, j1, pad, C1, ldc, &cols);
        wblock_gemm(a, m0, rows, w, N, K, j2, pad, C2, ldc, &cols);
        return;
    }
    const int64_t Kq = quad(K), js[2] = {j1, j2};
    const int8_job jobs[2] = {
        {(const int8_t *)w->data + j1 * BLOCK * Kq, block_colsum(w, j1), (int32_t *)C1},
        {(const int8_t *)w->data + j2 * BLOCK * Kq, block_colsum(w, j2), (int32_t *)C2},
    };
    int8_blocks(a, m0, rows, w, N, K, jobs, js, 2, ldc);
}

/* ---- the KV cache's 8-bit rows ------------------------------------------------------- */

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

/* stages h = VL .. n*VL/2 across the n vectors of v (n a power of two, <= 8), in registers */
static inline __attribute__((always_inline)) void cross_stages(vf *v, int n) {
    for (int s = 1; s < n; s *= 2)
        for (int i = 0; i < n; i++)
            if (!(i & s)) {
                const vf a = v[i], c = v[i + s];
                v[i] = vf_add(a, c), v[i + s] = vf_sub(a, c);
            }
}
/* Each block's butterflies in the order of hadamard.rotate, stage by stage (a value's sums come
 * out the same whichever pass makes them), in few passes over memory: first groups of up to
 * 8 vectors with every stage inside them in registers, then two stages a pass, the scale
 * folded into the last (half the time of a pass a stage: 512 values 332 -> 203 ns on AVX-512). */
void hadamard_rotate(float *x, int64_t n) {
    for (int64_t off = 0, b; off < n; off += b) {
        b = 1;
        while (2 * b <= n - off) b *= 2;
        float *y = x + off;
        const float scale = (float)(1.0 / sqrt((double)b));
        if (b < VL) {
            for (int64_t h = 1; h < b; h *= 2)
                for (int64_t i = 0; i < b; i += 2 * h)
                    for (int64_t j = i; j < i + h; j++) {
                        const float a = y[j], c = y[j + h];
                        y[j] = a + c, y[j + h] = a - c;
                    }
            for (int64_t j = 0; j < b; j++) y[j] *= scale;
            continue;
        }
        /* pass 1: groups of up to 8 vectors, every stage inside them */
        const int64_t group = b < 8 * VL ? b : 8 * VL, nv = group / VL;
        const vf vs = vf_set1(scale);
        for (int64_t g = 0; g < b; g += group) {
            vf v[8];
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                if (i < nv) {
                    v[i] = vf_load(y + g + i * VL);
                    for (int stage = 0; (1 << stage) < VL; stage++) v[i] = vf_butterfly(v[i], stage);
                }
            switch (nv) {
            case 2: cross_stages(v, 2); break;
            case 4: cross_stages(v, 4); break;
            case 8: cross_stages(v, 8); break;
            }
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                if (i < nv) vf_store(y + g + i * VL, group == b ? vf_mul(v[i], vs) : v[i]);
        }
        /* then two stages a pass (h and 2h over 4 vectors h apart), the scale in the last */
        int64_t h = group;
        for (; 4 * h <= b; h *= 4) {
            const int last = 4 * h == b;
            for (int64_t i = 0; i < b; i += 4 * h)
                for (int64_t j = i; j < i + h; j += VL) {
                    vf a0 = vf_load(y + j), a1 = vf_load(y + j + h), a2 = vf_load(y + j + 2 * h), a3 = vf_load(y + j + 3 * h);
                    vf t0 = vf_add(a0, a1), t1 = vf_sub(a0, a1), t2 = vf_add(a2, a3), t3 = vf_sub(a2, a3);
                    a0 = vf_add(t0, t2), a2 = vf_sub(t0, t2), a1 = vf_add(t1, t3), a3 = vf_sub(t1, t3);
                    if (last) a0 = vf_mul(a0, vs), a1 = vf_mul(a1, vs), a2 = vf_mul(a2, vs), a3 = vf_mul(a3, vs);
                    vf_store(y + j, a0), vf_store(y + j + h, a1), vf_store(y + j + 2 * h, a2), vf_store(y + j + 3 * h, a3);
                }
        }
        if (h < b) /* one stage left */
            for (int64_t j = 0; j < h; j += VL) {
                const vf a = vf_load(y + j), c = vf_load(y + j + h);
                vf_store(y + j, vf_mul(vf_add(a, c), vs)), vf_store(y + j + h, vf_mul(vf_sub(a, c), vs));
            }
    }
}

/* The int8 embedding's rows of ids [T] (table [V, D] int8 at row stride ld, a scale per row):
 * each dequantized, rotated back (the table is stored rotated) and rounded to bf16 into out
 * [T, D]. Returns -2 for an id outside [0, V). */
int ms_embed_int8(const int8_t *table, int64_t ld, const float *scales, int64_t V, const int64_t *ids, int64_t T,
                  int64_t D, bf16 *out, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= V) return -2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        float row[D];
        const int8_t *q = table + ids[t] * ld;
        const float scale = scales[ids[t]];
        for (int64_t i = 0; i < D; i++) row[i] = (float)q[i] * scale;
        hadamard_rotate(row, D);
        for (int64_t i = 0; i < D; i++) out[t * D + i] = f32_to_bf16(row[i]);
    }
    return 0;
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
