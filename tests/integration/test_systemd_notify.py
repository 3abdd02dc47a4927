"""sd_notify as systemd sees it: a datagram socket owned by the test stands in for PID 1."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for


class FakeSystemd:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def pump(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def seen(self, key: str, value: str = "1") -> list[float]:
        self.pump()
        return [t for t, f in self.messages if f.get(key) == value]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_systemd(tmp_path):
    s = FakeSystemd(tmp_path / "notify.sock")
    yield s
    s.close()


def test_ready_watchdog_and_stopping(tmp_path, daemon_factory, fake_systemd):
    d = daemon_factory(
        {"daemon": {"heartbeat_seconds": 0.2}},
        env={"NOTIFY_SOCKET": str(fake_systemd.path), "WATCHDOG_USEC": "10000000"},
    ).start()
    wait_for(lambda: fake_systemd.seen("READY"), 90, "READY=1")
    wait_for(lambda: len(fake_systemd.seen("WATCHDOG")) >= 6, 90, "six WATCHDOG=1 pings")
    pings = fake_systemd.seen("WATCHDOG")
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    # The rate is what systemd relies on: every gap inside half of WatchdogSec (10 s here), as systemd
    # advises; with 0.2 s heartbeats that holds on a heavily loaded machine too (gaps are as received).
    assert max(gaps) < 5.0, gaps
    assert any("copied" in f.get("STATUS", "") for _, f in fake_systemd.messages)
    assert fake_systemd.seen("READY")[0] <= pings[0]
    assert d.stop(signal.SIGTERM) == 0
    wait_for(lambda: fake_systemd.seen("STOPPING"), 90, "STOPPING=1")


def test_pings_twice_per_watchdog_period_when_the_heartbeat_is_slower(tmp_path, daemon_factory, fake_systemd):
    """heartbeat_seconds = 5 under WatchdogSec=1 would get a healthy daemon killed: it pings every 0.5 s
    instead, and says at start-up that its configured heartbeat is too slow for the unit."""
    d = daemon_factory(
        {"daemon": {"heartbeat_seconds": 5.0}},
        env={"NOTIFY_SOCKET": str(fake_systemd.path), "WATCHDOG_USEC": "1000000"},
    ).start()
    warning = d.wait_event("daemon.heartbeat_slower_than_watchdog", timeout=10)
    assert (warning["heartbeat_seconds"], warning["watchdog_seconds"], warning["ping_every_seconds"]) == (5.0, 1.0, 0.5)
    wait_for(lambda: len(fake_systemd.seen("WATCHDOG")) >= 8, 20, "eight WATCHDOG=1 pings")
    gaps = [b - a for a, b in itertools.pairwise(fake_systemd.seen("WATCHDOG"))]
    # Far below the configured 5 s: the watchdog's rate wins over the configured one.
    assert max(gaps) < 2.5, gaps
    assert d.stop(signal.SIGTERM) == 0


def test_no_warning_when_the_heartbeat_fits_the_watchdog(tmp_path, daemon_factory, fake_systemd):
    """The shipped pair (heartbeat 5 s, WatchdogSec=30) is fine as it is: no warning."""
    d = daemon_factory(
        {"daemon": {"heartbeat_seconds": 5.0}},
        env={"NOTIFY_SOCKET": str(fake_systemd.path), "WATCHDOG_USEC": "30000000"},
    ).start()
    wait_for(lambda: fake_systemd.seen("READY"), 10, "READY=1")
    assert d.stop(signal.SIGTERM) == 0
    assert d.events("daemon.ready")
    assert not d.events("daemon.heartbeat_slower_than_watchdog")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_watchdog_stops_while_a_worker_is_wedged(tmp_path, daemon_factory, fake_systemd):
    """strace delays every copy thread's 3rd read by 10 min: the copy stalls, the worker is wedged in
    the kernel, /healthz turns 503 and WATCHDOG=1 stops, so systemd would restart the service."""
    publish_checkpoint(tmp_path / "primary" / "step_0001.pt", 1, megabytes=8)
    d = daemon_factory(
        {
            "daemon": {"heartbeat_seconds": 0.2},
            "copy": {"stall_seconds": 0.5, "workers": 1},
            "io": {"buffer_bytes": 1024 * 1024},
        },
        env={"NOTIFY_SOCKET": str(fake_systemd.path)},
        wrapper=[
            "strace",
            "-f",
            "-qq",
            "-o",
            os.devnull,
            "-e",
            "trace=readv",
            "-e",
            "inject=readv:delay_enter=600000000:when=3",
        ],
    ).start()

    def unhealthy_statuses() -> list[float]:
        fake_systemd.pump()  # read as systemd does, so that the daemon's datagrams never back up
        return [t for t, f in fake_systemd.messages if f.get("STATUS", "").startswith("UNHEALTHY")]

    def became_unhealthy() -> bool:
        if d.exited():
            raise AssertionError(f"daemon exited ({d.proc.returncode}):\n{d.log_text()}")
        return bool(unhealthy_statuses()) and bool(d.events("daemon.unhealthy"))

    wait_for(became_unhealthy, 120, "daemon.unhealthy and an UNHEALTHY status")
    wait_for(lambda: "wedged" in d.http("/healthz")[1], 60, "/healthz naming the wedged worker")
    assert d.http("/healthz")[0] == 503
    unhealthy = unhealthy_statuses()
    last_ping = fake_systemd.seen("WATCHDOG")[-1]
    wait_for(lambda: len(unhealthy_statuses()) >= len(unhealthy) + 5, 60, "more unhealthy heartbeats")
    assert fake_systemd.seen("WATCHDOG")[-1] == last_ping, "WATCHDOG=1 must stop while a worker is wedged"
    d.kill()


def test_a_missing_primary_is_awaited_with_the_watchdog_fed(tmp_path, daemon_factory, fake_systemd):
    """A primary root that is not there at start (a disk being replaced) is a state: systemd hears READY=1
    and WATCHDOG=1 goes on, /healthz is healthy and /readyz says what is awaited, `primary.missing` is
    logged once, and mirroring begins when the root appears."""
    primary = tmp_path / "primary"
    primary.rmdir()
    d = daemon_factory(
        {"daemon": {"heartbeat_seconds": 0.2}},
        env={"NOTIFY_SOCKET": str(fake_systemd.path), "WATCHDOG_USEC": "10000000"},
    )
    d.start(wait_ready=False)

    def pings() -> list[float]:
        if d.exited():
            raise AssertionError(f"daemon exited ({d.proc.returncode}):\n{d.log_text()}")
        return fake_systemd.seen("WATCHDOG")

    wait_for(lambda: len(pings()) >= 5, 90, "five WATCHDOG=1 pings while the primary is missing")
    assert fake_systemd.seen("READY")
    assert d.http("/healthz")[0] == 200
    code, body = d.http("/readyz")
    assert code == 503 and "does not exist" in body, (code, body)
    assert len(d.events("primary.missing")) == 1
    publish_checkpoint(primary / "step_0001.pt", 1)
    wait_for(lambda: (tmp_path / "mirror" / "step_0001.pt").is_file(), 90, "the checkpoint mirrored")
    assert d.http("/readyz")[0] == 200
    assert len(d.events("primary.missing")) == 1
    assert d.stop(signal.SIGTERM) == 0


def test_a_primary_that_vanishes_while_running_is_awaited_and_the_mirror_kept(tmp_path, daemon_factory, fake_systemd):
    """The primary root goes away under a running daemon (an unmount, a disk pulled): it stays alive
    and not ready, WATCHDOG=1 goes on, `primary.missing` is logged once, nothing is pruned from the
    mirror although the trainer's folder looks empty (prune.mode follow), and mirroring resumes when the
    root is back."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step in (1, 2):
        publish_checkpoint(primary / "run" / f"step_{step:04d}.pt", step)
    d = daemon_factory(
        {
            "daemon": {"heartbeat_seconds": 0.2},
            "watch": {"rescan_interval_seconds": 0.5},
            "prune": {"mode": "follow", "min_age_seconds": 0},
        },
        env={"NOTIFY_SOCKET": str(fake_systemd.path), "WATCHDOG_USEC": "10000000"},
    )
    d.start()
    wait_for(lambda: all((mirror / "run" / f"step_{s:04d}.pt").is_file() for s in (1, 2)), 90, "both mirrored")
    shutil.rmtree(primary)

    def pings() -> list[float]:
        if d.exited():
            raise AssertionError(f"daemon exited ({d.proc.returncode}):\n{d.log_text()}")
        return fake_systemd.seen("WATCHDOG")

    wait_for(lambda: d.events("primary.missing"), 90, "primary.missing")
    before = len(pings())
    wait_for(lambda: len(pings()) >= before + 5, 90, "five WATCHDOG=1 pings while the primary is missing")
    code, body = d.http("/readyz")
    assert code == 503 and "does not exist" in body, (code, body)
    assert d.http("/healthz")[0] == 200
    assert len(d.events("primary.missing")) == 1
    assert sorted(p.name for p in (mirror / "run").iterdir()) == ["step_0001.pt", "step_0002.pt"]
    publish_checkpoint(primary / "run" / "step_0003.pt", 3)
    wait_for(lambda: (mirror / "run" / "step_0003.pt").is_file(), 90, "mirroring resumed")
    wait_for(lambda: d.http("/readyz")[0] == 200, 90, "ready again")
    assert len(d.events("primary.missing")) == 1
    assert d.stop(signal.SIGTERM) == 0
