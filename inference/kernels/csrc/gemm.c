/* bf16 CPU kernels for the engine's linear layers, MoE layers, decode attention, RMSNorm and
 * rotary embeddings, written once against simd.h and compiled per instruction set (AVX2,
 * AVX-512). Loaded through ctypes by inference/kernels/cpu.py.
 *
 * Weights are prepacked once at load (cpu_kernels.pack_weight) into the layout these loops
 * read: an [N, K] matrix becomes blocks of 16 output columns; block j holds, for each pair of
 * inputs (2kp, 2kp+1), the 16 columns' two values side by side: one 64-byte row of 32-bit
 * words per input pair, rows in input order. A vector load thus gives 8 or 16 columns' pair,
 * widened to float32 by a shift and a mask, and one weight load serves every token of the
 * step (register blocking over rows). The last N % 16 columns form a narrower block of the
 * same shape. K is padded to even with a zero. AMX tiles read the same layout as their B
 * operand (amx.c).
 *
 * Activations are widened to float32 once per call; all arithmetic is float32; results are
 * rounded to bf16 (nearest even) exactly where the reference's bf16 ops round.
 *
 * This file: the packed layout's products (register tiles, AMX hand-off) and the linear layers;
 * moe.c, attention.c, norm_rope.c and layer.c hold the other kernels.
 *
 * Threads: OpenMP, compiled with -fopenmp; the soname libgomp.so.1 resolves to the runtime
 * torch has loaded, so these loops share torch's thread pool. Scratch memory comes from one
 * region that grows and is reused across calls (a fresh 64 MB buffer per prefill layer would
 * cost its page faults every time); calls are serialised by its lock.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(MS_AVX512)
#define MR 8 /* rows per register tile: MR x 16 float32 accumulators */
#else
#define MR 4
#endif
#define L2_ROWS_BYTES (192 * 1024) /* float32 activation rows kept in L2 per chunk */
#define PREFETCH 1024        /* bytes ahead in a weight stream (one-row products) */
#define TILE_ROWS 256       /* rows of float32 results per block_gemm call (16 KB on the stack) */

/* ---- packed blocks ------------------------------------------------------------------- */

/* Block j of a packed [N, K] weight, as a full 16-column block: the narrow last block is
 * copied into `pad` (Kp * 16 bf16) with zero columns. `*cols` gets its real width. */
const bf16 *weight_block(const bf16 *w, int64_t N, int64_t Kp, int64_t j, bf16 *pad, int64_t *cols) {
    const int64_t full = N / BLOCK;
    if (j < full) {
        *cols = BLOCK;
        return w + j * BLOCK * Kp;
    }
    const int64_t t = N - full * BLOCK;
    const uint32_t *src = (const uint32_t *)(w + full * BLOCK * Kp);
    uint32_t *dst = (uint32_t *)pad;
    for (int64_t kp = 0; kp < Kp / 2; kp++)
        for (int64_t c = 0; c < BLOCK; c++) dst[kp * BLOCK + c] = c < t ? src[kp * t + c] : 0;
    *cols = t;
    return pad;
}

/* ---- register tiles ------------------------------------------------------------------ */

/* C[m][0..16) = sum_k A[m][k] B[k][.] for m < rows (rows <= MR): A float32 rows (stride lda,
 * Kp columns), B one packed block. Every weight vector loaded serves all rows. The even
 * inputs of a pair, then the odd ones: only one half of the pair is live in registers at a
 * time (8% faster than both at once on a Zen CPU with AVX2: 62-64 against 57-59 GFLOP/s). */
static inline __attribute__((always_inline)) void tile(const int rows, const float *A, int64_t lda,
                                                       const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    vf acc[MR][VPB];
#pragma GCC unroll 16
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 4
        for (int v = 0; v < VPB; v++) acc[m][v] = vf_zero();
    for (int64_t kp = 0; kp < Kp / 2; kp++) {
        const bf16 *b = B + kp * 2 * BLOCK;
        for (int half = 0; half < 2; half++) {
            vf wv[VPB];
#pragma GCC unroll 4
            for (int v = 0; v < VPB; v++) {
                const vi raw = vi_load(b + v * 2 * VL);
                wv[v] = half ? vi_as_vf(vi_and(raw, vi_set1((int32_t)0xffff0000u))) : vi_as_vf(vi_slli(raw, 16));
            }
#pragma GCC unroll 16
            for (int m = 0; m < rows; m++) {
                const vf a = vf_set1(A[m * lda + 2 * kp + half]);
#pragma GCC unroll 4
                for (int v = 0; v < VPB; v++) acc[m][v] = vf_fma(wv[v], a, acc[m][v]);
            }
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 4
        for (int v = 0; v < VPB; v++) vf_store(C + m * ldc + v * VL, acc[m][v]);
}

/* One row (matrix-vector products stream the weights once: bound by memory). Independent
 * accumulators for even and odd inputs and U pairs per iteration keep 8 FMA chains in
 * flight, so FMA latency does not cap the streaming rate. */
#define U (4 / VPB)
static inline void tile1(const float *A, const bf16 *B, int64_t Kp, float *C) {
    vf acc[2 * U][VPB];
    for (int s = 0; s < 2 * U; s++)
        for (int v = 0; v < VPB; v++) acc[s][v] = vf_zero();
    const int64_t pairs = Kp / 2;
    int64_t kp = 0;
    for (; kp + U <= pairs; kp += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            const bf16 *b = B + (kp + u) * 2 * BLOCK;
            _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);
            const vf a0 = vf_set1(A[2 * (kp + u)]), a1 = vf_set1(A[2 * (kp + u) + 1]);
#pragma GCC unroll 4
            for (int v = 0; v < VPB; v++) {
                vf e, o;
                vf_load_pairs(b + v * 2 * VL, &e, &o);
                acc[2 * u][v] = vf_fma(e, a0, acc[2 * u][v]);
                acc[2 * u + 1][v] = vf_fma(o, a1, acc[2 * u + 1][v]);
            }
        }
    }
    for (; kp < pairs; kp++) {
        const bf16 *b = B + kp * 2 * BLOCK;
        const vf a0 = vf_set1(A[2 * kp]), a1 = vf_set1(A[2 * kp + 1]);
        for (int v = 0; v < VPB; v++) {
            vf e, o;
            vf_load_pairs(b + v * 2 * VL, &e, &o);
            acc[0][v] = vf_fma(e, a0, acc[0][v]);
            acc[1][v] = vf_fma(o, a1, acc[1][v]);
        }
    }
    for (int v = 0; v < VPB; v++) {
        vf s = acc[0][v];
        for (int i = 1; i < 2 * U; i++) s = vf_add(s, acc[i][v]);
        vf_store(C + v * VL, s);
    }
}

#if defined(MS_AVX512_BF16)
/* The same products on vdpbf16ps (AVX512-BF16), which multiplies the packed pairs as they are
 * by each row's pair of inputs (A as bf16 rows, the pair broadcast) and accumulates in
 * float32: twice the products per instruction of the widened FMA tiles, for CPUs that run it
 * at full rate (AMD Zen 4 and later). CPUs with AMX get the avx512 build instead: the Xeons
 * we measured issue vdpbf16ps every other cycle, slower than FMAs on widened weights. */
#define MR16 12
static inline vf dot_pairs(vf acc, vi w, const bf16 *a) {
    int32_t pair;
    memcpy(&pair, a, 4);
    const vi x = _mm512_set1_epi32(pair);
    __m512bh wb, xb;
    memcpy(&wb, &w, 64);
    memcpy(&xb, &x, 64);
    return _mm512_dpbf16_ps(acc, wb, xb);
}

static inline __attribute__((always_inline)) void tile_bf16(const int rows, const bf16 *A, int64_t lda,
                                                            const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    vf acc[MR16];
#pragma GCC unroll 16
    for (int m = 0; m < rows; m++) acc[m] = vf_zero();
    for (int64_t kp = 0; kp < Kp / 2; kp++) {
        const vi w = vi_load(B + kp * 2 * BLOCK);
#pragma GCC unroll 16
        for (int m = 0; m < rows; m++) acc[m] = dot_pairs(acc[m], w, A + m * lda + 2 * kp);
    }
#pragma GCC unroll 16
    for (int m = 0; m < rows; m++) vf_store(C + m * ldc, acc[m]);
}

/* one row: four accumulators over consecutive pairs keep the dot products' latency hidden */
static inline void tile1_bf16(const bf16 *A, const bf16 *B, int64_t Kp, float *C) {
    vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    const int64_t pairs = Kp / 2;
    int64_t kp = 0;
    for (; kp + 4 <= pairs; kp += 4) {
        _mm_prefetch((const char *)(B + kp * 2 * BLOCK) + PREFETCH, _MM_HINT_T0);
        for (int u = 0; u < 4; u++) acc[u] = dot_pairs(acc[u], vi_load(B + (kp + u) * 2 * BLOCK), A + 2 * (kp + u));
    }
    for (; kp < pairs; kp++) acc[0] = dot_pairs(acc[0], vi_load(B + kp * 2 * BLOCK), A + 2 * kp);
    vf_store(C, vf_add(vf_add(acc[0], acc[1]), vf_add(acc[2], acc[3])));
}

/* C for any number of rows, in tiles of MR16 rows */
static void block_gemm_bf16(const bf16 *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    for (int64_t m0 = 0; m0 < rows; m0 += MR16) {
        const bf16 *a = A + m0 * lda;
        float *c = C + m0 * ldc;
        switch (rows - m0 < MR16 ? rows - m0 : MR16) {
        case 1: tile1_bf16(a, B, Kp, c); break;
        case 2: tile_bf16(2, a, lda, B, Kp, c, ldc); break;
        case 3: tile_bf16(3, a, lda, B, Kp, c, ldc); break;
        case 4: tile_bf16(4, a, lda, B, Kp, c, ldc); break;
        case 5: tile_bf16(5, a, lda, B, Kp, c, ldc); break;
        case 6: tile_bf16(6, a, lda, B, Kp, c, ldc); break;
        case 7: tile_bf16(7, a, lda, B, Kp, c, ldc); break;
        case 8: tile_bf16(8, a, lda, B, Kp, c, ldc); break;
        case 9: tile_bf16(9, a, lda, B, Kp, c, ldc); break;
        case 10: tile_bf16(10, a, lda, B, Kp, c, ldc); break;
        case 11: tile_bf16(11, a, lda, B, Kp, c, ldc); break;
        case 12: tile_bf16(12, a, lda, B, Kp, c, ldc); break;
        }
    }
}
#endif

/* Whether the register tiles read bf16 rows (the AVX512-BF16 build) rather than float32. */
int tiles_read_bf16(void) {
#if defined(MS_AVX512_BF16)
    return 1;
#else
    return 0;
#endif
}

/* AMX (amx.c), set by cpu_kernels.enable where the CPU has it: C = A B for a block and a group
 * of rows, A as bf16. Used from AMX_MIN_ROWS rows (a tile multiply costs the same for 4 rows
 * as for 16) when the inputs fill whole tiles. */
typedef void (*amx_fn)(const bf16 *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc);
static amx_fn amx_block;
static void (*amx_call_begins)(void); /* amx.c's ms_amx_new_call */
#define AMX_MIN_ROWS 4

void ms_set_amx(void *block, void *new_call) {
    amx_block = (amx_fn)block;
    amx_call_begins = (void (*)(void))new_call;
}

void amx_new_call(void) {
    if (amx_call_begins) amx_call_begins();
}

static inline int amx_takes(int64_t rows, int64_t Kp) { return amx_block && rows >= AMX_MIN_ROWS && Kp % 32 == 0; }

int amx_enabled(void) { return amx_block != NULL; }

/* C[m][0..16) for m < rows, any number of rows: on AMX when it takes them, else in register
 * tiles of MR rows. A: the rows as float32 (stride lda); A16: as bf16 (stride lda16, Kp
 * columns), which AMX and the AVX512-BF16 tiles read (NULL where neither is used). */
void block_gemm(const float *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc,
                       const bf16 *A16, int64_t lda16) {
    if (A16 && amx_takes(rows, Kp)) {
        amx_block(A16, lda16, rows, B, Kp, C, ldc);
        return;
    }
#if defined(MS_AVX512_BF16)
    block_gemm_bf16(A16, lda16, rows, B, Kp, C, ldc);
    return;
#endif
    if (rows == 1) {
        tile1(A, B, Kp, C);
        return;
    }
    for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const float *a = A + m0 * lda;
        float *c = C + m0 * ldc;
        switch (rows - m0 < MR ? rows - m0 : MR) {
        case 1: tile1(a, B, Kp, c); break;
        case 2: tile(2, a, lda, B, Kp, c, ldc); break;
        case 3: tile(3, a, lda, B, Kp, c, ldc); break;
        case 4: tile(4, a, lda, B, Kp, c, ldc); break;
#if MR > 4
        case 5: tile(5, a, lda, B, Kp, c, ldc); break;
        case 6: tile(6, a, lda, B, Kp, c, ldc); break;
        case 7: tile(7, a, lda, B, Kp, c, ldc); break;
        case 8: tile(8, a, lda, B, Kp, c, ldc); break;
#endif
        }
    }
}

/* One row of 16 float32 results (+ bias) -> `cols` bf16. */
static inline void store_row(const float *c, int64_t cols, const bf16 *bias, bf16 *out) {
    if (cols == BLOCK && !bias) {
        for (int v = 0; v < VPB; v++) vf_store_bf16(out + v * VL, vf_load(c + v * VL));
        return;
    }
    for (int64_t n = 0; n < cols; n++) out[n] = f32_to_bf16(c[n] + (bias ? bf16_to_f32(bias[n]) : 0.0f));
}

/* Rows per chunk so a chunk's float32 activations stay in L2 while the weight blocks pass. */
int64_t chunk_rows(int64_t Kp) {
    int64_t rows = L2_ROWS_BYTES / (Kp * (int64_t)sizeof(float));
    rows = rows / MR * MR;
    return rows < MR ? MR : rows;
}


/* ---- linear layers ------------------------------------------------------------------- */

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
    const int wide = !need8 && (w->kind != W_BF16 || !tiles_read_bf16()); /* FMA tiles read float32 rows */
    const int narrow = rows_need_b16(w, K);      /* AMX and vdpbf16ps read bf16 rows */
    const int copy = narrow && K != Kp;          /* which need a zero-padded copy for odd K */
    const size_t a_bytes = wide ? round64((size_t)batch * M * Kp * sizeof(float)) : 0;
    const size_t c_bytes = copy ? round64((size_t)batch * M * Kp * sizeof(bf16)) : 0;
    const size_t q_bytes = need8 ? round64((size_t)batch * M * Kq) + round64((size_t)batch * M * sizeof(float)) : 0;
    const size_t pad = round64(pad_bytes(K));
    const int64_t step = need8 ? 2 : 1, steps = (blocks + step - 1) / step; /* int8 blocks go in pairs */
    region_enter();
    char *scratch = region_alloc(a_bytes + c_bytes + q_bytes + (size_t)nthreads * pad);
    if (!scratch) {
        region_leave();
        return -1;
    }
    float *A = wide ? (float *)scratch : NULL;
    bf16 *X16 = copy ? (bf16 *)(scratch + a_bytes) : NULL;
    int8_t *Q = need8 ? (int8_t *)(scratch + a_bytes + c_bytes) : NULL;
    float *S = need8 ? (float *)(scratch + a_bytes + c_bytes + round64((size_t)batch * M * Kq)) : NULL;
#pragma omp parallel num_threads(nthreads) if (batch * M * N * K > 65536)
    {
        void *tpad = scratch + a_bytes + c_bytes + q_bytes + (size_t)omp_get_thread_num() * pad;
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
                    widen_row(row, K, row32, K);
                    quantize_row_s8(row32, K, Q + (i * M + m) * Kq, Kq, S + i * M + m);
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
                        Q ? Q + i * M * Kq : NULL, Kq, S ? S + i * M : NULL,
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
