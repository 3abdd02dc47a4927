"""Folder units mirrored for real: HF-like and DCP-like folders written with torch, published whole."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mirrord.config import Config, load_config
from mirrord.core.units import group_units
from mirrord.errors import SourceChangedError
from mirrord.store.manifest import Manifest
from mirrord.store.staging import FolderStaging
from mirrord.store.volume import LocalMirror, LocalUpload, LocalVolume
from tests.support.checkpoints import save_checkpoint
from tests.support.cli import run_mirrord
from tests.support.engine import copy_once
from tests.support.folders import write_dcp, write_hf
from tests.support.mirror import hash_file
from tests.support.units import unit_verified
from tests.support.unitsync import sync_units


def _config(primary: Path, mirror: Path, layout: str) -> Config:
    return load_config(
        environ={},
        overrides={"primary": str(primary), "mirror": str(mirror), "layout": layout, "copy": {"settle_seconds": 0}},
        check_roots=False,
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _sync(config: Config) -> tuple[int, LocalMirror]:
    """One planning pass and its copies, in process; returns how many jobs ran."""
    mirror = LocalMirror(config.mirror)
    return sync_units(config, mirror), mirror


WRITERS: dict[str, tuple[str, Callable[[Path, int], list[Path]]]] = {
    "hf": ("checkpoint-{}", write_hf),
    "dcp": ("step_{}", write_dcp),
}


@pytest.mark.parametrize("layout", ["hf", "dcp"])
def test_folder_unit_is_mirrored_whole_and_recorded_file_by_file(tmp_path: Path, layout: str) -> None:
    """Every file of the folder (DCP's .metadata too) is on the mirror byte for byte under the final
    name, recorded in the manifest with its size and hash; no staging folder is left; a second pass
    has nothing to do."""
    name, write = WRITERS[layout]
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    for step in (10, 20):
        write(primary / "run" / name.format(step), step)
    config = _config(primary, mirror_root, layout)
    jobs, _mirror = _sync(config)
    assert jobs == 2
    assert _tree(mirror_root / "run") == _tree(primary / "run")
    if layout == "dcp":
        assert (mirror_root / "run" / "step_10" / ".metadata").is_file()
    assert not [p for p in mirror_root.rglob("*.part")]
    entries = Manifest.load(mirror_root).entries
    for rel, data in _tree(primary).items():
        entry = entries[rel]
        assert entry.size == len(data)
        assert entry.digest == hash_file(primary / rel, entry.algo)
        assert entry.step == int(rel.split("/")[1].rsplit("-", 1)[-1].rsplit("_", 1)[-1])
    units = group_units(LocalVolume(mirror_root).snapshot((), config.rules).files.values(), config.rules)
    assert all(unit_verified(u, entries) for u in units.values())
    assert _sync(config)[0] == 0


def test_an_unfinished_folder_is_not_mirrored(tmp_path: Path) -> None:
    """HF: no trainer_state.json yet (the Trainer writes it last) -> nothing on the mirror, not even
    an empty folder. DCP: no .metadata yet -> the same."""
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    write_hf(primary / "checkpoint-5", 5)
    (primary / "checkpoint-5" / "trainer_state.json").unlink()
    assert _sync(_config(primary, mirror_root, "hf"))[0] == 0
    write_dcp(primary / "step_5", 5)
    (primary / "step_5" / ".metadata").unlink()
    assert _sync(_config(primary, mirror_root, "dcp"))[0] == 0
    assert not [p for p in mirror_root.iterdir() if p.is_dir()]


def test_a_changed_folder_is_published_again_whole(tmp_path: Path) -> None:
    """The trainer rewrote checkpoint-5 (another optimizer.pt, one file fewer): the old copy goes
    (entries first), the new one is published whole, and the manifest lists exactly its files."""
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "checkpoint-5"
    write_hf(folder, 5)
    config = _config(primary, mirror_root, "hf")
    _sync(config)
    write_hf(folder, 6)
    (folder / "rng_state.pth").unlink()
    os.utime(folder / "trainer_state.json")
    assert _sync(config)[0] == 1
    assert _tree(mirror_root / "checkpoint-5") == _tree(folder)
    assert sorted(Manifest.load(mirror_root).entries) == sorted(f"checkpoint-5/{n}" for n in _tree(folder))


def _cli(command: str, primary: Path, mirror: Path, env: dict[str, str], *args: str) -> str:
    result = run_mirrord(command, "--primary", primary, "--mirror", mirror, *args, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _old(paths: list[Path]) -> None:
    """Written an hour ago: settled, and past prune.min_age_seconds."""
    for path in paths:
        os.utime(path, (time.time() - 3600, time.time() - 3600))


def test_lightning_last_ckpt_is_mirrored_and_never_counted(tmp_path: Path) -> None:
    """sync + prune with keep_last = 1: the newest step and last.ckpt stay on the mirror; last.ckpt
    (no step) neither counts as a step nor is pruned; `latest` names the newest step."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    ckpts = primary / "lightning_logs" / "version_0" / "checkpoints"
    made = [save_checkpoint(ckpts / f"epoch={i}-step={10 * (i + 1)}.ckpt", 10 * (i + 1)) for i in range(3)]
    made.append(save_checkpoint(ckpts / "last.ckpt", 30))
    _old(made)
    env = {
        "MIRRORD_LAYOUT": "lightning",
        "MIRRORD_PRUNE__KEEP_LAST": "1",
        "MIRRORD_PRUNE__MODE": "keep_last",
        "MIRRORD_COPY__SETTLE_SECONDS": "0",
    }
    _cli("sync", primary, mirror, env)
    _cli("prune", primary, mirror, env)
    assert sorted(p.name for p in (mirror / ckpts.relative_to(primary)).iterdir()) == [
        "epoch=2-step=30.ckpt",
        "last.ckpt",
    ]
    assert _cli("latest", primary, mirror, env).strip().endswith("epoch=2-step=30.ckpt")


def test_deepspeed_folders_and_their_tag_file(tmp_path: Path) -> None:
    """global_stepN/ folders are units named by the `latest` tag file; the tag file is mirrored with
    them; keep_last = 1 keeps the newest folder whole; `latest` names it."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    made = []
    for step in (100, 200):
        folder = primary / "out" / f"global_step{step}"
        made += [
            save_checkpoint(folder / "mp_rank_00_model_states.pt", step),
            save_checkpoint(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step + 1),
        ]
    (primary / "out" / "latest").write_text("global_step200")
    made.append(primary / "out" / "latest")
    _old(made)
    env = {"MIRRORD_LAYOUT": "deepspeed", "MIRRORD_PRUNE__KEEP_LAST": "1", "MIRRORD_COPY__SETTLE_SECONDS": "0"}
    _cli("sync", primary, mirror, env)
    assert (mirror / "out" / "latest").read_text() == "global_step200"
    _cli("prune", primary, mirror, env)
    assert sorted(p.name for p in (mirror / "out").iterdir()) == ["global_step200", "latest"]
    assert _tree(mirror / "out" / "global_step200") == _tree(primary / "out" / "global_step200")
    assert _cli("latest", primary, mirror, env).strip() == str(mirror / "out" / "global_step200")


def test_deepspeed_tag_naming_a_folder_not_yet_mirrored_is_not_published(tmp_path: Path) -> None:
    """The planner chose `latest` when it named a mirrored folder; the trainer then saved global_step200
    and rewrote it. The copy reads it again: it names a folder the manifest does not record, so nothing
    is published (not a failure: that version of the tag is gone). Once the folder is in, it is."""
    from mirrord.core.jobs import CopyJob
    from mirrord.errors import SourceGoneError
    from mirrord.service.engine import Engine

    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "out" / "global_step200"
    save_checkpoint(folder / "mp_rank_00_model_states.pt", 200)
    save_checkpoint(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 201)
    tag = primary / "out" / "latest"
    tag.write_text("global_step200")
    config = _config(primary, mirror_root, "deepspeed")
    mirror = LocalMirror(config.mirror)
    job = CopyJob("out/latest", tag.stat().st_size, tag.stat().st_mtime_ns, None, "new")
    with mirror.lock():
        manifest = mirror.read_manifest()
        with pytest.raises(SourceGoneError, match="global_step200"):
            copy_once(Engine(config, mirror, manifest), job)
        manifest.close()
    assert not (mirror_root / "out" / "latest").exists()
    assert not list(mirror_root.rglob("*.part"))
    assert _sync(config)[0] == 1  # the folder: the plan holds the tag back until the folder is in
    assert not (mirror_root / "out" / "latest").exists()
    assert _sync(config)[0] == 1
    assert (mirror_root / "out" / "latest").read_text() == "global_step200"


def test_custom_folder_units_wait_for_their_marker(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "ckpt_7"
    made = [save_checkpoint(folder / "weights.pt", 7), save_checkpoint(folder / "optim.pt", 8)]
    _old(made)
    env = {
        "MIRRORD_LAYOUT": "custom",
        "MIRRORD_PATTERNS": "ckpt_*",
        "MIRRORD_PRUNE__STEP_PATTERN": r"ckpt_(\d+)",
        "MIRRORD_UNIT__KIND": "folder",
        "MIRRORD_UNIT__COMPLETE_MARKER": "DONE",
        "MIRRORD_COPY__SETTLE_SECONDS": "0",
        "MIRRORD_UNIT__SETTLE_SECONDS": "1",
    }  # sync waits 3 x this for a unit that is not whole
    _cli("sync", primary, mirror, env)
    assert not (mirror / "ckpt_7").exists()
    (folder / "DONE").touch()  # an empty marker is a file of the unit like any other
    _old([folder / "DONE"])
    _cli("sync", primary, mirror, env)
    assert _tree(mirror / "ckpt_7") == _tree(folder)


def test_lightning_link_last_ckpt_becomes_the_same_link_on_the_mirror(tmp_path: Path) -> None:
    """save_last="link": last.ckpt is a symlink to the newest step; sync makes the same relative link on
    the mirror once that step is mirrored, and says nothing about a skipped symlink."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    ckpts = primary / "checkpoints"
    made = [save_checkpoint(ckpts / "epoch=0-step=10.ckpt", 10)]
    (ckpts / "last.ckpt").symlink_to("epoch=0-step=10.ckpt")
    _old(made)
    env = {"MIRRORD_LAYOUT": "lightning", "MIRRORD_COPY__SETTLE_SECONDS": "0"}
    result = run_mirrord("sync", "--primary", primary, "--mirror", mirror, "--log-format", "json", env=env)
    assert result.returncode == 0, result.stderr
    assert (mirror / "checkpoints" / "last.ckpt").readlink() == Path("epoch=0-step=10.ckpt")
    assert (mirror / "checkpoints" / "last.ckpt").read_bytes() == (ckpts / "epoch=0-step=10.ckpt").read_bytes()
    assert "scan.skipped" not in result.stdout + result.stderr
    assert "alias.linked" in result.stdout + result.stderr


def _age(folder: Path, seconds: float) -> None:
    then = time.time() - seconds
    for path in folder.rglob("*"):
        os.utime(path, (then, then))


def test_status_lists_the_units_the_mirror_lacks_with_the_daemons_verdict(tmp_path: Path) -> None:
    """Per run, each folder unit the mirror does not hold, judged by the layout's completeness rule as
    the daemon judges it (reading trainer_state.json): whole units are pending (lag), a unit without
    its last file or still being written is incomplete (not lag: the daemon waits for it)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "run"
    for step in (10, 20):
        write_hf(run / f"checkpoint-{step}", step)
        _age(run / f"checkpoint-{step}", 3 * 86400)
    _sync(_config(primary, mirror, "hf"))
    write_hf(run / "checkpoint-30", 30)
    write_hf(run / "checkpoint-40", 40)
    (run / "checkpoint-40" / "trainer_state.json").unlink()
    for step in (30, 40):
        _age(run / f"checkpoint-{step}", 2 * 86400)
    write_hf(run / "checkpoint-50", 50)  # just written: not settled for settle_seconds yet
    env = {
        "MIRRORD_LAYOUT": "hf",
        "MIRRORD_METRICS__ENABLED": "false",
        "MIRRORD_COPY__SETTLE_SECONDS": "3600",
        "MIRRORD_PRUNE__ENABLED": "false",
    }
    lag = ("--max-lag", str(7 * 86400))  # checkpoint-30 is two days behind: lag, not yet a problem here
    result = run_mirrord("status", "--primary", primary, "--mirror", mirror, "--json", *lag, env=env)
    assert result.returncode == 0, result.stdout
    [report] = json.loads(result.stdout)["runs"]
    units = [(u["unit"], u["step"], u["state"]) for u in report["units"]]
    assert units == [
        ("run/checkpoint-50", 50, "incomplete"),
        ("run/checkpoint-40", 40, "incomplete"),
        ("run/checkpoint-30", 30, "pending"),
    ]
    why = {u["unit"]: u["why"] for u in report["units"]}
    assert why["run/checkpoint-40"].startswith("no trainer_state.json yet")
    assert why["run/checkpoint-50"].startswith("still being written")
    assert (report["mirror_step"], report["pending_files"]) == (20, 1)  # only the whole unit is lag
    text = run_mirrord("status", "--primary", primary, "--mirror", mirror, *lag, env=env).stdout
    assert "run/checkpoint-40  INCOMPLETE  no trainer_state.json yet" in text


def test_status_of_a_file_layout_lists_no_units(tmp_path: Path) -> None:
    """torch: file by file as before; nothing is judged as a folder."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    save_checkpoint(primary / "run" / "step_1.pt", 1)
    result = run_mirrord(
        "status", "--primary", primary, "--mirror", mirror, "--json", env={"MIRRORD_METRICS__ENABLED": "false"}
    )
    [report] = json.loads(result.stdout)["runs"]
    assert (report["units"], report["pending_files"]) == ([], 1)


def test_status_reports_folder_units_per_run(tmp_path: Path) -> None:
    """status groups an HF mirror by run (the folder above checkpoint-N/), with the unit's step."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    for step in (10, 20):
        write_hf(primary / "run" / f"checkpoint-{step}", step)
    _sync(_config(primary, mirror, "hf"))
    result = run_mirrord(
        "status",
        "--primary",
        primary,
        "--mirror",
        mirror,
        "--json",
        env={"MIRRORD_LAYOUT": "hf", "MIRRORD_METRICS__ENABLED": "false"},
    )
    runs = json.loads(result.stdout)["runs"]
    assert [(r["run"], r["primary_step"], r["mirror_step"], r["verified"], r["pending_files"]) for r in runs] == [
        ("run", 20, 20, True, 0)
    ]


class _ReplacingMirror(LocalMirror):
    """A local mirror whose unit staging, at its second file, runs `during` once: the point where the
    first member has been copied and the unit's copy is still in flight (a gate, not a race)."""

    def __init__(self, root: Path, during: Callable[[str], None]) -> None:
        super().__init__(root)
        self.during = during

    def begin_unit(self, key: str) -> FolderStaging:
        staging = super().begin_unit(key)
        uploaded: list[str] = []
        upload = staging.upload

        def gated(relkey: str, size: int, drop_cache: bool = False) -> LocalUpload:
            if len(uploaded) == 1:
                self.during(uploaded[0])
            uploaded.append(relkey)
            return upload(relkey, size, drop_cache)

        staging.upload = gated  # type: ignore[method-assign]
        return staging


def test_a_member_replaced_during_the_units_copy_is_never_published_mixed(tmp_path: Path) -> None:
    """A member replaced while the unit is copied (new inode, other bytes, same size, mtime restored: what
    `rsync -a`, `cp -p` or `tar x` do) after its own copy: the recheck compares inode and ctime, so that
    copy is discarded, and the next pass publishes the folder as it is now, never the old bytes beside
    the new files."""
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "checkpoint-5"
    write_hf(folder, 5)
    config = _config(primary, mirror_root, "hf")

    def replace(member: str) -> None:
        path = folder / member
        old = path.stat()
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # other bytes, same size
        fresh = path.with_name(path.name + ".new")
        fresh.write_bytes(bytes(data))
        os.utime(fresh, ns=(old.st_atime_ns, old.st_mtime_ns))
        fresh.replace(path)

    with pytest.raises(SourceChangedError, match="replaced while the folder was copied"):
        sync_units(config, _ReplacingMirror(config.mirror, replace))
    assert not (mirror_root / "checkpoint-5").exists()
    _sync(config)
    assert _tree(mirror_root / "checkpoint-5") == _tree(folder)


def test_a_folder_with_a_symlinked_member_is_not_whole(tmp_path: Path) -> None:
    """A member that is a symlink (deduplicated storage, a hub snapshot) cannot be copied as a file: the
    folder is not published (never mirrored without it and counted whole), and status says why."""
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "checkpoint-5"
    write_hf(folder, 5)
    blobs = primary / ".blobs"
    blobs.mkdir()
    (folder / "optimizer.pt").rename(blobs / "optimizer.pt")
    (folder / "optimizer.pt").symlink_to(blobs / "optimizer.pt")
    config = _config(primary, mirror_root, "hf")
    _sync(config)
    assert not (mirror_root / "checkpoint-5").exists()
    assert "checkpoint-5/optimizer.pt" not in Manifest.load(mirror_root).entries
    env = {"MIRRORD_LAYOUT": "hf", "MIRRORD_COPY__SETTLE_SECONDS": "0", "MIRRORD_METRICS__ENABLED": "false"}
    done = run_mirrord("status", "--json", "--primary", primary, "--mirror", mirror_root, env=env)
    report = json.loads(done.stdout)
    [unit] = [u for r in report["runs"] for u in r["units"]]
    assert unit["unit"] == "checkpoint-5" and unit["state"] == "incomplete"
    assert "optimizer.pt is a symlink" in unit["why"]
    done = run_mirrord("latest", "--primary", primary, "--mirror", mirror_root, env=env)
    assert "checkpoint-5" not in done.stdout


def test_a_private_folder_unit_stays_private_on_the_mirror(tmp_path: Path) -> None:
    """A 0700 checkpoint folder of 0600 files is 0700/0600 on the mirror under umask 022 (staged and
    renamed into place whole, with the source's modes from the start)."""
    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "checkpoint-5"
    write_hf(folder, 5)
    for path in folder.iterdir():
        path.chmod(0o600)
    folder.chmod(0o700)
    old = os.umask(0o022)
    try:
        _sync(_config(primary, mirror_root, "hf"))
    finally:
        os.umask(old)
    assert _tree(mirror_root / "checkpoint-5") == _tree(folder)
    assert (mirror_root / "checkpoint-5").stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in (mirror_root / "checkpoint-5").iterdir()} == {0o600}


def test_a_folder_that_gained_a_file_since_it_was_planned_is_judged_again_never_copied_stale(tmp_path: Path) -> None:
    """A unit job planned with the files of an earlier look (accelerate's first save, seen with one file)
    finds the folder holding others: discarded before anything is staged, and not retried with that file
    list (the daemon judges the folder again from a fresh listing)."""
    from structlog.testing import capture_logs

    from mirrord.core.jobs import CopyJob
    from mirrord.service.engine import Engine
    from mirrord.service.workers import copy_all

    primary, mirror_root = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "checkpoint-5"
    write_hf(folder, 5)
    config = _config(primary, mirror_root, "hf")
    first = folder / "model.safetensors"
    job = CopyJob(
        "checkpoint-5", first.stat().st_size, first.stat().st_mtime_ns, 5, "new", ("checkpoint-5/model.safetensors",)
    )
    mirror = LocalMirror(config.mirror)
    with mirror.lock(), capture_logs() as logs:
        outcome = copy_all(Engine(config, mirror, mirror.read_manifest()), [job], 1)["checkpoint-5"]
    assert isinstance(outcome, SourceChangedError) and "judged again" in outcome.cause
    [failed] = [e for e in logs if e["event"] == "copy.failed"]
    assert (failed["attempt"], failed["retry"]) == (1, "judged_again")
    assert not (mirror_root / "checkpoint-5").exists()
