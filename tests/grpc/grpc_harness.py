"""The gRPC test server: engine and grpc.aio server on a private event loop in a thread, on a free
127.0.0.1 port, with a plain synchronous client (channel + stub)."""

from __future__ import annotations

import asyncio
import threading
from typing import Self

import grpc

from inference import AsyncLLMEngine
from service.grpc_server import GrpcServer
from service.proto.moeserve.v1 import inference_pb2_grpc
from service.settings import Settings
from service.state import ServingState

MODEL_NAME = "demo-tiny"
MAX_MODEL_LEN = 2048


class GrpcServerThread:
    """Engine and gRPC server on a private event loop; `run(coro)` executes on that loop."""

    def __init__(self, model_path, max_num_seqs: int = 8, **settings) -> None:
        self.model_path = model_path
        self.max_num_seqs = max_num_seqs
        self.settings = Settings(**settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="grpc-test-server", daemon=True
        )

    def __enter__(self) -> Self:
        self._thread.start()
        self.run(self._start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        return self

    async def _start(self) -> None:
        self.engine = AsyncLLMEngine.from_pretrained(
            self.model_path,
            device="cpu",
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_tokens=8192,
            max_num_seqs=self.max_num_seqs,
            max_waiting=self.settings.max_waiting,
        )
        self.engine.start()
        self.state = ServingState(self.engine, self.settings, MODEL_NAME)
        self.server = await GrpcServer.start(self.state, "127.0.0.1", 0)
        self.port = self.server.port

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def kv_blocks_used(self) -> int:
        return self.engine.kv_blocks_used

    def __exit__(self, *exc) -> None:
        self.channel.close()
        self.run(self.server.stop(0.5))
        self.run(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
