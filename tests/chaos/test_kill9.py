"""kill -9 at random instants and at every syscall: the mirror is always whole, and a restart heals it.

After each SIGKILL: the manifest parses; every final-named file is a whole version of its source (or
what its manifest entry records); every manifest entry names a file. After the restart ran to
completion: no temp file anywhere, everything mirrored and recorded, and `mirrord latest` names the
newest checkpoint, whose bytes are its source's.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from mirrord.store.resume import latest_checkpoint as latest_checkpoint_of
from tests.chaos.harness import (
    BASE_MTIME_NS,
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
    frozen,
    kept_steps,
    latest_violations,
    load_manifest,
    step_name,
    write_config,
)
from tests.chaos.syscalls import parse, run_traced, syscall_counts, trace_args
from tests.support.logs import read_events
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

RUNS = ("run-a", "run-b", "run-c")
SMALL_BLOB = 400_000
MAX_STEP = 5
KEEP_LAST = 2


class TornWriter:
    """A trainer process writing one checkpoint in place, slowly (64 KiB every 10 ms), to be killed."""

    CHUNK, PAUSE = 65536, 0.01
    SCRIPT = (
        "import sys, time\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "with open(sys.argv[2], 'wb') as f:\n"
        "    for i in range(0, len(data), {chunk}):\n"
        "        f.write(data[i:i + {chunk}]); f.flush(); time.sleep({pause})\n"
    )

    def __init__(self, path: Path, blob: bytes, scratch: Path) -> None:
        scratch.write_bytes(blob)
        path.parent.mkdir(parents=True, exist_ok=True)
        script = self.SCRIPT.format(chunk=self.CHUNK, pause=self.PAUSE)
        self.proc = subprocess.Popen([sys.executable, "-c", script, str(scratch), str(path)], start_new_session=True)
        self.seconds = len(blob) / self.CHUNK * self.PAUSE

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class Trainer:
    """Keeps the primary busy between rounds: new steps, and checkpoints rewritten (new content)."""

    def __init__(self, world: World, checkpoints: Checkpoints, rng: random.Random) -> None:
        self.world, self.checkpoints, self.rng = world, checkpoints, rng
        self.steps = {run: 0 for run in RUNS}
        for run in RUNS:
            for _ in range(2):
                self.add(run)

    def add(self, run: str) -> None:
        self.steps[run] += 1
        self.world.install(f"{run}/{step_name(self.steps[run])}", self.checkpoints.pick(self.rng))

    def work(self) -> None:
        growing = [run for run, n in self.steps.items() if n < MAX_STEP]
        if growing and self.rng.random() < 0.5:
            self.add(self.rng.choice(growing))
        existing = self.world.primary_files()
        for rel in self.rng.sample(existing, k=self.rng.randint(1, 2)):
            self.world.install(rel, self.checkpoints.pick(self.rng))

    def kept(self) -> set[str]:
        """What a completed prune leaves on the mirror: each run's KEEP_LAST newest steps by (branch, step),
        and the tip of each branch that the trainer's rewrites abandoned (harness.kept_steps)."""
        return {f"{run}/{step_name(s)}" for run in RUNS for s in kept_steps(self.world, run, KEEP_LAST)}


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _phase(world: World, log: Path) -> str:
    """Where a kill landed, judged from what it left behind and what the killed process had logged."""
    files, temps, _odd = finals(world.mirror)
    if any(not t.startswith(".") and "/." not in t for t in temps):
        return "mid-copy"
    if temps:
        return "mid-manifest-write"
    entries, _ = load_manifest(world.mirror)
    if any(rel not in entries for rel in files):
        return "after-rename-before-record"
    names = {e.get("event") for e in read_events(log)}
    if names & {"sync.finished", "prune.finished"} or (
        "copy.started" in names
        and "copy.committed" in names
        and (len(read_events(log, "copy.started")) == len(read_events(log, "copy.committed")))
    ):
        return "after-the-work"
    if not names & {"copy.started", "prune.deleted"}:
        return "before-any-work"
    return "between-files"


class Rounds:
    """One kind of round: start mirrord, SIGKILL it at a random instant, restart it, check."""

    def __init__(self, zygote: Zygote, world: World, workdir: Path, tally: Tally, rng: random.Random) -> None:
        self.zygote, self.world, self.workdir, self.tally, self.rng = zygote, world, workdir, tally, rng
        # A bandwidth cap stretches each copy over many chunks, so random kills often land inside one.
        slow = {"bandwidth_limit": 40 * 2**20}
        self.sync_cfg = write_config(workdir / "sync.toml", world, io=slow)
        self.prune_cfg = write_config(
            workdir / "prune.toml", world, prune={"enabled": True, "keep_last": KEEP_LAST, "min_age_seconds": 0}
        )
        self.run_cfg = write_config(
            workdir / "run.toml",
            world,
            io=slow,
            watch={"rescan_interval_seconds": 2},
            prune={"enabled": True, "keep_last": KEEP_LAST, "min_age_seconds": 0},
        )
        self.window: dict[str, tuple[float, float]] = {}
        self.phases: Counter[str] = Counter()
        self.n = 0

    def log(self, what: str) -> Path:
        return self.workdir / f"{what}-{self.n}.log"

    def sync(self) -> None:
        code = self.zygote.run(["sync", "--config", self.sync_cfg], self.log("sync"))
        assert code == 0, f"a clean sync failed ({code}); see {self.log('sync')}"

    def kill_at_random(self, argv: list[str], kind: str, log: Path) -> None:
        """SIGKILL at a random instant: mostly inside the window where this kind of run does its
        work (measured by calibrate()), sometimes anywhere from its start."""
        first, last = self.window[kind]
        if self.rng.random() < 0.8:
            delay = self.rng.uniform(first * 0.9, last * 1.05)
        else:
            delay = self.rng.uniform(0, last * 1.05)
        pid = self.zygote.spawn(argv, log)
        time.sleep(delay)  # the fault instant itself, not a synchronization
        os.kill(pid, signal.SIGKILL)
        status = self.zygote.wait(pid, 60)
        assert status is not None, f"{kind}: the killed process did not go away"
        if status == -signal.SIGKILL:
            self.tally.fault(f"SIGKILL during mirrord {kind}")
            self.phases[_phase(self.world, log)] += 1
            self.window[kind] = (first, last * 1.02)
        else:  # too late: this kind of run is quicker than measured, aim earlier
            self.tally.fault(f"kill after mirrord {kind} had finished")
            self.window[kind] = (first * 0.95, max(first * 0.95 + 0.01, last * 0.9))

    def check_crash(self, context: str) -> None:
        self.tally.check(crash_violations(self.world), context)

    def check_converged(self, context: str, expected: set[str] | None) -> None:
        self.tally.check(converged_violations(self.world, expected), context)
        self.tally.check(latest_violations(self.zygote, self.sync_cfg, self.world, self.workdir), context)

    def calibrate(self, trainer: Trainer) -> None:
        """When, after its start, each kind of run does its work (first to last work event)."""
        marks = {
            "sync": ("copy.started", "sync.finished"),
            "prune": ("prune.deleted", "prune.finished"),
            "daemon": ("copy.started", "copy.committed"),
        }
        for kind, (begin, end) in marks.items():
            trainer.work()
            if kind == "prune":
                self.sync()
            log = self.log(f"calibrate-{kind}")
            spawned = time.time()
            if kind == "daemon":
                pid = self.zygote.spawn(["run", "--config", self.run_cfg], log)
                wait_for(lambda: self.daemon_converged(trainer.kept()), 60, "the daemon to converge", interval=0.02)
                wait_for(lambda log=log: read_events(log, "daemon.ready"), 60, "daemon readiness", interval=0.02)
                self.stop_daemon(pid)
            else:
                cfg = self.sync_cfg if kind == "sync" else self.prune_cfg
                assert self.zygote.run([kind, "--config", cfg], log) == 0
            stamps = [(e["event"], _seconds(e["timestamp"]) - spawned) for e in read_events(log)]
            first = min((t for name, t in stamps if name == begin), default=0.0)
            last = max((t for name, t in stamps if name == end), default=first + 0.1)
            self.window[kind] = (max(first, 0.0), max(last, first + 0.01))
        self.sync()

    def daemon_converged(self, expected: set[str]) -> bool:
        """The mirror holds exactly `expected`, each recorded as its current source, no copy in flight."""
        entries, problems = load_manifest(self.world.mirror)
        if problems:
            return False
        for rel in expected:
            st = (self.world.primary / rel).stat()
            entry = entries.get(rel)
            if entry is None or (entry.size, entry.source_mtime_ns) != (st.st_size, st.st_mtime_ns):
                return False
        files, temps, _odd = finals(self.world.mirror)
        return set(files) == expected and not [t for t in temps if not t.startswith(".")]

    def start_daemon(self) -> int:
        log = self.log("daemon")
        pid = self.zygote.spawn(["run", "--config", self.run_cfg], log)
        # SIGTERM before the handlers are installed would just kill it: wait until it is ready.
        wait_for(lambda: read_events(log, "daemon.ready"), 60, f"daemon readiness ({log})", interval=0.02)
        return pid

    def stop_daemon(self, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        status = self.zygote.wait(pid, 60)
        if status != 0:
            self.tally.check([f"daemon exited {status} on SIGTERM (log {self.log('daemon')})"])

    def sync_round(self) -> None:
        self.kill_at_random(["sync", "--config", self.sync_cfg], "sync", self.log("killed-sync"))
        self.check_crash(f"round {self.n} (sync killed)")
        self.sync()
        self.check_converged(f"round {self.n} (sync restarted)", set(self.world.primary_files()))

    def prune_round(self, trainer: Trainer) -> None:
        self.sync()
        self.kill_at_random(["prune", "--config", self.prune_cfg], "prune", self.log("killed-prune"))
        self.check_crash(f"round {self.n} (prune killed)")
        code = self.zygote.run(["prune", "--config", self.prune_cfg], self.log("prune"))
        if code != 0:
            self.tally.check([f"a clean prune exited {code}"], f"round {self.n}")
        self.check_converged(f"round {self.n} (prune restarted)", trainer.kept())

    def writer_round(self, trainer: Trainer) -> None:
        """The trainer is killed mid-save (a checkpoint written in place, no rename) while the daemon
        runs. Issue 14's invariants: the torn file is never published, no good step of its run is
        deleted while it is torn, `latest` names a whole checkpoint; once the trainer saves it again
        (whole), the daemon converges as usual."""
        run = self.rng.choice(RUNS)
        kept_before = trainer.kept()
        step = trainer.steps[run] + 1
        rel = f"{run}/{step_name(step)}"
        blob = trainer.checkpoints.pick(self.rng)
        # The whole blob is a version the primary may have (the writer may finish before the kill).
        self.world.history.setdefault(rel, []).append(digest_bytes(blob))
        pid = self.start_daemon()
        try:
            wait_for(
                lambda: self.daemon_converged(kept_before), 60, "the daemon to converge before the save", interval=0.02
            )
            writer = TornWriter(self.world.primary / rel, blob, self.workdir / f"blob-{self.n}")
            # Aimed from the save's start: the writer's interpreter start-up alone outlasts most saves.
            wait_for(
                lambda: (self.world.primary / rel).exists() or writer.proc.poll() is not None,
                60,
                "the trainer to begin its save",
            )
            time.sleep(self.rng.uniform(0, writer.seconds * 0.9))  # the fault instant, not a synchronization
            writer.kill()
            written = self.world.primary / rel
            size = written.stat().st_size if written.exists() else 0  # killed before it even opened it
            if 0 < size < len(blob):
                self.tally.fault("SIGKILL of the trainer mid-save (a torn checkpoint)")
            else:  # the save had not begun, or was complete: the daemon works on while the mirror is checked
                self.tally.fault("SIGKILL of the trainer " + ("after its save" if size else "before its first byte"))
            if 0 < size < len(blob):
                log = self.log("daemon")
                wait_for(
                    lambda: (
                        [e for e in read_events(log, "copy.failed") if e.get("path") == rel]
                        or self.zygote.wait(pid, 0) is not None
                    ),
                    60,
                    "the daemon to judge the torn file",
                    interval=0.02,
                )
            # The daemon keeps working (a whole save is copied, retention deletes an older step): the
            # checks read one instant of it, frozen, or a file deleted after the listing reads as lost.
            # (Only while it runs: the zygote reaped a daemon that died, and its pid may be someone else's.)
            with frozen(pid) if self.zygote.wait(pid, 0) is None else contextlib.nullcontext():
                if 0 < size < len(blob):
                    self.tally.check(self.torn_violations(rel, run, kept_before), f"round {self.n} (trainer killed)")
                self.check_crash(f"round {self.n} (trainer killed)")
            trainer.steps[run] = step
            self.world.install(rel, blob)  # the restarted trainer saves it again, whole
            kept = trainer.kept()
            wait_for(lambda: self.daemon_converged(kept), 60, "the daemon to converge after the re-save", interval=0.02)
        finally:
            self.stop_daemon(pid)
        self.check_converged(f"round {self.n} (trainer re-saved)", kept)

    def torn_violations(self, rel: str, run: str, kept_before: set[str]) -> list[str]:
        found = []
        if (self.world.mirror / rel).exists():
            found.append(f"{rel}: a torn source was published on the mirror")
        entries, _ = load_manifest(self.world.mirror)
        if rel in entries:
            found.append(f"{rel}: a torn source was recorded in the manifest")
        files = set(finals(self.world.mirror)[0])
        found += [
            f"{k}: a good step deleted while a newer one is torn"
            for k in kept_before
            if k.startswith(run + "/") and k not in files
        ]
        latest = latest_checkpoint_of(self.world.mirror)
        if latest is not None and hash_file(latest, "blake3") not in self.world.history.get(
            latest.relative_to(self.world.mirror).as_posix(), ()
        ):
            found.append(f"latest names {latest}, which is no whole checkpoint")
        return found

    def daemon_round(self, trainer: Trainer) -> None:
        """The daemon copies and prunes (keep_last): it converges on each run's newest steps."""
        self.kill_at_random(["run", "--config", self.run_cfg], "daemon", self.log("killed-daemon"))
        self.check_crash(f"round {self.n} (daemon killed)")
        kept = trainer.kept()
        pid = self.start_daemon()
        try:
            wait_for(lambda: self.daemon_converged(kept), 60, "the restarted daemon to converge", interval=0.02)
        finally:
            self.stop_daemon(pid)
        self.check_converged(f"round {self.n} (daemon restarted)", kept)


def test_sigkill_at_random_instants(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """SIGKILL `mirrord sync`, `mirrord prune` and `mirrord run` at random instants, then restart; and
    SIGKILL the trainer mid-save while the daemon runs."""
    tally, rng = report.seeded_scenario("kill -9 at random instants (sync, prune, daemon, trainer)", "kill9")
    trainer = Trainer(world, checkpoints, rng)
    rounds = Rounds(zygote, world, tmp_path, tally, rng)
    rounds.sync()
    rounds.calibrate(trainer)
    for n in range(SCALE.kill_rounds):
        rounds.n = n
        trainer.work()
        kind = rng.choices(("sync", "prune", "daemon", "writer"), weights=(6, 2, 2, 2))[0]
        if kind == "sync":
            rounds.sync_round()
        elif kind == "prune":
            rounds.prune_round(trainer)
        elif kind == "writer":
            rounds.writer_round(trainer)
        else:
            rounds.daemon_round(trainer)
        tally.rounds += 1
    tally.notes.append("kills landed: " + ", ".join(f"{k} {v}" for k, v in sorted(rounds.phases.items())))
    tally.assert_clean()
    landed = sum(n for kind, n in tally.faults.items() if kind.startswith("SIGKILL"))
    assert landed >= SCALE.kill_rounds // 2, f"only {landed} kills landed while mirrord was working"


def test_restart_after_a_kill_keeps_keep_last_steps(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path
) -> None:
    """The daemon copies newest first: killed while copying step 2 after step 3 was mirrored, its
    restart must still end with keep_last = 2 steps (2 and 3) on the mirror, not with step 3 alone
    (retention once took a window of one verified step as full and retired step 2 for good)."""
    rng = random.Random(17)
    world.install(f"run/{step_name(3)}", checkpoints.pick(rng, SMALL_BLOB))
    config = write_config(
        tmp_path / "run.toml",
        world,
        watch={"rescan_interval_seconds": 0.5},
        prune={"enabled": True, "keep_last": 2, "min_age_seconds": 0},
    )
    assert zygote.run(["sync", "--config", config], tmp_path / "sync.log") == 0
    for step in (1, 2):  # committed earlier; step 2 was being copied when the daemon was killed
        world.install(
            f"run/{step_name(step)}", checkpoints.pick(rng, SMALL_BLOB), mtime_ns=BASE_MTIME_NS - (3 - step) * 10**9
        )
    (world.mirror / "run" / (step_name(2) + ".part")).write_bytes(b"the first half of step 2")
    log = tmp_path / "daemon.log"
    pid = zygote.spawn(["run", "--config", config], log)

    def idle() -> bool:
        """Two reconciles done, the last one queued nothing, and no copy is in flight."""
        seen = read_events(log)
        reconciles = [e for e in seen if e["event"] == "reconcile.finished"]
        started = sum(e["event"] == "copy.started" for e in seen)
        ended = sum(e["event"] in ("copy.committed", "copy.failed") for e in seen)
        return len(reconciles) >= 2 and reconciles[-1]["queued"] == 0 and started == ended

    try:
        wait_for(idle, 90, "the daemon to go idle", interval=0.02)
        assert set(finals(world.mirror)[0]) == {f"run/{step_name(s)}" for s in (2, 3)}
    finally:
        os.kill(pid, signal.SIGTERM)
        assert zygote.wait(pid, 60) == 0


# ------------------------------------------------------------------------------ every syscall, once
INJECTED = ("openat", "write", "fsync", "renameat", "unlinkat", "mkdirat")


def _every_syscall(
    zygote: Zygote,
    world: World,
    workdir: Path,
    tally: Tally,
    argv: list[str],
    expected: Callable[[], set[str]],
    restart: list[str],
    check_cfg: Path,
) -> None:
    reset = world.mirror_reset(workdir / "baseline-mirror")
    prefix = workdir / "count" / "t"
    prefix.parent.mkdir()
    assert run_traced(zygote, argv, workdir / "count.log", trace_args(prefix, INJECTED)) == 0
    counts = syscall_counts(parse(prefix))
    for name in INJECTED:
        # The CI-sized run kills at every third openat (most are reads); the full run at every one.
        stride = 1 if SCALE.inject_every_n or name != "openat" else 3
        for n in range(1, counts.get(name, 0) + 1, stride):
            reset()
            log = workdir / f"inject-{name}-{n}.log"
            status = run_traced(
                zygote,
                argv,
                log,
                ["-o", os.devnull, "-e", f"trace={name}", "-e", f"inject={name}:signal=KILL:when={n}"],
            )
            context = f"{argv[0]} killed at {name} #{n}"
            if status == -signal.SIGKILL:
                tally.fault(f"{argv[0]}: KILL at {name}")
            tally.rounds += 1
            tally.check(crash_violations(world), context)
            code = zygote.run([*restart, "--config", check_cfg], workdir / "restart.log")
            if code != 0:
                tally.check([f"restart exited {code}"], context)
            tally.check(converged_violations(world, expected()), context)
            tally.check(latest_violations(zygote, check_cfg, world, workdir), context)
    reset()


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_sigkill_at_every_syscall_of_a_copy_and_a_prune(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """strace -e inject=SYSCALL:signal=KILL:when=N for every N over one sync cycle and one prune cycle."""
    tally = report.scenario("kill -9 at every syscall N (strace inject, sync + prune)")
    rng = random.Random(11)
    for rel in ("run-a/" + step_name(1), "run-a/" + step_name(2), "run-a/" + step_name(3), "run-b/" + step_name(1)):
        world.install(rel, checkpoints.pick(rng, max_bytes=400_000))
    sync_cfg = write_config(tmp_path / "sync.toml", world, copy={"workers": 1})
    prune_cfg = write_config(
        tmp_path / "prune.toml",
        world,
        copy={"workers": 1},
        prune={"enabled": True, "keep_last": 1, "min_age_seconds": 0},
    )
    assert zygote.run(["sync", "--config", sync_cfg], tmp_path / "first.log") == 0
    # One sync cycle with every kind of work: a replaced file, a new folder, a stale temp file.
    world.install("run-a/" + step_name(2), checkpoints.pick(rng, max_bytes=400_000))
    world.install("run-c/" + step_name(4), checkpoints.pick(rng, max_bytes=400_000))
    world.install("run-a/" + step_name(5), checkpoints.pick(rng, max_bytes=400_000))
    (world.mirror / "run-a" / (step_name(5) + ".part")).write_bytes(b"left behind by a dead process")
    all_files = lambda: set(world.primary_files())  # noqa: E731
    sync_dir = tmp_path / "sync-cycle"
    sync_dir.mkdir()
    _every_syscall(zygote, world, sync_dir, tally, ["sync", "--config", str(sync_cfg)], all_files, ["sync"], sync_cfg)
    assert zygote.run(["sync", "--config", sync_cfg], tmp_path / "second.log") == 0
    # Step 2 of run-a, rewritten after step 3, started a new branch (2, 5): step 3, the tip of the branch it
    # abandoned, is kept (prune.keep_branch_tips) beside each run's newest step.
    kept = {"run-a/" + step_name(3), "run-a/" + step_name(5), "run-b/" + step_name(1), "run-c/" + step_name(4)}
    prune_dir = tmp_path / "prune-cycle"
    prune_dir.mkdir()
    _every_syscall(
        zygote, world, prune_dir, tally, ["prune", "--config", str(prune_cfg)], lambda: kept, ["prune"], prune_cfg
    )
    tally.assert_clean()
    kills = sum(tally.faults.values())
    assert kills >= tally.rounds * 0.9, f"only {kills} of {tally.rounds} injections killed mirrord"


SWAP_POINTS = ("renameat2", "renameat", "unlinkat", "fsync")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_sigkill_at_every_step_of_replacing_a_changed_folder_unit(
    zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """A `sync` replaces checkpoint-10/ (the trainer saved it again with other bytes) by staging the new
    folder, exchanging it with the old one, then deleting the old one; strace kills it at every rename,
    renameat2, unlink/rmdir and fsync. After each kill the mirror's checkpoint-10/ is there and is one
    whole version, the old or the new, never a mix or nothing; a restarted sync publishes the new one
    and leaves no staging folder behind."""
    from tests.support.folders import write_hf

    tally = report.scenario("kill -9 at every step of a folder unit swap (strace inject, sync)")
    world = World(tmp_path / "world")
    folder = world.primary / "run" / "checkpoint-10"
    cfg = write_config(tmp_path / "sync.toml", world, layout="hf", copy={"workers": 1})

    def version(root: Path) -> dict[str, bytes] | None:
        unit = root / "run" / "checkpoint-10"
        if not unit.is_dir():
            return None
        return {p.relative_to(unit).as_posix(): p.read_bytes() for p in sorted(unit.rglob("*")) if p.is_file()}

    write_hf(folder, 10, width=16)
    assert zygote.run(["sync", "--config", cfg], tmp_path / "first.log") == 0
    old = version(world.mirror)
    write_hf(folder, 10, width=24)
    new = version(world.primary)
    assert old is not None and new is not None and old != new and set(old) == set(new)
    reset = world.mirror_reset(tmp_path / "baseline-mirror")
    prefix = tmp_path / "count" / "t"
    prefix.parent.mkdir()
    argv = ["sync", "--config", str(cfg)]
    assert run_traced(zygote, argv, tmp_path / "count.log", trace_args(prefix, SWAP_POINTS)) == 0
    counts = syscall_counts(parse(prefix))
    assert counts.get("renameat2", 0) >= 1, f"the replacement exchanged no names: {counts}"
    assert version(world.mirror) == new
    for name in SWAP_POINTS:
        for n in range(1, counts.get(name, 0) + 1):
            reset()
            context = f"sync killed at {name} #{n}"
            status = run_traced(
                zygote,
                ["sync", "--config", str(cfg)],
                tmp_path / f"inject-{name}-{n}.log",
                ["-o", os.devnull, "-e", f"trace={name}", "-e", f"inject={name}:signal=KILL:when={n}"],
            )
            if status == -signal.SIGKILL:
                tally.fault(f"sync: KILL at {name}")
            tally.rounds += 1
            seen = version(world.mirror)
            if seen not in (old, new):
                tally.check(
                    [
                        f"checkpoint-10/ after the kill is {'missing' if seen is None else 'neither version'}"
                        + ("" if seen is None else f": {sorted(seen)}")
                    ],
                    context,
                )
            code = zygote.run(["sync", "--config", cfg], tmp_path / "restart.log")
            if code != 0:
                tally.check([f"restart exited {code}"], context)
            if version(world.mirror) != new:
                tally.check(["the restarted sync did not publish the new version"], context)
            left = sorted(p.name for p in (world.mirror / "run").iterdir() if p.name != "checkpoint-10")
            if left:
                tally.check([f"left on the mirror after the restart: {left}"], context)
            entries, problems = load_manifest(world.mirror)
            tally.check(problems, context)
            if sorted(entries) != sorted(f"run/checkpoint-10/{m}" for m in new):
                tally.check([f"manifest after the restart: {sorted(entries)}"], context)
    reset()
    tally.assert_clean()
    kills = sum(tally.faults.values())
    print(f"swap chaos: {tally.rounds} kills over {counts}")
    assert kills >= tally.rounds * 0.9, f"only {kills} of {tally.rounds} injections killed mirrord"
