/* 4-bit weights times int8 activations (W4A8: int4.c's packed layout, scales, zero points and
 * float steps) on AMX int8 tiles, for products of many rows (prefill chunks, decode batches,
 * an expert's tokens), as SGLang's int4 x int8 AMX kernel does: a block of 16 columns is
 * unpacked once into unsigned bytes (mxfp4's codes looked up to u = 2 * e2m1 + 12), each
 * 64-byte row of octet o into two rows, its low nibbles (inputs 8o..8o+3 of each column) and
 * its high ones (8o+4..8o+7): the int8 layout's quad rows, so 8 octets fill one 1 KB B tile
 * of 64 inputs. TDPBSUD multiplies the rows' signed bytes by those unsigned ones into int32,
 * exactly. Each group's tile of sums is stored and finished as int4.c finishes its registers:
 * less the zero point times the row's group sum (int32), then acc += float(sum) * scale[g],
 * group by group, and y = acc * the row's scale; built with -ffp-contract=off (cpu_kernels),
 * so int4.c's floats, bit for bit, on any path.
 *
 * Groups of a multiple of 64 inputs, or one spanning the row (per channel): one tile step of
 * 64 inputs after another into the group's C tile. Other multiples of 32 (32 itself: mxfp4's,
 * GPTQ's g32 and the like): amx.c's grouped shape, steps of 32 inputs (A rows of 32 bytes, B
 * tiles of 8 quad rows). A last step past the end of the inputs reads its activations from a zero-padded copy
 * and the unpacked block's zero rows. Other groups (8, 16, 24, 40... inputs) and fewer than
 * MIN_ROWS rows (a decode step's one row: a tile step costs what 16 rows' does) run on the
 * int4 library cpu_kernels.enable hands over (ms_amx_int4_fallback: int4.c's VNNI or AVX2
 * build).
 *
 * ms_amx_int4_wblock is kernels.h's int4w_fn (wmat.c: the MoE kernel, the linear layers, the
 * fused step), ms_amx_int4_linear int4.c's ms_int4_linear: the same signatures.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

#define BLOCK 16
#define MIN_ROWS 4
#define MX_ZERO 12

typedef void (*int4w_fn)(const int8_t *A, int64_t lda, const float *sx, const int32_t *asum, int64_t rows,
                         int64_t octets, int64_t group_octets, int64_t ld, int mx, const uint8_t *B, const float *sc,
                         const int8_t *zero, int64_t cols, float *C, const uint8_t *B2, const float *sc2,
                         const int8_t *zero2, float *C2, int64_t ldc);
typedef int (*int4_linear_fn)(const int8_t *q, int64_t ldq, const float *sx, int64_t M, int64_t Kp, const uint8_t *w,
                              const float *scale, const int8_t *zero, int64_t group, int64_t N, int mx, float *y,
                              int64_t ldy, int nthreads);

static int4w_fn fallback_wblock;
static int4_linear_fn fallback_linear;

/* the int4 library's products (int4.c's ms_int4_wblock and ms_int4_linear) for what the tiles
 * do not take */
void ms_amx_int4_fallback(void *wblock, void *linear) {
    fallback_wblock = (int4w_fn)wblock;
    fallback_linear = (int4_linear_fn)linear;
}

/* mxfp4: e2m1 code -> 2 * e2m1 + 12 (int4.c's MX_TABLE) */
static const uint8_t MX_U[16] __attribute__((aligned(16))) = {12, 13, 14, 15, 16, 18, 20, 24,
                                                               12, 11, 10, 9,  8,  6,  4,  0};

/* octets of inputs a tile step multiplies for groups of group_octets: 8 (64 inputs), 4 (32,
 * the grouped shape), or 0 where the groups do not fill whole steps */
static int64_t step_octets(int64_t octets, int64_t group_octets) {
    if (group_octets >= octets || group_octets % 8 == 0) return 8;
    return group_octets % 4 == 0 ? 4 : 0;
}

/* whether a product of `rows` rows with these groups runs on the tiles (else on the fallback;
 * the tests check that their cases do) */
int ms_amx_int4_takes(int64_t rows, int64_t octets, int64_t group_octets) {
    return rows >= MIN_ROWS && step_octets(octets, group_octets) != 0;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* one 64-byte row of 16 columns' octet -> its low nibbles (lo) and high ones (hi) as bytes */
static inline void unpack_octet(const uint8_t *w, int mx, uint8_t *lo, uint8_t *hi) {
#if !defined(MS_AMX_EMULATED) /* the AMX build (AVX-512 BW); the emulated one's C, the same bytes */
    const __m512i v = _mm512_loadu_si512(w), mask = _mm512_set1_epi8(0x0f);
    __m512i l = _mm512_and_si512(v, mask), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    if (mx) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)MX_U));
        l = _mm512_shuffle_epi8(table, l);
        h = _mm512_shuffle_epi8(table, h);
    }
    _mm512_storeu_si512(lo, l);
    _mm512_storeu_si512(hi, h);
#else
    for (int i = 0; i < 64; i++) {
        lo[i] = mx ? MX_U[w[i] & 15] : w[i] & 15;
        hi[i] = mx ? MX_U[w[i] >> 4] : w[i] >> 4;
    }
#endif
}

/* a block B ([octets][cols][4] bytes: 16 columns, or a narrow last block's) -> U, two 64-byte
 * rows an octet (low nibbles, high ones), `padded` octets' worth: the columns past cols read
 * as zero bytes' nibbles (int4.c's padded block's; their outputs are dropped), the octets past
 * the last as zero bytes (they meet a zero-padded copy of the activations) */
static void unpack_block(const uint8_t *B, int64_t octets, int64_t cols, int mx, int64_t padded, uint8_t *U) {
    for (int64_t o = 0; o < octets; o++) {
        const uint8_t *w = B + o * cols * 4;
        uint8_t narrow[64];
        if (cols < BLOCK) {
            memset(narrow, 0, sizeof narrow);
            memcpy(narrow, w, (size_t)(cols * 4));
            w = narrow;
        }
        unpack_octet(w, mx, U + o * 128, U + o * 128 + 64);
    }
    memset(U + octets * 128, 0, (size_t)((padded - octets) * 128));
}

/* each group's sum of one row's activations into asum[g] (int4.c's group_sums) */
static void group_sums(const int8_t *x, int64_t octets, int64_t group_octets, int32_t *asum) {
    for (int64_t g = 0, o0 = 0; o0 < octets; g++, o0 += group_octets) {
        const int64_t k1 = 8 * min64(o0 + group_octets, octets);
        int32_t total = 0;
        for (int64_t k = 8 * o0; k < k1; k++) total += x[k];
        asum[g] = total;
    }
}

/* a block's scales and zero points, read in place (int4.c's block_params) */
typedef struct {
    const float *sc;
    const int8_t *zero;
    int64_t ld, cols;
    int32_t zdef;
} block_params;

/* group g's tile of sums for n rows into their accumulators, int4.c's steps: the zero point
 * times the row's group sum taken off in int32, then acc += float(sum) * scale (a narrow
 * block's columns past cols: scale 0, zero 0, as int4.c's) */
static void add_group(float acc[BLOCK][BLOCK], const int32_t sums[BLOCK][BLOCK], int64_t n, const int32_t *asum,
                      int64_t G, int64_t g, const block_params *p) {
    float sc[BLOCK];
    int32_t z[BLOCK];
    for (int64_t c = 0; c < BLOCK; c++) {
        sc[c] = c < p->cols ? p->sc[g * p->ld + c] : 0.0f;
        z[c] = c >= p->cols ? 0 : p->zero ? p->zero[g * p->ld + c] : p->zdef;
    }
    for (int64_t r = 0; r < n; r++) {
        const int32_t total = asum[r * G + g];
        for (int c = 0; c < BLOCK; c++) acc[r][c] = acc[r][c] + (float)(sums[r][c] - total * z[c]) * sc[c];
    }
}

/* n rows (n <= 16, rows_a) times the unpacked block U (and U2 unless `two` is 0) group by
 * group, on tiles C and A (C2 for U2; constants: the tile instructions take immediates) */
#define TILE_PASS(C_TILE, A_TILE, C2_TILE)                                                       \
    do {                                                                                         \
        for (int64_t g = 0; g < G; g++) {                                                        \
            const int64_t o0 = g * group_octets, o1 = min64(o0 + group_octets, octets);          \
            _tile_zero(C_TILE);                                                                  \
            if (two) _tile_zero(C2_TILE);                                                        \
            for (int64_t o = o0; o < o1; o += step) {                                            \
                const int8_t *a = rows_a + 8 * o;                                                \
                int64_t stride = lda;                                                            \
                if (o + step > o1) { /* past the last input: a zero-padded copy */               \
                    for (int64_t r = 0; r < n; r++)                                              \
                        memcpy(apad[r], a + r * lda, (size_t)(8 * (o1 - o)));                    \
                    a = &apad[0][0], stride = 64;                                                \
                }                                                                                \
                _tile_loadd(A_TILE, a, stride);                                                  \
                _tile_loadd(2, U + o * 128, 64);                                                 \
                _tile_dpbsud(C_TILE, A_TILE, 2);                                                 \
                if (two) {                                                                       \
                    _tile_loadd(6, U2 + o * 128, 64);                                            \
                    _tile_dpbsud(C2_TILE, A_TILE, 6);                                            \
                }                                                                                \
            }                                                                                    \
            _tile_stored(C_TILE, sums, 64);                                                      \
            add_group(acc, sums, n, asum_rows, G, g, p);                                         \
            if (two) {                                                                           \
                _tile_stored(C2_TILE, sums, 64);                                                 \
                add_group(acc2, sums, n, asum_rows, G, g, p2);                                   \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* rows [0, rows) of A (stride lda, 8 * octets inputs) times the unpacked block U (p) and,
 * unless U2 is NULL, a second (p2, into C2): y = acc * sx[m], the first cols_out columns of
 * each row stored (stride ldc). asum: the rows' group sums [rows][G]. */
static void tile_rows(const int8_t *A, int64_t lda, const float *sx, const int32_t *asum, int64_t rows,
                      int64_t octets, int64_t group_octets, int64_t step, const uint8_t *U, const uint8_t *U2,
                      const block_params *p, const block_params *p2, float *C, float *C2, int64_t ldc,
                      int64_t cols_out) {
    const int64_t G = (octets + group_octets - 1) / group_octets, full = rows / 16, tail = rows % 16;
    const int two = U2 != NULL;
    int32_t sums[BLOCK][BLOCK] __attribute__((aligned(64)));
    float acc[BLOCK][BLOCK] __attribute__((aligned(64))), acc2[BLOCK][BLOCK] __attribute__((aligned(64)));
    int8_t apad[16][64] __attribute__((aligned(64)));
    memset(apad, 0, sizeof apad);
    amx_configure((int)tail, step == 4);
    for (int64_t t = 0; t <= full; t++) {
        if (t == full && !tail) break;
        const int64_t r0 = t * 16, n = t < full ? 16 : tail;
        const int8_t *rows_a = A + r0 * lda;
        const int32_t *asum_rows = asum + r0 * G;
        memset(acc, 0, sizeof acc);
        memset(acc2, 0, sizeof acc2);
        if (t < full)
            TILE_PASS(0, 1, 5);
        else
            TILE_PASS(3, 4, 7);
        for (int64_t r = 0; r < n; r++) {
            const float s = sx[r0 + r];
            for (int64_t c = 0; c < cols_out; c++) C[(r0 + r) * ldc + c] = acc[r][c] * s;
            if (two)
                for (int64_t c = 0; c < cols_out; c++) C2[(r0 + r) * ldc + c] = acc2[r][c] * s;
        }
    }
}

/* a thread's scratch for the unpacked blocks (grown as needed, kept for the thread's life) */
static __thread uint8_t *scratch;
static __thread size_t scratch_bytes;

static uint8_t *thread_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* kernels.h's int4w_fn (int4.c's ms_int4_wblock: B and B2 widened to 16 columns by the
 * caller, cols B's real width; all 16 columns of C written) on tiles from MIN_ROWS rows */
void ms_amx_int4_wblock(const int8_t *A, int64_t lda, const float *sx, const int32_t *asum, int64_t rows,
                        int64_t octets, int64_t group_octets, int64_t ld, int mx, const uint8_t *B, const float *sc,
                        const int8_t *zero, int64_t cols, float *C, const uint8_t *B2, const float *sc2,
                        const int8_t *zero2, float *C2, int64_t ldc) {
    const int64_t step = step_octets(octets, group_octets), G = (octets + group_octets - 1) / group_octets;
    const int64_t padded = (octets + 7) / 8 * 8, unpacked = padded * 128;
    const size_t bytes = (size_t)(unpacked * (B2 ? 2 : 1)) + (asum ? 0 : sizeof(int32_t) * (size_t)(rows * G));
    uint8_t *s = ms_amx_int4_takes(rows, octets, group_octets) ? thread_scratch(bytes) : NULL;
    if (!s) { /* a few rows, groups the tiles do not take, or no memory */
        fallback_wblock(A, lda, sx, asum, rows, octets, group_octets, ld, mx, B, sc, zero, cols, C, B2, sc2, zero2, C2,
                        ldc);
        return;
    }
    uint8_t *U = s, *U2 = B2 ? s + unpacked : NULL;
    if (!asum) {
        int32_t *own = (int32_t *)(s + unpacked * (B2 ? 2 : 1));
        for (int64_t m = 0; m < rows; m++) group_sums(A + m * lda, octets, group_octets, own + m * G);
        asum = own;
    }
    const int32_t zdef = mx ? MX_ZERO : 8;
    const block_params p = {sc, zero, ld, cols, zdef}, p2 = {sc2, zero2, ld, BLOCK, zdef};
    unpack_block(B, octets, BLOCK, mx, padded, U);
    if (B2) unpack_block(B2, octets, BLOCK, mx, padded, U2);
    tile_rows(A, lda, sx, asum, rows, octets, group_octets, step, U, U2, &p, &p2, C, C2, ldc, BLOCK);
}

/* int4.c's ms_int4_linear (the same arguments and results) on tiles from MIN_ROWS rows: each
 * thread unpacks a block of 16 columns once and runs every row over it */
int ms_amx_int4_linear(const int8_t *q, int64_t ldq, const float *sx, int64_t M, int64_t Kp, const uint8_t *w,
                       const float *scale, const int8_t *zero, int64_t group, int64_t N, int mx, float *y, int64_t ldy,
                       int nthreads) {
    if (Kp % 8 || group % 8 || group <= 0 || M < 0 || N < 0) return 1;
    const int64_t octets = Kp / 8, group_octets = group / 8, step = step_octets(octets, group_octets);
    if (!ms_amx_int4_takes(M, octets, group_octets))
        return fallback_linear(q, ldq, sx, M, Kp, w, scale, zero, group, N, mx, y, ldy, nthreads);
    const int64_t G = (octets + group_octets - 1) / group_octets, blocks = (N + BLOCK - 1) / BLOCK;
    const int64_t full = N / BLOCK, padded = (octets + 7) / 8 * 8;
    int32_t *asum = malloc(sizeof(int32_t) * (size_t)(M * G + 1));
    if (!asum) return -1;
    for (int64_t m = 0; m < M; m++) group_sums(q + m * ldq, octets, group_octets, asum + m * G);
    ms_amx_new_call(); /* called from Python: the threads' tiles may hold another library's shape */
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (M * N * Kp > 65536)
    {
        uint8_t *U = aligned_alloc(64, (size_t)(padded * 128));
        if (!U) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < blocks; j++) {
                const int64_t cols = j < full ? BLOCK : N - full * BLOCK;
                unpack_block(w + j * BLOCK * 4 * octets, octets, cols, mx, padded, U);
                const block_params p = {scale + j * BLOCK, zero ? zero + j * BLOCK : NULL, N, cols, mx ? MX_ZERO : 8};
                tile_rows(q, ldq, sx, asum, M, octets, group_octets, step, U, NULL, &p, NULL, y + j * BLOCK, NULL, ldy,
                          cols);
            }
        }
        free(U);
    }
    free(asum);
    return failed ? -1 : 0;
}
