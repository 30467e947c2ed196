/* What the AMX library's files share (amx.c, amx_int4.c): the tile instructions (the CPU's,
 * or amx_emulation.h's plain C with -DMS_AMX_EMULATED) and each thread's tile configuration,
 * which amx.c loads and remembers: a tile register file has one configuration a thread, so
 * one record of it serves both files' products. */
#ifndef MS_AMX_TILES_H
#define MS_AMX_TILES_H

#if defined(MS_AMX_EMULATED)
#include "amx_emulation.h"
#else
#include <immintrin.h>
#endif

/* Tiles: 0 C (16 rows), 1 A (16 rows), 2 B, 3 C (`tail` rows), 4 A (`tail` rows); a second
 * block's 5 C (16 rows), 6 B, 7 C (`tail` rows); C rows of 16 int32 (or float32), A rows of
 * 64 bytes and B tiles of 16 rows of 64 bytes, or where `grouped`, A rows of 32 bytes and B
 * tiles of 8 rows (one multiply a group of 32 inputs). Loaded unless this thread's tiles
 * already have this shape in this call of the kernel library (ms_amx_new_call). */
__attribute__((visibility("hidden"))) void amx_configure(int tail, int grouped);
void ms_amx_new_call(void);

#endif
