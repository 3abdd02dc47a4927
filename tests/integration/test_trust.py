"""Only whole checkpoints count (issue 14): the six scenarios, each with a real trainer process writing real
torch.save bytes in place, against a real `mirrord run` daemon or the one-shot commands.

After each, the invariants: `latest` never names a file that fails torch.load; no good step is deleted
while a newer one is torn; no primary file is deleted without a verified mirror copy of exactly it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mirrord.store.manifest import Manifest
from mirrord.store.resume import latest_checkpoint
from tests.support.checkpoints import publish_checkpoint
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.faketime import faketime_env
from tests.support.mirror import sha256
from tests.support.wait import wait_for
from tests.support.writer import REPO, WRITER_ARGV

RUN = "run"


class Writer:
    """One trainer process (its own session, so the test can kill it and anything it started)."""

    def __init__(self, workdir: Path, path: Path, step: int, mode: str, **options: Any) -> None:
        self.marker = workdir / f"writer-{step}-{mode}-{os.getpid()}.marker"
        self.go = workdir / f"writer-{step}-{mode}.go"
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = [*WRITER_ARGV, str(path), str(step), mode, "--marker", str(self.marker), "--go", str(self.go)]
        for key, value in options.items():
            argv += [f"--{key}", str(value)]
        self.log = (workdir / f"writer-{step}-{mode}.log").open("wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)

    def wait_marker(self, timeout: float = 60) -> None:
        wait_for(lambda: self.marker.exists() or self.proc.poll() is not None, timeout, "the writer's fault point")
        assert self.marker.exists(), f"writer exited {self.proc.returncode}"

    def release(self) -> None:
        self.go.write_text("go")

    def wait_done(self, timeout: float = 120) -> None:
        assert self.proc.wait(timeout=timeout) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[Callable[..., Writer]]:
    started: list[Writer] = []

    def start(path: Path, step: int, mode: str, **options: Any) -> Writer:
        w = Writer(tmp_path, path, step, mode, **options)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def ckpt(root: Path, step: int) -> Path:
    return root / RUN / f"step_{step}.pt"


def steps_on(root: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (root / RUN).glob("step_*.pt")) if (root / RUN).is_dir() else []


def loads(path: Path) -> dict[str, Any]:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    assert isinstance(obj, dict)
    return obj


def assert_latest_loads(mirror: Path) -> Path | None:
    """Invariant: `latest` never names a file that fails torch.load."""
    found = latest_checkpoint(mirror)
    if found is not None:
        loads(found)
    return found


def assert_primary_deletions_were_mirrored(d: DaemonProcess) -> None:
    """Invariant: a primary file is deleted only after its copy was committed, while that copy was there."""
    events = d.events()
    for i, e in enumerate(events):
        if e.get("event") == "prune.deleted" and e.get("volume") == "primary":
            before = events[:i]
            assert any(b.get("event") == "copy.committed" and b.get("path") == e["path"] for b in before), e
            assert not any(
                b.get("event") == "prune.deleted" and b.get("volume") == "mirror" and b.get("path") == e["path"]
                for b in before
            ), e


def settings(**prune: Any) -> dict[str, Any]:
    return {
        "copy": {"settle_seconds": 0.5, "invalid_grace_seconds": 2.0},
        "prune": {"enabled": True, "min_age_seconds": 0, **prune},
        "watch": {"rescan_interval_seconds": 2},
    }


# -- 1. a writer that pauses longer than settle_seconds mid-write -------------------------------------


def test_a_paused_writer_is_never_published_and_older_steps_stay(
    tmp_path: Path, daemon_factory: Any, writers: Any
) -> None:
    """Before: the 60% prefix was published as step 4, recorded, counted by retention (which deleted an
    older good step), returned by latest, and old steps were re-copied and re-deleted. After: the
    prefix fails validation and is not published; the paused step keeps every older one; once the
    writer finishes, step 4 is copied once and only then does step 2 go."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings(keep_last=2)).start()
    for step in (1, 2, 3):
        publish_checkpoint(ckpt(primary, step), step, megabytes=1)
    wait_for(lambda: steps_on(mirror) == [2, 3], 60, "steps 2 and 3 mirrored, 1 pruned")
    w = writers(ckpt(primary, 4), 4, "pause", mb=24, at=0.6, pause=300)
    w.wait_marker()
    d.wait_event("copy.failed", path=f"{RUN}/step_4.pt", reason="invalid_source", timeout=60)
    assert steps_on(mirror) == [2, 3]
    assert f"{RUN}/step_4.pt" not in Manifest.load(mirror).entries
    assert assert_latest_loads(mirror) == ckpt(mirror, 3)
    w.release()
    w.wait_done()
    d.wait_event("copy.committed", path=f"{RUN}/step_4.pt", timeout=60)
    wait_for(lambda: steps_on(mirror) == [3, 4], 60, "step 2 pruned once step 4 is verified")
    assert assert_latest_loads(mirror) == ckpt(mirror, 4)
    assert sha256(ckpt(mirror, 4)) == sha256(ckpt(primary, 4))
    for step in (1, 2, 3):  # no churn: no step copied twice (step 1 may be retired before it is copied)
        assert len(d.events("copy.committed", path=f"{RUN}/step_{step}.pt")) <= 1, step
    assert len(d.events("copy.committed", path=f"{RUN}/step_4.pt")) == 1


# -- 2. a trainer killed mid-save ------------------------------------------------------------------------


def test_a_killed_writer_leaves_a_torn_file_that_is_reported_never_trusted(
    tmp_path: Path, daemon_factory: Any, writers: Any
) -> None:
    """Before: the torn step 16 was mirrored and recorded, step 12 pruned, `latest` printed step 16 (which
    torch.load refused) and `status` said "intact ... problems: none". After: step 16 is never published,
    step 12 stays, after copy.invalid_grace_seconds it is counted and logged, and `status` exits 1 naming it."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings(keep_last=1, primary=True)).start()
    publish_checkpoint(ckpt(primary, 12), 12, megabytes=1)
    wait_for(lambda: steps_on(mirror) == [12], 60, "step 12 mirrored")
    w = writers(ckpt(primary, 16), 16, "hang", mb=16, at=0.5)
    w.wait_marker()
    w.kill()  # kill -9 mid-save
    event = d.wait_event("copy.invalid_source", path=f"{RUN}/step_16.pt", timeout=60)
    assert event["reason"] == "truncated" and event["published"] is False
    assert d.metric("mirrord_copies_total", 'result="invalid_source"') == 1
    assert steps_on(mirror) == [12] and steps_on(primary) == [12, 16]
    latest = run_mirrord("latest", "--mirror", mirror)
    assert latest.returncode == 0 and latest.stdout.strip() == str(ckpt(mirror, 12))
    loads(Path(latest.stdout.strip()))
    status = run_mirrord("status", "--config", d.config_path)
    assert status.returncode == 1, status.stdout
    assert f"{RUN}/step_16.pt is not a whole checkpoint" in status.stdout
    assert_primary_deletions_were_mirrored(d)


def test_the_small_repro_sync_prune_latest_never_trust_a_half_truncated_step(tmp_path: Path) -> None:
    """A good step_1 and a half-truncated step_2, keep_last = 1. Before: sync copied step 2, prune deleted
    the only good step, latest returned the torn file. After: sync refuses step 2 (exit 1), prune keeps
    step 1 on both sides, latest returns step 1."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(ckpt(primary, 1), 1, megabytes=1)
    good = ckpt(primary, 1).read_bytes()
    publish_checkpoint(ckpt(primary, 2), 2, megabytes=1, rename=False)
    torn = ckpt(primary, 2).read_bytes()
    ckpt(primary, 2).write_bytes(torn[: len(torn) // 2])
    assert good
    env = {
        "MIRRORD_PRUNE__KEEP_LAST": "1",
        "MIRRORD_PRUNE__PRIMARY": "true",
        "MIRRORD_COPY__SETTLE_SECONDS": "0.2",
        "MIRRORD_PRUNE__MIN_AGE_SECONDS": "0",
    }
    roots = ("--primary", primary, "--mirror", mirror)
    sync = run_mirrord("sync", *roots, env=env)
    assert sync.returncode == 1
    assert f"NOT PUBLISHED {RUN}/step_2.pt" in sync.stderr
    assert steps_on(mirror) == [1]
    prune = run_mirrord("prune", *roots, env=env)
    assert prune.returncode == 0, prune.stdout + prune.stderr
    assert steps_on(mirror) == [1] and steps_on(primary) == [1, 2]
    latest = run_mirrord("latest", "--mirror", mirror)
    assert latest.stdout.strip() == str(ckpt(mirror, 1))
    loads(ckpt(mirror, 1))
    deep = run_mirrord("verify", "--deep", "--mirror", mirror)
    assert deep.returncode == 0, deep.stdout


# -- 3. a writer holding the file open, silent, while `mirrord sync` runs ---------------------------------


def test_sync_never_publishes_a_file_an_open_writer_has_not_written_yet(tmp_path: Path, writers: Any) -> None:
    """Before: a 0-byte step_2.pt was published and sync exited 0 ("unsettled 0"). After: nothing is
    published, sync exits 1 naming it; once the writer finishes, the next sync copies the whole file."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(ckpt(primary, 1), 1, megabytes=1)
    w = writers(ckpt(primary, 2), 2, "silent", mb=4)
    w.wait_marker()
    env = {"MIRRORD_COPY__SETTLE_SECONDS": "0.5"}
    first = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert first.returncode == 1, first.stderr
    assert f"NOT PUBLISHED {RUN}/step_2.pt" in first.stderr and "0 bytes" in first.stderr
    assert steps_on(mirror) == [1]
    assert f"{RUN}/step_2.pt" not in Manifest.load(mirror).entries
    w.release()
    w.wait_done()
    second = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert second.returncode == 0, second.stderr
    assert sha256(ckpt(mirror, 2)) == sha256(ckpt(primary, 2))
    assert loads(ckpt(mirror, 2))["step"] == 2


# -- 4. a rollback: the trainer resumes from step 4 after reaching 12 and writes 6 and 8 again ---------------


@pytest.mark.parametrize("prune_primary", [False, True])
def test_a_rollback_is_mirrored_and_latest_prefers_the_new_branch(
    tmp_path: Path, daemon_factory: Any, writers: Any, prune_primary: bool
) -> None:
    """Before: with prune.primary = false the new steps were treated as retired and never mirrored; with
    true, the new step_6 was deleted from the primary 7 s after it was written, never mirrored; latest kept
    returning the abandoned step 12. After: both new steps are mirrored, the rollback is logged once, the
    abandoned branch goes only once the new one is verified (but for its tip, 12, kept on the mirror), and
    latest returns the new step 8."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings(keep_last=2, primary=prune_primary)).start()
    for step in (2, 4, 6, 8, 10, 12):  # each mirrored before the next (a step below the window when
        publish_checkpoint(ckpt(primary, step), step, megabytes=0.5)  # first seen is never copied)
        wait_for(lambda step=step: step in steps_on(mirror), 60, f"step {step} mirrored")
    wait_for(lambda: steps_on(mirror) == [10, 12], 60, "steps 10 and 12 mirrored, older ones pruned")
    if prune_primary:
        wait_for(lambda: steps_on(primary) == [10, 12], 60, "the primary pruned to 10 and 12")
    for step in (6, 8):  # the new branch, written in place by the trainer
        w = writers(ckpt(primary, step), step, "plain", mb=1, seed=1000 + step)
        w.wait_done()
    # The abandoned branch goes but for its tip, 12, kept on the mirror (prune.keep_branch_tips).
    wait_for(lambda: steps_on(mirror) == [6, 8, 12], 60, "the new branch mirrored, the abandoned one pruned")
    for step in (6, 8):
        assert sha256(ckpt(mirror, step)) == sha256(ckpt(primary, step))
    found = assert_latest_loads(mirror)
    assert found == ckpt(mirror, 8) and loads(found)["seed"] == 1008
    d.wait_event("run.rollback_detected", run=RUN)
    wait_for(lambda: len(d.events("reconcile.finished")) >= 4, 60, "more reconciles")
    [event] = d.events("run.rollback_detected")
    assert (event["old_step"], event["new_step"]) == (12, 6)
    assert steps_on(primary) == ([6, 8] if prune_primary else [2, 4, 6, 8, 10, 12])
    assert_primary_deletions_were_mirrored(d)


# -- 5. a wall clock ahead of the files' mtimes ------------------------------------------------------------


def test_a_wall_clock_ahead_publishes_no_prefix_of_a_slow_writer(
    tmp_path: Path, daemon_factory: Any, writers: Any
) -> None:
    """The daemon's clock is 30 s ahead (faketime; its monotonic clock is left alone, as with an NTP
    step or an NFS server that lags). Before: a writer appending 100 KB every 0.3 s was published ten
    times, each prefix recorded and returned by latest, and step 1 pruned once a prefix entered the
    window. After: nothing is published until the file is whole, step 1 stays until then."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings(keep_last=1, primary=True), env=faketime_env("+30s")).start()
    publish_checkpoint(ckpt(primary, 1), 1, megabytes=1)
    wait_for(lambda: steps_on(mirror) == [1], 60, "step 1 mirrored")
    w = writers(ckpt(primary, 2), 2, "trickle", mb=2, chunk=100_000, interval=0.3)
    size_file = Path(str(w.marker) + ".size")
    wait_for(size_file.exists, 60, "the writer's start")
    whole = int(size_file.read_text())
    while w.proc.poll() is None:  # every observation while the writer writes
        # Step 2 on the mirror only once whole (the writer may linger after its last write), and
        # step 1 goes only after that.
        on_mirror = steps_on(mirror)
        assert on_mirror in ([1], [1, 2], [2]), on_mirror
        if 2 in on_mirror:
            assert ckpt(mirror, 2).stat().st_size == whole
        assert_latest_loads(mirror)
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=0.3)
    w.wait_done()
    d.wait_event("copy.committed", path=f"{RUN}/step_2.pt", timeout=60)
    wait_for(lambda: steps_on(mirror) == [2], 60, "step 1 pruned once step 2 is verified")
    assert len(d.events("copy.committed", path=f"{RUN}/step_2.pt")) == 1
    assert assert_latest_loads(mirror) == ckpt(mirror, 2)
    assert_primary_deletions_were_mirrored(d)


def test_a_wall_clock_a_day_ahead_does_not_age_a_file_past_min_age(tmp_path: Path, daemon_factory: Any) -> None:
    """Issue 15, item 3: `faketime +1d` made a 15-second-old step look a day old and it was deleted on both
    sides despite min_age_seconds = 300. After: mirrord must itself have seen the file unchanged for
    min_age_seconds (monotonic clock), so the step stays and the veto is logged as recently_seen."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings(keep_last=1, primary=True, min_age_seconds=300), env=faketime_env("+1d")).start()
    publish_checkpoint(ckpt(primary, 1), 1, megabytes=0.5)
    wait_for(lambda: steps_on(mirror) == [1], 60, "step 1 mirrored")  # before step 2 retires it
    publish_checkpoint(ckpt(primary, 2), 2, megabytes=0.5)
    wait_for(lambda: steps_on(mirror) == [1, 2], 60, "both steps mirrored")
    d.wait_event("prune.skipped", path=f"{RUN}/step_1.pt", volume="mirror", reason="recently_seen", timeout=60)
    d.wait_event("prune.skipped", path=f"{RUN}/step_1.pt", volume="primary", reason="recently_seen", timeout=60)
    assert steps_on(mirror) == [1, 2] and steps_on(primary) == [1, 2]
    assert not d.events("prune.deleted")


# -- 6. the first run on an existing tree ----------------------------------------------------------------


@pytest.mark.parametrize("prune_primary", [False, True])
def test_a_first_run_on_an_existing_tree_copies_only_what_the_window_keeps(
    tmp_path: Path, daemon_factory: Any, prune_primary: bool
) -> None:
    """20 old checkpoints, keep_last = 2. Before: all 20 were copied, then 18 deleted. After: only steps 19
    and 20 are copied; nothing is deleted from the mirror. With prune.primary the primary is bounded too:
    its 18 retired steps go once 19 and 20 are verified, never mirrored as they were (issue 32 item 4)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    base = 1_700_000_000 * 10**9
    for step in range(1, 21):
        path = publish_checkpoint(ckpt(primary, step), step, megabytes=0.2)
        os.utime(path, ns=(base + step * 10**9, base + step * 10**9))
    d = daemon_factory(settings(keep_last=2, primary=prune_primary)).start()
    wait_for(lambda: steps_on(mirror) == [19, 20], 60, "steps 19 and 20 mirrored")
    done = len(d.events("reconcile.finished"))
    wait_for(lambda: len(d.events("reconcile.finished")) >= done + 2, 60, "two more reconciles")
    assert sorted(e["path"] for e in d.events("copy.started")) == [f"{RUN}/step_19.pt", f"{RUN}/step_20.pt"]
    if prune_primary:
        wait_for(lambda: steps_on(primary) == [19, 20], 60, "the primary bounded to the window")
        assert {e["path"] for e in d.events("prune.deleted")} == {f"{RUN}/step_{s}.pt" for s in range(1, 19)}
        assert {e["volume"] for e in d.events("prune.deleted")} == {"primary"} and not d.events("prune.skipped")
    else:
        assert not d.events("prune.deleted") and steps_on(primary) == list(range(1, 21))
    assert steps_on(mirror) == [19, 20]
    assert assert_latest_loads(mirror) == ckpt(mirror, 20)


# -- verify --deep, status and latest on files the manifest cannot vouch for --------------------------


def test_verify_deep_validates_unrecorded_files_and_reports_unknown_formats_as_unchecked(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(ckpt(primary, 1), 1, megabytes=1)
    sync = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env={"MIRRORD_COPY__SETTLE_SECONDS": "0"})
    assert sync.returncode == 0, sync.stderr
    (mirror / RUN / "notes.pt").write_bytes(b"\x80\x02 not a zip, no validator for it")
    assert run_mirrord("verify", "--deep", "--mirror", mirror).returncode == 1  # unrecorded is a problem
    bad = bytearray(ckpt(primary, 1).read_bytes())
    bad[len(bad) // 2] ^= 1
    (mirror / RUN / "step_9.pt").write_bytes(bytes(bad))
    deep = run_mirrord("verify", "--deep", "--mirror", mirror)
    lines = {line.split()[1]: line.split()[0] for line in deep.stdout.splitlines() if len(line.split()) > 1}
    assert lines[f"{RUN}/step_9.pt"] == "CRC_MISMATCH", deep.stdout
    assert lines[f"{RUN}/notes.pt"] == "UNRECORDED", deep.stdout
    assert deep.returncode == 1
    (mirror / RUN / "step_9.pt").unlink()
    (mirror / RUN / "notes.pt").unlink()
    clean = run_mirrord("verify", "--deep", "--mirror", mirror)
    assert clean.returncode == 0, clean.stdout + clean.stderr


def test_a_torn_file_recorded_by_an_older_mirrord_is_neither_intact_nor_latest(tmp_path: Path) -> None:
    """A manifest entry written before validation existed, for a torn file of the recorded size and hash
    (what 0.1.0 recorded for a torn source): status says NOT intact (exit 1), latest skips it."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(ckpt(primary, 1), 1, megabytes=1)
    env = {"MIRRORD_COPY__SETTLE_SECONDS": "0", "MIRRORD_METRICS__ENABLED": "false"}
    assert run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env).returncode == 0
    publish_checkpoint(ckpt(primary, 2), 2, megabytes=1, rename=False)
    torn = ckpt(primary, 2).read_bytes()[:500_000]
    ckpt(primary, 2).write_bytes(torn)
    ckpt(mirror, 2).write_bytes(torn)
    st = ckpt(primary, 2).stat()
    os.utime(ckpt(mirror, 2), ns=(st.st_mtime_ns, st.st_mtime_ns))
    manifest = Manifest.open(mirror)
    from mirrord.core.model import ManifestEntry
    from tests.support.mirror import hash_file

    manifest.record(
        ManifestEntry(
            f"{RUN}/step_2.pt", len(torn), "blake3", hash_file(ckpt(mirror, 2), "blake3"), st.st_mtime_ns, 2, 0.0
        )
    )  # validation None: recorded before issue 14
    manifest.close()
    status = run_mirrord("status", "--primary", primary, "--mirror", mirror, env=env)
    assert status.returncode == 1 and "NOT intact" in status.stdout and "truncated" in status.stdout, status.stdout
    assert assert_latest_loads(mirror) == ckpt(mirror, 1)
