"""Run a command on a real pseudo-terminal, as a person at a shell would, and read what it shows."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Sequence
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """`argv` with stdin, stdout and stderr on a fresh 160-column pty, in its own process group."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self._master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        # The size is the pty's: COLUMNS and LINES inherited from the test process would override it
        # (a shell that exports them; a pytest-xdist worker has 80x24 in its environment).
        env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
        self.proc = subprocess.Popen(
            list(argv), stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True
        )
        os.close(slave)
        self._raw = bytearray()
        self._eof = False

    @property
    def text(self) -> str:
        """Everything shown so far, without colours and cursor movements."""
        return ANSI.sub("", self._raw.decode(errors="replace")).replace("\r", "")

    def read(self, seconds: float) -> None:
        """Collect output for up to `seconds` (less once the terminal is closed)."""
        deadline = time.monotonic() + seconds
        while not self._eof and time.monotonic() < deadline:
            ready, _, _ = select.select([self._master], [], [], min(0.2, max(0.0, deadline - time.monotonic())))
            if not ready:
                continue
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                chunk = b""
            if not chunk:
                self._eof = True
            self._raw += chunk

    def wait_for_text(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            if time.monotonic() > deadline or self._eof:
                raise AssertionError(f"{needle!r} not shown within {timeout} s:\n{self.text}")
            self.read(0.5)
        return self.text

    def finish(self, timeout: float) -> int:
        """Read until the command exits; its exit status."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None or not self._eof:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout} s:\n{self.text}")
            self.read(0.5)
            if self.proc.poll() is not None:
                self.read(0.5)
                break
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        """Kill the whole process group if it is still there; release the terminal."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        os.close(self._master)
