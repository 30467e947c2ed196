/* The linear layers (see ms_linear): the rows prepared once in the forms the weight's products
 * read, then every block of the weight (wmat.c) times chunks of rows, rounded to bf16. */
#include <omp.h>
#include <string.h>

#include "kernels.h"

#define TILE_ROWS 256 /* rows of float32 results per block_gemm call (16 KB on the stack) */

/* One row of 16 float32 results (+ bias) -> `cols` bf16. */
static inline void store_row(const float *c, int64_t cols, const bf16 *bias, bf16 *out) {
    if (cols == BLOCK && !bias) {
        for (int v = 0; v < VPB; v++) vf_store_bf16(out + v * VL, vf_load(c + v * VL));
        return;
    }
    for (int64_t n = 0; n < cols; n++) out[n] = f32_to_bf16(c[n] + (bias ? bf16_to_f32(bias[n]) : 0.0f));
}

/* y[M, N] = x[M, K] W^T (+ bias), rounded to bf16, for `batch` independent products (MLA's
 * per-head projections; 1 for a linear layer): product i reads x + i * x_bs (rows at stride
 * ldx), W + i * w_bs (packed bf16; 8-bit weights take batch 1) and writes y + i * y_bs (rows
 * at stride ldy). The rows are prepared once in the forms the weight's products read
 * (widened, bf16, quantized to int8). Returns -1 when scratch memory cannot be had, -3 for a
 * batch of 8-bit products. */
int ms_linear(const bf16 *x, int64_t x_bs, int64_t ldx, int64_t M, int64_t K, const wmat *w, int64_t w_bs,
              int64_t N, const bf16 *bias, bf16 *y, int64_t y_bs, int64_t ldy, int64_t batch, int nthreads) {
    if (batch > 1 && w->kind != W_BF16) return -3;
    const int64_t Kp = even(K), Kq = quad(K), blocks = (N + BLOCK - 1) / BLOCK;
    const int64_t rows = chunk_rows(Kp) < M ? chunk_rows(Kp) : M, chunks = (M + rows - 1) / rows;
    const int need8 = rows_need_s8(w);
    const int64_t group8 = rows_s8_group(w), lds = s8_scales(group8, K); /* activation scales a row */
    const int wide = !need8 && (w->kind != W_BF16 || !tiles_read_bf16()); /* FMA tiles read float32 rows */
    const int narrow = rows_need_b16(w, K);      /* AMX and vdpbf16ps read bf16 rows */
    const int copy = narrow && K != Kp;          /* which need a zero-padded copy for odd K */
    const size_t a_bytes = wide ? round64((size_t)batch * M * Kp * sizeof(float)) : 0;
    const size_t c_bytes = copy ? round64((size_t)batch * M * Kp * sizeof(bf16)) : 0;
    const size_t q_bytes = need8 ? round64((size_t)batch * M * Kq) + round64((size_t)batch * M * lds * sizeof(float)) : 0;
    /* 4-bit weights: each int8 row's group sums, taken once here rather than per block */
    const int64_t gs = four_bit(w) ? (K + w->group - 1) / w->group : 0;
    const size_t g_bytes = round64((size_t)batch * M * gs * sizeof(int32_t));
    const size_t pad = round64(pad_bytes(K));
    const int64_t step = need8 ? 2 : 1, steps = (blocks + step - 1) / step; /* int8 blocks go in pairs */
    region_enter();
    char *scratch = region_alloc(a_bytes + c_bytes + q_bytes + g_bytes + (size_t)nthreads * pad);
    if (!scratch) {
        region_leave();
        return -1;
    }
    float *A = wide ? (float *)scratch : NULL;
    bf16 *X16 = copy ? (bf16 *)(scratch + a_bytes) : NULL;
    int8_t *Q = need8 ? (int8_t *)(scratch + a_bytes + c_bytes) : NULL;
    float *S = need8 ? (float *)(scratch + a_bytes + c_bytes + round64((size_t)batch * M * Kq)) : NULL;
    int32_t *Gs = gs ? (int32_t *)(scratch + a_bytes + c_bytes + q_bytes) : NULL;
#pragma omp parallel num_threads(nthreads) if (batch * M * N * K > 65536)
    {
        void *tpad = scratch + a_bytes + c_bytes + q_bytes + g_bytes + (size_t)omp_get_thread_num() * pad;
        float C[TILE_ROWS * BLOCK], C2[TILE_ROWS * BLOCK];
        /* a row widened (and rotated) for quantizing: the pad is free here */
        float *row32 = need8 ? (float *)tpad : NULL;
#pragma omp for collapse(2) schedule(static)
        for (int64_t i = 0; i < batch; i++)
            for (int64_t m = 0; m < M; m++) {
                const bf16 *row = x + i * x_bs + m * ldx;
                if (A) widen_row(row, K, A + (i * M + m) * Kp, Kp);
                if (X16) {
                    memcpy(X16 + (i * M + m) * Kp, row, K * sizeof(bf16));
                    X16[(i * M + m) * Kp + K] = 0;
                }
                if (Q) {
                    widen_row_for(w, row, K, row32); /* (act-order: gathered) */
                    quantize_row_s8(row32, K, Q + (i * M + m) * Kq, Kq, S + (i * M + m) * lds, rows_rotate(w), group8);
                    if (Gs) s8_group_sums(Q + (i * M + m) * Kq, K, w->group, Gs + (i * M + m) * gs);
                }
            }
#pragma omp for collapse(3) schedule(static)
        for (int64_t i = 0; i < batch; i++)
            for (int64_t ch = 0; ch < chunks; ch++)
                for (int64_t jj = 0; jj < steps; jj++) {
                    wmat wi = *w;
                    if (i) wi.data = (const bf16 *)w->data + i * w_bs;
                    const rows_t r = {
                        A ? A + i * M * Kp : NULL, Kp,
                        X16 ? X16 + i * M * Kp : narrow ? x + i * x_bs : NULL, X16 ? Kp : ldx,
                        Q ? Q + i * M * Kq : NULL, Kq, S ? S + i * M * lds : NULL, lds,
                        Gs ? Gs + i * M * gs : NULL, gs ? w->group : 0,
                    };
                    const int64_t j0 = jj * step, j1 = j0 + step < blocks ? j0 + step : blocks;
                    const int64_t end = (ch + 1) * rows < M ? (ch + 1) * rows : M;
                    for (int64_t m0 = ch * rows; m0 < end; m0 += TILE_ROWS) {
                        const int64_t m1 = m0 + TILE_ROWS < end ? m0 + TILE_ROWS : end;
                        int64_t cols = BLOCK;
                        if (j1 - j0 == 2 && j1 * BLOCK <= N) {
                            wblock_gemm_pair(&r, m0, m1 - m0, &wi, N, K, j0, j0 + 1, tpad, C, C2, BLOCK);
                            for (int64_t m = m0; m < m1; m++) {
                                bf16 *out = y + i * y_bs + m * ldy + j0 * BLOCK;
                                store_row(C + (m - m0) * BLOCK, BLOCK, bias ? bias + j0 * BLOCK : NULL, out);
                                store_row(C2 + (m - m0) * BLOCK, BLOCK, bias ? bias + (j0 + 1) * BLOCK : NULL, out + BLOCK);
                            }
                            continue;
                        }
                        for (int64_t j = j0; j < j1; j++) {
                            wblock_gemm(&r, m0, m1 - m0, &wi, N, K, j, tpad, C, BLOCK, &cols);
                            for (int64_t m = m0; m < m1; m++)
                                store_row(C + (m - m0) * BLOCK, cols, bias ? bias + j * BLOCK : NULL,
                                          y + i * y_bs + m * ldy + j * BLOCK);
                        }
                    }
                }
    }
    region_leave();
    return 0;
}
