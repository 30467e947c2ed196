"""The REST socket: responses on a kept-alive connection go out at once (TCP_NODELAY on the
listening socket, inherited by each connection). Without it every response written in two
pieces (headers, then body) waited ~40 ms for the client's delayed ACK (Nagle)."""

from __future__ import annotations

import socket
import statistics
import time

import httpx

from service.rest_listener import bind_rest_socket


def test_the_listening_socket_has_tcp_nodelay():
    sock = bind_rest_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def test_kept_alive_requests_do_not_wait_for_delayed_acks(server):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        client.get("/health")  # the connection is open from here on
        times = []
        for _ in range(15):
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            times.append(time.perf_counter() - start)
    # a delayed ACK is 40 ms; a loopback round trip to an idle server under 5
    assert statistics.median(times) < 0.02, times
