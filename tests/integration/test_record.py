"""The mirror's record says what each checkpoint is (issue 41): readers need no config, "newest" is newest
recorded, and a source replaced after it was copied is seen by its identity. Real checkpoints, the real CLI."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from mirrord.store.manifest import Manifest
from mirrord.torch import atomic_save, restore_latest
from tests.support.cli import run_mirrord
from tests.support.config import settings, write_config
from tests.support.daemon import DaemonProcess
from tests.support.faketime import faketime_env
from tests.support.folders import write_dcp, write_hf
from tests.support.wait import wait_for


def _write_torch(folder: Path, step: int) -> list[Path]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f"step_{step:04d}.pt"
    atomic_save({"step": step, "w": torch.randn(16, 16)}, path)
    return [path]


WRITERS = {"hf": ("checkpoint-{}", write_hf), "dcp": ("step_{}", write_dcp), "torch": ("step_{:04d}.pt", _write_torch)}


def _mirrored(tmp_path: Path, layout: str, steps: list[int]) -> tuple[Path, Path, Path]:
    """`steps` of run exp1 saved in the `layout`'s own shape, then `mirrord sync`: (config, primary, mirror)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    mirror.mkdir()
    name, write = WRITERS[layout]
    for step in steps:
        write(primary / "exp1" / name.format(step), step)
    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror, {"layout": layout}))
    done = run_mirrord("sync", "--config", config)
    assert done.returncode == 0, done.stderr
    return config, primary, mirror


def _same_tree(restored: Path, mirrored: Path) -> None:
    """`restored` holds exactly the files of `mirrored` (a folder: every one, nothing else), byte for byte."""
    if mirrored.is_file():
        assert restored.read_bytes() == mirrored.read_bytes()
        return
    names = sorted(p.relative_to(mirrored).as_posix() for p in mirrored.rglob("*") if p.is_file())
    assert sorted(p.relative_to(restored).as_posix() for p in restored.rglob("*") if p.is_file()) == names
    for name in names:
        assert (restored / name).read_bytes() == (mirrored / name).read_bytes()


@pytest.mark.parametrize("layout", ["hf", "dcp", "torch"])
def test_every_reader_takes_a_whole_checkpoint_from_the_record_alone(tmp_path: Path, layout: str) -> None:
    """Case 1: checkpoints 100 and 200 of run exp1 mirrored with `layout`, then the primary wiped. With no
    config and no layout, `restore_latest(M, dest, run="exp1")`, `restore_latest(M, dest)`, `mirrord restore
    --mirror M --to D` and `mirrord latest --mirror M` all name and bring back the whole newest checkpoint
    (for a folder: every file), never one member published under the folder's name."""
    _config, primary, mirror = _mirrored(tmp_path, layout, [100, 200])
    newest = "exp1/" + WRITERS[layout][0].format(200)
    shutil.rmtree(primary)

    by_run = restore_latest(mirror, tmp_path / "by_run", run="exp1")
    assert by_run == tmp_path / "by_run" / newest
    _same_tree(by_run, mirror / newest)
    newest_run = restore_latest(mirror, tmp_path / "newest")
    assert newest_run == tmp_path / "newest" / newest
    _same_tree(newest_run, mirror / newest)

    cli = run_mirrord("restore", "--mirror", str(mirror), "--to", str(tmp_path / "cli"))
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == str(tmp_path / "cli" / newest)
    _same_tree(tmp_path / "cli" / newest, mirror / newest)

    latest = run_mirrord("latest", "--mirror", str(mirror))
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip() == str(mirror / newest)
    verify = run_mirrord("verify", "--mirror", str(mirror))
    assert verify.returncode == 0, verify.stdout + verify.stderr


# A mirror written by mirrord before the record said what each file is (made by `mirrord sync` at main
# before issue 41, layout hf): exp1/checkpoint-100 and -200, three files each.
OLD_MIRROR = Path(__file__).parent / "data" / "mirror-v1-hf"


def test_a_manifest_from_before_the_record_is_upgraded_in_place_by_the_next_sync(tmp_path: Path) -> None:
    """Item 1: the old manifest loads as it is; the first `mirrord sync` records, for every entry, the
    layout in force, its folder unit, the unit's member count and a recording sequence in the order the
    units were recorded (checkpoint-200 after -100), written to the mirror's own manifest; then a restore
    with no config brings back the whole checkpoint-200."""
    mirror, primary = tmp_path / "mirror", tmp_path / "primary"
    shutil.copytree(OLD_MIRROR, mirror)
    primary.mkdir()
    old = Manifest.load(mirror).entries
    assert len(old) == 6 and not any(e.layout or e.unit or e.seq for e in old.values())

    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror, {"layout": "hf"}))
    done = run_mirrord("sync", "--config", config)
    assert done.returncode == 0, done.stderr

    stored = json.loads((mirror / ".mirrord-manifest.json").read_bytes())["entries"]
    assert {(rel, raw["layout"], raw["unit"], raw["members"]) for rel, raw in stored.items()} == {
        (f"exp1/checkpoint-{step}/{name}", "hf", f"exp1/checkpoint-{step}", 3)
        for step in (100, 200)
        for name in ("model.safetensors", "optimizer.pt", "trainer_state.json")
    }
    seqs = {rel.split("/")[1]: raw["seq"] for rel, raw in stored.items()}
    assert 0 < seqs["checkpoint-100"] < seqs["checkpoint-200"]
    upgraded = Manifest.load(mirror).entries
    assert {rel: (e.size, e.digest, e.step) for rel, e in upgraded.items()} == {
        rel: (e.size, e.digest, e.step) for rel, e in old.items()
    }

    cli = run_mirrord("restore", "--mirror", str(mirror), "--to", str(tmp_path / "restored"))
    assert cli.returncode == 0, cli.stderr
    _same_tree(tmp_path / "restored" / "exp1" / "checkpoint-200", mirror / "exp1" / "checkpoint-200")


def _rsync_a(src: Path, dest: Path) -> None:
    """What `rsync -a` does: a temp file beside `dest` with the bytes and times of `src`, renamed onto it."""
    temp = dest.with_name(f".{dest.name}.rsync")
    shutil.copy2(src, temp)
    temp.replace(dest)


@pytest.mark.parametrize("put", ["cp -p", "rsync -a"])
def test_a_source_replaced_by_other_bytes_of_the_same_size_and_mtime_is_copied_again(tmp_path: Path, put: str) -> None:
    """Case 10: after step_1.pt is mirrored, other bytes of the same size and mtime are put in its place by
    the real `cp -p` (same inode, new ctime) or as `rsync -a` does (a new inode): the next sync sees it by
    identity, logs copy.source_replaced and mirrors the new bytes. A file put back with its recorded bytes
    (a restore) is read, its new identity recorded, and nothing is copied."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "exp1").mkdir(parents=True)
    mirror.mkdir()
    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror, {"layout": "torch"}))
    step_1, other = primary / "exp1" / "step_1.pt", tmp_path / "other.pt"
    atomic_save({"step": 1, "w": torch.zeros(16, 16)}, step_1)
    atomic_save({"step": 1, "w": torch.ones(16, 16)}, other)
    assert other.stat().st_size == step_1.stat().st_size and other.read_bytes() != step_1.read_bytes()
    mtime = step_1.stat().st_mtime_ns
    os.utime(other, ns=(mtime, mtime))
    first = run_mirrord("sync", "--config", config)
    assert first.returncode == 0, first.stderr

    if put == "cp -p":
        subprocess.run(["cp", "-p", str(other), str(step_1)], check=True)
    else:
        _rsync_a(other, step_1)
    assert (step_1.stat().st_size, step_1.stat().st_mtime_ns) == (other.stat().st_size, mtime)
    again = run_mirrord("sync", "--config", config, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["copied"] == ["exp1/step_1.pt"]
    assert '"copy.source_replaced"' in again.stderr
    assert (mirror / "exp1" / "step_1.pt").read_bytes() == other.read_bytes()
    assert torch.load(mirror / "exp1" / "step_1.pt", weights_only=True)["w"].sum() == 256

    step_1.unlink()  # put back by a restore: the recorded bytes, another inode
    restored = run_mirrord("restore", "--mirror", str(mirror), "--to", str(primary))
    assert restored.returncode == 0, restored.stderr
    settled = run_mirrord("sync", "--config", config, "--json")
    assert settled.returncode == 0, settled.stderr
    assert json.loads(settled.stdout)["copied"] == []
    assert '"copy.source_same_bytes"' in settled.stderr
    assert json.loads(run_mirrord("sync", "--config", config, "--json").stdout)["copied"] == []


def _legacy_save(path: Path, step: int, width: int = 64, rename: bool = True, torn: bool = False) -> bytes:
    """A legacy torch.save (no validator reads it) of `step`: by temp file and rename, or in place; `torn`
    writes only its first half in place (the trainer died while writing). Returns the bytes of the whole save."""
    buf = io.BytesIO()
    torch.save({"step": step, "w": torch.full((width, width), float(step))}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    if rename:
        part = path.with_name(path.name + ".part")
        part.write_bytes(data)
        part.replace(path)
    else:
        with open(path, "r+b") as f:  # rewritten in place, as torch.save(obj, path) does
            f.truncate(0)
            f.write(data[: len(data) // 2] if torn else data)
    return data


def _committed(d: DaemonProcess, rel: str, count: int) -> None:
    wait_for(lambda: len(d.events("copy.committed", path=rel)) >= count, 60, f"{rel} copied {count} time(s)")


def _saved_by_rename(d: DaemonProcess, primary: Path, mirror: Path) -> list[bytes]:
    """Steps 1..3 of run r saved by temp file and rename, each mirrored and recorded "renamed" (whole)."""
    good = []
    for step in (1, 2, 3):
        good.append(_legacy_save(primary / "r" / f"step_{step}.pt", step))
        _committed(d, f"r/step_{step}.pt", 1)
    assert {e.validation for e in Manifest.load(mirror).entries.values()} == {"renamed"}
    return good


def test_a_torn_rewrite_never_replaces_the_verified_copy_of_the_same_name(tmp_path: Path, daemon_factory) -> None:
    """Case 5: step_1..3 saved by temp file and rename in a format no validator reads (recorded "renamed"); the
    job restarts with the same names and dies half-way through rewriting step_3.pt in place. Once that settles,
    the daemon mirrors the torn bytes beside the verified copy, never over it: the mirror's step_3.pt is still
    the good one, and `mirrord latest` and `mirrord restore` name and bring back the good step 3."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "r").mkdir()
    d = daemon_factory({"watch": {"rescan_interval_seconds": 1}}).start()
    good = _saved_by_rename(d, primary, mirror)

    torn = _legacy_save(primary / "r" / "step_3.pt", 3, width=128, rename=False, torn=True)
    assert len(torn) > 2 * len(good[2])
    _committed(d, "r/step_3.pt", 2)  # the torn file, once it stopped changing
    assert (mirror / "r" / "step_3.pt").read_bytes() == good[2]
    entry = Manifest.load(mirror).entries["r/step_3.pt"]
    assert (entry.size, entry.validation) == (len(good[2]), "renamed")

    latest = run_mirrord("latest", "--mirror", str(mirror))
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip() == str(mirror / "r" / "step_3.pt")
    restored = run_mirrord("restore", "--mirror", str(mirror), "--to", str(tmp_path / "restored"))
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "restored" / "r" / "step_3.pt").read_bytes() == good[2]
    status = run_mirrord("status", "--config", str(d.config_path))
    assert " r " in status.stdout and ".mirrord-versions" not in status.stdout, status.stdout  # no run of its own
    done = len(d.events("reconcile.finished"))
    wait_for(lambda: len(d.events("reconcile.finished")) >= done + 2, 60, "two more reconciles")
    assert len(d.events("copy.committed", path="r/step_3.pt")) == 2  # the version beside is not copied again
    assert d.stop() == 0


def test_a_version_written_in_place_takes_the_name_once_the_trainer_saves_a_newer_step(
    tmp_path: Path, daemon_factory
) -> None:
    """Item 4's promotion: step_3.pt rewritten in place (whole, but no validator or rename says so) is kept
    beside the verified copy. Once the trainer saves step 4, a later save proves step 3's returned: the new
    step 3 takes the name, the old one is moved aside, still recorded, and retention (keep_last 10: every
    step stays) retires it later, as no resume needs it any more."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "r").mkdir()
    prune = {"enabled": True, "keep_last": 10, "min_age_seconds": 0}
    d = daemon_factory({"watch": {"rescan_interval_seconds": 1}, "prune": prune}).start()
    good = _saved_by_rename(d, primary, mirror)
    new = _legacy_save(primary / "r" / "step_3.pt", 3, width=128, rename=False)
    _committed(d, "r/step_3.pt", 2)
    assert (mirror / "r" / "step_3.pt").read_bytes() == good[2]
    assert d.events("copy.kept_beside", path="r/step_3.pt")

    _legacy_save(primary / "r" / "step_4.pt", 4)
    assert d.wait_event("copy.version_promoted", path="r/step_3.pt", timeout=60)["kept_aside"]
    assert (mirror / "r" / "step_3.pt").read_bytes() == new
    wait_for(lambda: d.events("prune.deleted", kind="step", step=3), 60, "the old step 3 retired")
    previous = d.events("prune.deleted", kind="step", step=3)[0]["path"]
    assert previous.startswith(".mirrord-versions/r/step_3.pt@") and not (mirror / previous).exists()
    entries = Manifest.load(mirror).entries
    assert previous not in entries and entries["r/step_3.pt"].size == len(new)
    assert sorted(p.name for p in (mirror / "r").iterdir()) == [f"step_{step}.pt" for step in (1, 2, 3, 4)]
    latest = run_mirrord("latest", "--mirror", str(mirror))
    assert latest.stdout.strip() == str(mirror / "r" / "step_4.pt"), latest.stderr
    assert d.stop() == 0


@pytest.mark.parametrize("moved", ["clock stepped back", "touch"])
def test_newest_is_the_newest_recorded_whatever_the_mtimes_say_later(tmp_path: Path, moved: str) -> None:
    """Case 4: steps 1..5 saved and mirrored in order. The host's clock ran 450 s fast while step 3 was
    saved and mirrored (then NTP stepped it back), or a tool touched step 4 on the primary after the fact (and sync
    recorded its new mtime): a lower step now has the newest mtime, but mirrord had recorded its bytes
    before the higher ones were saved. Read an hour later (faketime: no mtime is in the future then),
    `latest`, `restore`, `restore_latest` name step 5, and retention (keep_last 2) keeps 4 and 5."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    mirror.mkdir()
    retention = {"layout": "torch", "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 0}}
    config = write_config(tmp_path / "mirrord.toml", settings(primary, mirror, retention))
    for step in range(1, 6):
        (path,) = _write_torch(primary / "exp1" / "step", step)
        fast = moved == "clock stepped back" and step == 3  # this host's clock: the save's and mirrord's alike
        if fast:
            os.utime(path, (time.time() + 450,) * 2)
        synced = run_mirrord(
            "sync", "--config", config, env=faketime_env("+450s", monotonic_too=True) if fast else None
        )
        assert synced.returncode == 0, synced.stderr
    if moved == "touch":
        os.utime(primary / "exp1" / "step_0004.pt")
        touched = run_mirrord("sync", "--config", config)
        assert touched.returncode == 0, touched.stderr
    newest = max(range(1, 6), key=lambda s: (primary / "exp1" / f"step_{s:04d}.pt").stat().st_mtime_ns)
    assert newest == (3 if moved == "clock stepped back" else 4)

    later = faketime_env("+1h")
    latest = run_mirrord("latest", "--mirror", str(mirror), env=later)
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip() == str(mirror / "exp1" / "step_0005.pt")
    done = run_mirrord("restore", "--mirror", str(mirror), "--to", str(tmp_path / "dest"), env=later)
    assert done.returncode == 0, done.stderr
    assert torch.load(done.stdout.strip(), weights_only=True)["step"] == 5
    pruned = run_mirrord("prune", "--config", config, env=later)
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(p.name for p in (mirror / "exp1").glob("*.pt")) == ["step_0004.pt", "step_0005.pt"]
