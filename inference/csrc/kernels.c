/* bf16 CPU kernels for the engine's linear layers, MoE layers, decode attention, RMSNorm and
 * rotary embeddings, written once against simd.h and compiled per instruction set (AVX2,
 * AVX-512). Loaded through ctypes by inference/cpu_kernels.py.
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
 * Threads: OpenMP, compiled with -fopenmp; the soname libgomp.so.1 resolves to the runtime
 * torch has loaded, so these loops share torch's thread pool. Scratch memory comes from one
 * arena that grows and is reused across calls (a fresh 64 MB buffer per prefill layer would
 * cost its page faults every time); calls are serialised by the arena's lock.
 */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>

#include "simd.h"

#define BLOCK 16            /* output columns per packed block */
#define VPB (BLOCK / VL)    /* vectors per block row */
#if defined(MS_AVX512)
#define MR 8                /* rows per register tile */
#else
#define MR 4
#endif
#define L2_ROWS_BYTES (192 * 1024) /* float32 activation rows kept in L2 per chunk */
#define PREFETCH 1024        /* bytes ahead in a weight stream (one-row products) */
#define TILE_ROWS 256       /* rows of float32 results per block_gemm call (16 KB on the stack) */

/* ---- scratch arena ------------------------------------------------------------------- */

static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
static char *arena;
static size_t arena_size;

/* Locks the arena and returns at least `bytes` of it (64-byte aligned), or NULL (unlocked)
 * when it cannot grow. */
static void *arena_take(size_t bytes) {
    pthread_mutex_lock(&arena_lock);
    if (bytes > arena_size) {
        free(arena);
        arena_size = (bytes + 65535) & ~(size_t)65535;
        arena = aligned_alloc(64, arena_size);
        if (!arena) {
            arena_size = 0;
            pthread_mutex_unlock(&arena_lock);
            return NULL;
        }
    }
    return arena;
}

static void arena_give(void) { pthread_mutex_unlock(&arena_lock); }

static inline size_t round64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* ---- packed blocks ------------------------------------------------------------------- */

static inline int64_t even(int64_t k) { return k + (k & 1); }

/* Block j of a packed [N, K] weight, as a full 16-column block: the narrow last block is
 * copied into `pad` (Kp * 16 bf16) with zero columns. `*cols` gets its real width. */
static const bf16 *weight_block(const bf16 *w, int64_t N, int64_t Kp, int64_t j, bf16 *pad, int64_t *cols) {
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
 * Kp columns), B one packed block. Every weight vector loaded serves all rows. */
static inline __attribute__((always_inline)) void tile(const int rows, const float *A, int64_t lda,
                                                       const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    vf acc[MR][VPB];
#pragma GCC unroll 16
    for (int m = 0; m < rows; m++)
#pragma GCC unroll 4
        for (int v = 0; v < VPB; v++) acc[m][v] = vf_zero();
    for (int64_t kp = 0; kp < Kp / 2; kp++) {
        const bf16 *b = B + kp * 2 * BLOCK;
        vf e[VPB], o[VPB];
#pragma GCC unroll 4
        for (int v = 0; v < VPB; v++) vf_load_pairs(b + v * 2 * VL, &e[v], &o[v]);
#pragma GCC unroll 16
        for (int m = 0; m < rows; m++) {
            const vf a0 = vf_set1(A[m * lda + 2 * kp]), a1 = vf_set1(A[m * lda + 2 * kp + 1]);
#pragma GCC unroll 4
            for (int v = 0; v < VPB; v++) {
                acc[m][v] = vf_fma(e[v], a0, acc[m][v]);
                acc[m][v] = vf_fma(o[v], a1, acc[m][v]);
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

/* AMX (amx.c), set by cpu_kernels.enable where the CPU has it: C = A B for a block and a group
 * of rows, A as bf16. Used from AMX_MIN_ROWS rows (a tile multiply costs the same for 4 rows
 * as for 16) when the inputs fill whole tiles. */
typedef void (*amx_fn)(const bf16 *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc);
static amx_fn amx_block;
#define AMX_MIN_ROWS 4

void ms_set_amx(void *fn) { amx_block = (amx_fn)fn; }

static inline int amx_takes(int64_t rows, int64_t Kp) { return amx_block && rows >= AMX_MIN_ROWS && Kp % 32 == 0; }

/* C[m][0..16) for m < rows, any number of rows: on AMX when it takes them (A16: the same rows
 * as bf16, stride lda16), else in register tiles of MR rows. */
static void block_gemm(const float *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc,
                       const bf16 *A16, int64_t lda16) {
    if (A16 && amx_takes(rows, Kp)) {
        amx_block(A16, lda16, rows, B, Kp, C, ldc);
        return;
    }
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

/* Rows of bf16 (stride ld, K columns) -> float32 rows of Kp columns (zero padded). */
static inline void widen_row(const bf16 *x, int64_t K, float *out, int64_t Kp) {
    int64_t k = 0;
    for (; k + VL <= K; k += VL) vf_store(out + k, vf_load_bf16(x + k));
    for (; k < K; k++) out[k] = bf16_to_f32(x[k]);
    for (; k < Kp; k++) out[k] = 0.0f;
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
static int64_t chunk_rows(int64_t Kp) {
    int64_t rows = L2_ROWS_BYTES / (Kp * (int64_t)sizeof(float));
    rows = rows / MR * MR;
    return rows < MR ? MR : rows;
}

/* ---- linear layers ------------------------------------------------------------------- */

/* y[M, N] = x[M, K] W^T (+ bias), rounded to bf16, for `batch` independent products (MLA's
 * per-head projections; 1 for a linear layer): product i reads x + i * x_bs (rows at stride
 * ldx), W + i * w_bs (packed) and writes y + i * y_bs (rows at stride ldy). Returns nonzero
 * when scratch memory cannot be had. */
int ms_linear(const bf16 *x, int64_t x_bs, int64_t ldx, int64_t M, int64_t K, const bf16 *w, int64_t w_bs,
              int64_t N, const bf16 *bias, bf16 *y, int64_t y_bs, int64_t ldy, int64_t batch, int nthreads) {
    const int64_t Kp = even(K), blocks = (N + BLOCK - 1) / BLOCK;
    const int64_t rows = chunk_rows(Kp) < M ? chunk_rows(Kp) : M, chunks = (M + rows - 1) / rows;
    const size_t a_bytes = round64((size_t)batch * M * Kp * sizeof(float));
    const size_t pad_bytes = round64((size_t)Kp * BLOCK * sizeof(bf16));
    char *scratch = arena_take(a_bytes + (size_t)nthreads * pad_bytes);
    if (!scratch) return -1;
    float *A = (float *)scratch;
#pragma omp parallel num_threads(nthreads) if (batch * M * N * K > 65536)
    {
        bf16 *pad = (bf16 *)(scratch + a_bytes + (size_t)omp_get_thread_num() * pad_bytes);
        float C[TILE_ROWS * BLOCK];
#pragma omp for collapse(2) schedule(static)
        for (int64_t i = 0; i < batch; i++)
            for (int64_t m = 0; m < M; m++) widen_row(x + i * x_bs + m * ldx, K, A + (i * M + m) * Kp, Kp);
#pragma omp for collapse(3) schedule(static)
        for (int64_t i = 0; i < batch; i++)
            for (int64_t ch = 0; ch < chunks; ch++)
                for (int64_t j = 0; j < blocks; j++) {
                    int64_t cols;
                    const bf16 *B = weight_block(w + i * w_bs, N, Kp, j, pad, &cols);
                    const int64_t end = (ch + 1) * rows < M ? (ch + 1) * rows : M;
                    for (int64_t m0 = ch * rows; m0 < end; m0 += TILE_ROWS) {
                        const int64_t m1 = m0 + TILE_ROWS < end ? m0 + TILE_ROWS : end;
                        block_gemm(A + (i * M + m0) * Kp, Kp, m1 - m0, B, Kp, C, BLOCK,
                                   K == Kp ? x + i * x_bs + m0 * ldx : NULL, ldx);
                        for (int64_t m = m0; m < m1; m++)
                            store_row(C + (m - m0) * BLOCK, cols, bias ? bias + j * BLOCK : NULL,
                                      y + i * y_bs + m * ldy + j * BLOCK);
                    }
                }
    }
    arena_give();
    return 0;
}

/* ---- MoE layers ---------------------------------------------------------------------- */

/* silu(gate) * up over n values, rounded where the reference rounds (SiLU, the product). */
static void swiglu_row(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf g = vf_load(gate + i);
        const vf s = vf_round_bf16(vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g)))));
        vf_store(out + i, vf_round_bf16(vf_mul(s, vf_load(up + i))));
    }
    for (; i < n; i++) out[i] = round_bf16(round_bf16(gate[i] / (1.0f + expf(-gate[i]))) * up[i]);
}

/* rows [r0, r1) of A (float32, Kp columns) times block j of packed W -> rows of `out`
 * (float32, stride ldo, rounded to bf16 precision like the reference's bf16 outputs). */
static void rows_times_block(const float *A, const bf16 *A16, int64_t Kp, int64_t r0, int64_t r1, const bf16 *w,
                             int64_t N, int64_t j, bf16 *pad, float *out, int64_t ldo) {
    float C[TILE_ROWS * BLOCK];
    int64_t cols;
    const bf16 *B = weight_block(w, N, Kp, j, pad, &cols);
    for (int64_t m0 = r0; m0 < r1; m0 += TILE_ROWS) {
        const int64_t m1 = m0 + TILE_ROWS < r1 ? m0 + TILE_ROWS : r1;
        block_gemm(A + m0 * Kp, Kp, m1 - m0, B, Kp, C, BLOCK, A16 ? A16 + m0 * Kp : NULL, Kp);
        for (int64_t m = m0; m < m1; m++) {
            const float *c = C + (m - m0) * BLOCK;
            float *o = out + m * ldo + j * BLOCK;
            if (cols == BLOCK)
                for (int v = 0; v < VPB; v++) vf_store(o + v * VL, vf_round_bf16(vf_load(c + v * VL)));
            else
                for (int64_t n = 0; n < cols; n++) o[n] = round_bf16(c[n]);
        }
    }
}

/* The routed experts of T tokens in one call (one token, decode batches, prefill chunks):
 * out[t] = sum_a weights[t, a] * W2[e] (silu(g) * u), (g, u) = W13[e] x[t], e = ids[t, a].
 * (token, expert) pairs are sorted by expert, so each expert's weights are read once for all
 * of its tokens, and experts nobody was routed to not at all (a batched matmul over all
 * experts reads them all and multiplies the padding). Work is split across threads by
 * (expert, row chunk, 16-column block).
 * x [T, D] (row stride ldx); w13 [E] packed [2I, D] (gate rows, then up rows); w2 [E] packed
 * [D, I]; ids, weights [T, A]; out [T, D] (row stride ldo); counts [E] gets the tokens per
 * expert. Returns -1 without scratch memory, -2 for an expert id outside [0, E). */
int ms_moe(const bf16 *x, int64_t ldx, int64_t T, int64_t D, const bf16 *w13, const bf16 *w2, int64_t E,
           int64_t I, const int64_t *ids, const float *weights, int64_t A, bf16 *out, int64_t ldo,
           int64_t *counts, int nthreads) {
    const int64_t pairs = T * A, Dp = even(D), Ip = even(I), N1 = 2 * I;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    const int64_t rows = chunk_rows(Dp > Ip ? Dp : Ip);
    const int amx = amx_block && Dp % 32 == 0 && Ip % 32 == 0;
    const int64_t max_chunks = pairs / rows + E + 1;
    const size_t pad_bytes = round64((size_t)(Dp > Ip ? Dp : Ip) * BLOCK * sizeof(bf16));
    size_t sizes[] = {
        round64((E + 1) * sizeof(int64_t)),          /* first row of each expert */
        round64(pairs * sizeof(int64_t)),            /* row of each pair */
        round64(pairs * sizeof(int64_t)),            /* token of each row */
        round64(3 * max_chunks * sizeof(int64_t)),   /* (expert, first row, end row) chunks */
        round64((size_t)pairs * Dp * sizeof(float)), /* the tokens, by expert */
        round64((size_t)pairs * N1 * sizeof(float)), /* gate and up projections */
        round64((size_t)pairs * Ip * sizeof(float)), /* silu(gate) * up */
        round64((size_t)pairs * D * sizeof(float)),  /* expert outputs */
        (size_t)nthreads * pad_bytes,
        amx ? round64((size_t)pairs * Dp * sizeof(bf16)) : 0, /* the tokens and */
        amx ? round64((size_t)pairs * Ip * sizeof(bf16)) : 0, /* silu(gate) * up as bf16, for AMX */
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
    char *p0 = arena_take(total);
    if (!p0) return -1;
    char *cursor = p0;
    void *parts[sizeof sizes / sizeof *sizes];
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) parts[i] = cursor, cursor += sizes[i];
    int64_t *first = parts[0], *pair_row = parts[1], *token_of = parts[2], *chunk = parts[3];
    float *xs = parts[4], *gate_up = parts[5], *hidden = parts[6], *expert_out = parts[7];
    char *pads = parts[8];
    bf16 *xs16 = amx ? parts[9] : NULL, *hidden16 = amx ? parts[10] : NULL;

    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t p = 0; p < pairs; p++) counts[ids[p]]++;
    first[0] = 0;
    for (int64_t e = 0; e < E; e++) first[e + 1] = first[e] + counts[e];
    int64_t chunks = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = first[e]; r < first[e + 1]; r += rows) {
            chunk[3 * chunks] = e, chunk[3 * chunks + 1] = r;
            chunk[3 * chunks + 2] = r + rows < first[e + 1] ? r + rows : first[e + 1];
            chunks++;
        }
    for (int64_t e = 0; e < E; e++) counts[e] = 0; /* reused as fill cursors, restored below */
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = ids[p];
        pair_row[p] = first[e] + counts[e]++;
        token_of[pair_row[p]] = p / A;
    }
    const int64_t blocks1 = (N1 + BLOCK - 1) / BLOCK, blocks2 = (D + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(nthreads)
    {
        bf16 *pad = (bf16 *)(pads + (size_t)omp_get_thread_num() * pad_bytes);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) {
            widen_row(x + token_of[r] * ldx, D, xs + r * Dp, Dp);
            if (xs16) memcpy(xs16 + r * Dp, x + token_of[r] * ldx, D * sizeof(bf16));
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < chunks * blocks1; it++) {
            const int64_t *c = chunk + 3 * (it / blocks1);
            rows_times_block(xs, xs16, Dp, c[1], c[2], w13 + c[0] * N1 * Dp, N1, it % blocks1, pad, gate_up, N1);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) {
            swiglu_row(gate_up + r * N1, gate_up + r * N1 + I, hidden + r * Ip, I);
            if (Ip != I) hidden[r * Ip + I] = 0.0f;
            if (hidden16) /* exact: the values are bf16-rounded */
                for (int64_t i = 0; i < I; i++) hidden16[r * Ip + i] = f32_to_bf16(hidden[r * Ip + i]);
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < chunks * blocks2; it++) {
            const int64_t *c = chunk + 3 * (it / blocks2);
            rows_times_block(hidden, hidden16, Ip, c[1], c[2], w2 + c[0] * D * Ip, D, it % blocks2, pad, expert_out, D);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            bf16 *o = out + t * ldo;
            int64_t d = 0;
            for (; d + VL <= D; d += VL) {
                vf acc = vf_zero();
                for (int64_t a = 0; a < A; a++)
                    acc = vf_fma(vf_set1(weights[t * A + a]), vf_load(expert_out + pair_row[t * A + a] * D + d), acc);
                vf_store_bf16(o + d, acc);
            }
            for (; d < D; d++) {
                float acc = 0.0f;
                for (int64_t a = 0; a < A; a++) acc += weights[t * A + a] * expert_out[pair_row[t * A + a] * D + d];
                o[d] = f32_to_bf16(acc);
            }
        }
    }
    arena_give();
    return 0;
}

/* ---- decode attention ---------------------------------------------------------------- */

/* One query token per sequence over its paged context, for all sequences of a step, read
 * straight from the cache by block table (no gathered copy). Work items are (sequence, kv
 * head, context split); the splits (flash-decoding) keep every core busy when there are
 * fewer sequences than threads, and are merged by their softmax statistics at the end.
 * q [B, H, dk] (row stride ldq); key row of (slot, kv head g) at k_cache + slot * k_slot +
 * g * k_head, value row likewise (MLA passes the latent cache as both, dv < dk); slot of
 * position p: block_tables[b][p / block_size] * block_size + p % block_size; out [B, H, dv]
 * (row stride ldo). Query heads h * G / H share kv head g (grouped-query attention). */
int ms_decode_attention(const bf16 *q, int64_t ldq, int64_t B, int64_t H, int64_t G,
                        const bf16 *k_cache, int64_t k_slot, int64_t k_head, int64_t dk,
                        const bf16 *v_cache, int64_t v_slot, int64_t v_head, int64_t dv,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                        int64_t block_size, float scale, bf16 *out, int64_t ldo, int nthreads) {
    const int64_t hpg = H / G;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++) longest = context_lens[b] > longest ? context_lens[b] : longest;
    int64_t splits = (4 * nthreads + B * G - 1) / (B * G);
    const int64_t most = (longest + 63) / 64; /* at least 64 positions per split */
    splits = splits > most ? most : splits;
    splits = splits < 1 ? 1 : splits;
    const int64_t span = (longest + splits - 1) / splits;
    const int64_t part = dv + 2; /* per head: max score, sum of exponentials, dv weighted values */
    const size_t partial_bytes = round64((size_t)B * G * splits * hpg * part * sizeof(float));
    const size_t local_bytes = round64((size_t)hpg * (dk + span + dv) * sizeof(float));
    char *scratch = arena_take(partial_bytes + (size_t)nthreads * local_bytes);
    if (!scratch) return -1;
    float *partials = (float *)scratch;
#pragma omp parallel num_threads(nthreads)
    {
        float *qf = (float *)(scratch + partial_bytes + (size_t)omp_get_thread_num() * local_bytes);
        float *scores = qf + hpg * dk, *acc = scores + hpg * span;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < B * G * splits; it++) {
            const int64_t b = it / (G * splits), g = (it / splits) % G, s = it % splits;
            const int64_t c0 = s * span, c1 = c0 + span < context_lens[b] ? c0 + span : context_lens[b];
            float *res = partials + it * hpg * part;
            if (c0 >= c1) {
                for (int64_t h = 0; h < hpg; h++) res[h * part] = -INFINITY, res[h * part + 1] = 0.0f;
                continue;
            }
            for (int64_t h = 0; h < hpg; h++) {
                const bf16 *qh = q + b * ldq + (g * hpg + h) * dk;
                for (int64_t c = 0; c < dk; c++) qf[h * dk + c] = bf16_to_f32(qh[c]) * scale;
            }
            const int32_t *table = block_tables + b * bt_stride;
            for (int64_t p = c0; p < c1; p++) {
                const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                const bf16 *kr = k_cache + slot * k_slot + g * k_head;
                for (int64_t h0 = 0; h0 < hpg; h0 += 4) {
                    const int64_t nh = hpg - h0 < 4 ? hpg - h0 : 4;
                    vf a[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
                    int64_t c = 0;
                    for (; c + VL <= dk; c += VL) {
                        const vf kv = vf_load_bf16(kr + c);
                        for (int64_t h = 0; h < nh; h++) a[h] = vf_fma(vf_load(qf + (h0 + h) * dk + c), kv, a[h]);
                    }
                    for (int64_t h = 0; h < nh; h++) {
                        float dot = vf_sum(a[h]);
                        for (int64_t cc = c; cc < dk; cc++) dot += qf[(h0 + h) * dk + cc] * bf16_to_f32(kr[cc]);
                        scores[(h0 + h) * span + (p - c0)] = dot;
                    }
                }
            }
            const int64_t n = c1 - c0;
            for (int64_t h = 0; h < hpg; h++) {
                float *sc = scores + h * span, top = -INFINITY, sum = 0.0f;
                for (int64_t i = 0; i < n; i++) top = sc[i] > top ? sc[i] : top;
                int64_t i = 0;
                vf vs = vf_zero();
                for (; i + VL <= n; i += VL) {
                    const vf e = vf_exp(vf_sub(vf_load(sc + i), vf_set1(top)));
                    vf_store(sc + i, e);
                    vs = vf_add(vs, e);
                }
                sum = vf_sum(vs);
                for (; i < n; i++) sum += sc[i] = expf(sc[i] - top);
                res[h * part] = top, res[h * part + 1] = sum;
            }
            for (int64_t i = 0; i < hpg * dv; i++) acc[i] = 0.0f;
            for (int64_t p = c0; p < c1; p++) {
                const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                const bf16 *vr = v_cache + slot * v_slot + g * v_head;
                int64_t c = 0;
                for (; c + VL <= dv; c += VL) {
                    const vf vv = vf_load_bf16(vr + c);
                    for (int64_t h = 0; h < hpg; h++)
                        vf_store(acc + h * dv + c, vf_fma(vf_set1(scores[h * span + (p - c0)]), vv, vf_load(acc + h * dv + c)));
                }
                for (; c < dv; c++)
                    for (int64_t h = 0; h < hpg; h++) acc[h * dv + c] += scores[h * span + (p - c0)] * bf16_to_f32(vr[c]);
            }
            for (int64_t h = 0; h < hpg; h++) memcpy(res + h * part + 2, acc + h * dv, dv * sizeof(float));
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t b = bh / H, h = bh % H, g = h / hpg, hh = h % hpg;
            const float *res = partials + (b * G + g) * splits * hpg * part + hh * part;
            float top = -INFINITY, sum = 0.0f;
            for (int64_t s = 0; s < splits; s++) top = res[s * hpg * part] > top ? res[s * hpg * part] : top;
            for (int64_t c = 0; c < dv; c++) acc[c] = 0.0f;
            for (int64_t s = 0; s < splits; s++) {
                const float *r = res + s * hpg * part;
                if (r[1] == 0.0f) continue;
                const float f = expf(r[0] - top);
                sum += f * r[1];
                for (int64_t c = 0; c < dv; c++) acc[c] += f * r[2 + c];
            }
            bf16 *o = out + b * ldo + h * dv;
            for (int64_t c = 0; c < dv; c++) o[c] = f32_to_bf16(sum > 0.0f ? acc[c] / sum : 0.0f);
        }
    }
    arena_give();
    return 0;
}

/* ---- RMSNorm, residual adds, rotary embeddings --------------------------------------- */

/* out = RMSNorm(x) * w, rounded as the reference rounds (normalised in float32, rounded,
 * then times the bf16 weight). With `residual`, first residual = x + residual (rounded, the
 * reference's bf16 add), which is then normalised: one pass for the add and the norm. */
void ms_rmsnorm(const bf16 *x, int64_t ldx, bf16 *residual, int64_t ldr, const bf16 *w, float eps,
                bf16 *out, int64_t ldo, int64_t T, int64_t D, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *xr = x + t * ldx;
        bf16 *src = (bf16 *)xr;
        if (residual) {
            bf16 *rr = residual + t * ldr;
            int64_t d = 0;
            for (; d + VL <= D; d += VL) vf_store_bf16(rr + d, vf_add(vf_load_bf16(xr + d), vf_load_bf16(rr + d)));
            for (; d < D; d++) rr[d] = f32_to_bf16(bf16_to_f32(xr[d]) + bf16_to_f32(rr[d]));
            src = rr;
        }
        vf vs = vf_zero();
        int64_t d = 0;
        for (; d + VL <= D; d += VL) {
            const vf v = vf_load_bf16(src + d);
            vs = vf_fma(v, v, vs);
        }
        float ss = vf_sum(vs);
        for (; d < D; d++) ss += bf16_to_f32(src[d]) * bf16_to_f32(src[d]);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        bf16 *o = out + t * ldo;
        d = 0;
        for (; d + VL <= D; d += VL)
            vf_store_bf16(o + d, vf_mul(vf_round_bf16(vf_mul(vf_load_bf16(src + d), vf_set1(r))), vf_load_bf16(w + d)));
        for (; d < D; d++) o[d] = f32_to_bf16(round_bf16(bf16_to_f32(src[d]) * r) * bf16_to_f32(w[d]));
    }
}

/* Rotary embedding (rotate-half layout) of the H query and G key heads of qkv [T, (H + 2G) d]
 * in place, then the keys and values written to the cache rows slots[t] (k_cache/v_cache
 * [S, G, d]). cos/sin [T, d] bf16 (each frequency twice, as the checkpoints' tables). Each
 * product and the sum rounded as the reference's bf16 ops round. */
void ms_rope_cache(bf16 *qkv, int64_t ld, int64_t T, int64_t H, int64_t G, int64_t d, const bf16 *cos,
                   const bf16 *sin, const int64_t *slots, bf16 *k_cache, bf16 *v_cache, int nthreads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *ct = cos + t * d, *st = sin + t * d;
        for (int64_t head = 0; head < H + G; head++) {
            bf16 *x = qkv + t * ld + head * d;
            int64_t i = 0;
            for (; i + VL <= half; i += VL) {
                const vf x1 = vf_load_bf16(x + i), x2 = vf_load_bf16(x + half + i);
                const vf lo = vf_add(vf_round_bf16(vf_mul(x1, vf_load_bf16(ct + i))),
                                     vf_round_bf16(vf_mul(vf_sub(vf_zero(), x2), vf_load_bf16(st + i))));
                const vf hi = vf_add(vf_round_bf16(vf_mul(x2, vf_load_bf16(ct + half + i))),
                                     vf_round_bf16(vf_mul(x1, vf_load_bf16(st + half + i))));
                vf_store_bf16(x + i, lo);
                vf_store_bf16(x + half + i, hi);
            }
            for (; i < half; i++) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
                x[i] = f32_to_bf16(round_bf16(x1 * bf16_to_f32(ct[i])) + round_bf16(-x2 * bf16_to_f32(st[i])));
                x[half + i] = f32_to_bf16(round_bf16(x2 * bf16_to_f32(ct[half + i])) +
                                          round_bf16(x1 * bf16_to_f32(st[half + i])));
            }
        }
        if (slots) {
            memcpy(k_cache + slots[t] * G * d, qkv + t * ld + H * d, G * d * sizeof(bf16));
            memcpy(v_cache + slots[t] * G * d, qkv + t * ld + (H + G) * d, G * d * sizeof(bf16));
        }
    }
}
