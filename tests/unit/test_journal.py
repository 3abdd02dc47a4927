"""The manifest journal on disk: torn tails, corruption, the generation sequence, compaction crash points,
and readers that load while a writer appends and compacts."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mirrord.store.manifest as manifest_module
from mirrord.core.model import ManifestEntry
from mirrord.errors import ManifestError
from mirrord.store.journal import frame, parse_journal
from mirrord.store.manifest import MANIFEST_NAME, Manifest, encode_snapshot
from tests.support.wait import wait_for

JOURNAL0 = ".mirrord-manifest.journal.0"


def entry(i: int, size: int = 1) -> ManifestEntry:
    return ManifestEntry(f"run/step_{i:04d}.pt", size, "blake3", f"{i:064x}", 1_700_000_000 * 10**9 + i, i, 1.5)


def written(tmp_path: Path, n: int) -> tuple[Manifest, dict[str, ManifestEntry]]:
    manifest = Manifest.open(tmp_path)
    for i in range(n):
        manifest.record(entry(i))
    return manifest, manifest.entries


def test_a_torn_last_record_is_ignored_at_every_cut(tmp_path: Path) -> None:
    """Cut the journal at every byte of its last record (a crash mid-append): the reader sees exactly the
    records before it, and the next writer cuts the torn bytes off and appends cleanly after them."""
    manifest, before_last = written(tmp_path, 3)
    manifest.record(entry(3))
    journal = tmp_path / JOURNAL0
    data = journal.read_bytes()
    start = data.rstrip(b"\n").rindex(b"\n") + 1
    for cut in range(start, len(data)):
        journal.write_bytes(data[:cut])
        assert Manifest.load(tmp_path).entries == before_last, f"cut at byte {cut}"
    journal.write_bytes(data[: start + (len(data) - start) // 2])
    writer = Manifest.open(tmp_path)
    writer.record(entry(9))
    assert Manifest.load(tmp_path).entries == {**before_last, entry(9).path: entry(9)}
    assert parse_journal(journal.read_bytes(), "j")[1] == journal.stat().st_size  # nothing torn is left


def test_a_bad_checksum_on_the_last_record_is_a_torn_record(tmp_path: Path) -> None:
    """Garbage where the last append was (a power cut can leave zeros or old bytes) is not a record."""
    _, before = written(tmp_path, 2)
    journal = tmp_path / JOURNAL0
    with journal.open("ab") as f:
        f.write(b"\0" * 300)
    assert Manifest.load(tmp_path).entries == before
    data = journal.read_bytes()[:-300] + frame(b'{"del":["run/step_0000.pt"]}')
    flipped = bytearray(data)
    flipped[-5] ^= 0x20
    journal.write_bytes(bytes(flipped))
    assert Manifest.load(tmp_path).entries == before


def test_a_corrupt_record_in_the_middle_is_an_error_naming_the_journal(tmp_path: Path) -> None:
    """Records after a bad one were acknowledged: dropping them silently would lose recorded copies."""
    written(tmp_path, 4)
    journal = tmp_path / JOURNAL0
    lines = journal.read_bytes().split(b"\n")
    lines[2] = lines[2][:20] + b"X" + lines[2][21:]
    journal.write_bytes(b"\n".join(lines))
    with pytest.raises(ManifestError) as info:
        Manifest.load(tmp_path)
    assert info.value.path == str(journal) and "corrupt journal record" in info.value.cause
    with pytest.raises(ManifestError):
        Manifest.open(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(lambda d: (d / JOURNAL0).write_bytes(b""), "bad header", id="empty-journal"),
        pytest.param(lambda d: (d / JOURNAL0).write_bytes(frame(b'{"schema":"x"}')), "bad header", id="foreign"),
        pytest.param(
            lambda d: (d / JOURNAL0).rename(d / ".mirrord-manifest.journal.1"), "generation", id="renamed-journal"
        ),
        pytest.param(lambda d: (d / MANIFEST_NAME).unlink(), "missing", id="snapshot-deleted"),
        pytest.param(
            lambda d: (d / JOURNAL0).write_bytes((d / JOURNAL0).read_bytes() + frame(b"[1,2]")),
            "cannot parse journal record",
            id="record-not-a-change",
        ),
    ],
)
def test_journals_that_do_not_fit_their_snapshot_are_errors(tmp_path: Path, change, message: str) -> None:
    written(tmp_path, 2)
    change(tmp_path)
    with pytest.raises(ManifestError, match=message):
        Manifest.load(tmp_path)


def test_a_lost_journal_between_snapshot_and_newer_journal_is_an_error(tmp_path: Path) -> None:
    manifest, _ = written(tmp_path, 2)
    manifest._store.rotate()  # step 1 of a compaction: journals 0 and 1
    manifest.record(entry(5))
    (tmp_path / JOURNAL0).unlink()
    with pytest.raises(ManifestError, match="a journal is missing"):
        Manifest.load(tmp_path)


def test_compaction_crash_points_each_read_back_everything(tmp_path: Path) -> None:
    """Stop a compaction after each of its steps (and inside the snapshot's publication): a reader and a
    new writer see every recorded change, and the next compaction cleans up."""
    manifest, _ = written(tmp_path, 3)
    store = manifest._store
    generation = store.rotate()  # 1. new journal; appends go there
    manifest.record(entry(3))
    assert Manifest.load(tmp_path).entries == manifest.entries
    (tmp_path / (MANIFEST_NAME + ".part")).write_bytes(b'{"schema": "mirrord-manif')  # 2, interrupted
    assert Manifest.load(tmp_path).entries == manifest.entries
    (tmp_path / (MANIFEST_NAME + ".part")).unlink()
    snapshot = {k: v for k, v in manifest.entries.items() if k != entry(3).path}
    store.publish_snapshot(encode_snapshot(snapshot, generation))  # 2. done; journal 0 now stale
    assert Manifest.load(tmp_path).entries == manifest.entries
    reopened = Manifest.open(tmp_path)
    reopened.record(entry(4))
    assert Manifest.load(tmp_path).entries == reopened.entries == {**manifest.entries, entry(4).path: entry(4)}
    reopened.close()  # 3. and the stale journal goes
    assert sorted(p.name for p in tmp_path.iterdir() if ".journal." in p.name) == [".mirrord-manifest.journal.2"]
    assert Manifest.load(tmp_path).entries == reopened.entries


def _fail_directory_fsyncs(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[str]:
    """os.fsync fails with EIO on the directory `root` once journal 0 is unlinked (the directory fsync of
    compaction step 3, not those publishing journal 1 and the snapshot); returns what it failed."""
    real, failed = os.fsync, []

    def fsync(fd: int) -> None:
        if os.path.samestat(os.fstat(fd), root.stat()) and not (root / JOURNAL0).exists():
            failed.append(str(root))
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failed


def test_a_failed_directory_fsync_after_dropping_stale_journals_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unlink of a stale journal may not be durable: harmless (stale journals are ignored), but the
    I/O error is raised naming the directory and the cause, never swallowed."""
    manifest, entries = written(tmp_path, 3)
    with monkeypatch.context() as m:
        failed = _fail_directory_fsyncs(m, tmp_path)
        with pytest.raises(ManifestError) as raised:
            manifest.close()
    assert failed == [str(tmp_path)]
    assert raised.value.path == str(tmp_path) and os.strerror(errno.EIO) in raised.value.cause
    assert Manifest.load(tmp_path).entries == entries  # the snapshot was published before step 3
    reopened = Manifest.open(tmp_path)
    reopened.record(entry(7))
    reopened.close()
    assert Manifest.load(tmp_path).entries == {**entries, entry(7).path: entry(7)}


def test_a_stale_journal_that_cannot_be_unlinked_is_raised_and_the_others_still_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every stale journal is tried; the first failure names its journal; the next compaction retries."""
    manifest, _ = written(tmp_path, 2)
    store = manifest._store
    store.rotate()
    manifest.record(entry(2))
    generation = store.rotate()
    store.publish_snapshot(encode_snapshot(manifest.entries, generation))  # journals 0 and 1 now stale
    real = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == JOURNAL0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(self, missing_ok)

    with monkeypatch.context() as m:
        m.setattr(Path, "unlink", unlink)
        with pytest.raises(ManifestError) as raised:
            store.drop_before(generation)
    assert raised.value.path == str(tmp_path / JOURNAL0) and os.strerror(errno.EIO) in raised.value.cause
    journals = sorted(p.name for p in tmp_path.iterdir() if ".journal." in p.name)
    assert journals == [JOURNAL0, f".mirrord-manifest.journal.{generation}"]
    assert Manifest.load(tmp_path).entries == manifest.entries
    store.drop_before(generation)
    assert sorted(p.name for p in tmp_path.iterdir() if ".journal." in p.name) == [journals[1]]


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    import mirrord.store.manifest as m
    from mirrord.core.model import ManifestEntry

    m.COMPACT_MIN_RECORDS = int(sys.argv[2])
    manifest = m.Manifest.open(Path(sys.argv[1]))
    start = len(manifest)
    for i in range(start, start + int(sys.argv[3])):
        manifest.record(ManifestEntry(f"run/step_{i:06d}.pt", i, "blake3", f"{i:064x}", i, i, 1.0))
        if i % 7 == 3:
            manifest.remove(f"run/step_{i - 2:06d}.pt")
        print(i, flush=True)
""")


def expected(n: int) -> set[str]:
    """The paths after the writer's first n iterations (each records i and, now and then, removes i-2)."""
    paths: set[str] = set()
    for i in range(n):
        paths.add(f"run/step_{i:06d}.pt")
        if i % 7 == 3:
            paths.discard(f"run/step_{i - 2:06d}.pt")
    return paths


def test_readers_see_a_consistent_prefix_while_a_writer_appends_and_compacts(tmp_path: Path) -> None:
    """`latest`, `verify` and `status` load the manifest while the daemon writes: every load succeeds and
    is the state after some whole number of the writer's changes, never one that lost a change."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "20", "3000"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: (tmp_path / MANIFEST_NAME).exists(), 60, "the writer to start")
        loads = compactions_seen = 0
        generations: set[int] = set()
        while writer.poll() is None:
            paths = set(Manifest.load(tmp_path).entries)
            numbers = sorted(int(p.rsplit("_", 1)[1][:-3]) for p in paths)
            n = numbers[-1] + 1 if numbers else 0
            # the state after n or n-1... changes: the newest record and, maybe, its removal
            assert paths in (expected(n), expected(n) | {f"run/step_{n - 3:06d}.pt"}), f"inconsistent at {n}"
            loads += 1
            generations.add(json.loads((tmp_path / MANIFEST_NAME).read_bytes()).get("journal", 0))
        compactions_seen = len(generations)
        assert writer.wait(60) == 0
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, 9)
            writer.wait()
        if writer.stdout is not None:
            writer.stdout.close()
    assert set(Manifest.load(tmp_path).entries) == expected(3000)
    assert loads > 10 and compactions_seen > 2, (loads, compactions_seen)


def test_compaction_threshold_scales_with_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction rewrites every entry, so it waits for a quarter of them in records: constant cost per record."""
    monkeypatch.setattr(manifest_module, "COMPACT_MIN_RECORDS", 10)
    manifest = Manifest.open(tmp_path, background_compaction=False)
    manifest.apply(puts=[entry(i) for i in range(200)])
    for i in range(45):
        manifest.record(entry(i, size=2))
    assert json.loads((tmp_path / MANIFEST_NAME).read_bytes()).get("journal", 0) == 0  # 46 < 200 / 4
    for i in range(10):
        manifest.record(entry(i, size=3))
    assert json.loads((tmp_path / MANIFEST_NAME).read_bytes())["journal"] == 1
    assert Manifest.load(tmp_path).entries == manifest.entries
