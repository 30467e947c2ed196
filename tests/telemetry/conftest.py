"""Fixtures for the telemetry tests. `OtlpReceiver` lives in otlp_receiver.py so other
test packages can import it (as tests.telemetry.otlp_receiver once tests/ is a package)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry import logging as tlog
from telemetry import tracing
from tests.telemetry.otlp_receiver import OtlpReceiver


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A private provider exporting synchronously to memory (no global state)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    yield provider
    provider.shutdown()


@pytest.fixture
def tracer(tracer_provider: TracerProvider):
    return tracer_provider.get_tracer("test")


@pytest.fixture
def log_stream() -> io.StringIO:
    """JSON logging (debug and up) into a buffer."""
    stream = io.StringIO()
    tlog.configure_logging("json", "debug", stream=stream, cache_loggers=False)
    return stream


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Tests reconfigure logging: put back what was there before."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _reset_tracing() -> Iterator[None]:
    yield
    tracing.shutdown_tracing(timeout_s=2.0)
