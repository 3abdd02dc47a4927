"""sd_notify without libsystemd: READY, WATCHDOG, STATUS, STOPPING. A no-op when NOTIFY_SOCKET is unset."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping


def ping_interval(heartbeat_seconds: float, watchdog_seconds: float | None) -> float:
    """Seconds between WATCHDOG=1 pings: the configured heartbeat, but never slower than half of
    WatchdogSec (sd_watchdog_enabled(3)), so one late ping cannot get a healthy daemon killed."""
    if watchdog_seconds is None:
        return heartbeat_seconds
    return min(heartbeat_seconds, watchdog_seconds / 2)


class Notifier:
    """sd_notify(3) without libsystemd: READY, WATCHDOG, STATUS, RELOADING, STOPPING; a no-op without NOTIFY_SOCKET."""

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None
        self._sock: socket.socket | None = None
        usec = environ.get("WATCHDOG_USEC", "")
        self.watchdog_seconds = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 else None
        # WATCHDOG_PID names the process systemd watches; a child that inherited the variables is not it.
        watched = environ.get("WATCHDOG_PID", "")
        if watched and watched != str(os.getpid() if pid is None else pid):
            self.watchdog_seconds = None

    @property
    def enabled(self) -> bool:
        """Whether systemd asked for notifications (NOTIFY_SOCKET is set)."""
        return self._address is not None

    def notify(self, *lines: str) -> None:
        """Send one datagram; errors are swallowed (systemd being away must not stop mirroring)."""
        if self._address is None:
            return
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # Never block: a notify socket whose queue is full (a swamped or stuck reader) must not stall
        # the main loop; the message is dropped, as when systemd is away.
        with contextlib.suppress(OSError):
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self._address)

    def ready(self, status: str) -> None:
        """READY=1: start-up (or a reload) is done."""
        self.notify("READY=1", f"STATUS={status}")

    def watchdog(self, status: str) -> None:
        """WATCHDOG=1: the supervisor is alive and healthy."""
        self.notify("WATCHDOG=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        """Only the status line (an unhealthy heartbeat sends no WATCHDOG=1)."""
        self.notify(f"STATUS={status}")

    def reloading(self) -> None:
        """RELOADING=1: a SIGHUP is being handled."""
        self.notify("RELOADING=1")

    def stopping(self) -> None:
        """STOPPING=1: shutdown has begun."""
        self.notify("STOPPING=1", "STATUS=shutting down")

    def close(self) -> None:
        """Close the notify socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
