"""`mirrord status`: the answer to "is my mirror all right?" for a person at a terminal, or as JSON.

Everything comes from what any process can read without disturbing the daemon: the manifest and a
listing of both roots (no lock is taken), plus, if a daemon answers on `metrics.address`, its
/metrics, /healthz and /readyz. Per run it shows the newest step on each side, whether the newest
mirrored step is intact (size by default; content hash with `--verify`, which reads the files), and
how far behind the mirror is.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mirrord import __version__
from mirrord.config import Config
from mirrord.errors import ManifestError
from mirrord.manifest import Manifest
from mirrord.metrics import COPY_RESULTS
from mirrord.model import FileState, ManifestEntry, Snapshot, step_of
from mirrord.paths import open_file_beneath
from mirrord.plan import why_copy
from mirrord.scan import snapshot_tree
from mirrord.validators import Verdict, validate_fd
from mirrord.verify import check_entry
from mirrord.volume import LocalVolume

DEFAULT_TIMEOUT = 1.0
# Behind by more than this is a problem, not just lag (the MirrordMirrorLagging alert uses the same 15 min).
DEFAULT_MAX_LAG = 15 * 60.0


@dataclass
class VolumeStatus:
    path: str
    free_bytes: int | None = None
    total_bytes: int | None = None
    files: int = 0
    error: str | None = None


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


@dataclass
class DaemonStatus:
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


@dataclass
class Status:
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
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["version"] = __version__
        data["command"] = "status"  # as every --json document says which command wrote it
        return data


# --- reading the daemon -------------------------------------------------------------------------------
Fetch = Callable[[str, float], tuple[int, str]]


def http_get(url: str, timeout: float) -> tuple[int, str]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - http URL built from config
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError):
        return 0, ""


def endpoint_url(address: str) -> str:
    """Where to reach a daemon listening on `address` (a wildcard bind is reached on loopback)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - not a bind
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ask_daemon(config: Config, timeout: float = DEFAULT_TIMEOUT, fetch: Fetch = http_get) -> DaemonStatus:
    status = DaemonStatus(address=config.metrics.address)
    if not config.metrics.enabled:
        status.error = "metrics.enabled = false: the daemon cannot be asked"
        return status
    base = endpoint_url(config.metrics.address)
    code, body = fetch(base + "/metrics", timeout)
    if code == 0:
        status.error = f"nothing answers on {config.metrics.address} (daemon not running?)"
        return status
    samples = _samples(body) if code == 200 else {}
    if not any(name == "mirrord_build_info" for name, _ in samples):
        status.error = f"{config.metrics.address} answers, but not with mirrord's metrics (HTTP {code})"
        return status
    status.running = True
    for (name, labels), value in samples.items():
        if name == "mirrord_build_info" and value == 1:
            status.version = dict(labels).get("version")
        elif name == "mirrord_copies_total":
            status.copies[dict(labels).get("result", "")] = value
    status.queue_depth = samples.get(("mirrord_queue_depth", ()))
    status.in_flight = samples.get(("mirrord_copies_in_flight", ()))
    status.lag_seconds = samples.get(("mirrord_mirror_lag_seconds", ()))
    status.invalid_sources = samples.get(("mirrord_invalid_sources", ()))
    status.copy_loops = samples.get(("mirrord_copy_loop_files", ()))
    status.manifest_repairs = samples.get(("mirrord_manifest_repairs_total", ()))
    last = samples.get(("mirrord_last_mirrored_timestamp_seconds", ()))
    status.last_copy_at = last or None
    code, body = fetch(base + "/healthz", timeout)
    status.healthy, status.health = code == 200, body.strip() or f"HTTP {code}"
    code, body = fetch(base + "/readyz", timeout)
    status.ready, status.readiness = code == 200, body.strip() or f"HTTP {code}"
    code, body = fetch(base + "/status", timeout) if status.in_flight else (0, "")
    if code == 200:  # an older daemon has no /status: then there is just no per-file progress
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            status.copying = list(json.loads(body).get("copies", []))
    return status


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
    except ValueError:
        return {}


# --- reading the disks --------------------------------------------------------------------------------
def _volume(path: Path, snap: Snapshot | None, error: str | None) -> VolumeStatus:
    vol = VolumeStatus(str(path), files=len(snap.files) if snap else 0, error=error)
    try:
        vol.free_bytes, vol.total_bytes = LocalVolume(path).space()
    except OSError as exc:
        vol.error = vol.error or f"cannot stat the filesystem: {exc.strerror or exc}"
    return vol


def _snapshot(root: Path, config: Config) -> tuple[Snapshot | None, str | None]:
    if not root.is_dir():
        return None, f"{root} does not exist or is not a directory"
    snap = snapshot_tree(root, config.patterns, collect_partials=True)
    return snap, "; ".join(snap.errors) or None


def _retired(config: Config, psnap: Snapshot, msnap: Snapshot, manifest: dict[str, ManifestEntry],
             now: float) -> Callable[[str, int | None, int | None], bool]:
    """Steps retention has let go of: not mirrored on purpose, so not lag."""
    if not config.prune.enabled:
        return lambda run, step, mtime_ns=None: False
    from mirrord.retention import plan_prune

    plan = plan_prune(psnap, msnap, manifest, frozenset(), now, config.prune, config.step_regex)
    return lambda run, step, mtime_ns=None: plan.retired(run, step, mtime_ns)


def _disagreement(entry: ManifestEntry, state: FileState | None) -> str | None:
    if state is None:
        return "missing from the mirror"
    if state.size != entry.size:
        return f"{state.size} bytes, manifest says {entry.size}"
    return None


def _damaged(mirror_root: Path, manifest: dict[str, ManifestEntry], msnap: Snapshot) -> dict[str, str]:
    """Manifest entries whose file is missing or of another size: rel -> what is wrong.

    A running daemon publishes, records, prunes while we look; a disagreement is reported only if a
    fresh manifest and a fresh stat still show it (one copy or deletion in between is not damage).
    """
    suspects = [rel for rel, e in manifest.items() if _disagreement(e, msnap.files.get(rel)) is not None]
    if not suspects:
        return {}
    try:
        fresh = Manifest.load(mirror_root).entries
    except ManifestError:
        fresh = manifest
    volume = LocalVolume(mirror_root)
    damaged = {}
    for rel in suspects:
        entry = fresh.get(rel)
        if entry is None:
            continue
        try:
            state = volume.stat(rel)
        except (OSError, ValueError):
            state = None
        problem = _disagreement(entry, state)
        if problem is not None:
            damaged[rel] = problem
    return damaged


def _check_newest(run: RunStatus, entries: list[ManifestEntry], mirror_root: Path,
                  damaged: dict[str, str], deep: bool) -> None:
    """Is the newest mirrored step of a run what the manifest recorded? Size from the listing; hash on demand."""
    stepped = [e for e in entries if e.step is not None]
    if stepped:
        newest = [e for e in stepped if e.step == run.mirror_step]
    else:
        newest = [max(entries, key=lambda e: e.mirrored_at)]
    run.verify_mode = "hash" if deep else "size"
    for entry in sorted(newest, key=lambda e: e.path):
        if entry.path in damaged:
            run.verified, run.verify_detail = False, f"{entry.path}: {damaged[entry.path]}"
            return
        if deep:
            finding = check_entry(mirror_root, entry)
            if finding is not None:
                run.verified, run.verify_detail = False, f"{entry.path}: {finding.problem} ({finding.detail})"
                return
        # Intact means whole, not only the recorded size: check the structure (a torn zip lacks its end
        # records; a few KB read) and, with --verify, every CRC too.
        verdict = _validate(mirror_root, entry.path, quick=not deep)
        if not verdict.passed:
            run.verified, run.verify_detail = False, f"{entry.path}: {verdict}"
            return
    run.verified = True
    run.verify_detail = ", ".join(e.path for e in newest)


def _validate(root: Path, rel: str, quick: bool) -> Verdict:
    try:
        fd = open_file_beneath(root, rel)
    except OSError as exc:
        return Verdict("unreadable", exc.strerror or str(exc))
    try:
        return validate_fd(fd, rel, quick=quick)
    finally:
        os.close(fd)


def _invalid_sources(config: Config, psnap: Snapshot, manifest: dict[str, ManifestEntry], msnap: Snapshot,
                     now: float, retired: Callable[[str, int | None, int | None], bool]) -> list[str]:
    """Primary files not mirrored, unchanged for copy.invalid_grace_seconds, that are not whole (a
    structural check: reads a few KB of each). mirrord never publishes them: someone must look."""
    problems = []
    grace = config.copy.invalid_grace_seconds
    for rel, src in sorted(psnap.files.items()):
        if why_copy(src, manifest.get(rel), msnap.files.get(rel)) is None or src.mtime_ns / 1e9 > now - grace:
            continue
        if retired(src.run, step_of(rel, config.step_regex), src.mtime_ns):
            continue
        verdict = _validate(config.primary, rel, quick=True)
        if not verdict.passed:
            problems.append(f"primary: {rel} is not a whole checkpoint ({verdict}); it is not mirrored")
    return problems


def collect(
    config: Config,
    deep: bool = False,
    now: Callable[[], float] = time.time,
    timeout: float = DEFAULT_TIMEOUT,
    fetch: Fetch = http_get,
    max_lag: float = DEFAULT_MAX_LAG,
) -> Status:
    """Build the status report; reads only (never takes the mirror lock, never writes).

    Lag is a problem once a run is more than `max_lag` seconds behind, and so is a primary holding
    checkpoints to copy while the mirror has no manifest and no daemon answers: nothing is vouched for,
    and nothing is about to change that."""
    checked_at = now()
    problems: list[str] = []
    notes: list[str] = []
    manifest: dict[str, ManifestEntry] = {}
    # The manifest first, then the listing: a file is published before it is recorded, so every entry
    # read here names a file the listing can see.
    if config.mirror.is_dir():
        try:
            manifest = Manifest.load(config.mirror).entries
        except ManifestError as exc:
            problems.append(f"manifest: {exc.cause} ({exc.path}): nothing on the mirror can be vouched for")
    psnap, perr = _snapshot(config.primary, config)
    msnap, merr = _snapshot(config.mirror, config)
    if perr:
        problems.append(f"primary: {perr}")
    if merr and not config.mirror.exists():
        notes.append(f"mirror: {config.mirror} does not exist yet (`mirrord run` or `mirrord sync` creates it)")
    elif merr:
        problems.append(f"mirror: {merr}")
    psnap, msnap = psnap or Snapshot(), msnap or Snapshot()

    damaged: dict[str, str] = {}
    if manifest and not msnap.files and not merr:
        problems.append(f"mirror: {config.mirror} is empty but its manifest lists {len(manifest)} file(s): "
                        "is the mirror volume mounted?")
        damaged = {rel: "missing from the mirror" for rel in manifest}
    else:
        damaged = _damaged(config.mirror, manifest, msnap)
        missing = sorted(rel for rel, why in damaged.items() if why.startswith("missing"))
        wrong = sorted(rel for rel, why in damaged.items() if not why.startswith("missing"))
        if missing:
            problems.append(f"mirror: {len(missing)} file(s) in the manifest are missing, e.g. {missing[0]}")
        if wrong:
            problems.append(f"mirror: {len(wrong)} file(s) differ in size from the manifest, e.g. {wrong[0]}")
    unrecorded = sorted(set(msnap.files) - set(manifest))
    if unrecorded:
        notes.append(f"mirror: {len(unrecorded)} file(s) not in the manifest (not vouched for), "
                     f"e.g. {unrecorded[0]}")
    if msnap.partials:
        notes.append(f"mirror: {len(msnap.partials)} NAME.part file(s): copies in progress, or left by an "
                     "interrupted one (the next copy of that file replaces it)")

    runs = _runs(config, psnap, msnap, manifest, damaged, checked_at, deep)
    problems.extend(_invalid_sources(config, psnap, manifest, msnap, checked_at,
                                     _retired(config, psnap, msnap, manifest, checked_at)))
    for run in runs:
        if run.verified is False:
            problems.append(f"run {run.run}: newest mirrored step {run.mirror_step} is NOT intact: "
                            f"{run.verify_detail}")
        if run.lag_seconds > max_lag:
            problems.append(f"run {run.run}: the mirror is {human_duration(run.lag_seconds)} behind "
                            f"({run.pending_files} file(s) not mirrored; more than "
                            f"{human_duration(max_lag)}, see --max-lag)")

    daemon = ask_daemon(config, timeout, fetch)
    pending = sum(r.pending_files for r in runs)
    if not manifest and pending and not daemon.running and not any(p.startswith("manifest:") for p in problems):
        # Nothing is vouched for and no daemon is there to change that. (A running daemon is busy with its
        # first copies: that is lag, a problem only past max_lag.)
        problems.append(f"mirror: no manifest in {config.mirror} and no daemon answers: none of the {pending} "
                        "checkpoint(s) on the primary is mirrored (start `mirrord run`, or `mirrord sync` now)")
    if not daemon.running and config.metrics.enabled:
        problems.append(f"daemon: {daemon.error}")
    elif not daemon.running:
        notes.append(f"daemon: {daemon.error}")
    if daemon.invalid_sources:
        problems.append(f"daemon: {daemon.invalid_sources:.0f} source file(s) failed their format validator for "
                        "longer than copy.invalid_grace_seconds and are not mirrored (its log: copy.invalid_source)")
    if daemon.running:
        if not daemon.healthy:
            problems.append(f"daemon: unhealthy: {daemon.health}")
        if not daemon.ready:
            problems.append(f"daemon: not ready: {daemon.readiness}")
        if daemon.copy_loops:
            problems.append(f"daemon: {daemon.copy_loops:.0f} file(s) copied again and again with the same result, "
                            "no longer copied (the mirror does not keep what is written; see copy.loop in its log)")
        if daemon.manifest_repairs:
            notes.append(f"daemon: the on-disk manifest was found damaged and rewritten "
                         f"{daemon.manifest_repairs:.0f} time(s) (see manifest.repaired in its log)")
        failed = {r: n for r, n in daemon.copies.items() if r != "ok" and n}
        if failed:
            detail = ", ".join(f"{r} {n:.0f}" for r, n in sorted(failed.items()))
            notes.append(f"daemon: failed copy attempts since it started: {detail} (see its log: copy.failed)")
    lag = max((r.lag_seconds for r in runs), default=0.0)
    return Status(checked_at, _volume(config.primary, psnap, perr), _volume(config.mirror, msnap, merr),
                  len(manifest), runs, lag, daemon, problems, notes)


def _runs(config: Config, psnap: Snapshot, msnap: Snapshot, manifest: dict[str, ManifestEntry],
          damaged: dict[str, str], now: float, deep: bool) -> list[RunStatus]:
    regex = config.step_regex
    retired = _retired(config, psnap, msnap, manifest, now)
    primary_by_run: dict[str, list[FileState]] = defaultdict(list)
    entries_by_run: dict[str, list[ManifestEntry]] = defaultdict(list)
    for state in psnap.files.values():
        primary_by_run[state.run].append(state)
    for entry in manifest.values():
        entries_by_run[entry.run].append(entry)
    runs = []
    for name in sorted(set(primary_by_run) | set(entries_by_run)):
        run = RunStatus(name or ".")
        steps = [s for s in (step_of(f.rel, regex) for f in primary_by_run[name]) if s is not None]
        run.primary_step = max(steps, default=None)
        entries = entries_by_run[name]
        run.mirror_step = max((e.step for e in entries if e.step is not None), default=None)
        if entries:
            _check_newest(run, entries, config.mirror, damaged, deep)
        pending = [
            f for f in primary_by_run[name]
            if why_copy(f, manifest.get(f.rel), msnap.files.get(f.rel)) is not None
            and not retired(name, step_of(f.rel, regex), f.mtime_ns)
        ]
        run.pending_files = len(pending)
        if pending:
            oldest = min(f.mtime_ns for f in pending) / 1e9
            run.lag_seconds = max(0.0, now - oldest) if oldest > 0 else 0.0
        runs.append(run)
    return runs


# --- rendering ---------------------------------------------------------------------------------------
def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def human_duration(seconds: float) -> str:
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
    if vol.free_bytes is None:
        return f"unavailable ({vol.error})"
    text = f"{human_bytes(vol.free_bytes)} free of {human_bytes(vol.total_bytes)}"
    return text + (f"  ({vol.error})" if vol.error else "")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render(status: Status) -> str:
    """The report for a person."""
    when = datetime.fromtimestamp(status.checked_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"mirrord {__version__} status at {when}", ""]
    lines.append(f"primary  {status.primary.path}")
    lines.append(f"         {status.primary.files} checkpoint file(s); {_space(status.primary)}")
    lines.append(f"mirror   {status.mirror.path}")
    lines.append(f"         {status.mirror.files} checkpoint file(s), {status.manifest_entries} in the manifest; "
                 f"{_space(status.mirror)}")
    lines.append("")
    if status.runs:
        rows = [["RUN", "NEWEST STEP (PRIMARY)", "NEWEST STEP (MIRROR)", "MIRROR'S NEWEST STEP", "BEHIND"]]
        for run in status.runs:
            if run.verified is None:
                verified = "-"
            elif run.verified:
                verified = f"intact ({run.verify_mode} checked)"
            else:
                verified = f"NOT INTACT ({run.verify_mode})"
            behind = "caught up" if not run.pending_files else (
                f"{run.pending_files} file(s), oldest {human_duration(run.lag_seconds)}"
            )
            rows.append([run.run, _step(run.primary_step), _step(run.mirror_step), verified, behind])
        lines.extend(_table(rows))
        if any(r.verify_mode == "size" and r.verified for r in status.runs):
            lines.append("  (sizes checked against the manifest; add --verify to check content hashes)")
    else:
        lines.append("  no checkpoints on either side yet")
    lines.append("")
    lines.extend(_render_daemon(status.daemon, status.checked_at))
    lines.append("")
    if status.problems:
        lines.append("problems:")
        lines.extend(f"  ! {p}" for p in status.problems)
    else:
        lines.append("problems: none")
    if status.notes:
        lines.append("notes:")
        lines.extend(f"  - {n}" for n in status.notes)
    return "\n".join(lines)


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _render_daemon(d: DaemonStatus, now: float) -> list[str]:
    if not d.running:
        return [f"daemon   not reachable: {d.error}"]
    health = "healthy" if d.healthy else f"UNHEALTHY ({d.health})"
    ready = "ready" if d.ready else f"NOT READY ({d.readiness})"
    lines = [f"daemon   mirrord {d.version or '?'} on {d.address}: {health}, {ready}"]
    copies = ", ".join(f"{d.copies.get(r, 0):.0f} {r}" for r in COPY_RESULTS if d.copies.get(r) or r == "ok")
    queue = f"queue {d.queue_depth or 0:.0f}, copying {d.in_flight or 0:.0f}"
    lag = f"lag {human_duration(d.lag_seconds or 0)}"
    lines.append(f"         {queue}, {lag}; copies since start: {copies}")
    if d.last_copy_at:
        lines.append(f"         last copy published {human_duration(now - d.last_copy_at)} ago")
    for c in d.copying:
        lines.append(f"         copying {_progress_line(c)}")
    return lines


def _progress_line(c: dict[str, Any]) -> str:
    """`run/step_9.pt  1.2 GiB of 4.0 GiB (30%), 85.0 MiB/s, ETA 34s` from one /status copy."""
    size, done = c.get("size") or 0, c.get("bytes_done") or 0
    percent = f"{100 * done / size:.0f}%" if size else "?"
    rate, eta = c.get("rate_bytes_per_second") or 0, c.get("eta_seconds")
    return (f"{c.get('path')}  {human_bytes(done)} of {human_bytes(size)} ({percent}), {human_bytes(rate)}/s, "
            f"ETA {'?' if eta is None else human_duration(eta)}")
