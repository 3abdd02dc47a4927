"""The lock of an object-store mirror: a lease object with an expiry, renewed on a thread of its own.

An object store has no flock. The lease is an object (`.mirrord-leases/NODE`) naming its holder and
the wall time it expires, created with `If-None-Match: *`, renewed and released with `If-Match` on
our ETag; an expired one is taken over with `If-Match` on its ETag, so two contenders cannot both win.

Renewal runs on its own thread (`start_keeping`), with a client whose calls are bounded by short
timeouts and no retries of their own: a slow or hung server never holds up the daemon's heartbeat,
its health probe or a copy. Publishing is allowed only while the lease is *safe*: until two thirds
of the lease after the last renewal that succeeded was sent. The last third is the margin for clock
skew between nodes and for a commit already on the wire. Past that, `problem()` says why and every
commit point (a manifest write, an upload's completion, a deletion) refuses through `require()`
until a renewal succeeds again. A renewal that succeeds with `If-Match` on our own ETag proves that
nobody took the lease meanwhile, so publishing may resume; one that finds another holder has lost
the lease for good (`lost()`), and the daemon stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from mirrord.errors import LockedError, MirrordError, TransientError
from mirrord.obs.log import get_logger
from mirrord.store.s3.client import MISSING_CODES, S3_ERRORS, error_code, get_object, put_if, wrap

RENEW_AFTER = 1 / 3  # of the lease: when a renewal is due
SAFE_FOR = 2 / 3  # of the lease after a renewal was sent: how long publishing stays allowed
RETRY_AFTER = 1 / 12  # of the lease: the wait before trying again after a failed renewal


def call_timeout(seconds: float) -> float:
    """The bound on one lease call (connect, and each read): a tenth of the lease, 1 to 10 s."""
    return max(1.0, min(10.0, seconds / 10))


class Lease:
    """One holder's lease object; see the module docstring for when it is safe to publish."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        key: str,
        seconds: float,
        name: str = "",
        what: str = "this mirror's lease",
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.bucket, self.key, self.seconds = client, bucket, key, seconds
        self.wall, self.monotonic = wall, monotonic
        self.where, self.what = f"s3://{bucket}/{key}", what
        self.name = name or socket.gethostname()
        self.holder = f"{name or socket.gethostname()}:{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._etag: str | None = None
        self._safe_until = 0.0  # monotonic
        self._renewed_at = 0.0  # monotonic: when the last successful renewal was sent
        self._lost: str | None = None
        self._last_error = ""
        self._last_try = 0.0  # monotonic: the last renewal attempt
        self._stale_logged = False
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    # -- taking and giving back ----------------------------------------------------------------------
    def acquire(self, ours: bool = False) -> None:
        """Take the lease (create the lease object, or take over an expired one); LockedError if another
        mirrord holds it. `ours`: a holder of our own name is dead whatever its expiry says (the caller
        holds its node's lease, so no other mirrord of that name lives) and is taken over at once."""
        try:
            if self._put(None):
                return
            found = self._read()
            if found is None:
                return self.acquire(ours)  # released meanwhile
            doc, etag = found
            expires = float(doc["expires_at"])
        except S3_ERRORS as exc:
            raise wrap(self.where, exc, "take lease") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise LockedError(self.where, "a lease object that is not mirrord's is in the way") from exc
        mine = ours and str(doc.get("holder", "")).split(":")[0] == self.name
        if expires > self.wall() and not mine:
            raise LockedError(
                self.where,
                f"another mirrord ({doc.get('holder')}) holds {self.what} for {expires - self.wall():.0f} s more",
            )
        try:
            taken = self._put(etag)
        except S3_ERRORS as exc:
            raise wrap(self.where, exc, "take over lease") from exc
        if not taken:
            raise LockedError(self.where, "another mirrord took over the expired lease first")
        get_logger().warning("s3.lease_taken_over", path=self.where, previous=doc.get("holder"))

    def start_keeping(self) -> None:
        """Renew on a thread of our own from now on, until release()."""
        self._keeper = threading.Thread(target=self._keep, name="mirrord-s3-lease", daemon=True)
        self._keeper.start()

    def release(self) -> None:
        """Stop renewing and give the lease back (delete the object if it is still ours)."""
        self._stop.set()
        keeper = self._keeper
        if keeper is not None:
            keeper.join(2 * call_timeout(self.seconds) + 1)  # bounded: at most one call is under way
        if self._lost is not None or self._etag is None:
            return
        with contextlib.suppress(*S3_ERRORS):
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self._etag)

    # -- the state, read by any thread -----------------------------------------------------------------
    def lost(self) -> str | None:
        """Why the lease is ours no more (another mirrord took it, or it was removed), or None."""
        return self._lost

    def problem(self) -> str | None:
        """None while publishing is safe; else why not (lost for good, or not renewed in time)."""
        if self._lost is not None:
            return self._lost
        if self.monotonic() < self._safe_until:
            return None
        age = self.monotonic() - self._renewed_at
        return (
            f"{self.where}: the lease was last renewed {age:.0f} s ago"
            f"{' (' + self._last_error + ')' if self._last_error else ''}; "
            "nothing is published until it is renewed"
        )

    def require(self) -> None:
        """Raise unless publishing is safe now: LockedError if lost, TransientError if not renewed in time."""
        if self._lost is not None:
            raise LockedError(self.where, self._lost)
        problem = self.problem()
        if problem is not None:
            raise TransientError(self.where, problem)

    # -- renewing ------------------------------------------------------------------------------------
    def renew(self) -> None:
        """One renewal (If-Match on our ETag). A conflict may be a renewal of ours that the server applied
        late (a hung server answering queued requests): the holder in the object tells, and then its
        ETag is ours to renew. Anyone else's holder means the lease is lost."""
        try:
            if self._put(self._etag or ""):
                return
            found = self._read()
        except S3_ERRORS as exc:
            if error_code(exc) not in MISSING_CODES:
                raise wrap(self.where, exc, "renew lease") from exc
            found = None
        except ValueError as exc:
            raise wrap(self.where, exc, "read lease") from exc
        if found is None:
            self._lose("the lease object was removed")
        elif found[0].get("holder") != self.holder:
            self._lose(f"another mirrord ({found[0].get('holder')}) took the lease")
        elif not self._put(found[1]):  # one of our own renewals, applied late: renew on top of it
            raise TransientError(self.where, "renew lease: the lease object changed again meanwhile")

    def _keep(self) -> None:
        log = get_logger()
        while self._lost is None:
            now = self.monotonic()
            due = self._renewed_at + self.seconds * RENEW_AFTER
            if self._last_error:  # the due time is past: wait the pause, a refused connection fails at once
                due = self._last_try + self.seconds * RETRY_AFTER
            if not self._stale_logged and now < self._safe_until:
                due = min(due, self._safe_until)  # wake to say so when publishing must pause
            if self._stop.wait(max(0.0, due - now)):
                return
            if self.monotonic() >= self._safe_until and not self._stale_logged:
                self._stale_logged = True
                log.error("s3.lease_stale", path=self.where, cause=self.problem(), action="not publishing")
            if self.monotonic() < self._renewed_at + self.seconds * RENEW_AFTER and not self._last_error:
                continue
            self._last_try = self.monotonic()
            try:
                self.renew()
            except (*S3_ERRORS, MirrordError) as exc:
                self._last_error = getattr(exc, "cause", str(exc))
                log.warning("s3.lease_renew_failed", path=self.where, cause=self._last_error)
                continue
            if self._lost is not None:
                log.error("s3.lease_lost", path=self.where, cause=self._lost)
                return
            if self._stale_logged:
                log.info("s3.lease_renewed", path=self.where, action="publishing again")
            self._last_error, self._stale_logged = "", False

    # -- the object ----------------------------------------------------------------------------------
    def _lose(self, why: str) -> None:
        self._lost = f"{self.where}: {why}"

    def _read(self) -> tuple[dict[str, Any], str] | None:
        """The lease document and its ETag; None if there is none. ValueError if it is not a document."""
        found = get_object(self.client, self.bucket, self.key)
        if found is None:
            return None
        doc = json.loads(found[0])
        if not isinstance(doc, dict):
            raise ValueError("not a lease document")
        return doc, found[1]

    def _put(self, etag: str | None) -> bool:
        """Write the lease if the object is still `etag` (None: if there is none); False if another
        writer changed it first."""
        sent, now = self.monotonic(), self.wall()
        body = json.dumps({"holder": self.holder, "renewed_at": now, "expires_at": now + self.seconds}).encode()
        written = put_if(self.client, self.bucket, self.key, body, etag)
        if written is not None:
            self._etag, self._renewed_at, self._safe_until = written, sent, sent + self.seconds * SAFE_FOR
        return written is not None
