"""Daemon hooks: verify failures are counted, and lag keeps growing while the mirror is refused."""

from __future__ import annotations

import shutil

from mirrord.manifest import Manifest
from tests.integration.daemon_harness import save_checkpoint, wait_for


def test_a_damaged_mirror_copy_is_counted_once_and_repaired(tmp_path, daemon_factory):
    """A mirrored file truncated or deleted behind mirrord's back counts one verify failure, then is recopied."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    save_checkpoint(primary / "r" / "step_0001.pt", 1)
    save_checkpoint(primary / "r" / "step_0002.pt", 2)
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
    save_checkpoint(primary / "r" / "step_0001.pt", 1)
    first = daemon_factory().start()
    wait_for(lambda: Manifest.load(mirror).entries, 90, "mirrored")
    assert first.stop() == 0
    shutil.rmtree(mirror / "r")
    again = daemon_factory({"watch": {"rescan_interval_seconds": 0.5}}).start(wait_ready=False)
    wait_for(lambda: again.http("/readyz")[0] == 503, 90, "refused")
    save_checkpoint(primary / "r" / "step_0002.pt", 2)
    wait_for(lambda: (again.metric("mirrord_mirror_lag_seconds") or 0) > 0, 90, "lag > 0 while refused")
    assert again.stop() == 0
