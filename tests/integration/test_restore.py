"""`mirrord restore` and mirrord.torch.restore_latest on a local mirror: real torch.save checkpoints, the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mirrord.torch import atomic_save, latest_checkpoint, restore_latest
from tests.support.cli import run_mirrord
from tests.support.config import settings, write_config
from tests.support.daemon import DaemonProcess
from tests.support.drill import DCP, HF, RETENTION, TORCH, Trainer, disaster_drill, drill_daemon, restart_drill
from tests.support.privileges import NOBODY, run_as_nobody


def _train(run: Path, steps: list[int]) -> None:
    torch.manual_seed(0)
    run.mkdir(parents=True, exist_ok=True)
    for step in steps:
        atomic_save({"step": step, "w": torch.randn(64, 64)}, run / f"step_{step:04d}.pt")
        mtime = 1_700_000_000_000_000_000 + step * 10**9
        os.utime(run / f"step_{step:04d}.pt", ns=(mtime, mtime))


@pytest.fixture
def mirrored(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Three steps of run `a` on the primary, synced to the mirror; returns (config, primary, mirror)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    primary.mkdir()
    mirror.mkdir()
    _train(primary / "a", [10, 20, 30])
    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror))
    done = run_mirrord("sync", "--config", config)
    assert done.returncode == 0, done.stderr
    return config, primary, mirror


def _flip(path: Path) -> None:
    """Flip bytes in the middle of `path`, keeping its size and times."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 2)
        data = f.read(16)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_restore_brings_back_the_newest_step_and_sync_copies_nothing_again(mirrored: tuple[Path, Path, Path]) -> None:
    """After the run folder is wiped, restore publishes the newest verified step where the trainer looks,
    identical to the mirror's copy, with its source mtime: a following sync copies nothing."""
    config, primary, mirror = mirrored
    shutil.rmtree(primary / "a")
    done = run_mirrord("restore", "--config", config)
    assert done.returncode == 0, done.stderr
    restored = primary / "a" / "step_0030.pt"
    assert done.stdout.strip() == str(restored)
    assert restored.read_bytes() == (mirror / "a" / "step_0030.pt").read_bytes()
    assert restored.stat().st_mtime_ns == 1_700_000_000_000_000_000 + 30 * 10**9
    assert torch.load(restored, weights_only=True)["step"] == 30
    assert not list((primary / "a").glob("*.part"))
    again = run_mirrord("sync", "--config", config, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["copied"] == []


def test_a_damaged_copy_is_never_published_and_the_next_newest_is_restored(mirrored: tuple[Path, Path, Path]) -> None:
    """Bytes flipped in the newest mirror copy (size and times kept): nothing published under its name,
    step 20 restored instead (exit 0, the damaged file named); with --step 30, exit 1 and nothing published."""
    config, primary, mirror = mirrored
    _flip(mirror / "a" / "step_0030.pt")
    shutil.rmtree(primary / "a")
    pinned = run_mirrord("restore", "--config", config, "--step", "30")
    assert pinned.returncode == 1
    assert "step_0030.pt" in pinned.stderr and pinned.stdout == ""
    assert not (primary / "a" / "step_0030.pt").exists()
    assert not list((primary / "a").glob("*.part"))
    done = run_mirrord("restore", "--config", config, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["relative_path"] == "a/step_0020.pt"
    assert [d["path"] for d in doc["damaged"]] == [str(mirror / "a" / "step_0030.pt")]
    assert "DAMAGED" in done.stderr and "step_0030.pt" in done.stderr
    assert sorted(p.name for p in (primary / "a").iterdir()) == ["step_0020.pt"]


def test_an_identical_file_is_left_alone_and_a_different_one_needs_force(mirrored: tuple[Path, Path, Path]) -> None:
    """An identical file at the destination: exit 0, "already there", untouched (same inode). A different
    one: exit 1, untouched; with --force it is replaced by the mirror's copy."""
    config, primary, mirror = mirrored
    target = primary / "a" / "step_0030.pt"
    inode = target.stat().st_ino
    same = run_mirrord("restore", "--config", config)
    assert same.returncode == 0, same.stderr
    assert "already there" in same.stderr and target.stat().st_ino == inode
    target.write_bytes(b"not the checkpoint")
    refused = run_mirrord("restore", "--config", config)
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert target.read_bytes() == b"not the checkpoint"
    forced = run_mirrord("restore", "--config", config, "--force")
    assert forced.returncode == 0, forced.stderr
    assert target.read_bytes() == (mirror / "a" / "step_0030.pt").read_bytes()


def test_restore_to_another_folder_and_by_run(mirrored: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """--to DIR restores below DIR at the same relative path; --run picks the run."""
    config, _primary, mirror = mirrored
    done = run_mirrord("restore", "--config", config, "--run", "a", "--to", tmp_path / "elsewhere")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "elsewhere" / "a" / "step_0030.pt").read_bytes() == (mirror / "a" / "step_0030.pt").read_bytes()
    missing = run_mirrord("restore", "--config", config, "--run", "b", "--to", tmp_path / "x")
    assert missing.returncode == 1 and "no run 'b' on the mirror; its runs: 'a'" in missing.stderr
    (tmp_path / "file").write_text("")
    blocked = run_mirrord("restore", "--config", config, "--to", tmp_path / "file")
    assert blocked.returncode == 1 and "Traceback" not in blocked.stderr
    assert f"{tmp_path / 'file' / 'a' / 'step_0030.pt'}: restore:" in blocked.stderr


def test_restore_latest_and_latest_checkpoint_from_python(mirrored: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """restore_latest returns the restored path; latest_checkpoint refuses, with a sentence, what it cannot
    answer (a missing root, a run folder of a mirror, an s3:// URL) and returns None for an empty root."""
    _config, _primary, mirror = mirrored
    dest = tmp_path / "resume"
    assert restore_latest(mirror, dest) == dest / "a" / "step_0030.pt"
    assert restore_latest(mirror, dest, run="a") == dest / "a" / "step_0030.pt"  # already there
    assert latest_checkpoint(mirror) == mirror / "a" / "step_0030.pt"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        latest_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"run folder of the mirror {mirror}"):
        latest_checkpoint(mirror / "a")
    with pytest.raises(ValueError, match="restore_latest"):
        latest_checkpoint("s3://bucket/prefix")
    (tmp_path / "empty").mkdir()
    assert latest_checkpoint(tmp_path / "empty") is None
    assert restore_latest(tmp_path / "empty", dest) is None


def _cli_as_nobody(*argv: str, warm: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """`mirrord ARGV` run in a forked child that dropped root for uid/gid 65534: (exit status, stdout, stderr).
    The command (or `warm`) first runs as root in this process: only where its result does not depend on it."""
    import contextlib
    import io

    from mirrord.cli import main

    def run(args: tuple[str, ...] = argv) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
        return code, out.getvalue(), err.getvalue()

    # The child cannot read the interpreter's own modules (they live where 65534 cannot read): every module
    # the command imports is loaded here first, by the same command run as root (the callers make that safe).
    run(warm or argv)
    outcome = run_as_nobody(run)
    assert "value" in outcome, outcome["text"]
    code, out, err = outcome["value"]
    return int(code), str(out), str(err)


READ_ONLY_COMMANDS = (["latest"], ["verify"], ["prune", "--dry-run"], ["check-config"], ["status", "--timeout", "0.1"])


def test_a_group_reader_runs_every_read_only_command(mirrored: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A non-root user in the mirror's group (0750 folders, 0640 files) runs latest, verify, prune --dry-run,
    check-config, status and restore; sync and prune say they need write access (exit 2)."""
    config, _primary, mirror = mirrored
    for path in [mirror, *mirror.rglob("*")]:
        os.chown(path, 0, NOBODY)
        path.chmod(0o750 if path.is_dir() else 0o640)
    for folder in [tmp_path, *tmp_path.parents]:
        if folder.stat().st_mode & 0o005 != 0o005:
            folder.chmod(folder.stat().st_mode | 0o005)  # the way down to the mirror and the config
    for argv in READ_ONLY_COMMANDS:
        code, _out, err = _cli_as_nobody(*argv, "--config", str(config))
        assert "not writable" not in err, (argv, err)
        assert code == 0 or argv[0] == "status", (argv, err)  # status: exit 1 only for "no daemon answers"
    dest = tmp_path / "restored"
    dest.mkdir()
    os.chown(dest, NOBODY, NOBODY)
    code, _out, err = _cli_as_nobody(
        "restore",
        "--config",
        str(config),
        "--to",
        str(dest),
        warm=("restore", "--config", str(config), "--to", str(tmp_path / "warm")),
    )
    assert code == 0, err
    assert (dest / "a" / "step_0030.pt").read_bytes() == (mirror / "a" / "step_0030.pt").read_bytes()
    for argv in (["sync"], ["prune"]):
        code, _out, err = _cli_as_nobody(*argv, "--config", str(config), warm=("latest", "--config", str(config)))
        assert code == 2 and "not writable" in err, (argv, err)


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_read_only_bind_mount_touches_the_host(mirrored: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """TOUCHES THE HOST: bind-mounts the mirror read-only (root). latest, verify, prune --dry-run and restore
    read it; sync says it needs write access."""
    _config, primary, mirror = mirrored
    view = tmp_path / "ro-mirror"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(mirror), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        ro_config = write_config(tmp_path / "ro.toml", settings(primary, view))
        for argv in READ_ONLY_COMMANDS[:4]:
            done = run_mirrord(*argv, "--config", ro_config)
            assert done.returncode == 0, (argv, done.stderr)
        shutil.rmtree(primary / "a")
        done = run_mirrord("restore", "--config", ro_config)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(primary / "a" / "step_0030.pt")
        refused = run_mirrord("sync", "--config", ro_config)
        assert refused.returncode == 2 and "not writable" in refused.stderr
    finally:
        subprocess.run(["umount", str(view)], check=True)


@pytest.mark.trainers  # the trainer scripts are named in tests/support/drill.py, not here
@pytest.mark.parametrize("trainer", [TORCH, HF, DCP], ids=lambda t: t.layout)
def test_disaster_drill_on_a_local_mirror(tmp_path: Path, trainer: Trainer) -> None:
    """Per layout (torch.save files, transformers Trainer folders, torch.distributed.checkpoint folders): train
    with the daemon, wipe the run folder mid-run: the mirror's verified units never drop (counted every 50 ms);
    restore, resume with the library's own call: the losses equal an uninterrupted run's; the daemon mirrors
    the new steps and copies no old unit again."""
    from mirrord.store.volume import LocalVolume

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    mirror.mkdir()
    daemon = drill_daemon(tmp_path, trainer, primary, mirror)
    figures = disaster_drill(tmp_path, trainer, daemon, primary, LocalVolume(mirror))
    print(f"drill figures ({trainer.layout}, local):", figures)


@pytest.mark.trainers
def test_a_restart_from_scratch_in_the_wiped_run_folder_keeps_the_old_tip(tmp_path: Path) -> None:
    """The daemon running with keep_last 2: the run folder wiped after step 8, the job restarted from step 0 in
    the same folder (steps 2, 4, 6): the old run's step 8 stays on the mirror and restores, byte for byte."""
    from mirrord.store.volume import LocalVolume

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    mirror.mkdir()
    daemon = drill_daemon(tmp_path, TORCH, primary, mirror, RETENTION)
    figures = restart_drill(tmp_path, TORCH, daemon, primary, LocalVolume(mirror))
    print("restart drill figures (torch, local):", figures)


def test_a_folder_unit_is_restored_whole(tmp_path: Path) -> None:
    """layout = "hf": the newest checkpoint folder comes back whole (every file, each with its source mtime);
    a damaged file in it makes the whole folder pass over to the one before, and nothing of it is published."""
    from tests.support.folders import write_hf

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    mirror.mkdir()
    for step in (10, 20):
        write_hf(primary / "run" / f"checkpoint-{step}", step)
    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror, {"layout": "hf"}))
    assert run_mirrord("sync", "--config", config).returncode == 0
    originals = {
        p.relative_to(primary).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in primary.rglob("*")
        if p.is_file()
    }
    shutil.rmtree(primary / "run")
    done = run_mirrord("restore", "--config", config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(primary / "run" / "checkpoint-20")
    restored = {
        p.relative_to(primary).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in primary.rglob("*")
        if p.is_file()
    }
    assert restored == {k: v for k, v in originals.items() if "checkpoint-20" in k}
    assert json.loads(run_mirrord("sync", "--json", "--config", config).stdout)["copied"] == []

    _flip(next((mirror / "run" / "checkpoint-20").glob("*.safetensors")))
    done = run_mirrord("restore", "--config", config, "--to", tmp_path / "again")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "again" / "run" / "checkpoint-10")
    assert sorted(p.name for p in (tmp_path / "again" / "run").iterdir()) == ["checkpoint-10"]


def _strace_mirrord(
    watched: Path, *argv: str | Path, inject: str = "", max_file_bytes: int = 0
) -> tuple[subprocess.CompletedProcess[str], int]:
    """`mirrord ARGV` under strace, which sees only the calls on `watched` (-P) and, with `inject`, fails them;
    `max_file_bytes`: no file it writes may grow past that (prlimit: a destination that fills).
    Returns (the finished command, bytes it read from `watched`)."""
    from tests.support.cli import child_env, mirrord_argv

    log = watched.parent.parent.parent / "strace.log"
    tracing = ["strace", "-f", "-qq", "-o", str(log), "-P", str(watched), "-e", "trace=read,readv,pread64,preadv"]
    limit = ["prlimit", f"--fsize={max_file_bytes}"] if max_file_bytes else []
    done = subprocess.run(
        [*tracing, *(["-e", f"inject={inject}"] if inject else []), *limit, *mirrord_argv(), *map(str, argv)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
        check=False,
    )
    returns = [line.rpartition("= ")[2].split()[0] for line in log.read_text().splitlines() if "= " in line]
    return done, sum(int(r) for r in returns if r.isdigit())


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_copy_that_grew_is_never_read_past_its_recorded_size(mirrored: tuple[Path, Path, Path]) -> None:
    """Issue 41 case 3: the verified newest copy grown to 2 GiB (a sparse truncate; the issue's was 8 GiB).
    `latest` names step 20 and restore brings it back, both having read no byte of the grown file (its stored
    size is compared with the record first); restore names the mirror file and its size. Its destination
    takes no file past 1 MiB (prlimit), as a disk the grown bytes would fill: the intact step 20 still comes
    back (writing the grown bytes first, restore exited 1 there)."""
    config, primary, mirror = mirrored
    grown = mirror / "a" / "step_0030.pt"
    recorded = grown.stat().st_size
    os.truncate(grown, 2 << 30)
    latest, read = _strace_mirrord(grown, "latest", "--config", config)
    assert (latest.returncode, latest.stdout.strip(), read) == (0, str(mirror / "a" / "step_0020.pt"), 0), latest.stderr
    shutil.rmtree(primary / "a")
    done, read = _strace_mirrord(grown, "restore", "--config", config, max_file_bytes=1 << 20)
    assert done.returncode == 0, done.stderr
    assert read == 0
    assert done.stdout.strip() == str(primary / "a" / "step_0020.pt")
    assert f"DAMAGED {grown}: {2 << 30} bytes on the mirror, recorded {recorded}" in done.stderr
    assert sorted(p.name for p in (primary / "a").iterdir()) == ["step_0020.pt"]
    assert (primary / "a" / "step_0020.pt").read_bytes() == (mirror / "a" / "step_0020.pt").read_bytes()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder", "EIO", "EACCES"])
def test_restore_falls_back_past_a_newest_copy_it_cannot_read(mirrored: tuple[Path, Path, Path], kind: str) -> None:
    """Issue 41 case 6: the newest mirror copy replaced by a symlink, a FIFO or a folder, or failing its reads
    with EIO or EACCES (an NFS or FUSE mirror; strace injects them on that file alone): restore exits 0 with step 20,
    and the DAMAGED line names the mirror file, never the destination."""
    config, primary, mirror = mirrored
    newest = mirror / "a" / "step_0030.pt"
    if kind in ("symlink", "fifo", "folder"):
        newest.unlink()
        {"symlink": lambda: newest.symlink_to("step_0020.pt"), "fifo": lambda: os.mkfifo(newest)}.get(
            kind, newest.mkdir
        )()
    shutil.rmtree(primary / "a")
    if kind in ("EIO", "EACCES"):
        if shutil.which("strace") is None:
            pytest.skip("needs strace")
        done, _read = _strace_mirrord(newest, "restore", "--config", config, inject=f"read:error={kind}")
    else:
        done = run_mirrord("restore", "--config", config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(primary / "a" / "step_0020.pt")
    damaged = [line for line in done.stderr.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and damaged[0].startswith(f"DAMAGED {newest}: "), done.stderr
    assert str(primary) not in damaged[0]
    assert sorted(p.name for p in (primary / "a").iterdir()) == ["step_0020.pt"]


def test_restore_keeps_the_mirror_copys_modes_and_the_manifest_is_private(tmp_path: Path) -> None:
    """Issue 41 case 2: 0700 run folders with 0600 checkpoints (files of run `a`; an hf folder unit, restored
    through a staging folder), mirrored and restored under umask 022, are 0700/0600 again; the manifest
    (snapshot and journal) is 0600 in a 0700 mirror root and 0640 in a 0750 one (the read-only group of
    docs/security.md reads it), never readable by others."""
    from tests.support.folders import write_hf

    old_umask = os.umask(0o022)
    try:
        files, folders = tmp_path / "files", tmp_path / "folders"
        _train(files / "a", [10, 20])
        write_hf(folders / "run" / "checkpoint-10", 10)
        for path in [*files.rglob("*"), *folders.rglob("*")]:
            path.chmod(0o700 if path.is_dir() else 0o600)
        configs = {}
        for primary, mirror, mode, extra in (
            (files, tmp_path / "private", 0o600, {}),
            (files, tmp_path / "grouped", 0o640, {}),
            (folders, tmp_path / "hf-mirror", 0o600, {"layout": "hf"}),
        ):
            mirror.mkdir(mode=0o700 if mode == 0o600 else 0o750)
            configs[mirror.name] = write_config(tmp_path / f"{mirror.name}.toml", settings(primary, mirror, extra))
            assert run_mirrord("sync", "--config", configs[mirror.name]).returncode == 0
            manifest = list(mirror.glob(".mirrord-manifest*"))
            assert manifest and {p.name: p.stat().st_mode & 0o777 for p in manifest} == {p.name: mode for p in manifest}
        shutil.rmtree(files)
        shutil.rmtree(folders)
        for name in ("private", "hf-mirror"):
            done = run_mirrord("restore", "--config", configs[name])
            assert done.returncode == 0, done.stderr
        restored = [*files.rglob("*"), *(folders / "run").rglob("*"), folders / "run"]
        assert (
            files / "a" / "step_0020.pt" in restored
            and folders / "run" / "checkpoint-10" / "trainer_state.json" in restored
        )
        assert {p: p.stat().st_mode & 0o777 for p in restored} == {p: 0o700 if p.is_dir() else 0o600 for p in restored}
    finally:
        os.umask(old_umask)


def test_restore_plans_again_when_retention_retires_the_unit_it_chose(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Issue 41 case 7: a daemon with keep_last = 1 while the trainer saves every 0.3 s. Each of three restores
    is held just after it read the manifest until the daemon has retired every unit that manifest names (the
    race the issue saw in one restore in 20, made certain): the unit it planned is gone from the mirror and from
    the manifest, which is not DAMAGED; restore reads the manifest again and brings back a newer step, whole."""
    from mirrord.store.manifest import Manifest
    from mirrord.store.restore import restore
    from mirrord.store.resume import recorded_candidates
    from mirrord.store.volume import LocalVolume
    from tests.support.checkpoints import publish_checkpoint
    from tests.support.wait import wait_for

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    saving = threading.Event()

    def trainer() -> None:
        step = 0
        while not saving.wait(0.3):
            step += 1
            publish_checkpoint(primary / "a" / f"step_{step:04d}.pt", step)

    class RetiredWhileRestoring(LocalVolume):
        planned: Manifest | None = None

        def load_manifest(self) -> Manifest:
            if self.planned is not None:
                return super().load_manifest()
            self.planned = planned = super().load_manifest()
            wait_for(
                lambda: not any((mirror / key).exists() for key in planned.entries), 60, "the planned unit retired"
            )
            return planned

    training = threading.Thread(target=trainer)
    training.start()
    try:
        daemon = daemon_factory({"prune": {"enabled": True, "keep_last": 1, "min_age_seconds": 0}}).start()
        wait_for(lambda: recorded_candidates(LocalVolume(mirror).load_manifest()), 60, "a first step verified")
        for attempt in range(3):
            volume = RetiredWhileRestoring(mirror)
            restored = restore(volume, tmp_path / f"resume-{attempt}")
            assert restored.damaged == () and volume.planned and restored.key not in volume.planned.entries
            assert torch.load(restored.path, weights_only=True)["step"] == restored.step
    finally:
        saving.set()
        training.join()
    assert daemon.stop() == 0


def test_restore_without_a_run_refuses_among_several_and_names_them(mirrored: tuple[Path, Path, Path]) -> None:
    """Issue 41 case 8 and issue 45 item 5: with runs a and b on the mirror, restore without a run refuses and
    lists both (CLI: exit 1; restore_latest: WhichRunError, a ValueError); a run the mirror does not hold is an
    error listing the runs; a run folder given as the mirror gets the call to make instead, not None."""
    config, primary, mirror = mirrored
    _train(primary / "b", [5])
    assert run_mirrord("sync", "--config", config).returncode == 0
    dest = primary.parent / "resume"
    refused = run_mirrord("restore", "--config", config, "--to", dest)
    assert refused.returncode == 1 and "2 runs on the mirror ('a', 'b'): name the one" in refused.stderr
    assert not dest.exists() or not any(dest.iterdir())
    with pytest.raises(ValueError, match=r"\('a', 'b'\)"):
        restore_latest(mirror, dest)
    with pytest.raises(ValueError, match="no run 'c' on the mirror; its runs: 'a', 'b'"):
        restore_latest(mirror, dest, run="c")
    with pytest.raises(
        ValueError, match=rf"run folder of the mirror {mirror}: .*restore_latest\('{mirror}', dest, run='a'\)"
    ):
        restore_latest(mirror / "a", dest)
    assert restore_latest(mirror, dest, run="b") == dest / "b" / "step_0005.pt"


def test_restore_escapes_terminal_sequences_in_names(tmp_path: Path) -> None:
    """Issue 41 case 9: a run folder named with OSC and CSI sequences reaches restore's "DAMAGED" and
    "restored ... from ..." lines, and in the error line of a damaged --step, escaped (\\x1b), as the other
    commands print names."""
    hostile = "\x1b]0;owned\x07run\x1b[2J"
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    mirror.mkdir()
    _train(primary / hostile, [10, 20])
    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror))
    assert run_mirrord("sync", "--config", config).returncode == 0
    _flip(mirror / hostile / "step_0020.pt")
    done = run_mirrord("restore", "--config", config, "--to", tmp_path / "resume")
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["DAMAGED", "restored"], lines
    assert all("\\x1b]0;owned\\x07run\\x1b[2J" in line for line in lines), lines
    pinned = run_mirrord("restore", "--config", config, "--step", "20", "--to", tmp_path / "pinned")
    assert pinned.returncode == 1 and "\x1b" not in pinned.stderr and "\\x1b]0;owned" in pinned.stderr


def test_the_files_a_resume_reads_point_at_the_checkpoint_restored(tmp_path: Path) -> None:
    """DeepSpeed global_step2/ and 4/ with `latest` naming 4, mirrored; the mirror's step 4 damaged: restore with
    no config falls back to step 2 and writes `latest` naming global_step2 (not the damaged 4). Lightning files
    with `last.ckpt`, private (0600): restored beside step 4 as a private copy of it; a `last.ckpt` already at
    the destination (it may be newer than the mirror's) is left alone, and replaced with --force."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "pl").mkdir(parents=True)
    mirror.mkdir()
    for step in (2, 4):
        (primary / "ds" / f"global_step{step}").mkdir(parents=True)
        torch.save({"step": step}, primary / "ds" / f"global_step{step}" / "mp_rank_00_model_states.pt")
        torch.save({"step": step}, primary / "pl" / f"epoch={step // 2 - 1}-step={step}.ckpt")
    (primary / "ds" / "latest").write_text("global_step4")
    torch.save({"step": 4, "last": True}, primary / "pl" / "last.ckpt")
    for private in (primary / "pl").iterdir():
        private.chmod(0o600)
    for layout, run in (("deepspeed", "ds"), ("lightning", "pl")):
        config = write_config(tmp_path / f"{run}.toml", settings(primary / run, mirror / run, {"layout": layout}))
        assert run_mirrord("sync", "--config", config).returncode == 0
    with (mirror / "ds" / "global_step4" / "mp_rank_00_model_states.pt").open("r+b") as f:
        f.seek(100)
        f.write(b"\xff")  # the same size, other bytes
    shutil.rmtree(primary)

    done = run_mirrord("restore", "--mirror", mirror / "ds", "--to", tmp_path / "ds")
    assert done.returncode == 0 and "DAMAGED" in done.stderr, done.stderr
    assert done.stdout.strip() == str(tmp_path / "ds" / "global_step2")
    assert (tmp_path / "ds" / "latest").read_text() == "global_step2"

    step4 = (mirror / "pl" / "epoch=1-step=4.ckpt").read_bytes()
    assert run_mirrord("restore", "--mirror", mirror / "pl", "--to", tmp_path / "pl").returncode == 0
    assert (tmp_path / "pl" / "last.ckpt").read_bytes() == step4
    assert (tmp_path / "pl" / "last.ckpt").stat().st_mode & 0o777 == 0o600  # a copy of a private checkpoint
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "last.ckpt").write_bytes(b"newer")
    assert run_mirrord("restore", "--mirror", mirror / "pl", "--to", taken).returncode == 0
    assert (taken / "last.ckpt").read_bytes() == b"newer"
    assert run_mirrord("restore", "--mirror", mirror / "pl", "--to", taken, "--force").returncode == 0
    assert (taken / "last.ckpt").read_bytes() == step4
