"""The HTTP listener stays bounded and answers while many idle clients hold connections."""

from __future__ import annotations

import itertools
import socket
import threading
import urllib.request

from prometheus_client import CollectorRegistry

from mirrord.service.endpoints import MAX_CONNECTIONS, Endpoints
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
            assert threading.active_count() == before
        assert [t.name for t in threading.enumerate()].count("mirrord-http") == 1  # one thread serves them all
        assert MAX_CONNECTIONS >= 16
    finally:
        ep.stop()


def _trickle(port: int, started: threading.Event, stop: threading.Event) -> None:
    """A slowloris: a request head sent a byte at a time, never finished, until told to stop."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        for i, byte in enumerate(itertools.cycle(b"GET /healthz HTTP/1.1\r\nX-Slow: ")):
            if stop.wait(0.3):
                return
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # the server gave up on us: what it should do
                started.set()
                return
            if i == 3:
                started.set()


def test_slow_clients_cannot_hold_the_handlers() -> None:
    """Slowloris connections, each trickling a byte well within any per-read timeout: /healthz still
    answers while they trickle (a request's head has a deadline from the accept on, and is read without
    holding the thread that answers)."""
    ep = Endpoints("127.0.0.1", 0, CollectorRegistry(), lambda: (True, "ok"), lambda: (True, "ready"))
    ep.start()
    stop = threading.Event()
    started = [threading.Event() for _ in range(3)]
    slow = [threading.Thread(target=_trickle, args=(ep.port, s, stop), daemon=True) for s in started]
    try:
        for thread in slow:
            thread.start()
        for s in started:
            assert s.wait(30), "a slow client never got going"
        with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/healthz", timeout=20) as r:
            assert r.status == 200 and r.read() == b"ok\n"
    finally:
        stop.set()
        for thread in slow:
            thread.join(timeout=30)
        ep.stop()
