"""The chaos suite's shared machinery: the world (primary, mirror, every version ever written), the
invariants checked after every fault, a fork server for fast real `mirrord` processes, the tally
that becomes RESULTS.md, and the scale of a run (CI-sized by default, full with CHAOS_SCALE=full).

Invariants never look at timings. A check returns a list of violations (strings), so a scenario can
count them across all its rounds and report the figure before asserting that it is zero.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mirrord.config import Config
from mirrord.core.model import PENDING, PREVIOUS, ManifestEntry
from mirrord.errors import ManifestError
from mirrord.store.atomic import TEMP_SUFFIX
from mirrord.store.hashing import new_hasher
from mirrord.store.manifest import Manifest
from tests.support import config
from tests.support.mirror import hash_file
from tests.support.wait import wait_for

ALGO = "blake3"
ZYGOTE = Path(__file__).with_name("zygote.py")
BASE_MTIME_NS = 1_700_000_000 * 10**9


# --------------------------------------------------------------------------------------------- scale
@dataclass(frozen=True)
class Scale:
    """How hard each scenario pushes. `ci` must keep the whole suite within a few minutes on 2 cores."""

    name: str
    kill_rounds: int
    inject_every_n: bool  # strace KILL at every N of every syscall (else every third openat)
    power_cuts: int
    broken_power_cuts: int
    kth_faults: int  # k ranges over 1..kth_faults+1 writes / fsyncs, and the last one of the pass
    fiu_rounds: int
    swap_rounds: int
    overflow_rounds: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Scale:
        env = os.environ if environ is None else environ
        name = env.get("CHAOS_SCALE", "ci")
        if name == "full":
            scale = cls("full", 500, True, 100, 40, 24, 100, 200, 5)
        elif name == "ci":
            scale = cls("ci", 50, False, 10, 16, 10, 10, 30, 1)
        else:
            raise ValueError(f"CHAOS_SCALE must be ci or full, not {name!r}")
        if env.get("CHAOS_ROUNDS"):
            scale = cls(**{**scale.__dict__, "kill_rounds": int(env["CHAOS_ROUNDS"])})
        return scale


SCALE = Scale.from_env()


def seeded_rng(label: str) -> tuple[random.Random, int]:
    """A random generator for one scenario: CHAOS_SEED reproduces a run, otherwise a fresh seed."""
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    return random.Random(f"{seed}:{label}"), seed


# -------------------------------------------------------------------------------------------- report
@dataclass
class Tally:
    """One row of RESULTS.md: rounds run, faults injected (by kind), invariant violations (must be 0)."""

    scenario: str
    rounds: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    expect_violations: bool = False  # a deliberately broken variant: violations prove detection
    # What the harness saw but cannot blame on mirrord's protocol (an I/O error from the filesystem
    # under test): reported in RESULTS.md, never swallowed.
    findings: list[str] = field(default_factory=list)

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + n

    def check(self, found: Iterable[str], context: str = "") -> list[str]:
        found = list(found)
        self.violations.extend(f"{context}: {v}" if context else v for v in found)
        return found

    def assert_clean(self) -> None:
        shown = "\n  ".join(self.violations[:20])
        notes = "".join(f"\n({note})" for note in self.notes)  # the seed, to replay the run
        assert not self.violations, f"{self.scenario}: {len(self.violations)} invariant violation(s):\n  {shown}{notes}"

    def as_row(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "rounds": self.rounds,
            "faults": dict(sorted(self.faults.items())),
            "violations": len(self.violations),
            "notes": self.notes,
            "expect_violations": self.expect_violations,
            "findings": self.findings,
        }


@dataclass
class Report:
    tallies: list[Tally] = field(default_factory=list)
    outcomes: list[dict[str, str]] = field(default_factory=list)  # test id, outcome, reason

    def scenario(self, name: str, expect_violations: bool = False) -> Tally:
        tally = Tally(name, expect_violations=expect_violations)
        self.tallies.append(tally)
        return tally

    def seeded_scenario(self, name: str, label: str) -> tuple[Tally, random.Random]:
        """A scenario driven by seeded_rng(label); its seed is noted so that a failure can be replayed."""
        tally = self.scenario(name)
        rng, seed = seeded_rng(label)
        tally.notes.append(f"seed {seed}")
        return tally, rng

    def write(self, path: Path) -> None:
        doc = {"tallies": [t.as_row() for t in self.tallies], "tests": self.outcomes}
        path.write_text(json.dumps(doc, indent=1) + "\n")


REPORT = Report()


# --------------------------------------------------------------------------------------------- world
def digest_bytes(data: bytes) -> str:
    hasher = new_hasher(ALGO)
    hasher.update(data)
    return hasher.hexdigest()


def step_name(step: int) -> str:
    return f"step_{step:04d}.pt"


@dataclass
class World:
    """A primary and a mirror, plus every version of every file the 'trainer' ever wrote."""

    base: Path
    mirror_at: Path | None = None  # default: base/mirror
    primary: Path = field(init=False)
    mirror: Path = field(init=False)
    history: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.primary = self.base / "primary"
        self.mirror = self.mirror_at or self.base / "mirror"
        self.primary.mkdir(parents=True, exist_ok=True)
        self._mtime_tick = 0

    def install(self, rel: str, data: bytes, mtime_ns: int | None = None, in_place: bool = False) -> Path:
        """Write rel like a trainer does: NAME.part, then rename onto the final name (or, with
        `in_place`, straight onto the final name, for names too long to get a suffix)."""
        path = self.primary / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path if in_place else path.with_name(path.name + TEMP_SUFFIX)
        tmp.write_bytes(data)
        if mtime_ns is None:
            self._mtime_tick += 1
            mtime_ns = BASE_MTIME_NS + self._mtime_tick * 1_000_001
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        self.history.setdefault(rel, []).append(digest_bytes(data))
        if tmp != path:
            tmp.replace(path)
        return path

    def source_digest(self, rel: str) -> str | None:
        path = self.primary / rel
        if not path.is_file() or path.is_symlink():
            return None
        return hash_file(path, ALGO)

    def primary_files(self) -> list[str]:
        return sorted(finals(self.primary)[0])

    def mirror_reset(self, baseline: Path) -> Callable[[], None]:
        """Copy the mirror to `baseline` now; the function returned puts that copy back, so that every
        round of a scenario starts from the same mirror."""
        shutil.copytree(self.mirror, baseline, symlinks=True)

        def reset() -> None:
            shutil.rmtree(self.mirror)
            shutil.copytree(baseline, self.mirror, symlinks=True)

        return reset


def finals(root: Path) -> tuple[dict[str, Path], list[str], list[str]]:
    """(final-named files, every *.part anywhere, anything that is not a regular file or directory).

    Hidden names are not final names (the manifest and the lock live there) but hidden temp files
    still count as temp files.
    """
    files: dict[str, Path] = {}
    temps: list[str] = []
    odd: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        for name in list(dirnames):
            if (Path(dirpath) / name).is_symlink():
                odd.append((rel_dir / name).as_posix())
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            try:
                mode = os.lstat(Path(dirpath) / name).st_mode
            except FileNotFoundError:  # deleted meanwhile by a mirrord still running
                continue
            except OSError:  # unreadable metadata: crash_violations reports it when it reads the file
                mode = stat.S_IFREG
            if name.endswith(TEMP_SUFFIX):
                temps.append(rel)
            elif not stat.S_ISREG(mode):
                odd.append(rel)
            elif not name.startswith("."):
                files[rel] = Path(dirpath) / name
    return files, sorted(temps), sorted(odd)


UNREADABLE = "unreadable on the mirror"


def unreadable(rel: str, exc: OSError) -> str:
    """The violation for a file the filesystem would not let us read (EIO after a power cut, say)."""
    return f"{rel}: {UNREADABLE} ({exc.strerror or exc})"


def split_unreadable(found: Iterable[str]) -> tuple[list[str], list[str]]:
    """(I/O errors met while checking, every other violation)."""
    found = list(found)
    io = [v for v in found if UNREADABLE in v]
    return io, [v for v in found if UNREADABLE not in v]


def load_manifest(mirror: Path) -> tuple[dict[str, ManifestEntry], list[str]]:
    try:
        return Manifest.load(mirror).entries, []
    except ManifestError as exc:
        return {}, [f"manifest does not parse: {exc}"]
    except OSError as exc:  # EIO from the filesystem under test (after a power cut)
        return {}, [unreadable("the manifest", exc)]


def _matches(path: Path, entry: ManifestEntry | None) -> bool:
    return entry is not None and path.stat().st_size == entry.size and hash_file(path, entry.algo) == entry.digest


def crash_violations(world: World) -> list[str]:
    """What must hold at any instant, even right after a SIGKILL or a power cut.

    The manifest parses; every final-named file on the mirror is a whole version the primary once had
    (never a prefix, never a mixture); a recorded file matches its manifest entry or equals its current
    source (renamed into place, killed before the record was updated); every manifest entry names a
    file that exists; the mirror holds nothing but regular files and folders. An unrecorded file may be
    an older whole version: a prune drops the record before the unlink, and nothing vouches for it.
    """
    violations: list[str] = []
    entries, problems = load_manifest(world.mirror)
    violations += problems
    files, _temps, odd = finals(world.mirror)
    violations += [f"{rel}: not a regular file on the mirror" for rel in odd]
    for rel, path in sorted(files.items()):
        try:
            digest = hash_file(path, ALGO)
            matches = _matches(path, entries.get(rel))
        except OSError as exc:
            violations.append(unreadable(rel, exc))
            continue
        if digest not in world.history.get(rel, ()):
            violations.append(f"{rel}: content is no version the primary ever had (torn or foreign)")
            continue
        entry = entries.get(rel)
        if entry is not None and digest != world.source_digest(rel) and not matches:
            violations.append(f"{rel}: equals neither its source nor its manifest entry")
    # A version kept beside a verified copy (hidden, mirrord.core.model.VERSIONS) must be the file its entry records.
    versions = {rel: e for rel, e in entries.items() if e.role in (PENDING, PREVIOUS)}
    for rel, entry in sorted(versions.items()):
        try:
            if not _matches(world.mirror / rel, entry):
                violations.append(f"{rel}: the version does not match its manifest entry")
        except OSError as exc:
            violations.append(unreadable(rel, exc))
    missing = (rel for rel in entries if rel not in files and rel not in versions)
    violations += [f"manifest records {rel} but the mirror has no such file" for rel in missing]
    return violations


def converged_violations(world: World, expected: Iterable[str] | None = None) -> list[str]:
    """What must hold after a restart ran to completion: the crash invariants, and no temp file
    anywhere, and every mirror file equal to its source and recorded; with `expected`, exactly those
    files are mirrored."""
    violations = crash_violations(world)
    files, temps, _odd = finals(world.mirror)
    violations += [f"{rel}: temp file survived a completed restart" for rel in temps]
    entries, _ = load_manifest(world.mirror)
    for rel, path in sorted(files.items()):
        try:
            digest, size = hash_file(path, ALGO), path.stat().st_size
        except OSError as exc:
            violations.append(unreadable(rel, exc))
            continue
        if digest != world.source_digest(rel):
            violations.append(f"{rel}: differs from its source after a completed restart")
        entry = entries.get(rel)
        if entry is None:
            violations.append(f"{rel}: not recorded in the manifest after a completed restart")
        elif (entry.size, entry.digest) != (size, digest):
            violations.append(f"{rel}: manifest entry does not match the file after a completed restart")
    if expected is not None:
        want = set(expected)
        violations += [f"{rel}: not mirrored after a completed restart" for rel in sorted(want - set(files))]
        violations += [f"{rel}: on the mirror but should not be" for rel in sorted(set(files) - want)]
    return violations


def expected_latest(mirror: Path) -> Path | None:
    """What `latest` must name (issue 14): per run the newest by (branch, step) - a lower step written
    later is a rollback's new branch (mirrord.core.branches) - and across runs the one with the newest mtime."""
    from mirrord.core.branches import branches

    entries, _ = load_manifest(mirror)
    if not entries:
        return None
    by_run: dict[str, list[ManifestEntry]] = {}
    for e in entries.values():
        by_run.setdefault(e.run, []).append(e)
    best = []
    lie = (time.time() + 60) * 1e9  # an mtime beyond the skew allowance is a lying clock: no order
    for run_entries in by_run.values():
        order = branches(
            {e.step: 0 if e.source_mtime_ns > lie else e.source_mtime_ns for e in run_entries if e.step is not None}
        )
        best.append(
            max(
                run_entries,
                key=lambda e: (
                    e.step is not None,
                    order.key(e.step) if e.step is not None else (0, 0),
                    e.source_mtime_ns,
                ),
            )
        )
    return mirror / max(best, key=lambda e: e.source_mtime_ns).path


def kept_steps(world: World, run: str, n: int) -> set[int]:
    """What retention keeps of a run whose every step is on the primary (docs/retention.md): the n newest by
    (branch, step) (the window), and the tip of every abandoned branch (prune.keep_branch_tips, on by
    default): its newest step that is verified on the mirror or in the window (copied before long), else
    its newest step (then mirrored). A checkpoint rewritten later than a higher step is a rollback's new
    branch (issue 14): a trainer's rewrite abandons a branch."""
    from mirrord.core.branches import branches
    from mirrord.core.model import step_of

    regex = re.compile(r"step_(\d+)")
    stats = {}
    for rel, path in finals(world.primary)[0].items():
        step = step_of(rel, regex)
        if step is not None and rel.rsplit("/", 1)[0] == run:
            stats[step] = (rel, path.stat())
    run_branches = branches({step: st.st_mtime_ns for step, (_rel, st) in stats.items()})
    order = sorted(stats, key=run_branches.key)  # oldest first
    entries, _ = load_manifest(world.mirror)

    window = set(order[-n:])

    def mirrored(step: int) -> bool:
        rel, st = stats[step]
        entry, copy = entries.get(rel), world.mirror / rel
        return step in window or (
            entry is not None
            and copy.is_file()
            and copy.stat().st_size == entry.size
            and (entry.size, entry.source_mtime_ns) == (st.st_size, st.st_mtime_ns)
        )

    tips: dict[int, int] = {}
    for step in order:
        branch = run_branches.of[step]
        if branch < run_branches.top and (mirrored(step) or branch not in tips or not mirrored(tips[branch])):
            tips[branch] = step
    return window | set(tips.values())


# ----------------------------------------------------------------------------------------- processes
def settings(world: World, **sections: Any) -> dict[str, Any]:
    """mirrord settings for the world: the chaos preset (tests.support.config.CHAOS), then `sections`."""
    return config.settings(world.primary, world.mirror, config.CHAOS, sections)


def write_config(path: Path, world: World, **sections: Any) -> Path:
    """A mirrord TOML config file for the world (see settings())."""
    return config.write_config(path, settings(world, **sections))


def make_config(world: World, **sections: Any) -> Config:
    """The same settings as a Config object, for running mirrord's code inside the test process."""
    return config.load(settings(world, **sections))


class Zygote:
    """Client of zygote.py (see there): spawn real mirrord processes in milliseconds."""

    def __init__(self, log: Path) -> None:
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=Path(__file__).parents[2],
        )

    def _call(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the chaos zygote died; see its log")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def spawn(
        self,
        argv: list[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        stdout: Path | None = None,
        stop: bool = False,
        patch: str | None = None,
    ) -> int:
        answer = self._call(
            op="spawn",
            argv=[str(a) for a in argv],
            log=str(log),
            env=env or {},
            stdout=str(stdout) if stdout else None,
            stop=stop,
            patch=patch,
        )
        return int(answer["pid"])

    def wait(self, pid: int, timeout: float) -> int | None:
        status = self._call(op="wait", pid=pid, timeout=timeout)["status"]
        return None if status is None else int(status)

    def wait_or_kill(self, pid: int, timeout: float) -> int | None:
        """Wait up to `timeout`; a process still running then is SIGKILLed and reaped, and None returned."""
        status = self.wait(pid, timeout)
        if status is None:
            os.kill(pid, 9)
            self.wait(pid, 30)
        return status

    def run(self, argv: list[str], log: Path, timeout: float = 120, **kwargs: Any) -> int:
        """Run to completion; a process that outlives `timeout` is killed and reported as hung."""
        status = self.wait_or_kill(self.spawn(argv, log, **kwargs), timeout)
        if status is None:
            raise AssertionError(f"mirrord {' '.join(map(str, argv[:1]))} hung for {timeout} s; log: {log}")
        return status

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` is in group stop (or the process is gone: nothing of it runs either)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return all(state in ("T", "t", "Z", "X") for state in states)


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Hold a running mirrord still (SIGSTOP, every thread stopped) while the mirror is checked.

    A check reads many files one after the other; against a live daemon a file retention deletes
    between the listing and the read looks like a lost file. Stopped, the mirror is what a SIGKILL at
    that instant would leave, which is exactly what the crash invariants speak about; SIGCONT after.
    """
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:  # already gone: nothing moves
        yield
        return
    try:
        wait_for(lambda: _all_threads_stopped(pid), 60, f"every thread of process {pid} to stop", interval=0.02)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def latest_violations(zygote: Zygote, config: Path, world: World, workdir: Path) -> list[str]:
    """`mirrord latest` must name the highest recorded step, and its bytes must be the source's."""
    out = workdir / "latest.out"
    out.unlink(missing_ok=True)
    code = zygote.run(["latest", "--config", config], workdir / "latest.log", stdout=out)
    want = expected_latest(world.mirror)
    if want is None:
        return [] if code == 1 else [f"mirrord latest exited {code} with an empty manifest"]
    if code != 0:
        return [f"mirrord latest exited {code}; expected {want}"]
    got = Path(out.read_text().strip().splitlines()[-1])
    if got != want:
        return [f"mirrord latest returned {got}, expected {want}"]
    rel = got.relative_to(world.mirror).as_posix()
    if hash_file(got, ALGO) != world.source_digest(rel):
        return [f"mirrord latest returned {got}, whose bytes differ from its source"]
    return []


def latest_inprocess_violations(world: World) -> list[str]:
    """As latest_violations, calling mirrord.store.resume directly."""
    from mirrord.store.resume import latest_checkpoint

    got, want = latest_checkpoint(world.mirror), expected_latest(world.mirror)
    if got != want:
        return [f"latest_checkpoint returned {got}, expected {want}"]
    if got is not None and hash_file(got, ALGO) != world.source_digest(got.relative_to(world.mirror).as_posix()):
        return [f"latest_checkpoint returned {got}, whose bytes differ from its source"]
    return []


# ----------------------------------------------------------------------------------- block devices
def run_root(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=120)


class LoopFs:
    """An ext4 image on a loop device, mounted; remountable after a simulated power cut."""

    def __init__(self, image: Path, mount_point: Path, size_mb: int = 96, mkfs_args: tuple[str, ...] = ()) -> None:
        self.image, self.mount_point = image, mount_point
        with image.open("wb") as f:
            f.truncate(size_mb * 2**20)
        run_root("mkfs.ext4", "-q", "-F", *mkfs_args, str(image))
        self.device = run_root("losetup", "--find", "--show", str(image)).stdout.strip()
        self.stale_devices: list[str] = []  # loop devices whose superblock another namespace kept alive
        mount_point.mkdir(parents=True, exist_ok=True)
        self.mounted = False
        self.mount()

    def mount(self, after_shutdown: bool = False) -> None:
        """Mount the image. `after_shutdown`: the filesystem was shut down (a simulated power cut) and
        this mount stands for the reboot; then it must be a fresh one, never the dead superblock."""
        if after_shutdown and self._held_elsewhere():
            # Unmounted here, yet the kernel keeps the filesystem: a mount namespace created meanwhile by
            # another process (unshare, a container, a chroot build) holds a copy of the mount. Mounting the
            # device again would get that same, shut-down superblock back (EIO on every access). A second
            # loop device on the image gives a fresh mount that replays the journal, as a reboot would;
            # the old superblock is shut down and writes nothing. (Only then: a live superblock, as after
            # `umount -l` under a running daemon, must be shared, never mounted twice.)
            self.stale_devices.append(self.device)
            self.device = run_root("losetup", "--find", "--show", str(self.image)).stdout.strip()
        run_root("mount", "-t", "ext4", self.device, str(self.mount_point))
        self.mounted = True

    def _held_elsewhere(self) -> bool:
        """Whether the kernel still has an ext4 superblock on our device (give teardown 5 s)."""
        sysfs = Path("/sys/fs/ext4") / Path(self.device).name
        deadline = time.monotonic() + 5
        while sysfs.exists():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
        return False

    def umount(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            result = run_root("umount", str(self.mount_point), check=False)
            if result.returncode == 0:
                self.mounted = False
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"cannot unmount {self.mount_point}: {result.stderr.strip()}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.mounted:
            self.umount()
        for device in [*self.stale_devices, self.device]:  # a busy one goes when its holder lets go
            run_root("losetup", "--detach", device, check=False)


def loop_devices_unavailable() -> str | None:
    """Why a loop-mounted filesystem cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root (losetup, mount)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if subprocess.run(["which", tool], capture_output=True, check=False).returncode != 0:
            return f"{tool} is not installed"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control: this kernel or container has no loop devices"
    return None


@dataclass
class Checkpoints:
    """Real torch.save files of several sizes, made once per session and installed as bytes."""

    blobs: list[bytes]

    def pick(self, rng: random.Random, max_bytes: int | None = None) -> bytes:
        pool = [b for b in self.blobs if max_bytes is None or len(b) <= max_bytes]
        return rng.choice(pool)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.blobs)
