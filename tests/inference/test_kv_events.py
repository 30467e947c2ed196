"""KV-cache events (issue 36): the block manager's stores and removals as vLLM's events, their
wire format decoded with vLLM's own struct definitions (copied below from
vllm/distributed/kv_events.py), the ZMQ publisher with its replay socket, and
--kv-events-config."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from bench.harness import free_port
from inference.block_manager import BlockManager, _chain_hash
from inference.errors import InvalidParameterError
from inference.kv_event_publisher import END_SEQ, ZmqEventPublisher, start_publisher
from inference.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    kv_events_config,
)
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence


# ---- vLLM's definitions (vllm/distributed/kv_events.py), as its subscribers decode ------------
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


decode_vllm = msgspec.msgpack.Decoder(VllmKVEventBatch).decode

BS = 4


def _seq(tokens, sid="s"):
    return Sequence(sid, sid, 0, tokens, SamplingParams(), None)


def _computed(bm: BlockManager, tokens: list[int], sid: str) -> Sequence:
    s = _seq(tokens, sid)
    bm.use_cached_prefix(s)
    bm.allocate(s, len(tokens) - s.num_computed_tokens)
    s.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(s)
    return s


def _chain(tokens: list[int]) -> list[int]:
    hashes, parent = [], 0
    for start in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = _chain_hash(parent, tokens[start : start + BS])
        hashes.append(parent)
    return hashes


def test_the_block_manager_notes_stores_and_evictions_as_vllms_events():
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.take_events() == []  # nothing recorded until asked
    bm.record_events()
    a_tokens = list(range(10))  # two full blocks and a partial one
    a = _computed(bm, a_tokens, "a")
    events = bm.take_events()
    assert events[0] == AllBlocksCleared()
    (stored,) = events[1:]
    assert stored.block_hashes == _chain(a_tokens) == a.block_hashes
    assert stored.parent_block_hash is None and stored.block_size == BS
    assert stored.token_ids == a_tokens[:8] and stored.medium == "GPU"
    assert bm.take_events() == []  # taken once
    # a request sharing the first block, then one more block: only the new block is stored,
    # chained on the shared one
    b_tokens = a_tokens[:4] + [50, 51, 52, 53, 54]
    bm.free_sequence(a)
    b = _computed(bm, b_tokens, "b")
    (stored_b,) = bm.take_events()
    assert stored_b.block_hashes == [_chain(b_tokens)[1]]
    assert stored_b.parent_block_hash == _chain(a_tokens)[0]
    assert stored_b.token_ids == [50, 51, 52, 53]
    # a's second block was free and cached; b took the free blocks LRU-first: the evictions
    # name exactly the hashes that left the cache
    bm.free_sequence(b)
    c = _computed(bm, list(range(100, 116)), "c")  # four new blocks: every cached one goes
    events = bm.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted({*_chain(a_tokens), *_chain(b_tokens)})
    assert all(h not in bm.block_of for h in removed)
    assert next(e for e in events if isinstance(e, BlockStored)).block_hashes == c.block_hashes


def test_a_batch_decodes_with_vllms_structs():
    batch = KVEventBatch(
        12.5,
        [
            AllBlocksCleared(),
            BlockStored([2**64 - 1, 7], None, list(range(8)), 4, None, "GPU", None),
            BlockStored([9], 7, [1, 2, 3, 4], 4, None, "GPU", None),
            BlockRemoved([2**64 - 1], "GPU"),
        ],
        0,
    )
    payload = msgspec.msgpack.encode(batch)
    # vLLM's layout: the batch an array, each event a map tagged by "type", defaults left out
    # but for the fields vLLM requires (vllm-router 0.1.17 refuses any other)
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert ts == 12.5 and rank == 0
    assert events[0] == {"type": "AllBlocksCleared"}
    assert events[1] == {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 7],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert events[3] == {
        "type": "BlockRemoved",
        "block_hashes": [2**64 - 1],
        "medium": "GPU",
    }
    decoded = decode_vllm(payload)
    assert decoded.data_parallel_rank == 0
    first, second = decoded.events[1], decoded.events[2]
    assert isinstance(first, VllmBlockStored) and first.block_hashes == [2**64 - 1, 7]
    assert (first.parent_block_hash, first.lora_id, first.medium) == (None, None, "GPU")
    assert first.lora_name is None and first.extra_keys is None
    assert second.parent_block_hash == 7 and second.token_ids == [1, 2, 3, 4]
    assert isinstance(decoded.events[3], VllmBlockRemoved)
    assert isinstance(decoded.events[0], VllmAllBlocksCleared)


@pytest.fixture
def publisher():
    port, replay_port = free_port(), free_port()
    config = kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://*:{port}", "replay_endpoint": "tcp://*:{replay_port}", '
        '"topic": "kv@a"}'
    )
    pub = ZmqEventPublisher(config)
    try:
        yield pub, port, replay_port
    finally:
        pub.shutdown()


def _subscriber(ctx: zmq.Context, port: int, topic: bytes) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def test_the_publisher_sends_sequenced_batches_and_replays_them(publisher):
    pub, port, replay_port = publisher
    ctx = zmq.Context()
    sub = _subscriber(ctx, port, b"kv@a")
    try:
        # PUB drops what it sends before the subscription arrives: publish until one lands
        probe = KVEventBatch(time.time(), [AllBlocksCleared()])
        deadline = time.monotonic() + 10
        while True:
            pub.publish(probe)
            if sub.poll(100):
                break
            assert time.monotonic() < deadline, "no batch reached the subscriber"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@a"
        first_seq = int.from_bytes(seq, "big")
        batches = [
            KVEventBatch(time.time(), [BlockStored([i], None, [i] * 4, 4, None, "GPU", None)])
            for i in range(3)
        ]
        for batch in batches:
            pub.publish(batch)
        received = []
        while len(received) < 3:
            _, seq, payload = sub.recv_multipart()
            event = decode_vllm(payload).events[0]
            if isinstance(event, VllmBlockStored):
                received.append((int.from_bytes(seq, "big"), event.block_hashes))
        seqs = [s for s, _ in received]
        assert seqs == sorted(seqs) and seqs[0] > first_seq
        assert [h for _, h in received] == [[0], [1], [2]]
        # replay: an 8-byte big-endian start -> every buffered (topic, seq, batch) from there,
        # then (b"", -1, b""), as current vLLM's (vLLM's router drops a replay without topics)
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 5000)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart((b"", seqs[1].to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                assert topic == payload == b""
                break
            assert topic == b"kv@a"
            replayed.append((int.from_bytes(seq, "big"), decode_vllm(payload).events[0]))
        assert [s for s, _ in replayed] == seqs[1:]
        assert [e.block_hashes for _, e in replayed] == [[1], [2]]
        replay.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"enable_kv_cache_events": true, "publishr": "zmq"}', "publishr"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
        ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint"),
    ],
)
def test_a_bad_config_names_the_flag(text, words):
    with pytest.raises(InvalidParameterError) as err:
        kv_events_config(text)
    assert err.value.param == "kv_events_config" and words in err.value.message


def test_a_config_that_publishes_nothing_is_none():
    assert kv_events_config(None) is None
    assert kv_events_config('{"enable_kv_cache_events": false}') is None
    assert kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    config = kv_events_config('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.topic) == ("zmq", "tcp://*:5557", "")


def test_an_endpoint_in_use_is_refused_naming_the_flag(publisher):
    _, port, _ = publisher
    taken = kv_events_config(f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}')
    with pytest.raises(InvalidParameterError) as err:
        start_publisher(taken)
    assert err.value.param == "kv_events_config"


def test_a_replay_endpoint_in_use_releases_the_pub_socket(publisher):
    _, _, replay_port = publisher
    port = free_port()
    config = kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}", '
        f'"replay_endpoint": "tcp://*:{replay_port}"}}'
    )
    with pytest.raises(InvalidParameterError):
        start_publisher(config)
    ctx = zmq.Context.instance()
    probe = ctx.socket(zmq.PUB)
    deadline = time.monotonic() + 5
    while True:  # zmq closes sockets on its I/O thread: the port frees shortly after
        try:
            probe.bind(f"tcp://*:{port}")
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the refused start kept its PUB port bound"
            time.sleep(0.05)
    probe.close(linger=0)
