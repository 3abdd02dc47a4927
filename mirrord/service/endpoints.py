"""One HTTP listener: /metrics (Prometheus text format), /healthz (liveness), /readyz (first reconcile done),
/status (JSON: the copies under way with their progress, for `mirrord status`).

Bounded whatever the clients do: a fixed number of handler threads, at most MAX_CONNECTIONS open
connections (a new one evicts the oldest), a listen backlog of BACKLOG. The acceptor itself reads each
request's head, without blocking, for all connections at once; a connection reaches a handler only
with its whole head read, and one whose head is not in within TIMEOUT_SECONDS of its accept (a
slowloris trickling a byte every few seconds) is closed. So idle or slow clients cannot hold the
handlers, the descriptors, or /healthz hostage.
"""

from __future__ import annotations

import collections
import contextlib
import io
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
TIMEOUT_SECONDS = 5.0  # per request: its head read from the accept on, and each write of the answer
MAX_HEAD = 16 * 1024  # a GET's request line and headers; a longer head is not one of ours


class _Handler(BaseHTTPRequestHandler):
    server: Endpoints  # type: ignore[assignment]

    def setup(self) -> None:
        """The request is (connection, its head as the acceptor read it)."""
        self.connection, head = self.request
        self.rfile = io.BytesIO(head)
        self.wfile = self.connection.makefile("wb")

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

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, health: Probe, ready: Probe, status: Report = dict
    ) -> None:
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
        # The acceptor thread's own: connections whose head is still being read, oldest first.
        self._sel = selectors.DefaultSelector()
        self._pending: collections.OrderedDict[socket.socket, tuple[float, bytearray]] = collections.OrderedDict()
        self._wake_r, self._wake_w = socket.socketpair()
        self._ready: queue.Queue[tuple[socket.socket, bytes] | None] = queue.Queue(maxsize=MAX_CONNECTIONS + HANDLERS)
        self._threads = [threading.Thread(target=self._accept_loop, name="mirrord-http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._handle_loop, name=f"mirrord-http-{i}", daemon=True) for i in range(HANDLERS)
        ]

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
        for item in list(self._ready.queue):  # whatever a handler did not take
            if item is not None:
                item[0].close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the acceptor: reads every request's head, hands whole ones to the handlers ----------------
    def _accept_loop(self) -> None:
        self._sel.register(self._sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(timeout=1.0):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "conn":
                        conn = key.fileobj
                        assert isinstance(conn, socket.socket)
                        self._read_head(conn)
                deadline = time.monotonic() - TIMEOUT_SECONDS
                while self._pending and next(iter(self._pending.values()))[0] < deadline:
                    self._drop(next(iter(self._pending)))
        finally:
            for conn in self._pending:
                conn.close()
            self._sel.close()

    def _accept(self) -> None:
        for _ in range(BACKLOG):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and friends: shed the oldest connection and try later
                if self._pending:
                    self._drop(next(iter(self._pending)))
                return
            conn.setblocking(False)
            if len(self._pending) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._pending)))
            self._pending[conn] = (time.monotonic(), bytearray())
            self._sel.register(conn, selectors.EVENT_READ, "conn")
            self._read_head(conn)  # a probe that already spoke is answered at once

    def _read_head(self, conn: socket.socket) -> None:
        """Read what the client sent; hand the connection over once its head is whole."""
        head = self._pending[conn][1]
        try:
            while chunk := conn.recv(MAX_HEAD + 1 - len(head)):
                head += chunk
                if b"\r\n\r\n" in head or b"\n\n" in head or len(head) > MAX_HEAD:
                    break
            else:  # the client closed: nothing to answer
                return self._drop(conn)
        except (BlockingIOError, InterruptedError):
            return None  # more later
        except OSError:
            return self._drop(conn)
        if len(head) > MAX_HEAD:
            return self._drop(conn)
        self._sel.unregister(conn)
        del self._pending[conn]
        if self._ready.qsize() >= MAX_CONNECTIONS:  # handlers saturated: shed load
            conn.close()
        else:
            conn.setblocking(True)
            self._ready.put_nowait((conn, bytes(head)))
        return None

    def _drop(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        del self._pending[conn]
        conn.close()

    def _handle_loop(self) -> None:
        while True:
            item = self._ready.get()
            if item is None or self._stop.is_set():
                if item is not None:
                    item[0].close()
                return
            conn = item[0]
            try:
                conn.settimeout(TIMEOUT_SECONDS)
                _Handler(item, conn.getpeername(), self)  # type: ignore[arg-type]
            except Exception:  # noqa: S110 - a client that misbehaves must never kill a handler
                pass
            finally:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()


def serve(
    metrics: MetricsConfig, registry: CollectorRegistry, health: Probe, ready: Probe, status: Report
) -> Endpoints | None:
    """The endpoints `metrics` asks for (None when disabled), bound now: a busy address fails start-up."""
    if not metrics.enabled:
        return None
    try:
        return Endpoints(metrics.host, metrics.port, registry, health, ready, status)
    except OSError as exc:
        raise StartupError(f"cannot listen on {metrics.address} (metrics.address): {exc.strerror or exc}") from exc
