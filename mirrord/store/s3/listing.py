"""What an object-store mirror holds: objects as FileStates, chosen as the local scanner chooses files."""

from __future__ import annotations

import hashlib
import stat
from datetime import datetime
from typing import Any

from mirrord.core.layouts import Layout
from mirrord.core.model import FileState, Snapshot
from mirrord.store.s3.client import S3_ERRORS, S3Location, ns, wrap
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


def staging_area(rel: str, layout: Layout | None) -> str | None:
    """KEY.part when rel lies in a unit's staging area (listed in Snapshot.staging: swept once dead)."""
    if layout is None or not layout.folders:
        return None
    parts = rel.split("/")
    for i, folder in enumerate(parts[:-1]):
        if folder.startswith("."):
            return None
        if layout.is_staging_name(folder):
            return "/".join(parts[: i + 1])
        if layout.is_unit_name(folder):
            return None
    return None


def listed(rel: str, patterns: tuple[str, ...], layout: Layout | None) -> bool:
    """Whether the local scanner would list this key as a file (see mirrord.store.scan.snapshot_tree)."""
    parts = rel.split("/")
    if not rel or rel.endswith("/") or "" in parts or "." in parts or ".." in parts:
        return False
    folders, name = parts[:-1], parts[-1]
    in_unit = False
    for folder in folders:
        if folder.startswith("."):
            return False  # hidden folders (ours: leases, the manifest) are never entered
        if layout is not None and layout.folders and not in_unit:
            if layout.is_staging_name(folder):
                return False
            in_unit = layout.is_unit_name(folder)
    return is_selected_name(name, patterns, layout, in_unit)


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
    staging: dict[str, FileState] = {}
    errors: list[str] = []
    prefix = location.prefix
    try:
        for obj in list_objects(client, location.bucket, prefix):
            rel = obj["Key"][len(prefix):]
            if listed(rel, patterns, layout):
                files[rel] = object_state(rel, obj["Key"], obj["Size"], obj["LastModified"], obj.get("ETag", ""))
            elif (area := staging_area(rel, layout)) is not None:
                newest = max(ns(obj["LastModified"]), staging[area].mtime_ns if area in staging else 0)
                staging[area] = FileState(area, 0, newest, mode=stat.S_IFDIR | 0o755)
    except S3_ERRORS as exc:
        errors.append(str(wrap(location.url(), exc, "list")))
    return Snapshot(files, {}, tuple(errors), (), staging)
