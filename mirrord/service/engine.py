"""Executes copy jobs, one attempt each: copier, manifest record, log events and metrics. Retrying a
failed attempt is the caller's (the worker pool's retry policy, or `sync`'s next pass)."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mirrord.core.contributions import Contribution
from mirrord.core.jobs import CopyJob, CopyResult
from mirrord.core.model import PENDING, PREVIOUS, FileState, ManifestEntry, entry_whole, version_key, versioned
from mirrord.core.nodes import foreign
from mirrord.core.plan import REPLACED
from mirrord.core.units import MAX_READ_BYTES, recorded_as
from mirrord.errors import (
    CancelledError,
    InvalidSourceError,
    MirrordError,
    NodeConflictError,
    NoSpaceError,
    PermanentError,
    SourceChangedError,
    SourceGoneError,
    StalledError,
    from_oserror,
)
from mirrord.formats.dcpmeta import METADATA_NAME, MetadataError, storage_references
from mirrord.formats.verdicts import OK, RENAMED, UNCHECKED
from mirrord.obs.log import get_logger
from mirrord.paths import open_file_beneath
from mirrord.service.copier import CopyControl, CopyOptions, copy_file, hash_source
from mirrord.service.progress import ProgressBoard
from mirrord.service.unitcopy import copy_part, copy_unit
from mirrord.store.atomic import DirSyncs
from mirrord.store.manifest import Manifest, upgrade
from mirrord.store.mirror import Beside, Mirror, UploadTarget
from mirrord.store.volume import stat_safely

if TYPE_CHECKING:
    from mirrord.config import Config
    from mirrord.obs.metrics import Metrics

TAG_READ_BYTES = 4096  # a tag file holds one folder name
MakeRoom = Callable[[int], None] | None  # retention's make_room (None: retention is off)


def copy_options(config: Config) -> CopyOptions:
    """The copier's options as the config sets them."""
    return CopyOptions(
        algo=config.copy.hash,
        buffer_bytes=config.io.buffer_bytes,
        reserve_bytes=config.copy.free_space_reserve_bytes,
        bandwidth_limit=config.io.bandwidth_limit,
        drop_cache=config.io.drop_cache,
    )


class Engine:
    """The copy side of mirrord, shared by `sync` and the daemon's workers."""

    def __init__(
        self,
        config: Config,
        mirror: Mirror,
        manifest: Manifest,
        metrics: Metrics | None = None,
        wall: Callable[[], float] = time.time,
        make_room: MakeRoom = None,
        board: ProgressBoard | None = None,
    ) -> None:
        self.config = config
        self.primary_root = Path(config.primary)
        self.mirror = mirror
        mirror.keep_modes_of(config.primary)
        self.manifest = manifest
        upgraded = upgrade(manifest, config.rules)  # a record written before it said what each file is
        if upgraded:
            get_logger().info("manifest.upgraded", entries=upgraded, layout=config.rules.name)
        # None: nobody scrapes them (a one-shot `sync`), and prometheus_client is not even imported.
        self.metrics = metrics
        self.wall = wall
        self.make_room = make_room
        self.board = board or ProgressBoard()
        if metrics is not None:
            metrics.copy_bytes_in_flight.set_function(self.board.bytes_in_flight)
        self.options = copy_options(config)
        self.log = get_logger()
        self._last_steps: dict[str, int] = {}
        self._space_lock = threading.Lock()
        self._reserved = 0  # bytes promised to copies in flight: they all passed the free-space check
        self._pending = {rel for rel, e in manifest.entries.items() if e.role == PENDING}  # versions to promote

    def reconfigure(self, config: Config, make_room: MakeRoom) -> None:
        """Use a reloaded config and retention's make_room for the next copies: a copy takes both at its
        start, together under the lock, and keeps them to its end (copies in flight keep theirs)."""
        self.mirror.keep_modes_of(config.primary)
        with self._space_lock:
            self.config, self.options, self.make_room = config, copy_options(config), make_room

    def stage(self, job: CopyJob, control: CopyControl | None = None) -> StagedCopy | CopyResult:
        """Copy the job and publish it under its final name, leaving its directory fsync and its manifest
        record to commit() (which may take several staged copies at once). An alias published from its
        mirrored twin, and a node's part of a shared unit, are recorded at once: their CopyResult is
        returned, done. Raises MirrordError."""
        control = control or CopyControl()
        if job.why == REPLACED and (same := self._same_bytes(job, control)) is not None:
            return same  # (no copy started: the bytes are read, none written)
        self.log.info("copy.started", why=job.why, **_fields(job))
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        with self._space_lock:
            # Concurrent copies each need their full size: count the others' as reserved space.
            options = replace(self.options, reserve_bytes=self.options.reserve_bytes + self._reserved)
            make_room = self.make_room
            self._reserved += job.size
        try:
            if job.twins and (aliased := self._publish_twin(job, options, control)) is not None:
                return aliased
            if not job.part and (same := self._recorded_by_another_node(job, options, control)) is not None:
                return same
            with self.board.track(job, control):
                if job.part:
                    return self._contribute(job, options, control)
                if job.members:
                    return self._stage_unit(job, options, control, make_room)
                return self._stage_file(job, options, control, make_room)
        except MirrordError as exc:
            # A stall is counted once, by the supervisor that detected it; an invalid source by the
            # daemon, once it stayed invalid for copy.invalid_grace_seconds (a torn file is usually
            # still being written).
            if not isinstance(exc, CancelledError | StalledError | InvalidSourceError):
                self.count(exc.reason)
            raise
        finally:
            if self.metrics is not None:
                self.metrics.in_flight.dec()
            with self._space_lock:
                self._reserved -= job.size

    def _stage_file(self, job: CopyJob, options: CopyOptions, control: CopyControl, make_room: MakeRoom) -> StagedCopy:
        """One file copied and published; its directory fsync (and maybe its rename) left to commit(). Other
        bytes under the name of a copy recorded whole, from a source its writer did not rename into place
        (it may be torn), are a version: published beside that copy, never over it (commit() promotes it)."""
        old = self.manifest.get(job.rel)
        whole = old is not None and not old.role and entry_whole(old)  # (an alias, a tag: no checkpoint)
        target = Beside(self.mirror) if whole and not job.committed else None
        dirs = DirSyncs()
        try:
            result = self._copy(job, options, control, dirs, make_room, target or self.mirror)
        except BaseException:
            dirs.close()
            raise
        if target:
            result = replace(result, rel=version_key(job.rel))
            if result.validation != OK and not _same_digest(old, result):  # (else it takes the name at its commit)
                self._pending.add(result.rel)
                self.log.warning("copy.kept_beside", path=job.rel, version=result.rel, validation=result.validation)
        # A file whose rename is left to commit() is not published yet: its identity is taken there.
        entry = self._entry(job, result, self.manifest.next_seq(), identity=not dirs.renames_pending())
        return StagedCopy(job, result, [replace(entry, role=PENDING) if target else entry], dirs)

    def _stage_unit(self, job: CopyJob, options: CopyOptions, control: CopyControl, make_room: MakeRoom) -> StagedCopy:
        """A folder unit copied and published whole; its record left to commit()."""
        results = self._copy_unit(job, options, control, make_room)
        seq = self.manifest.next_seq()
        return StagedCopy(job, _unit_result(job, results), [self._entry(job, r, seq) for r in results], DirSyncs())

    def _entry(self, job: CopyJob, result: CopyResult, seq: int, identity: bool = True) -> ManifestEntry:
        """The manifest entry of one copy; with the published copy's identity (`identity`) once its name is.
        The same bytes copied again keep their place and time of recording (seq, mirrored_at) when they are the
        same file (a `touch`) or carry the recorded mtime (a restore); the same bytes saved again (a new file, a
        new mtime: a deterministic trainer's rollback) are a new save."""
        old = self.manifest.get(
            job.rel if result.rel == version_key(job.rel) else result.rel
        )  # (a version: its name's)
        recorded_at = self.wall()
        if (
            old is not None
            and old.seq
            and _same_digest(old, result)
            and ((old.source_dev, old.source_ino) == result.source[:2] or old.source_mtime_ns == result.source_mtime_ns)
        ):
            seq, job, recorded_at = old.seq, replace(job, seen=old.seen), old.mirrored_at
        entry = ManifestEntry(
            path=result.rel,
            size=result.size,
            algo=result.algo,
            digest=result.digest,
            source_mtime_ns=result.source_mtime_ns,
            step=job.step,
            mirrored_at=recorded_at,
            mirror_mtime_ns=result.mirror_mtime_ns,
            validation=RENAMED if job.committed and result.validation == UNCHECKED else result.validation,
            node=self.mirror.node,
            seq=seq,
            seen=job.seen,
            source_dev=result.source[0],
            source_ino=result.source[1],
            source_ctime_ns=result.source[2],
            **recorded_as(result.rel, self.config.rules, len(job.members) or 1),
        )
        return self._identified(entry) if identity else entry

    def _contribute(self, job: CopyJob, options: CopyOptions, control: CopyControl) -> CopyResult:
        """This node's part of a folder unit written by several nodes (s3.units_span_nodes): its files
        uploaded, then recorded as its contribution; the write that makes the unit whole records every
        file of it (`copy.committed`), else the unit waits for the other nodes (`copy.part_recorded`)."""
        from mirrord.store.s3 import node_name  # only an object-store mirror gets here

        results = copy_part(self.primary_root, job, self.mirror, options, control)
        seq = self.manifest.next_seq()
        entries = {result.rel: self._entry(job, result, seq) for result in results}
        node = node_name(self.config.s3.node)
        part = Contribution(node, entries, self._listed_by_metadata(job), self.wall())
        merged = self.manifest.contribute(job.rel, part)
        verdict = merged.verdict
        result = _unit_result(job, results)
        staged = StagedCopy(job, result, list(entries.values()), DirSyncs())
        if verdict.complete:
            if merged.puts:  # this write made it whole (else another node's had, with these very bytes)
                self.log.info(
                    "unit.completed",
                    path=job.rel,
                    run=job.run or ".",
                    step=job.step,
                    node=node,
                    files=len(merged.puts),
                    why=verdict.why,
                )
            return self._committed(staged)
        self.count("ok")
        if self.metrics is not None:
            self.metrics.copied_bytes.inc(result.size)
        self.log.info("copy.part_recorded", node=node, files=len(results), waiting_for=verdict.why, **_fields(job))
        return result

    def _listed_by_metadata(self, job: CopyJob) -> dict[str, int] | None:
        """What the part's `.metadata` lists (member -> bytes it needs), read again from the primary; None
        when this node's part has no `.metadata` (another node's has)."""
        rel = f"{job.rel}/{METADATA_NAME}"
        if rel not in job.members:
            return None
        path = self.primary_root / rel
        try:
            fd = open_file_beneath(self.primary_root, rel)
        except OSError as exc:
            raise from_oserror(path, exc, "open source") from exc
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_READ_BYTES + 1)
        except OSError as exc:
            raise from_oserror(path, exc, "read source") from exc
        try:
            return storage_references(data)
        except MetadataError as exc:
            raise SourceChangedError(path, f"no longer a readable {METADATA_NAME} ({exc}); part discarded") from exc

    def commit(self, batch: Sequence[StagedCopy]) -> list[CopyResult | MirrordError]:
        """Make a batch of staged copies durable and recorded: the fsync and rename of each small file
        whose copier left them to the group (mirrord.store.atomic.DirSyncs.publish_later), one fsync per
        directory for all their renames, then one journal record (one append, one fsync) for all their
        entries; only then is
        each counted and logged as copy.committed. The outcome of each copy, in order: all fail together
        (nothing recorded) if a directory fsync or the record fails."""
        if not batch:
            return []
        dirs = DirSyncs()
        renamed_here = {e.path for staged in batch if staged.dirs.renames_pending() for e in staged.entries}
        for staged in batch:
            dirs.absorb(staged.dirs)
        try:
            try:
                dirs.flush()
            except OSError as exc:
                where = self.mirror.describe(batch[0].job.rel) if len(batch) == 1 else self.mirror.describe()
                raise from_oserror(where, exc, "fsync of the directories of published copies") from exc
            puts = [self._identified(e) if e.path in renamed_here else e for staged in batch for e in staged.entries]
            # A version its validator checked takes its name now (nothing is stronger evidence that it is whole),
            # as do the recorded bytes copied again (a `touch`).
            puts = [
                p
                for e in puts
                for p in (
                    self._promoted(e)
                    if e.role == PENDING and (e.validation == OK or _same_digest(self.manifest.get(versioned(e)), e))
                    else [e]
                )
            ]
            # A folder unit's files are in the same record as the rest of the batch: all or none.
            self.manifest.apply(puts=puts)
        except MirrordError as exc:
            for _ in batch:
                self.count(exc.reason)
            return [exc] * len(batch)
        finally:
            dirs.close()
        results: list[CopyResult | MirrordError] = [self._committed(staged) for staged in batch]
        self._promote_versions(batch)
        return results

    def _promote_versions(self, batch: Sequence[StagedCopy]) -> None:
        """Put a version kept beside a verified copy under its name once its run recorded a newer step first
        listed after it (saves are sequential: a later save proves this one returned). Tried once per process
        (a failure is logged)."""
        newer = [e for s in batch for e in s.entries if not e.role]
        for key in list(self._pending):
            version = self.manifest.get(key)
            old = self.manifest.get(versioned(version)) if version is not None and version.role == PENDING else None
            if version is None or old is None or old.seq > version.seq:
                self._pending.discard(key)  # retired or superseded since: retention retires the version
            elif any(e.run == old.run and (e.step or 0) > (version.step or 0) and e.seen >= version.seq for e in newer):
                self._pending.discard(key)
                try:
                    self.manifest.apply(puts=self._promoted(version))
                except MirrordError as exc:
                    self.log.error("copy.version_not_promoted", path=old.path, reason=exc.reason, cause=exc.cause)

    def _promoted(self, version: ManifestEntry) -> list[ManifestEntry]:
        """Rename the version onto its name; returns its entry there, to record. The copy it replaces, while
        still the recorded one, is first given a second name aside (a hard link) and recorded there (PREVIOUS)
        by the same journal record that drops the version's own: every recorded name holds its recorded
        bytes at every instant, except between the rename and its record, as when any copy is published.
        On an object store the rename is a server-side copy over the name (S3 replaces an object in one step),
        then the delete of the version's key: a crash between the two leaves that key unrecorded (a leftover
        the next version of the name overwrites), and one before the name's record leaves the name holding
        bytes its record does not (readers check the ETag, else the hash, against the record, and pass it
        over), while the replaced copy is already recorded aside: nothing is lost, locally or there."""
        rel = versioned(version)
        try:
            old, state = self.manifest.get(rel), self.mirror.stat(rel)
        except OSError as exc:
            raise from_oserror(self.mirror.describe(rel), exc, "stat") from exc
        kept = []
        if (
            old
            and state
            and (state.ino, state.size, state.mtime_ns) == (old.mirror_ino or state.ino, old.size, old.stored_mtime_ns)
            and not _same_digest(old, version)  # (the same bytes: nothing to keep)
            and self.mirror.rename(rel, version_key(rel, old.seq), keep=True)  # (else not kept)
        ):
            kept = [self._identified(replace(old, path=version_key(rel, old.seq), role=PREVIOUS))]
        self.manifest.apply(puts=kept, removes=[version.path])
        self.mirror.rename(version.path, rel)
        self.log.info(
            "copy.version_promoted", path=rel, step=version.step, digest=version.digest, kept_aside=bool(kept)
        )
        return [self._identified(replace(version, path=rel, **recorded_as(rel, self.config.rules)))]

    def count(self, result: str) -> None:
        """Count one copy outcome (mirrord_copies_total), when metrics are kept."""
        if self.metrics is not None:
            self.metrics.copy_result(result)

    def _committed(self, staged: StagedCopy) -> CopyResult:
        """Count and log one copy that is durable and recorded."""
        job, result = staged.job, staged.result
        throughput = result.size / result.seconds if result.seconds > 0 else 0.0
        m = self.metrics
        if m is not None:
            m.copy_result("ok")
            m.copied_bytes.inc(result.size)
            m.copy_duration.observe(result.seconds)
            m.copy_throughput.set(throughput)
            m.last_timestamp.set(staged.entries[0].mirrored_at)
            if job.step is not None:
                run = job.run if self.config.metrics.run_names else hashlib.sha256(job.run.encode()).hexdigest()[:12]
                label = m.run_label(run)
                self._last_steps[label] = max(job.step, self._last_steps.get(label, job.step))
                m.last_step.labels(label).set(self._last_steps[label])
        self.log.info(
            "copy.committed",
            seconds=round(result.seconds, 3),
            throughput_mib_s=round(throughput / 2**20, 1),
            digest=result.digest,
            validation=result.validation,
            **_fields(job),
            # why a copy is unchecked (e.g. a legacy torch.save format without checksums): the user's fix
            **(
                {"validation_detail": result.validation_detail}
                if result.validation != "ok" and result.validation_detail
                else {}
            ),
        )
        return result

    def _same_bytes(self, job: CopyJob, control: CopyControl) -> CopyResult | None:
        """A source replaced since it was copied (another inode or ctime, same size and mtime) is read once:
        holding the recorded bytes (a restore put them back), its new identity is recorded and nothing is
        written; other bytes are logged and copied (None)."""
        started, puts = time.monotonic(), []
        for rel in job.paths:
            entry = self.manifest.get(rel)
            if entry is None:
                return None
            st, digest = hash_source(self.primary_root, rel, entry.algo, self.options.buffer_bytes, control)
            if (st.st_size, digest) != (entry.size, entry.digest):
                self.log.warning(
                    "copy.source_replaced", path=rel, run=job.run or ".", recorded=entry.digest, now=digest
                )
                return None
            puts.append(
                replace(
                    entry,
                    source_dev=st.st_dev,
                    source_ino=st.st_ino,
                    source_ctime_ns=st.st_ctime_ns,
                )
            )
        self.manifest.apply(puts=puts)
        self.log.info("copy.source_same_bytes", path=job.rel, run=job.run or ".", files=len(puts))
        size = sum(e.size for e in puts)
        return CopyResult(
            job.rel, size, puts[0].algo, puts[0].digest, job.mtime_ns, time.monotonic() - started, wrote=False
        )

    def _publish_twin(self, job: CopyJob, options: CopyOptions, control: CopyControl) -> CopyResult | None:
        """An alias (last.ckpt) whose bytes are those of a mirrored step: read once and hashed, then
        published on the mirror from that step's copy (mirror.clone: no byte written again) and recorded
        with its digest. None when no twin has its digest (or the mirror cannot clone): copy it."""
        entries = self.manifest.entries
        twins = [entries[rel] for rel in job.twins if rel in entries and entries[rel].algo == options.algo]
        if not twins:
            return None
        started = time.monotonic()
        before, digest = hash_source(self.primary_root, job.rel, options.algo, options.buffer_bytes, control)
        for twin in twins:
            if (twin.size, twin.digest) != (before.st_size, digest):
                continue
            stored = twin.mirror_mtime_ns if twin.mirror_mtime_ns is not None else twin.source_mtime_ns
            state = self.mirror.clone(twin.path, job.rel, FileState(twin.path, twin.size, stored, twin.mirror_ino))
            if state is None:
                continue
            entry = ManifestEntry(
                path=job.rel,
                size=before.st_size,
                algo=twin.algo,
                digest=digest,
                source_mtime_ns=before.st_mtime_ns,
                step=None,
                mirrored_at=self.wall(),
                mirror_mtime_ns=state.mtime_ns,
                validation=twin.validation,
                mirror_ino=state.ino,
                mirror_ctime_ns=state.ctime_ns,
                node=self.mirror.node,
                source_dev=before.st_dev,
                source_ino=before.st_ino,
                source_ctime_ns=before.st_ctime_ns,
                seq=self.manifest.next_seq(),
                **recorded_as(job.rel, self.config.rules),
            )
            puts = [entry]
            if twin.mirror_ino and twin.mirror_ino == state.ino:  # a hard link moved the shared inode's ctime
                puts.append(replace(twin, mirror_ctime_ns=state.ctime_ns))
            self.manifest.apply(puts=puts)
            seconds = time.monotonic() - started
            self.count("aliased")
            self.log.info(
                "copy.aliased",
                path=job.rel,
                run=job.run or ".",
                twin=twin.path,
                size=before.st_size,
                digest=digest,
                seconds=round(seconds, 3),
                bytes_written=0,
            )
            return CopyResult(
                job.rel,
                before.st_size,
                twin.algo,
                digest,
                before.st_mtime_ns,
                seconds,
                state.mtime_ns,
                twin.validation or "unchecked",
                f"same bytes as {twin.path}",
            )
        return None

    def _recorded_by_another_node(self, job: CopyJob, options: CopyOptions, control: CopyControl) -> CopyResult | None:
        """A name another node of the prefix recorded (mirrord.core.nodes): this node's source is hashed once
        per change; the same bytes are mirrored already (nothing uploaded), other bytes are a conflict
        (NodeConflictError: never uploaded over the other node's copy). None when this node's own."""
        entries, matched = self.manifest.entries, self.manifest.matched
        theirs = [e for rel in job.paths if foreign(e := entries.get(rel), self.mirror.node) and e is not None]
        for entry in theirs:
            seen = matched.get(entry.path)
            try:
                now = (self.primary_root / entry.path).stat(follow_symlinks=False)
                fresh = seen is None or seen[:2] != (now.st_size, now.st_mtime_ns)
            except OSError:
                fresh = True  # hash_source names what is wrong with it
            if fresh:
                before, digest = hash_source(self.primary_root, entry.path, entry.algo, options.buffer_bytes, control)
                seen = matched[entry.path] = (before.st_size, before.st_mtime_ns, digest)
                if digest != entry.digest:
                    self.log.error(
                        "copy.node_conflict",
                        path=entry.path,
                        node=self.mirror.node,
                        recorded_by=entry.node,
                        size=before.st_size,
                        recorded_size=entry.size,
                    )
            if seen is not None and seen[2] != entry.digest:
                raise NodeConflictError(
                    self.mirror.describe(entry.path),
                    f"node {entry.node} recorded it with "
                    f"other bytes than node {self.mirror.node}'s file: not uploaded over it",
                )
        if not theirs or len(theirs) < len(job.paths):
            return None
        self.log.info("copy.same_as_node", path=job.rel, node=self.mirror.node, recorded_by=theirs[0].node)
        return CopyResult(
            job.rel,
            job.size,
            theirs[0].algo,
            theirs[0].digest,
            job.mtime_ns,
            0.0,
            job.mtime_ns,
            theirs[0].validation or UNCHECKED,
            f"same bytes as node {theirs[0].node}'s",
        )

    def _copy(
        self,
        job: CopyJob,
        options: CopyOptions,
        control: CopyControl,
        dirs: DirSyncs,
        make_room: MakeRoom,
        target: UploadTarget,
    ) -> CopyResult:
        """copy_file, once more after making room when the mirror is full (and retention may free some)."""
        expect = self._tag_checked(job)
        try:
            return copy_file(self.primary_root, job.rel, target, options, control, dirs, expect)
        except NoSpaceError:
            if make_room is None:
                raise
            make_room(job.size + options.reserve_bytes)
            control.bytes_done = 0  # the second try starts from the first byte again
            return copy_file(self.primary_root, job.rel, target, options, control, dirs, expect)

    def _tag_checked(self, job: CopyJob) -> os.stat_result | None:
        """A tag file (DeepSpeed's `latest`) is published only naming a folder the manifest records: the
        planner saw that folder mirrored, but the trainer may have saved a newer one and rewritten the tag
        since. Returns the tag as checked, for copy_file to publish exactly that; None for other files."""
        rules = self.config.rules
        if job.members or not rules.tag_file or job.rel.rsplit("/", 1)[-1] != rules.tag_file:
            return None
        path = self.primary_root / job.rel
        try:
            fd = open_file_beneath(self.primary_root, job.rel)
        except FileNotFoundError as exc:
            raise SourceGoneError(path, "deleted before it was copied") from exc
        except OSError as exc:
            raise from_oserror(path, exc, "open source") from exc
        try:
            checked = os.fstat(fd)
            named = os.read(fd, TAG_READ_BYTES).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        prefix = f"{job.run}/" if job.run else ""

        def names(rel: str) -> bool:  # the folder itself, or its step (Megatron's tracker holds the number)
            folder, slash, _ = rel[len(prefix) :].partition("/")
            return bool(slash) and (folder == named or (named.isdigit() and rules.step_of(folder) == int(named)))

        if not named or "/" in named or not any(rel.startswith(prefix) and names(rel) for rel in self.manifest.entries):
            # Not a failure: the version the planner chose is gone; the new one is planned once its folder is in.
            raise SourceGoneError(
                path,
                f"rewritten since it was planned: names {named!r}, which is not "
                "mirrored yet (the tag is published after the folder it names)",
            )
        return checked

    def _copy_unit(
        self, job: CopyJob, options: CopyOptions, control: CopyControl, make_room: MakeRoom
    ) -> list[CopyResult]:
        """copy_unit (mirrord.service.unitcopy), once more after making room when the mirror is full. A unit
        is published durably (its parent fsynced) before it returns: units are not grouped."""
        drop_old = functools.partial(self._drop_old_unit, job)
        try:
            return copy_unit(self.primary_root, job, self.mirror, options, control, drop_old)
        except NoSpaceError:
            if make_room is None:
                raise
            make_room(job.size + options.reserve_bytes)
            control.bytes_done = 0
            return copy_unit(self.primary_root, job, self.mirror, options, control, drop_old)

    def _drop_old_unit(self, job: CopyJob, replaces: bool) -> None:
        """Before a folder unit is published again (changed, or published but never recorded): its old
        manifest entries go first, so the manifest never vouches for files that are gone; then, unless
        the commit swaps the new copy in itself (`replaces`), the old folder with what is in it."""
        prefix = job.rel + "/"
        old = [rel for rel in self.manifest.entries if rel.startswith(prefix)]
        if old:
            self.manifest.apply(removes=old)
        state = self.mirror.stat(job.rel)
        if state is not None and replaces:
            self.log.info(
                "copy.replaced_unit", path=job.rel, run=job.run or ".", step=job.step, files=len(old), how="swapped"
            )
            return
        if state is not None and not self.mirror.delete_folder(job.rel, state):
            raise PermanentError(
                self.mirror.describe(job.rel),
                "an older copy of this unit is in the way and changed while it was being removed",
            )
        if state is not None:
            self.log.info("copy.replaced_unit", path=job.rel, run=job.run or ".", step=job.step, files=len(old))

    def _identified(self, entry: ManifestEntry) -> ManifestEntry:
        """The entry with its published copy's inode, ctime and mtime (an object copied on the server has a
        LastModified of its own), recorded so that `latest` can trust the entry without re-reading the file
        while they stay the same. Unknown (0) if the stat fails, and not asked of a mirror without inodes."""
        state = stat_safely(self.mirror, entry.path) if self.mirror.has_inodes else None
        if state is None:
            return replace(entry, mirror_ino=0, mirror_ctime_ns=0)
        return replace(entry, mirror_ino=state.ino, mirror_ctime_ns=state.ctime_ns, mirror_mtime_ns=state.mtime_ns)


@dataclass
class StagedCopy:
    """A copy published under its final name whose directory fsync (in `dirs`) and manifest record are
    still to come (Engine.commit): until then it is neither durable nor counted."""

    job: CopyJob
    result: CopyResult  # the file's, or a folder unit's summed (_unit_result)
    entries: list[ManifestEntry]
    dirs: DirSyncs


def _fields(job: CopyJob) -> dict[str, Any]:
    return {"path": job.rel, "run": job.run or ".", "step": job.step, "size": job.size}


def _unit_result(job: CopyJob, results: list[CopyResult]) -> CopyResult:
    """One folder unit's copies, summed for the log line and the metrics."""
    ok = all(r.validation == "ok" for r in results)
    return CopyResult(
        job.rel,
        sum(r.size for r in results),
        results[0].algo if results else "",
        f"{len(results)} files",
        job.mtime_ns,
        sum(r.seconds for r in results),
        None,
        "ok" if ok else "unchecked",
        f"{len(results)} files",
    )


def _same_digest(recorded: ManifestEntry | None, copy: ManifestEntry | CopyResult) -> bool:
    """The copy holds the recorded bytes (by size and content hash)."""
    return recorded is not None and (recorded.size, recorded.algo, recorded.digest) == (
        copy.size,
        copy.algo,
        copy.digest,
    )
