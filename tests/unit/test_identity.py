"""mirrord.store.identity: a pinned mirror notices it is no longer the same volume; roots compared by identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from mirrord.store.identity import MARKER_NAME, MirrorGoneError, VolumeIdentity, overlap, read_marker


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
