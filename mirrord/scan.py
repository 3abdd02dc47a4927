"""Snapshot a volume: every committed candidate below a root, by lstat, never through a symlink."""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from mirrord.atomic import TEMP_SUFFIX
from mirrord.model import FileState, Snapshot

IGNORED_SUFFIXES = (TEMP_SUFFIX, ".tmp")


def is_candidate_name(name: str, patterns: Iterable[str]) -> bool:
    """A name that may be a committed checkpoint: matches a pattern, not hidden, not a temp name."""
    if name.startswith(".") or name.endswith(IGNORED_SUFFIXES):
        return False
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def is_temp_name(name: str) -> bool:
    return name.endswith(TEMP_SUFFIX) and not name.startswith(".")


def state_from_stat(rel: str, st: os.stat_result) -> FileState:
    return FileState(rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_mode, st.st_ctime_ns)


def snapshot_tree(
    root: Path,
    patterns: Iterable[str],
    collect_partials: bool = False,
    exclude: frozenset[tuple[int, int]] = frozenset(),
) -> Snapshot:
    """List `root` recursively.

    Symlinks (to files or directories) are never followed or listed as files; devices, FIFOs and
    sockets are skipped; both are reported in `skipped`. Hidden directories are not entered, nor a
    directory whose (device, inode) is in `exclude` (the other root, reached through a bind mount):
    that is an error. Listing errors are collected, not raised: a caller must treat a snapshot with
    errors as partial.
    """
    patterns = tuple(patterns)
    files: dict[str, FileState] = {}
    partials: dict[str, FileState] = {}
    errors: list[str] = []
    skipped: list[tuple[str, str]] = []
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        path = root / rel_dir if rel_dir else root
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError as exc:
            errors.append(f"{path}: cannot list: {exc.strerror or exc}")
            continue
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # vanished between listing and stat: not an error, the next scan sees it
            except OSError as exc:
                errors.append(f"{root / rel}: cannot stat: {exc.strerror or exc}")
                continue
            mode = st.st_mode
            if stat.S_ISLNK(mode):
                skipped.append((rel, "symlink"))
            elif stat.S_ISDIR(mode):
                if (st.st_dev, st.st_ino) in exclude:
                    errors.append(f"{root / rel}: is the other root (a bind mount?); not entered")
                elif not entry.name.startswith("."):
                    stack.append(rel)
            elif collect_partials and is_temp_name(entry.name):
                if stat.S_ISREG(mode):
                    partials[rel] = state_from_stat(rel, st)
            elif is_candidate_name(entry.name, patterns):
                if stat.S_ISREG(mode):
                    files[rel] = state_from_stat(rel, st)
                else:
                    skipped.append((rel, "not a regular file"))
    return Snapshot(files, partials, tuple(errors), tuple(skipped))
