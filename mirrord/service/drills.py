"""The daemon's drill (mirrord.store.drill): a run's newest verified unit restored into the mirror's staging area
(swept at every start: a drill killed midway leaves nothing there for long) and loaded by a bounded child process,
on a thread of its own, one drill at a time, and only while no copy is queued, under way or about to be: the
trainer's checkpoints come first. A run is due when its newest unit was not drilled yet, and again
`drill.interval_hours` after its last drill. What was drilled is kept in memory only: after a restart each run's
newest unit is drilled once more."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

from mirrord.config import Config
from mirrord.core.model import ManifestEntry
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.store.atomic import STAGING_AREA
from mirrord.store.drill import drill
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.resume import Candidate, recorded_candidates


@dataclass(frozen=True)
class Drilled:
    """A run's last drill: its unit's records (another record of the same name is another unit), when it started
    (wall clock), its failure (None: loaded), the last success."""

    unit: tuple[ManifestEntry, ...]
    at: float
    error: str | None
    ok_at: float | None


class Drills:
    """start_due() is called by the main loop; the drill's thread records what happened and calls `done`."""

    def __init__(
        self, mirror: Mirror, manifest: Manifest, metrics: Metrics, wall: Callable[[], float], done: Callable[[], None]
    ) -> None:
        self.mirror, self.manifest, self.metrics, self.wall, self.done = mirror, manifest, metrics, wall, done
        self.last: dict[str, Drilled] = {}  # run -> its last drill (written by the drill's thread only)
        self._thread: threading.Thread | None = None
        # (manifest seq, the oldest last drill's start): nothing is due before an interval after it, unless a unit
        # is recorded meanwhile; the interval is read at each look (a reload may change it)
        self._quiet = (-1, 0.0)
        self.log = get_logger()

    def start_due(self, config: Config, idle: bool) -> None:
        """Start the drill of the run due longest, when no drill runs and the copies are done (`idle`)."""
        interval = config.drill.interval_hours * 3600
        if not interval or not idle or (self._thread is not None and self._thread.is_alive()):
            return
        seq, now = self.manifest.last_seq, self.wall()
        if seq == self._quiet[0] and now < self._quiet[1] + interval:
            return
        newest = {run: units for run, units in recorded_candidates(self.manifest).items() if units}
        self.last = {run: last for run, last in self.last.items() if run in newest}  # a run gone is forgotten
        due = [
            run
            for run, units in newest.items()
            if (last := self.last.get(run)) is None or last.unit != units[0].entries or now >= last.at + interval
        ]
        if not due:
            self._quiet = (seq, min((last.at for last in self.last.values()), default=now))
            return
        run = min(due, key=lambda r: self.last[r].at if r in self.last else 0.0)
        self._quiet = (-1, 0.0)
        self._thread = threading.Thread(
            target=self._drill, args=(config, run, newest[run]), name="mirrord-drill", daemon=True
        )
        self._thread.start()

    def _drill(self, config: Config, run: str, units: list[Candidate]) -> None:
        started, loads, last = self.wall(), find_spec("torch") is not None, self.last.get(run)
        try:
            found = drill(self.mirror, config.rules, run, loads, units, within=STAGING_AREA)
        except Exception as exc:  # nothing to restore any more, no room for the scratch folder, ...: a finding, and
            # remembered as any other (a drill that ends without a record would be started again at once)
            found = {"file": self.mirror.describe(units[0].key), "error": str(exc)}
        label = self.metrics.run_label(run)
        ok_at = last.ok_at if last else None
        if found["error"]:
            self.metrics.drill_failures.labels(label).inc()
            self.metrics.drill_last_failure.labels(label).set(self.wall())
            self.log.error("drill.failed", run=run or ".", path=units[0].key, file=found["file"], error=found["error"])
        else:
            ok_at = self.wall()
            self.metrics.drill_last_success.labels(label).set(ok_at)
            self.log.info(
                "drill.passed",
                run=run or ".",
                path=found["relative_path"],
                step=found["step"],
                loaded=found["loaded"],
                structure_only=not loads,
            )
        error = f"{found['file']}: {found['error']}" if found["error"] else None
        self.last[run] = Drilled(units[0].entries, started, error, ok_at)
        self.done()

    def report(self) -> dict[str, dict[str, Any]]:
        """Per run (`.`: the root), for /status: when a drill last passed, and the last drill's failure."""
        return {run or ".": {"ok_at": d.ok_at, "error": d.error} for run, d in dict(self.last).items()}
