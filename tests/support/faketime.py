"""A process whose wall clock is off by a fixed amount: libfaketime preloaded into it, never the faketime(1)
wrapper. The wrapper names a semaphore and a shared-memory file after its pid and creates them exclusively;
one killed by process group leaves them in /dev/shm, and the next wrapper that gets the same pid fails
("sem_open: File exists")."""

from __future__ import annotations

from pathlib import Path

import pytest


def faketime_env(offset: str, monotonic_too: bool = False) -> dict[str, str]:
    """Environment for a child whose clock is `offset` ahead ("+30s", "+1d"); its monotonic clock is left
    alone, as with an NTP step, unless `monotonic_too`. Skips the test where Debian's faketime is missing."""
    libs = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))  # the daemon has threads
    if not libs:
        pytest.skip("libfaketime (Debian package faketime) is not installed")
    env = {"LD_PRELOAD": str(libs[0]), "FAKETIME": offset}
    return env if monotonic_too else {**env, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
