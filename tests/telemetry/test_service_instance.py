"""service.instance.id (telemetry/instance.py): from OTEL_RESOURCE_ATTRIBUTES, else
<hostname>:<port> once assigned; on the tracer provider's resource (so on every span) and on
every JSON log line."""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator

import pytest

from telemetry import instance
from telemetry import logging as tlog
from telemetry.logging import configure_logging, get_logger
from telemetry.tracing import build_tracer_provider


@pytest.fixture(autouse=True)
def _forget_the_id() -> Iterator[None]:
    instance.reset()
    yield
    instance.reset()


def _line(stream: io.StringIO) -> dict:
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines() if x.strip()]
    return line


def test_the_default_is_hostname_and_port(monkeypatch):
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert instance.current() is None
    assert instance.assign(8123) == f"{socket.gethostname()}:8123"
    assert instance.current() == f"{socket.gethostname()}:8123"


def test_the_environment_wins_over_the_default(monkeypatch):
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=t,service.instance.id=r-7"
    )
    assert instance.current() == "r-7"  # known before any port is
    assert instance.assign(8123) == "r-7"


def test_spans_carry_it_on_their_resource(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=t")
    instance.assign(9001)
    provider = build_tracer_provider()
    with provider.get_tracer("t").start_as_current_span("request") as span:
        pass
    attributes = span.resource.attributes
    assert attributes["service.instance.id"] == f"{socket.gethostname()}:9001"
    assert attributes["service.name"] == "moeserve"
    assert attributes["deployment.environment.name"] == "t"  # the variable's others stay
    provider.shutdown()


def test_log_lines_carry_it_and_an_explicit_field_wins(monkeypatch):
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    stream = io.StringIO()
    configure_logging("json", stream=stream, cache_loggers=False)
    get_logger("t").info("before the port is known")
    assert "service.instance.id" not in _line(stream)
    instance.assign(9002)
    for logged in ({}, {"service.instance.id": "other"}):
        stream.seek(0), stream.truncate()
        get_logger("t").info("after", **logged)
        expected = logged.get("service.instance.id", f"{socket.gethostname()}:9002")
        assert _line(stream)["service.instance.id"] == expected


def test_a_child_process_is_given_the_id_with_its_logging(monkeypatch):
    """The engine core's set-up: capture_request_lines(fmt, instance_id=) from its parent."""
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    before = list(tlog._line_sinks)
    take = tlog.capture_request_lines("json", instance_id="host-a:7000")
    try:
        get_logger("engine").info("step", trace_id="a" * 32, span_id="b" * 16)
        ((trace_id, line),) = take()
    finally:
        for sink in [s for s in tlog._line_sinks if s not in before]:
            tlog.remove_line_sink(sink)
    assert trace_id == "a" * 32 and json.loads(line)["service.instance.id"] == "host-a:7000"
