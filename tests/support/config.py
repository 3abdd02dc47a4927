"""The one config builder: {primary, mirror} plus presets and per-test sections, deep-merged in order.

The result is a plain dict (the shape of mirrord.toml), written as TOML for a child process or loaded
as a Config for code running in the test process. Key order follows the layers (a test that edits
the TOML text relies on it).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from mirrord.config import Config, load_config

# Copies at full speed and normal priority: the suite runs 4 workers on 2 cores, where SCHED_IDLE copies and
# pacing from pressure (the defaults, issue 44) would wait for the other tests' CPU and disk, and each test's
# wait would measure its neighbours. Pacing has its own tests (test_pacing.py), with the defaults.
FULL_SPEED: Mapping[str, Any] = {"bandwidth_limit": 0, "pacing": False, "ionice": "none", "cpu_policy": "normal"}

# In-process tests: copy at once, retry at once, at full speed (no bandwidth cap), no drills and no scrub (each a
# thread of its own: tests/integration/test_daemon_drill.py, test_scrub.py).
UNIT: Mapping[str, Any] = {
    "copy": {"settle_seconds": 0.0, "retry_backoff_seconds": 0.0},
    "io": FULL_SPEED,
    "drill": {"interval_hours": 0},
    "scrub": {"interval_days": 0},
}

# A daemon under test (tests.support.daemon): quick heartbeat and shutdown, no bandwidth cap, debug logs
# as JSON, no drills (a loader that imports torch after each copy: tests/integration/test_daemon_drill.py) and no
# scrub (reads of the mirror beside the test's own: test_scrub.py).
DAEMON: Mapping[str, Any] = {
    "copy": {"settle_seconds": 0.5, "retry_backoff_seconds": 0.1, "free_space_reserve_bytes": 0},
    "io": FULL_SPEED,
    "prune": {"enabled": False},
    "watch": {"rescan_interval_seconds": 30},
    "daemon": {"heartbeat_seconds": 0.25, "shutdown_grace_seconds": 5},
    "drill": {"interval_hours": 0},
    "scrub": {"interval_days": 0},
    "metrics": {},
    "log": {"format": "json", "level": "debug"},
}

# A daemon under benchmark: mirrord's own defaults, but no pruning and logs as JSON.
BENCH: Mapping[str, Any] = {"prune": {"enabled": False}, "metrics": {}, "log": {"format": "json", "level": "info"}}

# The chaos suite: two workers, no waiting, small buffers (more syscalls to strike), no cap, metrics off, no drills,
# no scrub.
CHAOS: Mapping[str, Any] = {
    "copy": {
        "workers": 2,
        "settle_seconds": 0.0,
        "retry_backoff_seconds": 0.0,
        "max_attempts": 2,
        "free_space_reserve_bytes": 0,
    },
    "io": {**FULL_SPEED, "buffer_bytes": 64 * 1024},
    "prune": {"enabled": False, "keep_last": 2, "min_age_seconds": 0},
    "watch": {"rescan_interval_seconds": 60},
    "daemon": {"heartbeat_seconds": 0.25, "shutdown_grace_seconds": 10},
    "drill": {"interval_hours": 0},
    "scrub": {"interval_days": 0},
    "metrics": {"enabled": False},
    "log": {"format": "json", "level": "info"},
}


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `extra` into `base` (tables recursively, anything else replaced); returns `base`."""
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(dict(value) if isinstance(value, Mapping) else value)
    return base


def settings(primary: Path | str, mirror: Path | str, *layers: Mapping[str, Any] | None) -> dict[str, Any]:
    """{primary, mirror} with each layer merged over the previous ones (None layers are skipped)."""
    data: dict[str, Any] = {"primary": str(primary), "mirror": str(mirror)}
    for layer in layers:
        if layer:
            merge(data, layer)
    return data


def write_config(path: Path, data: Mapping[str, Any]) -> Path:
    """`data` as a mirrord.toml at `path`."""
    path.write_text(tomli_w.dumps(dict(data)))
    return path


def load(data: Mapping[str, Any], check_roots: bool = True) -> Config:
    """`data` as a Config, with no file and no environment (what `mirrord` would load from the TOML)."""
    return load_config(None, environ={}, overrides=dict(data), check_roots=check_roots)
