"""Fixtures of the deploy suite: Debian roots, wheels, a private podman, the built image; the figures.

Everything here is built at most once per test run and removed at its end, also after a failure.
Tests skip (with the reason) only where the machine cannot run them: not root, or a tool missing
(`.ci/run` installs them all).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.debian import BASE_PYTHON, REPO, DebianRoots, build_wheels, copy_wheel_sources
from tests.deploy.podman import Podman

IMAGE = "localhost/mirrord:deploy-test"
BASE_IMAGE = "localhost/mirrord-deploy-base:bookworm"
# Printed at the end of the run (image sizes, build and boot times); tests add to it.
FIGURES: dict[str, str] = {}


def require(*tools: str) -> None:
    """Skip, saying why, when this machine cannot run the deploy tests."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("deploy tests need root on Linux (podman's overlay store, systemd-nspawn)")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"deploy tests need {', '.join(missing)} (apt-get install: see .ci/run)")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports = [
        r
        for stats in terminalreporter.stats.values()
        for r in stats
        if getattr(r, "nodeid", "").startswith("tests/deploy/") and hasattr(r, "duration")
    ]
    if not reports:
        return
    terminalreporter.section("deploy figures")
    for key, value in FIGURES.items():
        terminalreporter.write_line(f"{key}: {value}")
    total = sum(r.duration for r in reports)
    terminalreporter.write_line(f"deploy suite wall time (setup + tests + teardown): {total:.0f} s")


@pytest.fixture(scope="session")
def deploy_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("deploy")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def debian_roots(deploy_tmp: Path) -> Iterator[DebianRoots]:
    require("mmdebstrap")
    (deploy_tmp / "roots").mkdir()
    roots = DebianRoots(deploy_tmp / "roots")
    roots.start()  # downloads and unpacks while the wheels are built (the image and the booted unit need both)
    yield roots
    for name, seconds in roots.seconds.items():
        FIGURES[f"mmdebstrap {name} (both built side by side)"] = f"{seconds:.0f} s"
    roots.close()


@pytest.fixture(scope="session")
def wheels(deploy_tmp: Path) -> Path:
    """The wheels both the image and the booted machine install, with `--no-index`."""
    if sys.version_info[:2] != BASE_PYTHON:
        pytest.skip(
            f"wheels built by Python {sys.version_info[0]}.{sys.version_info[1]} cannot go into an "
            f"image of Python {BASE_PYTHON[0]}.{BASE_PYTHON[1]}; run the tests with Python 3.11"
        )
    dest = deploy_tmp / "wheels"
    (deploy_tmp / "wheel-build").mkdir()
    build_wheels(dest, deploy_tmp / "wheel-build")
    return dest


@pytest.fixture(scope="session")
def podman(deploy_tmp: Path) -> Iterator[Podman]:
    require("podman", "runc", "mmdebstrap")
    engine = Podman(deploy_tmp / "podman")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def image(podman: Podman, debian_roots: DebianRoots, wheels: Path, deploy_tmp: Path) -> str:
    """The repository's Dockerfile, built on the Debian stand-in base: its build stage builds mirrord
    from the sources, offline, with the dependencies' wheels in ./wheels (not mirrord's own)."""
    base_tar = debian_roots.base()
    started = time.monotonic()
    podman.run("import", "--quiet", str(base_tar), BASE_IMAGE, timeout=600)
    imported = time.monotonic()
    context = deploy_tmp / "context"
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore"):
        shutil.copy2(REPO / name, context)
    copy_wheel_sources(context)
    shutil.copytree(wheels, context / "wheels", ignore=shutil.ignore_patterns("mirrord-*.whl"))
    # --format docker: the OCI format has no HEALTHCHECK and would drop it silently.
    podman.run(
        "build",
        "--quiet",
        "--pull=never",
        "--format",
        "docker",
        "--build-arg",
        f"PYTHON_IMAGE={BASE_IMAGE}",
        "--build-arg",
        "PIP_NO_INDEX=1",
        "--tag",
        IMAGE,
        str(context),
        timeout=900,
    )
    built = time.monotonic()
    size, base = podman.size(IMAGE), podman.size(BASE_IMAGE)
    FIGURES["image size on the Debian stand-in base"] = f"{size / 1e6:.1f} MB"
    FIGURES["stand-in base (mmdebstrap minbase + python3, pip)"] = f"{base / 1e6:.1f} MB"
    FIGURES["app layers (what the Dockerfile adds)"] = f"{(size - base) / 1e6:.1f} MB"
    FIGURES["podman import / podman build"] = f"{imported - started:.0f} s / {built - imported:.0f} s"
    return IMAGE
