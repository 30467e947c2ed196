"""The REST listener: the socket uvicorn serves on, and uvicorn itself, left without its own
signal handling so that `MoeServer` drains first and then stops it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from service.startup import ServingSwitch
from service.tls import TlsFiles


class SignalFreeUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `MoeServer` drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_rest_socket(host: str, port: int) -> socket.socket:
    """Binds the REST socket here so that port 0 resolves to a known free port. TCP_NODELAY
    on it (the accepted connections inherit it): uvicorn sets it only on sockets it binds
    itself, and without it every response written in two pieces (headers, then body; each
    SSE event) waited ~40 ms for the client's delayed ACK on a kept-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def rest_server(app: ServingSwitch, tls: TlsFiles | None) -> SignalFreeUvicorn:
    """uvicorn serving `app` (over TLS with `tls`); our logging, no access log."""
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        **(tls.uvicorn_options() if tls else {}),
    )
    return SignalFreeUvicorn(config)
