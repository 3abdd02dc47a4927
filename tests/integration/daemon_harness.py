"""A real `mirrord run` subprocess for tests: its own config file, a free port, JSON log events."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tomli_w


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns a truthy value or the deadline passes (then fail naming `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def deep_update(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = value
    return base


class DaemonProcess:
    """Start, observe and stop one daemon. Logs go to a file so nothing blocks on a full pipe."""

    def __init__(self, workdir: Path, primary: Path, mirror: Path, settings: dict[str, Any] | None = None,
                 wrapper: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.config_path = workdir / "mirrord.toml"
        self.log_path = workdir / f"daemon-{self.port}.log"
        self.settings: dict[str, Any] = {
            "primary": str(primary),
            "mirror": str(mirror),
            "copy": {"settle_seconds": 0.5, "retry_backoff_seconds": 0.1, "free_space_reserve_bytes": 0},
            "prune": {"enabled": False},
            "watch": {"rescan_interval_seconds": 30},
            "daemon": {"heartbeat_seconds": 0.25, "shutdown_grace_seconds": 5},
            "metrics": {"address": f"127.0.0.1:{self.port}"},
            "log": {"format": "json", "level": "debug"},
        }
        deep_update(self.settings, settings or {})
        self.wrapper = list(wrapper)
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.write_config()

    def write_config(self) -> None:
        self.config_path.write_text(tomli_w.dumps(self.settings))

    def start(self, wait_ready: bool = True) -> DaemonProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRRORD_", "NOTIFY_SOCKET"))}
        env.update(self.env)
        cmd = [*self.wrapper, sys.executable, "-m", "mirrord", "run", "--config", str(self.config_path)]
        self._log = self.log_path.open("ab")
        # Its own process group: kill() reaches the daemon even behind a wrapper (strace) that dies first.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        if wait_ready:
            wait_for(lambda: self.http("/readyz")[0] == 200 or self.exited(), 90, "daemon readiness")
            assert not self.exited(), self.log_text()
        return self

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str, labels: str = "") -> float | None:
        code, body = self.http("/metrics")
        if code != 200:
            return None
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in body.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if (name is None or event.get("event") == name) and all(event.get(k) == v for k, v in match.items()):
                out.append(event)
        return out

    def wait_event(self, name: str, timeout: float = 90, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            if self.exited():
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before {name}:\n{self.log_text()}")
            hits = self.events(name, **match)
            return hits[0] if hits else None

        return wait_for(found, timeout, f"log event {name} {match}")  # type: ignore[no-any-return]

    def send(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 90) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole process group (the daemon and any wrapper), whether or not it still runs."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        if hasattr(self, "_log"):
            self._log.close()


def save_checkpoint(path: Path, step: int, megabytes: float = 0.1, rename: bool = True) -> Path:
    """A real torch.save checkpoint (model + optimizer state), committed with the .part -> rename pattern."""
    import torch

    torch.manual_seed(step)
    n = max(1, int(megabytes * 1024 * 1024 / 4 / 2))
    model = torch.nn.Linear(n, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, n)).sum().backward()
    opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(path.name + ".part") if rename else path
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, target)
    if rename:
        target.replace(path)
    return path
