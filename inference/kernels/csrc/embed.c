/* The int8 embedding's rows (see ms_embed_int8). */
#include "kernels.h"

/* The int8 embedding's rows of ids [T] (table [V, D] int8 at row stride ld, a scale per row):
 * each dequantized, rotated back (the table is stored rotated) and rounded to bf16 into out
 * [T, D]. Returns -2 for an id outside [0, V). */
int ms_embed_int8(const int8_t *table, int64_t ld, const float *scales, int64_t V, const int64_t *ids, int64_t T,
                  int64_t D, bf16 *out, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= V) return -2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        float row[D];
        const int8_t *q = table + ids[t] * ld;
        const float scale = scales[ids[t]];
        for (int64_t i = 0; i < D; i++) row[i] = (float)q[i] * scale;
        hadamard_rotate(row, D);
        for (int64_t i = 0; i < D; i++) out[t * D + i] = f32_to_bf16(row[i]);
    }
    return 0;
}
