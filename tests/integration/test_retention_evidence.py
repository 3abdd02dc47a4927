"""Retention decides from evidence, never from the primary's state or a mirror file's mtime (issue 32 items 3
and 4, issue 33 cases 7 and 8): real torch.save checkpoints, mirrored by `mirrord sync`, pruned by
`mirrord prune` (child processes). Checkpoints carry mtimes from the past (tests.support.checkpoints), so
the min-age guard lets them go unless a test says otherwise."""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mirrord.store.manifest import Manifest
from tests.support.checkpoints import BASE_MTIME_NS, save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.logs import parse_events

RUN = "run1"
S = 10**9


def cli(command: str, primary: Path, mirror: Path, *args: str, **env: str) -> Any:
    settings = {
        "MIRRORD_PRUNE__KEEP_LAST": "2",
        "MIRRORD_PRUNE__PRIMARY": "true",
        "MIRRORD_COPY__SETTLE_SECONDS": "0",
        **env,
    }
    return run_mirrord(command, "--primary", primary, "--mirror", mirror, "--log-format", "json", *args, env=settings)


def ok(result: Any) -> Any:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def steps_on(root: Path, pattern: str = "step_*.pt") -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (root / RUN).glob(pattern))


def save(primary: Path, step: int, mtime_s: int | None = None) -> Path:
    mtime = None if mtime_s is None else BASE_MTIME_NS + mtime_s * S
    return save_checkpoint(primary / RUN / f"step_{step:04d}.pt", step, mtime_ns=mtime)


def test_a_wiped_primary_restarted_from_scratch_keeps_the_old_runs_tip(primary: Path, mirror: Path) -> None:
    """keep_last 2: steps 1-6 mirrored and pruned to 5 and 6; the primary's run folder is wiped: prune then
    deletes nothing and status names the paused run. The job restarts from scratch in the same folder
    (steps 1, 2, 3, written later): after each save is mirrored and pruned the old run's step 6 (its only
    copy) is still on the mirror. Before: the new low steps read as the newer branch and, after three
    saves, 5 and 6 were gone."""
    for step in range(1, 7):
        save(primary, step)
    ok(cli("sync", primary, mirror, MIRRORD_PRUNE__ENABLED="false"))
    ok(cli("prune", primary, mirror))
    assert steps_on(primary) == steps_on(mirror) == [5, 6]
    shutil.rmtree(primary / RUN)
    (primary / RUN).mkdir()
    paused = ok(cli("prune", primary, mirror))
    assert parse_events(paused.stderr, "prune.deleted") == []
    assert [(e["run"], e["step"]) for e in parse_events(paused.stderr, "prune.paused")] == [(RUN, 6)]
    status = cli("status", primary, mirror)
    assert status.returncode == 1 and f"run {RUN}: mirror retention paused" in status.stdout, status.stdout
    for step in (1, 2, 3):
        save(primary, step, mtime_s=1_000 + step)
        ok(cli("sync", primary, mirror))
        pruned = ok(cli("prune", primary, mirror))
        assert 6 in steps_on(mirror), (step, steps_on(mirror), pruned.stdout)
    assert steps_on(mirror) == [2, 3, 6]
    assert steps_on(primary) == [2, 3]
    assert "branch_tip" in pruned.stdout and f"{RUN}/step_0006.pt" in Manifest.load(mirror).entries


def test_forget_branch_lets_the_operator_drop_a_kept_tip(primary: Path, mirror: Path) -> None:
    """`mirrord prune --forget-branch RUN:STEP` drops the kept tip of an abandoned branch."""
    for step in (5, 6):
        save(primary, step)
    ok(cli("sync", primary, mirror))
    for step in (1, 2, 3):
        save(primary, step, mtime_s=1_000 + step)
    (primary / RUN / "step_0005.pt").unlink()
    (primary / RUN / "step_0006.pt").unlink()
    ok(cli("sync", primary, mirror))
    ok(cli("prune", primary, mirror))
    assert steps_on(mirror) == [2, 3, 6]
    forgot = ok(cli("prune", primary, mirror, "--forget-branch", f"{RUN}:6"))
    assert steps_on(mirror) == [2, 3], forgot.stdout
    assert cli("prune", primary, mirror, "--forget-branch", "6").returncode == 2


def test_a_touched_mirror_copy_neither_reorders_nor_is_deleted(primary: Path, mirror: Path) -> None:
    """Steps 10, 20, 30 mirrored; 10 rotated away on the primary and its mirror copy touched (a backup tool,
    a restore by hand). keep_last 2: retention keeps 20 and 30, as `latest` answers 30, and leaves the
    touched copy alone until it is verified again. Before: `would delete run1/step_0020.pt`, kept 10."""
    for step in (10, 20, 30):
        save(primary, step)
    ok(cli("sync", primary, mirror, MIRRORD_PRUNE__ENABLED="false"))
    (primary / RUN / "step_0010.pt").unlink()
    touched = time.time() - 3_600  # older than the age guard: only the record can tell it was touched
    os.utime(mirror / RUN / "step_0010.pt", (touched, touched))
    dry = ok(cli("prune", primary, mirror, "--dry-run"))
    assert parse_events(dry.stderr, "prune.would_delete") == [], dry.stdout
    assert f"mirror   {RUN}/step_0010.pt  unconfirmed" in dry.stdout
    ok(cli("prune", primary, mirror))
    assert steps_on(mirror) == [10, 20, 30] and steps_on(primary) == [20, 30]
    latest = ok(cli("latest", primary, mirror))
    assert latest.stdout.strip().endswith(f"{RUN}/step_0030.pt")


def test_prune_primary_bounds_the_primary_when_old_steps_were_never_mirrored(primary: Path, mirror: Path) -> None:
    """8 old steps, keep_last 2, prune.primary = true: sync mirrors only the window (7, 8); prune then deletes
    1-6 from the primary although they were never mirrored, and a second pass logs nothing about them.
    Before: the primary kept all 8 forever (`skipped: unmirrored`, every pass)."""
    for step in range(1, 9):
        save(primary, step)
    ok(cli("sync", primary, mirror))
    assert steps_on(mirror) == [7, 8]
    pruned = ok(cli("prune", primary, mirror))
    assert steps_on(primary) == [7, 8], pruned.stdout
    assert parse_events(pruned.stderr, "prune.skipped") == []
    again = ok(cli("prune", primary, mirror))
    assert parse_events(again.stderr, "prune.skipped") == [] and parse_events(again.stderr, "prune.deleted") == []


def _legacy_save(path: Path, step: int, torn: bool, mtime_s: int) -> None:
    """A legacy torch.save (no checksums: the validator says "unchecked"), written in place; `torn`: the
    trainer died half-way."""
    buf = io.BytesIO()
    torch.save({"step": step, "w": torch.full((128, 128), float(step))}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[: len(data) // 2] if torn else data)
    os.utime(path, ns=(BASE_MTIME_NS + mtime_s * S,) * 2)


def test_a_torn_unchecked_checkpoint_never_retires_the_good_step(primary: Path, mirror: Path) -> None:
    """keep_last 1, prune.primary = true: a good legacy checkpoint (step 1) is mirrored; the trainer then dies
    half-way through step 2, written in place. Step 2 is published (nothing can tell it is torn) but it is
    no evidence of wholeness: step 1 stays on both sides. Before: step 1 was deleted on both sides."""
    _legacy_save(primary / RUN / "step_0001.pt", 1, torn=False, mtime_s=1)
    ok(cli("sync", primary, mirror, MIRRORD_PRUNE__KEEP_LAST="1"))
    _legacy_save(primary / RUN / "step_0002.pt", 2, torn=True, mtime_s=2)
    ok(cli("sync", primary, mirror, MIRRORD_PRUNE__KEEP_LAST="1"))
    assert Manifest.load(mirror).entries[f"{RUN}/step_0002.pt"].validation == "unchecked"
    pruned = ok(cli("prune", primary, mirror, MIRRORD_PRUNE__KEEP_LAST="1"))
    assert steps_on(primary) == steps_on(mirror) == [1, 2], pruned.stdout
    assert f"{RUN}/step_0001.pt  newer_unverified" in pruned.stdout


def test_latest_never_names_a_torn_unchecked_checkpoint_written_in_place(primary: Path, mirror: Path) -> None:
    """Issue 33 case 7, `latest`: the trainer died half-way through step 2, a legacy torch.save written in
    place (no validator reads it). Nothing says step 2 is whole, so `latest` names step 1 (the trainer
    saved after it: it was finished). The trainer restarts from step 1, saves step 2 again whole, then
    step 3: step 2 is named (a newer save followed it), step 3 is not yet. Before: `latest` named the
    torn step 2."""
    _legacy_save(primary / RUN / "step_0001.pt", 1, torn=False, mtime_s=1)
    _legacy_save(primary / RUN / "step_0002.pt", 2, torn=True, mtime_s=2)
    ok(cli("sync", primary, mirror))
    assert {e.validation for e in Manifest.load(mirror).entries.values()} == {"unchecked"}
    latest = ok(cli("latest", primary, mirror))
    assert latest.stdout.strip() == str(mirror / RUN / "step_0001.pt")
    _legacy_save(primary / RUN / "step_0002.pt", 2, torn=False, mtime_s=3)
    _legacy_save(primary / RUN / "step_0003.pt", 3, torn=False, mtime_s=4)
    ok(cli("sync", primary, mirror, MIRRORD_PRUNE__ENABLED="false"))
    assert Manifest.load(mirror).entries[f"{RUN}/step_0002.pt"].source_mtime_ns == BASE_MTIME_NS + 3 * S
    assert ok(cli("latest", primary, mirror)).stdout.strip() == str(mirror / RUN / "step_0002.pt")


def test_the_checkpoint_lightnings_last_ckpt_names_on_the_mirror_is_kept(primary: Path, mirror: Path) -> None:
    """Lightning, keep_last 1: steps 10 and 20 mirrored while `last.ckpt` named step 10, so the mirror's link
    names step 10; the trainer then moves its link on. Until the mirror's link moves too (the next sync),
    prune keeps step 10 there; after it, step 10 goes. Before: deleted at once, the mirror's link dangling."""
    run = primary / RUN
    env = {"MIRRORD_LAYOUT": "lightning", "MIRRORD_PRUNE__KEEP_LAST": "1", "MIRRORD_PRUNE__MODE": "keep_last"}
    save_checkpoint(run / "epoch=0-step=10.ckpt", 10)
    (run / "last.ckpt").symlink_to("epoch=0-step=10.ckpt")
    ok(cli("sync", primary, mirror, **env))
    save_checkpoint(run / "epoch=1-step=20.ckpt", 20)
    ok(cli("sync", primary, mirror, **env))
    assert (mirror / RUN / "last.ckpt").readlink().as_posix() == "epoch=0-step=10.ckpt"
    (run / "last.ckpt").unlink()
    (run / "last.ckpt").symlink_to("epoch=1-step=20.ckpt")
    held = ok(cli("prune", primary, mirror, **env))
    assert (mirror / RUN / "epoch=0-step=10.ckpt").exists(), held.stdout
    assert f"{RUN}/epoch=0-step=10.ckpt  pointer" in held.stdout
    ok(cli("sync", primary, mirror, **env))
    assert (mirror / RUN / "last.ckpt").readlink().as_posix() == "epoch=1-step=20.ckpt"
    ok(cli("prune", primary, mirror, **env))
    assert not (mirror / RUN / "epoch=0-step=10.ckpt").exists()
    assert (mirror / RUN / "last.ckpt").resolve().exists()
