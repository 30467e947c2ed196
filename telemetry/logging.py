"""Structured logging: one JSON object per line on stdout, with trace ids inside a request.

Call `configure_logging()` once at start-up (calling it again replaces the previous
configuration, which tests rely on). Both structlog loggers and stdlib loggers (uvicorn,
grpc, litestar, opentelemetry) end up in the same processor chain and the same stream.

Inside a request the service should `clear_contextvars()` then
`bind_contextvars(request_id=...)`; `add_otel_ids` adds `trace_id`/`span_id` of the current
OTel span. Contextvars do not cross into the engine core process, so code there passes
`trace_id=`/`span_id=`/`request_id=` explicitly; explicit fields always win. Every line
names its replica (`service.instance.id`, telemetry/instance.py) once the id is known.

Lines that carry a `trace_id` can also be handed, as the JSON line, to sinks registered with
`add_line_sink` (the inspector keeps each request's lines); `capture_request_lines` does the
same in a process whose lines travel elsewhere (the engine core ships them with its steps).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, TextIO

import structlog
from opentelemetry import trace

from telemetry import instance

try:  # msgspec is a project dependency; fall back to the stdlib if it ever is not.
    import msgspec

    _encode = msgspec.json.encode

    def _dumps(obj: Any, default: Callable[[Any], Any] | None = None) -> str:
        return _encode(obj, enc_hook=default).decode()

except ImportError:  # pragma: no cover
    import json

    def _dumps(obj: Any, default: Callable[[Any], Any] | None = None) -> str:
        return json.dumps(obj, default=default, separators=(",", ":"))


__all__ = [
    "add_line_sink",
    "add_otel_ids",
    "add_service_instance",
    "bind_request_context",
    "capture_request_lines",
    "configure_logging",
    "get_logger",
    "remove_line_sink",
]

LogFormat = Literal["json", "console"]

# stdlib loggers that install their own handlers; ours replace them so every line is JSON.
_FOREIGN_LOGGERS = (
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "grpc",
    "grpc._server",
    "grpc.aio",
    "litestar",
    "opentelemetry",
    "asyncio",
)
_HANDLER_NAME = "moeserve-structlog"

LineSink = Callable[[str, str], None]
# sink(trace_id, JSON line) for every line with a trace_id; process-wide like the logging
# configuration itself, and kept across configure_logging() calls
_line_sinks: list[LineSink] = []


def add_line_sink(sink: LineSink) -> None:
    """From now on `sink(trace_id, line)` gets every line logged with a `trace_id`, as one
    JSON object (the line itself when the format is JSON). Sinks run on the logging thread:
    they must be quick and thread-safe, and must not log."""
    _line_sinks.append(sink)


def remove_line_sink(sink: LineSink) -> None:
    if sink in _line_sinks:
        _line_sinks.remove(sink)


class _TappedRenderer:
    """The chain's renderer, which also hands lines with a trace_id to the line sinks.
    Lines without one (most of them) cost one dict lookup more."""

    def __init__(self, renderer: Any, is_json: bool) -> None:
        self.renderer = renderer
        self.json = (
            renderer
            if is_json
            else structlog.processors.JSONRenderer(serializer=_dumps, default=_fallback)
        )

    def __call__(self, logger: Any, method_name: str, event_dict: dict[str, Any]) -> Any:
        trace_id = event_dict.get("trace_id")
        if trace_id is None or not _line_sinks:
            return self.renderer(logger, method_name, event_dict)
        line = self.json(logger, method_name, event_dict)  # before the console renderer pops
        out = line if self.json is self.renderer else self.renderer(logger, method_name, event_dict)
        for sink in _line_sinks:
            sink(str(trace_id), line)
        return out


def _fallback(obj: Any) -> Any:
    """JSON fallback for values the encoder does not know (exceptions, paths, enums...)."""
    structlog_repr = getattr(obj, "__structlog__", None)
    if structlog_repr is not None:
        return structlog_repr()
    return repr(obj)


def add_otel_ids(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Add `trace_id` (32 hex) and `span_id` (16 hex) of the current OTel span.

    Fields already present (passed explicitly, e.g. by the engine thread on a request's
    behalf) win: if either id is present, neither is touched.
    """
    if "trace_id" in event_dict or "span_id" in event_dict:
        return event_dict
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


def add_service_instance(
    logger: Any, method_name: str, event_dict: dict[str, Any]
) -> dict[str, Any]:
    """`service.instance.id`: which replica logged the line (when known; explicit wins)."""
    instance_id = instance.current()
    if instance_id is not None:
        event_dict.setdefault(instance.SERVICE_INSTANCE_ID, instance_id)
    return event_dict


def _add_logger_name(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """`logger` field: the name given to `get_logger(name)`, or the stdlib record's name."""
    if "logger" not in event_dict:
        record = event_dict.get("_record")
        name = record.name if record is not None else getattr(logger, "name", None)
        if name is not None:
            event_dict["logger"] = name
    return event_dict


class _NamedWriteLogger(structlog.WriteLogger):
    """structlog's WriteLogger (one write + flush per line, per-file lock) with a name."""

    def __init__(self, file: TextIO, name: str | None) -> None:
        super().__init__(file)
        self.name = name


class _LoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedWriteLogger:
        return _NamedWriteLogger(self._file, str(args[0]) if args else None)


class _RepeatFilter(logging.Filter):
    """Lets each message template of a noisy library logger through at most once per
    `interval_s` (e.g. the OTel SDK's per-span "Queue full, dropping Span." while a collector
    is down); the next line that passes says how many were suppressed."""

    def __init__(self, prefixes: tuple[str, ...] = ("opentelemetry",), interval_s: float = 10.0):
        super().__init__()
        self._prefixes = prefixes
        self._interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}  # bounded by the templates in use
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefixes):
            return True
        msg = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        key = (record.name, msg)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            record.suppressed = suppressed
        return True


def _parse_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelNamesMapping().get(level.upper())
    if value is None:
        raise ValueError(f"unknown log level {level!r}")
    return value


def configure_logging(
    fmt: LogFormat | None = None,
    level: str | int = "info",
    *,
    stream: TextIO | None = None,
    cache_loggers: bool = True,
    instance_id: str | None = None,
) -> None:
    """Configure structlog and stdlib logging; safe to call more than once.

    fmt: "json" (one object per line), "console" (human readable), or None for console
    when `stream` is a TTY and JSON otherwise. `stream` defaults to sys.stdout.
    `cache_loggers=False` lets tests reconfigure loggers that were already used.
    `instance_id`: the process's service.instance.id, given to a child process by its parent
    (else the one telemetry.instance already knows, if any).
    """
    if instance_id is not None:
        instance.set_current(instance_id)
    stream = sys.stdout if stream is None else stream
    if fmt is None:
        fmt = "console" if _isatty(stream) else "json"
    if fmt not in ("json", "console"):
        raise ValueError(f"unknown log format {fmt!r} (json|console)")
    min_level = _parse_level(level)

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        add_otel_ids,
        add_service_instance,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    # Tracebacks without the frames' local variables (structlog shows them by default): they
    # hold request headers, API keys and prompts, none of which may reach a log.
    if fmt == "json":
        shared.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
        renderer = structlog.processors.JSONRenderer(serializer=_dumps, default=_fallback)
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=_isatty(stream), exception_formatter=_console_tracebacks()
        )
    renderer = _TappedRenderer(renderer, is_json=fmt == "json")
    foreign_chain = [*shared, structlog.stdlib.ExtraAdder(allow=("suppressed",))]

    structlog.reset_defaults()
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.UnicodeDecoder(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        context_class=dict,
        logger_factory=_LoggerFactory(stream),
        cache_logger_on_first_use=cache_loggers,
    )

    # stdlib: one handler on the root logger rendering through the same chain.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=foreign_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    handler.addFilter(_RepeatFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)  # ours from a previous call, or a basicConfig default
    root.addHandler(handler)
    root.setLevel(min_level)
    for name in _FOREIGN_LOGGERS:
        foreign = logging.getLogger(name)
        foreign.handlers.clear()
        foreign.propagate = True
    # Access logs are the service's job (one summary line per request), not uvicorn's.
    logging.getLogger("uvicorn.access").setLevel(max(min_level, logging.WARNING))


def capture_request_lines(
    fmt: LogFormat | None = None, max_lines: int = 1024, *, instance_id: str | None = None
) -> Callable[[], list[tuple[str, str]]]:
    """`configure_logging(fmt, instance_id=)` for a process whose request lines must also
    reach another one: returns `take()`, which hands over (trace_id, JSON line) of the lines
    logged since the previous call (at most `max_lines` of them; older ones are dropped)."""
    configure_logging(fmt, instance_id=instance_id)
    captured: deque[tuple[str, str]] = deque(maxlen=max_lines)
    add_line_sink(lambda trace_id, line: captured.append((trace_id, line)))

    def take() -> list[tuple[str, str]]:
        lines = []
        while captured:  # popleft is atomic: lines logged meanwhile wait for the next call
            lines.append(captured.popleft())
        return lines

    return take


def _console_tracebacks() -> Any:
    """Rich's tracebacks when rich is installed (structlog's default), without locals."""
    if structlog.dev.rich is not None:
        return structlog.dev.RichTracebackFormatter(show_locals=False)
    return structlog.dev.plain_traceback


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


def get_logger(name: str | None = None, **initial_values: Any) -> Any:
    """A structlog logger with `logger=name` bound (typically `get_logger(__name__)`)."""
    # The name travels as a logger-factory argument: binding it here would build the
    # logger now, before configure_logging() may have run (module-level loggers).
    return structlog.get_logger(*(() if name is None else (name,)), **initial_values)


def bind_request_context(request_id: str, **fields: Any) -> None:
    """Start of a request (in its task): forget the previous request's context, bind
    `request_id` (and e.g. api) for every line logged while it is handled."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id, **fields)
