from inference.block_manager import BlockManager
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence


def seq(tokens, sid="s"):
    return Sequence(sid, sid, 0, tokens, SamplingParams(), None)


def test_allocate_and_free_track_usage():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    assert bm.blocks_needed(s, 10) == 3 and bm.can_allocate(s, 10)
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_used == 3 and bm.usage == 3 / 8
    assert not bm.can_allocate(seq(list(range(40))), 40)
    bm.free_sequence(s)
    assert bm.num_used == 0 and not s.block_table and len(bm.free) == 8


def test_prefix_blocks_are_shared_and_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)), "a")
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full and computed
    b = seq(list(range(9)) + [99], "b")
    assert bm.use_cached_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2]
    bm.free_sequence(a)
    assert bm.num_used == 2  # still held by b
    bm.free_sequence(b)
    assert bm.num_used == 0
    c = seq(list(range(8)) + [1, 2, 3], "c")  # freed blocks keep their content for reuse
    assert bm.use_cached_prefix(c) == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)), "a")
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = seq(list(range(8)), "b")  # identical prompt: only the first block may be reused
    assert bm.use_cached_prefix(b) == 4


def test_lru_eviction_forgets_hashes():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(list(range(5)), "a")
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free_sequence(a)
    other = seq(list(range(100, 108)), "o")
    bm.allocate(other, 8)  # takes both blocks, evicting a's cached block
    bm.free_sequence(other)
    assert bm.use_cached_prefix(seq(list(range(5)), "a2")) == 0


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = seq(list(range(9)), "a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert bm.use_cached_prefix(seq(list(range(9)), "b")) == 0
