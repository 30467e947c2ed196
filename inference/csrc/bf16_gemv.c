/* bfloat16 kernels for CPU decode on x86: matrix-vector products for single-sequence steps
 * (AVX512-BF16) and the experts of decode batches (AMX).
 *
 * One decode token reads every weight it uses once, so a step is bound by memory bandwidth.
 * ATen's bf16 GEMV converts each weight to float32 before its FMA and runs expert-sized
 * matrices on one core: 5-9 GB/s here, against 15-30 GB/s for these loops (vdpbf16ps
 * multiplies bf16 pairs and accumulates in float32, two threads, four rows in flight).
 *
 * Loaded through ctypes (inference/cpu_kernels.py), compiled with -fopenmp: the soname
 * libgomp.so.1 resolves to the OpenMP runtime torch has already loaded, so these loops
 * share torch's thread pool instead of starting a second one on the same cores.
 *
 * Layout: row-major, rows contiguous (stride K). Accumulation is float32; outputs are
 * rounded to bf16 once, round-to-nearest-even.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

typedef uint16_t bf16;

static inline bf16 to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float from_bf16(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* 32 bf16 of row w from element 32*i; lanes past K read as zero. */
static inline __m512bh load32(const bf16 *w, int64_t i, int64_t K) {
    int64_t left = K - 32 * i;
    if (left >= 32) return (__m512bh)_mm512_loadu_si512(w + 32 * i);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), w + 32 * i);
}

/* Dot products of rows w[0..3] (stride K) with x; the next four rows are prefetched. */
static inline void dot4(const bf16 *w, int64_t K, const bf16 *x, float out[4]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t chunks = (K + 31) / 32;
    for (int64_t i = 0; i < chunks; i++) {
        const __m512bh xv = load32(x, i, K);
        _mm_prefetch((const char *)(w + 4 * K + 32 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 5 * K + 32 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 6 * K + 32 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 7 * K + 32 * i), _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, load32(w, i, K), xv);
        a1 = _mm512_dpbf16_ps(a1, load32(w + K, i, K), xv);
        a2 = _mm512_dpbf16_ps(a2, load32(w + 2 * K, i, K), xv);
        a3 = _mm512_dpbf16_ps(a3, load32(w + 3 * K, i, K), xv);
    }
    out[0] = _mm512_reduce_add_ps(a0);
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
}

static inline float dot1(const bf16 *w, int64_t K, const bf16 *x) {
    __m512 a = _mm512_setzero_ps();
    const int64_t chunks = (K + 31) / 32;
    for (int64_t i = 0; i < chunks; i++) a = _mm512_dpbf16_ps(a, load32(w, i, K), load32(x, i, K));
    return _mm512_reduce_add_ps(a);
}

/* out[r] = dot(W[r], x) for r in [0, N), float32; the rows are shared among the threads of
 * the enclosing parallel region. */
static void rows_dot(const bf16 *W, const bf16 *x, float *out, int64_t N, int64_t K) {
    const int64_t blocks = N / 4;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) dot4(W + 4 * b * K, K, x, out + 4 * b);
#pragma omp single
    for (int64_t r = 4 * blocks; r < N; r++) out[r] = dot1(W + r * K, K, x);
}

/* y = W x: W [N, K], x [K], y [N]. */
void bf16_gemv(const bf16 *W, const bf16 *x, bf16 *y, int64_t N, int64_t K, int nthreads) {
    const int64_t blocks = N / 4;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            float o[4];
            dot4(W + 4 * b * K, K, x, o);
            for (int k = 0; k < 4; k++) y[4 * b + k] = to_bf16(o[k]);
        }
#pragma omp single
        for (int64_t r = 4 * blocks; r < N; r++) y[r] = to_bf16(dot1(W + r * K, K, x));
    }
}

/* The routed experts of one token: out = sum_a weights[a] * W2[ids[a]] (silu(g) * u), where
 * (g, u) = W13[ids[a]] x is split in halves (gate rows, then up rows).
 * x [D]; w13 [E, 2I, D]; w2 [E, D, I]; ids, weights [A]; out [D].
 * scratch: A*2I + D floats; hidden: A*I bf16 (the activations, rounded to bf16 as the
 * reference rounds them before its down projection). */
void bf16_moe_token(const bf16 *x, const bf16 *w13, const bf16 *w2, const int64_t *ids,
                    const float *weights, int64_t A, int64_t I, int64_t D, bf16 *out,
                    float *scratch, bf16 *hidden, int nthreads) {
    float *gate_up = scratch, *acc = scratch + A * 2 * I;
#pragma omp parallel num_threads(nthreads)
    {
        for (int64_t a = 0; a < A; a++)
            rows_dot(w13 + ids[a] * 2 * I * D, x, gate_up + a * 2 * I, 2 * I, D);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < A * I; j++) {
            const int64_t a = j / I, i = j % I;
            const float g = from_bf16(to_bf16(gate_up[a * 2 * I + i]));
            const float u = from_bf16(to_bf16(gate_up[a * 2 * I + I + i]));
            const float s = from_bf16(to_bf16(g / (1.0f + expf(-g))));
            hidden[j] = to_bf16(s * u);
        }
#pragma omp for schedule(static)
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t a = 0; a < A; a++) {
            const bf16 *w = w2 + ids[a] * D * I, *h = hidden + a * I;
            const float scale = weights[a];
            const int64_t blocks = D / 4;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                float o[4];
                dot4(w + 4 * b * I, I, h, o);
                for (int k = 0; k < 4; k++) acc[4 * b + k] += scale * from_bf16(to_bf16(o[k]));
            }
#pragma omp single
            for (int64_t d = 4 * blocks; d < D; d++) acc[d] += scale * from_bf16(to_bf16(dot1(w + d * I, I, h)));
        }
#pragma omp for schedule(static)
        for (int64_t d = 0; d < D; d++) out[d] = to_bf16(acc[d]);
    }
}

#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the AMX register state only after this request (once per process). */
int bf16_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Decode batches through the experts with AMX tiles (Sapphire Rapids and later):
 * Y[e, t] = W[e] X[e, t] for t < counts[e]. Each expert's weights are read once for all of
 * its tokens, and experts nobody was routed to not at all (a batched matmul reads every
 * expert and multiplies the padding); oneDNN's bmm also repacks the weights on every call.
 * Computed transposed so the weights need no repacking: a 16x16 float32 tile of (weight
 * row, token) += 16 weight rows x 32 K (straight from the row-major weights) times the same
 * 32 K of 16 tokens, packed in pairs as TDPBF16PS wants its second operand.
 * X [E, C, K], W [E, N, K], Y [E, C, N] bf16; K % 32 == 0, N % 16 == 0;
 * packed: E * ceil(C / 16) * 16 * K bf16 (the tokens in tile order, zero past the counts). */
void bf16_expert_gemm(const bf16 *X, const bf16 *W, const int64_t *counts, bf16 *Y, bf16 *packed,
                          int64_t E, int64_t C, int64_t N, int64_t K, int nthreads) {
    const int64_t groups = (C + 15) / 16, chunks = K / 32, blocks = N / 16;
    const int64_t group_size = chunks * 16 * 32; /* bf16 per packed group of 16 tokens */
#pragma omp parallel num_threads(nthreads)
    {
        /* packed[e][g][i][p][t][2] = X[e, 16g + t, 32i + 2p + (0, 1)] */
#pragma omp for schedule(static)
        for (int64_t j = 0; j < E * groups; j++) {
            const int64_t e = j / groups, g = j % groups, n = counts[e];
            if (16 * g >= n) continue;
            uint32_t *dst = (uint32_t *)(packed + j * group_size);
            for (int64_t t = 0; t < 16; t++) {
                const int64_t token = 16 * g + t;
                const uint32_t *src = (const uint32_t *)(X + (e * C + token) * K);
                for (int64_t i = 0; i < chunks; i++)
                    for (int64_t p = 0; p < 16; p++)
                        dst[(i * 16 + p) * 16 + t] = token < n ? src[16 * i + p] : 0;
            }
        }
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int tile = 0; tile < 3; tile++) cfg.rows[tile] = 16, cfg.colsb[tile] = 64;
        _tile_loadconfig(&cfg);
        float out[16 * 16];
#pragma omp for schedule(dynamic, 4)
        for (int64_t j = 0; j < E * blocks; j++) {
            const int64_t e = j / blocks, r = 16 * (j % blocks), n = counts[e];
            const bf16 *w = W + (e * N + r) * K;
            for (int64_t g = 0; 16 * g < n; g++) {
                const bf16 *b = packed + (e * groups + g) * group_size;
                _tile_zero(0);
                for (int64_t i = 0; i < chunks; i++) {
                    _tile_loadd(1, w + 32 * i, K * sizeof(bf16));
                    _tile_loadd(2, b + i * 16 * 32, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, out, 64);
                for (int64_t t = 0; t < 16 && 16 * g + t < n; t++) {
                    bf16 *y = Y + (e * C + 16 * g + t) * N + r;
                    for (int k = 0; k < 16; k++) y[k] = to_bf16(out[16 * k + t]);
                }
            }
        }
        _tile_release();
    }
}
