"""`mirrord status`: the answer to "is my mirror all right?" for a person at a terminal, or as JSON.

Everything comes from what any process can read without disturbing the daemon: the manifest and a
listing of both roots (no lock is taken), plus, if a daemon answers on `metrics.address`, what its
/status says. Per run it shows the newest step on each side, whether the newest
mirrored step is intact (size by default; content hash with `--verify`, which reads the files), and
how far behind the mirror is.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mirrord import __version__
from mirrord.commands.printable import printable
from mirrord.core.contributions import Contributions
from mirrord.core.jobs import CopyJob
from mirrord.core.model import PENDING, PREVIOUS, FileState, ManifestEntry, Snapshot
from mirrord.core.reconcile import Facts, View, reconcile
from mirrord.core.units import Completeness, Unit, run_and_step
from mirrord.errors import ManifestError
from mirrord.obs.sizes import human_bytes
from mirrord.store.completeness import judge
from mirrord.store.mirror import Mirror, ReadableStore
from mirrord.store.resume import check_entry, validate_key
from mirrord.store.targets import mirror_for
from mirrord.store.volume import LocalVolume, stat_safely
from mirrord.vocabulary import CopyOutcome

if TYPE_CHECKING:
    from mirrord.config import Config, MetricsConfig

DEFAULT_TIMEOUT = 1.0
# Behind by more than this is a problem, not just lag (the MirrordMirrorLagging alert uses the same 15 min).
DEFAULT_MAX_LAG = 15 * 60.0


@dataclass
class VolumeStatus:
    """One volume as status shows it: path, space, files, problems."""

    path: str
    free_bytes: int | None = None
    total_bytes: int | None = None
    files: int = 0
    error: str | None = None


@dataclass
class UnitStatus:
    """A folder unit on the primary that the mirror does not hold (yet), as the daemon judges it now:
    `incomplete` (not copied until whole: `why` says what is missing), `pending` (whole, to be copied)
    or `retired` (whole, but retention let go of its step: never copied)."""

    unit: str
    step: int | None
    state: str  # incomplete | pending | retired
    why: str


@dataclass
class RunStatus:
    """One run (a folder of checkpoints). Steps are None when that side holds no stepped checkpoint."""

    run: str
    primary_step: int | None = None
    mirror_step: int | None = None
    verified: bool | None = None  # the newest mirrored step; None when nothing is mirrored yet
    verify_mode: str = "size"  # size | hash
    verify_detail: str = ""
    pending_files: int = 0  # committed on the primary, not (or no longer) intact on the mirror
    lag_seconds: float = 0.0  # age of the oldest pending file; 0 when caught up
    units: list[UnitStatus] = field(default_factory=list)  # folder layouts: units not mirrored, newest first


@dataclass
class DaemonStatus:
    """What the running daemon says on its endpoints (or why it could not be asked)."""

    address: str
    running: bool = False
    error: str | None = None  # why it could not be asked (not running, metrics disabled, ...)
    healthy: bool | None = None
    health: str = ""
    ready: bool | None = None
    readiness: str = ""
    version: str | None = None
    queue_depth: float | None = None
    in_flight: float | None = None
    lag_seconds: float | None = None
    invalid_sources: float | None = None
    copies: dict[str, float] = field(default_factory=dict)
    last_copy_at: float | None = None
    copying: list[dict[str, Any]] = field(default_factory=list)  # copies under way, from /status
    copy_loops: float | None = None  # files the daemon stopped re-copying (copies never stick)
    manifest_repairs: float | None = None  # on-disk manifest found damaged and rewritten
    drills: dict[str, dict[str, Any]] | None = None  # per run: {ok_at: when a drill last passed, error: the last's}


@dataclass
class Status:
    """The whole status report; `problems` make `mirrord status` exit 1."""

    checked_at: float
    primary: VolumeStatus
    mirror: VolumeStatus
    manifest_entries: int
    runs: list[RunStatus]
    lag_seconds: float
    daemon: DaemonStatus
    problems: list[str]  # something is wrong: exit status 1
    notes: list[str]  # worth knowing, not wrong

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as the --json document."""
        # "command": as every --json document says which command wrote it
        return asdict(self) | {"ok": self.ok, "version": __version__, "command": "status"}


# --- reading the daemon -------------------------------------------------------------------------------
# What the daemon's /status says, by the DaemonStatus field it fills (its counts of copies by result aside)
SAID = (
    "healthy",
    "health",
    "ready",
    "readiness",
    "version",
    "queue_depth",
    "in_flight",
    "lag_seconds",
    "invalid_sources",
    "copy_loops",
    "manifest_repairs",
    "last_copy_at",
    "drills",
)


def http_get(url: str, timeout: float) -> tuple[int, str]:
    """(status, body); status 0 when nothing answered. Whether anything listens is asked with a bare
    connect first: with no daemon (the usual case for a person at a terminal) status does not import
    urllib.request and the HTTP and TLS modules it pulls in."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=timeout):
            pass
    except (OSError, ValueError):
        return 0, ""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - http URL built from config
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError):
        return 0, ""


def endpoint_url(metrics: MetricsConfig) -> str:
    """Where to reach a daemon listening on metrics.address (a wildcard bind is reached on loopback)."""
    loopback = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}  # noqa: S104 - not a bind
    host = loopback.get(metrics.host, metrics.host)
    return f"http://[{host}]:{metrics.port}" if ":" in host else f"http://{host}:{metrics.port}"


def ask_daemon(config: Config, timeout: float, roots: tuple[str, str]) -> DaemonStatus:
    """Ask the daemon's /status (within `timeout`). `roots` (primary, mirror): the daemon that answers must
    say it mirrors these, else it is another config's daemon on the same address, and this config's daemon
    is not running."""
    status = DaemonStatus(address=config.metrics.address)
    if not config.metrics.enabled:
        status.error = "metrics.enabled = false: the daemon cannot be asked"
        return status
    code, body = http_get(endpoint_url(config.metrics) + "/status", timeout)
    if code == 0:
        status.error = f"nothing answers on {config.metrics.address} (daemon not running?)"
        return status
    document: Any = None
    with contextlib.suppress(ValueError):
        document = json.loads(body)
    if code != 200 or not isinstance(document, dict) or "mirror" not in document:
        status.error = f"{config.metrics.address} answers, but not with mirrord's /status (HTTP {code})"
        return status
    theirs = (document.get("primary"), document["mirror"])
    if theirs != roots:
        status.error = (
            f"{config.metrics.address} is the daemon of another mirror ({theirs[0]} -> {theirs[1]}), "
            f"not of {roots[1]}: this config's daemon is not running (do two configs share "
            "metrics.address?)"
        )
        return status
    status.running = True
    for name in SAID:
        setattr(status, name, document.get(name))
    status.copies, status.copying = document.get("copies_by_result", {}), document.get("copies", [])
    status.last_copy_at = status.last_copy_at or None  # 0: nothing published since it started
    return status


# --- reading the disks --------------------------------------------------------------------------------
def _volume(store: LocalVolume | Mirror, snap: Snapshot, error: str | None) -> VolumeStatus:
    """Free and total bytes stay None where the store does not know them (an object store)."""
    vol = VolumeStatus(store.describe(), files=len(snap.files), error=error)
    try:
        space = store.space()
    except OSError as exc:
        vol.error = vol.error or f"cannot stat the filesystem: {exc.strerror or exc}"
        return vol
    if space is not None:
        vol.free_bytes, vol.total_bytes = space
    return vol


def _snapshot(store: ReadableStore, config: Config) -> tuple[Snapshot | None, str | None]:
    if not store.exists():
        return None, f"{store.describe()} does not exist or is not a directory"
    snap = store.snapshot(config.patterns, config.rules)
    return snap, "; ".join(snap.errors) or None


def _disagreement(entry: ManifestEntry, state: FileState | None) -> str | None:
    if state is None:
        return "missing from the mirror"
    if state.size != entry.size:
        return f"{state.size} bytes, manifest says {entry.size}"
    return None


def _damaged(mirror: ReadableStore, manifest: Mapping[str, ManifestEntry], msnap: Snapshot) -> dict[str, str]:
    """Manifest entries whose file is missing or of another size: rel -> what is wrong.

    A running daemon publishes, records, prunes while we look; a disagreement is reported only if a
    fresh manifest and a fresh stat still show it (one copy or deletion in between is not damage).
    """
    suspects = [rel for rel, e in manifest.items() if _disagreement(e, msnap.files.get(rel)) is not None]
    if not suspects:
        return {}
    try:
        fresh = mirror.load_manifest().entries
    except ManifestError:
        fresh = manifest
    return {
        rel: problem
        for rel in suspects
        if rel in fresh and (problem := _disagreement(fresh[rel], stat_safely(mirror, rel))) is not None
    }


def _problem(entry: ManifestEntry, mirror: ReadableStore, damaged: dict[str, str], deep: bool) -> str | None:
    """What is wrong with the mirror's copy of `entry`, or None when it is intact."""
    if entry.path in damaged:
        return damaged[entry.path]
    if deep and (finding := check_entry(mirror, entry)) is not None:
        return f"{finding.problem} ({finding.detail})"
    if (
        not deep
        and entry.validation is not None
        and (state := stat_safely(mirror, entry.path))
        and entry.unchanged(state)
    ):
        return None  # the very copy that passed its validator (same inode and ctime, or the object's ETag)
    # Intact means whole, not only the recorded size: check the structure (a torn zip lacks its end
    # records; a few KB read) and, with --verify, every CRC too.
    verdict = validate_key(mirror, entry.path, quick=not deep)
    return None if verdict.passed else str(verdict)


def _check_newest(
    run: RunStatus, entries: list[ManifestEntry], mirror: ReadableStore, damaged: dict[str, str], deep: bool
) -> None:
    """Is the newest mirrored step of a run what the manifest recorded? Size from the listing; hash on demand."""
    if run.mirror_step is None:  # no stepped entry: the one mirrored last
        newest = [max(entries, key=lambda e: e.mirrored_at)]
    else:
        newest = [e for e in entries if e.step == run.mirror_step]
    run.verify_mode = "hash" if deep else "size"
    problems = ((e.path, _problem(e, mirror, damaged, deep)) for e in sorted(newest, key=lambda e: e.path))
    bad = next(((path, problem) for path, problem in problems if problem is not None), None)
    run.verified = bad is None
    run.verify_detail = ", ".join(e.path for e in newest) if bad is None else f"{bad[0]}: {bad[1]}"


def _invalid_sources(config: Config, primary: ReadableStore, view: View, now: float) -> list[str]:
    """Primary files behind, unchanged for copy.invalid_grace_seconds, that are not whole (a structural
    check: reads a few KB of each). mirrord never publishes them: someone must look."""
    settled = (
        j
        for j in sorted(view.behind, key=lambda j: j.rel)
        if j.mtime_ns / 1e9 <= now - config.copy.invalid_grace_seconds and not j.members
    )  # a folder unit: its files are validated as they are copied
    return [
        f"primary: {job.rel} is not a whole checkpoint ({verdict}); it is not mirrored"
        for job in settled
        if not (verdict := validate_key(primary, job.rel, quick=True)).passed
    ]


def _judged(
    primary: LocalVolume, config: Config, now: float, verdicts: dict[Unit, Completeness]
) -> Callable[[Unit], Completeness]:
    """The daemon's completeness rule (mirrord.store.completeness), each unit judged once and kept in
    `verdicts`. A file is settled once its mtime is copy.settle_seconds old: the daemon also waits that
    long after first seeing it unchanged, which one look cannot; a file layout is never judged."""

    def quiet(unit: Unit, guess: bool) -> bool:
        seconds = config.unit.settle_seconds if guess else config.copy.settle_seconds
        return not 0 <= now - unit.mtime_ns / 1e9 < seconds

    rule = judge(primary, config.rules, quiet)

    def complete(unit: Unit) -> Completeness:
        if unit not in verdicts:
            verdicts[unit] = rule(unit)
        return verdicts[unit]

    return complete


def _add_units(runs: list[RunStatus], view: View, verdicts: dict[Unit, Completeness]) -> None:
    """Each judged folder unit under its run: the ones the mirror lacks, with the daemon's verdict."""
    by_run = {r.run: r for r in runs}
    for unit in sorted(verdicts, key=lambda u: (u.step is None, -(u.step or 0), u.rel)):
        run = by_run.get(unit.run or ".")
        if run is None or unit.kind != "folder":
            continue
        state = (
            "incomplete"
            if not verdicts[unit].complete
            else "retired"
            if view.retired(unit.run, unit.step, unit.mtime_ns)
            else "pending"
        )
        run.units.append(UnitStatus(unit.rel, unit.step, state, verdicts[unit].why))


def collect(
    config: Config,
    deep: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    max_lag: float = DEFAULT_MAX_LAG,
) -> Status:
    """Build the status report; reads only (never takes the mirror lock, never writes).

    Lag is a problem once a run is more than `max_lag` seconds behind, and so is a primary holding
    checkpoints to copy while the mirror has no manifest and no daemon answers: nothing is vouched for,
    and nothing is about to change that."""
    checked_at = time.time()
    problems: list[str] = []
    notes: list[str] = []
    manifest: Mapping[str, ManifestEntry] = {}
    contributions: Contributions = {}  # nodes' shares of units not complete yet (s3.units_span_nodes)
    # The manifest first, then the listing: a file is published before it is recorded, so every entry
    # read here names a file the listing can see.
    primary, mirror = LocalVolume(config.primary), mirror_for(config.mirror_target, config.s3)
    if mirror.exists():
        try:
            loaded = mirror.load_manifest()
            manifest, contributions = loaded.entries, loaded.contributions
        except ManifestError as exc:
            problems.append(f"manifest: {exc.cause} ({exc.path}): nothing on the mirror can be vouched for")
    psnap, perr = _snapshot(primary, config)
    msnap, merr = _snapshot(mirror, config)
    if perr:
        problems.append(f"primary: {perr}")
    if merr and msnap is None:
        notes.append(f"mirror: {mirror.describe()} does not exist yet (`mirrord run` or `mirrord sync` creates it)")
    elif merr:
        problems.append(f"mirror: {merr}")
    # The daemon's own decision (copy, retire, refuse) on the same listings: status cannot disagree with it.
    verdicts: dict[Unit, Completeness] = {}
    view = reconcile(
        psnap or Snapshot(),
        msnap,  # None: no mirror yet (nothing listed, nothing vouched for)
        manifest,
        config,
        checked_at,
        facts=Facts(mirror_is_mount=mirror.is_mountpoint()),
        is_complete=_judged(primary, config, checked_at, verdicts),
    )
    psnap, msnap = psnap or Snapshot(), msnap or Snapshot()

    if view.refused is not None:
        problems.append(f"mirror: {mirror.describe()}: {view.refused}")
    if view.refused is not None and not msnap.files:
        damaged = {rel: "missing from the mirror" for rel in manifest}
    else:
        damaged = _damaged(mirror, manifest, msnap)
        for missing, what in ((True, "in the manifest are missing"), (False, "differ in size from the manifest")):
            if found := sorted(rel for rel, why in damaged.items() if why.startswith("missing") == missing):
                problems.append(f"mirror: {len(found)} file(s) {what}, e.g. {found[0]}")
    parts = {rel for unit in contributions.values() for part in unit.values() for rel in part.files}
    unrecorded = sorted(set(msnap.files) - set(manifest) - parts)
    if contributions:
        notes.append(
            f"mirror: {len(contributions)} unit(s) waiting for other nodes' shares, e.g. "
            f"{min(contributions)} (has {', '.join(sorted(contributions[min(contributions)]))}'s)"
        )
    if unrecorded:
        notes.append(f"mirror: {len(unrecorded)} file(s) not in the manifest (not vouched for), e.g. {unrecorded[0]}")
    if msnap.partials:
        notes.append(
            f"mirror: {len(msnap.partials)} NAME.part file(s): copies in progress, or left by an "
            "interrupted one (the next copy of that file replaces it)"
        )

    runs = _runs(config, mirror, psnap, manifest, view, damaged, checked_at, deep)
    _add_units(runs, view, verdicts)
    problems.extend(_invalid_sources(config, primary, view, checked_at))
    for name, step in sorted(view.prune.paused.items()):  # retention's own word (mirrord.core.retention)
        problems.append(
            f"run {name or '.'}: mirror retention paused: its newest verified step {step} is gone from "
            "the primary (wiped, unmounted, restored?); nothing of this run is deleted until a newer "
            f"step is verified, or `mirrord prune --forget-branch {name or '.'}:{step}`"
        )
    for name, tips in sorted(view.prune.branch_tips.items()):
        notes.append(
            f"run {name or '.'}: kept the newest step of an abandoned branch: "
            f"{', '.join(map(str, tips))} (`mirrord prune --forget-branch {name or '.'}:STEP` lets one go)"
        )
    for run in runs:
        if run.verified is False:
            problems.append(f"run {run.run}: newest mirrored step {run.mirror_step} is NOT intact: {run.verify_detail}")
        if run.lag_seconds > max_lag:
            problems.append(
                f"run {run.run}: the mirror is {human_duration(run.lag_seconds)} behind "
                f"({run.pending_files} file(s) not mirrored; more than "
                f"{human_duration(max_lag)}, see --max-lag)"
            )

    daemon = ask_daemon(config, timeout, (primary.describe(), mirror.describe()))
    pending = sum(r.pending_files for r in runs)
    if not manifest and pending and not daemon.running and not any(p.startswith("manifest:") for p in problems):
        # Nothing is vouched for and no daemon is there to change that. (A running daemon is busy with its
        # first copies: that is lag, a problem only past max_lag.)
        problems.append(
            f"mirror: no manifest in {mirror.describe()} and no daemon answers: none of the {pending} "
            "checkpoint(s) on the primary is mirrored (start `mirrord run`, or `mirrord sync` now)"
        )
    found, noted = _daemon_findings(daemon, config.metrics.enabled)
    problems.extend(found)
    notes.extend(noted)
    lag = max((r.lag_seconds for r in runs), default=0.0)
    return Status(
        checked_at,
        _volume(primary, psnap, perr),
        _volume(mirror, msnap, merr),
        len(manifest),
        runs,
        lag,
        daemon,
        problems,
        notes,
    )


def _daemon_findings(d: DaemonStatus, must_answer: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) from what the daemon said, or from its silence (a problem when metrics are
    enabled: then it should answer)."""
    if not d.running:
        return ([f"daemon: {d.error}"], []) if must_answer else ([], [f"daemon: {d.error}"])
    failed = {r: n for r, n in d.copies.items() if r != CopyOutcome.OK and n}
    attempts = ", ".join(f"{r} {n:.0f}" for r, n in sorted(failed.items()))
    problems = (  # (applies, what to say)
        (not d.healthy, f"unhealthy: {d.health}"),
        (not d.ready, f"not ready: {d.readiness}"),
        (
            d.invalid_sources,
            f"{d.invalid_sources or 0:.0f} source file(s) failed their format "
            "validator for longer than copy.invalid_grace_seconds and are not mirrored (its log: copy.invalid_source)",
        ),
        (
            d.copy_loops,
            f"{d.copy_loops or 0:.0f} file(s) copied again and again with the same "
            "result, no longer copied (the mirror does not keep what is written; see copy.loop in its log)",
        ),
    )
    problems += tuple((said["error"], f"drill {run} FAILED: {said['error']}") for run, said in _drills(d))
    notes = (
        (
            d.manifest_repairs,
            f"the on-disk manifest was found damaged and rewritten "
            f"{d.manifest_repairs or 0:.0f} time(s) (see manifest.repaired in its log)",
        ),
        (failed, f"failed copy attempts since it started: {attempts} (see its log: copy.failed)"),
    )
    return (
        [f"daemon: {text}" for applies, text in problems if applies],
        [f"daemon: {text}" for applies, text in notes if applies],
    )


def _runs(
    config: Config,
    mirror: ReadableStore,
    psnap: Snapshot,
    manifest: Mapping[str, ManifestEntry],
    view: View,
    damaged: dict[str, str],
    now: float,
    deep: bool,
) -> list[RunStatus]:
    primary_steps: dict[str, list[int | None]] = defaultdict(list)
    entries_by_run: dict[str, list[ManifestEntry]] = defaultdict(list)
    behind_by_run: dict[str, list[CopyJob]] = defaultdict(list)
    for rel in psnap.files:
        name, step = run_and_step(rel, config.rules, config.step_regex)
        primary_steps[name].append(step)
    for entry in manifest.values():  # the run the record names (records from before it said: the config's)
        if entry.role in (PENDING, PREVIOUS):
            continue  # a version kept beside a copy: no checkpoint of a run
        entries_by_run[
            entry.run if entry.layout else run_and_step(entry.path, config.rules, config.step_regex)[0]
        ].append(entry)
    for job in view.behind:  # not (intactly) mirrored, and not retired by retention
        behind_by_run[job.run].append(job)
    runs = []
    for name in sorted(set(primary_steps) | set(entries_by_run)):
        run = RunStatus(name or ".")
        run.primary_step = max((s for s in primary_steps[name] if s is not None), default=None)
        entries = entries_by_run[name]
        run.mirror_step = max((e.step for e in entries if e.step is not None), default=None)
        if entries:
            _check_newest(run, entries, mirror, damaged, deep)
        pending = behind_by_run[name]
        run.pending_files = len(pending)
        run.lag_seconds = now - min((job.waiting_since(now) for job in pending), default=now)
        runs.append(run)
    return runs


# --- rendering ---------------------------------------------------------------------------------------
def _bytes(n: float | None) -> str:
    return "?" if n is None else human_bytes(n)


def human_duration(seconds: float) -> str:
    """`seconds` for a person (45s, 3m 12s, 2h 05m, 3d 4h)."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {s:02d}s"
    hours, m = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {m:02d}m"
    return f"{hours // 24}d {hours % 24}h"


def _space(vol: VolumeStatus) -> str:
    if vol.free_bytes is None:  # an object store has no such number; a local volume that failed says why
        return f"free space unavailable ({vol.error})" if vol.error else "free space not reported (object store)"
    text = f"{_bytes(vol.free_bytes)} free of {_bytes(vol.total_bytes)}"
    return text + (f"  ({vol.error})" if vol.error else "")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render(status: Status) -> str:
    """The report for a person."""
    when = datetime.fromtimestamp(status.checked_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"mirrord {__version__} status at {when}",
        "",
        f"primary  {status.primary.path}",
        f"         {status.primary.files} checkpoint file(s); {_space(status.primary)}",
        f"mirror   {status.mirror.path}",
        f"         {status.mirror.files} checkpoint file(s), {status.manifest_entries} in the manifest; "
        f"{_space(status.mirror)}",
        "",
    ]
    rows = [["RUN", "NEWEST STEP (PRIMARY)", "NEWEST STEP (MIRROR)", "MIRROR'S NEWEST STEP", "BEHIND"]]
    for run in status.runs:
        verified = (
            "-"
            if run.verified is None
            else f"intact ({run.verify_mode} checked)"
            if run.verified
            else f"NOT INTACT ({run.verify_mode})"
        )
        behind = (
            f"{run.pending_files} file(s), oldest {human_duration(run.lag_seconds)}"
            if run.pending_files
            else "caught up"
        )
        rows.append([printable(run.run), _step(run.primary_step), _step(run.mirror_step), verified, behind])
    lines += _table(rows) if status.runs else ["  no checkpoints on either side yet"]
    if any(r.verify_mode == "size" and r.verified for r in status.runs):
        lines.append("  (sizes checked against the manifest; add --verify to check content hashes)")
    if units := [u for r in status.runs for u in r.units]:
        lines += ["", "units on the primary not on the mirror:"]
        lines += _table(
            [[printable(u.unit), u.state.upper() if u.state == "incomplete" else u.state, u.why] for u in units]
        )
    lines += [
        "",
        *_render_daemon(status.daemon, status.checked_at),
        "",
        "problems:" if status.problems else "problems: none",
        *(f"  ! {p}" for p in status.problems),
    ]
    if status.notes:
        lines += ["notes:", *(f"  - {n}" for n in status.notes)]
    return "\n".join(map(printable, lines))  # run and file names are anyone's: never raw on a terminal


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _render_daemon(d: DaemonStatus, now: float) -> list[str]:
    if not d.running:
        return [f"daemon   not reachable: {d.error}"]
    health = "healthy" if d.healthy else f"UNHEALTHY ({d.health})"
    ready = "ready" if d.ready else f"NOT READY ({d.readiness})"
    lines = [f"daemon   mirrord {d.version or '?'} on {d.address}: {health}, {ready}"]
    copies = ", ".join(f"{d.copies.get(r, 0):.0f} {r}" for r in CopyOutcome if d.copies.get(r) or r == CopyOutcome.OK)
    queue = f"queue {d.queue_depth or 0:.0f}, copying {d.in_flight or 0:.0f}"
    lag = f"lag {human_duration(d.lag_seconds or 0)}"
    lines.append(f"         {queue}, {lag}; copies since start: {copies}")
    if d.last_copy_at:
        lines.append(f"         last copy published {human_duration(now - d.last_copy_at)} ago")
    for run, said in _drills(d):
        done = f"FAILED {said['error']}" if said["error"] else f"ok {human_duration(now - said['ok_at'])} ago"
        lines.append(f"         drill {run}: {done}")
    return lines + [f"         copying {_progress_line(c)}" for c in d.copying]


def _drills(d: DaemonStatus) -> list[tuple[str, dict[str, Any]]]:
    """(run, what the daemon said of its drills) by run."""
    return sorted((d.drills or {}).items())


def _progress_line(c: dict[str, Any]) -> str:
    """`run/step_9.pt  1.2 GiB of 4.0 GiB (30%), 85.0 MiB/s, ETA 34s` from one /status copy."""
    size, done = c.get("size") or 0, c.get("bytes_done") or 0
    percent = f"{100 * done / size:.0f}%" if size else "?"
    rate, eta = c.get("rate_bytes_per_second") or 0, c.get("eta_seconds")
    return (
        f"{c.get('path')}  {_bytes(done)} of {_bytes(size)} ({percent}), {_bytes(rate)}/s, "
        f"ETA {'?' if eta is None else human_duration(eta)}"
    )
