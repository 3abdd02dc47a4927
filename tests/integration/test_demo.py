"""`mirrord demo`: the real command, a real daemon child, real checkpoints; it must end in the promised state."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mirrord.commands.banner import mirrord_command
from mirrord.formats.zipcheck import check_torch_zip
from mirrord.store.manifest import Manifest
from tests.support.cli import mirrord_argv, run_mirrord
from tests.support.logs import parse_events
from tests.support.mirror import assert_mirror_consistent
from tests.support.wait import wait_for

RUN = "demo-run"


def steps_on(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in (root / RUN).iterdir() if (m := re.fullmatch(r"step_(\d+)\.pt", p.name)))


def daemon_log(directory: Path) -> list[dict[str, Any]]:
    return parse_events((directory / "mirrord.log").read_text())


def metrics_port(directory: Path) -> int:
    match = re.search(r'address = "127\.0\.0\.1:(\d+)"', (directory / "mirrord.toml").read_text())
    assert match
    return int(match.group(1))


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def assert_demo_daemon_stopped(out: str, directory: Path) -> None:
    """The demo said its daemon stopped cleanly, the daemon logged it, and nothing listens any more."""
    assert "The demo daemon stopped (exit 0)" in out
    assert any(e["event"] == "daemon.stopped" for e in daemon_log(directory))
    assert not listening(metrics_port(directory))


def demo(directory: Path, *args: str) -> Any:
    return run_mirrord("demo", "--dir", directory, *args, timeout=300)


def test_short_demo_mirrors_prunes_and_leaves_keep_last_on_both_sides(tmp_path) -> None:
    """5 torch checkpoints, keep_last 3: both sides end with steps 3-5, intact; 1 and 2 pruned on both."""
    import torch

    directory = tmp_path / "demo"
    result = demo(directory, "--steps", "5", "--interval", "0.3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout

    primary, mirror = directory / "primary", directory / "mirror"
    assert steps_on(primary) == steps_on(mirror) == [3, 4, 5]
    assert sorted(Manifest.load(mirror).entries) == [f"{RUN}/step_{s:04d}.pt" for s in (3, 4, 5)]
    assert_mirror_consistent(primary, mirror)  # byte-identical, digests as recorded, no NAME.part

    deleted = {(e["volume"], e["path"]) for e in daemon_log(directory) if e["event"] == "prune.deleted"}
    assert deleted == {(v, f"{RUN}/step_{s:04d}.pt") for v in ("primary", "mirror") for s in (1, 2)}
    loaded = torch.load(mirror / RUN / "step_0005.pt", weights_only=True)
    assert loaded["step"] == 5 and loaded["model"]

    for step in range(1, 6):
        assert f"trainer  committed {RUN}/step_{step:04d}.pt" in out
        assert f"mirrored  {RUN}/step_{step:04d}.pt" in out
    assert "(torch.save, .part -> rename)" in out
    assert f"pruned    {RUN}/step_0001.pt on the mirror" in out
    assert f"pruned    {RUN}/step_0001.pt on the primary" in out
    assert "Both sides hold steps 3, 4, 5 of demo-run." in out
    # Where things are, then the status of the still-running daemon.
    for where in (str(primary), str(mirror), str(directory / "mirrord.toml"), "/metrics"):
        assert where in out
    status = out[out.index(f"$ {mirrord_command()} status") :]
    assert "intact (size checked)" in status and "caught up" in status
    assert "healthy, ready" in status and "copies since start: 5 ok" in status
    assert "problems: none" in status
    # The daemon was stopped cleanly and nothing listens any more.
    assert_demo_daemon_stopped(out, directory)


def test_demo_without_torch_writes_torch_like_zips_and_can_run_again(tmp_path) -> None:
    """--no-torch checkpoints pass the zip CRC check; a second demo in the same DIR starts afresh."""
    directory = tmp_path / "demo"
    first = demo(directory, "--steps", "3", "--interval", "0.2", "--keep-last", "2", "--no-torch")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "(zip, .part -> rename)" in first.stdout
    assert steps_on(directory / "primary") == steps_on(directory / "mirror") == [2, 3]
    for step in (2, 3):
        assert check_torch_zip(directory / "mirror" / RUN / f"step_{step:04d}.pt").status == "ok"

    second = demo(directory, "--steps", "2", "--interval", "0.2", "--keep-last", "2", "--no-torch")
    assert second.returncode == 0, second.stdout + second.stderr
    assert steps_on(directory / "primary") == steps_on(directory / "mirror") == [1, 2]
    assert_mirror_consistent(directory / "primary", directory / "mirror")
    verify = run_mirrord("verify", "--deep", "--config", directory / "mirrord.toml")
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize(
    ("signum", "inherited"),
    [
        (signal.SIGINT, "default"),
        (signal.SIGINT, "ignored"),  # a background job of a script: the shell starts it with SIGINT ignored
        (signal.SIGTERM, "default"),
    ],
)
def test_ctrl_c_stops_the_demo_and_its_daemon(tmp_path, signum: int, inherited: str) -> None:
    """SIGINT to the demo (as Ctrl-C sends it) or SIGTERM ends it with 130, and the daemon child is
    stopped cleanly, also when the demo was started with SIGINT ignored (whatever pytest inherited)."""
    directory, out_path = tmp_path / "demo", tmp_path / "demo.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    argv = [*mirrord_argv(), "demo", "--dir", str(directory), "--no-torch", "--interval", "30"]
    if inherited == "ignored":
        argv = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]
    with out_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(lambda: "committed demo-run/step_0001.pt" in out_path.read_text(), 120, "first commit")
        proc.send_signal(signum)
        assert proc.wait(timeout=90) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out_path.read_text()
    assert "interrupted: stopping the demo daemon" in text
    assert_demo_daemon_stopped(text, directory)


def test_demo_refuses_a_directory_it_did_not_make(tmp_path) -> None:
    """A non-empty directory without the demo's marker is never wiped: exit 2, untouched."""
    directory = tmp_path / "precious"
    directory.mkdir()
    (directory / "notes.txt").write_text("keep me")
    result = demo(directory, "--steps", "1")
    assert result.returncode == 2
    assert "is not empty and was not made by `mirrord demo`" in result.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("flag", ["--primary", "--mirror"])
def test_demo_rejects_root_flags(tmp_path, flag: str) -> None:
    """The demo's roots are DIR/primary and DIR/mirror; another root flag is a usage error, not ignored."""
    result = demo(tmp_path / "demo", flag, str(tmp_path / "elsewhere"))
    assert result.returncode == 2
    assert "choose DIR with --dir" in result.stderr
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--interval", "0"], ["--interval", "-1"]])
def test_demo_rejects_bad_numbers(tmp_path, bad: list[str]) -> None:
    result = demo(tmp_path / "demo", *bad)
    assert result.returncode == 2
    assert "must be" in result.stderr


def test_help_lists_status_and_demo_with_their_options() -> None:
    """`mirrord --help` names both commands; each one's help documents every option."""
    top = run_mirrord("--help")
    assert top.returncode == 0 and "status" in top.stdout and "demo" in top.stdout
    demo_help = run_mirrord("demo", "--help")
    assert demo_help.returncode == 0
    for text in ("--dir", "--steps", "--interval", "--keep-last", "--no-torch", "./var/demo"):
        assert text in demo_help.stdout, text


def test_demo_config_is_a_valid_mirrord_config(tmp_path) -> None:
    """The config the demo leaves behind passes check-config, so `mirrord run --config` can reuse it.

    The demo reads no configuration: a --config naming no file is ignored (and said to be), not an error.
    """
    directory = tmp_path / "demo"
    result = demo(directory, "--steps", "1", "--interval", "0.1", "--no-torch", "--config", tmp_path / "nope.toml")
    assert result.returncode == 0, result.stderr
    assert f"--config {tmp_path / 'nope.toml'} is ignored" in result.stderr
    checked = run_mirrord("check-config", "--config", directory / "mirrord.toml", "--format", "json")
    assert checked.returncode == 0, checked.stderr
    effective = json.loads(checked.stdout)
    assert effective["prune"]["keep_last"] == 3 and effective["prune"]["primary"] is True
    assert effective["prune"]["enabled"] is True
    assert effective["primary"] == str((directory / "primary").resolve())
