"""Fixtures for the REST tests: real servers on free 127.0.0.1 ports, in this process
(bench.harness.InProcessServer, so tests can also look at the engine object directly); tests
that need a real process (SIGTERM, a model fetched by name) use bench.harness.ServerProcess.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.harness import InProcessServer
from service.api_keys import KeyRing
from service.settings import Settings

MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 64 * 1024


def make_settings(model_dir: Path, **overrides) -> Settings:
    base = {
        "model": str(model_dir),
        "port": 0,
        "grpc_port": -1,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_tokens": 8192,
        "max_num_seqs": 8,
        "max_body_bytes": MAX_BODY_BYTES,
        "drain_timeout": 10.0,
        "device": "cpu",
        "dtype": "float32",
    }
    return Settings(**{**base, **overrides})


@pytest.fixture(scope="session")
def server(tiny_model_dir) -> Iterator[InProcessServer]:
    with InProcessServer(make_settings(tiny_model_dir)) as srv:
        yield srv


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return server.state.model_name


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture
def api_key(server) -> Iterator[str]:
    """Turns on --api-key for the duration of one test (the guard reads the live key ring)."""
    open_keys = server.state.keys
    server.state.keys = KeyRing("sk-test-key")
    try:
        yield "sk-test-key"
    finally:
        server.state.keys = open_keys


@pytest.fixture(scope="session")
def start_server(tiny_model_dir):
    """start_server(**settings overrides) -> a context manager running another server."""
    return lambda **overrides: InProcessServer(make_settings(tiny_model_dir, **overrides))


@pytest.fixture(scope="session")
def wait_idle():
    return _wait_idle


def _wait_idle(server: InProcessServer, timeout: float) -> float:
    """Seconds until the engine holds no KV block and no request; fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        engine = server.engine
        if engine.kv_blocks_used == 0 and engine.num_requests == 0 and server.state.in_flight == 0:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(
        f"engine still busy after {timeout} s: {server.engine.kv_blocks_used} blocks, "
        f"{server.engine.num_requests} requests"
    )
