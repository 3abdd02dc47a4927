"""Messages name the real cause, and say nothing internal: each case as a user meets it (issue 35)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.checkpoints import save_checkpoint
from tests.support.cli import child_env, mirrord_argv, run_mirrord
from tests.support.wait import wait_for


def _roots(tmp_path: Path) -> tuple[Path, Path]:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "run_a").mkdir(parents=True)
    mirror.mkdir()
    return primary, mirror


@pytest.mark.parametrize("command", [["check-config"], ["prune", "--dry-run"], ["latest"]])
def test_a_reader_that_left_ends_the_command_quietly(tmp_path: Path, command: list[str]) -> None:
    """`mirrord ... | head`: the pipe's reader is gone before the first write; no traceback, exit 141."""
    primary, mirror = _roots(tmp_path)
    save_checkpoint(primary / "run_a" / "step_1.pt", step=1)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*mirrord_argv(), *command, "--primary", str(primary), "--mirror", str(mirror)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode in (141, 1), result.stderr  # latest on an empty mirror has nothing to print: 1


def test_verify_prints_its_summary_on_stdout(tmp_path: Path) -> None:
    """The summary is verify's result: on stdout (where `| tee` or a script reads it), not stderr."""
    primary, mirror = _roots(tmp_path)
    save_checkpoint(primary / "run_a" / "step_1.pt", step=1)
    assert run_mirrord("sync", "--primary", primary, "--mirror", mirror).returncode == 0
    result = run_mirrord("verify", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 0, result.stderr
    assert "verified 1 file(s): 1 intact, 0 problem(s)" in result.stdout
    assert "verified" not in result.stderr


def test_a_locked_local_mirror_names_the_holders_pid(tmp_path: Path) -> None:
    """A second mirrord on a locked mirror is told which process holds it, as the S3 lease says its holder."""
    primary, mirror = _roots(tmp_path)
    holder = subprocess.Popen(
        [*mirrord_argv(), "run", "--primary", str(primary), "--mirror", str(mirror), "--log-format", "json"],
        env=child_env({"MIRRORD_METRICS__ENABLED": "false"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        for line in holder.stdout:  # until the daemon holds the lock (it logs readiness after taking it)
            if '"daemon.ready"' in line:
                break
        else:
            pytest.fail(f"the first daemon exited ({holder.wait()}) before it was ready")
        result = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
        assert result.returncode == 1
        assert f"another mirrord process (pid {holder.pid}) is using this mirror" in result.stderr, result.stderr
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        holder.stdout.close()


def test_config_errors_come_at_once_with_suggestions_and_the_section_hint(tmp_path: Path) -> None:
    """A mistyped section gets a suggestion; a top-level key written below the last section is told to move
    up; every problem of the file is listed in the same run."""
    primary, _ = _roots(tmp_path)
    config = tmp_path / "mirrord.toml"
    config.write_text(
        f'primary = "{primary}"\n[prun]\nkeep_last = 2\n[copy]\nworkers = "x"\n'
        f'[s3]\nnode = "a"\nmirror = "{tmp_path / "mirror"}"\n'
    )
    result = run_mirrord("check-config", "--config", config)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert f"mirrord: config error: prun: unknown key (in {config}); did you mean prune?" in lines, lines
    assert (
        f"mirrord: config error: s3.mirror: unknown key (in {config}); mirror is a top-level key: put it above "
        "the file's first [section] (below [s3] it is read as part of it)"
    ) in lines, lines
    assert any(line.startswith("mirrord: config error: copy.workers: ") for line in lines), lines


def test_a_mirror_whose_parent_does_not_exist_is_refused(tmp_path: Path) -> None:
    """A mistyped --mirror deep in a tree that does not exist is refused by sync and check-config (exit 2,
    nothing created), instead of the whole tree being made on whatever disk holds it."""
    primary, _ = _roots(tmp_path)
    save_checkpoint(primary / "run_a" / "step_1.pt", step=1)
    mirror = tmp_path / "nonexist" / "deep" / "m"
    for command in ("sync", "check-config"):
        result = run_mirrord(command, "--primary", primary, "--mirror", mirror)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert f"mirror: neither {mirror} nor its parent {mirror.parent} exists" in result.stderr, result.stderr
    assert not (tmp_path / "nonexist").exists()
    assert run_mirrord("sync", "--primary", primary, "--mirror", tmp_path / "m").returncode == 0  # parent exists


def test_relative_roots_in_a_config_file_are_printed_without_dot_dot(tmp_path: Path) -> None:
    """`primary = "../var/primary"` in config/mirrord.toml is shown as .../var/primary (as `make run` has it)."""
    (tmp_path / "config").mkdir()
    (tmp_path / "var" / "primary").mkdir(parents=True)
    config = tmp_path / "config" / "local.toml"
    config.write_text('primary = "../var/primary"\nmirror = "../var/mirror"\n')
    result = run_mirrord("check-config", "--config", config)
    assert result.returncode == 0, result.stderr
    assert f'primary = "{tmp_path.resolve()}/var/primary"' in result.stdout, result.stdout
    assert "/../" not in result.stdout


def test_sync_json_names_the_source_that_is_not_a_whole_checkpoint(tmp_path: Path) -> None:
    """`sync --json` with a truncated source: "ok": false and the document names the file and the cause, as
    the text mode's NOT PUBLISHED line does."""
    primary, mirror = _roots(tmp_path)
    torn = primary / "run_a" / "step_2.pt"
    save_checkpoint(torn, step=2)
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    result = run_mirrord(
        "sync", "--json", "--primary", primary, "--mirror", mirror, env={"MIRRORD_COPY__SETTLE_SECONDS": "0.2"}
    )
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] is False
    [invalid] = document["invalid"]
    assert invalid["path"] == "run_a/step_2.pt" and invalid["cause"], document


def test_output_shows_values_not_internal_reprs(tmp_path: Path) -> None:
    """Console logs show a guard's reason as `recent_mtime` (not `<Veto.RECENT_MTIME: ...>`), and the step
    pattern is printed as TOML takes it back (`'step_(\\d+)'`, not `'step_(\\\\d+)'`)."""
    primary, mirror = _roots(tmp_path)
    for step in (1, 2):
        save_checkpoint(primary / "run_a" / f"step_{step}.pt", step=step)
        os.utime(primary / "run_a" / f"step_{step}.pt")  # just written: the min-age guard keeps step 1
    assert (
        run_mirrord(
            "sync", "--primary", primary, "--mirror", mirror, env={"MIRRORD_COPY__SETTLE_SECONDS": "0.2"}
        ).returncode
        == 0
    )
    prune = run_mirrord(
        "prune",
        "--log-format",
        "console",
        "--primary",
        primary,
        "--mirror",
        mirror,
        env={"MIRRORD_PRUNE__KEEP_LAST": "1"},
    )
    assert prune.returncode == 0, prune.stderr
    assert "recent_mtime" in prune.stderr, prune.stderr
    assert "<Veto." not in prune.stderr and "Veto." not in prune.stdout
    check = run_mirrord("check-config", "--primary", primary, "--mirror", mirror)
    assert check.returncode == 0, check.stderr
    assert "'step_(\\d+)'" in check.stdout and "\\\\d" not in check.stdout, check.stdout


def test_init_systemd_prints_every_step_and_warns_about_hidden_paths(tmp_path: Path) -> None:
    """`init --systemd` names the user to create and the rights to give, and warns that a root under /tmp
    is hidden from the service by PrivateTmp= (the unit's sandbox)."""
    primary, mirror = _roots(tmp_path)
    config = tmp_path / "etc" / "mirrord.toml"
    config.parent.mkdir()
    result = run_mirrord("init", "--systemd", "--primary", primary, "--mirror", mirror, config)
    assert result.returncode == 0, result.stderr
    assert "useradd --system --user-group --no-create-home --shell /usr/sbin/nologin mirrord" in result.stdout
    assert f"chown mirrord:mirrord {mirror}" in result.stdout
    if str(tmp_path).startswith(("/tmp/", "/var/tmp/")):
        assert f"primary {primary} is under /" in result.stderr and "PrivateTmp=" in result.stderr, result.stderr


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_sync_stopped_by_a_hangup_or_term_removes_its_part_and_says_so(tmp_path: Path, gated_primary, sig: int) -> None:
    """A closed terminal (SIGHUP) or a SIGTERM mid-copy: the copy is aborted, no `.part` stays on the
    mirror, a log line says why it stopped, exit 128 + the signal. The copy is held half done at a gate
    until the command says it is cancelling it."""
    primary, mirror = gated_primary.mount_point, tmp_path / "mirror"
    mirror.mkdir()
    source = gated_primary.backing / "run_a" / "step_1.pt"
    save_checkpoint(source, step=1, megabytes=24)
    gated_primary.stall(source.name, after=16 * 2**20)
    env = child_env({"MIRRORD_COPY__SETTLE_SECONDS": "0"})
    log = tmp_path / "sync.log"
    with (
        log.open("w") as sink,
        subprocess.Popen(
            [*mirrord_argv(), "sync", "--log-format", "json", "--primary", str(primary), "--mirror", str(mirror)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            text=True,
            start_new_session=True,
        ) as proc,
    ):
        try:
            part = mirror / "run_a" / "step_1.pt.part"
            wait_for(
                lambda: (part.exists() and part.stat().st_size > 0) or proc.poll() is not None,
                60,
                "a .part on the mirror",
            )
            assert proc.poll() is None, log.read_text()
            proc.send_signal(sig)
            gated_primary.unstall_once_cancelling(log, ended=lambda: proc.poll() is not None)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    err = log.read_text()
    assert proc.returncode == 128 + sig, err
    assert not list(mirror.rglob("*.part")), sorted(mirror.rglob("*"))
    assert not (mirror / "run_a" / "step_1.pt").exists(), "the copy was finished instead of aborted"
    assert '"command.interrupted"' in err and signal.Signals(sig).name in err, err


def test_a_config_that_is_a_directory_is_called_one(tmp_path: Path) -> None:
    """`--config DIR` says it is a directory, not that another user could change it (issue 45.6)."""
    result = run_mirrord("check-config", "--config", tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"mirrord: config error: config: {tmp_path} is a directory: name the TOML file itself\n"


def test_a_failed_command_says_one_readable_line_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """Captured stderr (a pipe, a CI log) gets the error as one line, no JSON log line before it (issue 45.8);
    `--log-format json` still logs command.failed (test_startup_imports)."""
    _primary, mirror = _roots(tmp_path)
    (mirror / ".mirrord-manifest.json").write_text("{not json")
    result = run_mirrord("latest", "--mirror", mirror)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("mirrord: "), result.stderr


def test_a_quoted_number_or_boolean_in_the_file_is_refused(tmp_path: Path) -> None:
    """`keep_last = "5"` is a string: refused with the key and the fix, as `true` for a number is; the same
    text from a MIRRORD_* variable is the number (issue 45.8)."""
    primary, mirror = _roots(tmp_path)
    config = tmp_path / "mirrord.toml"
    config.write_text(f'primary = "{primary}"\nmirror = "{mirror}"\n[prune]\nkeep_last = "5"\ndry_run = "false"\n')
    result = run_mirrord("check-config", "--config", config)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"mirrord: config error: prune.{key}: {text!r} is a string, not a {kind} (in a TOML file, write it "
        f"without quotes) (in {config})"
        for key, text, kind in (("keep_last", "5", "number"), ("dry_run", "false", "boolean"))
    ]
    config.write_text(f'primary = "{primary}"\nmirror = "{mirror}"\n')
    shown = run_mirrord("check-config", "--config", config, "--format", "json", env={"MIRRORD_PRUNE__KEEP_LAST": "5"})
    assert json.loads(shown.stdout)["prune"]["keep_last"] == 5


def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_closest_flag(tmp_path: Path) -> None:
    """`prune --dry-rn`: the prune usage (not the top-level one) and `did you mean --dry-run?` (issue 45.8)."""
    result = run_mirrord("prune", "--dry-rn", "--mirror", tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: mirrord prune ")
    assert (
        result.stderr.splitlines()[-1]
        == "mirrord prune: error: unrecognized arguments: --dry-rn; did you mean --dry-run?"
    )
