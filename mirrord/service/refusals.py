"""Why the daemon refuses to copy or prune right now: one reason per check, each change logged once."""

from __future__ import annotations

from mirrord.obs.log import get_logger

# Refusal sources: the mirror is not the pinned volume; it looks unmounted; its manifest is unwritable;
# publishing is not safe (an object store's lease was not renewed in time).
IDENTITY, LISTING, MANIFEST, LEASE = "identity", "listing", "manifest", "lease"


class Refusals:
    """Set by the loop, the supervisor and (for a vanished mirror) a worker; read by /readyz and status."""

    def __init__(self, mirror: str) -> None:
        self.mirror = mirror  # named in the log lines
        self._reasons: dict[str, str] = {}
        self._logged: dict[str, str] = {}
        # What a refusal made the loop drop (watch hints, a listing's jobs) is not carried: a full listing
        # finds it again once nothing refuses (Reconciler.work), not the periodic rescan an hour later.
        self.missed = False
        self.log = get_logger()

    @property
    def blocked(self) -> str:
        """Why copying and pruning are refused ('' when they are not)."""
        return "; ".join(v for v in dict(self._reasons).values() if v)

    def get(self, source: str) -> str | None:
        """The current problem from `source`, if any."""
        return self._reasons.get(source)

    def note(self, source: str, problem: str) -> None:
        """Set a refusal from a worker thread, unlogged: the next check logs it (a single dict store)."""
        self._reasons[source] = problem

    def refuse(self, source: str, problem: str | None) -> None:
        """Set or clear one refusal; logs each change once (a worker may have set it first, unlogged)."""
        if problem:
            self._reasons[source] = problem
        else:
            self._reasons.pop(source, None)
        if (problem or "") == self._logged.get(source, ""):
            return
        self._logged[source] = problem or ""
        if problem:
            self.log.error("mirror.refused", cause=problem, mirror=self.mirror, check=source)
        else:
            self.log.info("mirror.accepted", mirror=self.mirror, check=source)
