"""Fixtures for the inspector tests: real servers (bench.harness.InProcessServer) on free
127.0.0.1 ports, with JSON logging configured so that request lines reach the inspector."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from bench.harness import InProcessServer
from service.settings import Settings
from telemetry.logging import configure_logging

COMPLETIONS = "/v1/completions"


def inspector_settings(model_dir: Path, **overrides) -> Settings:
    base = {
        "model": str(model_dir),
        "port": 0,
        "grpc_port": -1,
        "max_model_len": 512,
        "kv_cache_tokens": 8192,
        "max_num_seqs": 8,
        "device": "cpu",
        "dtype": "float32",
        "drain_timeout": 10.0,
    }
    return Settings(**{**base, **overrides})


@pytest.fixture(scope="module")
def json_logging() -> Iterator[io.StringIO]:
    """The process's log lines as JSON into a buffer (as `moeserve serve` configures them),
    put back as they were afterwards."""
    config, root = structlog.get_config(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("json", stream=stream, cache_loggers=False)
    yield stream
    structlog.configure(**config)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
def start_inspector(tiny_model_dir, json_logging):
    """start_inspector(**settings overrides) -> a context manager running a server."""
    return lambda **overrides: InProcessServer(inspector_settings(tiny_model_dir, **overrides))


@pytest.fixture(scope="module")
def server(start_inspector) -> Iterator[InProcessServer]:
    with start_inspector() as srv:
        yield srv


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
