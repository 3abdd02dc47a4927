"""`mirrord repair-manifest`: rebuild a lost or damaged manifest from the files on the mirror.

Offline (it takes the mirror lock, so no daemon may run). Every mirror file is re-hashed and validated
before it is recorded again:

* a file whose source is still on the primary with the same size must have the same content (the
  source is hashed too), and gets the source's mtime;
* a torch.save zip must pass its CRC-32 check (mirrord.formats.zipcheck);
* anything else that is not a torch zip is recorded only when it has a source that matches.

What fails is left unrecorded (the daemon copies it again from the primary if the source exists) and
listed. The old manifest, if any, is kept beside the new one as `.mirrord-manifest.json.damaged`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from mirrord.config import Config
from mirrord.core.model import ManifestEntry
from mirrord.core.units import run_and_step
from mirrord.formats.zipcheck import check_torch_zip_fd
from mirrord.store.hashing import hash_fd
from mirrord.store.mirror import ReadableStore, random_access_fd
from mirrord.store.targets import mirror_for
from mirrord.store.volume import LocalVolume

DAMAGED_SUFFIX = ".damaged"


@dataclass
class RepairReport:
    """What repair-manifest did: files recorded, files rejected and why, the old manifest, errors."""

    recorded: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (rel, why)
    old_manifest: str = ""  # what happened to the previous manifest
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every file was recorded without error."""
        return not self.rejected and not self.errors


def _digest(store: ReadableStore, rel: str, algo: str) -> tuple[int, str, int, int]:
    """(size, digest, mtime_ns, zip status as 0/1) of the key rel, read through the store (locally:
    beneath the root, never through a symlink)."""
    state = store.stat(rel)
    if state is None:
        raise FileNotFoundError(2, "gone while the manifest was being rebuilt")
    with store.open_read(rel) as stream, random_access_fd(stream) as fd:
        zip_ok = int(check_torch_zip_fd(fd).ok)  # pread only
        os.lseek(fd, 0, os.SEEK_SET)  # (a spooled copy was left at its end)
        size, digest = hash_fd(fd, algo)
    return size, digest, state.mtime_ns, zip_ok


def _judge(mirror: ReadableStore, primary: LocalVolume, rel: str, algo: str) -> tuple[int, str, int, int] | str:
    """(size, digest, mtime_ns, source mtime_ns) of a mirror file fit to be recorded, or why it is not."""
    try:
        size, digest, mtime_ns, zip_ok = _digest(mirror, rel, algo)
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    src = primary.stat(rel) if primary.exists() else None
    if src is None or not src.is_regular or src.size != size:
        why = "not a torch.save zip whose CRCs check out, and no matching source on the primary"
        return (size, digest, mtime_ns, mtime_ns) if zip_ok else why
    try:
        _, src_digest, source_mtime, _ = _digest(primary, rel, algo)
    except OSError as exc:
        return f"cannot read its source: {exc.strerror or exc}"
    return (size, digest, mtime_ns, source_mtime) if src_digest == digest else "differs from its source on the primary"


def repair_manifest(config: Config) -> RepairReport:
    """Rebuild the manifest of config.mirror from its files (see the module docstring)."""
    report = RepairReport()
    mirror, primary = mirror_for(config.mirror_target, config.s3), LocalVolume(config.primary)
    with mirror.lock():
        snap = mirror.snapshot(config.patterns)
        report.errors += list(snap.errors)
        entries: dict[str, ManifestEntry] = {}
        for rel in sorted(snap.files):
            judged = _judge(mirror, primary, rel, config.copy.hash)
            if isinstance(judged, str):
                report.rejected.append((rel, judged))
                continue
            size, digest, mtime_ns, source_mtime = judged
            step = run_and_step(rel, config.rules, config.step_regex)[1]
            entries[rel] = ManifestEntry(
                rel, size, config.copy.hash, digest, source_mtime, step, time.time(), mirror_mtime_ns=mtime_ns
            )
            report.recorded.append(rel)
        if snap.errors:
            return report  # a partial listing must not become a manifest that forgets files
        # The old snapshot and journals go aside (never deleted: a person may want them), then the
        # rebuilt entries are recorded and folded into one fresh snapshot.
        moved = mirror.set_manifest_aside(DAMAGED_SUFFIX)
        if moved:
            report.old_manifest = "kept as " + ", ".join(moved)
        manifest = mirror.read_manifest()
        if entries:
            manifest.apply(puts=entries.values())
        manifest.close()
    return report
