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
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* float32 -> bf16 precision (round to nearest even), kept as float32. */
static inline __m512 round_bf16(__m512 v) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp(x) to ~1 ulp: Cody-Waite reduction by ln 2 and Cephes' expf polynomial, scaled by 2^n. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* silu(gate) * up for 16 gate and 16 up values, each rounded to bf16 where the reference's
 * bf16 ops round (the projections, SiLU, the product). */
static inline __m256bh swiglu16(__m512 gate, __m512 up) {
    const __m512 g = round_bf16(gate), u = round_bf16(up);
    const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    return _mm512_cvtneps_pbh(_mm512_mul_ps(s, u));
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
 * scratch: A*(2I + D) floats; hidden: A*I bf16 (the activations, rounded to bf16 as the
 * reference rounds them before its down projection). */
void bf16_moe_token(const bf16 *x, const bf16 *w13, const bf16 *w2, const int64_t *ids,
                    const float *weights, int64_t A, int64_t I, int64_t D, bf16 *out,
                    float *scratch, bf16 *hidden, int nthreads) {
    float *gate_up = scratch, *expert_out = scratch + A * 2 * I;
    const int64_t chunks = (I + 15) / 16;
#pragma omp parallel num_threads(nthreads)
    {
        for (int64_t a = 0; a < A; a++)
            rows_dot(w13 + ids[a] * 2 * I * D, x, gate_up + a * 2 * I, 2 * I, D);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < A * chunks; j++) {
            const int64_t a = j / chunks, i = 16 * (j % chunks);
            const __mmask16 lanes = I - i >= 16 ? 0xffff : (__mmask16)((1u << (I - i)) - 1u);
            const float *gu = gate_up + a * 2 * I;
            const __m256bh h = swiglu16(_mm512_maskz_loadu_ps(lanes, gu + i), _mm512_maskz_loadu_ps(lanes, gu + I + i));
            _mm512_mask_storeu_epi16(hidden + a * I + i, lanes, _mm512_castsi256_si512((__m256i)h));
        }
        for (int64_t a = 0; a < A; a++)
            rows_dot(w2 + ids[a] * D * I, hidden + a * I, expert_out + a * D, D, I);
#pragma omp for schedule(static)
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int64_t a = 0; a < A; a++) acc += weights[a] * from_bf16(to_bf16(expert_out[a * D + d]));
            out[d] = to_bf16(acc);
        }
    }
}

/* Linux hands out the AMX register state only after this request (once per process). */
int bf16_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static void tiles_on(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int tile = 0; tile < 3; tile++) cfg.rows[tile] = 16, cfg.colsb[tile] = 64;
    _tile_loadconfig(&cfg);
}

/* One 16x16 float32 tile, out[16 * row + token]: weight rows w[0..15] (row-major, stride K)
 * times 16 tokens packed in pairs (packed[i][p][t][2] = token t's elements 32i + 2p, +1).
 * Computed transposed (weights as the first operand) so the weights need no repacking. */
static inline void amx_tile(const bf16 *w, const bf16 *packed, int64_t K, float *out) {
    _tile_zero(0);
    for (int64_t i = 0; i < K / 32; i++) {
        _tile_loadd(1, w + 32 * i, K * sizeof(bf16));
        _tile_loadd(2, packed + i * 16 * 32, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, out, 64);
}

/* The routed experts of a decode batch on AMX tiles (Sapphire Rapids and later), all in one
 * call: out[t] = sum_a weights[t, a] * W2[e] (silu(g) * u), (g, u) = W13[e] x[t], e = ids[t, a].
 * Each expert's weights are read once for all of its tokens (up to 16 per tile, the weight
 * rows staying in L1 across further groups of 16), and the experts nobody was routed to not
 * at all; a batched matmul reads every expert and multiplies the padding, and oneDNN's bmm
 * repacks the weights on every call. Rounding as bf16_moe_token.
 * x [T, D]; w13 [E, 2I, D]; w2 [E, D, I]; ids, weights [T, A]; out [T, D]; D, I % 32 == 0. */
int bf16_moe_batch(const bf16 *x, const bf16 *w13, const bf16 *w2, const int64_t *ids,
                   const float *weights, int64_t T, int64_t A, int64_t E, int64_t I, int64_t D,
                   bf16 *out, int nthreads) {
    const int64_t pairs = T * A;
    int status = -1; /* returned when a buffer cannot be allocated */
    /* routing tables: the s-th slot of expert e is row 16 * first_group[e] + s of every
     * per-slot buffer and holds token token_of[that row]; a pair's row is pair_row[p] */
    int64_t *count = calloc(E, sizeof(int64_t)), *first_group = malloc((E + 1) * sizeof(int64_t));
    int64_t *pair_row = malloc(pairs * sizeof(int64_t)), *token_of = NULL;
    bf16 *packed_x = NULL, *packed_h = NULL;
    float *gate_up = NULL, *expert_out = NULL;
    if (!count || !first_group || !pair_row) goto done;
    for (int64_t p = 0; p < pairs; p++) pair_row[p] = count[ids[p]]++;
    first_group[0] = 0;
    for (int64_t e = 0; e < E; e++) first_group[e + 1] = first_group[e] + (count[e] + 15) / 16;
    const int64_t groups = first_group[E], rows = 16 * groups;
    token_of = malloc(rows * sizeof(int64_t));
    packed_x = aligned_alloc(64, rows * D * sizeof(bf16) + 64);
    packed_h = aligned_alloc(64, rows * I * sizeof(bf16) + 64);
    gate_up = malloc(rows * 2 * I * sizeof(float));
    expert_out = malloc(rows * D * sizeof(float));
    if (!token_of || !packed_x || !packed_h || !gate_up || !expert_out) goto done;
    for (int64_t r = 0; r < rows; r++) token_of[r] = -1;
    for (int64_t p = 0; p < pairs; p++) {
        pair_row[p] += 16 * first_group[ids[p]];
        token_of[pair_row[p]] = p / A;
    }
    const int64_t up_blocks = 2 * I / 16, down_blocks = D / 16;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {  /* bf16 pairs as 32-bit words: [chunk][pair][token] */
            const int64_t t = token_of[r];
            uint32_t *dst = (uint32_t *)(packed_x + (r / 16) * 16 * D) + r % 16;
            const uint32_t *src = (const uint32_t *)(x + t * D);
            for (int64_t k2 = 0; k2 < D / 2; k2++) dst[16 * k2] = t < 0 ? 0 : src[k2];
        }
        tiles_on();
        float tile[256];
#pragma omp for schedule(dynamic, 4)
        for (int64_t j = 0; j < E * up_blocks; j++) {
            const int64_t e = j / up_blocks, n0 = 16 * (j % up_blocks);
            for (int64_t g = first_group[e]; g < first_group[e + 1]; g++) {
                amx_tile(w13 + (e * 2 * I + n0) * D, packed_x + g * 16 * D, D, tile);
                for (int64_t t = 0; t < 16; t++)
                    for (int64_t k = 0; k < 16; k++) gate_up[(16 * g + t) * 2 * I + n0 + k] = tile[16 * k + t];
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            uint32_t *dst = (uint32_t *)(packed_h + (r / 16) * 16 * I) + r % 16;
            const float *gu = gate_up + r * 2 * I;
            for (int64_t i = 0; i < I; i += 16) {
                uint32_t h[8];
                _mm256_storeu_si256((__m256i *)h, (__m256i)swiglu16(_mm512_loadu_ps(gu + i), _mm512_loadu_ps(gu + I + i)));
                for (int k = 0; k < 8; k++) dst[16 * (i / 2 + k)] = token_of[r] < 0 ? 0 : h[k];
            }
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t j = 0; j < E * down_blocks; j++) {
            const int64_t e = j / down_blocks, n0 = 16 * (j % down_blocks);
            for (int64_t g = first_group[e]; g < first_group[e + 1]; g++) {
                amx_tile(w2 + (e * D + n0) * I, packed_h + g * 16 * I, I, tile);
                for (int64_t t = 0; t < 16; t++)
                    for (int64_t k = 0; k < 16; k++)
                        expert_out[(16 * g + t) * D + n0 + k] = from_bf16(to_bf16(tile[16 * k + t]));
            }
        }
        _tile_release();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t a = 0; a < A; a++) acc += weights[t * A + a] * expert_out[pair_row[t * A + a] * D + d];
                out[t * D + d] = to_bf16(acc);
            }
    }
    status = 0;
done:
    free(count), free(first_group), free(pair_row), free(token_of);
    free(packed_x), free(packed_h), free(gate_up), free(expert_out);
    return status;
}
