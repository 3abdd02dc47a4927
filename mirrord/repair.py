"""`mirrord repair-manifest`: rebuild a lost or damaged manifest from the files on the mirror.

Offline (it takes the mirror lock, so no daemon may run). Every mirror file is re-hashed and validated
before it is recorded again:

* a file whose source is still on the primary with the same size must have the same content (the
  source is hashed too), and gets the source's mtime;
* a torch.save zip must pass its CRC-32 check (mirrord.zipcheck);
* anything else that is not a torch zip is recorded only when it has a source that matches.

What fails is left unrecorded (the daemon copies it again from the primary if the source exists) and
listed. The old manifest, if any, is kept beside the new one as `.mirrord-manifest.json.damaged`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from mirrord.config import Config
from mirrord.errors import ManifestError
from mirrord.hashing import hash_fd
from mirrord.manifest import MANIFEST_NAME, Manifest
from mirrord.model import ManifestEntry, step_of
from mirrord.paths import open_file_beneath
from mirrord.volume import LocalMirror, LocalVolume
from mirrord.zipcheck import check_torch_zip_fd

DAMAGED_SUFFIX = ".damaged"


@dataclass
class RepairReport:
    recorded: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (rel, why)
    old_manifest: str = ""  # what happened to the previous manifest
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.rejected and not self.errors


def _digest(root: os.PathLike[str] | str, rel: str, algo: str) -> tuple[int, str, int, int]:
    """(size, digest, mtime_ns, fd-validated zip status as 0/1) of root/rel, never through a symlink."""
    fd = open_file_beneath(root, rel)  # type: ignore[arg-type]
    try:
        st = os.fstat(fd)
        size, digest = hash_fd(fd, algo)
        zip_ok = int(check_torch_zip_fd(fd).ok)
    finally:
        os.close(fd)
    return size, digest, st.st_mtime_ns, zip_ok


def repair_manifest(config: Config) -> RepairReport:
    """Rebuild the manifest of config.mirror from its files (see the module docstring)."""
    report = RepairReport()
    mirror, primary = LocalMirror(config.mirror), LocalVolume(config.primary)
    algo = config.copy.hash
    with mirror.lock():
        snap = mirror.snapshot(config.patterns)
        report.errors += list(snap.errors)
        entries: dict[str, ManifestEntry] = {}
        for rel in sorted(snap.files):
            try:
                size, digest, mtime_ns, zip_ok = _digest(mirror.root, rel, algo)
            except OSError as exc:
                report.rejected.append((rel, f"cannot read: {exc.strerror or exc}"))
                continue
            source_mtime = mtime_ns
            src = primary.stat(rel) if config.primary.is_dir() else None
            if src is not None and src.is_regular and src.size == size:
                try:
                    _, src_digest, source_mtime, _ = _digest(primary.root, rel, algo)
                except OSError as exc:
                    report.rejected.append((rel, f"cannot read its source: {exc.strerror or exc}"))
                    continue
                if src_digest != digest:
                    report.rejected.append((rel, "differs from its source on the primary"))
                    continue
            elif not zip_ok:
                why = "not a torch.save zip whose CRCs check out, and no matching source on the primary"
                report.rejected.append((rel, why))
                continue
            entries[rel] = ManifestEntry(rel, size, algo, digest, source_mtime, step_of(rel, config.step_regex),
                                         time.time(), mirror_mtime_ns=mtime_ns)
            report.recorded.append(rel)
        if snap.errors:
            return report  # a partial listing must not become a manifest that forgets files
        # The old snapshot and journals go aside (never deleted: a person may want them), then the
        # rebuilt entries are recorded and folded into one fresh snapshot.
        journals = sorted(mirror.root.glob(MANIFEST_NAME.removesuffix(".json") + ".journal.*"))
        old = [mirror.root / MANIFEST_NAME, *journals]
        moved = []
        for path in old:
            if path.name.endswith(DAMAGED_SUFFIX) or not (path.exists() or path.is_symlink()):
                continue
            aside = path.with_name(path.name + DAMAGED_SUFFIX)
            try:
                path.replace(aside)
            except OSError as exc:
                raise ManifestError(path, f"cannot move the old manifest aside: {exc.strerror or exc}") from exc
            moved.append(aside.name)
        if moved:
            report.old_manifest = "kept as " + ", ".join(moved)
        manifest = Manifest.open(mirror.root, guard=mirror.check_identity)
        if entries:
            manifest.apply(puts=entries.values())
        manifest.close()
    return report
