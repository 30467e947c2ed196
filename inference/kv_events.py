"""KV-cache events in vLLM's wire format (SPEC section 13, Scale-out), so that what reads vLLM's
(the Gateway API Inference Extension's precise prefix scorer, llm-d's KV indexer, vLLM's router
under kv_aware) reads ours unchanged.

The structs are vLLM's current ones (vllm/distributed/kv_events.py): a batch is a msgpack
array [ts, events, data_parallel_rank]; each event is a map tagged {"type": its class name},
fields at their defaults left out but for those vLLM requires (BlockStored always carries
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name). vLLM's
router (0.1.17) decodes exactly this: it refuses a map batch ("KV event batch must be an
array") and array events ("KV event must be a tagged map"). Block hashes are our prefix cache's
chained xxh64 values, as unsigned 64-bit integers (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
form).

`--kv-events-config` takes vLLM's KVEventsConfig as JSON: `kv_events_config()` reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from inference.errors import InvalidParameterError

# vLLM names the medium a block lives in; its engine's own cache is "GPU", and consumers rank
# other media (CPU offload, disk) below it. Our paged cache is that primary cache, on any device.
MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events (vLLM's)."""


class BlockStored(KVCacheEvent):
    """Full blocks of one sequence entered the prefix cache: `block_hashes` in chain order,
    `parent_block_hash` the hash before the first (None at the sequence's start), `token_ids`
    the blocks' tokens (len(block_hashes) * block_size)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: LoRA, salt, media
    group_idx: int | None = None  # the KV cache group (one here)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks evicted (their memory reused): no longer a prefix-cache hit."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVCacheEventType = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVCacheEventType]


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (vllm/config/kv_events.py), same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"  # PUB: bound when it has a wildcard, else connected
    replay_endpoint: str | None = None  # ROUTER answering replay requests from the buffer
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_INTS = ("buffer_steps", "hwm", "max_queue_size")


def kv_events_config(text: str | None) -> KVEventsConfig | None:
    """--kv-events-config (JSON) -> the config, None when it publishes nothing; a bad value is
    an InvalidParameterError naming kv_events_config."""
    if not text:
        return None
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise _bad("must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise _bad(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if not isinstance(given.get("enable_kv_cache_events", False), bool):
        raise _bad("enable_kv_cache_events must be true or false")
    enabled = given.get("enable_kv_cache_events", False)
    publisher = given.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise _bad(f'publisher must be "zmq" or "null", got {publisher!r}')
    for name in _INTS:
        value = given.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _bad(f"{name} must be an integer >= 1")
    for name in ("endpoint", "topic"):
        if not isinstance(given.get(name, ""), str):
            raise _bad(f"{name} must be a string")
    replay = given.get("replay_endpoint")
    if replay is not None and not isinstance(replay, str):
        raise _bad("replay_endpoint must be a string")
    config = KVEventsConfig(**{**given, "publisher": publisher})
    if config.publishes and not config.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise _bad(f"endpoint must be a tcp://, ipc:// or inproc:// address: {config.endpoint}")
    return config if config.publishes else None


def _bad(message: str) -> InvalidParameterError:
    return InvalidParameterError("kv_events_config", message)
