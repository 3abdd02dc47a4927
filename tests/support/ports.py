"""Free TCP ports on the loopback, for a daemon's endpoints, a Prometheus or an S3 server of the tests' own."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

# Ports handed out lie below the kernel's ephemeral range (no outgoing connection can take one before its
# server binds it), in a block of their own per pytest-xdist worker (no two workers hand out the same one).
FIRST_PORT = 10000
PORTS_PER_WORKER = 1000


def _port_block() -> range | None:
    """This worker's ports, or None where the ephemeral range leaves no room below it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    blocks = (low - FIRST_PORT) // PORTS_PER_WORKER
    if blocks < 1:
        return None
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % blocks
    start = FIRST_PORT + worker * PORTS_PER_WORKER
    return range(start, start + PORTS_PER_WORKER)


_BLOCK = _port_block()
# Where the next search starts: a random point, so that two sessions at once rarely search alike.
_next = itertools.count(random.randrange(PORTS_PER_WORKER))


def _bound(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on right now (bound together, so none is handed out twice)."""
    socks: list[socket.socket] = []
    try:
        if _BLOCK is None:
            socks = [s for s in (_bound(0) for _ in range(n)) if s is not None]
        else:
            for _ in range(len(_BLOCK)):
                s = _bound(_BLOCK[next(_next) % len(_BLOCK)])
                if s is not None:
                    socks.append(s)
                if len(socks) == n:
                    break
        assert len(socks) == n, f"no {n} free ports on 127.0.0.1"
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick for an ephemeral bind)."""
    return free_ports(1)[0]


@contextlib.contextmanager
def idle_connections(port: int, n: int, batch: int = 32, timeout: float = 60.0) -> Iterator[list[socket.socket]]:
    """n connections to 127.0.0.1:port that never send a byte, each established before this yields, closed
    on exit.

    Opened in batches well under the server's listen backlog, each batch connected before the next: a burst
    larger than the backlog has SYNs dropped and retried a second later, so idle clients would still be
    arriving after the caller's own request, and a server that evicts its oldest connection would then
    (rightly) evict the caller's."""
    idle: list[socket.socket] = []
    deadline = time.monotonic() + timeout
    try:
        for first in range(0, n, batch):
            poll = select.poll()  # not select(): the hostile test holds descriptors above FD_SETSIZE
            pending: set[int] = set()
            for _ in range(min(batch, n - first)):
                s = socket.socket()
                idle.append(s)
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                poll.register(s.fileno(), select.POLLOUT)
                pending.add(s.fileno())
            while pending:
                left = deadline - time.monotonic()
                assert left > 0, f"{len(pending)} idle connections to port {port} never got established"
                for fd, _event in poll.poll(left * 1000):
                    poll.unregister(fd)
                    pending.discard(fd)
        yield idle
    finally:
        for s in idle:
            s.close()
