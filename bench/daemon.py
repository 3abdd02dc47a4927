"""A real `mirrord run` process for the latency and resource benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mirrord.errors import ManifestError
from mirrord.manifest import MANIFEST_NAME, Manifest

MANIFEST_PREFIX = MANIFEST_NAME.removesuffix(".json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for a mirrord config: scalars, lists of strings, nested tables."""
    scalars = [f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"
               for k, v in data.items() if not isinstance(v, dict)]
    lines = ([f"[{prefix}]"] if prefix and scalars else []) + scalars
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(to_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(lines) + "\n"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll until ``predicate`` is truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return value


class ManifestWatcher:
    """Reads the mirror's manifest (snapshot + journal) only when one of its files changed (cheap enough
    to poll every ms)."""

    def __init__(self, mirror: Path) -> None:
        self.mirror = mirror
        self._key: tuple[tuple[str, int, int, int], ...] | None = None
        self.entries: dict[str, Any] = {}

    def refresh(self) -> dict[str, Any]:
        key = []
        try:
            names = sorted(p.name for p in self.mirror.iterdir())
        except FileNotFoundError:
            return self.entries
        for name in names:
            if name.startswith(MANIFEST_PREFIX) and not name.endswith(".part"):
                try:
                    st = (self.mirror / name).stat()
                except FileNotFoundError:
                    continue
                key.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        if tuple(key) != self._key:
            try:
                self.entries = Manifest.load(self.mirror).entries
            except ManifestError:  # changed under us by a compaction: read again at the next poll
                return self.entries
            self._key = tuple(key)
        return self.entries


class Daemon:
    """Start `mirrord run` on a config file of our own, wait for /readyz, stop it with SIGTERM."""

    def __init__(self, workdir: Path, primary: Path, mirror: Path, settings: dict[str, Any]) -> None:
        self.port = free_port()
        self.config: dict[str, Any] = {
            "primary": str(primary), "mirror": str(mirror),
            "prune": {"enabled": False},
            "metrics": {"address": f"127.0.0.1:{self.port}"},
            "log": {"format": "json", "level": "info"},
        }
        for key, value in settings.items():
            if isinstance(value, dict):
                self.config.setdefault(key, {}).update(value)
            else:
                self.config[key] = value
        self.config_path = workdir / f"mirrord-{self.port}.toml"
        self.log_path = workdir / f"mirrord-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"mirrord run exited with {self.proc.returncode}; see {self.log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def __enter__(self) -> Daemon:
        self.config_path.write_text(to_toml(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRRORD_", "NOTIFY_SOCKET"))}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mirrord", "run", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        wait_for(self.ready, 60, "mirrord run to become ready", 0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
