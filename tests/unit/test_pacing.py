"""Pacing from pressure stall information: the pure decision, the readers, and the shared pacer driven through
real pressure files that a scripted copy control advances (no real time is measured or asserted)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from mirrord.core.model import ManifestEntry
from mirrord.obs.metrics import Metrics
from mirrord.service.copier import CopyControl
from mirrord.service.pacing import (
    CPU_STALLED,
    FLOOR_SHARE,
    IO_STALLED,
    Pacer,
    Stall,
    decide,
    io_scheduler,
    missing_evidence,
    read_pressure,
    save_interval,
)
from mirrord.service.scrub import Scrubber
from mirrord.store.volume import LocalMirror
from tests.support.checkpoints import BASE_MTIME_NS
from tests.support.wait import wait_for

QUIET, OTHERS_IO, OTHERS_CPU = Stall(0.0, 0.0), Stall(IO_STALLED, 0.0), Stall(0.0, CPU_STALLED)


# --- the decision -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stall", "probed", "behind", "ran", "waited", "expected"),
    [
        (QUIET, False, False, 0.0, 0.0, "go"),  # nothing waits: full speed
        (QUIET, True, True, 5.0, 0.0, "go"),
        (Stall(IO_STALLED * 0.99, CPU_STALLED * 0.99), False, False, 0.0, 0.0, "go"),  # under both thresholds
        (OTHERS_IO, False, False, 0.0, 0.0, "probe"),  # stalls while copying may be the copies' own
        (OTHERS_CPU, False, True, 0.0, 9.0, "probe"),
        (OTHERS_IO, True, False, 0.0, 0.0, "pause"),  # stalls while every copy waited: the others'
        (OTHERS_CPU, True, False, 1.0, 100.0, "pause"),  # not behind: backs off as long as the others need it
        (OTHERS_IO, True, True, 0.0, 0.0, "pause"),  # behind: it waits first...
        (OTHERS_IO, True, True, 1.0, 0.9, "pause"),
        (OTHERS_IO, True, True, 1.0, 1.1, "go"),  # ...then takes its floor share once it waited as long as it ran
        (None, False, False, 0.0, 0.0, "pause"),  # no evidence: paced as if behind, whatever behind says
        (None, True, False, 1.0, 1.1, "go"),
    ],
)
def test_decide(stall: Stall | None, probed: bool, behind: bool, ran: float, waited: float, expected: str) -> None:
    """Quiet -> go; busy while copying -> probe; others busy -> pause, but behind (or without evidence) the
    copy runs once it waited as long as it ran (the floor share, half of the time)."""
    assert FLOOR_SHARE == 0.5
    assert decide(stall, probed, behind, ran, waited) == expected


def test_decide_floor_share_over_a_long_backoff() -> None:
    """Driven turn by turn against others who always need the device, a copy that is behind runs half of the
    time; one that is not never runs."""
    for behind, share in ((True, FLOOR_SHARE), (False, 0.0)):
        ran = waited = 0.0
        for _ in range(10_000):
            if decide(OTHERS_IO, True, behind, ran, waited) == "go":
                ran += 0.01
            else:
                waited += 0.01
        assert ran / (ran + waited) == pytest.approx(share, abs=0.01)


# --- the readers ------------------------------------------------------------------------------------


def write_pressure(root: Path, io_us: int, cpu_us: int) -> None:
    """/proc/pressure's two files, each replaced whole (a reader never sees one half written)."""
    root.mkdir(exist_ok=True)
    for name, total in (("io", io_us), ("cpu", cpu_us)):
        (root / f"{name}.new").write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        )
        (root / f"{name}.new").replace(root / name)


def test_read_pressure_reads_the_some_totals(tmp_path: Path) -> None:
    write_pressure(tmp_path / "pressure", 1234, 99)
    assert read_pressure(tmp_path / "pressure") == (1234, 99)
    assert read_pressure(tmp_path / "absent") is None  # no PSI (an old kernel, a container hiding it)
    (tmp_path / "pressure" / "cpu").write_text("garbage\n")
    assert read_pressure(tmp_path / "pressure") is None


def test_missing_evidence_names_psi_once(tmp_path: Path) -> None:
    """The start-up line names what is missing: here PSI (ionice "none" asks nothing of the scheduler)."""
    [missing] = missing_evidence([tmp_path], "none", root=tmp_path / "absent")
    assert "pressure stall information" in missing and str(tmp_path / "absent") in missing
    write_pressure(tmp_path / "pressure", 0, 0)
    assert missing_evidence([tmp_path], "none", root=tmp_path / "pressure") == []


def test_io_scheduler_of_a_path_without_a_block_device_is_none() -> None:
    """A tmpfs or procfs path has no I/O scheduler (and the idle class is not reported missing there)."""
    assert io_scheduler(Path("/proc")) is None
    assert missing_evidence([Path("/proc")], "idle") == [] or Path("/proc/pressure/io").exists() is False


def _entry(path: str, step: int, seconds: float, unit: str = "") -> ManifestEntry:
    return ManifestEntry(path, 1, "blake3", "0" * 64, int(seconds * 1e9), step, 0.0, unit=unit)


def test_save_interval_is_the_busiest_runs_median_gap() -> None:
    """The median gap between a run's newest saves, from the sources' mtimes, the shortest over the runs; a
    folder unit's files count as one save (its newest file); None until a run has two saves."""
    assert save_interval([]) is None
    assert save_interval([_entry("a/step_1.pt", 1, 100)]) is None
    entries = [_entry(f"a/step_{i}.pt", i, 1000 + 60 * i) for i in range(1, 6)]  # every 60 s
    entries += [_entry("a/step_9.pt", 9, 1000 + 60 * 5 + 600)]  # one late save: the median ignores it
    entries += [
        _entry(f"b/checkpoint-{i}/{f}", i, 50 * i + k, f"b/checkpoint-{i}")
        for i in (1, 2, 3)
        for k, f in enumerate("xy")
    ]
    assert save_interval(entries) == pytest.approx(50.0)  # run b saves every 50 s
    assert save_interval(entries[:6]) == pytest.approx(60.0)
    # Only the newest saves count: a run that now saves every 10 s after saving every 1,000 s.
    old = [_entry(f"c/step_{i}.pt", i, 1000.0 * i) for i in range(1, 20)]
    new = [_entry(f"c/step_{i}.pt", i, 19_000 + 10.0 * (i - 19)) for i in range(20, 30)]
    assert save_interval(old + new) == pytest.approx(10.0)


# --- the pacer, driven through real pressure files -----------------------------------------------


class ScriptedWorld(CopyControl):
    """A copy control whose pauses advance a clock and write the pressure files: the others' stalls follow
    `others(t)` (io, cpu shares); every `pace()` copies `chunk` seconds, whose own stalls count as `own`."""

    def __init__(self, root: Path, others: Callable[[float], tuple[float, float]], own: float = 0.9) -> None:
        self.now, self.io_us, self.cpu_us, self.root, self.others, self.own = 0.0, 0, 0, root, others, own
        self.copying = self.waiting = 0.0
        write_pressure(root, 0, 0)
        super().__init__(clock=lambda: self.now)

    def advance(self, seconds: float, copying: bool) -> None:
        io, cpu = self.others(self.now)
        self.io_us += int(seconds * 1e6 * max(io, self.own if copying else 0.0))
        self.cpu_us += int(seconds * 1e6 * cpu)
        self.now += seconds
        write_pressure(self.root, self.io_us, self.cpu_us)

    def pause(self, seconds: float) -> None:
        self.waiting += seconds
        self.advance(seconds, copying=False)

    def copy(self, pacer: Pacer, seconds: float, chunk: float = 0.05) -> None:
        """Copy for `seconds` of the scripted clock, pacing between chunks."""
        end = self.now + seconds
        while self.now < end:
            self.advance(chunk, copying=True)
            self.copying += chunk
            pacer.pace(self)


def test_full_speed_when_only_the_copy_itself_stalls(tmp_path: Path) -> None:
    """The copy's own I/O waits read as pressure: it probes, finds nobody else, and probes less and less
    often (at most one probe per MAX_QUIET_SECONDS): nearly all the time is copying, nothing is backoff."""
    world = ScriptedWorld(tmp_path / "pressure", lambda t: (0.0, 0.0))
    metrics = Metrics(runtime=False)
    with capture_logs() as logs:
        pacer = Pacer(metrics=metrics, root=world.root, clock=world.clock)
        world.copy(pacer, 30.0)
    assert world.waiting / (world.copying + world.waiting) < 0.05
    assert metrics.backoff_seconds._value.get() == 0
    assert not [e for e in logs if e["event"].startswith("pacing.")]


def test_backs_off_while_others_need_the_device_then_resumes(tmp_path: Path) -> None:
    """Others stall on I/O from t=10 to t=20: the copy waits through it (logged, counted in
    mirrord_backoff_seconds_total) and copies at full speed before and after."""
    world = ScriptedWorld(tmp_path / "pressure", lambda t: (0.5, 0.0) if 10 <= t < 20 else (0.0, 0.0))
    metrics = Metrics(runtime=False)
    with capture_logs() as logs:
        pacer = Pacer(metrics=metrics, root=world.root, clock=world.clock)
        world.copy(pacer, 30.0)
    events = [e["event"] for e in logs]
    assert events == ["pacing.backoff", "pacing.resumed"]
    assert logs[0]["io_stalled"] >= IO_STALLED
    waited = metrics.backoff_seconds._value.get()
    assert 8 < waited <= 10.5 and logs[1]["waited_seconds"] == pytest.approx(waited, abs=0.05)
    assert world.copying + world.waiting == pytest.approx(30.0, abs=0.2)  # the rest of the time: copying


def test_behind_takes_the_floor_share_however_busy_the_others(tmp_path: Path) -> None:
    """Others always stall on I/O: the copy waits until it is behind (here from t=5), then still runs about
    half of the time (pacing.floor, logged once), so its 10 s of copying end."""
    world = ScriptedWorld(tmp_path / "pressure", lambda t: (0.8, 0.0))
    with capture_logs() as logs:
        pacer = Pacer(behind=lambda: world.now >= 5, root=world.root, clock=world.clock)
        while world.copying < 10:
            world.copy(pacer, 0.05)
    assert world.waiting >= 5  # nothing copied until behind
    assert FLOOR_SHARE - 0.1 < world.copying / (world.now - 5) < FLOOR_SHARE + 0.1
    assert [e["event"] for e in logs] == ["pacing.backoff", "pacing.floor"]


def test_cpu_pressure_counts_only_when_copies_do_not_run_at_sched_idle(tmp_path: Path) -> None:
    """Others waiting for a CPU hold a copy at normal priority, not one at SCHED_IDLE (the kernel already
    puts it behind every other task)."""
    for cpu_counts, waited in ((True, True), (False, False)):
        world = ScriptedWorld(tmp_path / f"pressure-{cpu_counts}", lambda t: (0.0, 0.9) if t < 5 else (0.0, 0.0))
        pacer = Pacer(root=world.root, clock=world.clock, cpu=cpu_counts)
        world.copy(pacer, 10.0)
        assert (world.waiting > 4) is waited


def test_without_psi_copies_run_half_of_the_time(tmp_path: Path) -> None:
    """No /proc/pressure: no evidence either way, so the copy runs at the floor share all along."""
    world = ScriptedWorld(tmp_path / "pressure", lambda t: (0.0, 0.0))
    for name in ("io", "cpu"):
        (world.root / name).unlink()
    world.advance = lambda seconds, copying: setattr(world, "now", world.now + seconds)  # type: ignore[method-assign]
    pacer = Pacer(root=world.root, clock=world.clock)
    world.copy(pacer, 20.0)
    assert FLOOR_SHARE - 0.1 < world.copying / world.now < FLOOR_SHARE + 0.1


def test_a_stop_ends_a_backoff(tmp_path: Path) -> None:
    """A copy asked to stop (shutdown) leaves the pacer's wait at once, however busy the others."""
    world = ScriptedWorld(tmp_path / "pressure", lambda t: (0.9, 0.0))
    pacer = Pacer(root=world.root, clock=world.clock)
    world.advance(1.0, copying=True)
    pauses = [0]

    def pause(seconds: float) -> None:
        pauses[0] += 1
        if pauses[0] == 20:
            world.stop("cancelled")
        ScriptedWorld.pause(world, seconds)

    world.pause = pause  # type: ignore[method-assign]
    pacer.pace(world)
    assert world.stop_reason == "cancelled" and pauses[0] == 20


def test_the_scrub_waits_while_others_need_the_device_then_reads(tmp_path: Path, make_config) -> None:
    """The scrub reads through the copies' pacer: while another process stalls on I/O (its pressure total
    grows as fast as the clock, in real pressure files) the scrub reads nothing and backs off; once that
    stops, the pass reads every copy."""
    from tests.unit.test_latest import mirror_steps

    config = make_config(copy={"free_space_reserve_bytes": 0})
    mirror_steps(config, [("run/step_1.pt", 1, BASE_MTIME_NS), ("run/step_2.pt", 2, BASE_MTIME_NS + 10**9)])
    mirror = LocalMirror(config.mirror)
    manifest = mirror.read_manifest()
    root, metrics, stalling = tmp_path / "pressure", Metrics(runtime=False), threading.Event()
    write_pressure(root, 0, 0)
    stalling.set()

    def others() -> None:  # another task waits on I/O all the time while `stalling` is set
        io_us, last = 0, time.monotonic()
        while stalling.is_set():
            now = time.monotonic()
            io_us, last = io_us + int((now - last) * 1e6), now
            write_pressure(root, io_us, 0)
            time.sleep(0.005)

    writer = threading.Thread(target=others)
    writer.start()
    try:
        pacer = Pacer(metrics=metrics, root=root)
        # (the pacer reads at most every 0.1 s, and these copies take less: its first window holds the stalls)
        wait_for(lambda: (read_pressure(root) or (0, 0))[0] > 300_000, 60, "the others stalled a while")
        scrubber = Scrubber(lambda: config, mirror, manifest, metrics, frozenset, lambda: False, print, pacer=pacer)
        scrub = threading.Thread(target=scrubber.scrub_pass, args=(1e-6,))
        scrub.start()
        wait_for(lambda: metrics.backoff_seconds._value.get() > 0.5, 60, "the scrub backing off")
        assert metrics.scrub_bytes._value.get() == 0
    finally:
        stalling.clear()
        writer.join()
    scrub.join(timeout=60)
    assert not scrub.is_alive()
    assert metrics.scrub_bytes._value.get() == sum(e.size for e in manifest.entries.values())
    manifest.close()
