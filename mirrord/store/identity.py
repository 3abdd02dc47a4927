"""Which filesystem objects the roots really are, whatever their paths say.

Two questions that a resolved path cannot answer:

* Is the mirror still the volume mirrord started on? An unmounted (even lazily, `umount -l`) mirror
  leaves a bare mount-point directory on the root filesystem that accepts copies, a manifest and
  deletions just as well. `VolumeIdentity` pins the mirror root's (device, inode) and a marker file
  holding a volume id written at first use; every upload, manifest write and deletion checks both.
* Are primary and mirror distinct, and is neither inside the other? A bind mount (`mount --bind p m`)
  gives one directory two unrelated paths. `overlap` compares (device, inode) pairs up the parents
  and across the mount points below each root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mirrord.errors import PermanentError
from mirrord.store import atomic
from mirrord.store.trusted import read_trusted

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


# ------------------------------------------------------------------------------- roots by identity
def _key(path: Path) -> tuple[int, int] | None:
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    try:
        with open(mountinfo, encoding="utf-8") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [Path(fields[4].encode().decode("unicode_escape")) for fields in rows if len(fields) > 4]


def overlap(primary: Path, mirror: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Why PRIMARY and MIRROR are not two separate trees when compared by (device, inode), or None.

    Catches what resolving paths cannot: the same directory under two names through a bind mount, a
    mirror whose path runs through a bind mount of the primary (or the reverse), and a bind mount of
    one root placed somewhere below the other.
    """
    pkey, mkey = _key(primary), _key(mirror)
    if pkey is None:
        return None  # a missing primary is reported by the path checks
    if pkey == mkey:
        return f"{mirror} is the same directory as primary {primary} (same device and inode: a bind mount?)"
    name = {pkey: f"primary {primary}", mkey: str(mirror)}
    # The mirror's parents are compared even for a mirror not created yet (mkey None).
    pairs = ((mirror, mkey, pkey), (primary, pkey, mkey))
    for path, key, other in pairs:
        for parent in Path(path).resolve().parents:
            if other is not None and _key(parent) == other:
                return f"{name[key]} is inside {name[other]} (reached through {parent}: a bind mount?)"
    if mkey is None:
        return None
    points = _mount_points(mountinfo)
    for path, key, other in pairs:  # a mount point strictly below one root whose directory is the other
        below = path.resolve()
        for point in points:
            if point != below and point.is_relative_to(below) and _key(point) == other:
                return f"{name[other]} is mounted inside {name[key]} at {point} (a bind mount)"
    return None
