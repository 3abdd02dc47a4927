"""One HTTP listener: /metrics (Prometheus text format), /healthz (liveness), /readyz (first reconcile done),
/status (JSON: the copies under way with their progress, for `mirrord status`).

Bounded whatever the clients do: a fixed number of handler threads, at most MAX_CONNECTIONS open
connections (a new one evicts the oldest idle one), a per-connection timeout, a listen backlog of
BACKLOG. A connection reaches a handler only once it has sent something, so idle or slow clients
(a thousand of them) cannot hold the handlers, the descriptors, or /healthz hostage.
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mirrord.config import MetricsConfig
from mirrord.errors import StartupError

Probe = Callable[[], tuple[bool, str]]
Report = Callable[[], dict[str, Any]]

HANDLERS = 2
MAX_CONNECTIONS = 64
BACKLOG = 128
TIMEOUT_SECONDS = 5.0


class _Handler(BaseHTTPRequestHandler):
    server: Endpoints  # type: ignore[assignment]
    timeout = TIMEOUT_SECONDS  # per-connection: a client that stops sending is dropped

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            ok, reason = (self.server.health if path == "/healthz" else self.server.ready)()
            self._send(200 if ok else 503, (reason + "\n").encode(), "text/plain; charset=utf-8")
        elif path == "/status":
            body = json.dumps(self.server.status(), indent=1).encode() + b"\n"
            self._send(200, body, "application/json")
        else:
            self._send(404, b"not found: try /metrics, /healthz, /readyz or /status\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every 15 s are not events worth a log line."""


class Endpoints:
    """Binds at construction (so a bad or busy address fails start-up), serves on daemon threads."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Probe, ready: Probe,
                 status: Report = dict) -> None:
        self.registry, self.health, self.ready, self.status = registry, health, ready, status
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(BACKLOG)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._ready: queue.Queue[socket.socket | None] = queue.Queue(maxsize=MAX_CONNECTIONS + HANDLERS)
        self._threads = [threading.Thread(target=self._accept_loop, name="mirrord-http", daemon=True)]
        self._threads += [threading.Thread(target=self._handle_loop, name=f"mirrord-http-{i}", daemon=True)
                          for i in range(HANDLERS)]

    @property
    def port(self) -> int:
        """The port actually bound (the kernel's pick when configured as 0)."""
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        """Start the acceptor and handler threads."""
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop serving and join the threads (bounded)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        acceptor, handlers = self._threads[0], self._threads[1:]
        acceptor.join(timeout=5)  # it closes the idle connections; nothing is queued after it ends
        for _ in handlers:
            self._ready.put(None)  # blocks only while handlers still drain connections queued before
        for thread in handlers:
            thread.join(timeout=5)
        while True:  # whatever a handler did not take
            try:
                conn = self._ready.get_nowait()
            except queue.Empty:
                break
            if conn is not None:
                conn.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the acceptor: holds idle connections, hands readable ones to the handlers ----------------
    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        idle: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=1.0):
                    if key.data == "listen":
                        self._accept(sel, idle)
                    elif key.data == "conn":
                        conn = key.fileobj
                        assert isinstance(conn, socket.socket)
                        sel.unregister(conn)
                        idle.pop(conn, None)
                        self._dispatch(conn)
                deadline = time.monotonic() - TIMEOUT_SECONDS
                while idle and next(iter(idle.values())) < deadline:
                    conn, _ = idle.popitem(last=False)
                    sel.unregister(conn)
                    conn.close()
        finally:
            for conn in idle:
                conn.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, idle: collections.OrderedDict[socket.socket, float]) -> None:
        for _ in range(BACKLOG):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and friends: shed the oldest idle connection and try later
                if idle:
                    self._evict_oldest(sel, idle)
                return
            conn.setblocking(True)
            if _has_request(conn):
                # A client that already spoke (a probe, a scrape) goes straight to a handler: held as
                # idle, it could be evicted by a flood of silent connections accepted after it.
                self._dispatch(conn)
                continue
            if len(idle) >= MAX_CONNECTIONS:
                self._evict_oldest(sel, idle)
            idle[conn] = time.monotonic()
            sel.register(conn, selectors.EVENT_READ, "conn")

    def _evict_oldest(self, sel: selectors.BaseSelector, idle: collections.OrderedDict[socket.socket, float]) -> None:
        """Make room: the oldest connection leaves the idle set; closed if it is still silent, handed to
        the handlers if its request arrived meanwhile (a probe accepted just before its bytes, then
        followed by a flood of silent connections in the same accept round, must still be answered)."""
        old, _ = idle.popitem(last=False)
        sel.unregister(old)
        if _has_request(old):
            self._dispatch(old)
        else:
            old.close()

    def _dispatch(self, conn: socket.socket) -> None:
        """Hand a connection that has sent something to the handlers, or drop it when they are saturated."""
        if self._ready.qsize() >= MAX_CONNECTIONS:  # handlers saturated: shed load
            conn.close()
        else:
            self._ready.put_nowait(conn)

    def _handle_loop(self) -> None:
        while True:
            conn = self._ready.get()
            if conn is None or self._stop.is_set():
                if conn is not None:
                    conn.close()
                return
            try:
                conn.settimeout(TIMEOUT_SECONDS)
                _Handler(conn, conn.getpeername(), self)  # type: ignore[arg-type]
            except Exception:  # noqa: S110 - a client that misbehaves must never kill a handler
                pass
            finally:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()


def _has_request(conn: socket.socket) -> bool:
    """Whether the client has already sent bytes (or closed): a peek, so the handler still reads them all."""
    try:
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # reset already: let the handler meet the error and close it
        return True
    return True


def serve(metrics: MetricsConfig, registry: CollectorRegistry, health: Probe, ready: Probe,
          status: Report) -> Endpoints | None:
    """The endpoints `metrics` asks for (None when disabled), bound now: a busy address fails start-up."""
    if not metrics.enabled:
        return None
    try:
        return Endpoints(metrics.host, metrics.port, registry, health, ready, status)
    except OSError as exc:
        raise StartupError(f"cannot listen on {metrics.address} (metrics.address): {exc.strerror or exc}") from exc
