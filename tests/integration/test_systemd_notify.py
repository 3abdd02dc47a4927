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

from tests.integration.daemon_harness import save_checkpoint, wait_for


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
    d = daemon_factory({"daemon": {"heartbeat_seconds": 0.2}},
                       env={"NOTIFY_SOCKET": str(fake_systemd.path), "WATCHDOG_USEC": "10000000"}).start()
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


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_watchdog_stops_while_a_worker_is_wedged(tmp_path, daemon_factory, fake_systemd):
    """strace delays every copy thread's 3rd read by 10 min: the copy stalls, the worker is wedged in
    the kernel, /healthz turns 503 and WATCHDOG=1 stops, so systemd would restart the service."""
    save_checkpoint(tmp_path / "primary" / "step_0001.pt", 1, megabytes=8)
    d = daemon_factory(
        {"daemon": {"heartbeat_seconds": 0.2}, "copy": {"stall_seconds": 0.5, "workers": 1},
         "io": {"buffer_bytes": 1024 * 1024}},
        env={"NOTIFY_SOCKET": str(fake_systemd.path)},
        wrapper=["strace", "-f", "-qq", "-o", os.devnull, "-e", "trace=readv",
                 "-e", "inject=readv:delay_enter=600000000:when=3"],
    ).start()

    def unhealthy_statuses() -> list[float]:
        fake_systemd.pump()  # read as systemd does, so that the daemon's datagrams never back up
        return [t for t, f in fake_systemd.messages if f.get("STATUS", "").startswith("UNHEALTHY")]

    def became_unhealthy() -> bool:
        if d.exited():
            raise AssertionError(f"daemon exited ({d.proc.returncode}):\n{d.log_text()}")
        return bool(unhealthy_statuses()) and bool(d.events("daemon.unhealthy"))

    wait_for(became_unhealthy, 120, "daemon.unhealthy and an UNHEALTHY status")
    code, body = d.http("/healthz")
    assert code == 503 and "wedged" in body, (code, body)
    unhealthy = unhealthy_statuses()
    last_ping = fake_systemd.seen("WATCHDOG")[-1]
    wait_for(lambda: len(unhealthy_statuses()) >= len(unhealthy) + 5, 60, "more unhealthy heartbeats")
    assert fake_systemd.seen("WATCHDOG")[-1] == last_ping, "WATCHDOG=1 must stop while a worker is wedged"
    d.kill()
