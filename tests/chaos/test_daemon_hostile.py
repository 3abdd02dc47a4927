"""A hostile environment around a running daemon: half-written configs reloaded, signals during
start-up, a thousand idle HTTP clients, the primary's root recreated or mounted over, hostile config
values, checkpoints that can never be mirrored, bursts of commits. Real processes, real signals, real
sockets, real mounts.

The promise checked: the daemon never deletes more than a whole, intended config says, never goes
blind or unresponsive, and its metrics and logs tell the truth.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import tomli_w

from mirrord.store.manifest import Manifest
from tests.chaos.harness import (
    Checkpoints,
    Report,
    World,
    Zygote,
    converged_violations,
    run_root,
    settings,
    step_name,
    write_config,
)
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.faketime import faketime_env
from tests.support.logs import read_events
from tests.support.ports import idle_connections
from tests.support.wait import wait_for

NS = 10**9


def _mirrored(world: World, rels: set[str]) -> bool:
    try:
        entries = Manifest.load(world.mirror).entries
    except Exception:  # being replaced: not yet
        return False
    return all(rel in entries and (world.mirror / rel).is_file() for rel in rels)


def _mirror_count(world: World) -> int:
    return len(list((world.mirror / "run").glob("*.pt"))) if (world.mirror / "run").is_dir() else 0


# ----------------------------------------------------------------------- 4. half-written config
@pytest.mark.parametrize("clock", ["real clock", "faketime +1d"])
def test_sighup_during_a_config_write_never_deletes_more(
    tmp_path: Path, checkpoints: Checkpoints, report: Report, clock: str
) -> None:
    """Issue 15.4: a SIGHUP while the config file is being rewritten in place (cut before [prune]:
    defaults apply, keep_last = 12; cut inside `keep_last = 20`: keep_last = 2). The reload must wait
    for the file to be whole, or refuse; never delete a checkpoint the whole file keeps. Also with the
    daemon's clock a day ahead (the file's mtime then looks old: it must not count as settled)."""
    env: dict[str, str] = {}
    if clock.startswith("faketime"):
        env = faketime_env("+1d", monotonic_too=True)  # preloaded, no wrapper: SIGHUP must reach the daemon
    tally = report.scenario(f"hostile env: SIGHUP while the config is half-written ({clock})")
    rng = random.Random(154)
    world = World(tmp_path / "w")
    for step in range(1, 16):
        world.install(f"run/{step_name(step)}", checkpoints.pick(rng, 200_000))
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {
            "prune": {"enabled": True, "keep_last": 20, "min_age_seconds": 0},
            "watch": {"rescan_interval_seconds": 0.5},
            "log": {"level": "info"},
        },
        env=env,
    )
    # [prune] last, as in many hand-written files: a cut loses only retention keys (a cut that lost
    # [metrics] would be refused anyway, as a change that needs a restart).
    order = [k for k in daemon.settings if k != "prune"] + ["prune"]
    daemon.settings = {k: daemon.settings[k] for k in order}
    daemon.write_config()
    daemon.start()
    whole = daemon.config_path.read_text()
    cuts = {
        "cut before [prune] (defaults: keep_last = 12)": whole.index("[prune]"),
        "cut inside keep_last = 20 (keep_last = 2)": whole.index("keep_last = 20") + len("keep_last = 2"),
    }
    try:
        wait_for(lambda: _mirror_count(world) == 15, 60, "15 steps mirrored", interval=0.02)
        for n, (label, cut) in enumerate(cuts.items(), start=1):
            with daemon.config_path.open("r+") as f:  # rewritten in place, as an editor or `>` does
                f.truncate(0)
                f.write(whole[:cut])
                f.flush()
                daemon.send(signal.SIGHUP)
                tally.fault(label)
                time.sleep(0.4)  # the fault itself: the writer pauses mid-write
                f.write(whole[cut:])
            tally.rounds += 1
            wait_for(
                lambda n=n: len(daemon.events("config.reloaded") + daemon.events("config.reload_refused")) >= n,
                30,
                f"reload {n} handled",
                interval=0.02,
            )
            start = len(daemon.events("prune.finished"))
            wait_for(
                lambda s=start: len(daemon.events("prune.finished")) >= s + 3, 30, "three prune passes", interval=0.02
            )
            if _mirror_count(world) != 15:
                tally.check([f"{label}: {15 - _mirror_count(world)} mirror checkpoint(s) deleted"])
    finally:
        code = daemon.stop()
    tally.notes.append(
        f"reloads applied {len(daemon.events('config.reloaded'))}, "
        f"refused {len(daemon.events('config.reload_refused'))}"
    )
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.assert_clean()


# ---------------------------------------------------------------- 8. a thousand idle HTTP clients
def test_idle_http_clients_do_not_blind_the_daemon(tmp_path: Path, checkpoints: Checkpoints, report: Report) -> None:
    """Issue 15.8: under LimitNOFILE=1024, 1,100 idle connections to the metrics port. /healthz must
    still answer, a new checkpoint must still be mirrored, the daemon's threads stay bounded, and no
    listing failure is reported as an unmounted mirror."""
    tally = report.scenario("hostile env: 1,100 idle HTTP connections under LimitNOFILE=1024")
    rng = random.Random(158)
    world = World(tmp_path / "w")
    world.install(f"run/{step_name(1)}", checkpoints.pick(rng))
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {"watch": {"rescan_interval_seconds": 1}, "log": {"level": "info"}},
        wrapper=["prlimit", "--nofile=1024:1024", "--"],
    )
    daemon.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    try:
        wait_for(lambda: _mirrored(world, {f"run/{step_name(1)}"}), 30, "step 1 mirrored", interval=0.02)
        with idle_connections(daemon.port, 1100) as idle:
            tally.fault("idle connections", len(idle))
            for round_ in range(3):
                tally.rounds += 1
                code = wait_for(lambda: daemon.http("/healthz")[0], 30, "/healthz to answer at all", interval=0.02)
                if code != 200:
                    tally.check([f"/healthz answered {code} with 1,100 idle clients"])
                rel = f"run/{step_name(2 + round_)}"
                world.install(rel, checkpoints.pick(rng))
                wait_for(
                    lambda rel=rel: _mirrored(world, {rel}),
                    30,
                    f"{rel} mirrored with 1,100 idle clients",
                    interval=0.02,
                )
            threads = len(list(Path(f"/proc/{daemon.proc.pid}/task").iterdir()))  # type: ignore[union-attr]
            tally.notes.append(f"daemon threads with 1,100 idle clients: {threads}")
            if threads > 40:
                tally.check([f"{threads} threads: one per connection"])
            unmounted = [e for e in daemon.events("mirror.refused") if "mounted" in str(e.get("cause"))]
            tally.check([f"reported as unmounted: {e['cause']}" for e in unmounted])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.check(converged_violations(world, world.primary_files()))
    tally.assert_clean()


# ------------------------------------------------------------------ 9. primary root replaced
@pytest.mark.host  # mounts a tmpfs over the primary
def test_watcher_follows_a_recreated_or_mounted_over_primary(
    tmp_path: Path, checkpoints: Checkpoints, report: Report
) -> None:
    """Issue 15.9: the primary's root recreated, then a tmpfs mounted on it, then unmounted, while the
    next rescan is ten minutes away. Every new checkpoint must still be mirrored promptly (the watcher
    re-armed on the new directory)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount -t tmpfs)")
    tally = report.scenario("hostile env: primary root recreated / mounted over (rescan 600 s)")
    rng = random.Random(159)
    world = World(tmp_path / "w")
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {
            "watch": {"mode": "native", "rescan_interval_seconds": 600},
            "copy": {"settle_seconds": 0.2},
            "log": {"level": "info"},
        },
    )
    daemon.start()
    mounted = False
    try:

        def change(label: str) -> None:
            nonlocal mounted
            if label == "recreated":
                world.primary.rename(tmp_path / "old-primary")
                world.primary.mkdir()
            elif label == "mounted over":
                run_root("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(world.primary))
                mounted = True
            else:
                run_root("umount", str(world.primary))
                mounted = False

        for n, label in enumerate(("recreated", "mounted over", "unmounted again"), start=1):
            change(label)
            tally.fault(f"primary root {label}")
            tally.rounds += 1
            rel = f"run-{n}/{step_name(n)}"
            world.install(rel, checkpoints.pick(rng))
            try:
                wait_for(
                    lambda rel=rel: _mirrored(world, {rel}),
                    20,
                    f"{rel} mirrored after the root was {label}",
                    interval=0.02,
                )
            except AssertionError as exc:
                tally.check([str(exc)])
            if daemon.http("/healthz")[0] != 200:
                tally.check([f"/healthz not ok after the root was {label}: {daemon.http('/healthz')[1]}"])
        tally.notes.append(f"watcher re-armed {len(daemon.events('watch.rearm'))} time(s)")
    finally:
        if mounted:
            run_root("umount", str(world.primary), check=False)
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.assert_clean()


# ---------------------------------------------------------------------- 10. hostile config values
HOSTILE_VALUES = {
    "daemon.heartbeat_seconds": "inf",
    "watch.rescan_interval_seconds": "1e-9",
    "watch.poll_interval_seconds": "inf",
    "io.bandwidth_limit": "1",
    "copy.stall_seconds": "nan",
    "prune.min_age_seconds": "1e308",
    "daemon.shutdown_grace_seconds": "-inf",
    "copy.retry_backoff_max_seconds": "inf",
}


def test_hostile_values_are_refused_naming_the_key(tmp_path: Path, zygote: Zygote, report: Report) -> None:
    """Issue 15.10: infinite, NaN, nanosecond and 1-byte/s values passed check-config and then froze,
    crashed or flooded the daemon. Each must be refused (exit 2) with the key named."""
    tally = report.scenario("hostile env: infinite / tiny intervals and rates in the config")
    world = World(tmp_path / "w")
    for key, raw in HOSTILE_VALUES.items():
        section, name = key.split(".")
        base = settings(world)
        base.setdefault(section, {})[name] = 0  # placeholder, replaced as raw TOML below
        text = tomli_w.dumps(base).replace(f"{name} = 0\n", f"{name} = {raw}\n", 1)
        config = tmp_path / "hostile.toml"
        config.write_text(text)
        out = tmp_path / "check.out"
        for command in ("check-config", "run"):
            code = zygote.run([command, "--config", config], tmp_path / "check.log", stdout=out, timeout=30)
            tally.rounds += 1
            tally.fault(f"{key} = {raw}")
            if code != 2:
                tally.check([f"{key} = {raw}: mirrord {command} exited {code}, expected 2"])
    # The message names the key: checked on the real executable's stderr for one of them.
    config.write_text(tomli_w.dumps(settings(world)).replace("heartbeat_seconds = 0.25", "heartbeat_seconds = inf"))
    err = subprocess.run(
        [sys.executable, "-m", "mirrord", "check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stderr
    if "daemon.heartbeat_seconds" not in err:
        tally.check([f"the error does not name the key: {err.strip()}"])
    tally.assert_clean()


# ------------------------------------------------------------------ 11. signals during start-up
def test_sighup_during_startup_does_not_kill_the_daemon(
    tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Issue 15.11: a SIGHUP within the first fraction of a second (while the daemon takes its lock and
    reads a large manifest) killed it. Sent at random instants of the start-up, it must be recorded and
    acted on: the daemon reaches ready, and stops cleanly on SIGTERM."""
    tally, rng = report.seeded_scenario("hostile env: SIGHUP during daemon start-up", "sighup-startup")
    world = World(tmp_path / "w")
    world.install(f"run/{step_name(1)}", checkpoints.pick(rng))
    # A large manifest makes start-up last long enough to aim at (entries for files that are gone).
    doc = {
        "schema": "mirrord-manifest",
        "version": 1,
        "entries": {
            f"old/step_{i:06d}.pt": {
                "size": 1,
                "hash": {"algo": "blake3", "digest": "00" * 32},
                "source_mtime_ns": 1,
                "step": i,
                "mirrored_at": 1.0,
            }
            for i in range(60_000)
        },
    }
    world.mirror.mkdir(parents=True, exist_ok=True)
    (world.mirror / ".mirrord-manifest.json").write_text(json.dumps(doc))
    config = write_config(tmp_path / "c.toml", world, watch={"rescan_interval_seconds": 3600})
    for n in range(8):
        log = tmp_path / f"run-{n}.log"
        pid = zygote.spawn(["run", "--config", config], log)
        # The random instant at which the fault strikes, from 50 ms after the fork: before mirrord's
        # main() runs (the fork server's own set-up, or an interpreter's start-up) no Python code can
        # catch a signal; systemd sends ExecReload only after READY=1 anyway.
        time.sleep(rng.uniform(0.05, 0.4))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
        tally.fault("SIGHUP during start-up")
        tally.rounds += 1
        try:
            wait_for(
                lambda log=log, pid=pid: read_events(log, "daemon.ready") or zygote.wait(pid, 0) is not None,
                60,
                "the daemon ready (or dead)",
                interval=0.02,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            status = zygote.wait_or_kill(pid, 60)
        if status != 0:
            tally.check([f"round {n}: the daemon exited {status} (-1 = killed by SIGHUP)"])
    tally.assert_clean()


# ------------------------------------------------- 13 + 15. a checkpoint that can never be mirrored
def test_lag_and_copy_failed_tell_the_truth_about_a_permanent_failure(
    tmp_path: Path, checkpoints: Checkpoints, report: Report
) -> None:
    """Issues 15.13 and 15.15: a checkpoint whose copy fails permanently (its run folder on the mirror
    is a file) was dropped from the queue, so the lag gauge read 0 and `copy.failed` said
    will_retry=false while it was retried at every rescan. The lag must grow, and every copy.failed
    must say what really happens next."""
    tally = report.scenario("hostile env: a checkpoint that can never be mirrored (lag, will_retry)")
    rng = random.Random(1513)
    world = World(tmp_path / "w")
    world.mirror.mkdir(parents=True)
    (world.mirror / "blocked").write_bytes(b"a file where the run folder should be")
    tally.fault("mirror run folder is a file")
    rel = f"blocked/{step_name(1)}"
    world.install(rel, checkpoints.pick(rng), mtime_ns=time.time_ns())
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {"watch": {"rescan_interval_seconds": 0.5}, "copy": {"max_attempts": 2}, "log": {"level": "info"}},
    )
    daemon.start()
    try:
        daemon.wait_event("copy.failed", path=rel)
        samples = []
        for n in range(1, 9):
            wait_for(lambda n=n: len(daemon.events("copy.failed", path=rel)) > n, 30, f"failure {n + 1}", interval=0.02)
            samples.append(daemon.metric("mirrord_mirror_lag_seconds") or 0.0)
            tally.rounds += 1
        tally.notes.append("lag samples (s): " + ", ".join(f"{s:.1f}" for s in samples))
        zeros = sum(1 for s in samples if s <= 0)
        if zeros:
            tally.check([f"{zeros} of {len(samples)} lag samples were 0 while {rel} cannot be mirrored"])
        if samples[-1] <= samples[0]:
            tally.check([f"the lag did not grow: {samples[0]:.1f} s -> {samples[-1]:.1f} s"])
        failed = daemon.events("copy.failed", path=rel)
        started = daemon.events("copy.started", path=rel)
        for i, event in enumerate(failed[:-1]):
            later = [e for e in started if e["timestamp"] > event["timestamp"]]
            if not event.get("will_retry") and later:
                tally.check([f"copy.failed #{i + 1} said will_retry=false, yet the copy was started again"])
        tally.notes.append("copy.failed says: " + ", ".join(sorted({str(e.get("retry")) for e in failed})))
    finally:
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.assert_clean()


# --------------------------------------------------------- 14. no false verify failures under load
def test_no_false_verify_failures_under_a_commit_burst(
    tmp_path: Path, checkpoints: Checkpoints, zygote: Zygote, report: Report
) -> None:
    """Issue 15.14: at ~70 checkpoints/s a copy published between the mirror listing and the manifest
    read was counted as a verify failure (86 in 60 s; `mirrord verify` found none). Both must say 0."""
    tally = report.scenario("hostile env: commit burst (~70 checkpoints/s) and verify_failures_total")
    rng = random.Random(1514)
    world = World(tmp_path / "w")
    small = sorted(checkpoints.blobs, key=len)[:3]
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {
            "watch": {"rescan_interval_seconds": 0.1},
            "copy": {"workers": 4, "settle_seconds": 0},
            "log": {"level": "info"},
        },
    )
    daemon.start()
    try:
        deadline = time.monotonic() + 15
        n = 0
        while time.monotonic() < deadline:
            n += 1
            world.install(f"run-{n % 4}/{step_name(n)}", rng.choice(small))
            time.sleep(1 / 70)  # the burst's pace: the fault itself
        tally.fault("checkpoints committed in 15 s", n)
        tally.rounds += 1
        wanted = set(world.primary_files())
        wait_for(lambda: _mirrored(world, wanted), 120, "the whole burst mirrored", interval=0.02)
        failures = daemon.metric("mirrord_verify_failures_total")
        tally.notes.append(
            f"{n} checkpoints, verify_failures_total = {failures}, "
            f"reconciles = {len(daemon.events('reconcile.finished'))}"
        )
        if failures:
            tally.check([f"verify_failures_total = {failures} with nothing damaged"])
    finally:
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    config = write_config(tmp_path / "c.toml", world)
    if zygote.run(["verify", "--config", config], tmp_path / "verify.log") != 0:
        tally.check(["mirrord verify found problems"])
    tally.check(converged_violations(world, world.primary_files()))
    tally.assert_clean()


# ---------------------------------------------------------------- 15. one prune.skipped per veto
def test_a_guard_veto_is_logged_once(tmp_path: Path, checkpoints: Checkpoints, report: Report) -> None:
    """Issue 15.15: a young file vetoed on every prune pass was logged on every pass (37,112 of 51,664
    lines in a burst). One prune.skipped line per file and reason; the metric still counts passes."""
    tally = report.scenario("hostile env: prune.skipped logged once per file and reason")
    rng = random.Random(1515)
    world = World(tmp_path / "w")
    now = time.time_ns()
    for step in range(1, 9):
        world.install(f"run/{step_name(step)}", checkpoints.pick(rng, 200_000), mtime_ns=now)
    # Every step mirrored first: a daemon started on an existing run copies only what the window keeps.
    synced = run_mirrord(
        "sync",
        "--primary",
        world.primary,
        "--mirror",
        world.mirror,
        env={
            "MIRRORD_PRUNE__ENABLED": "false",
            "MIRRORD_COPY__SETTLE_SECONDS": "0",
            "MIRRORD_METRICS__ENABLED": "false",
        },
    )
    assert synced.returncode == 0, synced.stderr
    daemon = DaemonProcess(
        tmp_path / "w",
        world.primary,
        world.mirror,
        {
            "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 3600},
            "watch": {"rescan_interval_seconds": 0.2},
            "log": {"level": "info"},
        },
    )
    daemon.start()
    try:
        wait_for(lambda: _mirror_count(world) == 8, 60, "8 steps mirrored", interval=0.02)
        start = len(daemon.events("prune.finished"))
        wait_for(lambda: len(daemon.events("prune.finished")) >= start + 10, 60, "ten more prune passes", interval=0.02)
        tally.rounds += 10
        tally.fault("young files vetoed on every pass", 6)
        per_file = Counter((e["volume"], e["path"], e["reason"]) for e in daemon.events("prune.skipped"))
        tally.notes.append(f"prune.skipped lines: {sum(per_file.values())} for {len(per_file)} (file, reason)")
        tally.check([f"{key} logged {n} times" for key, n in per_file.items() if n > 1])
        if not per_file:
            tally.check(["no veto was logged at all"])
        counted = daemon.metric("mirrord_prune_skipped_total", 'reason="recent_mtime"') or 0
        if counted < 6 * 10:
            tally.check([f"the metric counted {counted} vetoes over 10+ passes of 6 files"])
    finally:
        code = daemon.stop()
    tally.check([] if code == 0 else [f"daemon exited {code}"])
    tally.assert_clean()
