/* What the kernel sources share: the types and inline helpers every file may use, then the
 * declarations of each file's functions, one section per file, in the order of the file-level
 * call graph from the bottom up (a file calls only files of the sections above its own; the
 * test tests/inference/test_kernel_sources.py checks the graph has no cycle):
 *
 *   hooks.c      the AMX, int8 and int4 product hooks cpu.py sets, and the avx512 build's
 *                VNNI decode attention (no calls out)
 *   region.c     scratch memory                          -> hooks.c
 *   hadamard.c   the Hadamard rotation                   (no calls out)
 *   gemm.c       products of packed bf16 blocks           -> hooks.c
 *   gemm8.c      products of packed 8-bit blocks, the activation quantizer
 *                                                         -> hooks.c, gemm.c, hadamard.c
 *   wmat.c       a packed weight of any kind: its blocks' products
 *                                                         -> hooks.c, gemm.c, gemm8.c
 *   kv_rows.c    the paged KV cache's row formats         -> hadamard.c
 *   linear.c     ms_linear          -> region.c, gemm.c, gemm8.c, wmat.c
 *   moe.c        ms_moe, swiglu_row -> region.c, gemm.c, gemm8.c, wmat.c
 *   attention.c  ms_decode_attention -> hooks.c, region.c, hadamard.c, kv_rows.c
 *                (the avx512 build compiles it twice: ms_decode_attention_vnni with VNNI)
 *   prefill_attention.c  ms_prefill_attention -> region.c, hadamard.c, kv_rows.c
 *   norm_rope.c  ms_rmsnorm, ms_rope_cache -> kv_rows.c
 *   embed.c      ms_embed_int8      -> hadamard.c
 *   greedy.c     ms_greedy          (no calls out)
 *   logits.c     ms_logit_scores, ms_logprob_rows -> region.c, gemm.c, linear.c
 *   layer.c      ms_decode_step     -> region.c, linear.c, moe.c, attention.c, norm_rope.c
 *
 * cpu.py binds the exported ms_* kernels; amx.c and int8_vnni.c are libraries of their own
 * whose products hooks.c holds. */
#ifndef MS_KERNELS_H
#define MS_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

/* ==== shared types and inline helpers ================================================ */

#define BLOCK 16         /* output columns per packed block */
#define VPB (BLOCK / VL) /* vectors per block row */

/* internal state shared between the library's files, not exported */
#define MS_HIDDEN __attribute__((visibility("hidden")))

static inline size_t round64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }
static inline int64_t even(int64_t k) { return k + (k & 1); }
static inline int64_t quad(int64_t k) { return (k + 3) & ~(int64_t)3; }

/* A packed weight matrix [N, K] (cpu_kernels.pack_weight / pack_qweight), as the kernels
 * take it. bf16: blocks of 16 columns of input pairs ([Kp/2][16][2] bf16 each, Kp = K even).
 * 8-bit (int8, fp8 e4m3): blocks of 16 columns of input quads ([Kq/4][16][4] bytes each,
 * Kq = K rounded up to 4), the layout vpdpbusd and AMX's int8 tiles read; a float32 scale
 * per (group of `group` inputs, column), scale[g * N + n]; int8 weights (their rows rotated,
 * quant.py) also carry each column's sum (colsum[n], n < N rounded up to 16) for products on
 * unsigned activations (VNNI). 4-bit (W4A8: int4 levels, or mxfp4's e2m1 codes): two
 * values a byte, blocks of 16 columns of input octets ([K8/8][16][4] bytes, K8 = K rounded up
 * to 8; int4.c has the layout), scales as the 8-bit ones', int4's integer zero points per
 * (group, column) (zero[g * N + n], int8; NULL: 8, symmetric); their rows rotated as int8's
 * unless `plain` (published checkpoints: the activations are quantized unrotated). `perm`
 * (4-bit, plain, act-order GPTQ; NULL: none): column k of the weight is input perm[k], so the
 * activations are gathered into that order before they are quantized. Per-expert stacks are
 * E such matrices back to back (data, scales, sums, zeros and perms alike). */
enum { W_BF16 = 0, W_INT8 = 1, W_FP8 = 2, W_INT4 = 3, W_MXFP4 = 4 };
typedef struct {
    const void *data;
    const float *scale;
    const int32_t *colsum;
    int64_t group;
    int64_t kind;
    const int8_t *zero; /* int4: zero points [G][N], or NULL */
    int64_t plain;      /* 4-bit: the weight's rows are not rotated (nor are the activations) */
    const int32_t *perm; /* act-order: the inputs' order [K], or NULL */
} wmat;
static inline int four_bit(const wmat *w) { return w->kind == W_INT4 || w->kind == W_MXFP4; }

/* Rows of activations in the forms the products read, for rows [0, rows) of one call:
 * f32: widened (FMA tiles; stride ld32); b16: bf16 (AMX, vdpbf16ps; stride ld16, or NULL);
 * s8 + s8_scale: rotated and quantized for int8 weights (stride ld8, or NULL), lds scales a
 * row: row m's scale of inputs [ACT_GROUP g, ACT_GROUP (g + 1)) at s8_scale[m * lds + g]
 * (lds 1: one scale for the whole row). */
typedef struct {
    const float *f32;
    int64_t ld32;
    const bf16 *b16;
    int64_t ld16;
    const int8_t *s8;
    int64_t ld8;
    const float *s8_scale;
    int64_t lds;
    /* 4-bit weights: each int8 row's sums per group of gsum_group inputs (s8_group_sums), row
     * m's at gsum[m * groups]; NULL (or another group than the weight's): the products take
     * them per block */
    const int32_t *gsum;
    int64_t gsum_group;
} rows_t;

/* inputs per activation scale of int8 weights' products where groups are on
 * (cpu_kernels.int8_act_group; quant.INT8_ACT_GROUP): llama.cpp's Q8_0 block */
#define ACT_GROUP 32

/* The integer products of int8 blocks, C[m][0..16) = the exact int32 sums of row m of A
 * times each column of a block (gemm8.c's int8_blocks scales them). A: rows of signed bytes
 * (stride lda, Kq columns), multiplied by each of `count` blocks: B one packed 16-column
 * block, colsum its 16 column sums for kernels that multiply unsigned bytes, C its sums
 * (stride ldc). Blocks taken together share each load of the rows, and AMX streams two
 * blocks' weights at once. VNNI and AMX kernels live in libraries of their own (int8_vnni.c,
 * amx.c) that cpu_kernels.enable hands to hooks.c. */
typedef struct {
    const int8_t *B;
    const int32_t *colsum;
    int32_t *C;
} int8_job;
typedef void (*int8_fn)(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const int8_job *jobs, int64_t count,
                        int64_t ldc);
/* The same products with an activation scale per ACT_GROUP inputs: C (each job's, as float32)
 * [m][0..16) = sum over groups g in order of fma(float(exact int32 sum of row m's group g
 * times the column), sa[m * lds + g], acc), every path the same FMAs in the same order (so the
 * same floats); the weight's scales are the caller's. */
typedef void (*int8g_fn)(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const float *sa, int64_t lds,
                         const int8_job *jobs, int64_t count, int64_t ldc);

/* 4-bit blocks (int4.c's ms_int4_wblock, a library of its own, or on AMX amx_int4.c's
 * ms_amx_int4_wblock; wmat.c calls it): C[m][0..16) =
 * sum over groups g, in order, of float(exact sum of row m of A times the block's group g, less
 * the zero point times the row's group sum) * the group's scale, times the row's activation
 * scale sx[m], for `rows` rows of signed bytes (stride lda, 8 * octets columns); B one packed
 * 4-bit block of `octets` 64-byte rows, groups of group_octets rows; mx: its nibbles are mxfp4
 * codes (looked up; zero 12), else int4 levels. sc and zero (NULL: 8, mxfp4's 12) are the
 * block's first column of the weight's [G][N] arrays, read in place ld (N) apart; cols the
 * block's real width (the narrow last one's bytes widened to 16 columns by the caller).
 * B2 (NULL: none): a second, full block (sc2, zero2) into C2, one row's in the same pass over
 * the activations. asum: the rows' group sums [rows][groups] (s8_group_sums), or NULL: taken
 * here, per call. */
typedef void (*int4w_fn)(const int8_t *A, int64_t lda, const float *sx, const int32_t *asum, int64_t rows,
                         int64_t octets, int64_t group_octets, int64_t ld, int mx, const uint8_t *B, const float *sc,
                         const int8_t *zero, int64_t cols, float *C, const uint8_t *B2, const float *sc2,
                         const int8_t *zero2, float *C2, int64_t ldc);

/* AMX's bf16 product (amx.c): C = A B for a block and a group of rows, A as bf16. */
typedef void (*amx_fn)(const bf16 *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc);
/* ms_decode_attention's prototype: the avx512 build's second copy of it, compiled with
 * AVX512-VNNI (see attention.c's int4 rows) */
typedef int (*attention_fn)(const bf16 *q, int64_t ldq, int64_t B, int64_t H, int64_t G, int kv_kind,
                            const void *k_cache, int64_t k_slot, int64_t k_head, int64_t dk, const void *v_cache,
                            int64_t v_slot, int64_t v_head, int64_t dv, int64_t v_scale_at,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                            int64_t block_size, float scale, const float *sinks, int64_t window, bf16 *out,
                            int64_t ldo, int nthreads);

/* Rows of bf16 (stride ld, K columns) -> float32 rows of Kp columns (zero padded). */
static inline void widen_row(const bf16 *x, int64_t K, float *out, int64_t Kp) {
    int64_t k = 0;
    for (; k + VL <= K; k += VL) vf_store(out + k, vf_load_bf16(x + k));
    for (; k < K; k++) out[k] = bf16_to_f32(x[k]);
    for (; k < Kp; k++) out[k] = 0.0f;
}

/* A bf16 row -> its K values as float32 in a weight's input order (w->perm: out[k] =
 * x[perm[k]], act-order; NULL: in order). */
static inline void widen_row_for(const wmat *w, const bf16 *x, int64_t K, float *out) {
    if (!w->perm) {
        widen_row(x, K, out, K);
        return;
    }
    for (int64_t k = 0; k < K; k++) out[k] = bf16_to_f32(x[w->perm[k]]);
}

/* the largest |x[i]|, i < n (the scale of an 8-bit row: activations (gemm8.c) and KV-cache
 * rows (kv_rows.c)) */
static inline float row_amax(const float *x, int64_t n) {
    vf vmax = vf_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) vmax = vf_max(vmax, vf_max(vf_load(x + i), vf_sub(vf_zero(), vf_load(x + i))));
    float amax = vf_hmax(vmax);
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

/* ==== hooks.c: the products of the libraries of their own (amx.c, int8_vnni.c) ========= */
/* (and the avx512 build's VNNI copy of decode attention) */

/* cpu_kernels.enable sets them where the CPU has them (NULL: none); block_gemm (gemm.c) and
 * int8_block (gemm8.c) read them */
extern MS_HIDDEN amx_fn amx_block;
extern MS_HIDDEN int8_fn int8_vnni, int8_amx;
extern MS_HIDDEN int8g_fn int8g_vnni, int8g_amx; /* their grouped forms */
extern MS_HIDDEN int4w_fn int4_wblock; /* NULL: no int4 library (cpu_kernels.INT4 None) */
/* the avx512 build's decode attention on a CPU with AVX512-VNNI: its copy compiled with it
 * (ms_decode_attention_vnni), which ms_decode_attention hands every call to; else NULL */
extern MS_HIDDEN attention_fn attention_vnni;
void ms_set_amx(void *block, void *new_call);
void ms_set_int8(void *vnni, void *amx, void *vnni_grouped, void *amx_grouped);
void ms_set_int4(void *wblock);
void ms_set_attention_vnni(void *attention);
/* which integer product runs (for the start-up log line): 2 AMX, 1 VNNI, 0 vpmaddubsw */
int ms_int8_path(void);
/* whether products of many rows go to AMX */
int amx_enabled(void);
/* tells AMX an outermost call begins (the tiles' configuration from earlier calls may be
 * gone; region_enter calls it) */
void amx_new_call(void);

/* ==== region.c: scratch memory, see there ============================================= */

void region_enter(void);
void *region_alloc(size_t bytes);
void region_leave(void);

/* ==== hadamard.c ======================================================================= */

/* x[0..n) times the normalized Hadamard matrix of each power-of-two block of n, largest first
 * (576 = 512 + 64), in place; its own inverse (hadamard.py, the same floats). 8-bit KV rows
 * and int8 weights and activations are held rotated: it spreads a row's few large values
 * over all of them, and 8-bit rounding loses less. */
void hadamard_rotate(float *x, int64_t n);

/* ==== gemm.c: products of packed bf16 blocks ============================================ */

/* block j of packed W [N, K] as a full 16-column block (the narrow last one copied into pad,
 * Kp * 16 bf16), its real width in *cols; and C[m][0..16) = rows of A times one block (A
 * float32 at stride lda; A16 the same rows as bf16 at stride lda16, or NULL, for AMX and the
 * AVX512-BF16 tiles) */
const bf16 *weight_block(const bf16 *w, int64_t N, int64_t Kp, int64_t j, bf16 *pad, int64_t *cols);
void block_gemm(const float *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc,
                const bf16 *A16, int64_t lda16);
/* up to `rows` rows (0: off), each row rounds as alone in any batch (cpu.batch_invariant) */
void ms_set_batch_invariant(int rows);
/* rows per chunk so a chunk's float32 activations stay in L2 while weight blocks pass */
int64_t chunk_rows(int64_t Kp);
/* whether the register tiles read the rows as bf16 (the AVX512-BF16 build) */
int tiles_read_bf16(void);

/* ==== gemm8.c: products of packed 8-bit blocks ========================================== */

/* the exact int32 sums of rows times int8 blocks (see int8_job), on the hooks' AMX or VNNI
 * products where set, else vpmaddubsw */
void int8_block(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const int8_job *jobs, int64_t count,
                int64_t ldc);
/* the grouped products (int8g_fn) on the hooks' AMX or VNNI where set, else vpmaddubsw */
void int8_block_grouped(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const float *sa, int64_t lds,
                        const int8_job *jobs, int64_t count, int64_t ldc);
/* one row of activations for int8 / 4-bit weights: x rotated in place where `rotate`
 * (hadamard_rotate, as the weights' rows were; rows_rotate(w)), then quantized
 * symmetrically per group of `group` inputs (0: the whole row; rows_s8_group(w)),
 * q = rne(x * 127 / amax) in [-127, 127], Kq entries (zero padded), and each group's scale
 * amax / 127 (0 for a zero group) into scale[g] */
void quantize_row_s8(float *x, int64_t K, int8_t *q, int64_t Kq, float *scale, int rotate, int64_t group);
/* the sums of an int8 row's K inputs per group of `group` (the last group the rest) into
 * sums[g]: what 4-bit weights' zero points take off (rows_t gsum) */
void s8_group_sums(const int8_t *q, int64_t K, int64_t group, int32_t *sums);
/* wblock_gemm (wmat.c) for 8-bit and int4 weights (int8, fp8, int4; int4 with K a multiple
 * of 8, the rows' quantized form read up to it): C[m][0..16) = rows [m0, m0 + rows) of a
 * times block j of w, scaled; pad: pad_bytes(K) of scratch (wmat.c, its layout there) */
void wblock8_gemm(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j,
                  void *pad, float *C, int64_t ldc, int64_t *cols);
/* wblock_gemm_pair (wmat.c) for int8 weights: both full blocks j1, j2 in one pass over the rows */
void wblock8_gemm_pair(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j1,
                       int64_t j2, float *C1, float *C2, int64_t ldc);

/* ==== wmat.c: a packed weight of any kind ============================================== */

/* expert e of a stacked packed matrix [E][N, K] */
wmat wmat_expert(const wmat *w, int64_t e, int64_t N, int64_t K);
/* the forms of activations a product with w needs (see rows_t) */
int rows_need_b16(const wmat *w, int64_t K);
int rows_need_s8(const wmat *w);
/* inputs per activation scale of w's int8 rows: ACT_GROUP for int8 weights where groups are
 * on (ms_set_int8_act_group), else 0 (one scale a row: 4-bit weights, int4.c's arithmetic) */
int64_t rows_s8_group(const wmat *w);
void ms_set_int8_act_group(int group);
/* scales a row of K inputs takes at `group` inputs a scale (rows_t lds) */
static inline int64_t s8_scales(int64_t group, int64_t K) { return group ? (K + group - 1) / group : 1; }
/* whether w's int8 rows are rotated (all but unrotated 4-bit weights) */
int rows_rotate(const wmat *w);
/* C[m][0..16) = rows [m0, m0 + rows) of a times block j of w (scaled: real products), the
 * block's real width in *cols; pad: scratch of pad_bytes(K) per thread */
void wblock_gemm(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j,
                 void *pad, float *C, int64_t ldc, int64_t *cols);
/* two full blocks j1, j2 of w at once (into C1, C2): int8 weights stream both blocks in one
 * pass over the rows; other kinds take them one after the other */
void wblock_gemm_pair(const rows_t *a, int64_t m0, int64_t rows, const wmat *w, int64_t N, int64_t K, int64_t j1,
                      int64_t j2, void *pad, float *C1, float *C2, int64_t ldc);
size_t pad_bytes(int64_t K);

/* ==== kv_rows.c: the paged KV cache's row formats ======================================= */

/* cpu_kernels.KV_KINDS: bf16; int8, fp8 e4m3 or e5m2 with a bf16 scale after each (slot,
 * head) row's values; int4, two values a byte, with a bf16 scale per KV_INT4_GROUP values
 * after them (models/paged_cache.py). Strides in elements of the cache's storage (bf16 or
 * bytes). */
enum { KV_BF16 = 0, KV_INT8 = 1, KV_E4M3 = 2, KV_E5M2 = 3, KV_INT4 = 4 };
#define KV_INT4_GROUP 32 /* paged_cache.INT4_GROUP */
/* the first d values of one cache row of scale_at values -> float32 (an 8-bit row's scale at
 * row + scale_at bytes, an int4 row's scales at row + scale_at / 2; int4: d whole groups or
 * the whole row): a quantized row's values come back rotated (hadamard_rotate), as they were
 * stored */
void kv_widen_row(const void *row, int kind, int64_t d, int64_t scale_at, float *out);

/* the bf16 scale at byte scale_at of a quantized cache row (an 8-bit row's after its values,
 * an int4 row's groups' after its bytes) */
static inline float row_scale(const uint8_t *row, int64_t scale_at) {
    bf16 s;
    memcpy(&s, row + scale_at, 2);
    return bf16_to_f32(s);
}
/* d float32 values -> one cache row (quantized formats: rotated first, in x, then quantized
 * with the scales written after the values; int4 rows rounded through hinv [d, d] where not
 * NULL: kv_rows.c's int4_weighted_levels) */
void kv_store_row(float *x, int kind, int64_t d, const float *hinv, void *row);

/* ==== the exported kernels (cpu.py binds them), one file each ========================== */

/* linear.c */
int ms_linear(const bf16 *x, int64_t x_bs, int64_t ldx, int64_t M, int64_t K, const wmat *w, int64_t w_bs,
              int64_t N, const bf16 *bias, bf16 *y, int64_t y_bs, int64_t ldy, int64_t batch, int nthreads);
/* moe.c; and its SwiGLU, silu(gate) * up, rounded as the reference's bf16 ops round. moe_glu:
 * gpt-oss's experts (biases on both projections, the clamped SwiGLU when alpha > 0). */
typedef struct {
    const float *b13, *b2;
    float alpha, limit;
} moe_glu;
int ms_moe(const bf16 *x, int64_t ldx, int64_t T, int64_t D, const wmat *w13, const wmat *w2, int64_t E,
           int64_t I, const int64_t *ids, const float *weights, int64_t A, const moe_glu *glu, bf16 *out,
           int64_t ldo, int64_t *counts, int nthreads);
void swiglu_row(const float *gate, const float *up, float *out, int64_t n);
/* attention.c */
int ms_decode_attention(const bf16 *q, int64_t ldq, int64_t B, int64_t H, int64_t G, int kv_kind,
                        const void *k_cache, int64_t k_slot, int64_t k_head, int64_t dk,
                        const void *v_cache, int64_t v_slot, int64_t v_head, int64_t dv, int64_t v_scale_at,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                        int64_t block_size, float scale, const float *sinks, int64_t window, bf16 *out,
                        int64_t ldo, int nthreads);
/* prefill_attention.c */
int ms_prefill_attention(const bf16 *q, int64_t ldq, int64_t C, int64_t H, int64_t G, int64_t d, int kv_kind,
                         const void *k_cache, int64_t k_slot, int64_t k_head, const void *v_cache, int64_t v_slot,
                         int64_t v_head, const int64_t *slots, int64_t ctx, float scale, const float *sinks,
                         int64_t window, bf16 *out, int64_t ldo, int nthreads);
/* norm_rope.c */
void ms_rmsnorm(const bf16 *x, int64_t ldx, bf16 *residual, int64_t ldr, const bf16 *w, float eps,
                bf16 *out, int64_t ldo, int64_t T, int64_t D, int nthreads);
void ms_rope_cache(bf16 *qkv, int64_t ld, int64_t T, int64_t H, int64_t G, int64_t d, int64_t rd,
                   const bf16 *cos, const bf16 *sin, const float *key_shift, const float *key_hinv,
                   const int64_t *slots, int kv_kind, void *k_cache, void *v_cache, int64_t cache_row,
                   int nthreads);
/* embed.c */
int ms_embed_int8(const int8_t *table, int64_t ld, const float *scales, int64_t V, const int64_t *ids, int64_t T,
                  int64_t D, bf16 *out, int nthreads);
/* greedy.c */
void ms_greedy(const bf16 *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out, int nthreads);
/* logits.c: prompt scoring. Each row's target logprob and rank (1 + the logits above the
 * target's) and its top k (ids, logprobs; ties: the lower id first), of logits x (bf16, or
 * float32 with f32 set; row stride ldx) or of the lm_head's own logits of hidden rows x times
 * w (+ bias), computed tile_rows rows at a time (0: logits.c's choice). -2: a target outside
 * the vocabulary or k outside [0, vocab]; -1: no scratch memory. */
int ms_logprob_rows(const void *x, int64_t ldx, int f32, int64_t rows, int64_t n, const int64_t *targets, int64_t k,
                    float *target_lp, int64_t *rank, int64_t *top_ids, float *top_lp, int nthreads);
int ms_logit_scores(const bf16 *x, int64_t ldx, int64_t M, int64_t K, const wmat *w, int64_t N, const bf16 *bias,
                    const int64_t *targets, int64_t k, float *target_lp, int64_t *rank, int64_t *top_ids, float *top_lp,
                    int64_t tile_rows, int nthreads);
/* layer.c: ms_decode_step, its layer_spec mirrored by cpu.py (declared there) */

#endif
