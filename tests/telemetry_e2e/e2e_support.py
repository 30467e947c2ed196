"""`moeserve serve` as a subprocess for the end-to-end telemetry tests (bench/harness.py's
ServerProcess): JSON logs parsed line by line, spans exported over OTLP to the tests' in-process
receiver, a gRPC stub on its gRPC port."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import grpc

from bench.harness import ServerProcess
from service.proto.moeserve.v1 import inference_pb2_grpc
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

__all__ = ["OtlpReceiver", "ReceivedSpan", "Service"]


class Service(ServerProcess):
    """The server on CPU in float32 with gRPC, batching spans every 50 ms; `stub` is a client."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(
            model_dir,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *args,
            grpc=True,
            env={"OTEL_BSP_SCHEDULE_DELAY": "50", **(env or {})},
        )
        self.channel: grpc.Channel | None = None

    def __enter__(self) -> Self:
        super().__enter__()
        self.channel = grpc.insecure_channel(self.grpc_target)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        return super().stop(timeout)

    def summary(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The one "request finished" line of `request_id`."""
        lines = self.wait_for(
            lambda r: r.get("event") == "request finished" and r.get("request_id") == request_id,
            timeout=timeout,
        )
        assert len(lines) == 1, lines
        return lines[0]
