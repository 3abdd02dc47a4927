"""Names every layer agrees on: the temp suffix of an unpublished copy, and what a safe relative path is.

On the ground floor so that the pure core, the store and the formats can all use them.
"""

from __future__ import annotations

from mirrord.errors import UnsafePathError

TEMP_SUFFIX = ".part"  # NAME.part: a copy (or a folder unit) not yet whole; discovery ignores it


def split_rel(rel: str) -> tuple[str, ...]:
    """Components of a root-relative POSIX path; UnsafePathError for absolute paths, '..', '.', empty
    parts and NUL bytes.

    Only the canonical form a listing produces is accepted ('a//b', './a', 'a/' are refused, not
    normalised): on an object store those are other keys than 'a/b' and 'a'.
    """
    parts = tuple(rel.split("/"))
    if "" in parts or "." in parts or ".." in parts:  # also '' itself and '/...' (an empty first part)
        raise UnsafePathError(repr(rel), "not a safe relative path")
    if "\0" in rel:
        raise UnsafePathError(repr(rel), "path contains NUL")
    return parts
