/* A whole decode step in one call (ms_decode_step): for every decoder layer the same kernels the
 * Python model composes (RMSNorm with the residual add, the qkv projection, q/k norms, RoPE
 * and the cache write, paged attention, the output projection, the router, the experts or
 * the dense MLP, the shared expert), run back to back in C. A decode step of one sequence
 * costs about 1 ms of Python and dispatch when composed op by op, more than its attention;
 * this is what keeps the default eager engine's host overhead per step near zero.
 *
 * Covers standard attention (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Llama, gpt-oss with its
 * sinks, windows and biased experts, GLM-4.5 and MiniMax-M2 with partial rotary and noaux_tc
 * routing, DeepSeek-V2 and V3's MLA with their float32 routing); prefill chunks keep the
 * composed path. Rounding is the composed path's, op for op.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Mirrored by cpu_kernels.LayerSpec: int64 fields, then floats, then pointers, then weights,
 * then the experts' biases and activation. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim;
    int64_t experts, top_k, moe_inter; /* experts 0: a dense layer (mlp_* below) */
    int64_t mlp_inter;                 /* the dense MLP's or the shared expert's width, or 0 */
    int64_t qk_norm;                   /* 0 none, 1 per head (Qwen3-MoE), 2 over the projection (OLMoE) */
    int64_t norm_topk_prob;
    int64_t kv_kind, kv_row; /* the cache rows' format (KV_*) and elements per (slot, head) row */
    int64_t rotary_dim;      /* the dims of each head that rotate (partial rotary: < head_dim) */
    int64_t window;          /* > 0: a sliding-window layer (gpt-oss) */
    int64_t groups, topk_group; /* float32 routing's expert groups (router_f32 set) */
    int64_t sigmoid;            /* float32 routing: noaux_tc's sigmoid (else DeepSeek-V2's softmax) */
    /* MLA (kv_lora_rank > 0; DeepSeek-V3): the latent's width, the low-rank query's (0: none),
     * each head's unrotated query/key part and value width (rotary_dim: the rotated part), and
     * the per-head strides of the packed absorbed projections W_UK^T [H][r, n] and W_UV [H][v, r] */
    int64_t kv_lora_rank, q_lora_rank, nope_dim, v_dim, uk_stride, uv_stride;
    float eps, scale, clip_qkv, routed_scaling; /* clip_qkv 0: none */
    float latent_eps;                           /* MLA's q_a and kv_a norms */
    const bf16 *input_norm, *post_norm, *qkv_bias, *o_bias, *q_norm, *k_norm, *mlp_b13, *mlp_b2;
    const bf16 *router_bias;      /* the router's bias (gpt-oss), or NULL */
    const float *sinks;           /* [heads] attention sinks (gpt-oss), or NULL */
    const float *router_f32;      /* [experts, hidden]: noaux_tc routing in float32, or NULL */
    const float *correction_bias; /* [experts] noaux_tc's choice bias */
    const bf16 *q_a_bias, *q_a_norm, *kv_a_bias, *kv_a_norm; /* MLA's */
    const float *key_shift;       /* [kv_heads, head_dim] taken off the keys (int4 cache), or NULL */
    const float *key_hinv;        /* [kv_heads, head_dim, head_dim] int4 keys' rounding, or NULL */
    wmat wqkv, wo, router, w13, w2, mlp_w13, mlp_w2;
    wmat shared_gate;                     /* data NULL: ungated */
    wmat wq_a, wq_b, wkv_a, w_uk_t, w_uv; /* MLA's (wq_b: the query's whole projection without q LoRA) */
    moe_glu glu;      /* the experts' biases and clamped SwiGLU (gpt-oss); alpha 0: plain */
} layer_spec;

/* softmax over each token's router logits (float32, as the reference), its top_k experts
 * (ties to the lower id), optionally renormalised, times the routed scaling factor */
static void route(const bf16 *logits, int64_t T, int64_t E, int64_t A, int norm, float scaling,
                  int64_t *ids, float *weights, float *probs) {
    for (int64_t t = 0; t < T; t++) {
        const bf16 *l = logits + t * E;
        float top = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) top = bf16_to_f32(l[e]) > top ? bf16_to_f32(l[e]) : top;
        for (int64_t e = 0; e < E; e++) sum += probs[e] = expf(bf16_to_f32(l[e]) - top);
        float chosen = 0.0f;
        for (int64_t a = 0; a < A; a++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
            ids[t * A + a] = best;
            weights[t * A + a] = probs[best] / sum;
            chosen += weights[t * A + a];
            probs[best] = -1.0f; /* taken */
        }
        for (int64_t a = 0; a < A; a++) {
            if (norm) weights[t * A + a] /= chosen;
            weights[t * A + a] *= scaling;
        }
    }
}

/* Routing in float32 on the float32 gate W [E, D] read in place, for the rows h [T, D]:
 * - sigmoid (noaux_tc: DeepSeek-V3, GLM-4.5, MiniMax-M2), as moe.NoAuxMoE: experts chosen on
 *   score + correction bias within the best topk_group of `groups` groups (a group scores as
 *   the sum of its two best), weighted by the unbiased scores;
 * - softmax (DeepSeek-V2's group-limited greedy), as moe.select_experts: a group scores as
 *   its best probability;
 * ties to the lower id; weights optionally renormalised, times the routed scaling factor.
 * scratch: D + 2E floats. */
static void route_f32(const layer_spec *L, const bf16 *h, int64_t T, int64_t *ids, float *weights, float *scratch) {
    const int64_t D = L->hidden, E = L->experts, A = L->top_k, per = E / L->groups;
    float *x = scratch, *score = x + D, *choice = score + E;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < D; i++) x[i] = bf16_to_f32(h[t * D + i]);
        float top = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            const float *w = L->router_f32 + e * D;
            int64_t i = 0;
            vf v = vf_zero();
            for (; i + VL <= D; i += VL) v = vf_fma(vf_load(x + i), vf_load(w + i), v);
            float acc = vf_sum(v);
            for (; i < D; i++) acc += x[i] * w[i];
            score[e] = acc;
            top = acc > top ? acc : top;
        }
        for (int64_t e = 0; e < E; e++) {
            if (L->sigmoid) {
                score[e] = 1.0f / (1.0f + expf(-score[e]));
                choice[e] = score[e] + L->correction_bias[e];
            } else {
                sum += score[e] = expf(score[e] - top);
            }
        }
        if (!L->sigmoid)
            for (int64_t e = 0; e < E; e++) choice[e] = score[e] /= sum;
        if (L->groups > 1) {
            float group_score[64]; /* groups <= 64 (layer_spec's caller checks) */
            for (int64_t g = 0; g < L->groups; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int64_t e = g * per; e < (g + 1) * per; e++) {
                    const float c = choice[e];
                    if (c > a) b = a, a = c;
                    else if (c > b) b = c;
                }
                group_score[g] = L->sigmoid ? a + b : a;
            }
            for (int64_t k = 0; k < L->topk_group; k++) { /* mark the best groups: score -> +inf */
                int64_t best = -1;
                for (int64_t g = 0; g < L->groups; g++)
                    if (group_score[g] != INFINITY && (best < 0 || group_score[g] > group_score[best])) best = g;
                group_score[best] = INFINITY;
            }
            for (int64_t g = 0; g < L->groups; g++)
                if (group_score[g] != INFINITY)
                    for (int64_t e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
        }
        float chosen = 0.0f;
        for (int64_t a = 0; a < A; a++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (choice[e] != -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
            if (best < 0) /* fewer eligible experts than top_k cannot happen: groups hold >= 2 */
                best = 0;
            ids[t * A + a] = best;
            weights[t * A + a] = score[best];
            chosen += score[best];
            choice[best] = -INFINITY;
        }
        for (int64_t a = 0; a < A; a++) {
            if (L->norm_topk_prob) weights[t * A + a] /= L->sigmoid ? chosen + 1e-20f : chosen;
            weights[t * A + a] *= L->routed_scaling;
        }
    }
}

/* The dense SwiGLU MLP (a dense layer, or the shared expert): out = W2 (silu(g) * u) + b2. */
static int mlp(const layer_spec *L, const bf16 *h, int64_t T, bf16 *out, int nthreads) {
    const int64_t D = L->hidden, S = L->mlp_inter;
    bf16 *gu = region_alloc((size_t)T * 2 * S * sizeof(bf16));
    float *g32 = region_alloc((size_t)2 * S * sizeof(float)), *a32 = region_alloc((size_t)S * sizeof(float));
    bf16 *act = region_alloc((size_t)T * S * sizeof(bf16));
    if (!gu || !g32 || !a32 || !act) return -1;
    if (ms_linear(h, 0, D, T, D, &L->mlp_w13, 0, 2 * S, L->mlp_b13, gu, 0, 2 * S, 1, nthreads)) return -1;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < 2 * S; i++) g32[i] = bf16_to_f32(gu[t * 2 * S + i]);
        swiglu_row(g32, g32 + S, a32, S);
        for (int64_t i = 0; i < S; i++) act[t * S + i] = f32_to_bf16(a32[i]);
    }
    return ms_linear(act, 0, S, T, S, &L->mlp_w2, 0, D, L->mlp_b2, out, 0, D, 1, nthreads);
}

/* DeepSeek's rotation of (x[2i], x[2i+1]) pairs over n = rd values in place, each product and
 * sum rounded as the reference's bf16 ops round; cos/sin [rd] (each frequency twice: the
 * first half read), as models/layers.apply_rope_interleaved. */
static void rope_pairs(bf16 *x, int64_t rd, const bf16 *cos, const bf16 *sin) {
    for (int64_t i = 0; i < rd / 2; i++) {
        const float xe = bf16_to_f32(x[2 * i]), xo = bf16_to_f32(x[2 * i + 1]);
        const float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        x[2 * i] = f32_to_bf16(round_bf16(xe * c) - round_bf16(xo * s));
        x[2 * i + 1] = f32_to_bf16(round_bf16(xe * s) + round_bf16(xo * c));
    }
}

/* MLA's attention for T single-token rows, as models/mla.py and kernels/modules.py's
 * CpuAbsorbedAttention compose it: the (low-rank) query, the latent c_kv (normed) and its
 * shared rope key written to the cache (one row of r + p per slot), the absorbed query
 * q_nope W_UK^T beside q_pe, decode attention over the latent rows, W_UV, the output
 * projection -> o [T, D]. */
static int mla_attention(const layer_spec *L, const bf16 *h, int64_t T, const bf16 *cos, const bf16 *sin,
                         const int64_t *slots, void *cache, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *context_lens, int64_t block_size, bf16 *o, int nthreads) {
    const int64_t D = L->hidden, H = L->heads, n = L->nope_dim, p = L->rotary_dim, r = L->kv_lora_rank;
    const int64_t v = L->v_dim, dq = n + p, qr = L->q_lora_rank, row = L->kv_row;
    bf16 *q = region_alloc((size_t)T * H * dq * sizeof(bf16)), *kv = region_alloc((size_t)T * (r + p) * sizeof(bf16));
    bf16 *qabs = region_alloc((size_t)T * H * (r + p) * sizeof(bf16));
    bf16 *lat = region_alloc((size_t)T * H * r * sizeof(bf16)), *att = region_alloc((size_t)T * H * v * sizeof(bf16));
    bf16 *qa = qr ? region_alloc((size_t)T * qr * sizeof(bf16)) : NULL;
    float *row32 = region_alloc((size_t)(r + p) * sizeof(float));
    if (!q || !kv || !qabs || !lat || !att || (qr && !qa) || !row32) return -1;
    if (qr) {
        if (ms_linear(h, 0, D, T, D, &L->wq_a, 0, qr, L->q_a_bias, qa, 0, qr, 1, nthreads)) return -1;
        ms_rmsnorm(qa, qr, NULL, 0, L->q_a_norm, L->latent_eps, qa, qr, T, qr, nthreads);
        if (ms_linear(qa, 0, qr, T, qr, &L->wq_b, 0, H * dq, NULL, q, 0, H * dq, 1, nthreads)) return -1;
    } else if (ms_linear(h, 0, D, T, D, &L->wq_b, 0, H * dq, NULL, q, 0, H * dq, 1, nthreads)) {
        return -1;
    }
    if (ms_linear(h, 0, D, T, D, &L->wkv_a, 0, r + p, L->kv_a_bias, kv, 0, r + p, 1, nthreads)) return -1;
    ms_rmsnorm(kv, r + p, NULL, 0, L->kv_a_norm, L->latent_eps, kv, r + p, T, r, nthreads);
    for (int64_t t = 0; t < T; t++) {
        rope_pairs(kv + t * (r + p) + r, p, cos + t * p, sin + t * p);
        for (int64_t head = 0; head < H; head++) rope_pairs(q + (t * H + head) * dq + n, p, cos + t * p, sin + t * p);
        if (L->kv_kind == KV_BF16) {
            memcpy((bf16 *)cache + slots[t] * row, kv + t * (r + p), (r + p) * sizeof(bf16));
        } else {
            widen_row(kv + t * (r + p), r + p, row32, r + p);
            kv_store_row(row32, (int)L->kv_kind, r + p, NULL, (uint8_t *)cache + slots[t] * row);
        }
    }
    /* q_abs = [q_nope W_UK^T, q_pe] per head */
    if (ms_linear(q, dq, H * dq, T, n, &L->w_uk_t, L->uk_stride, r, NULL, qabs, r + p, H * (r + p), H, nthreads))
        return -1;
    for (int64_t t = 0; t < T; t++)
        for (int64_t head = 0; head < H; head++)
            memcpy(qabs + (t * H + head) * (r + p) + r, q + (t * H + head) * dq + n, p * sizeof(bf16));
    if (ms_decode_attention(qabs, H * (r + p), T, H, 1, (int)L->kv_kind, cache, row, row, r + p, cache, row, row, r,
                            r + p, block_tables, bt_stride, context_lens, block_size, L->scale, NULL, 0, lat, H * r,
                            nthreads))
        return -1;
    if (ms_linear(lat, r, H * r, T, r, &L->w_uv, L->uv_stride, v, NULL, att, v, H * v, H, nthreads)) return -1;
    return ms_linear(att, 0, H * v, T, H * v, &L->wo, 0, D, L->o_bias, o, 0, D, 1, nthreads);
}

/* One layer of a decode step for T single-token rows. x [T, D]: the previous layer's output
 * (first: the embeddings); residual [T, D]: the running sum, updated in place (first: x
 * itself, not added). cos/sin [T, d]; slots [T]; caches [S, G, d]; block tables as
 * ms_decode_attention. out [T, D]: this layer's output (its MLP/MoE result); counts [E]:
 * tokens per expert. Returns nonzero on an allocation failure or a bad expert id. */
static int decode_layer(const layer_spec *L, const bf16 *x, bf16 *residual, int first, int64_t T, const bf16 *cos,
                    const bf16 *sin, const int64_t *slots, void *k_cache, void *v_cache,
                    const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                    int64_t block_size, bf16 *out, int64_t *counts, int nthreads) {
    const int64_t D = L->hidden, H = L->heads, G = L->kv_heads, d = L->head_dim, W = (H + 2 * G) * d;
    int status = -1;
    region_enter();
    bf16 *h = region_alloc((size_t)T * D * sizeof(bf16)), *qkv = region_alloc((size_t)T * W * sizeof(bf16));
    bf16 *att = region_alloc((size_t)T * H * d * sizeof(bf16)), *o = region_alloc((size_t)T * D * sizeof(bf16));
    if (!h || !qkv || !att || !o) goto done;

    ms_rmsnorm(x, D, first ? NULL : residual, D, L->input_norm, L->eps, h, D, T, D, nthreads);
    if (L->kv_lora_rank) {
        if (mla_attention(L, h, T, cos, sin, slots, k_cache, block_tables, bt_stride, context_lens, block_size, o,
                          nthreads))
            goto done;
        goto attended;
    }
    if (ms_linear(h, 0, D, T, D, &L->wqkv, 0, W, L->qkv_bias, qkv, 0, W, 1, nthreads)) goto done;
    for (int64_t t = 0; L->qk_norm && t < T; t++) {
        bf16 *row = qkv + t * W;
        if (L->qk_norm == 1) { /* per head, in place */
            ms_rmsnorm(row, d, NULL, 0, L->q_norm, L->eps, row, d, H, d, 1);
            ms_rmsnorm(row + H * d, d, NULL, 0, L->k_norm, L->eps, row + H * d, d, G, d, 1);
        } else {
            ms_rmsnorm(row, H * d, NULL, 0, L->q_norm, L->eps, row, H * d, 1, H * d, 1);
            ms_rmsnorm(row + H * d, G * d, NULL, 0, L->k_norm, L->eps, row + H * d, G * d, 1, G * d, 1);
        }
    }
    if (L->clip_qkv > 0.0f)
        for (int64_t i = 0; i < T * W; i++) {
            const float v = bf16_to_f32(qkv[i]);
            qkv[i] = v > L->clip_qkv ? f32_to_bf16(L->clip_qkv) : v < -L->clip_qkv ? f32_to_bf16(-L->clip_qkv) : qkv[i];
        }
    const int64_t row = L->kv_row;
    ms_rope_cache(qkv, W, T, H, G, d, L->rotary_dim, cos, sin, L->key_shift, L->key_hinv, slots, (int)L->kv_kind,
                  k_cache, v_cache, row, nthreads);
    if (ms_decode_attention(qkv, W, T, H, G, (int)L->kv_kind, k_cache, G * row, row, d, v_cache, G * row, row, d, d,
                            block_tables, bt_stride, context_lens, block_size, L->scale, L->sinks, L->window, att,
                            H * d, nthreads))
        goto done;
    if (ms_linear(att, 0, H * d, T, H * d, &L->wo, 0, D, L->o_bias, o, 0, D, 1, nthreads)) goto done;
attended:
    if (first && residual != x) memcpy(residual, x, (size_t)T * D * sizeof(bf16));
    ms_rmsnorm(o, D, residual, D, L->post_norm, L->eps, h, D, T, D, nthreads);

    if (!L->experts) {
        status = mlp(L, h, T, out, nthreads);
        goto done;
    }
    const int64_t E = L->experts, A = L->top_k;
    bf16 *logits = region_alloc((size_t)T * E * sizeof(bf16));
    int64_t *ids = region_alloc((size_t)T * A * sizeof(int64_t));
    float *weights = region_alloc((size_t)T * A * sizeof(float));
    float *probs = region_alloc((size_t)(D + 2 * E) * sizeof(float));
    if (!logits || !ids || !weights || !probs) goto done;
    if (L->router_f32) {
        route_f32(L, h, T, ids, weights, probs);
    } else {
        if (ms_linear(h, 0, D, T, D, &L->router, 0, E, L->router_bias, logits, 0, E, 1, nthreads)) goto done;
        route(logits, T, E, A, (int)L->norm_topk_prob, L->routed_scaling, ids, weights, probs);
    }
    const moe_glu *glu = L->glu.b13 || L->glu.b2 || L->glu.alpha > 0.0f ? &L->glu : NULL;
    if ((status = ms_moe(h, D, T, D, &L->w13, &L->w2, E, L->moe_inter, ids, weights, A, glu, out, D, counts, nthreads)))
        goto done;
    if (L->mlp_inter) { /* the shared expert, sigmoid-gated (Qwen2-MoE) or not (DeepSeek) */
        status = -1;
        bf16 *shared = region_alloc((size_t)T * D * sizeof(bf16)), *gate = region_alloc((size_t)T * sizeof(bf16));
        if (!shared || !gate || mlp(L, h, T, shared, nthreads)) goto done;
        const int gated = L->shared_gate.data != NULL;
        if (gated && ms_linear(h, 0, D, T, D, &L->shared_gate, 0, 1, NULL, gate, 0, 1, 1, nthreads)) goto done;
        for (int64_t t = 0; t < T; t++) {
            const float g = gated ? round_bf16(1.0f / (1.0f + expf(-bf16_to_f32(gate[t])))) : 1.0f;
            for (int64_t i = 0; i < D; i++) {
                const float s = gated ? round_bf16(g * bf16_to_f32(shared[t * D + i])) : bf16_to_f32(shared[t * D + i]);
                out[t * D + i] = f32_to_bf16(bf16_to_f32(out[t * D + i]) + s);
            }
        }
    }
    status = 0;
done:
    region_leave();
    return status;
}

/* A whole decode step through every layer in one call: the embeddings of ids [T] (embed NULL:
 * the caller's rows, already in hidden [T, D]), the layers
 * (all covered by ms_decode_layer), and the final RMSNorm into hidden [T, D]; the lm_head
 * stays with the caller (the sampler reads its logits). cos/sin tables [positions, d] in
 * float32, rounded to bf16 per token as the composed path rounds them. counts [MoE layers,
 * E]: tokens per expert of each MoE layer, in layer order. */
int ms_decode_step(const layer_spec *layers, int64_t L, const bf16 *embed, const int64_t *ids, int64_t T,
                   const float *cos_table, const float *sin_table, const int64_t *positions, const int64_t *slots,
                   void *const *k_caches, void *const *v_caches, const int32_t *block_tables, int64_t bt_stride,
                   const int32_t *context_lens, int64_t block_size, const bf16 *final_norm, float eps, bf16 *hidden,
                   int64_t *counts, int nthreads) {
    const int64_t D = layers[0].hidden, d = layers[0].rotary_dim; /* the rope tables' width */
    int status = -1;
    region_enter();
    bf16 *x = region_alloc((size_t)T * D * sizeof(bf16)), *y = region_alloc((size_t)T * D * sizeof(bf16));
    bf16 *residual = region_alloc((size_t)T * D * sizeof(bf16));
    bf16 *cos = region_alloc((size_t)T * d * sizeof(bf16)), *sin = region_alloc((size_t)T * d * sizeof(bf16));
    if (!x || !y || !residual || !cos || !sin) goto done;
    for (int64_t t = 0; t < T; t++) {
        memcpy(x + t * D, embed ? embed + ids[t] * D : hidden + t * D, D * sizeof(bf16));
        for (int64_t i = 0; i < d; i++) {
            cos[t * d + i] = f32_to_bf16(cos_table[positions[t] * d + i]);
            sin[t * d + i] = f32_to_bf16(sin_table[positions[t] * d + i]);
        }
    }
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < L; l++) {
        int64_t *c = layers[l].experts ? counts + moe_layers++ * layers[l].experts : NULL;
        if ((status = decode_layer(&layers[l], x, residual, l == 0, T, cos, sin, slots, k_caches[l], v_caches[l],
                                   block_tables, bt_stride, context_lens, block_size, y, c, nthreads)))
            goto done;
        bf16 *swap = x;
        x = y, y = swap;
    }
    ms_rmsnorm(x, D, residual, D, final_norm, eps, hidden, D, T, D, nthreads);
    status = 0;
done:
    region_leave();
    return status;
}
