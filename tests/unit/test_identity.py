"""mirrord.store.identity: a pinned mirror notices it is no longer the same volume; roots compared by identity."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest

from mirrord.paths import overlap
from mirrord.store.identity import MARKER_NAME, MirrorGoneError, VolumeIdentity, read_marker
from tests.support.privileges import run_as_nobody


def test_first_use_writes_a_marker_and_later_uses_keep_it(tmp_path: Path) -> None:
    """The volume id is written once, atomically, and read back by every later start."""
    first = VolumeIdentity.establish(tmp_path)
    assert read_marker(tmp_path) == first.volume_id and len(first.volume_id) == 32
    again = VolumeIdentity.establish(tmp_path)
    assert again == first
    assert first.problem() is None


def test_a_replaced_root_or_marker_is_refused(tmp_path: Path) -> None:
    """Another directory at the path (what an unmount leaves), or a missing or foreign marker, is refused."""
    root = tmp_path / "mirror"
    root.mkdir()
    pinned = VolumeIdentity.establish(root)
    (root / MARKER_NAME).unlink()
    assert "is missing" in (pinned.problem() or "")
    (root / MARKER_NAME).write_text("mirrord-volume someone-else\n")
    assert "someone-else" in (pinned.problem() or "")
    root.rename(tmp_path / "elsewhere")
    root.mkdir()
    with pytest.raises(MirrorGoneError) as info:
        pinned.check()
    assert info.value.reason == "mirror_unmounted" and "unmounted" in info.value.cause


def test_overlap_by_identity_through_a_symlinked_parent(tmp_path: Path) -> None:
    """A mirror whose path reaches the primary another way is refused, even before it exists."""
    primary = tmp_path / "primary"
    primary.mkdir()
    (tmp_path / "alias").symlink_to(primary)
    assert overlap(primary, tmp_path / "alias" / "mirror") is not None
    assert overlap(primary, tmp_path / "alias") is not None
    other = tmp_path / "mirror"
    other.mkdir()
    assert overlap(primary, other) is None


def _swap_marker(root: str, kind: str, target: str) -> str:
    """As another user (nobody) in a mirror folder anyone can write: replace the marker."""
    marker = Path(root) / MARKER_NAME
    marker.unlink()
    if kind == "fifo":
        os.mkfifo(marker, 0o666)
    elif kind == "symlink":
        marker.symlink_to(target)
    else:  # a copy of the right marker, but nobody's file
        marker.write_text(Path(target).read_text())
    return kind


@pytest.mark.skipif(os.geteuid() != 0, reason="another user needs root to act as")
@pytest.mark.parametrize("kind", ["fifo", "symlink", "nobody's copy"])
def test_a_marker_replaced_by_another_user_is_refused_at_once(world_tmp: Path, kind: str) -> None:
    """Another user who can write the mirror folder swaps the volume marker: a FIFO must not block the
    heartbeat's check (and a start), and a symlink or a file of theirs is not trusted even when it holds
    the right id (a symlink to /dev/zero would otherwise be read without bound)."""
    root = world_tmp / "mirror"
    root.mkdir()
    root.chmod(0o777)
    pinned = VolumeIdentity.establish(root)
    genuine = world_tmp / "genuine-marker"
    genuine.write_text((root / MARKER_NAME).read_text())
    genuine.chmod(0o644)
    assert run_as_nobody(_swap_marker, str(root), kind, str(genuine)) == {"value": kind}
    answer: list[str | None] = []
    checker = threading.Thread(target=lambda: answer.append(pinned.problem()), daemon=True)
    checker.start()
    checker.join(timeout=60)  # a deadline, not a timing: the check either answers or blocks for good
    assert answer, "the heartbeat's marker check blocked"
    assert answer[0] is not None and "cannot read the volume marker" in answer[0]
    with pytest.raises(MirrorGoneError):
        pinned.check()
    if kind == "fifo":  # unblock a reader that the code before the fix left waiting
        with contextlib.suppress(OSError):
            os.close(os.open(root / MARKER_NAME, os.O_WRONLY | os.O_NONBLOCK))
