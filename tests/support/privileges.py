"""Run a function as uid/gid 65534: root bypasses permission bits, so a permission fault needs a non-root process."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

NOBODY = 65534


def run_as_nobody(func: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Run func(*args) in a forked child that dropped root for uid/gid 65534, and return its outcome.

    Root bypasses permission bits, so a permission-denied fault can only be real in a process that
    is not root. The child is forked (not exec'd) because the interpreter itself lives where nobody
    cannot read it. Returns {"value": ...} or {"error": type name, "path", "cause", "transient", "text"}.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                outcome: dict[str, Any] = {"value": func(*args)}
            except Exception as exc:
                outcome = {
                    "error": type(exc).__name__,
                    "path": getattr(exc, "path", None),
                    "cause": getattr(exc, "cause", None),
                    "transient": getattr(exc, "transient", None),
                    "text": str(exc),
                }
            data = json.dumps(outcome, default=str).encode()
            while data:
                data = data[os.write(write_fd, data) :]
        except BaseException:
            code = 1
            with open(2, "w", closefd=False) as err:
                err.write(traceback.format_exc())
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged child crashed"
    result: dict[str, Any] = json.loads(b"".join(chunks))
    return result
