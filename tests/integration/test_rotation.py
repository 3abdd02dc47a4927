"""A trainer rotates checkpoints away while mirrord copies them: that is rotation, not failure."""

from __future__ import annotations

from pathlib import Path

from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for


def test_a_checkpoint_deleted_before_or_during_its_copy_is_source_gone_not_failed(
    tmp_path, gated_primary, daemon_factory
):
    """One worker: step 10 is deleted while its copy is held half done at the gate, step 20 while it waits
    in the queue behind it. Both are counted source_gone and logged at info; nothing is failed or retried,
    nothing is left on the mirror, and step 30 is mirrored as usual."""
    backing, primary, mirror = gated_primary.backing, tmp_path / "primary", tmp_path / "mirror"
    # No watch event crosses the FUSE gate: the daemon finds files by scanning, every half second.
    d = daemon_factory({"copy": {"workers": 1}, "watch": {"rescan_interval_seconds": 0.5}}).start()
    first = publish_checkpoint(backing / "run" / "step_10.pt", 10, megabytes=4)
    gated_primary.stall("step_10.pt", after=1024 * 1024)
    d.wait_event("copy.started", path="run/step_10.pt")
    second = publish_checkpoint(backing / "run" / "step_20.pt", 20, megabytes=0.2)
    wait_for(lambda: d.metric("mirrord_queue_depth") == 1, 90, "step 20 queued behind step 10")
    assert not d.events("copy.started", path="run/step_20.pt")
    second.unlink()
    first.unlink()
    # Past the kernel's cache of the gate's entries: the daemon's next look at either name finds it gone.
    wait_for(
        lambda: not (primary / "run" / "step_10.pt").exists() and not (primary / "run" / "step_20.pt").exists(),
        90,
        "the deletions seen through the gate",
    )
    gated_primary.unstall()
    for rel in ("run/step_10.pt", "run/step_20.pt"):
        gone = d.wait_event("copy.source_gone", path=rel)
        assert gone["level"] == "info" and gone["run"] == "run"
    assert "deleted while it was being copied" in d.events("copy.source_gone", path="run/step_10.pt")[0]["cause"]
    assert "deleted before it was copied" in d.events("copy.source_gone", path="run/step_20.pt")[0]["cause"]
    publish_checkpoint(backing / "run" / "step_30.pt", 30, megabytes=0.2)
    wait_for(lambda: d.metric("mirrord_copies_total", 'result="ok"') == 1, 90, "step 30 mirrored")
    assert d.metric("mirrord_copies_total", 'result="source_gone"') == 2
    assert d.metric("mirrord_copies_total", 'result="failed"') == 0
    assert d.metric("mirrord_copies_total", 'result="source_changed"') == 0
    assert not d.events("copy.failed") and not d.events("copy.gave_up")
    assert sorted(p.relative_to(mirror).as_posix() for p in (mirror / "run").iterdir()) == ["run/step_30.pt"]
    assert d.stop() == 0
    stopped = d.events("daemon.stopped")[0]
    assert (stopped["copied"], stopped["failed"]) == (1, 0)
    assert not list(Path(mirror).rglob("*.part"))
