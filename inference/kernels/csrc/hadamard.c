/* The Hadamard rotation (hadamard_rotate) in which int8 weights and activations and 8-bit KV
 * rows are held: the same floats as inference/quantization/hadamard.py. */
#include "kernels.h"

/* stages h = VL .. n*VL/2 across the n vectors of v (n a power of two, <= 8), in registers */
static inline __attribute__((always_inline)) void cross_stages(vf *v, int n) {
    for (int s = 1; s < n; s *= 2)
        for (int i = 0; i < n; i++)
            if (!(i & s)) {
                const vf a = v[i], c = v[i + s];
                v[i] = vf_add(a, c), v[i + s] = vf_sub(a, c);
            }
}
/* Each block's butterflies in the order of hadamard.rotate, stage by stage (a value's sums come
 * out the same whichever pass makes them), in few passes over memory: first groups of up to
 * 8 vectors with every stage inside them in registers, then two stages a pass, the scale
 * folded into the last (half the time of a pass a stage: 512 values 332 -> 203 ns on AVX-512). */
void hadamard_rotate(float *x, int64_t n) {
    for (int64_t off = 0, b; off < n; off += b) {
        b = 1;
        while (2 * b <= n - off) b *= 2;
        float *y = x + off;
        const float scale = (float)(1.0 / sqrt((double)b));
        if (b < VL) {
            for (int64_t h = 1; h < b; h *= 2)
                for (int64_t i = 0; i < b; i += 2 * h)
                    for (int64_t j = i; j < i + h; j++) {
                        const float a = y[j], c = y[j + h];
                        y[j] = a + c, y[j + h] = a - c;
                    }
            for (int64_t j = 0; j < b; j++) y[j] *= scale;
            continue;
        }
        /* pass 1: groups of up to 8 vectors, every stage inside them */
        const int64_t group = b < 8 * VL ? b : 8 * VL, nv = group / VL;
        const vf vs = vf_set1(scale);
        for (int64_t g = 0; g < b; g += group) {
            vf v[8];
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                if (i < nv) {
                    v[i] = vf_load(y + g + i * VL);
                    for (int stage = 0; (1 << stage) < VL; stage++) v[i] = vf_butterfly(v[i], stage);
                }
            switch (nv) {
            case 2: cross_stages(v, 2); break;
            case 4: cross_stages(v, 4); break;
            case 8: cross_stages(v, 8); break;
            }
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                if (i < nv) vf_store(y + g + i * VL, group == b ? vf_mul(v[i], vs) : v[i]);
        }
        /* then two stages a pass (h and 2h over 4 vectors h apart), the scale in the last */
        int64_t h = group;
        for (; 4 * h <= b; h *= 4) {
            const int last = 4 * h == b;
            for (int64_t i = 0; i < b; i += 4 * h)
                for (int64_t j = i; j < i + h; j += VL) {
                    vf a0 = vf_load(y + j), a1 = vf_load(y + j + h), a2 = vf_load(y + j + 2 * h), a3 = vf_load(y + j + 3 * h);
                    vf t0 = vf_add(a0, a1), t1 = vf_sub(a0, a1), t2 = vf_add(a2, a3), t3 = vf_sub(a2, a3);
                    a0 = vf_add(t0, t2), a2 = vf_sub(t0, t2), a1 = vf_add(t1, t3), a3 = vf_sub(t1, t3);
                    if (last) a0 = vf_mul(a0, vs), a1 = vf_mul(a1, vs), a2 = vf_mul(a2, vs), a3 = vf_mul(a3, vs);
                    vf_store(y + j, a0), vf_store(y + j + h, a1), vf_store(y + j + 2 * h, a2), vf_store(y + j + 3 * h, a3);
                }
        }
        if (h < b) /* one stage left */
            for (int64_t j = 0; j < h; j += VL) {
                const vf a = vf_load(y + j), c = vf_load(y + j + h);
                vf_store(y + j, vf_mul(vf_add(a, c), vs)), vf_store(y + j + h, vf_mul(vf_sub(a, c), vs));
            }
    }
}
