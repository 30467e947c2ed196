/* Matrix-vector kernels for single-sequence decode in bfloat16 on x86 CPUs with AVX512-BF16.
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

/* Several tokens per block of weights are compute-bound, and on our CPUs vdpbf16ps issues
 * every other cycle while float32 FMAs issue twice a cycle: the batched kernel widens the
 * weights instead (a bf16 pair in a 32-bit lane is two float32 numbers: the high half masked,
 * the low half shifted up) and multiplies them with the tokens already widened the same way,
 * 1.7x the dot products of vdpbf16ps. */

/* Token x [K] bf16 -> float32 [chunks * 32]: per chunk of 32, the 16 even elements then the
 * 16 odd ones (lanes past K are zero). */
static inline void widen(const bf16 *x, int64_t K, float *out) {
    const int64_t chunks = (K + 31) / 32;
    for (int64_t i = 0; i < chunks; i++) {
        const __m512i v = (__m512i)load32(x, i, K);
        _mm512_storeu_ps(out + 32 * i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        _mm512_storeu_ps(out + 32 * i + 16, _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))));
    }
}

/* The sums of 16 vectors at once, lane i = sum of v[i]: unpacks and lane shuffles with
 * pairwise adds, instead of 16 separate horizontal reductions. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 s0[8], s1[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        s0[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++) {  /* per lane: the lane's sums of v[4j .. 4j+3] */
        const __m512d x = _mm512_castps_pd(s0[2 * j]), y = _mm512_castps_pd(s0[2 * j + 1]);
        s1[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s1[0], s1[1], 0x88), _mm512_shuffle_f32x4(s1[0], s1[1], 0xDD));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2], s1[3], 0x88), _mm512_shuffle_f32x4(s1[2], s1[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

/* Token t's two FMAs per weight row (even and odd elements) into its four accumulators. */
#define DOT4X4_TOKEN(t, a0, a1, a2, a3)                                          \
    do {                                                                        \
        const __m512 xe = _mm512_loadu_ps(xf + (t) * kf + 32 * i);              \
        const __m512 xo = _mm512_loadu_ps(xf + (t) * kf + 32 * i + 16);         \
        a0 = _mm512_fmadd_ps(w0o, xo, _mm512_fmadd_ps(w0e, xe, a0));            \
        a1 = _mm512_fmadd_ps(w1o, xo, _mm512_fmadd_ps(w1e, xe, a1));            \
        a2 = _mm512_fmadd_ps(w2o, xo, _mm512_fmadd_ps(w2e, xe, a2));            \
        a3 = _mm512_fmadd_ps(w3o, xo, _mm512_fmadd_ps(w3e, xe, a3));            \
    } while (0)

#define WIDEN_ROW(r, raw, e, o)                                                  \
    const __m512i raw = (__m512i)load32(w + (r) * K, i, K);                     \
    const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));           \
    const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(raw, hi_mask))

/* Rows w[0..3] (bf16, stride K) times four widened tokens xf (stride kf): out[4 * t + r].
 * The rows stay in L1 across the tokens. The 16 accumulators are named variables: as an
 * array whose address reaches hsum16, gcc stores each to the stack on every iteration. */
static inline void dot4x4(const bf16 *w, const float *xf, int64_t K, int64_t kf, float out[16]) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00,
           c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00,
           c31 = c00, c32 = c00, c33 = c00;
    const int64_t chunks = (K + 31) / 32;
    for (int64_t i = 0; i < chunks; i++) {
        _mm_prefetch((const char *)(w + 4 * K + 32 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 5 * K + 32 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 6 * K + 32 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 7 * K + 32 * i), _MM_HINT_T0);
        WIDEN_ROW(0, w0, w0e, w0o);
        WIDEN_ROW(1, w1, w1e, w1o);
        WIDEN_ROW(2, w2, w2e, w2o);
        WIDEN_ROW(3, w3, w3e, w3o);
        DOT4X4_TOKEN(0, c00, c01, c02, c03);
        DOT4X4_TOKEN(1, c10, c11, c12, c13);
        DOT4X4_TOKEN(2, c20, c21, c22, c23);
        DOT4X4_TOKEN(3, c30, c31, c32, c33);
    }
    const __m512 v[16] = {c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33};
    _mm512_storeu_ps(out, hsum16(v));
}

/* Decode batches through the experts: Y[e, t] = W[e] X[e, t] for t < counts[e], each
 * expert's weights read once for all of its tokens (a batched matmul would also read the
 * experts nobody was routed to, and multiply their padding).
 * X [E, C, K] (C a multiple of 4; rows from counts[e] on are never stored), W [E, N, K],
 * Y [E, C, N], all bf16; scratch: E * C * ceil(K / 32) * 32 floats (the widened tokens). */
void bf16_expert_gemm(const bf16 *X, const bf16 *W, const int64_t *counts, bf16 *Y, float *scratch,
                      int64_t E, int64_t C, int64_t N, int64_t K, int nthreads) {
    const int64_t blocks = (N + 3) / 4, kf = (K + 31) / 32 * 32;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < E * C; j++)
            if (j % C < (counts[j / C] + 3) / 4 * 4) widen(X + j * K, K, scratch + j * kf);  /* whole groups of 4 */
#pragma omp for schedule(dynamic, 16)
        for (int64_t j = 0; j < E * blocks; j++) {
            const int64_t e = j / blocks, r = 4 * (j % blocks), n = counts[e];
            if (n == 0) continue;
            const bf16 *w = W + (e * N + r) * K;
            const float *xf = scratch + e * C * kf;
            bf16 *y = Y + e * C * N + r;
            if (r + 4 <= N) {
                float o[16];
                for (int64_t t0 = 0; t0 < n; t0 += 4) {
                    dot4x4(w, xf + t0 * kf, K, kf, o);
                    for (int64_t t = t0; t < n && t < t0 + 4; t++)
                        for (int k = 0; k < 4; k++) y[t * N + k] = to_bf16(o[(t - t0) * 4 + k]);
                }
            } else {  /* the last rows when N is not a multiple of four */
                for (int64_t t = 0; t < n; t++)
                    for (int64_t k = 0; r + k < N; k++)
                        y[t * N + k] = to_bf16(dot1(w + k * K, K, X + (e * C + t) * K));
            }
        }
    }
}
