"""Copies and the scrub paced from evidence: at full speed while nothing else needs the device or the CPU,
paused while something does, and never behind for good.

The evidence is pressure stall information (PSI): the share of time some task waited for I/O or for a CPU.
It is read system-wide (/proc/pressure), never from the daemon's own cgroup: under systemd or in a container
that cgroup holds the daemon's tasks only, so its io.pressure shows mirrord's own waits and never the
trainer's. System-wide, a copy's own waits count too (measured: a lone 1.5 GiB `dd` with direct I/O on an
idle disk read as 35-79% io "some"), so a high reading taken while copying is only a hint: it is judged by
a probe, a short window in which every copy and the scrub of this process wait (their stalls end), so what
stalls in its second half is someone else. In a container /proc/pressure is the host's: more cautious,
never blind.

Once mirrord_mirror_lag_seconds passes one save interval (the median gap between a run's saves, from the
checkpoints' mtimes), the copy takes at least FLOOR_SHARE of the time however busy the others are: it
stops backing off for as long as it waited, so the mirror falls no further behind than about one checkpoint
while the copy at that share outpaces the saves. Without PSI (an old kernel, or a container that hides it)
there is no evidence: copies then run at that floor share all the time, half speed, and the daemon says so
once at start-up.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from mirrord.core.model import ManifestEntry
from mirrord.obs.log import get_logger

if TYPE_CHECKING:
    from mirrord.obs.metrics import Metrics

PROC_PRESSURE = Path("/proc/pressure")
CHECK_SECONDS = 0.1  # pressure is read at most this often (a read of two small files)
PROBE_SECONDS = 0.06  # a probe's window: the stalls of its second half are the others'
MAX_QUIET_SECONDS = 2.0  # after probes that found only our own stalls, no probe for up to this long
IO_STALLED = 0.10  # others waited for I/O 10% of the window: something needs the device
CPU_STALLED = 0.30  # others waited for a CPU 30% of the window (counted unless copies run at SCHED_IDLE)
FLOOR_SHARE = 0.5  # once behind, the copy runs at least this share of the time
FLOOR_TURN_SECONDS = 1.0  # ... in turns of this long

Decision = Literal["go", "probe", "pause"]


class CopyControl(Protocol):
    """What the pacer needs of a copy (service.copier.CopyControl, the scrub's): whether it was asked to stop,
    and a wait that ends early when it is."""

    stop_reason: str | None

    def pause(self, seconds: float) -> None:
        """Wait `seconds`, or less once the copy is asked to stop."""


@dataclass(frozen=True)
class Stall:
    """Shares of a window (0..1) in which some task waited: for I/O, and for a CPU."""

    io: float
    cpu: float

    @property
    def busy(self) -> bool:
        """Whether something waited long enough to need the device or the CPU."""
        return self.io >= IO_STALLED or self.cpu >= CPU_STALLED


def decide(stall: Stall | None, probed: bool, behind: bool, ran: float, waited: float) -> Decision:
    """What a copy does next, from the stalls over the last window (None: no PSI, no evidence).

    `probed`: that window was a probe (only the others' stalls); `ran`, `waited`: seconds this episode of
    backing off has copied and waited. Quiet -> go; busy while copying -> probe (the stall may be ours);
    others busy (or no evidence) -> pause, unless behind and the floor share is due -> go."""
    if stall is not None and not stall.busy:
        return "go"
    if stall is not None and not probed:
        return "probe"
    floor_due = (behind or stall is None) and waited * FLOOR_SHARE > ran * (1 - FLOOR_SHARE)
    return "go" if floor_due else "pause"


def read_pressure(root: Path = PROC_PRESSURE) -> tuple[int, int] | None:
    """The "some" stall totals (microseconds) of I/O and CPU, or None where PSI is missing."""
    try:
        return _total(root / "io"), _total(root / "cpu")
    except (OSError, ValueError, IndexError):
        return None


def _total(path: Path) -> int:
    with open(path) as f:  # "some avg10=0.00 avg60=0.00 avg300=0.00 total=1234"
        return int(f.readline().rpartition("total=")[2])


def io_scheduler(path: Path) -> str | None:
    """The I/O scheduler of the block device holding `path` (None: not a block device, e.g. tmpfs)."""
    try:
        dev = path.stat().st_dev
        block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        queue = block / "queue" if (block / "queue").exists() else block / ".." / "queue"  # a partition's disk
        return (queue / "scheduler").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def missing_evidence(paths: Iterable[Path], ionice: str, root: Path = PROC_PRESSURE) -> list[str]:
    """What the pacing lacks here, one phrase each: PSI, or an idle I/O class that has effect (BFQ only)."""
    missing = [] if read_pressure(root) is not None else [f"pressure stall information ({root})"]
    schedulers = {s for path in paths if (s := io_scheduler(path)) not in (None, "bfq")} if ionice == "idle" else set()
    return missing + [f"the idle I/O class (scheduler {s}; only bfq honours it)" for s in sorted(schedulers)]


def save_interval(entries: Iterable[ManifestEntry], saves: int = 8) -> float | None:
    """Seconds between a run's saves: the median gap between its newest `saves` steps' mtimes, the shortest
    over the runs (None until a run has two steps mirrored)."""
    runs: dict[str, dict[int, int]] = defaultdict(dict)
    for e in entries:
        if e.step is not None:
            steps = runs[(e.unit or e.path).rpartition("/")[0]]
            steps[e.step] = max(steps.get(e.step, 0), e.source_mtime_ns)
    gaps = []
    for steps in runs.values():
        mtimes = [steps[s] for s in sorted(steps)[-saves:]]
        if len(mtimes) > 1:
            gaps.append(statistics.median(b - a for a, b in itertools.pairwise(mtimes)) / 1e9)
    return min(gaps, default=None)


class Pacer:
    """One per process, shared by every copy thread and the scrub: each calls pace() between buffers.

    `behind()`: the mirror lags by more than a save interval (the floor share is due); asked only while
    others need the device. `cpu`: whether CPU pressure counts: not when copies run at SCHED_IDLE
    (io.cpu_policy = "idle"), which never keeps another task off a CPU (the kernel arbitrates that better
    than a pause; measured here, neighbours' builds alone read 50-100% cpu "some" and would hold copies).
    A floor turn lasts FLOOR_TURN_SECONDS; then the copy waits as long again (while others still need the
    device), so it runs FLOOR_SHARE of the time."""

    def __init__(
        self,
        behind: Callable[[], bool] = lambda: False,
        metrics: Metrics | None = None,
        cpu: bool = True,
        root: Path = PROC_PRESSURE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.behind, self.metrics, self.cpu, self.root, self.clock = behind, metrics, cpu, root, clock
        self.log = get_logger()
        self._lock = threading.Lock()
        self._checking = False
        self._paused_until = self._next_check = 0.0
        self._quiet = CHECK_SECONDS
        self._last = (self.clock(), read_pressure(root))
        self._episode: float | None = None  # when the current backing off (or floor turn) began
        self._waited = 0.0
        self._floor_logged = False

    def pace(self, control: CopyControl) -> None:
        """Between two buffers: wait while another thread's probe or backoff holds copies, or check the
        pressure when due (ends early when the copy is asked to stop)."""
        with self._lock:
            check = not self._checking and self.clock() >= max(self._next_check, self._paused_until)
            self._checking |= check
        if check:
            try:
                self._check(control)
            finally:
                self._checking = False
        while (self._checking or self._paused_until > self.clock()) and control.stop_reason is None:
            control.pause(PROBE_SECONDS / 4)

    def _check(self, control: CopyControl) -> None:
        stall, probed = self._stall(), False
        while control.stop_reason is None:
            now = self.clock()
            ran = 0.0 if self._episode is None else now - self._episode - self._waited
            behind = probed and stall is not None and stall.busy and self.behind()
            decision = decide(stall, probed, behind, ran, self._waited)
            if decision == "go":
                break
            if decision == "pause" and self._episode is None:
                self._episode, self._floor_logged = now, False
                self.log.info("pacing.backoff", **_shares(stall))
            stall, probed = self._probe(control), True
        else:
            return
        if stall is not None and not stall.busy:  # nothing else needs the device or the CPU
            if self._episode is not None:
                self.log.info("pacing.resumed", waited_seconds=round(self._waited, 2), **_shares(stall))
                self._quiet = CHECK_SECONDS
            elif probed:  # the stalls that made it probe were the copies' own: probe less often
                self._quiet = min(2 * self._quiet, MAX_QUIET_SECONDS)
            self._episode, self._waited = None, 0.0
            self._next_check = self.clock() + (self._quiet if probed else CHECK_SECONDS)
            return
        if not self._floor_logged:  # behind (or no evidence): a floor turn, whatever the others need
            self._floor_logged = True
            self.log.info("pacing.floor", share=FLOOR_SHARE, waited_seconds=round(self._waited, 2), **_shares(stall))
        self._episode, self._waited = self.clock(), 0.0
        self._next_check = self._episode + FLOOR_TURN_SECONDS

    def _probe(self, control: CopyControl) -> Stall | None:
        """Hold every copy for PROBE_SECONDS; the stalls of its second half (the others'), None without PSI.
        Within an episode of backing off, the probe's time is time waited."""
        begun = self.clock()
        self._paused_until = begun + PROBE_SECONDS
        control.pause(PROBE_SECONDS / 2)
        self._last = (self.clock(), read_pressure(self.root))
        control.pause(max(0.0, self._paused_until - self.clock()))
        stall = self._stall()
        if self._episode is not None:
            self._waited += self.clock() - begun
            if self.metrics is not None:
                self.metrics.backoff_seconds.inc(self.clock() - begun)
        return stall

    def _stall(self) -> Stall | None:
        """The stalls since the last reading (None without PSI)."""
        (then, before), now, after = self._last, self.clock(), read_pressure(self.root)
        self._last = (now, after)
        if before is None or after is None:
            return None
        window_us = max(now - then, 1e-3) * 1e6
        return Stall((after[0] - before[0]) / window_us, (after[1] - before[1]) / window_us if self.cpu else 0.0)


def _shares(stall: Stall | None) -> dict[str, float | None]:
    return {
        "io_stalled": None if stall is None else round(stall.io, 3),
        "cpu_stalled": None if stall is None else round(stall.cpu, 3),
    }
