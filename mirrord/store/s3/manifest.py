"""The manifest of an object-store mirror: one object per top-level folder, each written with a
conditional PUT (`If-None-Match: *` for the first, `If-Match` on its ETag after).

A change rewrites only the objects of the folders it touches, so recording one copy costs one PUT of
its folder's entries, not of every run's. The shard is the path's first component (the root's files
have one of their own): a store that knows no layout can compute it from the path alone, a unit's
files and the unit's contributions fall into the same shard, and runs are usually top-level folders.
A writer that lost a race re-reads that shard, re-applies its own change and tries again, so two
writers never silently overwrite each other. S3 has no atomic rename of a prefix, so the manifest entry
is the commit point of a unit: readers trust only what it lists. A change that spans shards is
recorded shard by shard (each part is idempotent: a retry re-applies it).

A mirror written by an older mirrord has one object, `.mirrord-manifest.json`: it is read beside the
shards (a shard, once written, is the truth for its folder), and the first write moves it into shards
and deletes it (If-Match: only the version moved). Upgrade every node of a shared prefix together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mirrord.core.contributions import Contribution, Merged, contribute
from mirrord.core.model import ManifestEntry
from mirrord.errors import ManifestError
from mirrord.obs.log import get_logger
from mirrord.store.manifest import MANIFEST_NAME, Change, decode_change, decode_shared_snapshot, encode_snapshot
from mirrord.store.s3.client import CONFLICT_CODES, MISSING_CODES, S3_ERRORS, error_code, get_object, put_if, wrap
from mirrord.store.s3.listing import list_objects

MANIFEST_DIR = ".mirrord-manifest.d"  # hidden: never listed as a checkpoint
MANIFEST_ATTEMPTS = 10
Contributions = dict[str, dict[str, Contribution]]


def shard_of(rel: str) -> str:
    """The shard a path is recorded in: its top-level folder ('' for a file at the root)."""
    top, sep, _rest = rel.partition("/")
    return top if sep else ""


def shard_name(shard: str) -> str:
    """The shard's object name below MANIFEST_DIR."""
    return f"folders/{shard}.json" if shard else "root.json"


@dataclass
class _Shard:
    """One shard as last read or written (etag None: no object yet)."""

    etag: str | None = None
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    contributions: Contributions = field(default_factory=dict)


class S3ManifestStore:
    """The Manifest's store on an object store (see mirrord.store.manifest.ManifestStore)."""

    journal_records = 0  # nothing to compact
    guard: Callable[[], None] | None = None

    def __init__(self, client: Any, bucket: str, root: str) -> None:
        self.client, self.bucket, self.root = client, bucket, root  # root: "" or ending in "/"
        self.where = f"s3://{bucket}/{root}{MANIFEST_DIR}/"
        self.legacy_key = root + MANIFEST_NAME
        self._shards: dict[str, _Shard] = {}
        self._legacy: _Shard | None = None

    def _key(self, shard: str) -> str:
        return f"{self.root}{MANIFEST_DIR}/{shard_name(shard)}"

    # -- reading ---------------------------------------------------------------------------------------
    def _listed(self) -> dict[str, str]:
        """shard -> ETag of every shard object there is now (anything else in the folder is not read)."""
        prefix = f"{self.root}{MANIFEST_DIR}/"
        try:
            found = list_objects(self.client, self.bucket, prefix)
        except S3_ERRORS as exc:
            raise wrap(self.where, exc, "list manifest") from exc
        shards = {}
        for obj in found:
            name = obj["Key"][len(prefix) :]
            shard = name.removeprefix("folders/").removesuffix(".json") if name != "root.json" else ""
            if shard_name(shard) == name:
                shards[shard] = obj["ETag"]
        return shards

    def load(self) -> dict[str, ManifestEntry]:
        """Every entry: the shards (each read again only when its ETag changed) and an older mirrord's
        single object, for the folders no shard holds yet."""
        shards: dict[str, _Shard] = {}
        for shard, etag in self._listed().items():
            known = self._shards.get(shard)
            shards[shard] = known if known is not None and known.etag == etag else self._read(self._key(shard))
        self._shards = shards
        self._legacy = self._read(self.legacy_key)
        return self.entries()

    def _read(self, key: str) -> _Shard:
        where = f"s3://{self.bucket}/{key}"
        try:
            found = get_object(self.client, self.bucket, key)
        except S3_ERRORS as exc:
            raise wrap(where, exc, "read manifest") from exc
        if found is None:
            return _Shard()
        entries, _generation, contributions = decode_shared_snapshot(found[0], where)
        return _Shard(found[1], entries, contributions)

    def _views(self) -> Iterable[_Shard]:
        """The shards, and the older single object's part of the folders they do not hold."""
        yield from self._shards.values()
        if self._legacy is not None and self._legacy.etag is not None:
            yield from self._split(self._legacy, skip=set(self._shards)).values()

    @staticmethod
    def _split(whole: _Shard, skip: set[str]) -> dict[str, _Shard]:
        parts: dict[str, _Shard] = {}
        for rel, entry in whole.entries.items():
            if shard_of(rel) not in skip:
                parts.setdefault(shard_of(rel), _Shard()).entries[rel] = entry
        for unit, nodes in whole.contributions.items():
            if shard_of(unit) not in skip:
                parts.setdefault(shard_of(unit), _Shard()).contributions[unit] = nodes
        return parts

    def entries(self) -> dict[str, ManifestEntry]:
        """Every entry as last read or written."""
        found: dict[str, ManifestEntry] = {}
        for shard in self._views():
            found.update(shard.entries)
        return found

    def contributions(self) -> Contributions:
        """Nodes' contributions to folder units not complete yet, as last read or written."""
        return {unit: dict(parts) for shard in self._views() for unit, parts in shard.contributions.items()}

    def shared_entries(self) -> dict[str, ManifestEntry]:
        """Every node's entries as stored now (several nodes share one prefix)."""
        return self.load()

    # -- writing ---------------------------------------------------------------------------------------
    def append(self, payloads: Iterable[bytes]) -> None:
        """Apply the changes, shard by shard: PUT If-Match (If-None-Match: * for a new shard); when another
        writer got there first, re-read its version of that shard, re-apply ours on top and try again."""
        changes = [decode_change(p, self.where) for p in payloads]
        shards = {shard_of(rel) for change in changes for rel in (*(e.path for e in change.puts), *change.removes)}
        self._migrate()
        for shard in sorted(shards):

            def apply(current: _Shard, shard: str = shard) -> _Shard:
                entries = dict(current.entries)
                for change in changes:
                    change.apply_to(entries)
                mine = {rel: entry for rel, entry in entries.items() if shard_of(rel) == shard}
                return _Shard(current.etag, mine, current.contributions)

            self._update(shard, apply)

    def contribute(self, unit: str, part: Contribution) -> Merged:
        """Record one node's part of a folder unit (mirrord.core.contributions.contribute) in its shard:
        read, merge, PUT If-Match; on a conflict, again on top of the other writer's version. The write
        that makes the unit whole records all of its files as entries and drops its contributions."""
        self.load()
        self._migrate()
        merged: list[Merged] = []

        def apply(current: _Shard) -> _Shard:
            stored = self._stored_below(unit)  # listed after the read: a part counted is one still there
            result = contribute(current.entries, current.contributions, unit, part, stored)
            entries = dict(current.entries)
            Change(result.puts, result.removes).apply_to(entries)
            merged[:] = [result]
            return _Shard(current.etag, entries, result.contributions)

        self._update(shard_of(unit), apply)
        return merged[0]

    def _stored_below(self, unit: str) -> dict[str, int]:
        """path -> size of every object under the unit's folder now."""
        try:
            found = list_objects(self.client, self.bucket, f"{self.root}{unit}/")
        except S3_ERRORS as exc:
            raise wrap(f"s3://{self.bucket}/{self.root}{unit}/", exc, "list") from exc
        return {obj["Key"][len(self.root) :]: int(obj["Size"]) for obj in found}

    def _update(self, shard: str, apply: Callable[[_Shard], _Shard]) -> None:
        """One shard changed by `apply`, conditionally written; again on a conflict, bounded."""
        key = self._key(shard)
        for attempt in range(MANIFEST_ATTEMPTS):
            current = self._shards.get(shard) or _Shard()
            changed = apply(current)
            if self._write(key, changed):
                self._shards[shard] = changed
                return
            get_logger().info("s3.manifest_conflict", path=f"s3://{self.bucket}/{key}", attempt=attempt + 1)
            self._shards[shard] = self._read(key)  # another writer's version: ours goes on top of it
        raise ManifestError(
            self.where,
            f"another writer changed the manifest {MANIFEST_ATTEMPTS} times in a row "
            "while this one tried to record; try again",
        )

    def _write(self, key: str, shard: _Shard) -> bool:
        """One conditional PUT of the shard (its ETag set); False if another writer changed it since."""
        if self.guard is not None:
            self.guard()  # before every attempt: a retry after a conflict is a new commit
        try:
            etag = put_if(
                self.client, self.bucket, key, encode_snapshot(shard.entries, 0, shard.contributions), shard.etag
            )
        except S3_ERRORS as exc:
            raise wrap(f"s3://{self.bucket}/{key}", exc, "write manifest") from exc
        if etag is not None:
            shard.etag = etag
        return etag is not None

    def _migrate(self) -> None:
        """An older mirrord's single manifest object, moved into shards (never over a shard already
        written: that one is newer) and then deleted, If-Match on the version moved."""
        for _attempt in range(MANIFEST_ATTEMPTS):
            legacy = self._legacy
            if legacy is None or legacy.etag is None:
                return
            for shard, part in sorted(self._split(legacy, skip=set(self._shards)).items()):
                if self._write(self._key(shard), part):
                    self._shards[shard] = part
                else:
                    self._shards[shard] = self._read(self._key(shard))  # another node moved it first
            try:
                if self.guard is not None:
                    self.guard()
                self.client.delete_object(Bucket=self.bucket, Key=self.legacy_key, IfMatch=legacy.etag)
            except S3_ERRORS as exc:
                if error_code(exc) in MISSING_CODES:
                    self._legacy = None
                    return
                if error_code(exc) not in CONFLICT_CODES:
                    raise wrap(f"s3://{self.bucket}/{self.legacy_key}", exc, "retire the old manifest") from exc
                self._legacy = self._read(self.legacy_key)  # an older mirrord wrote it meanwhile
                continue
            get_logger().info("s3.manifest_migrated", path=self.where, shards=len(self._shards))
            self._legacy = None
            return
        raise ManifestError(self.where, "the old manifest object kept changing while it was moved into shards")

    def set_aside(self, suffix: str) -> list[str]:
        """Every manifest object copied to a name that is never read (NAME+suffix), then deleted, each
        If-Match on the version copied (repair keeps a damaged manifest for a person to look at)."""
        try:
            found = [(self._key(shard), etag) for shard, etag in self._listed().items()]
            with contextlib.suppress(*S3_ERRORS):
                head = self.client.head_object(Bucket=self.bucket, Key=self.legacy_key)
                found.append((self.legacy_key, head["ETag"]))
            moved = []
            for key, etag in found:
                aside = key + suffix  # beside it, under a name load() never reads
                self.client.copy_object(
                    Bucket=self.bucket,
                    Key=aside,
                    CopySource={"Bucket": self.bucket, "Key": key},
                    CopySourceIfMatch=etag,
                )
                self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=etag)
                moved.append(f"s3://{self.bucket}/{aside}")
        except S3_ERRORS as exc:
            raise ManifestError(self.where, wrap(self.where, exc, "set the manifest aside").cause) from exc
        self._shards, self._legacy = {}, None
        return moved

    # -- compaction: nothing to do, every write is a whole shard -------------------------------------------
    def rotate(self) -> int:
        """Nothing to rotate: every manifest write is a whole shard."""
        return 0

    def publish_snapshot(self, data: bytes) -> None:
        """Nothing to fold: every write is already a whole shard."""

    def drop_before(self, generation: int) -> None:
        """No journals to drop."""

    def damage(self) -> str | None:
        """Always None: a conditional PUT cannot leave a torn manifest."""
        return None
