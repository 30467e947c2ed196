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
 * This file: the products of packed bf16 blocks (register tiles, the hand-off to AMX) and
 * nothing else; kernels.h lists the other files and what each holds (linear.c: the linear
 * layers; wmat.c: the products of a weight of any kind; moe.c, attention.c, norm_rope.c,
 * layer.c: the other kernels).
 *
 * Threads: OpenMP, compiled with -fopenmp; the soname libgomp.so.1 resolves to the runtime
 * torch has loaded, so these loops share torch's thread pool. Scratch memory comes from one
 * region that grows and is reused across calls (a fresh 64 MB buffer per prefill layer would
 * cost its page faults every time); calls are serialised by its lock.
 */
#include <string.h>

#include "kernels.h"

#if defined(MS_AVX512)
#define MR 8 /* rows per register tile: MR x 16 float32 accumulators */
#else
#define MR 4
#endif
#define L2_ROWS_BYTES (192 * 1024) /* float32 activation rows kept in L2 per chunk */
#define PREFETCH 1024        /* bytes ahead in a weight stream (one-row products) */

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

#if defined(MS_AVX512)
/* Two rows, each row's arithmetic exactly tile1's (the same chains over the same inputs,
 * summed in the same order), one weight load serving both: batch invariance (a row rounds as
 * alone) without reloading and re-widening the weights for every row. Two rows' 16 chains
 * fill AVX-512's registers; AVX2's 16 would spill them, so there each row takes tile1. */
static inline __attribute__((always_inline)) void tile1_rows(const int rows, const float *A, int64_t lda,
                                                             const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    vf acc[2][2 * U][VPB];
    for (int m = 0; m < rows; m++)
        for (int s = 0; s < 2 * U; s++)
            for (int v = 0; v < VPB; v++) acc[m][s][v] = vf_zero();
    const int64_t pairs = Kp / 2;
    int64_t kp = 0;
    for (; kp + U <= pairs; kp += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            const bf16 *b = B + (kp + u) * 2 * BLOCK;
            _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int v = 0; v < VPB; v++) {
                vf e, o;
                vf_load_pairs(b + v * 2 * VL, &e, &o);
#pragma GCC unroll 2
                for (int m = 0; m < rows; m++) {
                    acc[m][2 * u][v] = vf_fma(e, vf_set1(A[m * lda + 2 * (kp + u)]), acc[m][2 * u][v]);
                    acc[m][2 * u + 1][v] = vf_fma(o, vf_set1(A[m * lda + 2 * (kp + u) + 1]), acc[m][2 * u + 1][v]);
                }
            }
        }
    }
    for (; kp < pairs; kp++) {
        const bf16 *b = B + kp * 2 * BLOCK;
        for (int v = 0; v < VPB; v++) {
            vf e, o;
            vf_load_pairs(b + v * 2 * VL, &e, &o);
            for (int m = 0; m < rows; m++) {
                acc[m][0][v] = vf_fma(e, vf_set1(A[m * lda + 2 * kp]), acc[m][0][v]);
                acc[m][1][v] = vf_fma(o, vf_set1(A[m * lda + 2 * kp + 1]), acc[m][1][v]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < VPB; v++) {
            vf s = acc[m][0][v];
            for (int i = 1; i < 2 * U; i++) s = vf_add(s, acc[m][i][v]);
            vf_store(C + m * ldc + v * VL, s);
        }
}
#endif

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

/* Up to six rows, each row's arithmetic exactly tile1_bf16's (the same four chains over the
 * same pairs, summed in the same order), one weight load serving every row: batch invariance
 * (a row rounds as alone) at nearly the shared tiles' cost. Each row taking tile1_bf16 in turn
 * made a speculating engine's k + 1 verified rows cost 1.9x a decode step at k = 4 on the
 * demo MoE, against 1.4x with shared tiles (CPU time, one thread, AMD EPYC). */
static inline __attribute__((always_inline)) void tile1_rows_bf16(const int rows, const bf16 *A, int64_t lda,
                                                                  const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    vf acc[6][4]; /* 24 of the 32 registers */
#pragma GCC unroll 6
    for (int m = 0; m < rows; m++)
        for (int u = 0; u < 4; u++) acc[m][u] = vf_zero();
    const int64_t pairs = Kp / 2;
    int64_t kp = 0;
    for (; kp + 4 <= pairs; kp += 4) {
        _mm_prefetch((const char *)(B + kp * 2 * BLOCK) + PREFETCH, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            const vi w = vi_load(B + (kp + u) * 2 * BLOCK);
#pragma GCC unroll 6
            for (int m = 0; m < rows; m++) acc[m][u] = dot_pairs(acc[m][u], w, A + m * lda + 2 * (kp + u));
        }
    }
    for (; kp < pairs; kp++) {
        const vi w = vi_load(B + kp * 2 * BLOCK);
#pragma GCC unroll 6
        for (int m = 0; m < rows; m++) acc[m][0] = dot_pairs(acc[m][0], w, A + m * lda + 2 * kp);
    }
#pragma GCC unroll 6
    for (int m = 0; m < rows; m++)
        vf_store(C + m * ldc, vf_add(vf_add(acc[m][0], acc[m][1]), vf_add(acc[m][2], acc[m][3])));
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

/* AMX (amx.c, its product in hooks.c's amx_block where the CPU has it): used from
 * AMX_MIN_ROWS rows (a tile multiply costs the same for 4 rows as for 16) when the inputs fill
 * whole tiles. */
#define AMX_MIN_ROWS 4

/* Batch invariance, on while an engine speculates (ms_set_batch_invariant; 0 rows: off): up
 * to that many rows (decode steps), each row takes the one-row tile alone, so a row rounds the
 * same in any batch: speculative verification's k + 1 rows of a sequence give the bits of its
 * plain decode steps (greedy output identical with and without drafts). Off, rows share
 * register tiles and AMX takes them from AMX_MIN_ROWS, which round otherwise. */
static int64_t invariant_rows;
void ms_set_batch_invariant(int rows) { invariant_rows = rows; }

static inline int amx_takes(int64_t rows, int64_t Kp) {
    return amx_block && rows >= AMX_MIN_ROWS && rows > invariant_rows && Kp % 32 == 0;
}

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
    if (rows <= invariant_rows) {
        for (int64_t m = 0; m < rows; m += 6) {
            const bf16 *a = A16 + m * lda16;
            float *c = C + m * ldc;
            switch (rows - m < 6 ? rows - m : 6) {
            case 1: tile1_bf16(a, B, Kp, c); break;
            case 2: tile1_rows_bf16(2, a, lda16, B, Kp, c, ldc); break;
            case 3: tile1_rows_bf16(3, a, lda16, B, Kp, c, ldc); break;
            case 4: tile1_rows_bf16(4, a, lda16, B, Kp, c, ldc); break;
            case 5: tile1_rows_bf16(5, a, lda16, B, Kp, c, ldc); break;
            case 6: tile1_rows_bf16(6, a, lda16, B, Kp, c, ldc); break;
            }
        }
        return;
    }
    block_gemm_bf16(A16, lda16, rows, B, Kp, C, ldc);
    return;
#endif
    if (rows <= invariant_rows) {
        int64_t m = 0;
#if defined(MS_AVX512)
        for (; m + 2 <= rows; m += 2) tile1_rows(2, A + m * lda, lda, B, Kp, C + m * ldc, ldc);
#endif
        for (; m < rows; m++) tile1(A + m * lda, B, Kp, C + m * ldc);
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

/* Rows per chunk so a chunk's float32 activations stay in L2 while the weight blocks pass. */
int64_t chunk_rows(int64_t Kp) {
    int64_t rows = L2_ROWS_BYTES / (Kp * (int64_t)sizeof(float));
    rows = rows / MR * MR;
    return rows < MR ? MR : rows;
}
