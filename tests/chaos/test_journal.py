"""kill -9 of a process writing the manifest, at random instants: mid-append, mid-compaction, anywhere.

The writer records and removes entries one change at a time, with compactions every few records, and
prints the number of each change once it returned (acknowledged = durable). After each SIGKILL the
manifest must read back as exactly the state after some whole number of changes, never fewer than were
acknowledged (nothing durable lost) and never a partial change; a torn last record is ignored. The
next writer resumes on that state (cutting the torn tail off) and the next kill is checked the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mirrord.errors import ManifestError
from mirrord.store.journal import parse_journal
from mirrord.store.manifest import MANIFEST_NAME, Manifest, decode_snapshot
from tests.chaos.harness import SCALE, Report
from tests.support.wait import wait_for

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    import mirrord.store.manifest as m
    from mirrord.core.model import ManifestEntry

    m.COMPACT_MIN_RECORDS = 16
    manifest = m.Manifest.open(Path(sys.argv[1]))
    print("open", flush=True)
    start = int(sys.argv[2])
    for c in range(start, start + 100000):
        i = c // 2
        if c % 2 == 0:
            manifest.record(ManifestEntry(f"run/step_{i:06d}.pt", i, "blake3", f"{i:064x}", i, i, 1.0))
        else:
            manifest.apply(removes=[f"run/step_{i - 3:06d}.pt", f"run/step_{i - 5:06d}.pt"])
        print(c, flush=True)
""")


def apply_changes(state: frozenset[str], start: int, stop: int) -> frozenset[str]:
    """The writer's changes start..stop-1 (even: record step c/2; odd: remove two older steps)."""
    paths = set(state)
    for c in range(start, stop):
        i = c // 2
        if c % 2 == 0:
            paths.add(f"run/step_{i:06d}.pt")
        else:
            paths.difference_update({f"run/step_{i - 3:06d}.pt", f"run/step_{i - 5:06d}.pt"})
    return frozenset(paths)


def _torn(root: Path) -> bool:
    for journal in root.glob(".mirrord-manifest.journal.*"):
        if journal.suffix == ".part":
            continue
        data = journal.read_bytes()
        try:
            if parse_journal(data, str(journal))[1] < len(data):
                return True
        except ManifestError:
            return False
    return False


def test_kill9_of_a_manifest_writer_loses_nothing_acknowledged(tmp_path: Path, report: Report) -> None:
    tally, rng = report.seeded_scenario("kill -9 of a manifest writer (journal append, compaction)", "journal")
    root = tmp_path / "mirror"
    root.mkdir()
    state: frozenset[str] = frozenset()
    next_change = 0
    for _ in range(SCALE.kill_rounds):
        out, err = tmp_path / "acks", tmp_path / "stderr"
        with out.open("w") as f, err.open("w") as e:
            writer = subprocess.Popen(
                [sys.executable, "-c", WRITER, str(root), str(next_change)], stdout=f, stderr=e, start_new_session=True
            )
        try:
            wait_for(
                lambda out=out, w=writer: "open" in out.read_text() or w.poll() is not None,
                60,
                "the writer to open",
                interval=0.02,
            )
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(writer.pid, signal.SIGKILL)
            writer.wait()
        if writer.returncode != -signal.SIGKILL:
            tally.check([f"the writer exited {writer.returncode} before it was killed: {err.read_text()[-2000:]}"])
            break
        tally.rounds += 1
        tally.fault("SIGKILL")
        journals = [p for p in root.glob(".mirrord-manifest.journal.*") if p.suffix != ".part"]
        if len(journals) > 1 or list(root.glob("*.part")):
            tally.fault("SIGKILL mid-compaction (two journals or a temp file)")
        if _torn(root):
            tally.fault("SIGKILL left a torn record")
        acks = [int(line) for line in out.read_text().split()[1:] if line.isdigit()]
        acked = acks[-1] + 1 if acks else next_change  # changes [next_change, acked) were acknowledged
        try:
            got = frozenset(Manifest.load(root).entries)
        except ManifestError as exc:
            tally.check([f"manifest unreadable after a kill: {exc}"])
            break
        # A change is printed as soon as it returned, before the next one starts: at most one is unacknowledged.
        candidates = {c: apply_changes(state, next_change, c) for c in range(acked, acked + 2)}
        match = [c for c, s in candidates.items() if s == got]
        if not match:
            lost = sorted(candidates[acked] - got)[:3]
            extra = sorted(got - candidates[acked + 1])[:3]
            tally.check([f"state after kill is no whole number of changes >= {acked}: missing {lost}, extra {extra}"])
            break
        state, next_change = got, match[0]
    tally.notes.append(f"{next_change} changes recorded over {tally.rounds} writer processes")
    tally.assert_clean()
    final = Manifest.open(root)
    assert frozenset(final.entries) == state
    final.close()
    assert decode_snapshot((root / MANIFEST_NAME).read_bytes(), "manifest")[0] == Manifest.load(root).entries
