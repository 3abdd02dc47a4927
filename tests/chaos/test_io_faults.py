"""I/O faults: EIO and ENOSPC at the k-th write / fsync / rename / read, LD_PRELOAD fault injection with
libfiu in real processes, a really full filesystem, and a source that changes under the copier.

After every fault: the failure is reported with the path and the cause, no temp file is left, no
final name holds anything but a whole version of its source, the manifest parses; and the next
clean sync converges.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mirrord.commands.sync import SyncReport, run_sync
from mirrord.errors import MirrordError
from mirrord.store.volume import LocalUpload
from tests.chaos.harness import (
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
    latest_inprocess_violations,
    make_config,
    step_name,
    write_config,
)
from tests.support.checkpoints import save_checkpoint
from tests.support.logs import read_events

SMALL = 400_000
MARK = "user.mirrord-chaos-fsync-failed"


class Kth:
    """Raise OSError(err) on the k-th call (counting every call through tick())."""

    def __init__(self, k: int, err: int) -> None:
        self.k, self.err, self.calls, self.fired = k, err, 0, False

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.k:
            self.fired = True
            raise OSError(self.err, os.strerror(self.err))


@pytest.fixture
def busy_world(world: World, checkpoints: Checkpoints) -> Iterator[tuple[World, Callable[[], None]]]:
    """A synced mirror, then a cycle of work (a replaced file, a new folder, a new file); reset()
    puts the mirror back to its state before that cycle."""
    rng = random.Random(5)
    for step in (1, 2, 3):
        world.install(f"run-a/{step_name(step)}", checkpoints.pick(rng, SMALL))
    assert run_sync(make_config(world)).ok
    reset = world.mirror_reset(world.base / "baseline")
    world.install(f"run-a/{step_name(2)}", checkpoints.pick(rng, SMALL))
    world.install(f"run-b/{step_name(4)}", checkpoints.pick(rng, SMALL))
    world.install(f"run-a/{step_name(5)}", checkpoints.pick(rng, SMALL))
    yield world, reset


def _sync(world: World, **copy: Any) -> SyncReport | MirrordError:
    try:
        return run_sync(make_config(world, copy={"workers": 1, "max_attempts": 1, **copy}))
    except MirrordError as exc:  # a manifest that cannot be written ends the pass
        return exc


def _after_fault(tally: Tally, world: World, outcome: SyncReport | MirrordError, inj: Kth, context: str) -> None:
    """The failed pass reported the fault with a path and its cause, and left nothing half-done."""
    if inj.fired:
        tally.fault(f"{os.strerror(inj.err)} injected")
        messages = [str(outcome)] if isinstance(outcome, MirrordError) else list(outcome.failed.values())
        if not messages:
            tally.check(["an injected fault went unreported"], context)
        for text in messages:
            if str(world.primary) not in text and str(world.mirror) not in text:
                tally.check([f"failure does not name the path: {text}"], context)
            if os.strerror(inj.err) not in text:
                tally.check([f"failure does not name the cause: {text}"], context)
    temps = finals(world.mirror)[1]
    tally.check([f"{t}: temp file left by a failed copy" for t in temps], context)
    tally.check(crash_violations(world), context)


def _heals(tally: Tally, world: World, context: str) -> None:
    outcome = _sync(world)
    if not isinstance(outcome, SyncReport) or not outcome.ok:
        tally.check([f"clean sync after the fault failed: {outcome}"], context)
    tally.check(converged_violations(world, world.primary_files()), context)
    tally.check(latest_inprocess_violations(world), context)


def _count_calls(world: World, reset: Callable[[], None], patch: Callable[[Kth], None]) -> int:
    counter = Kth(0, errno.EIO)
    patch(counter)
    outcome = _sync(world)
    assert isinstance(outcome, SyncReport) and outcome.ok
    reset()
    return counter.calls


def _kth_fault_rounds(
    tally: Tally,
    world: World,
    reset: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
    install: Callable[[pytest.MonkeyPatch, Kth], None],
    err: int,
    limit: int,
) -> None:
    with monkeypatch.context() as m:
        total = _count_calls(world, reset, lambda inj: install(m, inj))
    # The first calls, one past them, and the pass's last call (the end-of-pass compaction's directory
    # fsync, rename): a fault there must be reported too, whatever the scale.
    for k in sorted({*range(1, min(total, limit) + 2), total}):
        for attempts in (1, 3):
            reset()
            inj = Kth(k, err)
            with monkeypatch.context() as m:
                install(m, inj)
                outcome = _sync(world, max_attempts=attempts)
            context = f"k={k}, max_attempts={attempts}"
            tally.rounds += 1
            if attempts == 1:
                _after_fault(tally, world, outcome, inj, context)
                _heals(tally, world, context)
            else:
                # One fault and retries: a copy is retried and the pass succeeds; a manifest that
                # cannot be written ends the pass (it is the record everything else trusts).
                if inj.fired:
                    tally.fault(f"{os.strerror(err)} injected, with retries")
                if isinstance(outcome, SyncReport) and not outcome.ok:
                    tally.check([f"a single fault was not retried: {outcome.failed}"], context)
                if isinstance(outcome, MirrordError):
                    _after_fault(tally, world, outcome, inj, context)
                tally.check(crash_violations(world), context)
                _heals(tally, world, context)


def _on_upload_write(m: pytest.MonkeyPatch, inj: Kth) -> None:
    real = LocalUpload.write

    def write(self: LocalUpload, data: memoryview) -> None:
        inj.tick()
        real(self, data)

    m.setattr(LocalUpload, "write", write)


def _on_os(name: str) -> Callable[[pytest.MonkeyPatch, Kth], None]:
    def install(m: pytest.MonkeyPatch, inj: Kth) -> None:
        real = getattr(os, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            inj.tick()
            return real(*args, **kwargs)

        m.setattr(os, name, call)

    return install


@pytest.mark.parametrize(
    ("where", "err"),
    [("write", errno.EIO), ("write", errno.ENOSPC), ("fsync", errno.EIO), ("replace", errno.EIO), ("readv", errno.EIO)],
)
def test_fault_at_every_kth_call(
    where: str,
    err: int,
    busy_world: tuple[World, Callable[[], None]],
    monkeypatch: pytest.MonkeyPatch,
    report: Report,
) -> None:
    """EIO/ENOSPC on the k-th data write, fsync, rename or source read of one sync, for every k (up to
    the scale's limit, and the last one)."""
    world, reset = busy_world
    tally = report.scenario(f"I/O fault: {errno.errorcode[err]} at the k-th {where} (every k)")
    install = _on_upload_write if where == "write" else _on_os(where)
    _kth_fault_rounds(tally, world, reset, monkeypatch, install, err, SCALE.kth_faults)
    tally.assert_clean()


class FailOneFsync:
    """os.fsync that fails the k-th call on a regular file, marking that file with an extended
    attribute (an inode number can be reused by the next file created, a mark cannot), and records
    every later fsync of a marked file."""

    def __init__(self, k: int, real: Callable[[int], None]) -> None:
        self.k, self.real, self.calls, self.fired = k, real, 0, False
        self.again: list[str] = []

    def __call__(self, fd: int) -> None:
        try:
            marked = bool(os.getxattr(fd, MARK))
        except OSError:
            marked = False
        if marked:
            self.again.append(str(Path(f"/proc/self/fd/{fd}").readlink()))
        self.calls += 1
        if self.calls == self.k and stat.S_ISREG(os.fstat(fd).st_mode):
            os.setxattr(fd, MARK, b"1")
            self.fired = True
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.real(fd)


def test_a_failed_fsync_is_never_retried_on_the_same_file(
    busy_world: tuple[World, Callable[[], None]], monkeypatch: pytest.MonkeyPatch, report: Report
) -> None:
    """After fsync fails the kernel may have dropped the dirty pages: the copy is rebuilt, not re-fsynced."""
    world, reset = busy_world
    tally = report.scenario("I/O fault: no second fsync of a file whose fsync failed")
    for k in range(1, 14):
        reset()
        fsync = FailOneFsync(k, os.fsync)
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", fsync)
            _sync(world, max_attempts=3)
        tally.rounds += 1
        if fsync.fired:
            tally.fault("EIO from fsync of a file")
        tally.check([f"fsync retried on {p} after it failed" for p in fsync.again], f"k={k}")
        tally.check(crash_violations(world), f"k={k}")
        _heals(tally, world, f"k={k}")
    tally.assert_clean()


def test_short_writes_are_completed(
    busy_world: tuple[World, Callable[[], None]], monkeypatch: pytest.MonkeyPatch, report: Report
) -> None:
    """write(2) may write less than asked (signals, quotas, FUSE): every byte still arrives."""
    world, reset = busy_world
    tally = report.scenario("I/O fault: short writes")
    rng = random.Random(9)
    real = os.write

    def write(fd: int, data: Any) -> int:
        tally.fault("short write")
        return int(real(fd, memoryview(data)[: rng.randint(1, 5000)]))

    for _ in range(3):
        reset()
        with monkeypatch.context() as m:
            m.setattr(os, "write", write)
            outcome = _sync(world)
        tally.rounds += 1
        if not isinstance(outcome, SyncReport) or not outcome.ok:
            tally.check([f"sync with short writes failed: {outcome}"])
        tally.check(converged_violations(world, world.primary_files()))
    tally.assert_clean()


# ---------------------------------------------------------------------------------------- libfiu
FIU_POINTS = (
    ("posix/io/rw/write", errno.EIO),
    ("posix/io/rw/write", errno.ENOSPC),
    ("posix/io/rw/write/reduce", 0),
    ("posix/io/sync/fsync", errno.EIO),
    ("posix/io/rw/readv", errno.EIO),
    ("posix/io/rw/read", errno.EIO),
)


@pytest.mark.skipif(shutil.which("fiu-run") is None, reason="fiu-run (Debian fiu-utils) is not installed")
def test_fiu_random_libc_faults_in_a_real_process(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """libfiu's LD_PRELOAD wrappers fail libc calls of a real `mirrord sync` at random."""
    tally, rng = report.seeded_scenario("I/O fault: libfiu LD_PRELOAD random libc failures (real process)", "fiu")
    config = write_config(tmp_path / "sync.toml", world)
    names = [f"run-{r}/{step_name(s)}" for r in "ab" for s in range(1, 5)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_")}
    for n in range(SCALE.fiu_rounds):
        for rel in rng.sample(names, k=3):
            world.install(rel, checkpoints.pick(rng))
        point, err = rng.choice(FIU_POINTS)
        probability = rng.choice((0.01, 0.03, 0.1, 0.3))
        spec = f"enable_random name={point},probability={probability}" + (f",failinfo={err}" if err else "")
        log = tmp_path / f"fiu-{n}.log"
        with log.open("wb") as out:
            result = subprocess.run(
                [
                    "fiu-run",
                    "-x",
                    "-f",
                    "",
                    "-c",
                    spec,
                    sys.executable,
                    "-m",
                    "mirrord",
                    "sync",
                    "--config",
                    str(config),
                ],
                stdout=out,
                stderr=out,
                env=env,
                timeout=300,
                check=False,
            )
        tally.rounds += 1
        kind = point.rsplit("/", 1)[-1] + (f" {errno.errorcode[err]}" if err else "")
        tally.fault(f"{kind}: run failed" if result.returncode else f"{kind}: run survived")
        context = f"round {n}: {spec} (exit {result.returncode}, log {log})"
        tally.check(crash_violations(world), context)
        code = zygote.run(["sync", "--config", config], tmp_path / f"heal-{n}.log")
        if code != 0:
            tally.check([f"clean sync after the fiu run exited {code}"], context)
        tally.check(converged_violations(world, world.primary_files()), context)
    tally.assert_clean()


# ------------------------------------------------------------------------------ a full filesystem
def _fill(mount: Path, leave: int) -> Path:
    """Fill the filesystem until exactly `leave` bytes (rounded to pages) are available."""
    filler = mount / ".filler"
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    size = max(0, free - leave)
    with filler.open("wb") as f:
        f.write(b"\0" * size)
    return filler


def _big_checkpoints(base: Path, n: int, width: int) -> list[bytes]:
    return [save_checkpoint(base / f"big{i}.pt", 900 + i, width=width, depth=2).read_bytes() for i in range(n)]


def test_real_full_filesystem(small_tmpfs: Path, tmp_path: Path, zygote: Zygote, report: Report) -> None:
    """An 8 MiB tmpfs mirror: racing copies, a manifest that no longer fits, no space at all."""
    tally = report.scenario("I/O fault: real full filesystem (8 MiB tmpfs)")
    world = World(tmp_path, mirror_at=small_tmpfs / "mirror")
    big = _big_checkpoints(tmp_path / "blobs", 2, 320)  # about 2.5 MB each
    config = write_config(tmp_path / "sync.toml", world, copy={"workers": 2, "max_attempts": 1})
    world.mirror.mkdir()

    def sync(label: str) -> tuple[int, list[dict[str, Any]]]:
        log = tmp_path / f"{label}.log"
        return zygote.run(["sync", "--config", config], log), read_events(log)

    def after(label: str, code: int, log_events: list[dict[str, Any]]) -> None:
        tally.rounds += 1
        failures = [e for e in log_events if e.get("event") in ("copy.failed", "command.failed")]
        if code != 0:
            tally.fault(f"{label}: " + ", ".join(sorted({str(e.get("reason")) for e in failures})))
            if not failures or not all(e.get("path") or e.get("error_path") for e in failures):
                tally.check(["a failure was logged without its path"], label)
        tally.check([f"{t}: temp file left on a full mirror" for t in finals(world.mirror)[1]], label)
        tally.check(crash_violations(world), label)

    # 1. Two copies that each fit, but not together: one of them meets the kernel's ENOSPC (or the
    #    pre-flight check, if the other already wrote enough).
    world.install("run/step_0001.pt", big[0])
    world.install("run/step_0002.pt", big[1])
    filler = _fill(small_tmpfs, int(len(big[0]) * 1.6))
    code, log_events = sync("two-copies-one-space")
    after("two copies racing for the space of one", code, log_events)
    # 2. The data fits exactly; the manifest recording it does not.
    filler.unlink()
    shutil.rmtree(world.mirror)
    world.mirror.mkdir()
    filler = _fill(small_tmpfs, 0)
    filler.unlink()
    page = os.statvfs(small_tmpfs).f_frsize
    # The data, the lock file, the volume marker and the empty snapshot a fresh mirror gets; not the
    # journal of the record.
    filler = _fill(small_tmpfs, (-(-len(big[0]) // page) + 3) * page)
    world.primary.joinpath("run/step_0002.pt").rename(tmp_path / "aside.pt")
    code, log_events = sync("manifest-does-not-fit")
    after("the manifest does not fit", code, log_events)
    causes = [str(e.get("cause")) for e in log_events if e.get("event") == "copy.failed"]
    if code == 0 or not any("manifest" in c for c in causes):
        tally.check([f"the manifest write did not fail on a full filesystem: {causes}"], "manifest-does-not-fit")
    # 3. Nothing fits at all. (Step 2 stays aside: 8 MiB cannot hold both steps and a temp copy.)
    filler.unlink()
    filler = _fill(small_tmpfs, 0)
    code, log_events = sync("no-space-at-all")
    after("no space at all", code, log_events)
    # Space comes back: everything converges.
    filler.unlink()
    code, _ = sync("space-again")
    if code != 0:
        tally.check([f"sync after space came back exited {code}"])
    tally.check(converged_violations(world, world.primary_files()), "after space came back")
    tally.assert_clean()


# --------------------------------------------------------------------- the source changes mid-copy
def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0" * 4096)


def _rewrite_in_place(keep_mtime: bool) -> Callable[[Path], None]:
    def rewrite(path: Path) -> None:
        st = path.stat()
        data = bytearray(path.read_bytes())
        for part in (slice(0, 1000), slice(-1000, None)):  # bytes already copied, and bytes not yet
            data[part] = bytes(255 - b for b in data[part])
        with path.open("r+b") as f:
            f.write(data)
        if keep_mtime:  # what `cp -p` or a restore tool does: the old mtime on new bytes
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    return rewrite


def _replace_by_rename(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[:8] = b"\xffREPLACE"
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    tmp.replace(path)


def _delete(path: Path) -> None:
    path.unlink()


MUTATIONS: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "appended": _append,
    "rewritten in place": _rewrite_in_place(keep_mtime=False),
    "rewritten in place, old mtime restored": _rewrite_in_place(keep_mtime=True),
    "replaced by rename, same size and mtime": _replace_by_rename,
    "deleted": _delete,
}


TORN = ("truncated", "appended")  # no longer a whole torch.save zip once changed


def _mutating_write(
    real: Callable[[LocalUpload, memoryview], None],
    path: Path,
    rel: str,
    mutate: Callable[[Path], None],
    world: World,
    tally: Tally,
    label: str,
) -> Callable[[LocalUpload, memoryview], None]:
    """LocalUpload.write that changes the source once, after the first chunk reached the mirror."""
    writes = [0]

    def write(self: LocalUpload, chunk: memoryview) -> None:
        writes[0] += 1
        if writes[0] == 2:
            mutate(path)
            if path.exists():
                world.history[rel].append(digest_bytes(path.read_bytes()))
            tally.fault(label)
        real(self, chunk)

    return write


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_source_changes_during_the_copy(
    mutation: str, world: World, checkpoints: Checkpoints, monkeypatch: pytest.MonkeyPatch, report: Report
) -> None:
    """The source changes after the copier read part of it: the copy is discarded, never published."""
    tally = report.scenario(f"source changed mid-copy: {mutation}")
    rel = f"run/{step_name(7)}"
    rng = random.Random(13)
    data = max(checkpoints.blobs, key=len)
    for attempts in (1, 3):
        path = world.install(rel, data if attempts == 1 else checkpoints.pick(rng, SMALL))
        write = _mutating_write(LocalUpload.write, path, rel, MUTATIONS[mutation], world, tally, mutation)
        with monkeypatch.context() as m:
            m.setattr(LocalUpload, "write", write)
            outcome = _sync(world, max_attempts=attempts)
        tally.rounds += 1
        context = f"max_attempts={attempts}"
        tally.check(crash_violations(world), context)
        tally.check([f"{t}: temp file left" for t in finals(world.mirror)[1]], context)
        if attempts == 1:
            # A source deleted mid-copy was rotated away by its trainer: reported as gone, not as a failure.
            expected = "gone" if mutation == "deleted" else "failed"
            if not isinstance(outcome, SyncReport) or rel not in getattr(outcome, expected):
                tally.check([f"a copy of a source that changed was not reported as {expected}: {outcome}"], context)
            if (world.mirror / rel).exists():
                tally.check(["a copy of a source that changed was published"], context)
        elif path.exists() and mutation in TORN:
            # Truncated or with bytes appended, the source is no longer a whole checkpoint: the retry
            # reads it again and refuses it (issue 14), and nothing is published under its name.
            if not isinstance(outcome, SyncReport) or rel not in outcome.invalid or outcome.ok:
                tally.check([f"the retry did not refuse the torn source: {outcome}"], context)
            if (world.mirror / rel).exists():
                tally.check(["a torn source was published"], context)
        elif path.exists():
            if not isinstance(outcome, SyncReport) or not outcome.ok:
                tally.check([f"the retry did not copy the changed source: {outcome}"], context)
            tally.check(converged_violations(world, world.primary_files()), context)
    tally.assert_clean()
