"""How an inference process keeps its heap: the garbage collector and glibc's allocator.

Both showed in perf profiles of a batched decode on the CPU (32 x 128 -> 128, Xeon, 2 cores;
bench/NOTES.md): the collector's full passes over the objects loading left (torch,
transformers, the tokenizer: hundreds of thousands) took 6% of the samples, and page faults
about 3% (920k in a run), every step's freed logits and activations going back to the
kernel and faulting in again, zeroed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
from collections.abc import Iterator

import structlog

log = structlog.get_logger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks under this come from the heap (glibc's threshold adapts up to 32 MB on its own,
# but then trims the heap's top past twice it); freed memory over this stays mapped.
_MMAP_THRESHOLD = 64 << 20
_TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Keeps freed blocks in glibc's heap instead of returning them to the kernel (vLLM's CPU
    backend preloads tcmalloc for the same reason). Process-wide; False where the C library
    is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    done = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(
        _M_TRIM_THRESHOLD, _TRIM_THRESHOLD
    )
    if not done:
        log.info("glibc kept its own allocation thresholds (mallopt refused)")
    return bool(done)


def freeze_startup_objects() -> None:
    """For a process that keeps one engine for life: what loading left goes to the collector's
    permanent generation, so its passes walk only what serving allocates (vLLM's engine core
    does the same). Not for a process that makes several engines: an earlier one, frozen,
    would never be freed."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collector_skips_existing() -> Iterator[None]:
    """Inside the block, the collector leaves alone the objects that existed when it began
    (LLMEngine.generate: a batch's steps); afterwards they are collected as before. Where
    the process froze its objects already (freeze_startup_objects), that stays."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
