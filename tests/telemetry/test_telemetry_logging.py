from __future__ import annotations

import io
import json
import logging
import re
from datetime import datetime

import structlog

from telemetry import logging as tlog
from telemetry.logging import configure_logging, get_logger

LOCAL_SECRET = "sk-local-secret"


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_line_fields_outside_a_span(log_stream):
    get_logger("moeserve.test").info("hello", answer=42)
    (line,) = _lines(log_stream)
    assert line["event"] == "hello"
    assert line["answer"] == 42
    assert line["level"] == "info"
    assert line["logger"] == "moeserve.test"
    ts = datetime.fromisoformat(line["timestamp"])
    assert ts.utcoffset().total_seconds() == 0
    assert "trace_id" not in line and "span_id" not in line


def test_json_line_carries_trace_and_span_ids_inside_a_span(log_stream, tracer):
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id="req-1")
    try:
        with tracer.start_as_current_span("request") as span:
            get_logger("moeserve.test").info("inside")
            logging.getLogger("uvicorn.error").warning("stdlib %s", "inside")
    finally:
        structlog.contextvars.clear_contextvars()
    ctx = span.get_span_context()
    lines = _lines(log_stream)
    assert [line["event"] for line in lines] == ["inside", "stdlib inside"]
    for line in lines:
        assert line["trace_id"] == format(ctx.trace_id, "032x")
        assert line["span_id"] == format(ctx.span_id, "016x")
        assert re.fullmatch(r"[0-9a-f]{32}", line["trace_id"])
        assert re.fullmatch(r"[0-9a-f]{16}", line["span_id"])
        assert line["request_id"] == "req-1"
    assert lines[1]["logger"] == "uvicorn.error"
    assert lines[1]["level"] == "warning"


def test_explicit_ids_win(log_stream, tracer):
    with tracer.start_as_current_span("request"):
        get_logger("engine").info("on behalf", trace_id="a" * 32, span_id="b" * 16)
    (line,) = _lines(log_stream)
    assert line["trace_id"] == "a" * 32
    assert line["span_id"] == "b" * 16


def test_level_filtering_and_exceptions():
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream, cache_loggers=False)
    log = get_logger("t")
    log.debug("dropped")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
        logging.getLogger("grpc").exception("stdlib failed")
    lines = _lines(stream)
    assert [line["event"] for line in lines] == ["failed", "stdlib failed"]
    for line in lines:
        assert line["level"] == "error"
        assert "RuntimeError" in json.dumps(line["exception"])


def test_tracebacks_never_show_local_variables():
    """A frame's locals can hold a request's Authorization header, an API key or a prompt."""

    def handler(authorization: str) -> None:
        key = authorization.removeprefix("Bearer ")
        raise RuntimeError(f"failed for a key of {len(key)} characters")

    secret = LOCAL_SECRET  # defined far from the lines rich quotes around each frame
    for fmt in ("json", "console"):
        stream = io.StringIO()
        configure_logging(fmt, "info", stream=stream, cache_loggers=False)
        try:
            handler(f"Bearer {secret}")
        except RuntimeError:
            get_logger("t").exception("failed")
            logging.getLogger("grpc").exception("stdlib failed")
        out = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())  # rich's colours
        assert "failed for a key of 15 characters" in out and "handler" in out, fmt
        assert secret not in out, fmt


def test_unserialisable_values_do_not_break_a_line(log_stream):
    get_logger("t").info("odd", value=object(), exc=ValueError("x"), nested={"a": [1, 2.5]})
    (line,) = _lines(log_stream)
    assert line["value"].startswith("<object object")
    assert line["nested"] == {"a": [1, 2.5]}


def test_console_mode_is_human_readable():
    stream = io.StringIO()
    configure_logging("console", "info", stream=stream, cache_loggers=False)
    get_logger("t").info("console hello", k="v")
    logging.getLogger("litestar").info("from litestar")
    out = stream.getvalue()
    assert "console hello" in out and "k=v" in out and "from litestar" in out
    assert not out.lstrip().startswith("{")
    assert "\x1b[" not in out  # StringIO is no TTY: no colours


def test_default_format_follows_tty():
    stream = io.StringIO()  # not a TTY -> JSON
    configure_logging(None, stream=stream, cache_loggers=False)
    get_logger("t").info("x")
    assert json.loads(stream.getvalue())["event"] == "x"


def test_idempotent_one_handler_one_line():
    stream = io.StringIO()
    configure_logging("json", stream=stream, cache_loggers=False)
    configure_logging("json", stream=stream, cache_loggers=False)
    assert len(logging.getLogger().handlers) == 1
    logging.getLogger("uvicorn").info("once")
    get_logger("t").info("once")
    assert len(_lines(stream)) == 2


def test_logger_created_before_configuration_follows_it():
    early = get_logger("early")  # e.g. a module-level logger, imported before start-up
    stream = io.StringIO()
    configure_logging("json", stream=stream, cache_loggers=False)
    early.info("late", n=1)
    (line,) = _lines(stream)
    assert line["logger"] == "early" and line["n"] == 1


def test_noisy_library_warnings_are_rate_limited():
    stream = io.StringIO()
    configure_logging("json", stream=stream, cache_loggers=False)
    noisy = logging.getLogger("opentelemetry.sdk._shared_internal")
    for _ in range(1000):
        noisy.warning("Queue full, dropping %s.", "Span")
    logging.getLogger("opentelemetry.other").warning("different logger")
    noisy.warning({"unhashable": ["msg"]})
    lines = _lines(stream)
    assert [line["event"] for line in lines] == [
        "Queue full, dropping Span.",
        "different logger",
        "{'unhashable': ['msg']}",
    ]


def test_line_sinks_get_the_json_line_of_each_line_with_a_trace_id(log_stream, tracer):
    got: list[tuple[str, str]] = []

    def sink(trace_id: str, line: str) -> None:
        got.append((trace_id, line))

    tlog.add_line_sink(sink)
    try:
        get_logger("t").info("no trace")
        with tracer.start_as_current_span("request") as span:
            get_logger("t").info("in a trace", n=1)
            logging.getLogger("grpc").warning("stdlib in a trace")
    finally:
        tlog.remove_line_sink(sink)
    get_logger("t").info("after removal", trace_id="c" * 32)
    trace_id = format(span.get_span_context().trace_id, "032x")
    written = [line for line in log_stream.getvalue().splitlines() if trace_id in line]
    assert got == [(trace_id, line) for line in written]  # the very lines the logger wrote
    assert [json.loads(line)["event"] for _, line in got] == ["in a trace", "stdlib in a trace"]


def test_line_sinks_get_json_under_the_console_format():
    stream = io.StringIO()
    configure_logging("console", stream=stream, cache_loggers=False)
    got: list[tuple[str, str]] = []

    def sink(trace_id: str, line: str) -> None:
        got.append((trace_id, line))

    tlog.add_line_sink(sink)
    try:
        get_logger("t").info("engine line", trace_id="a" * 32, span_id="b" * 16, k="v")
    finally:
        tlog.remove_line_sink(sink)
    ((trace_id, line),) = got
    record = json.loads(line)
    assert trace_id == "a" * 32 and record["event"] == "engine line" and record["k"] == "v"
    assert "engine line" in stream.getvalue() and not stream.getvalue().startswith("{")


def test_capture_request_lines_hands_over_each_line_once():
    before = list(tlog._line_sinks)
    take = tlog.capture_request_lines("json", max_lines=2)
    try:
        for i in range(3):
            get_logger("t").info("captured", i=i, trace_id="d" * 32)
        get_logger("t").info("not a request's")
        lines = take()
        assert [json.loads(line)["i"] for _, line in lines] == [1, 2]  # the oldest dropped
        assert {trace for trace, _ in lines} == {"d" * 32}
        assert take() == []
    finally:
        for sink in [s for s in tlog._line_sinks if s not in before]:
            tlog.remove_line_sink(sink)
