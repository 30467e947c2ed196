/* Prompt scoring (SamplingParams.prompt_logprobs, echo): for each row of logits, the log-
 * probability of one target token, its rank and the top k, without a [rows, vocab] float32
 * log-softmax ever held. ms_logit_scores runs the lm_head itself over tiles of rows (ms_linear
 * into one bf16 tile of scratch, the logits the model's own bf16 lm_head gives) and scores
 * each tile; ms_logprob_rows scores logits already computed (bf16 or float32).
 *
 * A row takes two vector passes: its maximum and its top k, then the sum of exp(x - max) and
 * the count of logits above the target's. log_softmax(x)[t] = x[t] - (max + log(sum)); the
 * rank is 1 + that count (vLLM's Logprob.rank). Top-k ties keep the lower token id first. */
#include <omp.h>

#include "kernels.h"

/* Logits per tile of rows (64 MB of bf16: ~1000 rows of a 32000-token vocabulary, ~200 of
 * 151936). Large on purpose: ms_linear splits a call's row chunks between threads, which then
 * read the same weight blocks at about the same time (one read from DRAM serves both), where
 * a tile of one chunk splits the columns and each thread streams its own half. On the small
 * demo's lm_head (32000 x 512, 2 threads; a shared AMD EPYC, proportions only), against the
 * lm_head alone: 512 rows in tiles of 96 ~1.5x; 511 rows as 480 + 31 ~1.14x, in one tile
 * ~1.04x. */
#define TILE_ELEMS (32 << 20)

static inline vf load_lanes(const void *row, int f32, int64_t i) {
    return f32 ? vf_load((const float *)row + i) : vf_load_bf16((const bf16 *)row + i);
}

static inline float load_one(const void *row, int f32, int64_t i) {
    return f32 ? ((const float *)row)[i] : bf16_to_f32(((const bf16 *)row)[i]);
}

/* value v at index i into the k best so far (vals descending, `*filled` of k held): after
 * every equal value, so the first index of a tie stays ahead */
static inline void keep_top(float v, int64_t i, float *vals, int64_t *ids, int64_t k, int64_t *filled) {
    if (*filled == k && !(v > vals[k - 1])) return;
    int64_t at = *filled < k ? (*filled)++ : k - 1;
    while (at > 0 && v > vals[at - 1]) {
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    vals[at] = v;
    ids[at] = i;
}

/* One row of n logits: target's logprob and rank, the top k (ids, logprobs). */
static void score_row(const void *row, int f32, int64_t n, int64_t target, int64_t k, float *target_lp,
                      int64_t *rank, int64_t *top_ids, float *top_lp) {
    float vals[k > 0 ? k : 1];
    int64_t filled = 0, i = 0;
    vf vmax = vf_set1(-INFINITY);
    for (; i + VL <= n; i += VL) {
        const vf v = load_lanes(row, f32, i);
        vmax = vf_max(vmax, v);
        if (k == 0) continue;
        /* until k are held every lane is a candidate; then only those above the k-th */
        unsigned above = filled < k ? (1u << VL) - 1 : lanes_above(v, vf_set1(vals[k - 1]));
        while (above) {
            const int lane = __builtin_ctz(above);
            above &= above - 1;
            keep_top(load_one(row, f32, i + lane), i + lane, vals, top_ids, k, &filled);
        }
    }
    float top = vf_hmax(vmax);
    for (; i < n; i++) {
        const float v = load_one(row, f32, i);
        top = v > top ? v : top;
        if (k) keep_top(v, i, vals, top_ids, k, &filled);
    }
    const float t = load_one(row, f32, target);
    const vf vtop = vf_set1(top), vt = vf_set1(t);
    vf vsum = vf_zero();
    int64_t above = 0;
    for (i = 0; i + VL <= n; i += VL) {
        const vf v = load_lanes(row, f32, i);
        vsum = vf_add(vsum, vf_exp(vf_sub(v, vtop)));
        above += __builtin_popcount(lanes_above(v, vt));
    }
    float sum = vf_sum(vsum);
    for (; i < n; i++) {
        const float v = load_one(row, f32, i);
        sum += expf(v - top);
        above += v > t;
    }
    const float lse = top + logf(sum);
    *target_lp = t - lse;
    *rank = above + 1;
    for (int64_t j = 0; j < k; j++) top_lp[j] = j < filled ? vals[j] - lse : -INFINITY;
}

int ms_logprob_rows(const void *x, int64_t ldx, int f32, int64_t rows, int64_t n, const int64_t *targets, int64_t k,
                    float *target_lp, int64_t *rank, int64_t *top_ids, float *top_lp, int nthreads) {
    if (n < 1 || k < 0 || k > n) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (targets[r] < 0 || targets[r] >= n) return -2;
    const size_t width = f32 ? sizeof(float) : sizeof(bf16);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++)
        score_row((const char *)x + r * ldx * width, f32, n, targets[r], k, target_lp + r, rank + r, top_ids + r * k,
                  top_lp + r * k);
    return 0;
}

int ms_logit_scores(const bf16 *x, int64_t ldx, int64_t M, int64_t K, const wmat *w, int64_t N, const bf16 *bias,
                    const int64_t *targets, int64_t k, float *target_lp, int64_t *rank, int64_t *top_ids, float *top_lp,
                    int64_t tile_rows, int nthreads) {
    if (N < 1 || k < 0 || k > N) return -2;
    for (int64_t r = 0; r < M; r++)
        if (targets[r] < 0 || targets[r] >= N) return -2;
    if (M == 0) return 0;
    /* rows per tile (tile_rows 0): whole chunks of ms_linear's rows (a partial one runs its
     * register tiles short), at most as many as TILE_ELEMS logits hold (at least one chunk),
     * the rows shared evenly between the tiles (no short last one) */
    const int64_t chunk = chunk_rows(even(K)), fit = TILE_ELEMS / N / chunk;
    const int64_t most = chunk * (fit > 1 ? fit : 1), tiles = (M + most - 1) / most;
    const int64_t even_share = (M + tiles - 1) / tiles;
    int64_t tile = tile_rows > 0 ? tile_rows : (even_share + chunk - 1) / chunk * chunk;
    tile = tile < M ? tile : M;
    region_enter();
    bf16 *logits = region_alloc((size_t)tile * N * sizeof(bf16));
    int status = logits ? 0 : -1;
    for (int64_t m0 = 0; m0 < M && !status; m0 += tile) {
        const int64_t rows = m0 + tile < M ? tile : M - m0;
        status = ms_linear(x + m0 * ldx, 0, ldx, rows, K, w, 0, N, bias, logits, 0, N, 1, nthreads);
        if (!status)
            status = ms_logprob_rows(logits, N, 0, rows, N, targets + m0, k, target_lp + m0, rank + m0,
                                     top_ids + m0 * k, top_lp + m0 * k, nthreads);
    }
    region_leave();
    return status;
}
