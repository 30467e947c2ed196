/* Greedy decoding's pick: the index of each row's largest logit. */
#include "kernels.h"

#define GREEDY_SPAN 256 /* logits per stretch whose maximum the first pass keeps */

/* out[r] = the first index of row r's maximum (x rows of n bf16 at stride ldx), as torch's
 * max(dim=-1).indices. One vector pass keeps each stretch's maximum; the first stretch
 * holding the row's maximum is then scanned for its first index. Rows with NaNs are the
 * caller's concern: a NaN never compares larger here, where torch would return it. */
void ms_greedy(const bf16 *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *row = x + r * ldx;
        float top = -INFINITY, span_max[(n + GREEDY_SPAN - 1) / GREEDY_SPAN];
        for (int64_t s = 0; s * GREEDY_SPAN < n; s++) {
            const int64_t i0 = s * GREEDY_SPAN, i1 = i0 + GREEDY_SPAN < n ? i0 + GREEDY_SPAN : n;
            float m = -INFINITY;
            int64_t i = i0;
            if (i1 - i0 >= VL) {
                vf vm = vf_load_bf16(row + i);
                for (i += VL; i + VL <= i1; i += VL) vm = vf_max(vm, vf_load_bf16(row + i));
                m = vf_hmax(vm);
            }
            for (; i < i1; i++) m = bf16_to_f32(row[i]) > m ? bf16_to_f32(row[i]) : m;
            span_max[s] = m;
            top = m > top ? m : top;
        }
        int64_t best = -1;
        for (int64_t i = 0; i < n && best < 0; i += GREEDY_SPAN) {
            if (span_max[i / GREEDY_SPAN] != top) continue;
            for (int64_t j = i; j < i + GREEDY_SPAN && j < n; j++)
                if (bf16_to_f32(row[j]) == top) {
                    best = j;
                    break;
                }
        }
        out[r] = best < 0 ? 0 : best;
    }
}
