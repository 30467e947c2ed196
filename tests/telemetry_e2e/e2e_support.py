"""`moeserve serve` as a subprocess for the end-to-end telemetry tests: JSON logs on its
stdout parsed line by line, spans exported over OTLP to the tests' in-process receiver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import grpc

from service.proto.moeserve.v1 import inference_pb2_grpc
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

REPO = Path(__file__).resolve().parents[2]

__all__ = ["OtlpReceiver", "ReceivedSpan", "Service"]


class Service:
    """`python -m service.cli serve` on free ports; `records` are its JSON log lines."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--log-format",
            "json",
            *args,
        ]
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            **(env or {}),
        }
        self.records: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._cond = threading.Condition()
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            started = self.wait_for(lambda r: r.get("event") == "server started", timeout=180)[0]
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{started['rest_port']}"
        self.grpc_target = f"127.0.0.1:{started['grpc_port']}"
        self.channel = grpc.insecure_channel(self.grpc_target)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            with self._cond:
                self.raw.append(line)
                if isinstance(record, dict):
                    self.records.append(record)
                self._cond.notify_all()

    def wait_for(self, predicate, count: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [r for r in self.records if predicate(r)]
                if len(found) >= count:
                    return found
                if time.monotonic() > deadline or (self.proc.poll() is not None and not found):
                    raise AssertionError(
                        f"{len(found)}/{count} matching log lines; output:\n"
                        + "".join(self.raw[-60:])
                    )
                self._cond.wait(0.2)

    def summary(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The one "request finished" line of `request_id`."""
        lines = self.wait_for(
            lambda r: r.get("event") == "request finished" and r.get("request_id") == request_id,
            timeout=timeout,
        )
        assert len(lines) == 1, lines
        return lines[0]
