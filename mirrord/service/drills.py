"""The daemon's drill (mirrord.store.drill): a run's newest verified unit restored into the mirror's staging area
(swept at every start: a drill killed midway leaves nothing there for long) and loaded by a bounded child process,
on a thread of its own, one drill at a time, and only while no copy is queued, under way or about to be: the
trainer's checkpoints come first. A run is due when its newest unit was not drilled yet, and again
`drill.interval_hours` after its last drill. What each run's last drill found is kept on the mirror, beside the
manifest (STATE_NAME): a restarted daemon exports it at once and drills no unit again before its interval."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.util import find_spec
from typing import Any

from mirrord.config import Config
from mirrord.errors import MirrordError
from mirrord.obs.log import get_logger
from mirrord.obs.metrics import Metrics
from mirrord.service.workers import lower_priority
from mirrord.store.atomic import STAGING_AREA
from mirrord.store.drill import Halt, StoppedError, drill
from mirrord.store.manifest import Manifest
from mirrord.store.mirror import Mirror
from mirrord.store.resume import Candidate, recorded_candidates

STATE_NAME = ".mirrord-drills.json"  # hidden: never listed as a checkpoint


@dataclass(frozen=True)
class Drilled:
    """A run's last drill: its unit's (path, digest) records (another record of the same name is another unit),
    when it started (wall clock), its failure (None: loaded), the last success and the last failure."""

    unit: tuple[tuple[str, str], ...]
    at: float
    error: str | None
    ok_at: float | None
    failed_at: float | None


def _unit(candidate: Candidate) -> tuple[tuple[str, str], ...]:
    return tuple((e.path, e.digest) for e in candidate.entries)


def _decode(raw: dict[str, Any]) -> Drilled:
    """Raises ValueError/KeyError/TypeError for anything that is not a drill as _save wrote it."""
    ok_at, failed_at = (None if raw[k] is None else float(raw[k]) for k in ("ok_at", "failed_at"))
    error = None if raw["error"] is None else str(raw["error"])
    return Drilled(tuple((str(p), str(d)) for p, d in raw["unit"]), float(raw["at"]), error, ok_at, failed_at)


class Drills:
    """start_due() is called by the main loop; the drill's thread records what happened and calls `done`."""

    def __init__(
        self, mirror: Mirror, manifest: Manifest, metrics: Metrics, wall: Callable[[], float], done: Callable[[], None]
    ) -> None:
        self.mirror, self.manifest, self.metrics, self.wall, self.done = mirror, manifest, metrics, wall, done
        self.log = get_logger()
        self._thread: threading.Thread | None = None
        self._halt = Halt()
        # (manifest seq, the oldest last drill's start): nothing is due before an interval after it, unless a unit
        # is recorded meanwhile; the interval is read at each look (a reload may change it)
        self._quiet = (-1, 0.0)
        runs = recorded_candidates(manifest)
        # run -> its last drill (written by the drill's thread only); exported at once, drills on or off
        self.last = {run: d for run, d in self._load().items() if runs.get(run)}
        for run, last in self.last.items():
            self._export(run, last)

    def _load(self) -> dict[str, Drilled]:
        """The drills STATE_NAME remembers; none when it is missing, or unreadable (said: every run drilled again)."""
        try:
            with self.mirror.open_read(STATE_NAME) as f:
                return {str(run): _decode(raw) for run, raw in json.load(f)["runs"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, MirrordError, ValueError, KeyError, TypeError, AttributeError) as exc:
            path = self.mirror.describe(STATE_NAME)
            self.log.warning("drill.state_unreadable", path=path, cause=str(exc), action="each run drilled again")
            return {}

    def _save(self) -> None:
        """STATE_NAME written whole, atomically (the mirror's upload, as a copy's); a failure is said, drills go on."""
        data = json.dumps({"version": 1, "runs": {run: asdict(d) for run, d in self.last.items()}}).encode()
        try:
            upload = self.mirror.begin_upload(STATE_NAME, len(data))
            try:
                upload.write(memoryview(data))
                upload.seal(int(self.wall() * 1e9))
                upload.commit()
            except BaseException:
                upload.abort()
                raise
        except (OSError, MirrordError) as exc:
            self.log.error("drill.state_not_saved", path=self.mirror.describe(STATE_NAME), cause=str(exc))

    def _export(self, run: str, last: Drilled) -> None:
        label = self.metrics.run_label(run)
        if last.ok_at is not None:
            self.metrics.drill_last_success.labels(label).set(last.ok_at)
        if last.failed_at is not None:
            self.metrics.drill_last_failure.labels(label).set(last.failed_at)

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
            if (last := self.last.get(run)) is None or last.unit != _unit(units[0]) or now >= last.at + interval
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

    def stop(self) -> None:
        """The daemon is stopping: the drill under way ends now (its loader killed, its scratch copy removed) and
        records nothing; a restore stuck on a hung mount is not waited for (a daemon thread)."""
        self._halt.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _drill(self, config: Config, run: str, units: list[Candidate]) -> None:
        # Its reads at the copies' priority; the loader started from this thread inherits it (nice, ionice and
        # the scheduling policy are the calling thread's, and a child's start with them).
        lower_priority(config.io.ionice, config.io.cpu_nice, config.io.cpu_policy)
        started, loads, last = self.wall(), find_spec("torch") is not None, self.last.get(run)
        try:
            found = drill(self.mirror, config.rules, run, loads, units, STAGING_AREA, self._halt)
        except StoppedError:
            return
        except Exception as exc:  # nothing to restore any more, no room for the scratch folder, ...: a finding, and
            # remembered as any other (a drill that ends without a record would be started again at once)
            found = {"file": self.mirror.describe(units[0].key), "error": str(exc)}
        now, error = self.wall(), f"{found['file']}: {found['error']}" if found["error"] else None
        ok_at, failed_at = (last.ok_at, last.failed_at) if last else (None, None)
        self.last[run] = drilled = Drilled(
            _unit(units[0]), started, error, ok_at if error else now, now if error else failed_at
        )
        self._save()  # (before it is exported and logged: what a restart finds is what was said)
        self._export(run, drilled)
        if error:
            self.metrics.drill_failures.labels(self.metrics.run_label(run)).inc()
            self.log.error("drill.failed", run=run or ".", path=units[0].key, file=found["file"], error=found["error"])
        else:
            self.log.info(
                "drill.passed",
                run=run or ".",
                path=found["relative_path"],
                step=found["step"],
                loaded=found["loaded"],
                structure_only=not loads,
            )
        self.done()

    def report(self) -> dict[str, dict[str, Any]]:
        """Per run (`.`: the root), for /status: when a drill last passed, and the last drill's failure."""
        return {run or ".": {"ok_at": d.ok_at, "error": d.error} for run, d in dict(self.last).items()}
