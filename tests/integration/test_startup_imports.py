"""What a real `mirrord` process never loads: the daemon and every command run without torch (only
mirrord.torch, the training-side helpers, needs it) and without boto3 (only an s3:// mirror needs it);
`--version` and `--help` load nothing outside the standard library. Checked on the modules a real process
holds when it exits, so a new import that changes none of this changes no test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.checkpoints import publish_checkpoint, save_checkpoint
from tests.support.cli import child_env, run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_port
from tests.support.wait import wait_for

# Runs `mirrord ARGS` as the console script does (ARGS: what follows the first "mirrord" argument, so that
# it can wrap `python -m mirrord run ...`); at exit, writes every module the process holds to OUT.
DRIVER = """
import atexit, json, sys
out, args = sys.argv[1], sys.argv[sys.argv.index("mirrord") + 1:]
before = sorted(sys.modules)
atexit.register(lambda: open(out, "w").write(json.dumps({"before": before, "after": sorted(sys.modules)})))
import mirrord.cli
sys.exit(mirrord.cli.main(args))
"""
# Never needed by the daemon nor by a command on a local mirror.
NEVER = ("torch", "boto3", "botocore")


def loaded(out: Path) -> tuple[set[str], set[str]]:
    """(modules before mirrord was imported, modules at exit) written by DRIVER."""
    doc = json.loads(out.read_text())
    return set(doc["before"]), set(doc["after"])


def never_needed(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in NEVER)


@pytest.fixture
def run_cli(tmp_path: Path) -> Callable[..., tuple[int, set[str], set[str]]]:
    """run(ARGS, env=...) -> (exit code, modules before mirrord, modules at exit) of `mirrord ARGS`."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)

    def run(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, set[str], set[str]]:
        out = tmp_path / "modules.json"
        out.unlink(missing_ok=True)
        result = subprocess.run(
            [sys.executable, str(driver), str(out), "mirrord", *map(str, args)],
            capture_output=True,
            text=True,
            env=child_env(env),
            timeout=120,
            check=False,
        )
        assert out.exists(), result.stderr
        return result.returncode, *loaded(out)

    return run


@pytest.mark.parametrize("args", [["--version"], ["--help"], []], ids=["--version", "--help", "bare"])
def test_version_and_help_load_only_the_standard_library(run_cli, args: list[str]) -> None:
    code, before, after = run_cli(*args)
    assert code in (0, 2)
    outside = sorted(m for m in after - before if m.split(".")[0] not in (*sys.stdlib_module_names, "mirrord"))
    assert outside == []


def test_commands_answer_without_torch_or_boto3(tmp_path: Path, run_cli) -> None:
    """sync copies (and verifies) real torch.save checkpoints, latest, drill and status answer about them."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step in (1, 2):
        save_checkpoint(primary / "run" / f"step_{step}.pt", step)
    env = {"MIRRORD_PRUNE__ENABLED": "false", "MIRRORD_METRICS__ADDRESS": f"127.0.0.1:{free_port()}"}
    for args, want in (
        (("sync", "--primary", primary, "--mirror", mirror), 0),
        (("latest", "--mirror", mirror), 0),
        (("latest", "--mirror", mirror, "--verify"), 0),
        (("drill", "--mirror", mirror), 0),  # the loader it starts imports torch, not the command
        (("status", "--primary", primary, "--mirror", mirror), 1),
    ):  # 1: no daemon answers
        code, _, after = run_cli(*args, env=env)
        assert code == want, args
        assert never_needed(after) == [], args
    assert (mirror / "run" / "step_2.pt").read_bytes() == (primary / "run" / "step_2.pt").read_bytes()


def test_the_daemon_runs_without_torch_or_boto3(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A real daemon mirrors and verifies a real checkpoint, stops on SIGTERM: it never loaded either."""
    driver, out = tmp_path / "driver.py", tmp_path / "modules.json"
    driver.write_text(DRIVER)
    d = daemon_factory(wrapper=[sys.executable, str(driver), str(out)]).start()
    publish_checkpoint(tmp_path / "primary" / "run" / "step_0001.pt", 1)
    d.wait_event("copy.committed", path="run/step_0001.pt")
    assert d.stop(signal.SIGTERM) == 0
    wait_for(out.exists, 30, "the module list written at exit")
    assert never_needed(loaded(out)[1]) == []


def test_the_training_side_helpers_do_load_torch() -> None:
    """The other side of the line: mirrord.torch is what pays for torch (so the checks above can fail)."""
    code = "import sys, mirrord.torch; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_command_that_fails_still_logs_its_reason(tmp_path: Path) -> None:
    """structlog is loaded on the first log line, configured as the command asked (JSON here)."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / ".mirrord-manifest.json").write_text("{not json")
    result = run_mirrord("latest", "--mirror", mirror, "--log-format", "json")
    assert result.returncode == 1
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["command.failed"]
    assert events[0]["command"] == "latest" and events[0]["level"] == "error"


def test_an_invalid_config_value_gets_the_models_message(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    result = run_mirrord("latest", "--mirror", mirror, env={"MIRRORD_COPY__WORKERS": "65"})
    assert result.returncode == 2
    assert (
        "mirrord: config error: copy.workers: Input should be less than or equal to 64 "
        "(from MIRRORD_COPY__WORKERS='65')" in result.stderr
    )
