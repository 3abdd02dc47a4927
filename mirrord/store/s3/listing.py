"""What an object-store mirror holds: objects as FileStates, chosen as the local scanner chooses files."""

from __future__ import annotations

import hashlib
import stat
from datetime import datetime
from typing import Any

from mirrord.core.model import VERSIONS, FileState, Snapshot
from mirrord.layouts import Layout
from mirrord.paths import S3Location
from mirrord.store.s3.client import S3_ERRORS, ns, wrap
from mirrord.store.scan import is_selected_name


def etag_identity(key: str, etag: str) -> int:
    """An object's stand-in for an inode: its key and ETag, as a positive 63-bit number. A rewrite of the
    key gives another ETag, so an entry that recorded it is trusted without reading the object again
    (as a local entry is by inode and ctime); a copy under another key never shares it."""
    digest = hashlib.blake2b(f"{key}\0{etag}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1


def object_state(rel: str, key: str, size: int, last_modified: datetime, etag: str) -> FileState:
    """An object as a FileState: mtime (and ctime) is LastModified, what the retention guards judge;
    the identity is the ETag's (etag_identity)."""
    when = ns(last_modified)
    return FileState(rel, int(size), when, ino=etag_identity(key, etag), mode=stat.S_IFREG | 0o644, ctime_ns=when)


def placed(rel: str, patterns: tuple[str, ...], layout: Layout | None) -> str | None:
    """`rel` itself when the local scanner would list this key as a file (see mirrord.store.scan.snapshot_tree);
    KEY.part when rel lies in a unit's staging area (listed in Snapshot.staging: swept once dead); else None."""
    parts = rel.split("/")
    if not rel or rel.endswith("/") or "" in parts or "." in parts or ".." in parts:
        return None
    in_unit = False
    for i, folder in enumerate(parts[:-1]):
        if folder.startswith("."):
            return None  # hidden folders (ours: leases, the manifest) are never entered
        if layout is not None and layout.folders and not in_unit:
            if layout.is_staging_name(folder):
                return "/".join(parts[: i + 1])
            in_unit = layout.is_unit_name(folder)
    return rel if is_selected_name(parts[-1], patterns, layout, in_unit) else None


def list_objects(client: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every object under `prefix` (raises botocore's errors)."""
    found: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.extend(page.get("Contents", ()))
    return found


def snapshot(client: Any, location: S3Location, patterns: tuple[str, ...], layout: Layout | None) -> Snapshot:
    """Every committed candidate object under the prefix (see S3Mirror.snapshot); a listing error makes
    the view partial (errors), never raises."""
    files: dict[str, FileState] = {}
    versions: dict[str, FileState] = {}
    staging: dict[str, FileState] = {}
    errors: tuple[str, ...] = ()
    try:
        for obj in list_objects(client, location.bucket, location.prefix):
            rel = obj["Key"][len(location.prefix) :]
            place = placed(rel, patterns, layout)
            if place == rel or rel.startswith(VERSIONS + "/"):  # (the versions kept beside: listed apart)
                state = object_state(rel, obj["Key"], obj["Size"], obj["LastModified"], obj.get("ETag", ""))
                (files if place == rel else versions)[rel] = state
            elif place is not None:
                newest = max(ns(obj["LastModified"]), staging[place].mtime_ns if place in staging else 0)
                staging[place] = FileState(place, 0, newest, mode=stat.S_IFDIR | 0o755)
    except S3_ERRORS as exc:
        errors = (str(wrap(location.url(), exc, "list")),)
    return Snapshot(files, {}, errors, (), staging, versions=versions)
