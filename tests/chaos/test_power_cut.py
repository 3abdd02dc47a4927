"""Power cuts for real: the mirror on ext4 in a loop device, cut with EXT4_IOC_SHUTDOWN (no log flush).

The ioctl with EXT4_GOING_FLAGS_NOLOGFLUSH stops the filesystem dead: whatever the journal had not
committed is lost, exactly as if the power had gone. After unmount and remount (journal replay),
everything `mirrord sync` logged as `copy.committed` before the cut must be there, whole, and in the
manifest. The same harness runs copiers with one step of the protocol removed, to show that it notices.

Unlike a real power cut, the ioctl leaves the process running, and an fsync already under way when
it strikes can still return success for a journal transaction the shutdown discarded (the kernel
takes a transaction that is no longer running or committing as committed). A line logged after that
was never "logged before the power went": only lines timestamped before the cut began count.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import random
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from tests.chaos.harness import (
    ALGO,
    SCALE,
    Checkpoints,
    LoopFs,
    Report,
    Tally,
    World,
    Zygote,
    converged_violations,
    crash_violations,
    load_manifest,
    loop_devices_unavailable,
    seeded_rng,
    split_unreadable,
    step_name,
    unreadable,
    write_config,
)
from tests.support.logs import read_events
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

_REASON = loop_devices_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"power-cut tests need loop devices: {_REASON}")


def _ior(kind: str, nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (ord(kind) << 8) | nr


EXT4_IOC_SHUTDOWN = _ior("X", 125, 4)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def power_cut(mount_point: Path) -> None:
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


@pytest.fixture
def ext4(loop_fs: Callable[..., LoopFs]) -> LoopFs:
    return loop_fs("mnt", size_mb=96)


def test_remount_after_a_cut_is_fresh_even_if_another_namespace_holds_the_mount(ext4: LoopFs) -> None:
    """A mount namespace created while the mirror is mounted (unshare, a container build) keeps the cut
    filesystem alive after our unmount; the remount must still be a fresh, readable filesystem."""
    (ext4.mount_point / "before.bin").write_bytes(b"x" * 4096)
    os.sync()
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sleep", "600"], start_new_session=True
    )
    try:
        wait_for(
            lambda: Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep",
            60,
            "the namespace holder",
            interval=0.02,
        )
        power_cut(ext4.mount_point)
        ext4.umount()
        ext4.mount(after_shutdown=True)
        assert (ext4.mount_point / "before.bin").read_bytes() == b"x" * 4096
        (ext4.mount_point / "after.bin").write_bytes(b"y")
        assert ext4.stale_devices, "the superblock outlived the unmount: the harness must notice"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def _version(world: World, rel: str, digest: str) -> str:
    """A digest as the version number(s) of rel it was (v1 is the first written), for messages."""
    numbers = [str(i + 1) for i, d in enumerate(world.history.get(rel, ())) if d == digest]
    return f"v{'/v'.join(numbers)} ({digest[:12]})" if numbers else f"no version ({digest[:12]})"


def _committed_violations(world: World, committed: dict[str, str], source: dict[str, str]) -> list[str]:
    """Every file logged as committed is on the mirror and in the manifest: that version or a later one.
    `source` names the log that said so (for the message)."""
    violations: list[str] = []
    entries, _ = load_manifest(world.mirror)
    for rel, digest in sorted(committed.items()):
        versions = world.history[rel]
        later = set(versions[versions.index(digest) :]) if digest in versions else {digest}
        said = f"committed {_version(world, rel, digest)} per {source.get(rel, '?')}"
        path = world.mirror / rel
        try:
            if not path.is_file():
                violations.append(f"{rel}: logged as committed, missing after the power cut")
                continue
            digest, size = hash_file(path, ALGO), path.stat().st_size
        except OSError as exc:  # EIO after the remount: an outcome to record, not a crash of the harness
            violations.append(unreadable(rel, exc))
            continue
        if digest not in later:
            violations.append(f"{rel}: logged as committed, after the power cut holds other bytes ({size} bytes)")
        entry = entries.get(rel)
        if entry is None:
            violations.append(f"{rel}: logged as committed, not in the manifest after the power cut")
        elif entry.digest not in later:
            violations.append(
                f"{rel}: logged as committed, the manifest after the power cut records an older version "
                f"({said}; the manifest records {_version(world, rel, entry.digest)}, the mirror "
                f"holds {_version(world, rel, digest)})"
            )
    return violations


def keep_evidence(world: World, logs: list[Path], found: list[str], where: Path) -> Path:
    """Copy what a failed round leaves behind (the manifest's snapshot and journals as the remount shows
    them, a listing of the mirror, the logs, the violations) before the restart changes any of it."""
    where.mkdir(parents=True, exist_ok=True)
    listing = []
    for path in sorted(world.mirror.rglob("*")):
        try:
            st = path.lstat()
        except OSError as exc:
            listing.append(f"{path.relative_to(world.mirror)}: {exc}")
            continue
        listing.append(f"{path.relative_to(world.mirror)} size={st.st_size} mtime_ns={st.st_mtime_ns} ino={st.st_ino}")
        if path.parent == world.mirror and path.name.startswith(".mirrord-manifest") and path.is_file():
            with contextlib.suppress(OSError):
                shutil.copy2(path, where / path.name)
    (where / "mirror.txt").write_text("\n".join(listing) + "\n")
    for log in logs:
        with contextlib.suppress(OSError):
            shutil.copy2(log, where / log.name)
    history = {rel: [d[:12] for d in digests] for rel, digests in sorted(world.history.items())}
    (where / "violations.txt").write_text(
        "\n".join(found)
        + "\n\nhistory (v1 first):\n"
        + "\n".join(f"{r}: {' '.join(h)}" for r, h in history.items())
        + "\n"
    )
    return where


def run_power_cuts(
    rounds: int,
    patch: str | None,
    tally: Tally,
    world: World,
    fs: LoopFs,
    zygote: Zygote,
    checkpoints: Checkpoints,
    rng: random.Random,
    workdir: Path,
    after: float = 0.25,
    until_revealing: int = 0,
) -> tuple[int, int]:
    """Returns (rounds in which the power cut left a violation behind, rounds that could reveal a
    missing fsync). A fraction `after` of the cuts come just after the process finished (what it
    logged must survive that).

    A round can reveal a missing fsync only if writes nobody fsynced are lost by the cut. Each round
    writes a canary file without fsync as the sync starts: if it survives the cut, something made it
    durable (a journal commit, or another process's sync(): `stress-ng --io` calls it in a loop), and
    a broken copier would have got away with it too. With `until_revealing`, rounds go on (up to 3x)
    until that many rounds could reveal one.

    A file the remounted filesystem will not read (EIO) is an outcome, never a crash: with a broken
    copier it counts as caught; with mirrord it is a finding in the tally (reported in RESULTS.md and
    in the test's result), and the restart that round is judged on what can still be read."""
    # A bandwidth cap stretches the copies, so that cuts land inside them as well as between them.
    config = write_config(workdir / "sync.toml", world, copy={"workers": 2}, io={"bandwidth_limit": 40 * 2**20})
    committed: dict[str, str] = {}
    source: dict[str, str] = {}  # rel -> the log whose copy.committed is in `committed`
    caught = 0
    duration = 0.3
    names = [f"run-{r}/{step_name(s)}" for r in "ab" for s in range(1, 7)]
    canary = fs.mount_point / ".canary"  # outside the mirror: no invariant looks at it
    revealing = 0
    late = 0  # copy.committed lines logged after a cut began: not counted
    for n in itertools.count():
        if n >= rounds and (revealing >= until_revealing or n >= 3 * rounds):
            break
        for rel in rng.sample(names, k=rng.randint(2, 4)):
            world.install(rel, checkpoints.pick(rng))
        log = workdir / f"cut-{n}.log"
        canary_bytes = os.urandom(64 * 1024)
        try:
            canary.write_bytes(canary_bytes)  # deliberately never fsynced
        except OSError as exc:  # the filesystem under test is failing: an outcome, not a crash
            tally.findings.append(f"cut {n}: cannot write the canary: {exc.strerror or exc}")
            canary_bytes = b""
        spawned = time.time()
        pid = zygote.spawn(["sync", "--config", config], log, patch=patch)
        if rng.random() < after:
            # Power lost moments after mirrord exited: what it logged as committed must be on disk.
            zygote.wait(pid, 120)
            time.sleep(rng.uniform(0, 0.3))  # the instant of the power cut, not a synchronization
        else:
            time.sleep(rng.uniform(0, duration))  # the instant of the power cut, not a synchronization
        cut_at = time.time()
        power_cut(fs.mount_point)
        status = zygote.wait_or_kill(pid, 60)
        if status is None:
            tally.check([f"mirrord sync hung after the power cut (log {log})"], f"cut {n}")
        finished = read_events(log, "sync.finished")
        if status == 0 and finished:
            duration = datetime.fromisoformat(finished[0]["timestamp"]).timestamp() - spawned
        tally.fault("power cut after the sync finished" if status == 0 else "power cut during the sync")
        fs.umount()
        fs.mount(after_shutdown=True)  # replays the journal: this is the state a rebooted machine would see
        try:
            revealing += bool(canary_bytes) and canary.read_bytes() != canary_bytes
        except OSError:  # gone, or unreadable: lost all the same
            revealing += bool(canary_bytes)
        with contextlib.suppress(OSError):
            canary.unlink()
        for event in read_events(log, "copy.committed"):
            if datetime.fromisoformat(event["timestamp"]).timestamp() >= cut_at:
                late += 1  # logged after the power was gone (see the module docstring): nothing vouches for it
                continue
            committed[event["path"]] = event["digest"]
            source[event["path"]] = f"{log.name} at {event['timestamp']}"
        found = _committed_violations(world, committed, source) + crash_violations(world)
        io_errors, found_rest = split_unreadable(found)
        if patch is None and io_errors:
            tally.findings.extend(f"cut {n}: {v}" for v in io_errors)
            found = found_rest
        if patch is None and found:  # mirrord failed: keep the evidence, the restart would change it
            kept = keep_evidence(world, [log, *workdir.glob("restart-*.log")], found, workdir / f"evidence-cut-{n}")
            tally.notes.append(f"cut {n}: evidence kept in {kept}")
        tally.check(found, f"cut {n} ({patch or 'mirrord'})")
        caught += bool(found)
        tally.rounds += 1
        restart_log = workdir / f"restart-{n}.log"
        code = zygote.run(["sync", "--config", config], restart_log)
        for event in read_events(restart_log, "copy.committed"):
            committed[event["path"]] = event["digest"]
            source[event["path"]] = f"{restart_log.name} at {event['timestamp']}"
        recovered = converged_violations(world, world.primary_files())
        if code != 0:
            recovered.append(f"the sync after the power cut exited {code} (log {restart_log})")
        if patch is None:
            io_after, recovered = split_unreadable(recovered)
            if io_errors or io_after:  # the filesystem, not mirrord, failed this round: report it
                tally.findings.extend(f"restart after cut {n}: {v}" for v in io_after + recovered)
                recovered = []
            tally.check(recovered, f"restart after cut {n}")
    tally.notes.append(
        f"{late} copy.committed line(s) logged after the cut had begun: not counted (a real power "
        "cut leaves no process to log them)"
    )
    if fs.stale_devices:
        tally.notes.append(
            f"{len(fs.stale_devices)} remount(s) on a fresh loop device: another mount namespace "
            "kept the cut filesystem alive"
        )
    return caught, revealing


def test_power_cut_never_loses_what_was_logged_committed(
    ext4: LoopFs, tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Power cuts at random instants during and after `mirrord sync`; remount; restart; check."""
    tally, rng = report.seeded_scenario("power cut (ext4 EXT4_IOC_SHUTDOWN, no log flush)", "power-cut")
    world = World(tmp_path, mirror_at=ext4.mount_point / "mirror")
    run_power_cuts(SCALE.power_cuts, None, tally, world, ext4, zygote, checkpoints, rng, tmp_path)
    tally.assert_clean()


@pytest.mark.parametrize("broken", ["no_file_fsync", "no_dir_fsync", "rename_before_fsync"])
def test_power_cut_catches_a_broken_copier(
    broken: str, ext4: LoopFs, tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """The same rounds with a copier that skips or misorders one step: the harness must notice."""
    tally = report.scenario(f"power cut: broken copier ({broken}) is caught", expect_violations=True)
    rng, seed = seeded_rng(f"power-cut-{broken}")
    world = World(tmp_path, mirror_at=ext4.mount_point / "mirror")
    # Half the cuts just after the sync: the moment when a missing fsync is most likely to show.
    target = SCALE.broken_power_cuts
    caught, revealing = run_power_cuts(
        target,
        broken,
        tally,
        world,
        ext4,
        zygote,
        checkpoints,
        rng,
        tmp_path,
        after=0.5,
        until_revealing=target if broken == "no_file_fsync" else 0,
    )
    tally.notes.append(
        f"seed {seed}; caught in {caught} of {tally.rounds} rounds ({revealing} of which lost an un-fsynced canary)"
    )
    # ext4 commits metadata in order, and any fsync commits all that came before: the fsync of the manifest
    # journal that follows every publication therefore also makes a rename durable whose directory was not
    # fsynced. On ext4 a power cut cannot reveal that copier; the syscall order check does (test_syscall_order).
    if broken in ("rename_before_fsync", "no_dir_fsync") or caught:
        return
    if revealing < target // 4:
        pytest.skip(
            f"only {revealing} of {tally.rounds} power cuts lost an un-fsynced write (another process's "
            f"sync() made them durable?): this machine cannot reveal the {broken} copier now"
        )
    raise AssertionError(
        f"{tally.rounds} power cuts ({revealing} losing un-fsynced writes) did not reveal the {broken} copier"
    )
