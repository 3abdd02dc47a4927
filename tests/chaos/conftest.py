"""Fixtures of the chaos suite: the scale, the tally that becomes RESULTS.md, real checkpoints, a fork
server for real mirrord processes, ext4 filesystems on loop devices."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import (
    REPORT,
    SCALE,
    Checkpoints,
    LoopFs,
    Report,
    Scale,
    World,
    Zygote,
    loop_devices_unavailable,
)
from tests.support.checkpoints import save_checkpoint

# (width, depth) of the checkpoints: about 25 KB to 1.6 MB of real torch.save zip files.
SHAPES = ((32, 2), (48, 2), (64, 2), (96, 2), (128, 2), (160, 3), (192, 2), (256, 2))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remember each chaos test's outcome (and why it was skipped) for RESULTS.md."""
    if not report.nodeid.startswith("tests/chaos/"):
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif hasattr(report, "wasxfail"):
            reason = str(report.wasxfail)
        REPORT.outcomes.append({"test": report.nodeid, "outcome": outcome, "reason": reason})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("CHAOS_RESULTS")
    if path and (REPORT.tallies or REPORT.outcomes):
        REPORT.write(Path(path))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Findings (I/O errors of the filesystem under test) are part of the result: show them."""
    findings = [f"{t.scenario}: {f}" for t in REPORT.tallies for f in t.findings]
    if findings:
        terminalreporter.section("chaos findings (not invariant violations)")
        for line in findings:
            terminalreporter.line(line)


@pytest.fixture(scope="session")
def scale() -> Scale:
    return SCALE


@pytest.fixture(scope="session")
def report() -> Report:
    return REPORT


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Distinct real checkpoints (model + Adam state), each a different size."""
    base = tmp_path_factory.mktemp("blobs")
    blobs = []
    for i, (width, depth) in enumerate(SHAPES):
        path = save_checkpoint(base / f"b{i}.pt", 100 + i, width=width, depth=depth)
        blobs.append(path.read_bytes())
    return Checkpoints(blobs)


@pytest.fixture(scope="session")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


@pytest.fixture
def loop_fs(tmp_path: Path) -> Iterator[Callable[..., LoopFs]]:
    """make(name, size_mb, mkfs_args): an ext4 image tmp/NAME.img on a loop device, mounted at tmp/NAME.
    Skips the test where loop devices cannot be used; unmounts and detaches everything it made."""
    with contextlib.ExitStack() as made:

        def make(name: str, size_mb: int = 64, mkfs_args: tuple[str, ...] = ()) -> LoopFs:
            reason = loop_devices_unavailable()
            if reason:
                pytest.skip(f"needs a loop-mounted filesystem: {reason}")
            fs = LoopFs(tmp_path / f"{name}.img", tmp_path / name, size_mb=size_mb, mkfs_args=mkfs_args)
            made.callback(fs.close)
            return fs

        yield make


@pytest.fixture
def coarse_ext4(loop_fs: Callable[..., LoopFs]) -> LoopFs:
    """ext4 with 128-byte inodes: no room for the extra timestamp bytes, so every mtime is whole seconds
    and none can be later than 2038 (a later one is clamped)."""
    return loop_fs("coarse", size_mb=48, mkfs_args=("-I", "128"))
