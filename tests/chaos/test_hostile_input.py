"""Hostile input: symlinks out of the roots, a directory swapped for a symlink between plan and delete,
names no one expects, FIFOs and device nodes, files mirrord may not read.

Nothing is ever read or copied from outside the primary, written or deleted outside the mirror (or
the primary, for primary pruning); nothing hangs; every file that can be mirrored is.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mirrord.commands.sync  # imported before any fork that drops privileges
from mirrord.config import Config
from mirrord.service.pruner import Pruner
from mirrord.store.volume import LocalMirror, LocalVolume
from tests.chaos.harness import (
    ALGO,
    SCALE,
    Checkpoints,
    Report,
    Tally,
    World,
    Zygote,
    converged_violations,
    crash_violations,
    digest_bytes,
    finals,
    latest_violations,
    load_manifest,
    make_config,
    step_name,
    write_config,
)
from tests.support.daemon import DaemonProcess
from tests.support.logs import read_events
from tests.support.mirror import hash_file
from tests.support.privileges import NOBODY, run_as_nobody
from tests.support.wait import wait_for

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (device nodes, dropping privileges)")


def _secret(base: Path, checkpoints: Checkpoints) -> tuple[Path, set[str]]:
    """A checkpoint outside both roots, and the digests of everything out there."""
    outside = base / "outside"
    outside.mkdir()
    secret = outside / "secret.pt"
    secret.write_bytes(checkpoints.blobs[-1] + b"SECRET")
    (outside / "run-x").mkdir()
    (outside / "run-x" / step_name(3)).write_bytes(checkpoints.blobs[-2] + b"SECRET")
    return outside, {hash_file(p, ALGO) for p in outside.rglob("*.pt")}


def _leaked(world: World, secrets: set[str]) -> list[str]:
    files = finals(world.mirror)[0]
    return [f"{rel}: holds bytes from outside the primary" for rel, p in files.items() if hash_file(p, ALGO) in secrets]


def _sync_round(world: World, zygote: Zygote, tmp_path: Path, tally: Tally) -> tuple[Path, Path, int]:
    """One round of a real `mirrord sync` of the world: its config, its log and its exit code."""
    config = write_config(tmp_path / "mirrord.toml", world)
    log = tmp_path / "sync.log"
    code = zygote.run(["sync", "--config", config], log, timeout=60)
    tally.rounds += 1
    return config, log, code


def _daemon_round(
    world: World, tmp_path: Path, tally: Tally, rescan: float, until: Callable[[DaemonProcess], object], what: str
) -> None:
    """One round of the daemon on the same tree, until `until` returns: it stays healthy and exits 0."""
    daemon = DaemonProcess(tmp_path, world.primary, world.mirror, {"watch": {"rescan_interval_seconds": rescan}})
    daemon.start()
    try:
        until(daemon)
        if daemon.http("/healthz")[0] != 200:
            tally.check([f"daemon unhealthy with {what}"])
    finally:
        code = daemon.stop()
    tally.rounds += 1
    if code != 0:
        tally.check([f"daemon exited {code}"])


def _three_reconciles(daemon: DaemonProcess) -> None:
    wait_for(lambda: len(daemon.events("reconcile.finished")) >= 3, 90, "three reconciles", interval=0.02)


def test_symlinks_in_the_primary_are_never_followed(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """Symlinks to a secret outside, to the mirror, to a directory outside, to /etc, and a loop."""
    tally = report.scenario("hostile: symlinks in the primary (to a secret, to the mirror, loops)")
    outside, secrets = _secret(tmp_path, checkpoints)
    world.install(f"run/{step_name(1)}", checkpoints.blobs[0])
    world.mirror.mkdir()
    links = {
        f"run/{step_name(2)}": outside / "secret.pt",
        "run-x": outside / "run-x",
        f"run/{step_name(4)}": world.mirror / "run" / step_name(1),
        "to-mirror": world.mirror,
        f"run/{step_name(5)}": Path("/etc/passwd"),
        "loop": world.primary,
        f"run/{step_name(6)}": Path(step_name(6)),  # points at itself
    }
    for rel, target in links.items():
        (world.primary / rel).symlink_to(target)
        tally.fault("symlink planted")
    _config, log, code = _sync_round(world, zygote, tmp_path, tally)
    if code != 0:
        tally.check([f"sync exited {code}: symlinks must be skipped, not fail the pass"])
    skipped = {e["path"] for e in read_events(log, "scan.skipped")}
    tally.check([f"{rel}: symlink not reported as skipped" for rel in links if rel not in skipped])
    tally.check(_leaked(world, secrets))
    tally.check(converged_violations(world, {f"run/{step_name(1)}"}))
    # The daemon sees the same tree: it mirrors the real file and stays healthy.
    _daemon_round(world, tmp_path, tally, 0.5, _three_reconciles, "symlinks in the primary")
    tally.check(_leaked(world, secrets))
    tally.check(converged_violations(world, {f"run/{step_name(1)}"}))
    tally.assert_clean()


def test_symlinks_planted_on_the_mirror_are_not_written_through(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """A mirror folder that is a symlink to elsewhere, and a final name that is a symlink to a victim."""
    tally = report.scenario("hostile: symlinks planted on the mirror")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"do not overwrite")
    world.install(f"run/{step_name(1)}", checkpoints.blobs[0])
    world.install(step_name(2), checkpoints.blobs[1])
    world.mirror.mkdir()
    (world.mirror / "run").symlink_to(elsewhere, target_is_directory=True)
    (world.mirror / step_name(2)).symlink_to(victim)
    tally.fault("symlinks planted", 2)
    _config, log, code = _sync_round(world, zygote, tmp_path, tally)
    if code != 1:
        tally.check([f"sync exited {code}; the copy into a symlinked folder must fail"])
    if list(elsewhere.iterdir()):
        tally.check([f"written through the planted folder symlink: {sorted(elsewhere.iterdir())}"])
    if victim.read_bytes() != b"do not overwrite":
        tally.check(["the symlink's target was overwritten"])
    failed = [e for e in read_events(log, "copy.failed") if e["path"] == f"run/{step_name(1)}"]
    if not failed or "run" not in str(failed[0].get("error_path")):
        tally.check(["the refused copy was not reported with its path"])
    final = world.mirror / step_name(2)
    if final.is_symlink() or hash_file(final, ALGO) != world.source_digest(step_name(2)):
        tally.check(["the final name is still the planted symlink, or holds other bytes"])
    tally.assert_clean()


# ------------------------------------------------------------------------------------ TOCTOU
def _prune_world(world: World, checkpoints: Checkpoints, side: str) -> tuple[Config, Path]:
    """Steps 1-4 mirrored and verified; keep_last = 1; a victim folder with the same file names."""
    for step in (1, 2, 3, 4):
        if not (world.primary / "run" / step_name(step)).exists():
            world.install(f"run/{step_name(step)}", checkpoints.blobs[step])
    config = make_config(world, prune=_prune_settings(side))
    # Every step mirrored first (with pruning on, a first sync copies only what the window keeps).
    assert mirrord.commands.sync.run_sync(make_config(world, prune={"enabled": False})).ok
    victim = world.base / "victim" / "run"
    if not victim.exists():
        victim.mkdir(parents=True)
        for step in (1, 2, 3, 4):
            (victim / step_name(step)).write_bytes(f"victim {step}".encode())
    return config, victim


def _prune_settings(side: str) -> dict[str, Any]:
    """keep_last = 1 on the mirror, or on the primary too with side == "primary"."""
    return {"enabled": True, "keep_last": 1, "min_age_seconds": 0, "primary": side == "primary"}


def _run_folder(world: World, side: str) -> Path:
    return (world.mirror if side == "mirror" else world.primary) / "run"


def _victims_intact(victim: Path) -> list[str]:
    return [
        f"{p}: deleted or changed through a swapped-in symlink"
        for p in (victim / step_name(s) for s in (1, 2, 3, 4))
        if not p.exists() or p.read_bytes() != (f"victim {p.name[5:9].lstrip('0')}".encode())
    ]


def _swap(directory: Path, target: Path) -> None:
    directory.rename(directory.with_name(directory.name + ".parked"))
    directory.symlink_to(target, target_is_directory=True)


def _unswap(directory: Path) -> None:
    if directory.is_symlink():
        directory.unlink()
        directory.with_name(directory.name + ".parked").rename(directory)


@pytest.mark.parametrize("side", ["mirror", "primary"])
@pytest.mark.parametrize("when", ["after planning", "just before the unlink"])
def test_folder_swapped_for_a_symlink_between_plan_and_delete(
    when: str, side: str, world: World, checkpoints: Checkpoints, monkeypatch: pytest.MonkeyPatch, report: Report
) -> None:
    """The TOCTOU window of pruning, hit exactly: the run folder becomes a symlink to a victim folder."""
    tally = report.scenario(f"hostile: run folder swapped for a symlink {when} ({side} pruning)")
    config, victim = _prune_world(world, checkpoints, side)
    folder = _run_folder(world, side)
    swapped: list[bool] = []

    def swap_once() -> None:
        if not swapped:
            swapped.append(True)
            _swap(folder, victim)
            tally.fault("folder swapped for a symlink")

    if when == "after planning":
        real_plan = Pruner.plan

        def plan(self: Pruner, *args: Any, **kwargs: Any) -> Any:
            result = real_plan(self, *args, **kwargs)
            swap_once()
            return result

        monkeypatch.setattr(Pruner, "plan", plan)
    else:
        real_delete = LocalVolume.delete

        def delete(self: LocalVolume, rel: str, expected: Any) -> None:
            swap_once()
            real_delete(self, rel, expected)

        monkeypatch.setattr(LocalVolume, "delete", delete)
    mirror = LocalMirror(world.mirror)
    with mirror.lock():
        outcome = Pruner(config, LocalVolume(world.primary), mirror, mirror.read_manifest()).run_cycle()
    monkeypatch.undo()
    tally.rounds += 1
    tally.check(_victims_intact(victim))
    if swapped and not (outcome.failed or outcome.changed or outcome.skipped):
        tally.check(["deletions through the swapped folder were not refused"])
    _unswap(folder)
    tally.check(crash_violations(world))
    tally.assert_clean()
    assert swapped, "the swap never happened: nothing was planned for deletion"


def test_folder_flipping_to_a_symlink_while_mirrord_prunes(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """A real `mirrord prune` while another thread keeps flipping the run folder to a symlink and back."""
    tally, rng = report.seeded_scenario("hostile: run folder flipping to a symlink during a real mirrord prune", "flip")
    for n in range(SCALE.swap_rounds):
        side = "primary" if n % 3 == 2 else "mirror"
        config, victim = _prune_world(world, checkpoints, side)
        cfg = write_config(tmp_path / f"{side}.toml", world, prune=_prune_settings(side))
        folder = _run_folder(world, side)
        stop = threading.Event()
        pause = rng.uniform(0, 0.003)

        def flip(
            folder: Path = folder, victim: Path = victim, pause: float = pause, stop: threading.Event = stop
        ) -> None:
            while not stop.is_set():
                _swap(folder, victim)
                time.sleep(pause)  # how long the symlink stays: the shape of the fault, not a sync
                _unswap(folder)
                time.sleep(pause)

        flipper = threading.Thread(target=flip, name="chaos-flipper")
        flipper.start()
        try:
            zygote.run(["prune", "--config", cfg], tmp_path / f"prune-{n}.log", timeout=60)
        finally:
            stop.set()
            flipper.join()
        tally.rounds += 1
        tally.fault(f"folder flipping during a {side} prune")
        tally.check(_victims_intact(victim), f"round {n}")
        tally.check(crash_violations(world), f"round {n}")
        del config
    tally.assert_clean()


# ------------------------------------------------------------------------------------- names
def _hostile_names() -> dict[str, str]:
    long_stem = "step_0009_"
    return {
        "spaces": f"run/{step_name(1)[:-3]} with spaces.pt",
        "newline": "run/step_0002\nsecond line.pt",
        "tab and quotes": "run/step_0003\t\"quoted\" 'x'.pt",
        "unicode NFC": "run/step_0004 caf\u00e9.pt",
        "unicode NFD": "run/step_0005 cafe\u0301.pt",
        "emoji and RTL": "run/step_0006 \U0001f525 \u05e9\u05dc\u05d5\u05dd.pt",
        "leading dash": "run/-step_0007.pt",
        "backslash and colon": "run/step_0008 a\\b:c.pt",
        "250 bytes": "run/" + long_stem + "y" * (250 - len(long_stem) - 3) + ".pt",
        "not UTF-8": "run/" + os.fsdecode(b"step_0010 \xff\xfe.pt"),
        "odd folder": "weird dir \n \u00e9/step_0012.pt",
        "plain newest": f"run/{step_name(99)}",
    }


TOO_LONG = "run/step_0011_" + "z" * (255 - len("step_0011_") - 3) + ".pt"  # 255 bytes: NAME.part cannot exist


def test_hostile_names_are_mirrored(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """Spaces, newlines, quotes, NFC/NFD, emoji, RTL, a leading dash, 250 bytes, bytes that are not
    UTF-8: all mirrored and recorded. A 255-byte name cannot get its temp name: a clean, named failure."""
    tally = report.scenario("hostile: file names (spaces, newlines, unicode, not UTF-8, 250/255 bytes)")
    names = _hostile_names()
    rng = random.Random(31)
    for rel in names.values():
        world.install(rel, checkpoints.pick(rng, 400_000))
        tally.fault("hostile name")
    world.install(TOO_LONG, checkpoints.pick(rng, 400_000), in_place=True)
    tally.fault("hostile name")
    config, log, code = _sync_round(world, zygote, tmp_path, tally)
    if code != 1:
        tally.check([f"sync exited {code}; expected 1 (the 255-byte name cannot be mirrored)"])
    failed = {e["path"]: e for e in read_events(log, "copy.failed")}
    if TOO_LONG not in failed or "too long" not in str(failed[TOO_LONG].get("cause")):
        tally.check([f"the 255-byte name was not reported as too long: {list(failed)}"])
    tally.check([f"{rel!r}: failed: {e.get('cause')}" for rel, e in failed.items() if rel != TOO_LONG])
    expected = set(names.values())
    tally.check(converged_violations(world, expected), "sync")
    tally.check(latest_violations(zygote, config, world, tmp_path), "sync")
    # The daemon, from scratch, with the same names: it mirrors them and stays healthy.
    shutil.rmtree(world.mirror)

    def mirrored() -> bool:
        entries, _ = load_manifest(world.mirror)
        return expected <= set(entries)

    _daemon_round(
        world,
        tmp_path,
        tally,
        1,
        lambda _daemon: wait_for(mirrored, 60, "the daemon to mirror every hostile name", interval=0.02),
        "hostile names",
    )
    tally.check(converged_violations(world, expected), "daemon")
    tally.assert_clean()


# ------------------------------------------------------------------------ FIFOs and device nodes
def _special_files(primary: Path) -> dict[str, Callable[[Path], None]]:
    def unix_socket(path: Path) -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))

    return {
        f"run/{step_name(2)}": lambda p: os.mkfifo(p),
        f"run/{step_name(3)}": lambda p: os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 5)),  # /dev/zero
        f"run/{step_name(4)}": lambda p: os.mknod(p, stat.S_IFBLK | 0o644, os.makedev(7, 0)),  # /dev/loop0
        f"run/{step_name(5)}": unix_socket,
    }


@ROOT_ONLY
def test_fifos_and_device_nodes_are_never_opened_or_copied(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """A FIFO, /dev/zero and /dev/loop0 device nodes and a socket named like checkpoints: skipped,
    never read (a FIFO would block forever, /dev/zero never ends, a block device is a raw disk)."""
    tally = report.scenario("hostile: FIFO, device nodes and a socket in the primary")
    world.install(f"run/{step_name(1)}", checkpoints.blobs[0])
    for rel, make in _special_files(world.primary).items():
        make(world.primary / rel)
        tally.fault("special file")
    _config, log, code = _sync_round(world, zygote, tmp_path, tally)
    if code != 0:
        tally.check([f"sync exited {code}"])
    skipped = {e["path"] for e in read_events(log, "scan.skipped")}
    tally.check([f"{rel}: not reported as skipped" for rel in _special_files(world.primary) if rel not in skipped])
    tally.check(converged_violations(world, {f"run/{step_name(1)}"}))
    _daemon_round(world, tmp_path, tally, 0.5, _three_reconciles, "special files in the primary")
    tally.check(converged_violations(world, {f"run/{step_name(1)}"}))
    tally.assert_clean()


@ROOT_ONLY
@pytest.mark.parametrize("patch", ["fifo_at_open", "zero_device_at_open", "symlink_at_open"])
def test_checkpoint_swapped_for_a_special_file_before_the_copy_opens_it(
    patch: str, world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """The scan saw a regular file; by the time the copier opens it, it is a FIFO, /dev/zero or a
    symlink to a secret. The copy must fail at once, naming the file; it must not hang or leak."""
    tally = report.scenario(f"hostile: checkpoint swapped for a special file at open ({patch})")
    outside, secrets = _secret(tmp_path, checkpoints)
    rel = f"run/{step_name(1)}"
    world.install(rel, checkpoints.blobs[0])
    world.install(f"run/{step_name(2)}", checkpoints.blobs[1])
    config = write_config(tmp_path / "mirrord.toml", world)
    log = tmp_path / "sync.log"
    pid = zygote.spawn(
        ["sync", "--config", config],
        log,
        patch=f"{patch}:{rel}",
        env={"CHAOS_SYMLINK_TARGET": str(outside / "secret.pt")},
    )
    code = zygote.wait_or_kill(pid, 30)
    if code is None:
        tally.check(["mirrord sync hung on the swapped-in file"])
    tally.fault(patch)
    tally.rounds += 1
    if code is not None and code != 1:
        tally.check([f"sync exited {code}; the swapped file must be a failure"])
    failed = [e for e in read_events(log, "copy.failed") if e["path"] == rel]
    if code is not None and not failed:
        tally.check(["the swapped file was not reported as a failed copy"])
    tally.check(_leaked(world, secrets))
    if (world.mirror / rel).exists():
        tally.check(["the swapped file was copied"])
    tally.check([f"{t}: temp file left" for t in finals(world.mirror)[1]])
    world.history[rel] = []  # whatever is at that name now is no checkpoint
    tally.check(crash_violations(world))
    tally.assert_clean()


@ROOT_ONLY
def test_fifo_planted_on_the_mirror_does_not_hang_latest_or_verify(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """The newest recorded checkpoint on the mirror replaced by a FIFO: `latest` skips it and `verify`
    reports it, both promptly."""
    tally = report.scenario("hostile: FIFO in place of a recorded checkpoint on the mirror")
    for step in (1, 2):
        world.install(f"run/{step_name(step)}", checkpoints.blobs[step])
    config = write_config(tmp_path / "mirrord.toml", world)
    assert zygote.run(["sync", "--config", config], tmp_path / "sync.log") == 0
    newest = world.mirror / "run" / step_name(2)
    newest.unlink()
    os.mkfifo(newest)
    tally.fault("FIFO on the mirror")
    out = tmp_path / "latest.out"
    for command, want in (("latest", 0), ("verify", 1)):
        pid = zygote.spawn([command, "--config", config], tmp_path / f"{command}.log", stdout=out)
        code = zygote.wait_or_kill(pid, 30)
        tally.rounds += 1
        if code is None:
            tally.check([f"mirrord {command} hung on a FIFO on the mirror"])
        elif code != want:
            tally.check([f"mirrord {command} exited {code}, expected {want}"])
    lines = out.read_text(errors="replace").splitlines()
    if code is not None and str(world.mirror / "run" / step_name(1)) not in lines:
        tally.check([f"latest did not fall back to step 1: {lines}"])
    tally.assert_clean()


# ------------------------------------------------------------------------------- permission denied
def _sync_summary(config: Config) -> dict[str, Any]:
    outcome = mirrord.commands.sync.run_sync(config)
    return {"copied": sorted(outcome.copied), "failed": outcome.failed, "listing_errors": outcome.listing_errors}


@ROOT_ONLY
def test_permission_denied(world_tmp: Path, checkpoints: Checkpoints, report: Report) -> None:
    """Run as an unprivileged user: an unreadable checkpoint and an unlistable folder are reported
    with their paths; everything readable is mirrored."""
    tally = report.scenario("hostile: permission denied (unreadable file, unlistable folder)")
    world = World(world_tmp)
    world.primary.chmod(0o755)
    for step in (1, 2, 3):
        world.install(f"run/{step_name(step)}", checkpoints.blobs[step])
    world.install(f"locked/{step_name(4)}", checkpoints.blobs[4])
    (world.primary / "run").chmod(0o755)
    (world.primary / "run" / step_name(3)).chmod(0o000)
    (world.primary / "locked").chmod(0o000)
    world.mirror.mkdir()
    os.chown(world.mirror, NOBODY, NOBODY)
    tally.fault("unreadable file")
    tally.fault("unlistable folder")
    try:
        outcome = run_as_nobody(_sync_summary, make_config(world))
    finally:
        (world.primary / "locked").chmod(0o755)
    tally.rounds += 1
    value = outcome.get("value")
    if value is None:
        tally.check([f"sync as nobody raised: {outcome}"])
    else:
        failed = value["failed"]
        unreadable = f"run/{step_name(3)}"
        if unreadable not in failed or "ermission denied" not in failed[unreadable]:
            tally.check([f"unreadable file not reported: {failed}"])
        elif str(world.primary / unreadable) not in failed[unreadable]:
            tally.check([f"failure does not name the path: {failed[unreadable]}"])
        if not any("locked" in e for e in value["listing_errors"]):
            tally.check([f"unlistable folder not reported: {value['listing_errors']}"])
    readable = {f"run/{step_name(s)}" for s in (1, 2)}
    tally.check(converged_violations(world, readable))
    world.history.setdefault(f"run/{step_name(3)}", []).append(digest_bytes(checkpoints.blobs[3]))
    tally.assert_clean()
