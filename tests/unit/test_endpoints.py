"""The HTTP listener stays bounded and answers while many idle clients hold connections."""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.request

from prometheus_client import CollectorRegistry

from mirrord.service.endpoints import HANDLERS, MAX_CONNECTIONS, Endpoints


def test_idle_clients_cannot_starve_healthz() -> None:
    """300 idle connections: /healthz still answers, and the listener's threads do not grow."""
    ep = Endpoints("127.0.0.1", 0, CollectorRegistry(), lambda: (True, "ok"), lambda: (True, "ready"))
    ep.start()
    idle: list[socket.socket] = []
    try:
        before = threading.active_count()
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", ep.port))
            idle.append(s)
        with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/healthz", timeout=10) as r:
            assert r.status == 200 and r.read() == b"ok\n"
        assert threading.active_count() == before  # fixed threads: 1 acceptor + HANDLERS
        assert HANDLERS <= 4 and MAX_CONNECTIONS >= 16
    finally:
        for s in idle:
            s.close()
        ep.stop()
