/* The MoE layer kernel (see ms_moe). */
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"

#define TILE_ROWS 256 /* rows of float32 results per block_gemm call (16 KB on the stack) */

/* silu(gate) * up over n values, rounded where the reference rounds (SiLU, the product). */
void swiglu_row(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf g = vf_load(gate + i);
        const vf s = vf_round_bf16(vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g)))));
        vf_store(out + i, vf_round_bf16(vf_mul(s, vf_load(up + i))));
    }
    for (; i < n; i++) out[i] = round_bf16(round_bf16(gate[i] / (1.0f + expf(-gate[i]))) * up[i]);
}

/* gpt-oss's clamped SwiGLU over n values: gate clamped above and up on both sides at limit,
 * gate * sigmoid(alpha * gate) * (up + 1), rounded at each of the reference's bf16 ops. */
static void clamped_swiglu_row(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit) {
    int64_t i = 0;
    const vf one = vf_set1(1.0f), lim = vf_set1(limit), nlim = vf_set1(-limit), a = vf_set1(alpha);
    for (; i + VL <= n; i += VL) {
        const vf g = vf_min(vf_load(gate + i), lim), u = vf_max(vf_min(vf_load(up + i), lim), nlim);
        const vf ga = vf_round_bf16(vf_mul(g, a));
        const vf sig = vf_round_bf16(vf_div(one, vf_add(one, vf_exp(vf_sub(vf_zero(), ga)))));
        const vf glu = vf_round_bf16(vf_mul(g, sig));
        vf_store(out + i, vf_round_bf16(vf_mul(vf_round_bf16(vf_add(u, one)), glu)));
    }
    for (; i < n; i++) {
        const float g = gate[i] < limit ? gate[i] : limit;
        const float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        const float sig = round_bf16(1.0f / (1.0f + expf(-round_bf16(g * alpha))));
        out[i] = round_bf16(round_bf16(u + 1.0f) * round_bf16(g * sig));
    }
}

/* the experts' activation: SwiGLU, or gpt-oss's clamped form when alpha > 0 */
static inline void glu_row(const float *gate, const float *up, float *out, int64_t n, const moe_glu *glu) {
    if (glu->alpha > 0.0f)
        clamped_swiglu_row(gate, up, out, n, glu->alpha, glu->limit);
    else
        swiglu_row(gate, up, out, n);
}

/* out = round(round(in) + bias) over a block's n values (bias NULL: round only; out may be
 * in), as the reference's bf16 product and then its bias add round */
static inline void round_add_bias(const float *in, const float *bias, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf r = vf_round_bf16(vf_load(in + i));
        if (bias) r = vf_round_bf16(vf_add(r, vf_load(bias + i)));
        vf_store(out + i, r);
    }
    for (; i < n; i++) out[i] = bias ? round_bf16(round_bf16(in[i]) + bias[i]) : round_bf16(in[i]);
}

/* ---- MoE layers ---------------------------------------------------------------------- */

/* rows [r0, r1) of a times block j of w [N, K] (plus bias [N] unless NULL) -> rows of `out`
 * (float32, stride ldo, rounded to bf16 precision like the reference's bf16 outputs). */
static void rows_times_block(const rows_t *a, int64_t r0, int64_t r1, const wmat *w, int64_t N, int64_t K,
                             int64_t j, const float *bias, void *pad, float *out, int64_t ldo) {
    float C[TILE_ROWS * BLOCK];
    for (int64_t m0 = r0; m0 < r1; m0 += TILE_ROWS) {
        const int64_t m1 = m0 + TILE_ROWS < r1 ? m0 + TILE_ROWS : r1;
        int64_t cols;
        wblock_gemm(a, m0, m1 - m0, w, N, K, j, pad, C, BLOCK, &cols);
        for (int64_t m = m0; m < m1; m++) {
            const float *c = C + (m - m0) * BLOCK;
            round_add_bias(c, bias ? bias + j * BLOCK : NULL, out + m * ldo + j * BLOCK, cols);
        }
    }
}

/* The first projection with the activation in its epilogue (I % 16 == 0): rows [r0, r1) of a
 * times gate block j and up block I/16 + j of W13 [2I, K] (plus bias13 [2I] unless NULL) ->
 * glu(gate, up) into columns 16j.. of hidden (float32, stride ldh; also as bf16 into hidden16
 * unless NULL), each value rounded where the reference rounds. No [rows, 2I] intermediate, no
 * second pass over it. */
static void rows_swiglu_block(const rows_t *a, int64_t r0, int64_t r1, const wmat *w13, int64_t I, int64_t K,
                              int64_t j, const float *bias13, const moe_glu *glu, void *pad, float *hidden,
                              bf16 *hidden16, int64_t ldh) {
    /* U a line past G's 16 KB: 4 KB apart, g[i]'s rounding stored in place and u[i]'s load
     * alias (same low 12 address bits) and the load waits (Zen 4: the load of u was half of
     * this function's samples in batched decoding) */
    float GU[2 * TILE_ROWS * BLOCK + 16] __attribute__((aligned(64)));
    float *G = GU, *U = GU + TILE_ROWS * BLOCK + 16;
    for (int64_t m0 = r0; m0 < r1; m0 += TILE_ROWS) {
        const int64_t m1 = m0 + TILE_ROWS < r1 ? m0 + TILE_ROWS : r1;
        wblock_gemm_pair(a, m0, m1 - m0, w13, 2 * I, K, j, I / BLOCK + j, pad, G, U, BLOCK);
        for (int64_t m = m0; m < m1; m++) {
            float *g = G + (m - m0) * BLOCK, *u = U + (m - m0) * BLOCK, *h = hidden + m * ldh + j * BLOCK;
            round_add_bias(g, bias13 ? bias13 + j * BLOCK : NULL, g, BLOCK);
            round_add_bias(u, bias13 ? bias13 + I + j * BLOCK : NULL, u, BLOCK);
            glu_row(g, u, h, BLOCK, glu);
            if (hidden16)
                for (int v = 0; v < VPB; v++) vf_store_bf16(hidden16 + m * ldh + j * BLOCK + v * VL, vf_load(h + v * VL));
        }
    }
}

/* The routed experts of T tokens in one call (one token, decode batches, prefill chunks):
 * out[t] = sum_a weights[t, a] * W2[e] (silu(g) * u), (g, u) = W13[e] x[t], e = ids[t, a].
 * (token, expert) pairs are sorted by expert, so each expert's weights are read once for all
 * of its tokens, and experts nobody was routed to not at all (a batched matmul over all
 * experts reads them all and multiplies the padding). Work is split across threads by
 * (expert, row chunk, 16-column block), handed out guided: a thread's first share is a long
 * run of consecutive blocks (one stream of weights, each block's prefetch running into the
 * next), the shares shrinking to 4 blocks so the threads still finish together. Runs of 4
 * blocks throughout (dynamic, 4) restarted the weight stream at every share: 2.26 ms a layer
 * against 1.80 at 32 tokens (medium's int4 experts, AMD EPYC Zen 4), and faster at no count
 * of tokens.
 * x [T, D] (row stride ldx); w13 [E] packed [2I, D] (gate rows, then up rows); w2 [E] packed
 * [D, I], bf16 or 8-bit (int8: the tokens and the SwiGLU outputs are quantized per row for
 * the integer products); ids, weights [T, A]; out [T, D] (row stride ldo); counts [E] gets
 * the tokens per expert. glu (NULL: plain SwiGLU, no biases): gpt-oss's experts, float32
 * biases b13 [E, 2I] (gate then up) and b2 [E, D] (each may be NULL) and the clamped SwiGLU
 * when alpha > 0. Returns -1 without scratch memory, -2 for an expert id outside [0, E). */
int ms_moe(const bf16 *x, int64_t ldx, int64_t T, int64_t D, const wmat *w13, const wmat *w2, int64_t E,
           int64_t I, const int64_t *ids, const float *weights, int64_t A, const moe_glu *glu, bf16 *out,
           int64_t ldo, int64_t *counts, int nthreads) {
    const moe_glu plain = {NULL, NULL, 0.0f, 0.0f};
    if (!glu) glu = &plain;
    const int64_t pairs = T * A, Dp = even(D), Ip = even(I), Dq = quad(D), Iq = quad(I), N1 = 2 * I;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    const int64_t rows = chunk_rows(Dp > Ip ? Dp : Ip);
    const int fused = I % BLOCK == 0; /* SwiGLU in the first projection's epilogue */
    /* the forms of the tokens (x) and of silu(gate) * up (h) the two products read */
    const int x8 = rows_need_s8(w13), h8 = rows_need_s8(w2);
    const int64_t xg = rows_s8_group(w13), hg = rows_s8_group(w2); /* inputs per activation scale */
    const int64_t xls = s8_scales(xg, D), hls = s8_scales(hg, I);    /* scales a row */
    /* 4-bit weights: each int8 row's group sums, taken once here rather than per block */
    const int64_t xgs = four_bit(w13) ? (D + w13->group - 1) / w13->group : 0;
    const int64_t hgs = four_bit(w2) ? (I + w2->group - 1) / w2->group : 0;
    const int x32 = !x8 && (w13->kind != W_BF16 || !tiles_read_bf16());
    const int x16 = rows_need_b16(w13, D) && (w13->kind != W_BF16 || tiles_read_bf16() || (Dp % 32 == 0 && Ip % 32 == 0));
    const int h16 = rows_need_b16(w2, I) && (w2->kind != W_BF16 || tiles_read_bf16() || (Dp % 32 == 0 && Ip % 32 == 0));
    const int64_t max_chunks = pairs / rows + E + 1;
    const size_t pad = round64(pad_bytes(Dp > Ip ? Dp : Ip));
    size_t sizes[] = {
        round64((E + 1) * sizeof(int64_t)),          /* first row of each expert */
        round64(pairs * sizeof(int64_t)),            /* row of each pair */
        round64(pairs * sizeof(int64_t)),            /* token of each row */
        round64(3 * max_chunks * sizeof(int64_t)),   /* (expert, first row, end row) chunks */
        x32 ? round64((size_t)pairs * Dp * sizeof(float)) : 0, /* the tokens, by expert */
        fused ? 0 : round64((size_t)pairs * N1 * sizeof(float)), /* gate and up projections */
        round64((size_t)pairs * Ip * sizeof(float)), /* silu(gate) * up */
        round64((size_t)pairs * D * sizeof(float)),  /* expert outputs */
        (size_t)nthreads * pad,
        x16 ? round64((size_t)pairs * Dp * sizeof(bf16)) : 0, /* the tokens and */
        h16 ? round64((size_t)pairs * Ip * sizeof(bf16)) : 0, /* silu(gate) * up as bf16 */
        x8 ? round64((size_t)pairs * Dq) + round64(pairs * xls * sizeof(float)) : 0, /* the tokens */
        h8 ? round64((size_t)pairs * Iq) + round64(pairs * hls * sizeof(float)) : 0, /* and h, int8 */
        round64((size_t)pairs * xgs * sizeof(int32_t)), /* their group sums */
        round64((size_t)pairs * hgs * sizeof(int32_t)),
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
    region_enter();
    char *p0 = region_alloc(total);
    if (!p0) {
        region_leave();
        return -1;
    }
    char *cursor = p0;
    void *parts[sizeof sizes / sizeof *sizes];
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) parts[i] = cursor, cursor += sizes[i];
    int64_t *first = parts[0], *pair_row = parts[1], *token_of = parts[2], *chunk = parts[3];
    float *xs = x32 ? parts[4] : NULL, *gate_up = parts[5], *hidden = parts[6], *expert_out = parts[7];
    char *pads = parts[8];
    bf16 *xs16 = x16 ? parts[9] : NULL, *hidden16 = h16 ? parts[10] : NULL;
    int8_t *xs8 = x8 ? parts[11] : NULL, *hidden8 = h8 ? parts[12] : NULL;
    float *xs8_scale = x8 ? (float *)((char *)parts[11] + round64((size_t)pairs * Dq)) : NULL;
    float *hidden8_scale = h8 ? (float *)((char *)parts[12] + round64((size_t)pairs * Iq)) : NULL;
    int32_t *xsum = xgs ? parts[13] : NULL, *hsum = hgs ? parts[14] : NULL;
    const rows_t xr = {xs, Dp, xs16, Dp, xs8, Dq, xs8_scale, xls, xsum, xgs ? w13->group : 0};
    const rows_t hr = {hidden, Ip, hidden16, Ip, hidden8, Iq, hidden8_scale, hls, hsum, hgs ? w2->group : 0};

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
        void *tpad = pads + (size_t)omp_get_thread_num() * pad;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) {
            const bf16 *row = x + token_of[r] * ldx;
            if (xs) widen_row(row, D, xs + r * Dp, Dp);
            if (xs16) {
                memcpy(xs16 + r * Dp, row, D * sizeof(bf16));
                if (Dp != D) xs16[r * Dp + D] = 0;
            }
        }
        if (xs8 && w13->perm) { /* act-order: each row in its expert's input order */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t r = pair_row[p];
                const wmat we = wmat_expert(w13, ids[p], N1, D);
                widen_row_for(&we, x + (p / A) * ldx, D, tpad);
                quantize_row_s8(tpad, D, xs8 + r * Dq, Dq, xs8_scale + r * xls, rows_rotate(w13), xg);
                if (xsum) s8_group_sums(xs8 + r * Dq, D, w13->group, xsum + r * xgs); /* in its order */
            }
        } else if (xs8) { /* each token rotated and quantized once, copied to its other rows */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                float *row32 = tpad;
                const int64_t r = pair_row[t * A];
                widen_row(x + t * ldx, D, row32, D);
                quantize_row_s8(row32, D, xs8 + r * Dq, Dq, xs8_scale + r * xls, rows_rotate(w13), xg);
                if (xsum) s8_group_sums(xs8 + r * Dq, D, w13->group, xsum + r * xgs);
                for (int64_t a = 1; a < A; a++) {
                    memcpy(xs8 + pair_row[t * A + a] * Dq, xs8 + r * Dq, Dq);
                    memcpy(xs8_scale + pair_row[t * A + a] * xls, xs8_scale + r * xls, xls * sizeof(float));
                    if (xsum) memcpy(xsum + pair_row[t * A + a] * xgs, xsum + r * xgs, xgs * sizeof(int32_t));
                }
            }
        }
        if (fused) {
#pragma omp for schedule(guided, 4)
            for (int64_t it = 0; it < chunks * (I / BLOCK); it++) {
                const int64_t *c = chunk + 3 * (it / (I / BLOCK));
                const wmat we = wmat_expert(w13, c[0], N1, D);
                const float *b = glu->b13 ? glu->b13 + c[0] * N1 : NULL;
                rows_swiglu_block(&xr, c[1], c[2], &we, I, D, it % (I / BLOCK), b, glu, tpad, hidden, hidden16, Ip);
            }
        } else {
#pragma omp for schedule(guided, 4)
            for (int64_t it = 0; it < chunks * blocks1; it++) {
                const int64_t *c = chunk + 3 * (it / blocks1);
                const wmat we = wmat_expert(w13, c[0], N1, D);
                const float *b = glu->b13 ? glu->b13 + c[0] * N1 : NULL;
                rows_times_block(&xr, c[1], c[2], &we, N1, D, it % blocks1, b, tpad, gate_up, N1);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < pairs; r++) {
                glu_row(gate_up + r * N1, gate_up + r * N1 + I, hidden + r * Ip, I, glu);
                if (Ip != I) hidden[r * Ip + I] = 0.0f;
                if (hidden16) /* exact: the values are bf16-rounded */
                    for (int64_t i = 0; i < Ip; i++) hidden16[r * Ip + i] = f32_to_bf16(hidden[r * Ip + i]);
            }
        }
        if (hidden8) { /* rotated in place (where w2's rows are): the int8 product reads only the quantized rows */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < pairs; r++) {
                quantize_row_s8(hidden + r * Ip, I, hidden8 + r * Iq, Iq, hidden8_scale + r * hls, rows_rotate(w2), hg);
                if (hsum) s8_group_sums(hidden8 + r * Iq, I, w2->group, hsum + r * hgs);
            }
        }
#pragma omp for schedule(guided, 4)
        for (int64_t it = 0; it < chunks * blocks2; it++) {
            const int64_t *c = chunk + 3 * (it / blocks2);
            const wmat we = wmat_expert(w2, c[0], D, I);
            const float *b = glu->b2 ? glu->b2 + c[0] * D : NULL;
            rows_times_block(&hr, c[1], c[2], &we, D, I, it % blocks2, b, tpad, expert_out, D);
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
    region_leave();
    return 0;
}
