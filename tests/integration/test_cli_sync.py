"""`mirrord sync`, `verify` and `latest` as a user runs them: the console script on real torch checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mirrord.commands.sync import run_sync
from mirrord.config import Config
from mirrord.store.manifest import MANIFEST_NAME, Manifest
from tests.support.checkpoints import save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.logs import parse_events
from tests.support.mirror import assert_mirror_consistent, mirror_files, sha256

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
    """verify's findings as (PROBLEM, path): its stdout without the summary line that ends it."""
    return [(p[0], p[1]) for p in (line.split() for line in stdout.splitlines()) if len(p) >= 2 and p[0] != "verified"]


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
    events = parse_events(result.stderr)
    assert sorted(e["path"] for e in events if e["event"] == "copy.committed") == sorted([*SMALL, BIG])
    # Highest step first: BIG is the first job handed out, so among the first two starts (two workers log
    # copy.started in whatever order the scheduler runs them).
    assert BIG in [e["path"] for e in events if e["event"] == "copy.started"][:2]

    again = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    assert again.returncode == 0, again.stderr
    [finished] = [e for e in parse_events(again.stderr) if e["event"] == "sync.finished"]
    assert (finished["copied"], finished["failed"], finished["in_sync"]) == (0, 0, len(SMALL) + 1)

    verify = run_mirrord("verify", "--mirror", mirror)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"verified {len(SMALL) + 1} file(s)" in verify.stdout  # the summary is the result: stdout
    latest = run_mirrord("latest", "--mirror", mirror)
    assert (latest.returncode, latest.stdout) == (0, f"{mirror / BIG}\n")

    import torch

    state = torch.load(mirror / BIG, weights_only=True, mmap=True)
    assert state["step"] == 100 and len(state["optimizer"]["state"]) == 2


def test_sync_exit_1_when_a_copy_fails_and_the_rest_is_mirrored(primary: Path, mirror: Path, small_tree: Path) -> None:
    """A regular file squats where the runB folder must go: runB fails, is reported by path, the rest is done."""
    (mirror / "runB").write_bytes(b"not a directory")
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 1
    failed_lines = sorted(line for line in result.stderr.splitlines() if line.startswith("FAILED "))
    assert [line.split()[1].rstrip(":") for line in failed_lines] == ["runB/step_0005.pt", "runB/step_0015.pt"]
    failures = [e for e in parse_events(result.stderr) if e["event"] == "copy.failed"]
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
    result = run_mirrord("sync", "--primary", primary, "--mirror", synced, env={"MIRRORD_COPY__SETTLE_SECONDS": "0.5"})
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
def test_verify_exit_1_lists_the_damaged_file(synced: Path, damage: Callable[[Path], None], problem: str) -> None:
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


# --- errors a new user meets ------------------------------------------------------------------------


def test_verify_and_latest_on_a_mirror_that_does_not_exist_exit_2_naming_it(tmp_path: Path) -> None:
    """A mistyped --mirror is bad usage: one line naming the path, exit 2; nothing is created there."""
    absent = tmp_path / "nonexistent"
    for command in ("verify", "latest"):
        result = run_mirrord(command, "--mirror", absent)
        assert (result.returncode, result.stdout) == (2, ""), (command, result.stderr)
        assert f"{absent} does not exist" in result.stderr and "Traceback" not in result.stderr
        assert "verified" not in result.stderr  # not "verified 0 file(s): -1 ok, 1 problem(s)"
    assert not absent.exists()


def _without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import torch` fails as if torch were not installed (a sitecustomize
    on PYTHONPATH puts a finder first that says there is no such module)."""
    shim = tmp_path / "no-torch"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _NoTorch())\n"
    )
    return {"PYTHONPATH": str(shim)}


def test_verify_load_without_torch_says_how_to_install_it(synced: Path, tmp_path: Path) -> None:
    env = _without_torch(tmp_path)
    probe = run_mirrord("verify", "--deep", "--mirror", synced, env=env)  # --deep needs no torch
    assert probe.returncode == 0, probe.stderr
    result = run_mirrord("verify", "--load", "--mirror", synced, env=env)
    assert (result.returncode, result.stdout) == (2, "")
    assert "pip install 'mirrord[torch]'" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert run_mirrord("verify", "--load", "--mirror", synced).returncode == 0  # with torch: all intact


# --- --json -----------------------------------------------------------------------------------------


def _json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """stdout must be exactly one JSON document."""
    document: dict[str, Any] = json.loads(result.stdout)
    assert document["ok"] is (result.returncode == 0)
    assert document["version"] and document["command"]
    return document


def test_sync_json_lists_copied_failed_and_in_sync(primary: Path, mirror: Path, small_tree: Path) -> None:
    (mirror / "runB").write_bytes(b"not a directory")
    result = run_mirrord("sync", "--json", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 1
    doc = _json(result)
    assert doc["command"] == "sync"
    assert doc["copied"] == sorted(rel for rel in SMALL if not rel.startswith("runB/"))
    assert [f["path"] for f in doc["failed"]] == ["runB/step_0005.pt", "runB/step_0015.pt"]
    assert all(f["error"] for f in doc["failed"])
    (mirror / "runB").unlink()
    again = _json(run_mirrord("sync", "--json", "--primary", primary, "--mirror", mirror))
    assert (again["ok"], again["copied"], again["failed"], again["in_sync"]) == (
        True,
        ["runB/step_0005.pt", "runB/step_0015.pt"],
        [],
        len(SMALL) - 2,
    )


def test_verify_json_counts_intact_files_and_lists_problems(synced: Path) -> None:
    clean = _json(run_mirrord("verify", "--json", "--mirror", synced))
    assert (clean["command"], clean["ok"], clean["checked"], clean["intact"], clean["problems"]) == (
        "verify",
        True,
        len(SMALL),
        len(SMALL),
        [],
    )
    _flip_one_byte(synced / "runA" / "step_0020.pt")
    save_checkpoint(synced / "runC" / "step_0001.pt", 1)
    result = run_mirrord("verify", "--json", "--deep", "--mirror", synced)
    assert result.returncode == 1
    doc = _json(result)
    assert (doc["checked"], doc["intact"], doc["deep"], doc["mirror"]) == (
        len(SMALL),
        len(SMALL) - 1,
        True,
        str(synced),
    )
    assert sorted((p["problem"], p["path"]) for p in doc["problems"]) == [
        ("hash_mismatch", "runA/step_0020.pt"),
        ("unrecorded", "runC/step_0001.pt"),
    ]
    assert "verified 6 file(s): 5 intact, 2 problem(s)" in result.stderr


def test_latest_json_names_path_step_and_size(synced: Path) -> None:
    doc = _json(run_mirrord("latest", "--json", "--mirror", synced, "--run", "runA"))
    path = synced / "runA" / "step_0030.pt"
    assert (doc["path"], doc["relative_path"], doc["step"], doc["size"], doc["side"], doc["run"]) == (
        str(path),
        "runA/step_0030.pt",
        30,
        path.stat().st_size,
        "mirror",
        "runA",
    )
    none = run_mirrord("latest", "--json", "--mirror", synced, "--run", "runZ")
    assert none.returncode == 1
    assert (_json(none)["path"], _json(none)["step"]) == (None, None)


def test_json_when_the_manifest_is_unreadable_says_why(primary: Path, synced: Path) -> None:
    """No result to report: still one document, with the error, and exit 1."""
    (synced / MANIFEST_NAME).write_bytes(b'{"schema": "mirrord-manifest", "version": 1, "entr')
    for command, extra in (("sync", ("--primary", str(primary))), ("verify", ()), ("latest", ())):
        result = run_mirrord(command, "--json", "--mirror", synced, *extra)
        assert result.returncode == 1, (command, result.stderr)
        doc = _json(result)
        assert (doc["command"], doc["error"]["reason"]) == (command, "manifest"), doc
        assert MANIFEST_NAME in doc["error"]["path"] and doc["error"]["cause"]


def test_private_checkpoints_stay_private_on_the_mirror(tmp_path: Path) -> None:
    """A 0700 run folder with a 0600 checkpoint (and a 0700 folder unit's 0600 files) keep those modes on
    the mirror under the usual umask 022, never widened to 0755/0644; a setuid bit is never copied."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "private"
    save_checkpoint(run / "step_1.pt", 1)
    save_checkpoint(primary / "shared" / "step_1.pt", 1)
    run.chmod(0o700)
    (run / "step_1.pt").chmod(0o600)
    (primary / "shared" / "step_1.pt").chmod(0o4755)
    old = os.umask(0o022)
    try:
        done = run_mirrord("sync", "--primary", primary, "--mirror", mirror)
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    assert (mirror / "private" / "step_1.pt").read_bytes() == (run / "step_1.pt").read_bytes()
    assert (mirror / "private").stat().st_mode & 0o7777 == 0o700
    assert (mirror / "private" / "step_1.pt").stat().st_mode & 0o7777 == 0o600
    assert (mirror / "shared" / "step_1.pt").stat().st_mode & 0o7777 == 0o755
