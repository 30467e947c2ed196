/* The products of the libraries of their own that cpu_kernels.enable hands to this one where
 * the CPU has them: AMX's bf16 and int8 tiles (amx.c), VNNI's int8 products (int8_vnni.c) and
 * the int4 products (int4.c).
 * gemm.c's block_gemm and gemm8.c's int8_block read them; region.c tells AMX when an
 * outermost call begins. This file calls no other. */
#include "kernels.h"

/* AMX (amx.c), set by cpu_kernels.enable where the CPU has it: C = A B for a block and a group
 * of rows, A as bf16 (block_gemm: from AMX_MIN_ROWS rows when the inputs fill whole tiles). */
amx_fn amx_block;
static void (*amx_call_begins)(void); /* amx.c's ms_amx_new_call */

void ms_set_amx(void *block, void *new_call) {
    amx_block = (amx_fn)block;
    amx_call_begins = (void (*)(void))new_call;
}

void amx_new_call(void) {
    if (amx_call_begins) amx_call_begins();
}

int amx_enabled(void) { return amx_block != NULL; }

/* int8 products: VNNI (int8_vnni.c) and AMX's int8 tiles (amx.c), or NULL (int8_block) */
int8_fn int8_vnni, int8_amx;
int8g_fn int8g_vnni, int8g_amx; /* their forms with an activation scale per ACT_GROUP inputs */
void ms_set_int8(void *vnni, void *amx, void *vnni_grouped, void *amx_grouped) {
    int8_vnni = (int8_fn)vnni;
    int8_amx = (int8_fn)amx;
    int8g_vnni = (int8g_fn)vnni_grouped;
    int8g_amx = (int8g_fn)amx_grouped;
}
/* int4 products (int4.c, the path cpu_kernels.INT4 names), or NULL */
int4w_fn int4_wblock;
void ms_set_int4(void *wblock) { int4_wblock = (int4w_fn)wblock; }

/* the avx512 build's decode attention compiled with AVX512-VNNI (int4 rows on vpdpbusd), set
 * where the CPU has it; NULL: ms_decode_attention runs its own body */
attention_fn attention_vnni;
void ms_set_attention_vnni(void *attention) { attention_vnni = (attention_fn)attention; }

/* which integer product runs (for the start-up log line): 2 AMX, 1 VNNI, 0 vpmaddubsw */
int ms_int8_path(void) { return int8_amx ? 2 : int8_vnni ? 1 : 0; }
