"""Fixtures for the gRPC tests: the real server on a free port (see grpc_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inference.checkpoints.demo_model import ensure_demo_model
from tests.grpc.grpc_harness import GrpcServerThread


@pytest.fixture(scope="session")
def model_path():
    return ensure_demo_model("tiny")


@pytest.fixture(scope="module")
def server(model_path) -> Iterator[GrpcServerThread]:
    """Shared by a module's tests: default settings; tests must not drain it."""
    with GrpcServerThread(model_path) as srv:
        yield srv


@pytest.fixture
def make_server(model_path):
    """Factory for a private server with its own Settings (api_key, max_waiting, ...)."""
    started: list[GrpcServerThread] = []

    def make(**kwargs) -> GrpcServerThread:
        srv = GrpcServerThread(model_path, **kwargs).__enter__()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.__exit__(None, None, None)
