from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.daemon_harness import DaemonProcess


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Make daemons on tmp_path/primary -> tmp_path/mirror; every one is killed at teardown."""
    made: list[DaemonProcess] = []
    (tmp_path / "primary").mkdir(exist_ok=True)

    def make(settings: dict[str, Any] | None = None, **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path, tmp_path / "primary", tmp_path / "mirror", settings, **kwargs)
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill()
