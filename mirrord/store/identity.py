"""Which filesystem objects the roots really are, whatever their paths say.

Two questions that a resolved path cannot answer:

* Is the mirror still the volume mirrord started on? An unmounted (even lazily, `umount -l`) mirror
  leaves a bare mount-point directory on the root filesystem that accepts copies, a manifest and
  deletions just as well. `VolumeIdentity` pins the mirror root's (device, inode) and a marker file
  holding a volume id written at first use; every upload, manifest write and deletion checks both.
* Are primary and mirror distinct, and is neither inside the other? A bind mount (`mount --bind p m`)
  gives one directory two unrelated paths. `overlap` (in mirrord.paths: the config asks it) compares
  (device, inode) pairs up the parents and across the mount points below each root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mirrord.errors import PermanentError
from mirrord.store import atomic
from mirrord.trusted import read_trusted

MARKER_NAME = ".mirrord-volume-id"
_MARKER_PREFIX = "mirrord-volume "
MARKER_LIMIT = 4096


class MirrorGoneError(PermanentError):
    """The mirror root is no longer the volume mirrord started on (unmounted, replaced, remounted)."""

    reason = "mirror_unmounted"


def read_marker(root: Path) -> str | None:
    """The volume id in ROOT's marker file, None if there is none; OSError if it cannot be read or is not
    trusted (others may write the mirror folder: a FIFO, a symlink or another user's file is refused)."""
    try:
        text = read_trusted(Path(root) / MARKER_NAME, MARKER_LIMIT)[1].decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    return text.removeprefix(_MARKER_PREFIX) if text.startswith(_MARKER_PREFIX) else ""


@dataclass(frozen=True)
class VolumeIdentity:
    """Which volume a mirror root is: its device and inode, and the id stored on it."""

    root: Path
    dev: int
    ino: int
    volume_id: str

    @classmethod
    def establish(cls, root: Path) -> VolumeIdentity:
        """Pin ROOT as it is now; write the marker (a fresh volume id) if the mirror has none yet."""
        marker = Path(root) / MARKER_NAME
        try:
            st = Path(root).stat()
            volume_id = read_marker(root)
            if not volume_id:
                import uuid  # here: it imports platform, which runs uname; only a new mirror needs an id

                volume_id = uuid.uuid4().hex
                atomic.write_bytes_atomic(marker, f"{_MARKER_PREFIX}{volume_id}\n".encode())
        except OSError as exc:
            raise PermanentError(marker, f"cannot read or write the volume marker: {exc.strerror or exc}") from exc
        return cls(Path(root), st.st_dev, st.st_ino, volume_id)

    def problem(self) -> str | None:
        """None while ROOT is still the pinned volume; else why not (one line naming the path).

        The volume id decides: the same volume mounted again (even on another device number, as a
        loop device or a USB disk may get) is the same mirror; a bare mount point or another volume is not.
        """
        try:
            st = self.root.stat()
        except OSError as exc:
            return f"{self.root}: cannot stat the mirror root: {exc.strerror or exc}"
        try:
            found = read_marker(self.root)
        except OSError as exc:
            return f"{self.root / MARKER_NAME}: cannot read the volume marker: {exc.strerror or exc}"
        if found == self.volume_id:
            return None
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return (
                f"{self.root} is no longer the directory mirrord started on (device {self.dev:#x} inode "
                f"{self.ino} -> device {st.st_dev:#x} inode {st.st_ino}, no volume id {self.volume_id} "
                "there): is the mirror unmounted?"
            )
        what = "is missing" if found is None else f"holds volume id {found or '(garbage)'!r}"
        return f"{self.root / MARKER_NAME} {what}; expected volume id {self.volume_id}"

    def check(self) -> None:
        """Raise MirrorGoneError unless ROOT is still the pinned volume."""
        if (problem := self.problem()) is not None:
            raise MirrorGoneError(self.root, problem)
