/* AMX register tiles for the kernels' products with many rows (Sapphire Rapids and later):
 * the AVX-512 build of kernels.c hands a block of 16 output columns times a group of rows to
 * ms_amx_block when the CPU has AMX (cpu_kernels.enable sets the pointer). Built as its own
 * object so a compiler or CPU without AMX keeps the AVX-512 kernels.
 *
 * The packed weight layout (kernels.c) is the B operand as the tile instruction reads it:
 * 16 input pairs x 16 columns x 2 bf16 = one 1 KB tile, contiguous. A is the rows as bf16,
 * 32 inputs per tile row. One tile multiply-accumulates 16 x 16 x 32 products.
 *
 * int8 weights (W8A8) take the int8 tiles the same way (ms_amx_int8_block): 16 input quads x
 * 16 columns x 4 bytes = one 1 KB tile of the packed 8-bit layout, A the rows' signed bytes,
 * 64 inputs per tile row; TDPBSSD multiplies signed by signed into int32.
 *
 * With -DMS_AMX_EMULATED the tile instructions come from amx_emulation.h (plain C with the
 * instructions' documented semantics), so the tests check this file's logic on any CPU.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"

typedef uint16_t bf16;

#if defined(MS_AMX_EMULATED)
__thread amx_emu_state amx_emu; /* the emulated registers, one set a thread for the library */
#endif

/* Linux hands out the AMX register state only after this request (once per process). */
int ms_amx_init(void) {
#if defined(MS_AMX_EMULATED)
    return 1;
#else
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#endif
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* The tiles amx_tiles.h lists. A thread keeps its configuration from block to block within
 * one call of the kernel library (loading and releasing it for every block of 16 columns cost
 * 4-5% of a batched decode step, bench/NOTES.md), and loads it again for a new tail or a new
 * call: between calls, other libraries in the process (oneDNN) use the same threads' tiles
 * and release them. The library's outermost calls bump call_epoch (ms_amx_new_call, from
 * region_enter; amx_int4.c's own linear) before their parallel regions start. */
static uint64_t call_epoch = 1;
static __thread uint64_t configured_epoch;
static __thread int configured_tail, configured_grouped;

void ms_amx_new_call(void) { __atomic_add_fetch(&call_epoch, 1, __ATOMIC_RELAXED); }

/* grouped: the int8 products with an activation scale per 32 inputs (ms_amx_int8_grouped),
 * 4-bit weights' groups of 32: A tiles of 32 bytes a row and B tiles of 8 quad rows, one
 * group a multiply */
void amx_configure(int tail, int grouped) {
    const uint64_t epoch = __atomic_load_n(&call_epoch, __ATOMIC_RELAXED);
    if (configured_epoch == epoch && configured_tail == tail && configured_grouped == grouped) return;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = cfg.rows[5] = cfg.rows[6] = 16;
    cfg.rows[3] = cfg.rows[4] = cfg.rows[7] = (uint8_t)(tail ? tail : 16);
    if (grouped) {
        cfg.colsb[1] = cfg.colsb[4] = 32;
        cfg.rows[2] = cfg.rows[6] = 8;
    }
#if defined(MS_AMX_EMULATED)
    _tile_loadconfig(&cfg);
#else
    /* an asm that reads all 64 bytes: with GCC 12's _tile_loadconfig builtin, the optimiser
     * dropped the stores of colsb and rows before it once configure was not inlined */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
#endif
    configured_epoch = epoch, configured_tail = tail, configured_grouped = grouped;
}

static void configure(int tail) { amx_configure(tail, 0); }

/* bytes a tile load looks ahead along its block's stream (2-4 KB measured best; 8 KB and
 * more, slower) */
#define PREFETCH_AHEAD 4096

static inline void prefetch_tile(const int8_t *b) {
    for (int line = 0; line < 1024; line += 64) __builtin_prefetch(b + PREFETCH_AHEAD + line, 0, 3);
}

/* C[r][0..16) = sum_k A[r][k] B[k][.] for r < rows: A bf16 rows (stride lda elements, Kp
 * columns), B one packed 16-column block (Kp / 2 pair rows), C float32 (stride ldc). Kp is a
 * multiple of 32 (the caller checks). */
void ms_amx_block(const bf16 *A, int64_t lda, int64_t rows, const bf16 *B, int64_t Kp, float *C, int64_t ldc) {
    const int64_t full = rows / 16, tail = rows % 16;
    configure((int)tail);
    for (int64_t g = 0; g < full; g++) {
        _tile_zero(0);
        for (int64_t k = 0; k < Kp; k += 32) {
            _tile_loadd(1, A + g * 16 * lda + k, lda * sizeof(bf16));
            _tile_loadd(2, B + k * 16, 64);
            prefetch_tile((const int8_t *)(B + k * 16));
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, C + g * 16 * ldc, ldc * sizeof(float));
    }
    if (tail) {
        _tile_zero(3);
        for (int64_t k = 0; k < Kp; k += 32) {
            _tile_loadd(4, A + full * 16 * lda + k, lda * sizeof(bf16));
            _tile_loadd(2, B + k * 16, 64);
            prefetch_tile((const int8_t *)(B + k * 16));
            _tile_dpbf16ps(3, 4, 2);
        }
        _tile_stored(3, C + full * 16 * ldc, ldc * sizeof(float));
    }
}

/* The int8 products (kernels.h int8_fn): for each job's block, C[r][0..16) = the exact int32
 * sums of row r of A times the block's columns, r < rows: A signed bytes (stride lda, Kq
 * columns), B one packed 16-column int8 block (Kq / 4 quad rows); Kq a multiple of 64 (the
 * caller checks). colsum: unused (signed products need no offset). TDPBSSD multiplies signed
 * by signed into int32, and a tile accumulates every input: one store per block and 16 rows.
 *
 * At a few rows per expert these products wait on memory: a tile load stalls until its 16
 * lines arrive. So blocks go two at a time (two streams of weights in flight, one load of
 * the rows for both), and each tile load asks for the lines PREFETCH_AHEAD bytes further
 * along its stream (measured on a Xeon with AMX: one core streaming from memory 6.5 -> 9.8
 * GB/s, bench/NOTES.md). */
typedef struct {
    const int8_t *B;
    const int32_t *colsum;
    int32_t *C;
} int8_job;

/* n rows (n <= 16) times blocks b0 and, if `two`, b1, on tiles C and A (and C2 for b1;
 * constants: the tile instructions take their register numbers as immediates) */
#define INT8_ROWS(C_TILE, A_TILE, C2_TILE)                                                     \
    do {                                                                                       \
        _tile_zero(C_TILE);                                                                    \
        if (two) _tile_zero(C2_TILE);                                                          \
        for (int64_t k = 0; k < Kq; k += 64) {                                                 \
            _tile_loadd(A_TILE, rows_a + k, lda);                                              \
            _tile_loadd(2, b0 + k * 16, 64);                                                   \
            prefetch_tile(b0 + k * 16);                                                        \
            _tile_dpbssd(C_TILE, A_TILE, 2);                                                   \
            if (two) {                                                                         \
                _tile_loadd(6, b1 + k * 16, 64);                                               \
                prefetch_tile(b1 + k * 16);                                                    \
                _tile_dpbssd(C2_TILE, A_TILE, 6);                                              \
            }                                                                                  \
        }                                                                                      \
        _tile_stored(C_TILE, c0, ldc * sizeof(int32_t));                                       \
        if (two) _tile_stored(C2_TILE, c1, ldc * sizeof(int32_t));                             \
    } while (0)

void ms_amx_int8_block(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const int8_job *jobs, int64_t count,
                       int64_t ldc) {
    const int64_t full = rows / 16, tail = rows % 16;
    configure((int)tail);
    for (int64_t b = 0; b < count; b += 2) {
        const int two = b + 1 < count;
        const int8_t *b0 = jobs[b].B, *b1 = two ? jobs[b + 1].B : NULL;
        for (int64_t g = 0; g <= full; g++) {
            if (g == full && !tail) break;
            const int8_t *rows_a = A + g * 16 * lda;
            int32_t *c0 = jobs[b].C + g * 16 * ldc, *c1 = two ? jobs[b + 1].C + g * 16 * ldc : NULL;
            if (g < full)
                INT8_ROWS(0, 1, 5);
            else
                INT8_ROWS(3, 4, 7);
        }
    }
}

/* The int8 products with an activation scale per 32 inputs (kernels.h int8g_fn; Kq a multiple
 * of 32, the caller checks): one TDPBSSD a group (16 rows x 32 inputs x 16 columns, its exact
 * int32 sums at most 32 * 127 * 127 = 516,128 in magnitude, exact in float32), stored, and
 * acc = fma(float(sum), the row's group scale, acc), group by group: the FMAs of every other
 * int8 path, in their order, so the same floats. */
static inline void add_group(float *acc, const int32_t *sums, float s) {
#if defined(MS_AMX_EMULATED)
    for (int c = 0; c < 16; c++) acc[c] = fmaf((float)sums[c], s, acc[c]);
#else
    _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums)), _mm512_set1_ps(s),
                                          _mm512_loadu_ps(acc)));
#endif
}

/* n rows (n <= 16) of block B times the groups, on tiles C and A */
#define INT8_GROUPED_ROWS(C_TILE, A_TILE)                                                      \
    do {                                                                                       \
        memset(acc, 0, sizeof acc);                                                            \
        for (int64_t g = 0; g < Kq / 32; g++) {                                                \
            _tile_zero(C_TILE);                                                                \
            _tile_loadd(A_TILE, rows_a + g * 32, lda);                                         \
            _tile_loadd(2, B + g * 512, 64);                                                   \
            for (int line = 0; line < 512; line += 64)                                         \
                __builtin_prefetch(B + g * 512 + PREFETCH_AHEAD + line, 0, 3);                 \
            _tile_dpbssd(C_TILE, A_TILE, 2);                                                   \
            _tile_stored(C_TILE, sums, 64);                                                    \
            for (int64_t r = 0; r < n; r++) add_group(acc[r], sums[r], sa[(r0 + r) * lds + g]); \
        }                                                                                      \
    } while (0)

void ms_amx_int8_grouped(const int8_t *A, int64_t lda, int64_t rows, int64_t Kq, const float *sa, int64_t lds,
                         const int8_job *jobs, int64_t count, int64_t ldc) {
    const int64_t full = rows / 16, tail = rows % 16;
    amx_configure((int)tail, 1);
    int32_t sums[16][16] __attribute__((aligned(64)));
    float acc[16][16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < count; b++) {
        const int8_t *B = jobs[b].B;
        for (int64_t t = 0; t <= full; t++) {
            if (t == full && !tail) break;
            const int64_t r0 = t * 16, n = t < full ? 16 : tail;
            const int8_t *rows_a = A + r0 * lda;
            if (t < full)
                INT8_GROUPED_ROWS(0, 1);
            else
                INT8_GROUPED_ROWS(3, 4);
            float *c = (float *)jobs[b].C + r0 * ldc;
            for (int64_t r = 0; r < n; r++) memcpy(c + r * ldc, acc[r], sizeof acc[r]);
        }
    }
}
