"""sd_notify details that decide whether systemd keeps a healthy daemon alive."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mirrord.service.systemd import Notifier, ping_interval


@pytest.mark.parametrize(
    ("heartbeat", "watchdog", "expected"),
    [
        (5.0, None, 5.0),  # no watchdog: the configured heartbeat
        (5.0, 30.0, 5.0),  # the shipped unit: 5 s is well inside 30 s
        (5.0, 5.0, 2.5),  # WatchdogSec=5 would kill a daemon pinging every 5 s: ping twice as often
        (20.0, 30.0, 15.0),
        (0.2, 2.0, 0.2),
    ],
)
def test_pings_at_least_twice_per_watchdog_period(heartbeat: float, watchdog: float | None, expected: float) -> None:
    """min(heartbeat_seconds, WatchdogSec / 2), as sd_watchdog_enabled(3) recommends."""
    assert ping_interval(heartbeat, watchdog) == expected


def test_watchdog_usec_is_read_in_seconds() -> None:
    """WATCHDOG_USEC=30000000 is WatchdogSec=30; absent, empty, zero or garbage means no watchdog."""
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_seconds == 30.0
    for bad in ("", "0", "-5", "30s", "abc"):
        assert Notifier({"WATCHDOG_USEC": bad}).watchdog_seconds is None, bad
    assert Notifier({}).watchdog_seconds is None


def test_watchdog_pid_of_another_process_means_no_watchdog() -> None:
    """A child that inherited WATCHDOG_USEC is not the process systemd watches (WATCHDOG_PID says which)."""
    env = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "4242"}
    assert Notifier(env, pid=4242).watchdog_seconds == 4.0
    assert Notifier(env, pid=4243).watchdog_seconds is None
    assert Notifier({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_seconds == 4.0


def test_notify_sends_one_datagram_and_is_a_no_op_without_a_socket(tmp_path: Path) -> None:
    """READY=1 and STATUS= arrive together on $NOTIFY_SOCKET; without it nothing is sent and nothing fails."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        assert notifier.enabled
        notifier.ready("0 copied")
        notifier.watchdog("1 copied")
        notifier.close()
        assert server.recv(4096) == b"READY=1\nSTATUS=0 copied"
        assert server.recv(4096) == b"WATCHDOG=1\nSTATUS=1 copied"
    silent = Notifier({})
    assert not silent.enabled
    silent.ready("ignored")
    silent.close()
