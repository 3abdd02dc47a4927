"""What each command loads: `--version` and `--help` only the standard library, `latest` and `status` only
what answering needs. Start-up time is measured in bench/ (goal 3 of the performance issue); this guards
the cause of a slow start (an eager import) without timing anything: the set of modules a real `mirrord`
process holds when it exits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import save_checkpoint
from tests.support.cli import child_env, run_mirrord
from tests.support.ports import free_port

# Runs mirrord's main() as the console script does, then writes every module name the process holds,
# and those the interpreter held before mirrord was imported (site's own), to the file named first.
DRIVER = """
import json, sys
before = sorted(sys.modules)
import mirrord.cli
try:
    code = mirrord.cli.main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "before": before, "after": sorted(sys.modules)}, out)
"""

# Never needed to print an answer: the logging stack (structlog pulls in rich and asyncio), the metrics
# client, the HTTP client, torch and the S3 client. (The configuration is read by the pydantic models.)
HEAVY = ("structlog", "rich", "asyncio", "prometheus_client", "torch", "numpy", "boto3", "botocore",
         "urllib.request", "http.client", "ssl")


def modules_after(
    tmp_path: Path, *args: str | Path, env: dict[str, str] | None = None
) -> tuple[int, set[str], set[str]]:
    """(exit code, modules before mirrord was imported, modules at exit) of `mirrord ARGS` in a child process."""
    out = tmp_path / "modules.json"
    result = subprocess.run([sys.executable, "-c", DRIVER, str(out), *map(str, args)], capture_output=True,
                            text=True, env=child_env(env), timeout=120, check=False)
    assert out.exists(), result.stderr
    doc = json.loads(out.read_text())
    return doc["code"], set(doc["before"]), set(doc["after"])


# Never needed by a file layout's `latest`: planning copies and their records, folder units, several nodes'
# contributions, pinning a locked mirror, staging a folder unit (each is imported by the code that plans or writes).
NOT_FOR_AN_ANSWER = ("mirrord.core.plan", "mirrord.core.jobs", "mirrord.core.units", "mirrord.core.contributions",
                     "mirrord.core.retention", "mirrord.store.identity", "mirrord.store.staging")


def config_modules(tmp_path: Path) -> set[str]:
    """What reading the configuration loads (pydantic's own imports): not the command's to answer for."""
    out = tmp_path / "config-modules.json"
    script = f"import json, sys; import mirrord.config; json.dump(sorted(sys.modules), open({str(out)!r}, 'w'))"
    subprocess.run([sys.executable, "-c", script], env=child_env(), timeout=120, check=True)
    return set(json.loads(out.read_text()))


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.mark.parametrize("args", [["--version"], ["-V"], ["--help"], []], ids=["--version", "-V", "--help", "bare"])
def test_version_and_help_load_only_the_standard_library(tmp_path: Path, args: list[str]) -> None:
    code, before, after = modules_after(tmp_path, *args)
    assert code in (0, 2)
    outside = sorted(m for m in after - before
                     if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "mirrord")
    assert outside == []
    ours = sorted(m for m in after if m.split(".")[0] == "mirrord")
    assert ours == ["mirrord", "mirrord.cli", "mirrord.errors", "mirrord.vocabulary"]
    if args in (["--version"], ["-V"]):  # not even the parser, nor what building it needs
        assert sorted({"argparse", "pathlib", "json", "textwrap", "shutil", "gettext"} & (after - before)) == []


@pytest.fixture
def mirrored(tmp_path: Path) -> tuple[Path, Path]:
    """A primary with two real torch.save checkpoints, mirrored by `mirrord sync`."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step in (1, 2):
        save_checkpoint(primary / "run" / f"step_{step}.pt", step)
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env={"MIRRORD_PRUNE__ENABLED": "false"})
    assert result.returncode == 0, result.stderr
    return primary, mirror


def test_latest_loads_no_logging_stack_and_no_re_read_code(tmp_path: Path, mirrored: tuple[Path, Path]) -> None:
    """A recorded, unchanged file is trusted by stat: the hashing and validating code is not even loaded."""
    _, mirror = mirrored
    code, _, after = modules_after(tmp_path, "latest", "--mirror", mirror)
    assert code == 0
    assert heavy(after) == []
    assert "mirrord.commands.verify" not in after
    after -= config_modules(tmp_path)
    re_read = ("mirrord.formats.validators", "mirrord.formats.zipcheck", "isal", "blake3", "xxhash", "tempfile")
    assert sorted(m for m in after if m.split(".")[0] in re_read or m in re_read) == []  # (hashing, CRC, spooling)
    assert "ctypes" not in after  # libc's syncfs, sync_file_range, fstatfs: looked up by the first copy
    assert sorted(set(NOT_FOR_AN_ANSWER) & after) == []
    assert sorted({"shutil", "bz2", "lzma"} & after) == []  # (argparse's formatters are sized without shutil)
    assert sorted({"hashlib", "_hashlib"} & after) == []  # a read-only manifest load hashes nothing
    code, _, after = modules_after(tmp_path, "latest", "--mirror", mirror, "--json")  # what scripts run
    assert code == 0
    assert heavy(after) == [] and "ctypes" not in after
    assert not [m for m in after if m.startswith(("mirrord.service.", "mirrord.commands.sync"))]
    assert sorted(set(NOT_FOR_AN_ANSWER) & after) == []
    code, _, after = modules_after(tmp_path, "latest", "--mirror", mirror, "--verify")
    assert code == 0 and "blake3" in after  # --verify re-reads: it needs the hash


def test_status_without_a_daemon_loads_no_logging_metrics_or_http_client(
    tmp_path: Path, mirrored: tuple[Path, Path]
) -> None:
    primary, mirror = mirrored
    env = {"MIRRORD_METRICS__ADDRESS": f"127.0.0.1:{free_port()}"}  # nothing listens there
    code, _, after = modules_after(tmp_path, "status", "--primary", primary, "--mirror", mirror, env=env)
    assert code == 1  # the only problem: no daemon answers
    assert heavy(after) == [] and "ctypes" not in after


def test_a_command_that_fails_still_logs_its_reason(tmp_path: Path, mirrored: tuple[Path, Path]) -> None:
    """structlog is loaded on the first log line, configured as the command asked (JSON here)."""
    _, mirror = mirrored
    (mirror / ".mirrord-manifest.json").write_text("{not json")
    result = run_mirrord("latest", "--mirror", mirror, "--log-format", "json")
    assert result.returncode == 1
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["command.failed"]
    assert events[0]["command"] == "latest" and events[0]["level"] == "error"


def test_sync_loads_no_metrics_client(tmp_path: Path, mirrored: tuple[Path, Path]) -> None:
    """A one-shot `sync` is timed whole by the scripts that run it: nothing scrapes its metrics, so
    prometheus_client (and its HTTP server) stays out."""
    primary, mirror = mirrored
    save_checkpoint(primary / "run" / "step_3.pt", 3)
    env = {"MIRRORD_PRUNE__ENABLED": "false", "MIRRORD_LOG__FORMAT": "json"}
    code, _, after = modules_after(tmp_path, "sync", "--primary", primary, "--mirror", mirror, env=env)
    assert code == 0
    assert (mirror / "run" / "step_3.pt").read_bytes() == (primary / "run" / "step_3.pt").read_bytes()
    logging_stack = ("structlog", "rich", "asyncio", "ssl")  # it logs (asyncio, pulled in by structlog, loads ssl)
    assert [m for m in heavy(after) if m.split(".")[0] not in logging_stack] == []
    assert "mirrord.obs.metrics" not in after and "http.server" not in after
    save_checkpoint(primary / "run" / "step_4.pt", 4)
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    committed = [e for e in events if e["event"] == "copy.committed"]
    assert [e["path"] for e in committed] == ["run/step_4.pt"] and committed[0]["level"] == "info"
    assert events[-1]["event"] == "sync.finished" and events[-1]["copied"] == 1
