"""What must hold on a mirror: no temp file left, every file equal to its source, the manifest true."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mirrord.store.atomic import TEMP_SUFFIX
from mirrord.store.hashing import hash_stream
from mirrord.store.manifest import MANIFEST_NAME, Manifest


def hash_file(path: str | os.PathLike[str], algo: str) -> str:
    """Hex digest of a whole file with `algo` (never follows a final symlink)."""
    with open(path, "rb", buffering=0, opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as f:
        return hash_stream(f, algo)[1]


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def names(directory: Path) -> list[str]:
    """The entries of one directory, sorted."""
    return sorted(p.name for p in directory.iterdir())


def mirror_files(mirror: Path) -> dict[str, Path]:
    """Every non-hidden regular file below mirror, by POSIX relative path (symlinks are not followed)."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(mirror):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath) / name
                found[path.relative_to(mirror).as_posix()] = path
    return found


def temp_files(mirror: Path) -> list[str]:
    """Every NAME.part anywhere below mirror, hidden directories included."""
    return sorted(
        (Path(d) / n).relative_to(mirror).as_posix()
        for d, _dirs, names in os.walk(mirror)
        for n in names
        if n.endswith(TEMP_SUFFIX)
    )


def assert_mirror_consistent(primary: Path, mirror: Path, ignore: frozenset[str] = frozenset()) -> None:
    """The invariants that must hold after any fault.

    No NAME.part is left; every final-named file (except those in `ignore`, planted by the test) is
    byte-identical to its source; every manifest entry names a file whose size and digest it records.
    """
    assert temp_files(mirror) == [], f"temp files left on the mirror: {temp_files(mirror)}"
    for rel, path in mirror_files(mirror).items():
        if rel in ignore:
            continue
        source = primary / rel
        assert source.is_file(), f"{rel} is on the mirror but has no source"
        assert path.stat().st_size == source.stat().st_size, f"{rel}: size differs from its source"
        assert sha256(path) == sha256(source), f"{rel}: content differs from its source"
    if (mirror / MANIFEST_NAME).exists():
        for entry in Manifest.load(mirror).entries.values():
            path = mirror / entry.path
            assert path.is_file(), f"manifest records {entry.path} but it is not on the mirror"
            assert path.stat().st_size == entry.size, f"{entry.path}: size differs from the manifest"
            assert hash_file(path, entry.algo) == entry.digest, f"{entry.path}: digest differs"
