"""The HTTP listener stays bounded and answers while many idle clients hold connections."""

from __future__ import annotations

import threading
import urllib.request

from prometheus_client import CollectorRegistry

from mirrord.service.endpoints import HANDLERS, MAX_CONNECTIONS, Endpoints
from tests.support.ports import idle_connections


def test_idle_clients_cannot_starve_healthz() -> None:
    """300 idle connections: /healthz still answers, and the listener's threads do not grow."""
    ep = Endpoints("127.0.0.1", 0, CollectorRegistry(), lambda: (True, "ok"), lambda: (True, "ready"))
    ep.start()
    try:
        before = threading.active_count()
        with idle_connections(ep.port, 300):
            with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/healthz", timeout=10) as r:
                assert r.status == 200 and r.read() == b"ok\n"
            assert threading.active_count() == before  # fixed threads: 1 acceptor + HANDLERS
        assert HANDLERS <= 4 and MAX_CONNECTIONS >= 16
    finally:
        ep.stop()
