"""Daemon hooks: verify failures are counted, and lag keeps growing while the mirror is refused."""

from __future__ import annotations

import hashlib
import shutil

from mirrord.store.manifest import Manifest
from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for


def test_a_damaged_mirror_copy_is_counted_once_and_repaired(tmp_path, daemon_factory):
    """A mirrored file truncated or deleted behind mirrord's back counts one verify failure, then is recopied."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    publish_checkpoint(primary / "r" / "step_0002.pt", 2)
    d = daemon_factory({"watch": {"rescan_interval_seconds": 0.5}}).start()
    wait_for(lambda: len(Manifest.load(mirror).entries) == 2, 90, "both mirrored")
    assert d.metric("mirrord_verify_failures_total") == 0
    with (mirror / "r" / "step_0001.pt").open("r+b") as f:
        f.truncate(10)
    d.wait_event("mirror.verify_failed", path="r/step_0001.pt", why="mirror_mismatch")
    (mirror / "r" / "step_0002.pt").unlink()
    d.wait_event("mirror.verify_failed", path="r/step_0002.pt", why="mirror_missing")
    wait_for(lambda: d.metric("mirrord_copies_total", 'result="ok"') == 4, 90, "both repaired")
    assert (mirror / "r" / "step_0001.pt").stat().st_size == (primary / "r" / "step_0001.pt").stat().st_size
    assert d.metric("mirrord_verify_failures_total") == 2
    assert len(d.events("mirror.verify_failed")) == 2
    assert d.stop() == 0


def test_lag_grows_while_the_mirror_is_refused(tmp_path, daemon_factory):
    """An emptied (unmounted-looking) mirror stops copies; lag must show it so MirrordMirrorLagging can fire."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    first = daemon_factory().start()
    wait_for(lambda: Manifest.load(mirror).entries, 90, "mirrored")
    assert first.stop() == 0
    shutil.rmtree(mirror / "r")
    again = daemon_factory({"watch": {"rescan_interval_seconds": 0.5}}).start(wait_ready=False)
    wait_for(lambda: again.http("/readyz")[0] == 503, 90, "refused")
    publish_checkpoint(primary / "r" / "step_0002.pt", 2)
    wait_for(lambda: (again.metric("mirrord_mirror_lag_seconds") or 0) > 0, 90, "lag > 0 while refused")
    assert again.stop() == 0


def test_queue_depth_is_read_when_scraped_not_when_the_heartbeat_pushes(tmp_path, gated_primary, daemon_factory):
    """Three copies held at a gate, one worker, a heartbeat of 60 s: /metrics shows the queue draining copy
    by copy as the gate lets one through, and reads 0 as soon as the last copy is recorded (a gauge pushed
    on the heartbeat still said 2)."""
    mirror = tmp_path / "mirror"
    names = [f"step_{step:04d}.pt" for step in (1, 2, 3)]
    for step, name in enumerate(names, start=1):
        publish_checkpoint(gated_primary.backing / "r" / name, step, megabytes=0.25)
    gated_primary.stall(*names)
    d = daemon_factory({"copy": {"workers": 1}, "daemon": {"heartbeat_seconds": 60}}).start()
    wait_for(lambda: d.metric("mirrord_queue_depth") == 2, 90, "one copy held at the gate, two waiting")
    gated_primary.stall(*names[:2])  # the newest step (copied first) goes through
    wait_for(lambda: d.metric("mirrord_queue_depth") == 1, 90, "one copy done, one held, one waiting")
    gated_primary.unstall()
    wait_for(lambda: len(Manifest.load(mirror).entries) == 3, 90, "all three mirrored")
    assert d.metric("mirrord_queue_depth") == 0
    wait_for(lambda: d.metric("mirrord_mirror_lag_seconds") == 0, 90, "caught up")
    assert d.stop() == 0


def test_run_names_can_be_kept_out_of_the_metrics(tmp_path, daemon_factory):
    """metrics.run_names = false: /metrics labels a private run by the digest docs/security.md says how to
    compute, never by its folder name (issue 45.9)."""
    primary = tmp_path / "primary"
    publish_checkpoint(primary / "secret-run" / "step_0007.pt", 7)
    (primary / "secret-run").chmod(0o700)
    d = daemon_factory({"metrics": {"run_names": False}}).start()
    digest = hashlib.sha256(b"secret-run").hexdigest()[:12]
    wait_for(lambda: d.metric("mirrord_last_mirrored_step", f'run="{digest}"') == 7, 90, "the step, by digest")
    assert "secret-run" not in d.http("/metrics")[1]
    assert d.stop() == 0
