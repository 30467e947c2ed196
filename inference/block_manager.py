"""Paged KV block bookkeeping: free list, ref counts, prefix caching by chained block hash.

Pure Python, no tensors. A freed block keeps its hash and content until it is reused, so a
later request with the same prefix can pick it up again (LRU eviction from the free list).

After `record_events()` the manager also notes what enters and leaves the prefix cache as vLLM's
KV-cache events (inference/kv_events.py), starting with AllBlocksCleared (a fresh cache);
`take_events()` hands them over once per step (the engine core publishes them).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from inference.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEventType,
)
from inference.sequence import Sequence


def _chain_hash(parent: int, tokens: list[int]) -> int:
    h = xxhash.xxh64(parent.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.intdigest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_of: dict[int, int] = {}  # block -> hash
        self.block_of: dict[int, int] = {}  # hash -> block
        self.num_used = 0  # blocks with ref_count > 0
        # KV-cache events since the last take_events(); None: not recorded
        self.events: list[KVCacheEventType] | None = None

    def record_events(self) -> None:
        """From now on, note the cache's events; the first clears what a subscriber knew of an
        earlier process on this endpoint (blocks cached before, by a warm-up, go unannounced:
        a router only misses their hits)."""
        self.events = [AllBlocksCleared()]

    def take_events(self) -> list[KVCacheEventType]:
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block, _ = self.free.popitem(last=False)
            self._forget_hash(block)
            self._ref(block)
            seq.block_table.append(block)

    def use_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence without blocks: take the longest cached run of its full blocks, never
        the very last token (its logits must be computed). Returns the tokens reused."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        parent, hits = 0, []
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            parent = _chain_hash(parent, seq.token_ids[start : start + self.block_size])
            block = self.block_of.get(parent)
            if block is None:
                break
            hits.append((block, parent))
        for block, h in hits:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self._ref(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else 0
        run: list[int] = []  # consecutive blocks newly cached: one BlockStored event
        run_first = run_parent = 0
        for i in range(seq.num_hashed_blocks, full):
            previous, parent = (
                parent,
                _chain_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size]),
            )
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self.block_of and block not in self.hash_of:
                self.block_of[parent] = block
                self.hash_of[block] = parent
                if self.events is not None:
                    if not run:
                        run_first, run_parent = i, previous
                    run.append(parent)
            elif run:
                self._stored(seq, run_first, run_parent, run)
                run = []
        if run:
            self._stored(seq, run_first, run_parent, run)
        seq.num_hashed_blocks = max(full, seq.num_hashed_blocks)

    def _stored(self, seq: Sequence, first: int, parent: int, hashes: list[int]) -> None:
        size = self.block_size
        tokens = seq.token_ids[first * size : (first + len(hashes)) * size]
        # a chain's first block has no parent: 0 here, None (nil) on the wire
        self.events.append(BlockStored(hashes, parent or None, tokens, size, None, MEDIUM, None))

    def free_sequence(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are evicted before its shared prefix.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.num_used -= 1
                self.free[block] = None
        seq.block_table = array("i")
        seq.block_hashes = []
        seq.num_hashed_blocks = 0

    def release_uncomputed(self, seq: Sequence) -> None:
        """Frees the blocks past the sequence's computed tokens (speculative decoding: those
        taken for draft tokens that were rejected). They were never full, so they carry no
        hash and no event; they go to the front of the free list, to be reused before any
        cached block is evicted."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.num_used -= 1
                self.free[block] = None
                self.free.move_to_end(block, last=False)

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.num_used += 1
        self.ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.block_of.get(h) == block:
            del self.block_of[h]
            if self.events is not None:
                self.events.append(BlockRemoved([h], MEDIUM))
