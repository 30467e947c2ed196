/* A packed weight of any kind (kernels.h wmat: bf16, int8, fp8, int4 or mxfp4): the products of
 * its blocks every kernel calls (wblock_gemm, wblock_gemm_pair), dispatched on the weight's kind
 * to the bf16 products (gemm.c), the 8-bit ones (gemm8.c) or the 4-bit ones (int4.c's, through
 * hooks.c's int4_wblock: wblock4_gemm, wblock4_pair), the scratch they need, the
 * forms of activation rows they read, and one expert of a stacked weight. */
#include "kernels.h"

wmat wmat_expert(const wmat *w, int64_t e, int64_t N, int64_t K) {
    wmat x = *w;
    if (w->kind == W_BF16) {
        x.data = (const bf16 *)w->data + e * N * even(K);
        return x;
    }
    const int64_t groups = (K + w->group - 1) / w->group;
    x.data = (const uint8_t *)w->data + e * N * (four_bit(w) ? ((K + 7) & ~(int64_t)7) / 2 : quad(K));
    x.scale = w->scale + e * groups * N;
    x.zero = w->zero ? w->zero + e * groups * N : NULL;
    x.colsum = w->colsum ? w->colsum + e * ((N + BLOCK - 1) / BLOCK) * BLOCK : NULL;
    x.perm = w->perm ? w->perm + e * K : NULL;
    return x;
}

/* scratch per thread for wblock_gemm: a narrow 8-bit block, a dequantized bf16 block, the
 * block's scales per group (fp8; gemm8.c's wblock8_gemm lays these out; 4-bit weights use the
 * narrow block's part only), a narrow bf16 block (weight_block) */
size_t pad_bytes(int64_t K) {
    const int64_t Kq = quad(K);
    return round64((size_t)Kq * BLOCK) + round64((size_t)Kq * BLOCK * sizeof(bf16)) +
           round64((size_t)(Kq / 4 + 1) * BLOCK * sizeof(float)) + round64((size_t)even(K) * BLOCK * sizeof(bf16));
}

int rows_need_b16(const wmat *w, int64_t K) {
    (void)K;
    return w->kind != W_INT8 && !four_bit(w) && (tiles_read_bf16() || amx_enabled());
}

int rows_need_s8(const wmat *w) { return w->kind == W_INT8 || four_bit(w); }

/* int8 weights' activation scales per ACT_GROUP inputs (1) or one a row (0); cpu_kernels.enable
 * sets it from quant.INT8_ACT_GROUP */
static int int8_act_grouped;
void ms_set_int8_act_group(int group) { int8_act_grouped = group != 0; }

int64_t rows_s8_group(const wmat *w) { return w->kind == W_INT8 && int8_act_grouped ? ACT_GROUP : 0; }

int rows_rotate(const wmat *w) { return !(four_bit(w) && w->plain); }

/* rows m0.. of a's group sums where they are w's groups' (rows_t gsum), else NULL */
static const int32_t *group_sums_for(const rows_t *a, int64_t m0, const wmat *w, int64_t K) {
    return a->gsum && a->gsum_group == w->group ? a->gsum + m0 * ((K + w->group - 1) / w->group) : NULL;
}

/* block j of a 4-bit weight (int4, mxfp4; K a multiple of 8) times rows [m0, m0 + rows) of
 * a's int8 rows, scaled (4-bit weights' rows carry one scale each: rows_s8_group 0), on
 * int4.c's products, which read the weight's scales and zero points in place; the narrow
 * last block widened to 16 columns in pad (octets * 64 bytes fit pad_bytes(K)'s first part) */
static void wblock4_gemm(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j,
                         uint8_t *pad, float *C, int64_t ldc, int64_t *cols) {
    const int64_t octets = K / 8, full = N / BLOCK;
    const uint8_t *B = (const uint8_t *)w->data + j * BLOCK * 4 * octets;
    *cols = j < full ? BLOCK : N - full * BLOCK;
    if (*cols < BLOCK) { /* [octets][cols][4] -> [octets][16][4], zero columns */
        memset(pad, 0, (size_t)(octets * 64));
        for (int64_t o = 0; o < octets; o++) memcpy(pad + o * 64, B + o * *cols * 4, (size_t)(*cols * 4));
        B = pad;
    }
    int4_wblock(a->s8 + m0 * a->ld8, a->ld8, a->s8_scale + m0, group_sums_for(a, m0, w, K), rows, octets, w->group / 8, N,
                w->kind == W_MXFP4, B,
                w->scale + j * BLOCK, w->zero ? w->zero + j * BLOCK : NULL, *cols, C, NULL, NULL, NULL, NULL, ldc);
}

/* blocks j1 and j2 of a 4-bit weight: two full ones in one call (one row's in one pass) */
static void wblock4_pair(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j1,
                         int64_t j2, uint8_t *pad, float *C1, float *C2, int64_t ldc) {
    int64_t cols;
    if ((j1 + 1) * BLOCK > N || (j2 + 1) * BLOCK > N) {
        wblock4_gemm(a, m0, rows, w, N, K, j1, pad, C1, ldc, &cols);
        wblock4_gemm(a, m0, rows, w, N, K, j2, pad, C2, ldc, &cols);
        return;
    }
    const int64_t octets = K / 8;
    const uint8_t *data = w->data;
    int4_wblock(a->s8 + m0 * a->ld8, a->ld8, a->s8_scale + m0, group_sums_for(a, m0, w, K), rows, octets,
                w->group / 8, N, w->kind == W_MXFP4, data + j1 * BLOCK * 4 * octets, w->scale + j1 * BLOCK, w->zero ? w->zero + j1 * BLOCK : NULL, BLOCK,
                C1, data + j2 * BLOCK * 4 * octets, w->scale + j2 * BLOCK, w->zero ? w->zero + j2 * BLOCK : NULL, C2,
                ldc);
}

void wblock_gemm(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j,
                 void *pad, float *C, int64_t ldc, int64_t *cols) {
    if (four_bit(w)) {
        wblock4_gemm(a, m0, rows, w, N, K, j, pad, C, ldc, cols);
        return;
    }
    if (w->kind == W_BF16) {
        const int64_t Kp = even(K);
        const bf16 *B = weight_block(w->data, N, Kp, j, pad, cols);
        block_gemm(a->f32 ? a->f32 + m0 * a->ld32 : NULL, a->ld32, rows, B, Kp, C, ldc,
                   a->b16 ? a->b16 + m0 * a->ld16 : NULL, a->ld16);
        return;
    }
    wblock8_gemm(a, m0, rows, w, N, K, j, pad, C, ldc, cols);
}

void wblock_gemm_pair(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j1,
                      int64_t j2, void *pad, float *C1, float *C2, int64_t ldc) {
    if (four_bit(w)) {
        wblock4_pair(a, m0, rows, w, N, K, j1, j2, pad, C1, C2, ldc);
        return;
    }
    if (w->kind != W_INT8) {
        int64_t cols;
        wblock_gemm(a, m0, rows, w, N, K, j1, pad, C1, ldc, &cols);
        wblock_gemm(a, m0, rows, w, N, K, j2, pad, C2, ldc, &cols);
        return;
    }
    wblock8_gemm_pair(a, m0, rows, w, N, K, j1, j2, C1, C2, ldc);
}
