"""Uploads to an object-store mirror: a file (one PUT, or a multipart upload whose parts go while the
copier streams), a folder unit's files, and the sweep of multipart uploads a dead writer left behind.

A file is visible only whole: the key appears only at CompleteMultipartUpload (or the one PUT), and every
failure aborts the upload explicitly. Every part carries a CRC32 the server checks and answers back.
"""

from __future__ import annotations

import base64
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from mirrord.errors import PermanentError, SizeMismatchError, TransientError
from mirrord.obs.log import get_logger
from mirrord.paths import split_rel
from mirrord.store.atomic import DirSyncs
from mirrord.store.s3.client import MIB, S3_ERRORS, ns, wrap
from mirrord.store.s3.listing import object_state

if TYPE_CHECKING:
    from mirrord.store.s3.mirror import S3Mirror

try:  # ISA-L's CRC-32 (python-isal): the same function as zlib's (what botocore would use), several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without its wheel
    from zlib import crc32

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
        self.mirror.committed(object_state(self.rel, self.key, self.expected_size, head["LastModified"], self.etag))
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
