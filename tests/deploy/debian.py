"""What the deploy tests build on: Debian roots made with mmdebstrap, and mirrord's wheels.

No container registry is reachable from the machines that run the tests, so the image's base is a
stand-in made from Debian packages (bookworm's Python is 3.11, the minor of python:3.11-slim), and
the root that boots systemd is made the same way. Both are built once per test run, concurrently
(30 s on an idle machine, 2 min on a busy one), and only when a test asks for one of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
BASE_PYTHON = (3, 11)  # bookworm's python3, the same minor as the Dockerfile's python:3.11-slim
BUILD_SECONDS = 900
WHEEL_FILES = ("pyproject.toml", "setup.py", "README.md")
WHEEL_FOLDERS = ("mirrord", "config", "systemd")  # downloads from the Debian archive: generous for a slow mirror

# Docs, man pages and translations are of no use to a test and are a third of the download.
_SLIM = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")]
# The stand-in for python:3.11-slim: python with pip, and no PEP 668 marker (the official image has
# none either, so the Dockerfile's system-wide `pip install` works the same on both).
BASE_ARGS = [
    "--include=python3,python3-pip,python3-venv,python-is-python3",
    '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
]
# A root that boots a real systemd (PID 1) under systemd-nspawn, with what the README's install needs
# and the unit's ExecReload=/bin/kill (procps; minbase lacks it, every real Debian install has it);
# `ip` (iproute2) gives the machine's loopback an address outside 127/8 for a "remote" S3 endpoint.
SYSTEMD_ARGS = ["--include=systemd,systemd-sysv,dbus,procps,iproute2,python3,python3-venv"]


class DebianRoots:
    """Both roots are built side by side, from start() or the first use on; each accessor waits only for its own."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.base_tar = workdir / "base.tar"
        self.systemd_root = workdir / "systemd-root"
        self._builds: dict[Path, subprocess.Popen[bytes]] = {}
        self.seconds: dict[str, float] = {}

    def start(self) -> None:
        """Start both builds (once): they download and unpack while the caller does other work."""
        if self._builds:
            return
        for target, extra in ((self.base_tar, BASE_ARGS), (self.systemd_root, SYSTEMD_ARGS)):
            log = (self.workdir / f"{target.name}.log").open("wb")
            with log:
                self._builds[target] = subprocess.Popen(
                    ["mmdebstrap", "--quiet", "--variant=minbase", *_SLIM, *extra, SUITE, str(target)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self._started = time.monotonic()

    def _wait(self, target: Path) -> Path:
        self.start()
        build = self._builds[target]
        try:
            code = build.wait(timeout=BUILD_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        log = (self.workdir / f"{target.name}.log").read_text(errors="replace")
        outcome = "timed out" if code is None else f"exited {code}"
        assert code == 0, f"mmdebstrap {target.name} {outcome}:\n{log[-3000:]}"
        self.seconds.setdefault(target.name, time.monotonic() - self._started)
        return target

    def base(self) -> Path:
        """A tarball of the stand-in base image's root filesystem (for `podman import`)."""
        return self._wait(self.base_tar)

    def systemd(self) -> Path:
        """A directory that `systemd-nspawn -b` boots."""
        return self._wait(self.systemd_root)

    def close(self) -> None:
        """Stop builds still running (a failed run), then remove everything built."""
        for build in self._builds.values():
            if build.poll() is None:
                os.killpg(build.pid, signal.SIGKILL)
            build.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def copy_wheel_sources(dest: Path) -> None:
    """What `pip wheel .` needs from a checkout; mirrord/data/ links into config/ and systemd/ (kept as links)."""
    for name in WHEEL_FILES:
        shutil.copy2(REPO / name, dest)
    for folder in WHEEL_FOLDERS:
        shutil.copytree(REPO / folder, dest / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))


def build_wheels(dest: Path, scratch: Path) -> list[Path]:
    """mirrord and its dependencies (with the `s3` extra) as wheels, pinned to exactly the versions
    installed where the tests run: the image and the booted machine then run what the rest of the
    suite tested. The image's build stage builds mirrord itself again, offline, from these wheels and
    the setuptools wheel its isolated build environment needs (the Dockerfile's `PIP_NO_INDEX=1`).
    """
    source = scratch / "src"
    source.mkdir()
    copy_wheel_sources(source)
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    constraints = scratch / "constraints.txt"
    constraints.write_text(frozen)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(dest),
            "--constraint",
            str(constraints),
            f"{source}[s3]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"pip wheel exited {result.returncode}:\n{result.stderr[-3000:]}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--dest",
            str(dest),
            "setuptools>=68",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"pip download exited {result.returncode}:\n{result.stderr[-3000:]}"
    wheels = sorted(dest.glob("*.whl"))
    assert any(w.name.startswith("mirrord-") for w in wheels), wheels
    assert not any(w.name.startswith("torch-") for w in wheels), "the image must not carry torch"
    return wheels
