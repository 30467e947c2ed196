/* What the kernel sources share: the scratch region, the packed-weight geometry and the
 * products of packed blocks (gemm.c), and the exported kernels (cpu_kernels.py binds them). */
#ifndef MS_KERNELS_H
#define MS_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#define BLOCK 16         /* output columns per packed block */
#define VPB (BLOCK / VL) /* vectors per block row */

/* region.c: scratch memory, see there */
void region_enter(void);
void *region_alloc(size_t bytes);
void region_leave(void);

static inline size_t round64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }
static inline int64_t even(int64_t k) { return k + (k & 1); }

/* Rows of bf16 (stride ld, K columns) -> float32 rows of Kp columns (zero padded). */
static inline void widen_row(const bf16 *x, int64_t K, float *out, int64_t Kp) {
    int64_t k = 0;
    for (; k + VL <= K; k += VL) vf_store(out + k, vf_load_bf16(x + k));
    for (; k < K; k++) out[k] = bf16_to_f32(x[k]);
    for (; k < Kp; k++) out[k] = 0.0f;
}

/* gemm.c: block j of packed W [N, K] as a full 16-column block (the narrow last one copied into
 * pad, Kp * 16 bf16), its real width in *cols; and C[m][0..16) = rows of A times one block (A
 * float32 at stride lda; A16 the same rows as bf16 at stride lda16, or NULL, for AMX and the
 * AVX512-BF16 tiles) */
const bf16 *weight_block(const bf16 *w, int64_t N, int64_t Kp, int64_t j, bf16 *pad, int64_t *cols);
void block_gemm(const float *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc,
                const bf16 *A16, int64_t lda16);
/* gemm.c: rows per chunk so a chunk's float32 activations stay in L2 while weight blocks pass */
int64_t chunk_rows(int64_t Kp);
/* gemm.c: whether products of many rows go to AMX (cpu_kernels.enable sets it), and whether
 * the register tiles read the rows as bf16 (the AVX512-BF16 build) */
int amx_enabled(void);
int tiles_read_bf16(void);
/* moe.c: silu(gate) * up, rounded as the reference's bf16 ops round */
void swiglu_row(const float *gate, const float *up, float *out, int64_t n);

int ms_linear(const bf16 *x, int64_t x_bs, int64_t ldx, int64_t M, int64_t K, const bf16 *w, int64_t w_bs,
              int64_t N, const bf16 *bias, bf16 *y, int64_t y_bs, int64_t ldy, int64_t batch, int nthreads);
int ms_moe(const bf16 *x, int64_t ldx, int64_t T, int64_t D, const bf16 *w13, const bf16 *w2, int64_t E,
           int64_t I, const int64_t *ids, const float *weights, int64_t A, bf16 *out, int64_t ldo,
           int64_t *counts, int nthreads);
int ms_decode_attention(const bf16 *q, int64_t ldq, int64_t B, int64_t H, int64_t G,
                        const bf16 *k_cache, int64_t k_slot, int64_t k_head, int64_t dk,
                        const bf16 *v_cache, int64_t v_slot, int64_t v_head, int64_t dv,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                        int64_t block_size, float scale, bf16 *out, int64_t ldo, int nthreads);
void ms_rmsnorm(const bf16 *x, int64_t ldx, bf16 *residual, int64_t ldr, const bf16 *w, float eps,
                bf16 *out, int64_t ldo, int64_t T, int64_t D, int nthreads);
void ms_rope_cache(bf16 *qkv, int64_t ld, int64_t T, int64_t H, int64_t G, int64_t d, const bf16 *cos,
                   const bf16 *sin, const int64_t *slots, bf16 *k_cache, bf16 *v_cache, int nthreads);

#endif
