"""Fixtures for the load-test tests: the real server (`python -m service.cli serve`) as a
subprocess on free loopback ports, serving the tiny demo model behind an API key, and the two
load tools (loadtest/locustfile.py, loadtest/bench_serving.py) driven against it like a user
would."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
API_KEY = "sk-loadtest"


@dataclass
class RunningServer:
    proc: subprocess.Popen
    rest_port: int
    grpc_port: int
    model: str
    api_key: str
    log: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def _start(model_dir: Path, timeout: float = 120.0) -> RunningServer:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    for name in list(env):  # the server reads MOESERVE_* flags: start from the defaults
        if name.startswith("MOESERVE_"):
            env.pop(name)
    args = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny-loadtest",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--kv-cache-tokens",
        "8192",
        "--log-format",
        "json",
        "--api-key",
        API_KEY,
    ]
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "server started":
            return RunningServer(
                proc,
                int(record["rest_port"]),
                int(record["grpc_port"]),
                "tiny-loadtest",
                API_KEY,
                log,
            )
    proc.kill()
    proc.wait(10)
    raise AssertionError("server did not log 'server started'; output:\n" + "".join(log))


@pytest.fixture(scope="session")
def live_server(tiny_model_dir) -> Iterator[RunningServer]:
    server = _start(Path(tiny_model_dir))
    try:
        httpx.get(server.url + "/ready", timeout=30).raise_for_status()
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.terminate()
            try:
                server.proc.wait(20)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait(10)


@pytest.fixture(scope="session")
def bench_serving():
    """loadtest/bench_serving.py as a module (it is a script, not a package member; like
    `python loadtest/bench_serving.py`, it finds its sibling prompt_words.py on sys.path)."""
    if str(LOADTEST) not in sys.path:
        sys.path.insert(0, str(LOADTEST))
    spec = importlib.util.spec_from_file_location("bench_serving", LOADTEST / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_serving", module)
    spec.loader.exec_module(module)
    return module
