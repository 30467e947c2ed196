"""A served engine with vLLM's --kv-events-config (issue 36): its engine core publishes the
prefix cache's events on ZMQ in vLLM's wire format; a subscriber decodes them with vLLM's
struct definitions (tests/inference/test_kv_events.py) and finds each request's full blocks
stored under the engine's chained block hashes, evictions of stored blocks only once a small
cache fills, and the replay socket hands back what was published."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

from bench.harness import InProcessServer, free_port
from inference.block_manager import _chain_hash
from inference.kv_event_publisher import END_SEQ
from tests.inference.test_kv_events import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    decode_vllm,
)
from tests.service.conftest import make_settings

BLOCK = 16
KV_TOKENS = 256  # 16 blocks: a few distinct prompts evict earlier ones


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[tuple[InProcessServer, int, int]]:
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "moeserve",
    }
    settings = make_settings(
        tiny_model_dir,
        kv_events_config=json.dumps(config),
        kv_cache_tokens=KV_TOKENS,
        max_model_len=128,
        max_num_seqs=2,
    )
    with InProcessServer(settings) as server:
        yield server, port, replay_port


def _receive(sub: zmq.Socket, until, timeout: float = 30.0) -> list[tuple[int, object]]:
    """(sequence, batch) as published, until `until(batches)` holds."""
    got, deadline = [], time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"events missing; got {got}"
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"moeserve"
            got.append((int.from_bytes(seq, "big"), decode_vllm(payload)))
    return got


def _prompt_hashes(prompt: list[int]) -> list[int]:
    """The chained hashes of a prompt's full blocks, as the engine's block manager makes them."""
    hashes, parent = [], 0
    for start in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
        parent = _chain_hash(parent, prompt[start : start + BLOCK])
        hashes.append(parent)
    return hashes


def _events(batches) -> list:
    return [e for _, b in batches for e in b.events]


def test_the_engine_publishes_its_cache_as_vllm_does(served):
    server, port, replay_port = served
    vocab = server.state.engine.args.vocab_size
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"moeserve")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # a PUB socket sends nothing to a subscription still on its way
    prompts = [[random.Random(i).randrange(10, vocab) for _ in range(70)] for i in range(6)]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for prompt in prompts:
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
        expected = {h for prompt in prompts for h in _prompt_hashes(prompt)}

        def all_seen(got) -> bool:
            events = _events(got)
            hashes = {h for e in events if isinstance(e, VllmBlockStored) for h in e.block_hashes}
            return expected <= hashes and any(isinstance(e, VllmBlockRemoved) for e in events)

        batches = _receive(sub, all_seen)
        stored: dict[int, list[int]] = {}
        live: set[int] = set()
        for event in _events(batches):
            if isinstance(event, VllmBlockStored):
                assert event.block_size == BLOCK and event.medium == "GPU"
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash or 0
                for i, h in enumerate(event.block_hashes):  # the engine's chained hashes
                    tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                    parent = _chain_hash(parent, tokens)
                    assert h == parent
                    stored[h] = tokens
                    live.add(h)
            elif isinstance(event, VllmBlockRemoved):
                assert set(event.block_hashes) <= live, "removed a block never stored"
                live -= set(event.block_hashes)
            assert len(live) <= KV_TOKENS // BLOCK  # never more cached than the cache holds
        # each prompt's four full blocks were stored, under the chain of its own tokens
        for prompt in prompts:
            for i, h in enumerate(_prompt_hashes(prompt)):
                assert stored[h] == prompt[i * BLOCK : (i + 1) * BLOCK]
        # replay from the first sequence: the same batches, then the end marker
        first_seq = batches[0][0]
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 10000)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = {}
        while True:
            _, topic, seq, payload = replay.recv_multipart()  # current vLLM's frames
            if seq == END_SEQ:
                break
            assert topic == b"moeserve"  # the server's topic
            replayed[int.from_bytes(seq, "big")] = decode_vllm(payload)
        replay.close(linger=0)
        assert isinstance(replayed[0].events[0], VllmAllBlocksCleared)  # a fresh cache first
        for seq, batch in batches:
            assert replayed[seq] == batch
        assert min(replayed) == 0 and first_seq in replayed
    finally:
        sub.close(linger=0)
        ctx.term()
