"""Which replica this process is: OpenTelemetry's `service.instance.id` resource attribute,
carried by its spans, its GenAI metrics, every JSON log line and the inspector.

Set it the standard way, `OTEL_RESOURCE_ATTRIBUTES=service.instance.id=replica-1` (neither
vLLM nor SGLang has a command-line flag for it, so there is none here either). Without it a
server takes `<hostname>:<REST port>` once its port is bound: unique per replica on one host
(each has its own port) and across pods (each has its own hostname), stable across restarts
of the same replica, and the same shape as the `instance` label Prometheus gives a target it
scrapes by host and port, the label OpenTelemetry's Prometheus mapping pairs with this
attribute.

The value is process-wide, like the tracer provider: `assign()` once the port is known; the
engine core process gets it through its logging set-up (`configure_logging(instance_id=)`).
"""

from __future__ import annotations

import os
import socket

from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, OTELResourceDetector, Resource

__all__ = [
    "SERVICE_INSTANCE_ID",
    "assign",
    "current",
    "default_instance_id",
    "from_environment",
    "reset",
    "service_resource",
    "set_current",
]

_UNSET = object()
_current: object = _UNSET  # str | None once known (None: no id); read on every log line


def from_environment() -> str | None:
    """`service.instance.id` from OTEL_RESOURCE_ATTRIBUTES, or None."""
    value = OTELResourceDetector().detect().attributes.get(SERVICE_INSTANCE_ID)
    return str(value) if value else None


def default_instance_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


def assign(port: int) -> str:
    """The process's id from now on: the environment's, else `<hostname>:<port>`."""
    return set_current(from_environment() or default_instance_id(port))


def set_current(instance_id: str | None) -> str | None:
    global _current
    _current = instance_id
    return instance_id


def current() -> str | None:
    """The id `assign`/`set_current` gave, else the environment's (read once; None: none)."""
    global _current
    if _current is _UNSET:
        _current = from_environment()
    return _current  # type: ignore[return-value]


def reset() -> None:
    """Forgets the id: the next `current()` reads the environment again (tests)."""
    global _current
    _current = _UNSET


def service_resource(service_name: str | None = None) -> Resource:
    """The process's OTel resource: service.name (argument, OTEL_SERVICE_NAME, "moeserve"),
    service.instance.id when known, and OTEL_RESOURCE_ATTRIBUTES' other attributes."""
    attributes = {"service.name": service_name or os.environ.get("OTEL_SERVICE_NAME") or "moeserve"}
    instance_id = current()
    if instance_id is not None:
        attributes[SERVICE_INSTANCE_ID] = instance_id
    return Resource.create(attributes)
