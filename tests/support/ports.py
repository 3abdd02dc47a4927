"""Free TCP ports on the loopback, for a daemon's endpoints, a Prometheus or an S3 server of the tests' own."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on right now (bound together, so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick for an ephemeral bind)."""
    return free_ports(1)[0]


@contextlib.contextmanager
def idle_connections(port: int, n: int) -> Iterator[list[socket.socket]]:
    """n connections to 127.0.0.1:port that never send a byte (connected without waiting), closed on exit."""
    idle: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            idle.append(s)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
        yield idle
    finally:
        for s in idle:
            s.close()
