"""A real `mirrord run` process for tests and benchmarks: its own config file, a free port, JSON log
events in a file (nothing blocks on a full pipe), its own process group (killed whole)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import config
from tests.support.cli import child_env
from tests.support.logs import read_events
from tests.support.ports import free_port
from tests.support.wait import wait_for

READY_SECONDS = 90


class DaemonProcess:
    """Start, observe and stop one daemon on primary -> mirror.

    Its settings are `base` (the tests' quick preset by default), the metrics address on a free port,
    then `settings`; edit `.settings` and call write_config() to change them before a reload.
    """

    def __init__(
        self,
        workdir: Path,
        primary: Path,
        mirror: Path,
        settings: Mapping[str, Any] | None = None,
        wrapper: Sequence[str] = (),
        env: dict[str, str] | None = None,
        base: Mapping[str, Any] = config.DAEMON,
        keep_notify: bool = False,
        ready_seconds: float = READY_SECONDS,
    ) -> None:
        """`keep_notify`: pass NOTIFY_SOCKET / WATCHDOG_* through (a benchmark listening to the pings);
        `ready_seconds`: how long start() waits for /readyz (ready after the first reconcile, which takes
        longer than READY_SECONDS on a tree of 1,000,000 files)."""
        self.workdir = workdir
        self.ready_seconds = ready_seconds
        self.port = free_port()
        self.config_path = workdir / "mirrord.toml"
        self.log_path = workdir / f"daemon-{self.port}.log"
        self.settings = config.settings(
            primary, mirror, base, {"metrics": {"address": f"127.0.0.1:{self.port}"}}, settings
        )
        self.wrapper = list(wrapper)
        self.env = env or {}
        self.keep_notify = keep_notify
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.write_config()

    def write_config(self) -> None:
        """Write .settings to the config file (the daemon reads it at start and on SIGHUP)."""
        config.write_config(self.config_path, self.settings)

    def start(self, wait_ready: bool = True) -> DaemonProcess:
        """Start `mirrord run --config FILE` (no MIRRORD_*, NOTIFY_SOCKET or WATCHDOG_* inherited unless
        keep_notify); wait for /readyz."""
        dropped = ("MIRRORD_",) if self.keep_notify else ("MIRRORD_", "NOTIFY_SOCKET", "WATCHDOG_")
        env = child_env(self.env, drop=dropped)
        cmd = [*self.wrapper, sys.executable, "-m", "mirrord", "run", "--config", str(self.config_path)]
        self._log = self.log_path.open("ab")
        # Its own process group: kill() reaches the daemon even behind a wrapper (strace) that dies first.
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, start_new_session=True
        )
        if wait_ready:
            wait_for(lambda: self.http("/readyz")[0] == 200 or self.exited(), self.ready_seconds, "daemon readiness")
            assert not self.exited(), self.log_text()
        return self

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop(timeout=60)
        finally:
            self.kill()

    @property
    def pid(self) -> int:
        """The daemon's pid (the wrapper's, if there is one)."""
        assert self.proc is not None
        return self.proc.pid

    def exited(self) -> bool:
        """Whether the process was started and has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def http(self, path: str) -> tuple[int, str]:
        """(status, body) of GET path on the daemon's endpoints; (0, "") if nothing answers."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str, labels: str = "") -> float | None:
        """The value of one sample on /metrics, or None if it is not there."""
        code, body = self.http("/metrics")
        if code != 200:
            return None
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in body.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def log_text(self) -> str:
        """Everything the daemon wrote so far."""
        return self.log_path.read_text(errors="replace")

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Its JSON log events (see tests.support.logs)."""
        return read_events(self.log_path, name, **match)

    def wait_event(self, name: str, timeout: float = 90, **match: Any) -> dict[str, Any]:
        """The first event `name` matching `match`, once logged; fails if the daemon exits first."""

        def found() -> dict[str, Any] | None:
            if self.exited():
                assert self.proc is not None
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before {name}:\n{self.log_text()}")
            hits = self.events(name, **match)
            return hits[0] if hits else None

        return wait_for(found, timeout, f"log event {name} {match}")  # type: ignore[no-any-return]

    def send(self, signum: int) -> None:
        """Send a signal to the daemon process."""
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 90) -> int:
        """Signal it (if still running) and wait for its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._close_log()

    def kill(self) -> None:
        """SIGKILL the whole process group (the daemon and any wrapper), whether or not it still runs."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
