#include <pthread.h>
#include <stdlib.h>

#include "kernels.h"

/* ---- scratch memory ------------------------------------------------------------------ */

/* One region, reused across calls: a kernel takes its scratch with region_alloc between
 * region_enter and region_leave, and a kernel called from another (the fused decoder layer)
 * takes its own on top and gives it back when it returns. When a call needs more than the
 * region holds, the rest comes from extra blocks, and the region grows to the high-water mark
 * when the outermost call ends, so steady-state calls never allocate. The lock serialises
 * callers (the owner thread only: OpenMP workers never allocate). */
static pthread_mutex_t region_lock = PTHREAD_MUTEX_INITIALIZER;
static char *region;
static size_t region_size, region_used, region_peak;
static void **extra; /* blocks allocated past the region during this call, as a linked list */
static __thread int region_depth;
static __thread size_t region_marks[8];

void region_enter(void) {
    if (region_depth++ == 0) {
        pthread_mutex_lock(&region_lock);
        region_used = region_peak = 0;
        amx_new_call(); /* every outermost call enters here, before its parallel regions */
    }
    region_marks[region_depth < 8 ? region_depth : 7] = region_used;
}

void *region_alloc(size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    if (region_used + bytes <= region_size) {
        void *p = region + region_used;
        region_used += bytes;
        region_peak = region_used > region_peak ? region_used : region_peak;
        return p;
    }
    void **block = aligned_alloc(64, bytes + 64);
    if (!block) return NULL;
    *block = extra;
    extra = block;
    region_peak += bytes; /* what the region should hold next time */
    return (char *)block + 64;
}

void region_leave(void) {
    region_used = region_marks[region_depth < 8 ? region_depth : 7];
    if (--region_depth) return;
    if (extra) {
        while (extra) {
            void **next = *extra;
            free(extra);
            extra = next;
        }
        free(region);
        region_size = (region_peak + 65535) & ~(size_t)65535;
        region = aligned_alloc(64, region_size);
        if (!region) region_size = 0;
    }
    pthread_mutex_unlock(&region_lock);
}

