"""A hostile environment around the mirror volume: unmounted under a running daemon, the same
directory under two names (bind mounts), its lock file removed, its manifest damaged, timestamps it
cannot store, sparse files. Real loop-mounted ext4 images, real `mount --bind`, real processes.

The promise checked everywhere: nothing is deleted while the real mirror is not there, nothing lands
on whatever lies under the mount point, two mirrord never work on one mirror, nothing is re-copied in
a loop, and what is published is whole (and as sparse as its source).
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from mirrord.store.manifest import MANIFEST_NAME, Manifest
from tests.chaos.harness import (
    ALGO,
    Checkpoints,
    LoopFs,
    Report,
    World,
    Zygote,
    converged_violations,
    crash_violations,
    latest_violations,
    loop_devices_unavailable,
    run_root,
    step_name,
    write_config,
)
from tests.support import config as support_config
from tests.support.daemon import DaemonProcess
from tests.support.gate import FuseMount
from tests.support.logs import read_events
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

NS = 10**9


def _needs_loop() -> None:
    reason = loop_devices_unavailable()
    if reason:
        pytest.skip(f"needs a loop-mounted filesystem: {reason}")


@pytest.fixture
def loop_mirror(loop_fs: Callable[..., LoopFs]) -> LoopFs:
    """An ext4 image on a loop device, mounted at tmp/mnt: the mirror root is the mount point itself."""
    return loop_fs("mnt", size_mb=64)


def _mirrored(world: World, rels: set[str]) -> bool:
    try:
        entries = Manifest.load(world.mirror).entries
    except Exception:  # a manifest being replaced or damaged by the scenario: not yet
        return False
    return all(rel in entries and (world.mirror / rel).is_file() for rel in rels)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ------------------------------------------------------------------------------- 1. unmounted mirror
def test_unmounted_mirror_is_never_written_and_nothing_is_deleted(
    loop_mirror: LoopFs, tmp_path: Path, checkpoints: Checkpoints, report: Report
) -> None:
    """Issue 15.1: `umount -l` of the mirror under a running daemon (keep_last = 2, prune.primary =
    true), then a checkpoint renamed into place and one written in place. Nothing may appear in the bare
    mount-point directory (no manifest, no copy), no primary step may be deleted, the mirror's free
    space gauge must not become the root disk's; after the remount everything is mirrored."""
    tally = report.scenario("hostile env: mirror unmounted (umount -l) under a running daemon")
    rng = random.Random(151)
    world = World(tmp_path / "w", mirror_at=loop_mirror.mount_point)
    settings = {
        "prune": {"enabled": True, "keep_last": 2, "primary": True, "min_age_seconds": 0},
        "watch": {"rescan_interval_seconds": 0.5},
        "copy": {"settle_seconds": 0.3},
        "log": {"level": "debug"},
    }
    daemon = DaemonProcess(tmp_path / "w", world.primary, world.mirror, settings)
    daemon.start()
    try:
        for step in range(1, 6):  # one at a time, each mirrored before the next (issue 14: a step
            # already below the window when first seen is never copied, so never pruned from the primary)
            world.install(f"run/{step_name(step)}", checkpoints.pick(rng))
            wait_for(
                lambda step=step: _mirrored(world, {f"run/{step_name(step)}"}),
                60,
                f"step {step} mirrored",
                interval=0.02,
            )
        kept = {f"run/{step_name(s)}" for s in (4, 5)}
        wait_for(
            lambda: _mirrored(world, kept) and set(world.primary_files()) == kept,
            60,
            "steps 4-5 mirrored and steps 1-3 pruned on both sides",
            interval=0.02,
        )
        run_root("umount", "-l", str(loop_mirror.mount_point))
        loop_mirror.mounted = False
        tally.fault("umount -l of the mirror")
        world.install(f"run/{step_name(6)}", checkpoints.pick(rng))  # renamed into place
        in_place = world.primary / "run" / step_name(7)
        in_place.write_bytes(checkpoints.pick(rng))  # written in place: the settle recheck's path
        world.history.setdefault(f"run/{step_name(7)}", []).append(hash_file(in_place, ALGO))
        tally.fault("checkpoint committed while the mirror is gone", 2)

        # Watch ten rescans (refused or not; 0.5 s apart, settle rechecks between them) for anything
        # landing in the bare directory or any primary deletion.
        def rescans() -> int:
            return len(daemon.events("reconcile.refused") + daemon.events("reconcile.finished"))

        base = rescans()
        for n in range(1, 11):
            wait_for(lambda n=n: rescans() >= base + n, 30, f"rescan {n} after the unmount", interval=0.02)
            tally.rounds += 1
            landed = _listing(loop_mirror.mount_point)
            if landed:
                tally.check([f"written to the bare mount point: {', '.join(landed[:5])}"])
                break
            missing = {f"run/{step_name(s)}" for s in (4, 5, 6, 7)} - set(world.primary_files())
            if missing:
                tally.check([f"primary {sorted(missing)} deleted while the mirror was unmounted"])
                break
        code, why = daemon.http("/readyz")
        tally.notes.append(f"/readyz while unmounted: {code} {why.strip()[:120]}")
        if code != 503:
            tally.check([f"/readyz answered {code} while the mirror was unmounted"])
        free_now = daemon.metric("mirrord_volume_free_bytes", 'volume="mirror"') or 0
        if free_now > 64 * 2**20:  # more than the whole 64 MiB mirror image: whatever lies underneath
            tally.check([f"mirror free bytes became {free_now:.0f}: the free space under the mount point"])
        loop_mirror.mount()
        tally.fault("remount")
        want = {f"run/{step_name(s)}" for s in (6, 7)}
        wait_for(lambda: _mirrored(world, want), 60, "steps 6-7 mirrored after the remount", interval=0.02)
    finally:
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.check(crash_violations(world))
    tally.assert_clean()


# ---------------------------------------------------------------------------- 2. roots by identity
def _bind(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    run_root("mount", "--bind", str(source), str(target))


@pytest.mark.host  # bind mounts
def test_bind_mounted_roots_are_refused(
    tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Issue 15.2: primary == mirror through `mount --bind p m`, a mirror bind-mounted inside the primary,
    and a mirror whose path runs through a bind mount of the primary. Every command refuses (exit 2,
    naming the mirror) and the trainer's checkpoints are never touched."""
    _needs_loop()  # root and mount(8)
    tally = report.scenario("hostile env: primary and mirror the same tree through bind mounts")
    rng = random.Random(152)
    world = World(tmp_path / "w")
    for step in range(1, 5):
        world.install(f"run/{step_name(step)}", checkpoints.pick(rng))
    before = world.primary_files()
    layouts = {
        "mirror is a bind mount of the primary": (tmp_path / "m1", tmp_path / "m1"),
        "mirror bind-mounted inside the primary": (world.primary / "inside", tmp_path / "m2"),
        "mirror path through a bind mount of the primary": (tmp_path / "alias", tmp_path / "alias" / "m3"),
    }
    sources = {
        "mirror is a bind mount of the primary": world.primary,
        "mirror bind-mounted inside the primary": tmp_path / "m2",
        "mirror path through a bind mount of the primary": world.primary,
    }
    (tmp_path / "m2").mkdir()
    for label, (mount_at, mirror) in layouts.items():
        _bind(sources[label], mount_at)
        tally.fault(label)
        try:
            config = write_config(
                tmp_path / "c.toml",
                world,
                mirror=str(mirror),
                prune={"enabled": True, "keep_last": 1, "primary": True, "min_age_seconds": 0},
            )
            for command in ("check-config", "sync", "prune", "run"):
                log = tmp_path / f"{command}.log"
                err = tmp_path / f"{command}.err"
                code = zygote.run([command, "--config", config], log, stdout=err, timeout=60)
                tally.rounds += 1
                if code != 2:
                    tally.check([f"{label}: mirrord {command} exited {code}, expected 2 (refused)"])
                if world.primary_files() != before:
                    tally.check([f"{label}: mirrord {command} changed the primary: {world.primary_files()}"])
        finally:
            if run_root("umount", str(mount_at), check=False).returncode != 0:
                run_root("umount", "-l", str(mount_at))  # a killed mirrord may still be releasing it
    tally.assert_clean()


# ------------------------------------------------------------------------------------------- 5. lock
def test_removed_lock_file_stops_the_daemon_and_lock_does_not_pin_the_mirror(
    loop_mirror: LoopFs, tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Issue 15.5: `.mirrord.lock` removed under a running daemon lets a second mirrord in; the daemon
    must notice (next heartbeat) and stop cleanly before doing more. A running sync whose lock is
    removed stops too. And holding the lock must not keep the mirror busy: `mount -o remount,ro` works."""
    tally = report.scenario("hostile env: lock file removed; remount,ro under a running daemon")
    rng = random.Random(155)
    world = World(tmp_path / "w", mirror_at=loop_mirror.mount_point)
    world.install(f"run/{step_name(1)}", checkpoints.pick(rng))
    daemon = DaemonProcess(tmp_path / "w", world.primary, world.mirror, {"log": {"level": "info"}})
    daemon.start()
    try:
        wait_for(lambda: _mirrored(world, {f"run/{step_name(1)}"}), 30, "step 1 mirrored", interval=0.02)

        # A copy or a journal append in flight holds a file open for writing for a moment: retry for a
        # while; only a descriptor held for good (the lock) keeps it busy throughout.
        def remount_ro() -> subprocess.CompletedProcess[str] | None:
            result = run_root("mount", "-o", "remount,ro", str(loop_mirror.mount_point), check=False)
            return result if result.returncode == 0 else None

        tally.fault("mount -o remount,ro under the daemon")
        tally.rounds += 1
        try:
            wait_for(remount_ro, 10, "mount -o remount,ro of the mirror", interval=0.2)
        except AssertionError as exc:
            tally.check([f"remount,ro refused while the daemon runs: {exc}"])
        else:
            run_root("mount", "-o", "remount,rw", str(loop_mirror.mount_point))
        (world.mirror / ".mirrord.lock").unlink()
        tally.fault("lock file removed under the daemon")
        tally.rounds += 1
        try:
            daemon.proc.wait(timeout=30)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            tally.check(["the daemon kept running after its lock file was removed"])
        else:
            if daemon.proc.returncode != 1 or not daemon.events("mirror.lock_lost"):  # type: ignore[union-attr]
                tally.check([f"daemon exited {daemon.proc.returncode} without mirror.lock_lost"])  # type: ignore[union-attr]
    finally:
        daemon.kill()
    # A sync whose lock is removed mid-run stops; the second sync then owns the mirror alone.
    for step in range(2, 8):
        world.install(f"run/{step_name(step)}", checkpoints.pick(rng))
    # The sync reads the primary through a gate that holds its copy in flight until it says it cancels it.
    (tmp_path / "gate").mkdir()
    gate = FuseMount(world.primary, tmp_path / "gated", tmp_path / "gate")
    try:
        gate.stall("*")
        config = support_config.write_config(
            tmp_path / "held.toml",
            support_config.settings(gate.mount_point, world.mirror, support_config.CHAOS, {"copy": {"workers": 1}}),
        )
        first = zygote.spawn(["sync", "--config", config], tmp_path / "sync-1.log")
        wait_for(
            lambda: read_events(tmp_path / "sync-1.log", "copy.started"), 30, "the first sync copying", interval=0.02
        )
        (world.mirror / ".mirrord.lock").unlink()
        tally.fault("lock file removed under a running sync")
        tally.rounds += 1
        with contextlib.suppress(AssertionError):  # a sync that does not notice is reported below
            gate.unstall_once_cancelling(tmp_path / "sync-1.log")
        status = zygote.wait_or_kill(first, 30)
    finally:
        gate.close()
    if status is None:
        tally.check(["the first sync kept running after its lock file was removed"])
    elif not read_events(tmp_path / "sync-1.log", "mirror.lock_lost"):
        tally.check([f"the first sync exited {status} without noticing the lock was lost"])
    fast = write_config(tmp_path / "fast.toml", world)
    assert zygote.run(["sync", "--config", fast], tmp_path / "sync-2.log") == 0
    tally.check(converged_violations(world, world.primary_files()))
    tally.assert_clean()


# ------------------------------------------------------------------ 6. timestamps it cannot store
def test_timestamps_the_mirror_cannot_store_are_not_recopied(
    coarse_ext4: LoopFs, tmp_path: Path, checkpoints: Checkpoints, report: Report
) -> None:
    """Issue 15.6: a source mtime in 2040 on a mirror that clamps to 2038 was copied again at every
    rescan, forever. Each file must be copied once; and a mirror copy whose mtime keeps being changed
    behind mirrord's back (a sync tool, say) is re-copied at most a few times, then reported."""
    tally = report.scenario("hostile env: mtimes the mirror cannot store (2040 on 128-byte-inode ext4)")
    rng = random.Random(156)
    world = World(tmp_path / "w", mirror_at=coarse_ext4.mount_point / "mirror")
    y2040 = 2_218_000_000 * NS
    for step in (1, 2):
        world.install(f"run/{step_name(step)}", checkpoints.pick(rng), mtime_ns=y2040 + step * NS)
    tally.fault("mtime in 2040", 2)
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {"watch": {"rescan_interval_seconds": 0.3}, "log": {"level": "info"}},
    )
    daemon.start()
    try:
        wait_for(lambda: _mirrored(world, set(world.primary_files())), 30, "both files mirrored", interval=0.02)
        start = len(daemon.events("reconcile.finished"))
        wait_for(lambda: len(daemon.events("reconcile.finished")) >= start + 10, 60, "ten more rescans", interval=0.02)
        tally.rounds += 10
        copies = len(daemon.events("copy.committed"))
        tally.notes.append(f"copies of 2 files over 10+ rescans: {copies}")
        if copies != 2:
            tally.check([f"{copies} copies for 2 files: re-copied because of the clamped mtime"])
        # Something keeps changing the copy's mtime: a loop mirrord must break by itself.
        target = world.mirror / "run" / step_name(1)
        stop = threading.Event()

        def meddle() -> None:
            while not stop.wait(0.05):
                with contextlib.suppress(OSError):
                    os.utime(target, ns=(1_600_000_000 * NS, 1_600_000_000 * NS))

        meddler = threading.Thread(target=meddle, daemon=True)
        meddler.start()
        tally.fault("mirror copy's mtime reset behind mirrord's back")
        try:
            daemon.wait_event("copy.loop", timeout=60)
            start = len(daemon.events("reconcile.finished"))
            wait_for(
                lambda: len(daemon.events("reconcile.finished")) >= start + 10, 60, "ten more rescans", interval=0.02
            )
            tally.rounds += 10
        finally:
            stop.set()
            meddler.join()
        recopies = len(daemon.events("copy.committed", path=f"run/{step_name(1)}")) - 1
        tally.notes.append(f"re-copies while the mtime was being reset: {recopies}, then reported (copy.loop)")
        if recopies > 4:
            tally.check([f"re-copied {recopies} times in a loop"])
        if daemon.metric("mirrord_copy_loop_files") != 1:
            tally.check(["mirrord_copy_loop_files does not report the looping file"])
        status = subprocess.run(
            [*_mirrord(), "status", "--config", str(daemon.config_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if status.returncode != 1 or "copied again and again" not in status.stdout:
            tally.check([f"mirrord status exited {status.returncode} without the looping file as a problem"])
    finally:
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.assert_clean()


# ------------------------------------------------------------------------------- 12. the manifest
def test_manifest_damaged_under_a_running_daemon_is_repaired(
    tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Issue 15.12: the manifest overwritten with garbage, truncated, or replaced by a directory while
    the daemon runs. The daemon notices at its next heartbeat, rewrites it from memory (counted), or -
    if it cannot - stops being ready, naming the manifest. Offline, `mirrord repair-manifest` rebuilds it
    by re-hashing and validating the files, and leaves out a damaged one."""
    tally = report.scenario("hostile env: manifest damaged while the daemon runs; repair-manifest")
    rng = random.Random(1512)
    world = World(tmp_path / "w")
    for step in range(1, 5):
        world.install(f"run/{step_name(step)}", checkpoints.pick(rng))
    daemon = DaemonProcess(tmp_path / "w", world.primary, world.mirror, {"log": {"level": "info"}})
    daemon.start()
    manifest = world.mirror / MANIFEST_NAME
    config = write_config(tmp_path / "c.toml", world)
    try:
        wait_for(lambda: _mirrored(world, set(world.primary_files())), 30, "everything mirrored", interval=0.02)
        good = Manifest.load(world.mirror).entries
        for n, (label, damage) in enumerate(
            (
                ("overwritten with garbage", lambda: manifest.write_bytes(b"\x00garbage" * 10)),
                ("truncated in place", lambda: os.truncate(manifest, manifest.stat().st_size // 2)),
                ("bytes flipped in place", lambda: _flip(manifest)),
                ("removed", manifest.unlink),
                ("journal overwritten with garbage", lambda: _journal(world).write_bytes(b"garbage\n")),
                ("journal removed", lambda: _journal(world).unlink()),
            ),
            start=1,
        ):
            damage()
            tally.fault(f"manifest {label}")
            tally.rounds += 1
            wait_for(
                lambda n=n: daemon.metric("mirrord_manifest_repairs_total") == n,
                30,
                f"repair #{n} ({label})",
                interval=0.02,
            )
            if Manifest.load(world.mirror).entries != good:
                tally.check([f"after the repair ({label}) the manifest is not what the daemon holds"])
            tally.check(latest_violations(zygote, config, world, tmp_path), label)
        manifest.unlink()
        manifest.mkdir()
        tally.fault("manifest replaced by a directory")
        tally.rounds += 1
        wait_for(
            lambda: daemon.http("/readyz")[0] == 503, 30, "/readyz to refuse an unwritable manifest", interval=0.02
        )
        why = daemon.http("/readyz")[1]
        if MANIFEST_NAME not in why or "repair-manifest" not in why:
            tally.check([f"/readyz does not name the manifest and the way out: {why.strip()}"])
        manifest.rmdir()
        wait_for(lambda: daemon.http("/readyz")[0] == 200 and manifest.is_file(), 30, "recovery", interval=0.02)
    finally:
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    # Offline: a damaged manifest stops a restart, naming repair-manifest; the repair rebuilds it.
    manifest.write_bytes(b"{not json")
    tally.fault("manifest damaged while no daemon runs")
    restart = subprocess.run(
        [*_mirrord(), "run", "--config", str(config)], capture_output=True, text=True, timeout=60, check=False
    )
    code = restart.returncode
    if code != 1 or "repair-manifest" not in restart.stderr:
        tally.check([f"a restart on a damaged manifest exited {code} without naming repair-manifest"])
    victim = world.mirror / "run" / step_name(2)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the mirror copy rots: repair must not vouch for it
    victim.write_bytes(bytes(data))
    tally.fault("a mirror copy damaged before the repair")
    out = tmp_path / "repair.out"
    code = zygote.run(["repair-manifest", "--config", config], tmp_path / "repair.log", stdout=out)
    tally.rounds += 1
    entries = Manifest.load(world.mirror).entries
    if code != 1 or f"run/{step_name(2)}" in entries:
        tally.check([f"repair-manifest exited {code} and recorded the damaged copy: {sorted(entries)}"])
    if set(entries) != set(world.primary_files()) - {f"run/{step_name(2)}"}:
        tally.check([f"repair-manifest recorded {sorted(entries)}"])
    assert zygote.run(["sync", "--config", config], tmp_path / "sync.log") == 0
    tally.check(converged_violations(world, world.primary_files()))
    tally.assert_clean()


def _journal(world: World) -> Path:
    """The manifest's current journal (the newest generation)."""
    journals = sorted(world.mirror.glob(".mirrord-manifest.journal.*"), key=lambda p: int(p.suffix[1:]))
    return journals[-1]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x20
    path.write_bytes(bytes(data))


def _mirrord() -> list[str]:
    return [sys.executable, "-m", "mirrord"]


# ---------------------------------------------------------------------------------- 16. sparse files
def test_sparse_checkpoints_stay_sparse(
    tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Issue 15.16: a checkpoint with a 256 MiB hole used 256 MiB on the mirror. The copy must take the
    space of the data only, read back identical, and verify."""
    tally = report.scenario("hostile env: sparse checkpoints (256 MiB holes)")
    world = World(tmp_path / "w")
    blob = max(checkpoints.blobs, key=len)
    layouts = {
        "hole in the middle": (blob, 256 << 20, blob),
        "hole at the end": (blob, 256 << 20, b""),
        "hole at the start": (b"", 256 << 20, blob),
    }
    for step, (label, (head, hole, tail)) in enumerate(layouts.items(), start=1):
        rel = f"run/{step_name(step)}"
        path = world.primary / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            # Zips around a hole are no whole torch.save zip, and such a source is never published
            # (issue 14); a leading non-zip line makes them a format mirrord does not check.
            head = b"not a zip: sparse test data\n" + head
            f.write(head)
            f.seek(len(head) + hole)
            f.write(tail)
            f.truncate(len(head) + hole + len(tail))
        os.utime(path, ns=(1_700_000_000 * NS + step, 1_700_000_000 * NS + step))
        world.history.setdefault(rel, []).append(hash_file(path, ALGO))
        tally.fault(label)
    config = write_config(tmp_path / "c.toml", world)
    assert zygote.run(["sync", "--config", config], tmp_path / "sync.log") == 0
    for rel in world.primary_files():
        tally.rounds += 1
        src, dst = (world.primary / rel).stat(), (world.mirror / rel).stat()
        tally.notes.append(
            f"{rel}: {src.st_size >> 20} MiB, source uses {src.st_blocks * 512 >> 10} KiB, "
            f"mirror uses {dst.st_blocks * 512 >> 10} KiB"
        )
        if dst.st_blocks > src.st_blocks + 2048:  # + 1 MiB of slack for block rounding
            tally.check(
                [
                    f"{rel}: the mirror copy uses {dst.st_blocks * 512} bytes, "
                    f"its source {src.st_blocks * 512}: not sparse"
                ]
            )
    tally.check(converged_violations(world, world.primary_files()))
    code = zygote.run(["verify", "--config", config], tmp_path / "verify.log")
    tally.check([] if code == 0 else [f"mirrord verify exited {code}"])
    tally.assert_clean()
