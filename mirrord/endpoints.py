"""One HTTP listener: /metrics (Prometheus text format), /healthz (liveness), /readyz (first reconcile done),
/status (JSON: the copies under way with their progress, for `mirrord status`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Probe = Callable[[], tuple[bool, str]]
Report = Callable[[], dict[str, Any]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    registry: CollectorRegistry
    health: Probe
    ready: Probe
    status: Report


class _Handler(BaseHTTPRequestHandler):
    server: _Server

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
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every 15 s are not events worth a log line."""


class Endpoints:
    """Binds at construction (so a bad or busy address fails start-up), serves on a daemon thread."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Probe, ready: Probe,
                 status: Report = dict) -> None:
        self._server = _Server((host, port), _Handler)
        self._server.registry, self._server.health, self._server.ready = registry, health, ready
        self._server.status = status
        self._thread = threading.Thread(target=self._server.serve_forever, name="mirrord-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
