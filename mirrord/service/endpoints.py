"""One HTTP listener: /metrics (Prometheus text format), /healthz (liveness), /readyz (first reconcile done),
/status (JSON: the copies under way with their progress, for `mirrord status`).

Bounded whatever the clients do: one thread runs an asyncio loop that serves every connection, at most
MAX_CONNECTIONS open (a new one evicts the oldest), a listen backlog of BACKLOG. A request is answered
only with its whole head read, and a connection whose head is not in within TIMEOUT_SECONDS of its
accept (a slowloris trickling a byte every few seconds) is closed. So idle or slow clients cannot hold
the thread, the descriptors, or /healthz hostage.
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mirrord.config import MetricsConfig
from mirrord.errors import StartupError

Probe = Callable[[], tuple[bool, str]]
Report = Callable[[], dict[str, Any]]

MAX_CONNECTIONS = 64
BACKLOG = 128
TIMEOUT_SECONDS = 5.0  # per request: its head read from the accept on, and the write of the answer
MAX_HEAD = 16 * 1024  # a GET's request line and headers; a longer head is not one of ours


class _Handler(BaseHTTPRequestHandler):
    """Answers a request whose head the loop has read, into memory: the loop sends the answer."""

    server: Endpoints  # type: ignore[assignment]
    wfile: io.BytesIO

    def setup(self) -> None:
        self.rfile, self.wfile = io.BytesIO(self.request), io.BytesIO()

    def finish(self) -> None:
        """Keeps wfile open for the loop to read."""

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
    """Binds at construction (so a bad or busy address fails start-up), serves on a daemon thread."""

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
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self._stopping = asyncio.Event()
        self._open: collections.OrderedDict[asyncio.StreamWriter, None] = collections.OrderedDict()
        self._thread = threading.Thread(target=self._run, name="mirrord-http", daemon=True)

    def start(self) -> None:
        """Start serving."""
        self._loop = asyncio.new_event_loop()
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close every connection, and join the thread (bounded)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=5)
        self._sock.close()

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=lambda: self._loop) as runner:  # its exit cancels what still serves
            runner.run(self._serve_until_stopped())

    async def _serve_until_stopped(self) -> None:
        async with await asyncio.start_server(self._serve, sock=self._sock, backlog=BACKLOG, limit=MAX_HEAD):
            await self._stopping.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_CONNECTIONS:
            self._open.popitem(last=False)[0].transport.abort()
        self._open[writer] = None
        try:
            head = await asyncio.wait_for(_read_head(reader), TIMEOUT_SECONDS)
            writer.transport.set_write_buffer_limits(0)  # drain() returns once the whole answer is with the kernel
            writer.write(_Handler(head, writer.get_extra_info("peername"), self).wfile.getvalue())  # type: ignore[arg-type]
            await asyncio.wait_for(writer.drain(), TIMEOUT_SECONDS)
        except Exception:  # noqa: S110 - a client that misbehaves is closed, and never stops the loop
            pass
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()  # now, whatever is left unsent: close() would wait for a client that never reads


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """A request's line and headers, up to the empty line (CRLF or bare LF), at most MAX_HEAD bytes."""
    head = b""
    while not head.endswith((b"\n\n", b"\n\r\n")):
        head += await reader.readuntil(b"\n")
        if len(head) > MAX_HEAD:
            raise ValueError("request head too long")
    return head


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
