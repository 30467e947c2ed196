/* The AMX tile instructions amx.c uses, in plain C with their documented semantics (Intel
 * SDM, "Intel AMX"): for tests on CPUs without AMX (amx.c built with -DMS_AMX_EMULATED).
 * Eight tile registers of up to 16 rows x 64 bytes per thread, shaped by the last
 * configuration; TDPBF16PS: C[m][n] += sum over pairs k of A[m][2k] B[k][2n] +
 * A[m][2k+1] B[k][2n+1], in float32; TDPBSSD: C[m][n] += sum over quads k of the four
 * products of signed bytes A[m][4k + i] B[k][4n + i], in int32; TDPBSUD: the same with B's
 * bytes unsigned. The registers are one state per thread for every file of the library
 * (amx.c defines it, amx_int4.c shares its configuration). */
#ifndef MS_AMX_EMULATION_H
#define MS_AMX_EMULATION_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t data[8][16][64];
    int rows[8], colsb[8];
} amx_emu_state;
extern __thread amx_emu_state amx_emu __attribute__((visibility("hidden")));

static inline float amx_emu_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void _tile_loadconfig(const void *config) {
    const uint8_t *c = config;
    for (int t = 0; t < 8; t++) {
        amx_emu.colsb[t] = c[16 + 2 * t] | (c[17 + 2 * t] << 8);
        amx_emu.rows[t] = c[48 + t];
    }
}

static inline void _tile_zero(int t) { memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]); }

static inline void _tile_loadd(int t, const void *base, int64_t stride) {
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy(amx_emu.data[t][r], (const uint8_t *)base + r * stride, amx_emu.colsb[t]);
}

static inline void _tile_stored(int t, void *base, int64_t stride) {
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy((uint8_t *)base + r * stride, amx_emu.data[t][r], amx_emu.colsb[t]);
}

static inline void _tile_dpbf16ps(int c, int a, int b) {
    for (int m = 0; m < amx_emu.rows[c]; m++)
        for (int n = 0; n < amx_emu.colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, &amx_emu.data[c][m][4 * n], 4);
            for (int k = 0; k < amx_emu.colsb[a] / 4; k++) {
                uint16_t a0, a1, b0, b1;
                memcpy(&a0, &amx_emu.data[a][m][4 * k], 2);
                memcpy(&a1, &amx_emu.data[a][m][4 * k + 2], 2);
                memcpy(&b0, &amx_emu.data[b][k][4 * n], 2);
                memcpy(&b1, &amx_emu.data[b][k][4 * n + 2], 2);
                acc += amx_emu_bf16(a0) * amx_emu_bf16(b0) + amx_emu_bf16(a1) * amx_emu_bf16(b1);
            }
            memcpy(&amx_emu.data[c][m][4 * n], &acc, 4);
        }
}

/* TDPBSSD / TDPBSUD: signed bytes of A times B's, signed or (b_unsigned) unsigned */
static inline void amx_emu_dpbs(int c, int a, int b, int b_unsigned) {
    for (int m = 0; m < amx_emu.rows[c]; m++)
        for (int n = 0; n < amx_emu.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &amx_emu.data[c][m][4 * n], 4);
            for (int k = 0; k < amx_emu.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t wb = amx_emu.data[b][k][4 * n + i];
                    acc += (int32_t)(int8_t)amx_emu.data[a][m][4 * k + i] * (b_unsigned ? (int32_t)wb : (int8_t)wb);
                }
            memcpy(&amx_emu.data[c][m][4 * n], &acc, 4);
        }
}

static inline void _tile_dpbssd(int c, int a, int b) { amx_emu_dpbs(c, a, b, 0); }
static inline void _tile_dpbsud(int c, int a, int b) { amx_emu_dpbs(c, a, b, 1); }

#endif
