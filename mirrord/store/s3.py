"""The object-store mirror: `mirror = "s3://bucket/prefix"` (AWS S3, MinIO, Ceph RGW, SeaweedFS, R2, ...).

The same promises as the filesystem mirror, with S3's own commit points:

- **A file is visible only whole.** Up to `part_size` it is one PutObject; above, a multipart upload
  whose parts are sent while the copier streams (the same single read that hashes and validates), at
  most `concurrency` parts in flight across every upload, so memory is bounded by `concurrency *
  part_size` plus the part each file in flight is filling (`files_in_flight` files at once). The key
  appears only at CompleteMultipartUpload; every failure aborts the upload explicitly, and
  `sweep_stale_uploads` aborts what a killed process left behind (older than the age guard). Every part
  carries a CRC32 the server checks (`x-amz-checksum-crc32`, computed here with ISA-L, and compared
  with the one the server answers back); the manifest keeps the content hash.
- **The manifest is one object** written with a conditional PUT (`If-None-Match: *` for the first,
  `If-Match` on the ETag after). A writer that lost a race re-reads it, re-applies its own change and
  tries again, so two writers never silently overwrite each other. S3 has no atomic rename of a
  prefix, so the manifest entry is the commit point of a unit: readers trust only what it lists.
- **The lock is a lease object** per node (`.mirrord-leases/NODE`) with an expiry, renewed by the
  daemon's heartbeat (`lock_problem`); an expired lease may be taken over, a live one refuses.
- **Deletion re-checks**: the object must still have the planned size and LastModified, and it is
  deleted with `If-Match` on the ETag just read, so a newer upload under the same key is never deleted.
- **No free space**: `space()` is None (there is no such number), and the gauge is absent, not 0.

Credentials come only from the standard chain (environment, profile, instance or pod role); a secret in
the configuration file is refused unless `allow_inline_credentials = true` (see mirrord.config).
"""

from __future__ import annotations

import base64
import contextlib
import io
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

from mirrord.core.contributions import Contribution, Merged, contribute
from mirrord.core.layouts import Layout
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.errors import (
    ChangedError,
    ManifestError,
    MirrordError,
    PermanentError,
    SizeMismatchError,
    TransientError,
)
from mirrord.obs.log import get_logger
from mirrord.store.atomic import DirSyncs
from mirrord.store.lease import Lease, call_timeout
from mirrord.store.manifest import (
    MANIFEST_NAME,
    Change,
    Manifest,
    decode_change,
    decode_shared_snapshot,
    encode_snapshot,
)
from mirrord.store.mirror import Mirror
from mirrord.store.paths import split_rel
from mirrord.store.s3_errors import CONFLICT_CODES, error_code, wrap
from mirrord.store.scan import is_selected_name

try:  # ISA-L's CRC-32 (python-isal): the same function as zlib's (what botocore would use), several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without its wheel
    from zlib import crc32

MIB = 1024 * 1024
LEASE_DIR = ".mirrord-leases"
# One node of a shared prefix prunes it (the holder of this lease); its own folder, so that no node
# name can collide with it.
RETENTION_LEASE = ".mirrord-retention/lease"
STAGING_SUFFIX = ".part"  # a unit staged beside an older copy of itself: KEY.part/
CHECKSUM = "CRC32"  # zlib's: no extra dependency (CRC32C needs botocore[crt]); every S3 server checks it
MANIFEST_ATTEMPTS = 10


@dataclass(frozen=True)
class S3Location:
    """Where an object-store mirror lives: the bucket and the key prefix."""
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """`s3://bucket` or `s3://bucket/some/prefix`; ValueError (one readable line) otherwise."""
        if not url.startswith("s3://"):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url[5:].partition("/")
        if not bucket or "/" in bucket or len(bucket) < 3:
            raise ValueError(f"{url!r}: no valid bucket name after s3://")
        prefix = prefix.strip("/")
        if prefix:
            split_rel(prefix)  # no '..', no empty components, no NUL
        return cls(bucket, f"{prefix}/" if prefix else "")

    def key(self, rel: str) -> str:
        """The object key of `rel`."""
        return self.prefix + rel

    def url(self, rel: str = "") -> str:
        """The s3:// URL of `rel` (for messages)."""
        return f"s3://{self.bucket}/{self.prefix}{rel}"


@dataclass(frozen=True)
class S3Settings:
    """What the mirror needs from the [s3] section (mirrord.config.S3Config)."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    part_size: int = 8 * MIB
    concurrency: int = 8
    files_in_flight: int = 8
    storage_class: str | None = None
    sign_payload: bool = False
    access_key_id: str | None = None
    secret_access_key: str | None = None
    lease_seconds: float = 120.0
    node: str = ""
    max_attempts: int = 10


def node_name(configured: str) -> str:
    """This node's name in a shared prefix: s3.node, or the host's name."""
    return configured or socket.gethostname()


def make_session(settings: S3Settings) -> Any:
    """A boto3 session: the credential chain (or the inline key pair), and botocore's loaded S3 model,
    shared by every client made from it (loading that model is most of a client's start-up cost)."""
    import boto3

    return boto3.session.Session(aws_access_key_id=settings.access_key_id,
                                 aws_secret_access_key=settings.secret_access_key)


def make_client(settings: S3Settings, timeout: float | None = None, attempts: int | None = None,
                session: Any = None) -> Any:
    """A botocore S3 client: standard retries (throttling, 5xx, a connection refused while a server restarts).
    `timeout` and `attempts` bound each call of a client that must never hang for long (the lease's).
    Made from `session` when given (the mirror's: its clients share one loaded model)."""
    from botocore.config import Config as BotoConfig

    session = session if session is not None else make_session(settings)
    config = BotoConfig(
        region_name=settings.region,
        # Unsigned payload (what botocore does over https anyway): every body still carries the CRC32 the
        # server checks. Signing adds a SHA-256 pass over every byte sent over plain http (s3.sign_payload).
        s3={"addressing_style": settings.addressing_style,
            **({} if settings.sign_payload else {"payload_signing_enabled": False})},
        retries={"mode": "standard", "max_attempts": attempts or settings.max_attempts},
        max_pool_connections=max(10, settings.concurrency + settings.files_in_flight + 4),  # parts + files
        connect_timeout=timeout or 10,
        read_timeout=timeout or 120,
    )
    return session.client("s3", endpoint_url=settings.endpoint_url, config=config)


def _ns(when: datetime) -> int:
    return int(when.timestamp()) * 10**9 + when.microsecond * 1000


def _staging_area(rel: str, layout: Layout | None) -> str | None:
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


def _listed(rel: str, patterns: tuple[str, ...], layout: Layout | None) -> bool:
    """Whether the local scanner would list this key as a file (see mirrord.store.scan.snapshot_tree)."""
    parts = rel.split("/")
    if not rel or rel.endswith("/") or "" in parts or "." in parts or ".." in parts:
        return False
    folders, name = parts[:-1], parts[-1]
    in_unit = False
    for folder in folders:
        if folder.startswith("."):
            return False  # hidden folders (ours: leases, a set-aside manifest) are never entered
        if layout is not None and layout.folders and not in_unit:
            if layout.is_staging_name(folder):
                return False
            in_unit = layout.is_unit_name(folder)
    return is_selected_name(name, patterns, layout, in_unit)


class S3Mirror:
    """The mirror interface over one bucket and prefix (keys are root-relative POSIX paths)."""

    has_inodes = False  # an object has no inode or ctime: nothing to record beside its LastModified

    def __init__(self, url: str, settings: S3Settings | None = None, client: Any = None) -> None:
        self.location = S3Location.parse(url)
        self.settings = settings or S3Settings()
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

    def describe(self, rel: str = "") -> str:
        """Where rel lives, for messages: s3://bucket/prefix/rel."""
        return self.location.url(rel)

    def _key(self, rel: str) -> str:
        split_rel(rel)
        return self.location.key(rel)

    # -- reading --------------------------------------------------------------------------------------
    def exists(self) -> bool:
        """The bucket answers (and we may use it)."""
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except Exception:
            return False
        return True

    def snapshot(self, patterns: Iterable[str], layout: Layout | None = None) -> Snapshot:
        """Every committed candidate object under the prefix, chosen as the local scanner chooses files
        (mirrord.store.scan): hidden folders are not entered; with a folder layout every member of a unit
        folder is listed (dot names too). No partials or staging: an object exists only once whole.
        A listing error makes the view partial (errors), never raises."""
        patterns = tuple(patterns)
        files: dict[str, FileState] = {}
        staging: dict[str, FileState] = {}
        errors: list[str] = []
        prefix = self.location.prefix
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    rel = obj["Key"][len(prefix):]
                    if _listed(rel, patterns, layout):
                        files[rel] = _state(rel, obj["Size"], obj["LastModified"])
                    elif (area := _staging_area(rel, layout)) is not None:
                        newest = max(_ns(obj["LastModified"]), staging[area].mtime_ns if area in staging else 0)
                        staging[area] = FileState(area, 0, newest, mode=stat.S_IFDIR | 0o755)
        except Exception as exc:
            errors.append(str(wrap(self.url, exc, "list")))
        return Snapshot(files, {}, tuple(errors), (), staging)

    def stat(self, rel: str) -> FileState | None:
        """The object's state; for a key that only prefixes objects (a folder unit), a folder whose
        mtime is the newest LastModified below it; None if neither."""
        head = self._head(rel)
        if head is not None:
            return _state(rel, head["ContentLength"], head["LastModified"])
        below = self._below(rel)
        if not below:
            return None
        newest = max(obj["LastModified"] for obj in below)
        return FileState(rel, 0, _ns(newest), mode=stat.S_IFDIR | 0o755)

    def _below(self, rel: str) -> list[dict[str, Any]]:
        """Every object under rel/ (a folder unit's files)."""
        found: list[dict[str, Any]] = []
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self._key(rel) + "/"):
                found.extend(page.get("Contents", ()))
        except Exception as exc:
            raise wrap(self.describe(rel), exc, "list") from exc
        return found

    def _head(self, rel: str) -> dict[str, Any] | None:
        key = self._key(rel)  # ValueError for an unsafe key, as the seam says: not a server error
        try:
            return dict(self.client.head_object(Bucket=self.location.bucket, Key=key))
        except Exception as exc:
            if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise wrap(self.describe(rel), exc, "head") from exc

    def open_read(self, rel: str) -> BinaryIO:
        """The object's bytes, streamed (verify hashes them as they arrive)."""
        try:
            body = self.client.get_object(Bucket=self.location.bucket, Key=self._key(rel))["Body"]
        except Exception as exc:
            if error_code(exc) in ("404", "NoSuchKey"):
                raise FileNotFoundError(2, "no such object", self.describe(rel)) from exc
            raise wrap(self.describe(rel), exc, "get") from exc
        return io.BufferedReader(_BodyReader(body), buffer_size=MIB)

    def space(self) -> tuple[int, int] | None:
        """An object store has no free-space figure: None (the gauge is then absent, never 0)."""
        return None

    def link_aliases(self, primary_root: Any, links: Any, entries: Any) -> list[tuple[str, str]]:
        """An object store has no symlinks: no alias is linked (Mirror.link_aliases)."""
        return []

    # -- writing --------------------------------------------------------------------------------------
    def begin_upload(self, rel: str, size: int, drop_cache: bool = False) -> S3Upload:
        """Begin uploading `rel` (a single PUT or a multipart upload, decided by its size)."""
        return S3Upload(self, rel, size)

    def delete(self, rel: str, expected: FileState) -> None:
        """Delete rel only if it is still the object planned (size, LastModified), by If-Match on its ETag."""
        head = self._head(rel)
        if head is None:
            return
        now = _state(rel, head["ContentLength"], head["LastModified"])
        if (now.size, now.mtime_ns) != (expected.size, expected.mtime_ns):
            raise ChangedError(self.describe(rel), "changed since it was planned for deletion")
        self.require_lease()
        try:
            self.client.delete_object(Bucket=self.location.bucket, Key=self._key(rel), IfMatch=head["ETag"])
        except Exception as exc:
            if error_code(exc) == "PreconditionFailed":
                raise ChangedError(self.describe(rel), "replaced since it was planned for deletion") from exc
            if error_code(exc) in ("404", "NoSuchKey"):
                return
            raise wrap(self.describe(rel), exc, "delete") from exc

    def clone(self, source_key: str, key: str, expected: FileState) -> FileState | None:
        """A server-side copy of the object `source_key` (still `expected`: size and LastModified, then
        held by If-Match on its ETag) to `key`: no byte is uploaded again. None if it changed."""
        head = self._head(source_key)
        if head is None:
            return None
        if (int(head["ContentLength"]), _ns(head["LastModified"])) != (expected.size, expected.mtime_ns):
            return None
        self.require_lease()  # the copy appears under `key`: only under a lease safe to publish under
        bucket = self.location.bucket
        try:  # a managed copy: multipart (UploadPartCopy) above 5 GB; the object appears only when whole
            self.client.copy({"Bucket": bucket, "Key": self._key(source_key)}, bucket, self._key(key),
                             ExtraArgs={"CopySourceIfMatch": head["ETag"]})
        except Exception as exc:
            if error_code(exc) in ("PreconditionFailed", "404", "NoSuchKey"):
                return None
            raise wrap(self.describe(key), exc, "copy") from exc
        return self.stat(key)

    def begin_unit(self, key: str) -> S3UnitStaging:
        """A folder unit. Under an empty prefix its files go straight under their final keys (S3 cannot
        rename a prefix; the caller's manifest record of the unit is what makes it trusted). If an older
        copy is there, they are staged under KEY.part/ instead (never over the old copy's objects) and
        commit() copies them into place once the old copy is gone (FileExistsError while it is not)."""
        split_rel(key)
        staging = S3UnitStaging(self, key, staged=bool(self._below(key)))
        self._open_units[key] = staging
        return staging

    def delete_folder(self, key: str, expected: FileState | None = None) -> bool:
        """A prefix is not a thing on S3: gone as soon as no object is left under it. With `expected` (an
        old copy of a unit being replaced, its manifest entries already removed): every object under it
        is deleted, each by If-Match on its ETag, unless one is newer than `expected` said (then False)."""
        staging = self._open_units.get(key)
        ours = staging.published() if staging is not None else set()
        below = [obj for obj in self._below(key) if obj["Key"] not in ours]  # never the new copy's files
        if expected is None or not below:
            return not below
        if max(_ns(obj["LastModified"]) for obj in below) > expected.mtime_ns:
            return False  # written since it was planned: not the folder that was meant
        self.require_lease()
        for obj in below:
            try:
                self.client.delete_object(Bucket=self.location.bucket, Key=obj["Key"], IfMatch=obj["ETag"])
            except Exception as exc:
                if error_code(exc) == "PreconditionFailed":
                    return False
                if error_code(exc) not in ("404", "NoSuchKey"):
                    raise wrap(f"s3://{self.location.bucket}/{obj['Key']}", exc, "delete") from exc
        return True

    def set_manifest_aside(self, suffix: str) -> list[str]:
        """Copy the manifest object to NAME+suffix, then delete it (If-Match: only the version copied)."""
        key = self.location.key(MANIFEST_NAME)
        aside = key + suffix
        try:
            head = self.client.head_object(Bucket=self.location.bucket, Key=key)
        except Exception as exc:
            if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return []
            raise ManifestError(self.describe(MANIFEST_NAME), wrap(key, exc, "head manifest").cause) from exc
        try:
            source = {"Bucket": self.location.bucket, "Key": key}
            self.client.copy_object(Bucket=self.location.bucket, Key=aside, CopySource=source,
                                    CopySourceIfMatch=head["ETag"])
            self.client.delete_object(Bucket=self.location.bucket, Key=key, IfMatch=head["ETag"])
        except Exception as exc:
            raise ManifestError(self.describe(MANIFEST_NAME), wrap(key, exc, "set the manifest aside").cause) from exc
        return [f"s3://{self.location.bucket}/{aside}"]

    def is_mountpoint(self) -> bool | None:
        """Always None: "mount point" means nothing for an object store."""
        return None

    def check_identity(self) -> None:
        """A bucket cannot be unmounted: nothing to pin (the lease is the ownership check)."""

    def identity_problem(self) -> str | None:
        """Always None: an object store has no mount to vanish from under us."""
        return None

    # -- stale multipart uploads ----------------------------------------------------------------------
    def stale_uploads(self, older_than: float, now: float | None = None) -> list[tuple[str, str, float]]:
        """(key, upload id, age s) of multipart uploads under the prefix started more than `older_than` ago."""
        now = time.time() if now is None else now
        found = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self.location.prefix):
            for up in page.get("Uploads", ()):
                age = now - up["Initiated"].timestamp()
                if age > older_than:
                    found.append((up["Key"], up["UploadId"], age))
        return found

    def sweep_stale_uploads(self, older_than: float, now: float | None = None) -> int:
        """Abort the multipart uploads a killed or failed writer left (their parts are billed until then).

        Only older than the age guard: a younger one may be a live upload of another node.
        """
        swept = 0
        try:
            stale = self.stale_uploads(older_than, now)
        except Exception as exc:
            raise wrap(self.url, exc, "list multipart uploads") from exc
        for key, upload_id, age in stale:
            try:
                self.client.abort_multipart_upload(Bucket=self.location.bucket, Key=key, UploadId=upload_id)
            except Exception as exc:
                if error_code(exc) not in ("NoSuchUpload", "404"):
                    raise wrap(f"s3://{self.location.bucket}/{key}", exc, "abort stale upload") from exc
            get_logger().info("s3.stale_upload_aborted", path=f"s3://{self.location.bucket}/{key}",
                              age_seconds=round(age))
            swept += 1
        return swept

    # -- manifest -------------------------------------------------------------------------------------
    def manifest_store(self) -> S3ManifestStore:
        """The manifest object, read and written by conditional PUTs."""
        return S3ManifestStore(self.client, self.location.bucket, self.location.key(MANIFEST_NAME))

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
        node = node_name(self.settings.node)
        seconds = self.settings.lease_seconds
        client = make_client(self.settings, timeout=call_timeout(seconds), attempts=1,  # never a long hang
                             session=self._session)
        lease = Lease(client, self.location.bucket, self.location.key(f"{LEASE_DIR}/{node}"), seconds, name=node)
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
        node = node_name(self.settings.node)
        lease = Lease(self._lease_client, self.location.bucket, self.location.key(RETENTION_LEASE),
                      self.settings.lease_seconds, name=node, what="this prefix's retention lease")
        try:
            lease.acquire(ours=True)  # a dead process of this node (we hold its lease) held it: take it over
        except MirrordError as exc:
            return exc.cause
        lease.start_keeping()
        self.retention = lease
        get_logger().info("s3.retention_claimed", path=lease.where, node=node)
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
        the lease renews itself on its own thread (mirrord.store.lease)."""
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


def _state(rel: str, size: int, last_modified: datetime) -> FileState:
    """An object as a FileState: mtime is LastModified (what the retention guards judge), no inode."""
    return FileState(rel, int(size), _ns(last_modified), mode=stat.S_IFREG | 0o644)


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


class _BodyReader(io.RawIOBase):
    """botocore's StreamingBody as a raw stream, so io.BufferedReader can wrap it."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        return n

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()
        super().close()


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
        settings = mirror.settings
        self.part_size = settings.part_size
        self.concurrency = settings.concurrency
        self.multipart = size > self.part_size
        self.written = 0
        self.stored_mtime_ns: int | None = None  # LastModified, known once committed
        self.etag: str | None = None  # of the committed object
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._slots = mirror.part_slots
        self._pool: ThreadPoolExecutor | None = None
        self._sealed = False
        self._done = False
        self._part_list: list[dict[str, Any]] = []

    def _extra(self) -> dict[str, Any]:
        storage_class = self.mirror.settings.storage_class
        return {"StorageClass": storage_class} if storage_class else {}

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
                    Bucket=self.bucket, Key=self.key, ChecksumAlgorithm=CHECKSUM, **self._extra())
            except Exception as exc:
                raise wrap(self.where, exc, "create multipart upload") from exc
            self._upload_id = created["UploadId"]
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="mirrord-s3-part")
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
            answer = self.mirror.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                                    PartNumber=number, Body=body, ChecksumAlgorithm=CHECKSUM,
                                                    **{f"Checksum{CHECKSUM}": checksum})
        except Exception as exc:
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
        self._sealed = True
        return None

    def commit(self, dirs: DirSyncs | None = None) -> int:
        """Complete the upload (or PUT the small file); returns the object's LastModified. Durable when
        this returns: an object store has no directory to fsync (`dirs` is not needed)."""
        if not self._sealed:
            raise RuntimeError("commit() before seal()")
        client = self.mirror.client
        self.mirror.require_lease()  # the object appears here: only under a lease safe to publish under
        try:
            if self.multipart:
                client.complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                                 MultipartUpload={"Parts": self._part_list})
            else:
                checksum = _checksum(self._buf)
                answer = client.put_object(Bucket=self.bucket, Key=self.key, Body=self._buf,  # as is: no copy
                                           ChecksumAlgorithm=CHECKSUM, **{f"Checksum{CHECKSUM}": checksum},
                                           **self._extra())
                _check_echo(self.where, "object", checksum, answer)
            self._done = True
            head = client.head_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            raise wrap(self.where, exc, "complete upload") from exc
        finally:
            self._close()
        if head["ContentLength"] != self.expected_size:
            raise SizeMismatchError(self.where, f"object has {head['ContentLength']} bytes after upload, "
                                                f"source had {self.expected_size}")
        self.stored_mtime_ns = _ns(head["LastModified"])
        self.etag = head["ETag"]
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
            except Exception as exc:  # the stale-upload sweep gets it later
                get_logger().warning("s3.abort_failed", path=self.where, cause=str(wrap(self.where, exc, "abort")))

    def _close(self) -> None:
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
        mirror.require_lease()
        if mirror._below(self.key):
            raise FileExistsError(17, "an older copy of the unit is still there; delete it first",
                                  mirror.describe(self.key))
        client, bucket = mirror.client, mirror.location.bucket
        staged_prefix = mirror.location.key(self.area) + "/"
        final_prefix = mirror.location.key(self.key) + "/"
        for upload in self._uploads:
            target = final_prefix + upload.key.removeprefix(staged_prefix)
            try:  # a managed copy: multipart (UploadPartCopy) above 5 GB, all on the server
                client.copy({"Bucket": bucket, "Key": upload.key}, bucket, target)
            except Exception as exc:
                raise wrap(mirror.describe(self.key), exc, "copy a staged file into place") from exc
        for upload in self._uploads:
            with contextlib.suppress(Exception):  # a leftover is swept with the dead staging area
                client.delete_object(Bucket=bucket, Key=upload.key, IfMatch=upload.etag)

    def abort(self) -> None:
        """Abort what is in flight and delete the files this staging completed (only if still ours, by ETag)."""
        self.mirror._open_units.pop(self.key, None)
        client, bucket = self.mirror.client, self.mirror.location.bucket
        for upload in self._uploads:
            upload.abort()
            if upload.etag is not None:
                try:
                    client.delete_object(Bucket=bucket, Key=upload.key, IfMatch=upload.etag)
                except Exception as exc:
                    get_logger().warning("s3.unit_abort_failed", path=upload.where,
                                         cause=str(wrap(upload.where, exc, "delete")))


class S3ManifestStore:
    """The manifest object, written whole with a conditional PUT; the Manifest's store (see mirrord.store.manifest).

    Each append re-encodes every entry (no journal: an object cannot be appended to), so recording costs
    one PUT of the whole manifest; group commit in Manifest batches concurrent changes into one PUT.
    """

    journal_records = 0  # nothing to compact
    guard: Callable[[], None] | None = None

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.where = f"s3://{bucket}/{key}"
        self._entries: dict[str, ManifestEntry] = {}
        self._contributions: dict[str, dict[str, Contribution]] = {}  # nodes' parts of units not whole yet
        self._etag: str | None = None

    def load(self) -> dict[str, ManifestEntry]:
        """Read the object (an empty manifest if there is none yet) and remember its ETag."""
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self.key)
            data = answer["Body"].read()
        except Exception as exc:
            if error_code(exc) in ("404", "NoSuchKey"):
                self._entries, self._contributions, self._etag = {}, {}, None
                return {}
            raise wrap(self.where, exc, "read manifest") from exc
        self._entries, _generation, self._contributions = decode_shared_snapshot(data, self.where)
        self._etag = answer["ETag"]
        return dict(self._entries)

    def contributions(self) -> dict[str, dict[str, Contribution]]:
        """Nodes' contributions to folder units not complete yet, as last read or written."""
        return {unit: dict(parts) for unit, parts in self._contributions.items()}

    def contribute(self, unit: str, part: Contribution) -> Merged:
        """Record one node's part of a folder unit (mirrord.core.contributions.contribute) in the object:
        read, merge, PUT If-Match; on a conflict, again on top of the other writer's version. The write
        that makes the unit whole records all of its files as entries and drops its contributions."""
        self.load()
        for attempt in range(MANIFEST_ATTEMPTS):
            stored = self._stored_below(unit)  # listed after the read: a part counted is one still there
            merged = contribute(self._entries, self._contributions, unit, part, stored)
            entries = dict(self._entries)
            Change(merged.puts, merged.removes).apply_to(entries)
            if self._put(entries, merged.contributions, attempt):
                return merged
        raise ManifestError(self.where, f"another writer changed the manifest {MANIFEST_ATTEMPTS} times in a row "
                                        "while this one tried to record; try again")

    def _stored_below(self, unit: str) -> dict[str, int]:
        """path -> size of every object under the unit's folder now."""
        root = self.key[: -len(MANIFEST_NAME)]  # the mirror's prefix ("" or ending in "/")
        stored: dict[str, int] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{root}{unit}/")
            for page in pages:
                for obj in page.get("Contents", ()):
                    stored[obj["Key"][len(root):]] = int(obj["Size"])
        except Exception as exc:
            raise wrap(f"s3://{self.bucket}/{root}{unit}/", exc, "list") from exc
        return stored

    def _put(self, entries: dict[str, ManifestEntry], contributions: dict[str, dict[str, Contribution]],
             attempt: int) -> bool:
        """One conditional PUT of the whole object; False (and the object read again) if another writer
        changed it since we read it."""
        condition = {"IfMatch": self._etag} if self._etag is not None else {"IfNoneMatch": "*"}
        if self.guard is not None:
            self.guard()  # before every attempt: a retry after a conflict is a new commit
        try:
            answer = self.client.put_object(Bucket=self.bucket, Key=self.key,
                                            Body=encode_snapshot(entries, 0, contributions),
                                            ContentType="application/json", **condition)
        except Exception as exc:
            if error_code(exc) not in CONFLICT_CODES:
                raise wrap(self.where, exc, "write manifest") from exc
            get_logger().info("s3.manifest_conflict", path=self.where, attempt=attempt + 1)
            self.load()  # another writer's version: ours goes on top of it
            return False
        self._entries, self._contributions, self._etag = entries, contributions, answer["ETag"]
        return True

    def append(self, payloads: Iterable[bytes]) -> None:
        """Apply the changes to the object: PUT If-Match (or If-None-Match: * for the first). When another
        writer got there first, re-read its version, re-apply ours on top and try again."""
        changes = [decode_change(p, self.where) for p in payloads]
        for attempt in range(MANIFEST_ATTEMPTS):
            entries = dict(self._entries)
            for change in changes:
                change.apply_to(entries)
            if self._put(entries, self._contributions, attempt):  # other nodes' contributions kept
                return
        raise ManifestError(self.where, f"another writer changed the manifest {MANIFEST_ATTEMPTS} times in a row "
                                        "while this one tried to record; try again")

    def rotate(self) -> int:
        """Nothing to rotate: every manifest write is the whole object."""
        return 0

    def publish_snapshot(self, data: bytes) -> None:
        """Compaction: nothing to fold, every write is already the whole object."""

    def drop_before(self, generation: int) -> None:
        """No journals to drop."""

    def damage(self) -> str | None:
        """Always None: a conditional PUT cannot leave a torn manifest."""
        return None

    def shared_entries(self) -> dict[str, ManifestEntry]:
        """The object as it is now: every node's entries (several nodes share one prefix)."""
        return self.load()


def settings_from(section: Any) -> S3Settings:
    """S3Settings from the [s3] section (mirrord.config.S3Config); a key pair in the file is warned about
    (the config refused it unless allow_inline_credentials)."""
    if section.access_key_id or section.secret_access_key:
        get_logger().warning("s3.inline_credentials", cause="a key pair in the configuration file is used "
                             "(s3.allow_inline_credentials = true); prefer the standard credential chain")
    return S3Settings(endpoint_url=section.endpoint_url, region=section.region,
                      addressing_style=section.addressing_style, part_size=section.part_size,
                      concurrency=section.concurrency, files_in_flight=section.files_in_flight,
                      storage_class=section.storage_class, sign_payload=section.sign_payload,
                      access_key_id=section.access_key_id, secret_access_key=section.secret_access_key,
                      lease_seconds=section.lease_seconds, node=section.node, max_attempts=section.max_attempts)


def open_s3_mirror(url: str, section: Any = None) -> S3Mirror:
    """The mirror for `mirror = "s3://..."`; a readable ConfigError-like message if boto3 is missing."""
    try:
        import boto3  # noqa: F401
    except ImportError as exc:
        raise PermanentError(url, "an s3:// mirror needs boto3: pip install 'mirrord[s3]'") from exc
    return S3Mirror(url, settings_from(section) if section is not None else S3Settings())


def _conforms(mirror: S3Mirror) -> Mirror:
    """mypy checks here that S3Mirror implements the whole seam (mirrord.store.mirror.Mirror)."""
    return mirror
