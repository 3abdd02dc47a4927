"""`mirrord sync`, `verify` and `latest` as a user runs them: the console script on real torch checkpoints."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mirrord.config import Config
from mirrord.manifest import MANIFEST_NAME, Manifest
from mirrord.sync import run_sync
from tests.helpers import (
    assert_mirror_consistent,
    log_events,
    mirror_files,
    run_mirrord,
    save_checkpoint,
    sha256,
)

SMALL = {
    "runA/step_0010.pt": 10,
    "runA/step_0020.pt": 20,
    "runA/step_0030.pt": 30,
    "runB/step_0005.pt": 5,
    "runB/step_0015.pt": 15,
    "final.pt": 1,
}
BIG = "big/step_0100.pt"  # ~200 MB: a 4096x4096 layer with Adam's two moments


def _not_checkpoints(primary: Path) -> None:
    """What a trainer's directory also holds; none of it may reach the mirror."""
    (primary / "runA" / "step_0040.pt.part").write_bytes(b"in progress")
    (primary / "runA" / "step_0040.pt.tmp").write_bytes(b"in progress")
    (primary / "runA" / "notes.txt").write_text("lr=1e-3")
    (primary / "runA" / ".step_0050.pt").write_bytes(b"hidden")


@pytest.fixture
def small_tree(primary: Path) -> Path:
    for rel, step in SMALL.items():
        save_checkpoint(primary / rel, step)
    _not_checkpoints(primary)
    return primary


@pytest.fixture
def synced(small_tree: Path, mirror: Path, make_config: Callable[..., Config]) -> Path:
    """The small tree already mirrored (in-process; the subprocess runs are the ones under test)."""
    assert run_sync(make_config()).ok
    return mirror


def _lines(stdout: str) -> list[tuple[str, str]]:
    """verify's findings as (PROBLEM, path)."""
    return [(p[0], p[1]) for p in (line.split() for line in stdout.splitlines()) if len(p) >= 2]


def test_sync_mirrors_a_tree_of_real_checkpoints_including_200_mb(
    primary: Path, mirror: Path, small_tree: Path
) -> None:
    """One pass copies everything, preserving paths and mtimes; a second pass copies nothing;
    verify and latest agree with it."""
    save_checkpoint(primary / BIG, 100, width=4096, depth=1)
    assert (primary / BIG).stat().st_size > 190 * 2**20
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 0, result.stderr
    assert sorted(mirror_files(mirror)) == sorted([*SMALL, BIG])
    assert_mirror_consistent(primary, mirror)
    for rel in [*SMALL, BIG]:
        assert (mirror / rel).stat().st_mtime_ns == (primary / rel).stat().st_mtime_ns, rel
    manifest = Manifest.load(mirror)
    assert {rel: e.step for rel, e in manifest.entries.items()} == {**SMALL, "final.pt": None, BIG: 100}
    events = log_events(result.stderr)
    assert sorted(e["path"] for e in events if e["event"] == "copy.committed") == sorted([*SMALL, BIG])
    # Highest step first: the queue hands BIG out first, but with copy.workers (2 by default) threads the
    # second job's copy.started may be logged before it; BIG is among the first `workers` to start.
    started = [e["path"] for e in events if e["event"] == "copy.started"]
    assert BIG in started[:2], started

    again = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    assert again.returncode == 0, again.stderr
    [finished] = [e for e in log_events(again.stderr) if e["event"] == "sync.finished"]
    assert (finished["copied"], finished["failed"], finished["in_sync"]) == (0, 0, len(SMALL) + 1)

    verify = run_mirrord("verify", "--mirror", mirror)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout == "" and f"verified {len(SMALL) + 1} file(s)" in verify.stderr
    latest = run_mirrord("latest", "--mirror", mirror)
    assert (latest.returncode, latest.stdout) == (0, f"{mirror / BIG}\n")

    import torch

    state = torch.load(mirror / BIG, weights_only=True, mmap=True)
    assert state["step"] == 100 and len(state["optimizer"]["state"]) == 2


def test_sync_exit_1_when_a_copy_fails_and_the_rest_is_mirrored(
    primary: Path, mirror: Path, small_tree: Path
) -> None:
    """A regular file squats where the runB folder must go: runB fails, is reported by path, the rest is done."""
    (mirror / "runB").write_bytes(b"not a directory")
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 1
    failed_lines = sorted(line for line in result.stderr.splitlines() if line.startswith("FAILED "))
    assert [line.split()[1].rstrip(":") for line in failed_lines] == ["runB/step_0005.pt", "runB/step_0015.pt"]
    failures = [e for e in log_events(result.stderr) if e["event"] == "copy.failed"]
    assert sorted(e["path"] for e in failures) == ["runB/step_0005.pt", "runB/step_0015.pt"]
    assert all(e["reason"] and e["cause"] for e in failures)
    expected = sorted(rel for rel in SMALL if not rel.startswith("runB/"))
    assert sorted(rel for rel in mirror_files(mirror) if rel != "runB") == expected
    assert_mirror_consistent(primary, mirror, ignore=frozenset({"runB"}))


def test_sync_exit_2_on_a_bad_configuration_touches_nothing(tmp_path: Path, small_tree: Path) -> None:
    absent = run_mirrord("sync", "--primary", tmp_path / "absent", "--mirror", tmp_path / "m")
    nested = run_mirrord("sync", "--primary", small_tree, "--mirror", small_tree / "mirror")
    assert (absent.returncode, nested.returncode) == (2, 2)
    assert "primary" in absent.stderr and "inside primary" in nested.stderr
    assert not (tmp_path / "m").exists() and not (small_tree / "mirror").exists()


def test_sync_waits_for_a_file_written_in_place_to_settle(primary: Path, synced: Path) -> None:
    """A file modified just now is copied once it has stayed unchanged for settle_seconds (sync waits up
    to three settle periods for it)."""
    fresh = save_checkpoint(primary / "runA" / "step_0031.pt", 31, mtime_ns=time.time_ns())
    result = run_mirrord("sync", "--primary", primary, "--mirror", synced,
                         env={"MIRRORD_COPY__SETTLE_SECONDS": "0.5"})
    assert result.returncode == 0, result.stderr
    assert sha256(synced / "runA" / "step_0031.pt") == sha256(fresh)
    assert_mirror_consistent(primary, synced)


def test_sync_refuses_a_corrupt_manifest(primary: Path, synced: Path) -> None:
    """Without a readable resume record nothing is trusted: exit 1 naming the manifest, nothing copied."""
    (synced / MANIFEST_NAME).write_bytes(b'{"schema": "mirrord-manifest", "version": 1, "entr')
    save_checkpoint(primary / "runA" / "step_0040.pt", 40)
    result = run_mirrord("sync", "--primary", primary, "--mirror", synced)
    assert result.returncode == 1
    assert MANIFEST_NAME in result.stderr
    assert not (synced / "runA" / "step_0040.pt").exists()
    verify = run_mirrord("verify", "--mirror", synced)
    assert verify.returncode == 1 and MANIFEST_NAME in verify.stderr


# --- verify -----------------------------------------------------------------------------------------


def _flip_one_byte(path: Path) -> None:
    """Same size, same mtime: only the hash can tell."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [(_flip_one_byte, "HASH_MISMATCH"), (_truncate, "SIZE_MISMATCH"), (Path.unlink, "MISSING")],
    ids=["one-byte-flipped", "truncated", "deleted"],
)
def test_verify_exit_1_lists_the_damaged_file(
    synced: Path, damage: Callable[[Path], None], problem: str
) -> None:
    clean = run_mirrord("verify", "--mirror", synced)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    damage(synced / "runA" / "step_0020.pt")
    result = run_mirrord("verify", "--mirror", synced)
    assert result.returncode == 1
    assert _lines(result.stdout) == [(problem, "runA/step_0020.pt")]


def test_verify_lists_a_file_the_manifest_does_not_know(synced: Path) -> None:
    save_checkpoint(synced / "runC" / "step_0001.pt", 1)
    result = run_mirrord("verify", "--mirror", synced)
    assert result.returncode == 1
    assert _lines(result.stdout) == [("UNRECORDED", "runC/step_0001.pt")]


# --- latest -----------------------------------------------------------------------------------------


def test_latest_skips_a_truncated_newer_checkpoint(synced: Path) -> None:
    """step_0030 lost its tail on the mirror: latest offers step_0020, globally and for the run."""
    assert run_mirrord("latest", "--mirror", synced, "--run", "runA").stdout == f"{synced}/runA/step_0030.pt\n"
    _truncate(synced / "runA" / "step_0030.pt")
    for args in (("--run", "runA"), ("--run", str(synced / "runA")), ()):
        result = run_mirrord("latest", "--mirror", synced, *args)
        assert (result.returncode, result.stdout) == (0, f"{synced}/runA/step_0020.pt\n"), args
    result = run_mirrord("latest", "--mirror", synced, "--run", "runB")
    assert (result.returncode, result.stdout) == (0, f"{synced}/runB/step_0015.pt\n")


def test_latest_exit_1_when_nothing_is_intact(synced: Path, tmp_path: Path) -> None:
    for rel in ("runB/step_0005.pt", "runB/step_0015.pt"):
        _flip_one_byte(synced / rel)
    damaged = run_mirrord("latest", "--mirror", synced, "--run", "runB")
    unknown_run = run_mirrord("latest", "--mirror", synced, "--run", "runZ")
    (tmp_path / "empty").mkdir()
    empty = run_mirrord("latest", "--mirror", tmp_path / "empty")
    for result in (damaged, unknown_run, empty):
        assert (result.returncode, result.stdout) == (1, "")
        assert "no intact checkpoint" in result.stderr


def test_latest_run_outside_the_mirror_is_a_usage_error(synced: Path, tmp_path: Path) -> None:
    """--run names a folder of the mirror; anything else is bad usage (exit 2, a message, no traceback)."""
    result = run_mirrord("latest", "--mirror", synced, "--run", tmp_path / "elsewhere")
    assert (result.returncode, result.stdout) == (2, "")
    assert "--run" in result.stderr and "Traceback" not in result.stderr
