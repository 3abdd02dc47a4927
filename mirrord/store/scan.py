"""Snapshot a volume: every committed candidate below a root, by lstat, never through a symlink."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from stat import S_ISDIR, S_ISLNK, S_ISREG

from mirrord.core.model import FileState, Snapshot
from mirrord.layouts import (
    Layout,
    lookalike_folder,
    lookalike_name,
    name_matcher,
)
from mirrord.paths import DIR_FLAGS, open_dir_beneath, open_root, split_rel
from mirrord.store.atomic import TEMP_SUFFIX

IGNORED_SUFFIXES = (TEMP_SUFFIX, ".tmp")
# A folder whose path is this long cannot be named by a path (ENAMETOOLONG): nor could a trainer or cp reach
# its files, so the walk (by descriptor, which could) reports it as unlistable, as a listing by path did.
_PATH_MAX = 4096
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # opening a folder that is gone, or a symlink


def is_candidate_name(name: str, patterns: Iterable[str]) -> bool:
    """A name that may be a committed checkpoint: matches a pattern, not hidden, not a temp name."""
    hidden_or_temp = name.startswith(".") or name.endswith(IGNORED_SUFFIXES)
    return not hidden_or_temp and bool(name_matcher(tuple(patterns))(name))


def state_from_stat(rel: str, st: os.stat_result) -> FileState:
    """The FileState of `rel` from its lstat."""
    return FileState(rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_mode, st.st_ctime_ns)


def snapshot_tree(
    root: Path,
    patterns: Iterable[str],
    collect_partials: bool = False,
    exclude: frozenset[tuple[int, int]] = frozenset(),
    layout: Layout | None = None,
    unit: str = "",
) -> Snapshot:
    """List `root` recursively (with `unit`, only the folder root/unit, as a unit: see snapshot_unit).

    Without `layout` (or with a file layout) a candidate is a file named by `patterns` (or the
    layout's). With a folder layout, every file below a unit folder is listed (dot names too: DCP's
    `.metadata`), beside it only the layout's alias and tag files; a staging folder (`NAME.part/`)
    is not entered but listed in `staging`.

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
    staging: dict[str, FileState] = {}
    lookalikes: dict[str, str] = {}
    folders = layout is not None and layout.folders
    inside = {unit} if unit else set()  # directories at or below a unit folder
    for fd, rel_dir, entries, subdirs in _walk(root, errors, unit):
        in_unit = rel_dir in inside
        prefix = f"{rel_dir}/" if rel_dir else ""
        folder_lookalike = lookalike_folder(rel_dir) if layout is not None else None
        for entry in entries:
            name = entry.name
            # A NAME.part of ours; a dotted one is a trainer's own temp file.
            partial = collect_partials and name.endswith(TEMP_SUFFIX) and name[0] != "."
            selected = not partial and is_selected_name(name, patterns, layout, in_unit)
            if not (partial or selected):
                # Beyond the selected names only folders (to enter) and symlinks (to report) matter, and the
                # directory entry's type says which without an lstat.
                try:
                    if not (entry.is_dir(follow_symlinks=False) or entry.is_symlink()):
                        # A file the layout does not select that looks like a checkpoint: the first per
                        # pattern is remembered for a warning (by name and the entry's type: no lstat).
                        if (
                            layout is not None
                            and (look := lookalike_name(name, folder_lookalike)) is not None
                            and look not in lookalikes
                            and entry.is_file(follow_symlinks=False)
                        ):
                            lookalikes[look] = prefix + name
                        elif folders and not in_unit and layout is not None and layout.is_unit_name(name):
                            lookalikes.setdefault(layout.pattern_of(name), prefix + name)  # a file, not a unit folder
                        continue
                except OSError:
                    pass  # the lstat below reports it
            rel = prefix + name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # vanished between listing and stat: not an error, the next scan sees it
            except OSError as exc:
                errors.append(f"{root / rel}: cannot stat: {exc.strerror or exc}")
                continue
            if S_ISREG(st.st_mode):
                if not (partial or selected):
                    continue  # (the entry's type said folder or link, lstat says it was replaced meanwhile)
                (partials if partial else files)[rel] = state_from_stat(rel, st)
            elif S_ISLNK(st.st_mode):
                skipped.append((rel, "symlink"))
            elif S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in exclude:
                    errors.append(f"{root / rel}: is the other root (a bind mount?); not entered")
                elif folders and not in_unit and layout is not None and layout.is_staging_name(name):
                    staging[rel] = state_from_stat(rel, st)
                elif not name.startswith("."):
                    if in_unit or (folders and layout is not None and layout.is_unit_name(name)):
                        inside.add(rel)
                    subdirs.append(name)
            elif selected:
                skipped.append((rel, "not a regular file"))
    return Snapshot(files, partials, tuple(errors), tuple(skipped), staging, lookalikes)


def _walk(root: Path, errors: list[str], top: str = "") -> Iterator[tuple[int, str, list[os.DirEntry[str]], list[str]]]:
    """Depth first below `root` (or its folder `top`): for each directory its open descriptor, rel path,
    entries and a list the caller fills with the names of the subdirectories to enter (entered after
    the caller is done with it).

    Every directory is opened beneath its parent's descriptor with O_NOFOLLOW, so a folder swapped for
    a symlink during the walk is an error, never followed; files are lstat'ed relative to the descriptor
    (cheaper than a path from the root, and the same file the listing named). At most one descriptor
    per level is open. A directory that cannot be opened or listed, or whose path is longer than a path
    may be, is an error in `errors`; a `top` that is gone or a symlink lists nothing, silently.
    """
    parts = split_rel(top) if top else None
    try:
        top_fd = open_root(root) if parts is None else open_dir_beneath(root, parts)
    except OSError as exc:
        if parts is None or exc.errno not in _GONE:
            errors.append(f"{root / top}: cannot list: {exc.strerror or exc}")
        return
    frames: list[tuple[int, str, list[str]]] = []  # (descriptor, rel path, subdirectories left to enter)
    # The length of root / rel_dir as bytes is this plus rel_dir's (no path object made per folder).
    top_bytes = os.fsencode(root)
    base = len(top_bytes) + (not top_bytes.endswith(b"/"))
    fd, rel_dir = top_fd, top
    try:
        while True:
            subdirs: list[str] = []
            frames.append((fd, rel_dir, subdirs))  # owns the descriptor from here
            try:
                with os.scandir(fd) as it:
                    entries = list(it)
            except OSError as exc:
                errors.append(f"{root / rel_dir}: cannot list: {exc.strerror or exc}")
            else:
                yield fd, rel_dir, entries, subdirs
            fd = -1
            while frames:  # the next directory: the last one named on the deepest level that has any left
                parent, parent_rel, left = frames[-1]
                if not left:
                    frames.pop()
                    os.close(parent)
                    continue
                name = left.pop()
                rel_dir = f"{parent_rel}/{name}" if parent_rel else name
                if base + len(os.fsencode(rel_dir)) >= _PATH_MAX:
                    errors.append(f"{root / rel_dir}: cannot list: {os.strerror(errno.ENAMETOOLONG)}")
                    continue
                try:
                    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
                    break
                except OSError as exc:
                    errors.append(f"{root / rel_dir}: cannot list: {exc.strerror or exc}")
            if fd < 0:
                return
    finally:
        for f, _, _ in frames:
            os.close(f)


def is_selected_name(name: str, patterns: tuple[str, ...], layout: Layout | None, in_unit: bool) -> bool:
    """Whether a file named `name` (inside a unit folder or not) is listed: the one rule, shared with the S3 store."""
    if layout is None:
        return is_candidate_name(name, patterns)
    if in_unit:
        return layout.is_member_name(name)
    return layout.is_extra_name(name) or (not layout.folders and layout.is_unit_name(name))


def snapshot_unit(root: Path, key: str, layout: Layout) -> Snapshot:
    """List one unit folder, root/key, as snapshot_tree lists it inside a unit (every member, dot names
    too; hidden folders not entered), reached beneath the root without following a symlink. What a watch
    event re-evaluates instead of the whole tree; a folder that is gone (or is not a folder) lists empty."""
    listed = snapshot_tree(root, (), layout=layout, unit=key)
    return Snapshot(listed.files, errors=listed.errors)


def unit_folders(root: Path, key: str, layout: Layout) -> list[str]:
    """The unit folders directly in root/key (a run folder), as rel paths, symlinks left out; [] when
    it is gone."""
    try:
        fd = open_dir_beneath(root, split_rel(key) if key else ())
    except OSError as exc:
        if exc.errno in _GONE:
            return []
        raise
    try:
        with os.scandir(fd) as entries:  # (a symlink is never a unit; an entry gone meanwhile is no folder)
            names = [e.name for e in entries if layout.is_unit_name(e.name) and e.is_dir(follow_symlinks=False)]
    finally:
        os.close(fd)
    return [f"{key}/{name}" if key else name for name in names]
