/* 4-bit weights times int8 activations (W4A8), the linear layer of quantization/qweight.py's
 * int4 and mxfp4 formats: a float32 scale per output column and group of inputs (int4: 32, 64,
 * 128 or a whole column; mxfp4: 32), int8 activations with one scale a row (quantized by the
 * caller, rotated where the weights are). A library of its own, built per path and loaded
 * where the CPU reports its extension (cpu_kernels.enable): -DMS_AVX512 with -mavx512vnni,
 * vpdpbusd on 16 columns; AVX2's with -mavxvnni -DMS_INT4_VNNI, AVX-VNNI's vpdpbusd on 8 (on
 * SIMDe's with -DMS_SIMDE: the tests' emulation); or the AVX2 build, vpmaddubsw on 8, its int16
 * sums widened (vpmaddwd) once every few octets (every AVX2 CPU). With -ffp-contract=off: the
 * float sums are the torch reference's, rounding for rounding. Where the CPU has AMX,
 * amx_int4.c runs the products of many rows on int8 tiles (the same layout and floats) and
 * hands this library the rest (one row, groups that fill no whole tile step).
 *
 * Packed layout (cpu_kernels.pack_qweight): unsigned nibbles in [0, 15]; blocks of 16 output
 * columns, each a run of 64-byte rows, one per octet of inputs: byte 4c + j of row o holds
 * column c's input 8o + j in its low nibble and 8o + 4 + j in its high one. A mask gives the
 * low quad, a shift and the mask the high one: each lane of a vector a column's 4
 * consecutive inputs, the quad vpdpbusd and vpmaddubsw read (the int8 layout's, half the
 * bytes). The last N % 16 columns a narrower block, padded here.
 * The nibbles' bytes u and each (group, column)'s integer zero z: int4's nibbles are the
 * levels, u = level, z the zero point (8 where symmetric: u = v + 8); mxfp4's are e2m1 codes,
 * which a register lookup (vpshufb) turns into u = 2 * e2m1 + 12 in [0, 24], z = 12. Either
 * way the weight is (u - z) * scale.
 * ms_int4_linear is the linear layer; ms_int4_wblock the products of one block that the main
 * library's kernels (wmat.c: linear layers, MoE, the fused step) call through kernels.h's
 * int4w_fn (cpu_kernels.enable sets it), reading the weight's scales and zero points in place.
 * One row (decode) runs block_row: its sums in registers, in independent chains.
 *
 * Each group's exact sum: sum(u * x) - z * sum(x) (the zero taken off with the activations'
 * group sum, in int32); unsigned bytes times signed bytes is what both instructions multiply,
 * and no pair sum nears vpmaddubsw's int16 saturation (2 * 24 * 127). Then, in order: acc =
 * 0; acc += float(group sum) * scale[g], g = 0, 1, ...; y = acc * row scale.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 16
#define VPB (BLOCK / VL) /* vectors a block of 16 columns spans */
/* rows a tile shares each unpacked weight vector with: a sum register each (and VPB) */
#if defined(MS_AVX512)
#define MR 8
#else
#define MR 4
#endif

static inline vi nibble_mask(void) { return vi_set1(0x0f0f0f0f); }

/* mxfp4: e2m1 code c -> 2 * e2m1(c) + 12 (qweight.E2M1_DOUBLED + 12), one table a 128-bit lane */
#define MX_TABLE 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
#define MX_ZERO 12

#if defined(MS_AVX512)
static inline vi high_nibbles(vi w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble_mask()); }
static inline vi dot4(vi acc, vi u8, vi s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
static inline vi mx_table(void) { return _mm512_broadcast_i32x4(_mm_setr_epi8(MX_TABLE)); }
static inline vi lookup(vi table, vi nibbles) { return _mm512_shuffle_epi8(table, nibbles); }
static inline vi mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
#else
static inline vi high_nibbles(vi w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble_mask()); }
static inline vi mx_table(void) { return _mm256_broadcastsi128_si256(_mm_setr_epi8(MX_TABLE)); }
static inline vi lookup(vi table, vi nibbles) { return _mm256_shuffle_epi8(table, nibbles); }
static inline vi mullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
#if defined(MS_INT4_VNNI) && defined(MS_SIMDE)
static inline vi dot4(vi acc, vi u8, vi s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(MS_INT4_VNNI)
static inline vi dot4(vi acc, vi u8, vi s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
#define SUMS16
static inline vi dot4(vi acc, vi u8, vi s8) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u8, s8)); }
#endif
#endif

/* Where the products are vpmaddubsw's (AVX2 without VNNI), its int16 pair sums add up as int16
 * (vpaddw) over a span of octets and widen to int32 once (vpmaddwd by ones) where each quad's
 * took its own vpmaddwd: half the multiplies. Exact while every lane's int16 sum stays in
 * range, all of a span's chains added: an octet adds at most 2 quads x 2 x 15 x 128 = 7,680
 * (int4) or 2 x 2 x 24 x 128 = 12,288 (mxfp4, u up to 24), so spans of 4 octets, or 2.
 * Elsewhere the sums are int32 already and a span is the whole group. */
#if defined(SUMS16)
static inline int64_t span_end(int64_t o, int64_t o1, const int mx) {
    const int64_t octets = mx ? 2 : 4;
    return o + octets < o1 ? o + octets : o1;
}
static inline vi widen(vi s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
/* the spans [o, o2) of a group's octets [o0, o1); o ends each span's body at o2 */
#define FOR_SPANS(o, o2, o0, o1, mx) for (int64_t o = (o0), o2; o < (o1) && ((o2 = span_end(o, (o1), (mx))), 1);)
#else
/* one span, the group: a loop the compiler sees run once, so the code is a plain group's */
#define FOR_SPANS(o, o2, o0, o1, mx) for (int64_t o = (o0), o2 = (o1), once_ = 1; once_; once_ = 0)
#endif

/* a span's chains t[0..n) (stride `stride` vectors of VPB) into the group's sums s: where the
 * span is int16 (SUMS16), all of them added (high_sum is the identity there) and widened into
 * s[0]; elsewhere each into its own */
static inline __attribute__((always_inline)) void fold_span(vi *s, const vi *t, int n, int stride) {
    for (int v = 0; v < VPB; v++) {
#if defined(SUMS16)
        vi all = t[v];
        for (int u = 1; u < n; u++) all = _mm256_add_epi16(all, t[u * stride + v]);
        s[v] = vi_add(s[v], widen(all));
#else
        for (int u = 0; u < n; u++) s[u * stride + v] = vi_add(s[u * stride + v], t[u * stride + v]);
#endif
    }
}

/* The high nibbles as the products take them: AVX-512's vpdpbusd never saturates, so there a
 * high nibble multiplies as 16 times itself, the byte's low half masked off (one instruction
 * where a shift and a mask were two: at 4 rows an expert the unpacking is a quarter of the
 * tile's instructions), and high_sum takes those sums down by 16 once a group, exactly (each a
 * multiple of 16, and within int32 for groups up to 139,000 inputs: an octet adds at most
 * 4 * 240 * 128 to a lane). AVX2's vpmaddubsw would saturate: the nibble itself there.
 * mxfp4's codes are looked up from the nibbles, low and high alike. */
static inline vi low_operand(vi w, vi table, const int mx) {
    const vi l = vi_and(w, nibble_mask());
    return mx ? lookup(table, l) : l;
}
#if defined(MS_AVX512)
static inline vi high_operand(vi w, vi table, const int mx) {
    return mx ? lookup(table, high_nibbles(w)) : vi_and(w, vi_set1((int32_t)0xf0f0f0f0u));
}
static inline vi high_sum(vi s, const int mx) { return mx ? s : vi_srai(s, 4); }
#else
static inline vi high_operand(vi w, vi table, const int mx) { return mx ? lookup(table, high_nibbles(w)) : high_nibbles(w); }
static inline vi high_sum(vi s, const int mx) {
    (void)mx;
    return s;
}
#endif

#if defined(MS_AVX512)
/* acc + u8's quads times the signed quad at a, broadcast by vpdpbusd's own memory operand
 * ({1to16}). The tile's rows each meet an octet's quads once (VPB 1), and GCC, given a
 * broadcast (quad), spends an instruction of its own on it: 8 of some 19 an octet at 4 rows. */
static inline vi dot4_at(vi acc, vi u8, const int8_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*(const int32_t *)a));
    return acc;
}
#endif

static inline vi quad(const int8_t *a) {
    int32_t x4;
    memcpy(&x4, a, 4);
    return vi_set1(x4);
}

/* Asks for the weight bytes PREFETCH_OCTETS octets (64-byte lines) past octet o, into L2: a
 * block's octets, and the next block's after them, lie back to back. With the hardware's
 * prefetch alone the MoE kernel read its experts at 14-17 GB/s of this VM's 27 at 32 tokens
 * (AMD EPYC Zen 4; ~4 rows an expert, the many-row tile), 19-22 GB/s so (16 octets into L1:
 * 15-18). Since the MoE kernel hands each thread long runs of consecutive blocks, 96 octets
 * ahead beat 48 (1.74 -> 1.60 ms a layer at 32 tokens; 160: the same; prefetcht0, nta or a
 * line in two: slower). Past the weight's end the address is only a hint: prefetches do not
 * fault. */
#define PREFETCH_OCTETS 96
static inline void prefetch_octet(const uint8_t *B, int64_t o) { __builtin_prefetch(B + (o + PREFETCH_OCTETS) * 64, 0, 2); }

/* a block's scales and zero points, read in place from the weight's [G][N] arrays: sc and
 * zero (NULL: every zero zdef) at stride ld between groups, their first `cols` columns (a
 * narrow last block's other columns take scale 0 and zero 0: its outputs there are dropped) */
typedef struct {
    const float *sc;
    const int8_t *zero;
    int64_t ld, cols;
    int32_t zdef;
} block_params;

/* VL int8 -> int32 */
#if defined(MS_AVX512)
static inline vi load_s8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vi load_s8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#endif

/* group g's scales s[VPB] and zero points z[VPB] of a block */
static inline void group_params(const block_params *p, int64_t g, vf *s, vi *z) {
    if (p->cols == BLOCK) {
        for (int v = 0; v < VPB; v++) {
            s[v] = vf_load(p->sc + g * p->ld + v * VL);
            z[v] = p->zero ? load_s8(p->zero + g * p->ld + v * VL) : vi_set1(p->zdef);
        }
        return;
    }
    float sp[BLOCK];
    int32_t zp[BLOCK];
    for (int64_t c = 0; c < BLOCK; c++) {
        sp[c] = c < p->cols ? p->sc[g * p->ld + c] : 0.0f;
        zp[c] = c >= p->cols ? 0 : p->zero ? p->zero[g * p->ld + c] : p->zdef;
    }
    for (int v = 0; v < VPB; v++) {
        s[v] = vf_load(sp + v * VL);
        z[v] = vi_load(zp + v * VL);
    }
}

/* Asks for the next block's scales and zero points (the next 16 columns of each group's row,
 * the block the MoE kernel's and the linear's threads mostly take next) into L2: each group's
 * are a line of their own, ld columns from the last, which the hardware's prefetch does not
 * follow; loaded cold, they were a tenth of the AVX2 tile's samples (AMD EPYC Zen 3, 32 tokens
 * on medium's experts). Past the arrays' ends the address is only a hint. */
static inline void prefetch_next_params(const block_params *p, int64_t G) {
    for (int64_t g = 0; g < G; g++) {
        __builtin_prefetch(p->sc + g * p->ld + BLOCK, 0, 2);
        if (p->zero) __builtin_prefetch(p->zero + g * p->ld + BLOCK, 0, 2);
    }
}

/* octet o of rows [0, rows) times the block: each row's low quads' sums into lo[m], its high
 * ones' into hi[m] on AVX-512 (two chains a row: a few rows' sums would otherwise wait on
 * vpdpbusd's latency); AVX2's 16 registers hold one chain a row, both quads into lo[m] */
static inline __attribute__((always_inline)) void octet_tile(int rows, const int8_t *q, int64_t ldq, const uint8_t *B,
                                                             int64_t o, vi table, const int mx, vi lo[MR][VPB],
                                                             vi hi[MR][VPB]) {
    vi wl[VPB], wh[VPB];
    prefetch_octet(B, o);
    for (int v = 0; v < VPB; v++) {
        const vi w = vi_load(B + o * 64 + v * 4 * VL);
        wl[v] = low_operand(w, table, mx);
        wh[v] = high_operand(w, table, mx);
    }
    for (int m = 0; m < rows; m++) {
#if defined(MS_AVX512)
        lo[m][0] = dot4_at(lo[m][0], wl[0], q + m * ldq + 8 * o);
        hi[m][0] = dot4_at(hi[m][0], wh[0], q + m * ldq + 8 * o + 4);
#else
        const vi xl = quad(q + m * ldq + 8 * o), xh = quad(q + m * ldq + 8 * o + 4);
        (void)hi;
        for (int v = 0; v < VPB; v++) lo[m][v] = dot4(dot4(lo[m][v], wl[v], xl), wh[v], xh);
#endif
    }
}

/* rows [0, rows) of q times one block of 16 columns: B its packed bytes (octets of 64 bytes),
 * p its scales and zeros, asum the rows' group sums [rows][G], sx the rows' scales;
 * y[m][0..16). rows and mx are constants where it is inlined (tile), so the sums stay in
 * registers; two rows take two octets a step, in chains of their own. mx: the nibbles are
 * mxfp4 codes, looked up. */
static inline __attribute__((always_inline)) void block_tile(int rows, const int8_t *q, int64_t ldq,
                                                             const int32_t *asum, int64_t G, const float *sx,
                                                             const uint8_t *B, int64_t octets, int64_t group_octets,
                                                             const block_params *p, const int mx, float *y,
                                                             int64_t ldy) {
    float acc[MR][BLOCK] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    const vi table = mx_table();
    prefetch_next_params(p, G);
    const int unroll = rows <= 2 ? 2 : 1;
    for (int64_t g = 0; g < G; g++) {
        const int64_t o0 = g * group_octets, o1 = o0 + group_octets < octets ? o0 + group_octets : octets;
        vi s[4][MR][VPB]; /* per octet of a step: low quads' sums, high quads' */
        for (int u = 0; u < 4; u++)
            for (int m = 0; m < rows; m++)
                for (int v = 0; v < VPB; v++) s[u][m][v] = vi_set1(0);
        FOR_SPANS(o, o2, o0, o1, mx) {
            vi t[4][MR][VPB];
            for (int u = 0; u < 4; u++)
                for (int m = 0; m < rows; m++)
                    for (int v = 0; v < VPB; v++) t[u][m][v] = vi_set1(0);
            if (unroll == 2)
                for (; o + 2 <= o2; o += 2) {
                    octet_tile(rows, q, ldq, B, o, table, mx, t[0], t[1]);
                    octet_tile(rows, q, ldq, B, o + 1, table, mx, t[2], t[3]);
                }
            for (; o < o2; o++) octet_tile(rows, q, ldq, B, o, table, mx, t[0], t[1]);
            for (int m = 0; m < rows; m++) fold_span(s[0][m], t[0][m], 4, MR * VPB);
        }
        vf sc[VPB];
        vi zp[VPB];
        group_params(p, g, sc, zp);
        for (int m = 0; m < rows; m++) {
            const vi total = vi_set1(asum[m * G + g]);
            for (int v = 0; v < VPB; v++) {
                const vi isum = vi_add(vi_add(s[0][m][v], s[2][m][v]), high_sum(vi_add(s[1][m][v], s[3][m][v]), mx));
                const vf exact = vi_to_vf(vi_sub(isum, mullo(total, zp[v]))); /* less z * the group's sum */
                vf_store(acc[m] + v * VL, vf_add(vf_load(acc[m] + v * VL), vf_mul(exact, sc[v])));
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        const vf r = vf_set1(sx[m]);
        for (int v = 0; v < VPB; v++) vf_store(y + m * ldy + v * VL, vf_mul(vf_load(acc[m] + v * VL), r));
    }
}

/* octets of inputs a one-row pass reads per step, each octet's low and high quads summed in
 * chains of their own: one chain waits on vpdpbusd's latency at every step */
#if defined(MS_AVX512)
#define ROW_UNROLL 4
#else
#define ROW_UNROLL 2
#endif

/* octet o of one row times the block: its low quads' sums into lo[VPB], its high ones' into hi */
static inline __attribute__((always_inline)) void octet_row(const int8_t *q, const uint8_t *B, int64_t o,
                                                            vi table, const int mx, vi *lo, vi *hi) {
    const vi xl = quad(q + 8 * o), xh = quad(q + 8 * o + 4);
    prefetch_octet(B, o);
    for (int v = 0; v < VPB; v++) {
        const vi w = vi_load(B + o * 64 + v * 4 * VL);
        const vi l = low_operand(w, table, mx), h = high_operand(w, table, mx);
        lo[v] = dot4(lo[v], l, xl);
        hi[v] = dot4(hi[v], h, xh);
    }
}

/* block_tile for one row (decode): the sums in registers, 2 * ROW_UNROLL independent chains
 * a group, added in int32 (exact, so in any order) before the same float steps */
static inline __attribute__((always_inline)) void block_row(const int8_t *q, const int32_t *asum, int64_t G, float sx,
                                                            const uint8_t *B, int64_t octets, int64_t group_octets,
                                                            const block_params *p, const int mx, float *y) {
    const vi table = mx_table();
    prefetch_next_params(p, G);
    vf acc[VPB];
    for (int v = 0; v < VPB; v++) acc[v] = vf_set1(0.0f);
    for (int64_t g = 0; g < G; g++) {
        const int64_t o0 = g * group_octets, o1 = o0 + group_octets < octets ? o0 + group_octets : octets;
        vi s[2 * ROW_UNROLL][VPB];
        for (int u = 0; u < 2 * ROW_UNROLL; u++)
            for (int v = 0; v < VPB; v++) s[u][v] = vi_set1(0);
        FOR_SPANS(o, o2, o0, o1, mx) {
            vi t[2 * ROW_UNROLL][VPB];
            for (int u = 0; u < 2 * ROW_UNROLL; u++)
                for (int v = 0; v < VPB; v++) t[u][v] = vi_set1(0);
            for (; o + ROW_UNROLL <= o2; o += ROW_UNROLL)
                for (int u = 0; u < ROW_UNROLL; u++) octet_row(q, B, o + u, table, mx, t[2 * u], t[2 * u + 1]);
            for (; o < o2; o++) octet_row(q, B, o, table, mx, t[0], t[1]);
            fold_span(s[0], t[0], 2 * ROW_UNROLL, VPB);
        }
        vf sc[VPB];
        vi zp[VPB];
        group_params(p, g, sc, zp);
        const vi total = vi_set1(asum[g]);
        for (int v = 0; v < VPB; v++) {
            vi low = s[0][v], high = s[1][v];
            for (int u = 1; u < ROW_UNROLL; u++) {
                low = vi_add(low, s[2 * u][v]);
                high = vi_add(high, s[2 * u + 1][v]);
            }
            const vi isum = vi_add(low, high_sum(high, mx));
            const vf exact = vi_to_vf(vi_sub(isum, mullo(total, zp[v])));
            acc[v] = vf_add(acc[v], vf_mul(exact, sc[v]));
        }
    }
    for (int v = 0; v < VPB; v++) vf_store(y + v * VL, vf_mul(acc[v], vf_set1(sx)));
}

/* one row times two blocks in one pass (the gate and up blocks of an expert, a linear layer's
 * pairs): each activation quad loaded once for both, half the group sums. PAIR_UNROLL octets
 * a step: 4 * PAIR_UNROLL chains a block pair (AVX2's 16 registers hold 4 x 2). */
#if defined(MS_AVX512)
#define PAIR_UNROLL 2
#else
#define PAIR_UNROLL 1
#endif

static inline __attribute__((always_inline)) void octet_pair(const int8_t *q, const uint8_t *B, const uint8_t *B2,
                                                             int64_t o, vi table, const int mx, vi *lo, vi *hi, vi *lo2,
                                                             vi *hi2) {
    const vi xl = quad(q + 8 * o), xh = quad(q + 8 * o + 4);
    prefetch_octet(B, o);
    prefetch_octet(B2, o);
    for (int v = 0; v < VPB; v++) {
        const vi w = vi_load(B + o * 64 + v * 4 * VL), w2 = vi_load(B2 + o * 64 + v * 4 * VL);
        const vi l = low_operand(w, table, mx), l2 = low_operand(w2, table, mx);
        const vi h = high_operand(w, table, mx), h2 = high_operand(w2, table, mx);
        lo[v] = dot4(lo[v], l, xl);
        hi[v] = dot4(hi[v], h, xh);
        lo2[v] = dot4(lo2[v], l2, xl);
        hi2[v] = dot4(hi2[v], h2, xh);
    }
}

/* block_row for two blocks (p, p2; outputs y, y2): each block's sums and float steps the
 * one-block pass's */
static inline __attribute__((always_inline)) void pair_row(const int8_t *q, const int32_t *asum, int64_t G, float sx,
                                                           const uint8_t *B, const uint8_t *B2, int64_t octets,
                                                           int64_t group_octets, const block_params *p,
                                                           const block_params *p2, const int mx, float *y,
                                                           float *y2) {
    const vi table = mx_table();
    prefetch_next_params(p, G);
    prefetch_next_params(p2, G);
    vf acc[VPB], acc2[VPB];
    for (int v = 0; v < VPB; v++) acc[v] = acc2[v] = vf_set1(0.0f);
    for (int64_t g = 0; g < G; g++) {
        const int64_t o0 = g * group_octets, o1 = o0 + group_octets < octets ? o0 + group_octets : octets;
        vi s[4 * PAIR_UNROLL][VPB]; /* per step: low quads of B, high of B, low of B2, high of B2 */
        for (int u = 0; u < 4 * PAIR_UNROLL; u++)
            for (int v = 0; v < VPB; v++) s[u][v] = vi_set1(0);
        FOR_SPANS(o, o2, o0, o1, mx) {
            vi t[4 * PAIR_UNROLL][VPB];
            for (int u = 0; u < 4 * PAIR_UNROLL; u++)
                for (int v = 0; v < VPB; v++) t[u][v] = vi_set1(0);
            for (; o + PAIR_UNROLL <= o2; o += PAIR_UNROLL)
                for (int u = 0; u < PAIR_UNROLL; u++)
                    octet_pair(q, B, B2, o + u, table, mx, t[4 * u], t[4 * u + 1], t[4 * u + 2], t[4 * u + 3]);
            for (; o < o2; o++) octet_pair(q, B, B2, o, table, mx, t[0], t[1], t[2], t[3]);
            /* B's chains (low, high of each step) and B2's, each block on its own */
            for (int u = 0; u < PAIR_UNROLL; u++) {
                fold_span(s[4 * u], t[4 * u], 2, VPB);
                fold_span(s[4 * u + 2], t[4 * u + 2], 2, VPB);
            }
        }
        vf sc[VPB], sc2[VPB];
        vi zp[VPB], zp2[VPB];
        group_params(p, g, sc, zp);
        group_params(p2, g, sc2, zp2);
        const vi total = vi_set1(asum[g]);
        for (int v = 0; v < VPB; v++) {
            vi low = s[0][v], high = s[1][v], low2 = s[2][v], high2 = s[3][v];
            for (int u = 1; u < PAIR_UNROLL; u++) {
                low = vi_add(low, s[4 * u][v]);
                high = vi_add(high, s[4 * u + 1][v]);
                low2 = vi_add(low2, s[4 * u + 2][v]);
                high2 = vi_add(high2, s[4 * u + 3][v]);
            }
            const vi isum = vi_add(low, high_sum(high, mx)), isum2 = vi_add(low2, high_sum(high2, mx));
            acc[v] = vf_add(acc[v], vf_mul(vi_to_vf(vi_sub(isum, mullo(total, zp[v]))), sc[v]));
            acc2[v] = vf_add(acc2[v], vf_mul(vi_to_vf(vi_sub(isum2, mullo(total, zp2[v]))), sc2[v]));
        }
    }
    for (int v = 0; v < VPB; v++) {
        vf_store(y + v * VL, vf_mul(acc[v], vf_set1(sx)));
        vf_store(y2 + v * VL, vf_mul(acc2[v], vf_set1(sx)));
    }
}

/* block_tile specialized on the rows (1..MR, one row on block_row) and on the nibbles' kind
 * (mx: mxfp4 codes): constants, so each form keeps its sums in registers */
static void tile(int mx, int rows, const int8_t *q, int64_t ldq, const int32_t *asum, int64_t G, const float *sx,
                 const uint8_t *B, int64_t octets, int64_t group_octets, const block_params *p, float *y,
                 int64_t ldy) {
#define TILE_ROWS(r)                                                                                   \
    case r:                                                                                            \
        if (mx)                                                                                        \
            block_tile(r, q, ldq, asum, G, sx, B, octets, group_octets, p, 1, y, ldy);                 \
        else                                                                                           \
            block_tile(r, q, ldq, asum, G, sx, B, octets, group_octets, p, 0, y, ldy);                 \
        return;
    switch (rows) {
    case 1:
        if (mx)
            block_row(q, asum, G, sx[0], B, octets, group_octets, p, 1, y);
        else
            block_row(q, asum, G, sx[0], B, octets, group_octets, p, 0, y);
        return;
        TILE_ROWS(2)
        TILE_ROWS(3)
        TILE_ROWS(4)
#if MR > 4
        TILE_ROWS(5)
        TILE_ROWS(6)
        TILE_ROWS(7)
        TILE_ROWS(8)
#endif
    }
#undef TILE_ROWS
}

/* each group's sum of one row's activations (x: 8 * octets bytes; groups of group_octets
 * octets) into asum[g]: what the zero points take off */
static void group_sums(const int8_t *x, int64_t octets, int64_t group_octets, int32_t *asum) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t g = 0, o0 = 0; o0 < octets; g++, o0 += group_octets) {
        const int64_t k1 = 8 * (o0 + group_octets < octets ? o0 + group_octets : octets);
        int64_t k = 8 * o0;
        __m256i s = _mm256_setzero_si256();
        for (; k + 32 <= k1; k += 32) /* byte pairs (1 * x, exact in int16), then pairs of those */
            s = _mm256_add_epi32(
                s, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)(x + k))), ones16));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
        int32_t total = _mm_cvtsi128_si32(h);
        for (; k < k1; k++) total += x[k];
        asum[g] = total;
    }
}

/* rows [0, rows) of A (stride lda, 8 * octets columns) times one block and, unless B2 is NULL,
 * a second (p2, into C2), MR rows at a time; the rows' group sums asum [rows][G], or NULL:
 * each MR rows' taken once for both blocks */
static void rows_times_blocks(const int8_t *A, int64_t lda, const float *sx, const int32_t *asum, int64_t rows,
                              const uint8_t *B, const uint8_t *B2, int64_t octets, int64_t group_octets,
                              const block_params *p, const block_params *p2, int mx, float *C, float *C2,
                              int64_t ldc) {
    const int64_t G = (octets + group_octets - 1) / group_octets;
    int32_t own[MR * G];
    for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int rows_here = rows - m0 < MR ? (int)(rows - m0) : MR;
        const int32_t *sums = asum ? asum + m0 * G : own;
        if (!asum)
            for (int m = 0; m < rows_here; m++) group_sums(A + (m0 + m) * lda, octets, group_octets, own + m * G);
        tile(mx, rows_here, A + m0 * lda, lda, sums, G, sx + m0, B, octets, group_octets, p, C + m0 * ldc, ldc);
        if (B2)
            tile(mx, rows_here, A + m0 * lda, lda, sums, G, sx + m0, B2, octets, group_octets, p2, C2 + m0 * ldc,
                 ldc);
    }
}

/* kernels.h's int4w_fn, the main library's 4-bit products (wmat.c; the MoE kernel, the linear
 * layers, the fused step): rows of A times one block B of `octets` 64-byte rows, the weight's
 * scales and zero points read in place (sc, zero: the block's first column of the [G][N]
 * arrays, stride ld; zero NULL: 8, or mxfp4's 12; cols: the block's real width), each row
 * times its scale sx[m]; and, unless B2 is NULL, a second full block B2 (sc2, zero2) into C2,
 * one row's in the same pass (pair_row). asum: the rows' group sums [rows][G] (NULL: taken
 * here) */
void ms_int4_wblock(const int8_t *A, int64_t lda, const float *sx, const int32_t *asum, int64_t rows, int64_t octets,
                    int64_t group_octets, int64_t ld, int mx, const uint8_t *B, const float *sc, const int8_t *zero,
                    int64_t cols, float *C, const uint8_t *B2, const float *sc2, const int8_t *zero2, float *C2,
                    int64_t ldc) {
    const int32_t zdef = mx ? MX_ZERO : 8;
    const block_params p = {sc, zero, ld, cols, zdef}, p2 = {sc2, zero2, ld, BLOCK, zdef};
    if (B2 && rows == 1) {
        const int64_t G = (octets + group_octets - 1) / group_octets;
        int32_t own[G];
        if (!asum) {
            group_sums(A, octets, group_octets, own);
            asum = own;
        }
        if (mx)
            pair_row(A, asum, G, sx[0], B, B2, octets, group_octets, &p, &p2, 1, C, C2);
        else
            pair_row(A, asum, G, sx[0], B, B2, octets, group_octets, &p, &p2, 0, C, C2);
        return;
    }
    rows_times_blocks(A, lda, sx, asum, rows, B, B2, octets, group_octets, &p, &p2, mx, C, C2, ldc);
}

/* y [M, N] float32 (stride ldy) = q [M, Kp] int8 (stride ldq; Kp a multiple of 8, zero past
 * the real inputs) times the packed 4-bit weight w [Kp/8][N][4] with scales [G][N] (G groups
 * of `group` inputs, a multiple of 8) and int4's zero points zero [G][N] (NULL: 8, or mxfp4's
 * 12), times each row's scale sx [M]. mx: the nibbles are mxfp4 codes. Returns 0, -1 when out
 * of memory, 1 for bad sizes. */
int ms_int4_linear(const int8_t *q, int64_t ldq, const float *sx, int64_t M, int64_t Kp, const uint8_t *w,
                   const float *scale, const int8_t *zero, int64_t group, int64_t N, int mx, float *y, int64_t ldy,
                   int nthreads) {
    if (Kp % 8 || group % 8 || group <= 0 || M < 0 || N < 0) return 1;
    const int64_t octets = Kp / 8, G = (Kp + group - 1) / group, blocks = (N + BLOCK - 1) / BLOCK;
    const int64_t full = N / BLOCK;
    int32_t *asum = malloc(sizeof(int32_t) * (size_t)(M * G + 1));
    if (!asum) return -1;
    for (int64_t m = 0; m < M; m++) group_sums(q + m * ldq, octets, group / 8, asum + m * G);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (M * N * Kp > 65536)
    {
        /* per thread: a padded tail block and its outputs */
        uint8_t *pad = N > full * BLOCK ? aligned_alloc(64, (size_t)(octets * 64)) : NULL;
        float *ytail = aligned_alloc(64, sizeof(float) * MR * BLOCK);
        if (!ytail || (N > full * BLOCK && !pad)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < blocks; j++) {
                const int64_t cols = j < full ? BLOCK : N - full * BLOCK;
                const uint8_t *B = w + j * BLOCK * 4 * octets;
                if (cols < BLOCK) { /* the tail block: [octets][cols][4] -> [octets][16][4] */
                    memset(pad, 0, (size_t)(octets * 64));
                    for (int64_t o = 0; o < octets; o++) memcpy(pad + o * 64, B + o * cols * 4, (size_t)(cols * 4));
                    B = pad;
                }
                const block_params p = {scale + j * BLOCK, zero ? zero + j * BLOCK : NULL, N, cols, mx ? MX_ZERO : 8};
                for (int64_t m0 = 0; m0 < M; m0 += MR) {
                    const int rows = M - m0 < MR ? (int)(M - m0) : MR;
                    const int direct = cols == BLOCK;
                    float *out = direct ? y + m0 * ldy + j * BLOCK : ytail;
                    tile(mx, rows, q + m0 * ldq, ldq, asum + m0 * G, G, sx + m0, B, octets, group / 8, &p, out,
                         direct ? ldy : BLOCK);
                    if (!direct)
                        for (int m = 0; m < rows; m++)
                            memcpy(y + (m0 + m) * ldy + j * BLOCK, ytail + m * BLOCK, sizeof(float) * (size_t)cols);
                }
            }
        }
        free(pad);
        free(ytail);
    }
    free(asum);
    return failed ? -1 : 0;
}
