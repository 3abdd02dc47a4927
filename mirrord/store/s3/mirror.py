"""The object-store mirror: `mirror = "s3://bucket/prefix"` (AWS S3, MinIO, Ceph RGW, SeaweedFS, R2, ...).

The same promises as the filesystem mirror, with S3's own commit points (docs/s3.md):

- **A file is visible only whole** (S3Upload, below): at most `concurrency` parts in flight across
  every upload, so memory is bounded by `concurrency * part_size` plus the part each file is filling.
- **The manifest is one object per top-level folder** (mirrord.store.s3.manifest), written with
  conditional PUTs; its entry is the commit point of a unit.
- **The lock is a lease object** per node (mirrord.store.s3.lease), renewed on its own thread.
- **Deletion re-checks**: the object must still have the planned size and LastModified, and it is
  deleted with `If-Match` on the ETag just read, so a newer upload under the same key is never deleted.
- **No free space**: `space()` is None (there is no such number), and the gauge is absent, not 0.
- **Every request has a deadline** (`s3.timeout_seconds`), retries included.

Credentials come only from the standard chain (environment, profile, instance or pod role); a secret in
the configuration file is refused unless `allow_inline_credentials = true` (see mirrord.config).
"""

from __future__ import annotations

import base64
import contextlib
import io
import stat
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from mirrord.core.model import FileState, Snapshot
from mirrord.errors import ChangedError, MirrordError, PermanentError, SizeMismatchError, TransientError
from mirrord.layouts import Layout
from mirrord.obs.log import get_logger
from mirrord.paths import S3Location, split_rel
from mirrord.store.atomic import DirSyncs
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.s3 import listing
from mirrord.store.s3.client import (
    MISSING_CODES,
    S3_ERRORS,
    S3Settings,
    error_code,
    make_client,
    make_session,
    node_name,
    ns,
    server_time,
    wrap,
)
from mirrord.store.s3.lease import Lease, call_timeout
from mirrord.store.s3.manifest import S3ManifestStore

try:  # ISA-L's CRC-32 (python-isal): the same function as zlib's (what botocore would use), several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without its wheel
    from zlib import crc32

MIB = 1024 * 1024
LEASE_DIR = ".mirrord-leases"
# One node of a shared prefix prunes it (the holder of this lease); its own folder, so that no node
# name can collide with it.
RETENTION_LEASE = ".mirrord-retention/lease"


class S3Mirror:
    """The mirror interface over one bucket and prefix (keys are root-relative POSIX paths)."""

    has_inodes = True  # the key and ETag stand for the inode (listing.etag_identity)

    def __init__(self, url: str, settings: S3Settings | None = None, client: Any = None) -> None:
        self.location = S3Location.parse(url)
        self.settings = settings or S3Settings()
        self.node = node_name(self.settings.node)
        self._session: Any = None if client is not None else make_session(self.settings)
        self.client = client if client is not None else make_client(self.settings, session=self._session)
        self.url = self.location.url()
        self.lease: Lease | None = None
        self.retention: Lease | None = None  # held while this node prunes the prefix (see claim_retention)
        self._lease_client: Any = None
        self._open_units: dict[str, S3UnitStaging] = {}  # unit key -> its staging, until commit or abort
        # Parts in flight, every upload together: memory stays concurrency * part_size (plus the part each
        # file in flight is filling) however many files go at once.
        self.part_slots = threading.BoundedSemaphore(self.settings.concurrency)
        self.live_uploads: set[str] = set()  # this process's multipart uploads in flight: never swept
        self._just_committed = threading.local()  # see committed()

    def describe(self, rel: str = "") -> str:
        """Where rel lives, for messages: s3://bucket/prefix/rel."""
        return self.location.url(rel)

    def _key(self, rel: str) -> str:
        split_rel(rel)
        return self.location.key(rel)

    # -- reading --------------------------------------------------------------------------------------
    def local_tree(self) -> None:
        """Not a directory tree."""

    def keep_modes_of(self, primary: Path) -> None:
        """Objects have no permission bits."""

    def exists(self) -> bool:
        """The bucket is there (and we may use it); False only when the server says it is not. Any other
        failure raises, naming its cause: an unreachable endpoint is not a missing bucket."""
        # Two retries, not the daemon's patient ones: a command on a closed port says so within seconds.
        client = make_client(self.settings, attempts=2, session=self._session) if self._session else self.client
        try:
            client.head_bucket(Bucket=self.location.bucket)
        except S3_ERRORS as exc:
            if error_code(exc) not in (*MISSING_CODES, "NoSuchBucket"):
                raise wrap(self.url, exc, "reach the bucket") from exc
            try:  # a HEAD's 404 has no body: a listing's answer says whether S3 or another service spoke
                client.list_objects_v2(Bucket=self.location.bucket, MaxKeys=1)
            except S3_ERRORS as listed:
                if error_code(listed) == "NoSuchBucket":
                    return False
                raise wrap(self.url, listed, "reach the bucket") from listed
        return True

    def link_aliases(self, primary_root: Any, links: Any, entries: Any) -> list[tuple[str, str]]:
        """An object store has no symlinks: no alias is linked (Mirror.link_aliases)."""
        return []

    def snapshot(self, patterns: Iterable[str], layout: Layout | None = None) -> Snapshot:
        """Every committed candidate object under the prefix, chosen as the local scanner chooses files
        (mirrord.store.scan): hidden folders are not entered; with a folder layout every member of a unit
        folder is listed (dot names too). No partials or staging: an object exists only once whole.
        A listing error makes the view partial (errors), never raises."""
        return listing.snapshot(self.client, self.location, tuple(patterns), layout)

    def stat(self, rel: str) -> FileState | None:
        """The object's state; for a key that only prefixes objects (a folder unit), a folder whose
        mtime is the newest LastModified below it; None if neither."""
        just: FileState | None = getattr(self._just_committed, "state", None)
        self._just_committed.state = None
        if just is not None and just.rel == rel:
            return just
        head = self._head(rel)
        if head is not None:
            return listing.object_state(rel, self._key(rel), head["ContentLength"], head["LastModified"], head["ETag"])
        below = self._below(rel)
        if not below:
            return None
        newest = max(obj["LastModified"] for obj in below)
        return FileState(rel, 0, ns(newest), mode=stat.S_IFDIR | 0o755)

    def committed(self, state: FileState | None) -> None:
        """An upload of ours just completed as `state` (its HEAD already made): the very next stat() on
        this thread, if it asks about that object (the engine recording its identity), answers from
        here at no request. Any other stat, or a change made through this mirror, forgets it (None)."""
        self._just_committed.state = state

    def _below(self, rel: str) -> list[dict[str, Any]]:
        """Every object under rel/ (a folder unit's files)."""
        try:
            return listing.list_objects(self.client, self.location.bucket, self._key(rel) + "/")
        except S3_ERRORS as exc:
            raise wrap(self.describe(rel), exc, "list") from exc

    def _head(self, rel: str) -> dict[str, Any] | None:
        key = self._key(rel)  # ValueError for an unsafe key, as the seam says: not a server error
        try:
            return dict(self.client.head_object(Bucket=self.location.bucket, Key=key))
        except S3_ERRORS as exc:
            if error_code(exc) in MISSING_CODES:
                return None
            raise wrap(self.describe(rel), exc, "head") from exc

    def open_read(self, rel: str) -> BinaryIO:
        """The object's bytes, in order (restore and verify hash them as they arrive): the first range
        streamed; once it is read through, the rest as ranged GETs in parallel (see _RangedReader)."""
        key = self._key(rel)
        try:
            try:
                first = self.client.get_object(
                    Bucket=self.location.bucket, Key=key, Range=f"bytes=0-{self.settings.part_size - 1}"
                )
            except S3_ERRORS as exc:
                if error_code(exc) != "InvalidRange":
                    raise
                first = self.client.get_object(Bucket=self.location.bucket, Key=key)  # an empty object
        except S3_ERRORS as exc:
            if error_code(exc) in MISSING_CODES:
                raise FileNotFoundError(2, "no such object", self.describe(rel)) from exc
            raise wrap(self.describe(rel), exc, "get") from exc
        return io.BufferedReader(_RangedReader(self, rel, first), buffer_size=MIB)

    def space(self) -> tuple[int, int] | None:
        """An object store has no free-space figure: None (the gauge is then absent, never 0)."""
        return None

    # -- writing --------------------------------------------------------------------------------------
    def begin_upload(self, rel: str, size: int, drop_cache: bool = False) -> S3Upload:
        """Begin uploading `rel` (a single PUT or a multipart upload, decided by its size)."""
        return S3Upload(self, rel, size)

    def delete(self, rel: str, expected: FileState) -> None:
        """Delete rel only if it is still the object planned (size, LastModified), by If-Match on its ETag."""
        self.committed(None)
        head = self._head(rel)
        if head is None:
            return
        if not _unchanged(head, expected):
            raise ChangedError(self.describe(rel), "changed since it was planned for deletion")
        self.require_lease()
        if not self._delete_if_match(self._key(rel), head["ETag"]):
            raise ChangedError(self.describe(rel), "replaced since it was planned for deletion")

    def _delete_if_match(self, key: str, etag: str) -> bool:
        """Delete `key` if it is still the object `etag` names (gone already: done); False if it was replaced."""
        try:
            self.client.delete_object(Bucket=self.location.bucket, Key=key, IfMatch=etag)
        except S3_ERRORS as exc:
            if error_code(exc) == "PreconditionFailed":
                return False
            if error_code(exc) not in MISSING_CODES:
                raise wrap(f"s3://{self.location.bucket}/{key}", exc, "delete") from exc
        return True

    def clone(self, source_key: str, key: str, expected: FileState) -> FileState | None:
        """A server-side copy of the object `source_key` (still `expected`: size and LastModified, then
        held by If-Match on its ETag) to `key`: no byte is uploaded again. None if it changed."""
        self.committed(None)
        head = self._head(source_key)
        if head is None or not _unchanged(head, expected):
            return None
        self.require_lease()  # the copy appears under `key`: only under a lease safe to publish under
        bucket = self.location.bucket
        try:  # a managed copy: multipart (UploadPartCopy) above 5 GB; the object appears only when whole
            self.client.copy(
                {"Bucket": bucket, "Key": self._key(source_key)},
                bucket,
                self._key(key),
                ExtraArgs={"CopySourceIfMatch": head["ETag"]},
            )
        except S3_ERRORS as exc:
            if error_code(exc) in ("PreconditionFailed", "404", "NoSuchKey"):
                return None
            raise wrap(self.describe(key), exc, "copy") from exc
        return self.stat(key)

    def rename(self, key: str, other: str, keep: bool = False) -> bool:
        """S3 renames nothing: a server-side copy of `key` (clone: still the object just read) replaces
        `other` in one step (a reader gets the old object or the new one, whole); then, unless `keep`, `key`
        is deleted (If-Match: only the object copied). Not one step: a crash between the two leaves both.
        With `keep`, False if `key` changed meanwhile (nothing done); else ChangedError."""
        state = self.stat(key)
        if state is None or self.clone(key, other, state) is None:
            if keep:
                return False
            raise ChangedError(self.describe(key), "gone or replaced before it was copied to " + self.describe(other))
        if not keep:
            self.delete(key, state)
        return True

    def begin_unit(self, key: str) -> S3UnitStaging:
        """A folder unit. Under an empty prefix its files go straight under their final keys (S3 cannot
        rename a prefix; the caller's manifest record of the unit is what makes it trusted). If an older
        copy is there, they are staged under KEY.part/ instead (never over the old copy's objects) and
        commit() copies them into place once the old copy is gone (FileExistsError while it is not)."""
        split_rel(key)
        staging = S3UnitStaging(self, key, staged=bool(self._below(key)))
        self._open_units[key] = staging
        return staging

    def delete_unit(self, key: str, files: Iterable[tuple[str, FileState]]) -> None:
        """No folders to rename: file by file, then what is left under the prefix."""
        for rel, state in files:
            self.delete(rel, state)
        self.delete_folder(key)

    def delete_folder(self, key: str, expected: FileState | None = None) -> bool:
        """A prefix is not a thing on S3: gone as soon as no object is left under it. With `expected` (an
        old copy of a unit being replaced, its manifest entries already removed): every object under it
        is deleted, each by If-Match on its ETag, unless one is newer than `expected` said (then False)."""
        self.committed(None)
        staging = self._open_units.get(key)
        ours = staging.published() if staging is not None else set()
        below = [obj for obj in self._below(key) if obj["Key"] not in ours]  # never the new copy's files
        if expected is None or not below:
            return not below
        if max(ns(obj["LastModified"]) for obj in below) > expected.mtime_ns:
            return False  # written since it was planned: not the folder that was meant
        self.require_lease()
        return all(self._delete_if_match(obj["Key"], obj["ETag"]) for obj in below)

    def set_manifest_aside(self, suffix: str) -> list[str]:
        """Every manifest object copied to NAME+suffix, then deleted (If-Match: only the version copied)."""
        return self.manifest_store().set_aside(suffix)

    def is_mountpoint(self) -> bool | None:
        """Always None: "mount point" means nothing for an object store."""
        return None

    def check_identity(self) -> None:
        """A bucket cannot be unmounted: nothing to pin (the lease is the ownership check)."""

    def identity_problem(self) -> str | None:
        """Always None: an object store has no mount to vanish from under us."""
        return None

    # -- stale multipart uploads ----------------------------------------------------------------------
    def stale_uploads(self, older_than: float) -> list[tuple[str, str, float]]:
        """(key, upload id, age s) of the multipart uploads under the prefix older than `older_than` seconds
        by the server's own clock (its Date header against the Initiated it stamped: a local clock ahead of
        the server's ages nothing), never one of this process's own uploads in flight."""
        found = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.location.bucket, Prefix=self.location.prefix
        )
        for page in pages:
            now = server_time(page)
            for up in page.get("Uploads", ()):
                if now is None or up["UploadId"] in self.live_uploads:
                    continue  # no clock to age it by, or ours: kept
                if (age := now - up["Initiated"].timestamp()) > older_than:
                    found.append((up["Key"], up["UploadId"], age))
        return found

    def sweep_stale_uploads(self, older_than: float) -> int:
        """Abort the multipart uploads a killed or failed writer left under the prefix (their parts are billed
        until then): only stale_uploads(), however long one of ours has run. A younger one may be another
        node's live upload."""
        bucket = self.location.bucket
        try:
            stale = self.stale_uploads(older_than)
        except S3_ERRORS as exc:
            raise wrap(self.url, exc, "list multipart uploads") from exc
        for key, upload_id, age in stale:
            if upload_id in self.live_uploads:
                continue  # started since the listing
            try:
                self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except S3_ERRORS as exc:
                if error_code(exc) not in ("NoSuchUpload", "404"):
                    raise wrap(f"s3://{bucket}/{key}", exc, "abort stale upload") from exc
            get_logger().info("s3.stale_upload_aborted", path=f"s3://{bucket}/{key}", age_seconds=round(age))
        return len(stale)

    # -- manifest -------------------------------------------------------------------------------------
    def manifest_store(self) -> S3ManifestStore:
        """The manifest object, read and written by conditional PUTs."""
        return S3ManifestStore(self.client, self.location.bucket, self.location.prefix)

    def load_manifest(self) -> Manifest:
        """The manifest as it is now, read-only (verify, latest, status), with the nodes' contributions to
        units not complete yet."""
        store = self.manifest_store()
        return Manifest(store.load(), contributions=store.contributions())

    def read_manifest(self) -> Manifest:
        """The manifest, open for changes: each one is a conditional PUT of the whole object."""
        store = self.manifest_store()
        store.guard = self.require_lease  # the manifest entry is the commit point: only under a safe lease
        return Manifest(store.load(), store)

    # -- lock -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One mirrord per node and prefix: a lease object with an expiry, renewed by lock_problem()."""
        seconds = self.settings.lease_seconds
        client = make_client(
            self.settings,
            timeout=call_timeout(seconds),
            attempts=1,  # never a long hang
            session=self._session,
        )
        lease = Lease(
            client, self.location.bucket, self.location.key(f"{LEASE_DIR}/{self.node}"), seconds, name=self.node
        )
        lease.acquire()
        lease.start_keeping()
        self.lease, self._lease_client = lease, client
        try:
            yield
        finally:
            retention, self.retention, self.lease = self.retention, None, None
            if retention is not None:
                retention.release()
            lease.release()

    def claim_retention(self) -> str | None:
        """None if this node may prune the prefix now: it holds the retention lease (taken here when free
        or expired; renewed on its own thread from then on, until the lock is released). Else who does
        (another node's live lease) or why not. Several nodes share a prefix: exactly one prunes it, from
        the merged manifest. Without a lock (nothing coordinates) None."""
        if self.lease is None:
            return None
        held = self.retention
        if held is not None:
            if held.lost() is None:
                return held.problem()
            held.release()
            self.retention = None
            get_logger().warning("s3.retention_lost", path=held.where, cause=held.lost())
        lease = Lease(
            self._lease_client,
            self.location.bucket,
            self.location.key(RETENTION_LEASE),
            self.settings.lease_seconds,
            name=self.node,
            what="this prefix's retention lease",
        )
        try:
            lease.acquire(ours=True)  # a dead process of this node (we hold its lease) held it: take it over
        except MirrordError as exc:
            return exc.cause
        lease.start_keeping()
        self.retention = lease
        get_logger().info("s3.retention_claimed", path=lease.where, node=self.node)
        return None

    def require_retention(self) -> None:
        """Before each deletion retention makes on the mirror: raise unless this node still holds the
        retention lease safely (it may have gone stale while the pass ran)."""
        held = self.retention
        if self.lease is None:
            return
        if held is None:
            raise TransientError(self.url, "this node does not hold the prefix's retention lease")
        held.require()

    def lock_problem(self) -> str | None:
        """Why the lease is lost for good (another mirrord took it), or None. Never waits for the server:
        the lease renews itself on its own thread (mirrord.store.s3.lease)."""
        lease = self.lease
        return None if lease is None else lease.lost()

    def write_problem(self) -> str | None:
        """Why nothing may be published right now (the lease was not renewed in time, or is lost), or None."""
        lease = self.lease
        return None if lease is None else lease.problem()

    def require_lease(self) -> None:
        """Before every commit point (a manifest write, an upload's completion, a deletion): raise unless
        the lease is safe to publish under. Without a lock (a read-only command, a test) nothing to check."""
        lease = self.lease
        if lease is not None:
            lease.require()


def _unchanged(head: dict[str, Any], expected: FileState) -> bool:
    """The object HEAD describes is still the one planned: same size and LastModified."""
    return (int(head["ContentLength"]), ns(head["LastModified"])) == (expected.size, expected.mtime_ns)


class _RangedReader(io.RawIOBase):
    """An object read in order at the rate of several connections: the first response's body streamed (a
    validator reading a header costs one GET), then the rest as ranged GETs of s3.part_size, at most
    s3.concurrency in flight (memory: concurrency * part_size), each with If-Match on the first ETag so
    that every byte is of the same object."""

    def __init__(self, mirror: S3Mirror, rel: str, first: dict[str, Any]) -> None:
        self._mirror, self._rel, self._etag = mirror, rel, first["ETag"]
        self._body: Any = first["Body"]
        total = int(first.get("ContentRange", f"/{first['ContentLength']}").rsplit("/", 1)[1])
        self._starts = iter(range(int(first["ContentLength"]), total, mirror.settings.part_size))
        self._total = total
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: deque[Future[bytes]] = deque()
        self._chunk = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._body is not None:
            try:  # (a connection cut in the body: botocore's error, said as the ranged GETs' are)
                data = self._body.read(len(buffer))
            except S3_ERRORS as exc:
                raise wrap(self._mirror.describe(self._rel), exc, "get") from exc
            if data:
                buffer[: len(data)] = data
                return len(data)
            self._body = None
        while not self._chunk:
            self._top_up()
            if not self._ahead:
                return 0
            self._chunk = memoryview(self._ahead.popleft().result())
        n = min(len(buffer), len(self._chunk))
        buffer[:n], self._chunk = self._chunk[:n], self._chunk[n:]
        return n

    def _top_up(self) -> None:
        settings = self._mirror.settings
        while len(self._ahead) < settings.concurrency and (start := next(self._starts, None)) is not None:
            self._pool = self._pool or ThreadPoolExecutor(settings.concurrency, thread_name_prefix="s3-read")
            self._ahead.append(self._pool.submit(self._get, start, min(start + settings.part_size, self._total) - 1))

    def _get(self, start: int, end: int) -> bytes:
        mirror = self._mirror
        try:
            body = mirror.client.get_object(
                Bucket=mirror.location.bucket,
                Key=mirror._key(self._rel),
                Range=f"bytes={start}-{end}",
                IfMatch=self._etag,
            )["Body"]
            return bytes(body.read())
        except S3_ERRORS as exc:
            if error_code(exc) == "PreconditionFailed":
                raise ChangedError(mirror.describe(self._rel), "replaced while it was read") from exc
            raise wrap(mirror.describe(self._rel), exc, "get") from exc

    def close(self) -> None:
        if self._body is not None:
            with contextlib.suppress(*S3_ERRORS, OSError):
                self._body.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()


# -- uploads ---------------------------------------------------------------------------------------------
# A file (one PUT, or a multipart upload whose parts go while the copier streams) and a folder unit's files,
# each a part of its S3Mirror (its client, settings, lease and open units). A file is visible only whole: the
# key appears only at CompleteMultipartUpload (or the one PUT), and every failure aborts the upload
# explicitly. Every part carries a CRC32 the server checks and answers back.
CHECKSUM = "CRC32"  # zlib's: no extra dependency (CRC32C needs botocore[crt]); every S3 server checks it
STAGING_SUFFIX = ".part"  # a unit staged beside an older copy of itself: KEY.part/


def _checksum(body: bytes | bytearray) -> str:
    """The x-amz-checksum-crc32 of a body, computed here (ISA-L) so that botocore does not (zlib): the
    server checks it against the bytes it received and refuses the request on a mismatch."""
    return base64.b64encode(crc32(body).to_bytes(4, "big")).decode("ascii")


def _check_echo(where: str, what: str, sent: str, answer: dict[str, Any]) -> None:
    """A server that checks the checksum answers it back; one that answers another checksum stored other
    bytes than ours (a server that answers none does not check it: the size and the hash still stand)."""
    echoed = answer.get(f"Checksum{CHECKSUM}")
    if echoed is not None and echoed != sent:
        raise TransientError(where, f"the server stored {what} with CRC-32 {echoed}, the bytes sent had {sent}")


class S3Upload:
    """One object being written; visible under its key only after commit().

    write() fills a part buffer; a full part goes to a small thread pool (at most `concurrency` in
    flight for the whole mirror, S3Mirror.part_slots: write() blocks for a free slot, which bounds
    memory). seal() sends the last part and waits for all of them; commit() completes the multipart
    upload (or makes the one PUT of a small file).
    """

    def __init__(self, mirror: S3Mirror, rel: str, size: int) -> None:
        self.mirror = mirror
        self.rel = rel
        self.where = mirror.describe(rel)
        self.bucket = mirror.location.bucket
        self.key = mirror._key(rel)
        self.expected_size = size
        self.part_size = mirror.settings.part_size
        self.multipart = size > self.part_size
        storage_class = mirror.settings.storage_class
        self._extra = {"StorageClass": storage_class} if storage_class else {}
        self.written = 0
        self.stored_mtime_ns: int | None = None  # LastModified, known once committed
        self.etag: str | None = None  # of the committed object
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._slots = mirror.part_slots
        self._pool: ThreadPoolExecutor | None = None
        self._done = False
        self._part_list: list[dict[str, Any]] | None = None  # set by seal()

    def write(self, data: memoryview) -> None:
        """Buffer or upload the next bytes (a part at a time for a multipart upload)."""
        self.written += len(data)
        if not self.multipart:
            if self.written > max(self.expected_size, self.part_size):
                raise SizeMismatchError(self.where, f"more than the {self.expected_size} bytes the source had")
            self._buf += data
            return
        while data:
            take = min(len(data), self.part_size - len(self._buf))
            self._buf += data[:take]
            data = data[take:]
            if len(self._buf) == self.part_size:
                self._send_part()

    def skip(self, nbytes: int) -> None:
        """A hole in a sparse source: objects have no holes, so its zeros are uploaded."""
        zeros = memoryview(bytes(min(nbytes, MIB)))
        while nbytes > 0:
            n = min(nbytes, len(zeros))
            self.write(zeros[:n])
            nbytes -= n

    def _send_part(self) -> None:
        if self._upload_id is None:
            try:
                created = self.mirror.client.create_multipart_upload(
                    Bucket=self.bucket, Key=self.key, ChecksumAlgorithm=CHECKSUM, **self._extra
                )
            except S3_ERRORS as exc:
                raise wrap(self.where, exc, "create multipart upload") from exc
            self._upload_id = created["UploadId"]
            self.mirror.live_uploads.add(self._upload_id)  # the stale-upload sweep never takes it
            self._pool = ThreadPoolExecutor(self.mirror.settings.concurrency, thread_name_prefix="mirrord-s3-part")
        self._raise_failed()
        self._slots.acquire()  # at most `concurrency` parts in memory and on the wire
        part, self._buf = self._buf, bytearray()  # handed over, not copied: botocore sends a bytearray as is
        number = len(self._parts) + 1
        assert self._pool is not None
        try:
            future = self._pool.submit(self._upload_part, number, part)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _done: self._slots.release())  # also when abort() cancels it
        self._parts.append(future)

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        checksum = _checksum(body)
        try:
            answer = self.mirror.client.upload_part(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
                ChecksumAlgorithm=CHECKSUM,
                **{f"Checksum{CHECKSUM}": checksum},
            )
        except S3_ERRORS as exc:
            raise wrap(self.where, exc, f"upload part {number}") from exc
        _check_echo(self.where, f"part {number}", checksum, answer)
        return {"PartNumber": number, "ETag": answer["ETag"], f"Checksum{CHECKSUM}": checksum}

    def _raise_failed(self) -> None:
        for future in self._parts:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def seal(self, mtime_ns: int) -> int | None:
        """Send the last part, wait for every part, check the size. The stored mtime (LastModified) is
        known only after commit (stored_mtime_ns); None here."""
        if self.multipart and self._buf:
            self._send_part()
        parts = [f.result() for f in self._parts]
        if self.written != self.expected_size:
            raise SizeMismatchError(self.where, f"wrote {self.written} bytes, source had {self.expected_size}")
        self._part_list = parts
        return None

    def commit(self, dirs: DirSyncs | None = None) -> int:
        """Complete the upload (or PUT the small file); returns the object's LastModified. Durable when
        this returns: an object store has no directory to fsync (`dirs` is not needed)."""
        if self._part_list is None:
            raise RuntimeError("commit() before seal()")
        client = self.mirror.client
        self.mirror.require_lease()  # the object appears here: only under a lease safe to publish under
        try:
            if self.multipart:
                client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._part_list},
                )
            else:
                checksum = _checksum(self._buf)
                answer = client.put_object(
                    Bucket=self.bucket,
                    Key=self.key,
                    Body=self._buf,  # as is: no copy
                    ChecksumAlgorithm=CHECKSUM,
                    **{f"Checksum{CHECKSUM}": checksum},
                    **self._extra,
                )
                _check_echo(self.where, "object", checksum, answer)
            self._done = True
            head = client.head_object(Bucket=self.bucket, Key=self.key)
        except S3_ERRORS as exc:
            raise wrap(self.where, exc, "complete upload") from exc
        finally:
            self._close()
        if head["ContentLength"] != self.expected_size:
            raise SizeMismatchError(
                self.where, f"object has {head['ContentLength']} bytes after upload, source had {self.expected_size}"
            )
        self.stored_mtime_ns = ns(head["LastModified"])
        self.etag = head["ETag"]
        self.mirror.committed(
            listing.object_state(self.rel, self.key, self.expected_size, head["LastModified"], self.etag)
        )
        return self.stored_mtime_ns

    def abort(self) -> None:
        """Explicitly abort the multipart upload (its parts are gone); a small file was never sent."""
        if self._done:
            return
        self._done = True
        for future in self._parts:
            future.cancel()
        self._close()
        if self._upload_id is not None:
            try:
                self.mirror.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            except S3_ERRORS as exc:  # the stale-upload sweep gets it later
                get_logger().warning("s3.abort_failed", path=self.where, cause=str(wrap(self.where, exc, "abort")))

    def _close(self) -> None:
        if self._upload_id is not None:
            self.mirror.live_uploads.discard(self._upload_id)
        self._buf = bytearray()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class S3UnitStaging:
    """A folder unit being uploaded (see S3Mirror.begin_unit): each file under its final key, or under
    KEY.part/ when an older copy is in the way. commit() checks every file completed and, when staged,
    copies them into place (server-side) once no older object is left under KEY. abort() deletes the
    files this staging completed (If-Match on their ETags: a newer upload of the same key stays)."""

    replaces = False  # no prefix can be swapped: the caller deletes an older copy before commit()

    def __init__(self, mirror: S3Mirror, key: str, staged: bool = False) -> None:
        self.mirror, self.key = mirror, key
        self.area = f"{key}{STAGING_SUFFIX}" if staged else key
        self._uploads: list[S3Upload] = []

    def upload(self, relkey: str, size: int, drop_cache: bool = False) -> S3Upload:
        """Begin one file of the unit, uploaded into the unit's area (its final keys, or a staging area)."""
        split_rel(relkey)
        upload = S3Upload(self.mirror, f"{self.area}/{relkey}", size)
        self._uploads.append(upload)
        return upload

    def published(self) -> set[str]:
        """Keys of the files this staging has completed (the new copy of the unit)."""
        return {u.key for u in self._uploads if u.etag is not None}

    def commit(self) -> None:
        """Check that every file completed and move a staged unit into place (the manifest record that
        follows commits the unit)."""
        for upload in self._uploads:
            if upload.etag is None:
                raise PermanentError(upload.where, "the unit was committed before this file was")
        if self.area != self.key:
            self._move_into_place()
        self.mirror._open_units.pop(self.key, None)

    def _move_into_place(self) -> None:
        mirror = self.mirror
        mirror.committed(None)
        mirror.require_lease()
        if mirror._below(self.key):
            raise FileExistsError(
                17, "an older copy of the unit is still there; delete it first", mirror.describe(self.key)
            )
        client, bucket = mirror.client, mirror.location.bucket
        for upload in self._uploads:
            target = mirror.location.key(self.key) + upload.key.removeprefix(mirror.location.key(self.area))
            try:  # a managed copy: multipart (UploadPartCopy) above 5 GB, all on the server
                client.copy({"Bucket": bucket, "Key": upload.key}, bucket, target)
            except S3_ERRORS as exc:
                raise wrap(mirror.describe(self.key), exc, "copy a staged file into place") from exc
        for upload in self._uploads:
            with contextlib.suppress(*S3_ERRORS):  # a leftover is swept with the dead staging area
                client.delete_object(Bucket=bucket, Key=upload.key, IfMatch=upload.etag)

    def abort(self) -> None:
        """Abort what is in flight and delete the files this staging completed (only if still ours, by ETag)."""
        self.mirror._open_units.pop(self.key, None)
        self.mirror.committed(None)
        client, bucket = self.mirror.client, self.mirror.location.bucket
        for upload in self._uploads:
            upload.abort()
            if upload.etag is not None:
                try:
                    client.delete_object(Bucket=bucket, Key=upload.key, IfMatch=upload.etag)
                except S3_ERRORS as exc:
                    get_logger().warning(
                        "s3.unit_abort_failed", path=upload.where, cause=str(wrap(upload.where, exc, "delete"))
                    )


def open_s3_mirror(url: str, section: S3Settings | None = None) -> S3Mirror:
    """The mirror for `mirror = "s3://..."` with the [s3] section; a readable ConfigError-like message if
    boto3 is missing. A key pair in the file is warned about (the config refused it unless
    allow_inline_credentials)."""
    try:
        import boto3  # noqa: F401
    except ImportError as exc:
        raise PermanentError(url, "an s3:// mirror needs boto3: pip install 'mirrord[s3]'") from exc
    if section is not None and (section.access_key_id or section.secret_access_key):
        get_logger().warning(
            "s3.inline_credentials",
            cause="a key pair in the configuration file is used "
            "(s3.allow_inline_credentials = true); prefer the standard credential chain",
        )
    return S3Mirror(url, section)


def _conforms(mirror: S3Mirror) -> Mirror:
    """mypy checks here that S3Mirror implements the whole seam (mirrord.store.mirror.Mirror)."""
    return mirror
