"""inference/heap.py: the collector pauses on old objects only inside the block, and the
allocator settings take on glibc."""

import gc
import platform
import weakref

import pytest

from inference import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_objects_frozen_for_the_block_are_collected_after_it():
    assert gc.get_freeze_count() == 0
    node = Node()
    alive = weakref.ref(node)
    with heap.collector_skips_existing():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: the collector leaves it alone in the block
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_a_process_frozen_already_stays_frozen():
    # What a frozen object does, not the freeze count: other threads (pytest-xdist's) free
    # frozen objects of their own meanwhile, which lowers the count.
    node = Node()
    alive = weakref.ref(node)
    gc.freeze()
    try:
        with heap.collector_skips_existing():
            pass
        del node
        gc.collect()
        assert alive() is not None  # still frozen after the block
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive() is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds():
    assert heap.keep_freed_memory()
