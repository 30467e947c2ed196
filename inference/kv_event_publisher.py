"""Publishes KV-cache event batches over ZeroMQ as vLLM's ZmqEventPublisher does, so its
subscribers work unchanged: a PUB socket sends (topic, 8-byte big-endian sequence number,
msgpack KVEventBatch) per batch; an optional ROUTER socket answers a replay request (an 8-byte
big-endian start sequence) with every buffered (topic, sequence, payload) from there on, then
the end marker (b"", -1, b""): current vLLM's replay frames, which vLLM's router (0.1.17)
requires (it drops a replay without the topic frame, and with it every event published
before it subscribed: a router started after the replicas could then anchor no later block).

The engine core's step only appends the batch to a queue (`publish`); encoding, sending and
replay run on this publisher's thread, so a slow subscriber or network never slows a step. A
full queue (the thread far behind) drops the batch and says so in the log rather than block
the step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count

import msgspec
import zmq

from inference.errors import InvalidParameterError
from inference.kv_events import KVEventBatch, KVEventsConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.1  # how long the thread waits for a batch before looking at replay requests


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):  # vLLM's rule: a wildcard or local address is bound
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            try:
                self._replay.bind(config.replay_endpoint)
            except zmq.ZMQError:  # leave no socket bound behind the refused start
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise
        self.dropped = 0  # batches dropped on a full queue
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Called on the step path: queues the batch, never blocks."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            log.warning("kv events: queue full, batch dropped (%d so far)", self.dropped)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Sends what is queued (up to `timeout`), then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seqs = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError:
                    log.exception("kv events: replay request failed")
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(seqs), encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("kv events: publish failed (the batch stays replayable)")
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                frames = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(frames)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def start_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher `config` asks for (None: none); an endpoint it cannot bind or reach is
    an InvalidParameterError naming kv_events_config."""
    if config is None:
        return None
    try:
        return ZmqEventPublisher(config)
    except zmq.ZMQError as exc:
        raise InvalidParameterError(
            "kv_events_config", f"cannot open {config.endpoint} / {config.replay_endpoint}: {exc}"
        ) from None


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
