"""The manifest snapshot's binary companion: the same entries as the JSON, used only while it is the JSON's
own, and any companion that is not (stale, torn, damaged, a stranger's, unsafe) falls back to the JSON with
a log line."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mirrord.store.atomic as atomic_module
import mirrord.store.companion as companion_module
import mirrord.store.manifest as manifest_module
from mirrord.core.model import ManifestEntry
from mirrord.obs import log
from mirrord.store.companion import MAGIC, CompanionError, encode_companion, read_companion
from mirrord.store.journal import LocalManifestStore
from mirrord.store.manifest import MANIFEST_NAME, Manifest, encode_snapshot, read_snapshot, read_snapshot_companion
from mirrord.store.packed import RECORD_LAYOUT, pack
from tests.support.logs import parse_events

COMPANION = ".mirrord-manifest.packed"
N = 40


def entry(i: int) -> ManifestEntry:
    """Entries that exercise every field: no step, a mirror mtime of its own, every verdict, each algorithm."""
    algo = ("blake3", "sha256", "xxh3_128")[i % 3]
    digest = f"{i:032x}" if algo == "xxh3_128" else f"{i:064x}"
    return ManifestEntry(f"run_{i % 4}/step_{i:04d}.pt", i * 1000, algo, digest, 1_700_000_000 * 10**9 + i,
                         None if i % 5 == 0 else i, 1.5 + i, None if i % 2 else 1_700_000_001 * 10**9 + i,
                         (None, "ok", "unchecked")[i % 3], 1000 + i, 1_700_000_002 * 10**9 + i)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """mirrord's log as JSON lines in a buffer; companions from 8 entries on."""
    monkeypatch.setattr(manifest_module, "COMPANION_FROM_ENTRIES", 8)
    out = io.StringIO()
    log.configure("json", "info", out)
    yield out
    log.configure("json", "info", io.StringIO())


def compacted(root: Path, n: int = N) -> dict[str, ManifestEntry]:
    """A mirror root whose manifest holds `n` entries in its snapshot (journal folded in)."""
    manifest = Manifest.open(root, background_compaction=False)
    manifest.apply(puts=[entry(i) for i in range(n)])
    manifest.compact()
    return dict(manifest.entries)


def read_from(root: Path) -> tuple[dict[str, ManifestEntry], bool]:
    """The stored snapshot's entries and whether they came from the companion."""
    stored = LocalManifestStore(root, MANIFEST_NAME).read(read_snapshot, read_snapshot_companion)
    return dict(Manifest._adopting(stored.snapshot or {}).entries), stored.from_companion


def test_round_trip_keeps_every_field_objects_and_packed(tmp_path: Path) -> None:
    entries = {e.path: e for e in map(entry, range(N))}
    digest = hashlib.sha256(b"the snapshot").digest()
    data = encode_companion(entries, 7, digest)
    assert data is not None and data.startswith(MAGIC)
    path = tmp_path / COMPANION
    path.write_bytes(data)
    for packed_from, held_type in ((N + 1, ManifestEntry), (N, bytes)):
        fd = os.open(path, os.O_RDONLY)
        try:
            found = read_companion(fd, packed_from)
        finally:
            os.close(fd)
        assert (found.generation, found.snapshot_sha256) == (7, digest)
        assert {type(h) for h in found.entries.values()} == {held_type}
        assert dict(Manifest._adopting(found.entries).entries) == entries


def test_paths_and_records_read_in_small_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths cut anywhere by the chunks they are read in (one longer than a chunk), records in batches."""
    monkeypatch.setattr(companion_module, "_READ_BYTES", 7)
    monkeypatch.setattr(companion_module, "_BATCH", 3)
    entries = {e.path: e for e in map(entry, range(N))}
    long = ManifestEntry("run_long/" + "x" * 30 + ".pt", 1, "blake3", "ab" * 32, 1, 1, 1.0)
    entries[long.path] = long
    path = tmp_path / COMPANION
    path.write_bytes(encode_companion(entries, 3, bytes(32)) or b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_companion(fd, N + 2).entries == entries
    finally:
        os.close(fd)


def test_compaction_writes_a_companion_the_next_load_uses(tmp_path: Path, events: io.StringIO) -> None:
    expected = compacted(tmp_path)
    assert (tmp_path / COMPANION).exists()
    assert read_from(tmp_path) == (expected, True)
    assert dict(Manifest.load(tmp_path).entries) == expected
    assert parse_events(events.getvalue(), "manifest.companion_ignored") == []


def test_load_replays_the_journal_over_the_companion(tmp_path: Path, events: io.StringIO) -> None:
    expected = compacted(tmp_path)
    manifest = Manifest.open(tmp_path, background_compaction=False)
    manifest.record(entry(N))
    manifest.remove(entry(0).path)
    expected[entry(N).path] = entry(N)
    del expected[entry(0).path]
    assert dict(Manifest.load(tmp_path).entries) == expected
    assert read_from(tmp_path)[1]


def test_open_adds_the_companion_an_older_mirrord_did_not_write(tmp_path: Path, events: io.StringIO) -> None:
    entries = {e.path: e for e in map(entry, range(N))}
    (tmp_path / MANIFEST_NAME).write_bytes(Manifest(entries).to_bytes())  # the JSON alone, as before
    assert read_from(tmp_path) == (entries, False)
    Manifest.open(tmp_path).close()
    assert read_from(tmp_path) == (entries, True)


def test_a_small_manifest_has_no_companion_and_loses_a_stale_one(tmp_path: Path, events: io.StringIO) -> None:
    compacted(tmp_path)
    assert (tmp_path / COMPANION).exists()
    manifest = Manifest.open(tmp_path, background_compaction=False)
    manifest.apply(removes=[entry(i).path for i in range(N - 3)])
    manifest.compact()  # 3 entries: below the threshold
    assert not (tmp_path / COMPANION).exists()
    assert read_from(tmp_path) == ({e.path: e for e in map(entry, range(N - 3, N))}, False)
    assert parse_events(events.getvalue(), "manifest.companion_ignored") == []


def test_a_companion_that_cannot_be_written_is_logged_and_the_compaction_goes_on(
        tmp_path: Path, events: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """The companion is optional: once the snapshot is durable, a full disk for its companion is one log
    line naming the cause and the path, the stale journals are still dropped, and the next load reads the
    JSON (the previous compaction's companion, now stale, is ignored)."""
    compacted(tmp_path)
    companion_path = tmp_path / COMPANION
    real_write = atomic_module.write_bytes_atomic

    def no_space_for_the_companion(path: Path, data: bytes, **options: Any) -> None:
        if Path(path) == companion_path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data, **options)

    monkeypatch.setattr(atomic_module, "write_bytes_atomic", no_space_for_the_companion)
    manifest = Manifest.open(tmp_path, background_compaction=False)
    manifest.apply(puts=[entry(i) for i in range(N, N + 3)], removes=[entry(0).path])
    expected = dict(manifest.entries)
    manifest.compact()  # does not raise
    snapshot = json.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert len(snapshot["entries"]) == N + 2  # published, with the journal's changes folded in
    assert sorted(p.name for p in tmp_path.glob(".mirrord-manifest.journal.*")) == [
        f".mirrord-manifest.journal.{snapshot['journal']}"]  # the older journals dropped
    (line,) = parse_events(events.getvalue(), "manifest.companion_not_written")
    assert line["path"] == str(companion_path) and "No space left on device" in line["cause"]
    manifest.close()
    monkeypatch.undo()
    assert read_from(tmp_path) == (expected, False)  # the JSON is the truth
    assert dict(Manifest.load(tmp_path).entries) == expected
    (ignored, *_rest) = parse_events(events.getvalue(), "manifest.companion_ignored")
    assert "stale" in ignored["cause"]


def _damaged(data: bytes) -> dict[str, bytes]:
    body_at = len(MAGIC) + struct.calcsize("<I32s32sQQQ")
    return {
        "a flipped byte in a record": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
        "a flipped byte in a path": data[:body_at + 3] + bytes([data[body_at + 3] ^ 2]) + data[body_at + 4:],
        "torn": data[: len(data) * 2 // 3],
        "torn in the header": data[:30],
        "data after its end": data + b"x",
        "a stranger's file": b"PK\x03\x04" + data[4:],
        "a newer version": MAGIC + struct.pack("<I", 2) + data[len(MAGIC) + 4:],
        "empty": b"",
    }


@pytest.mark.parametrize("how", list(_damaged(b"x" * 200)))
def test_a_damaged_companion_falls_back_to_the_json_with_a_log_line(tmp_path: Path, events: io.StringIO,
                                                                    how: str) -> None:
    expected = compacted(tmp_path)
    path = tmp_path / COMPANION
    path.write_bytes(_damaged(path.read_bytes())[how])
    assert read_from(tmp_path) == (expected, False)
    assert dict(Manifest.load(tmp_path).entries) == expected
    (ignored, *_rest) = parse_events(events.getvalue(), "manifest.companion_ignored")
    assert ignored["path"] == str(path) and "the JSON is read" in ignored["cause"]
    Manifest.open(tmp_path).close()  # the lock holder replaces it
    assert read_from(tmp_path) == (expected, True)


def test_a_companion_of_another_snapshot_is_stale(tmp_path: Path, events: io.StringIO) -> None:
    """The JSON replaced without its companion (a crash between the two, an older mirrord compacting, a
    restore by hand): the companion names the other snapshot's digest and is ignored."""
    compacted(tmp_path)
    other = {e.path: e for e in map(entry, range(N, 2 * N))}
    (tmp_path / MANIFEST_NAME).write_bytes(encode_snapshot(other, 1))  # (the compaction's generation)
    assert read_from(tmp_path) == (other, False)
    (ignored,) = parse_events(events.getvalue(), "manifest.companion_ignored")
    assert "stale" in ignored["cause"]
    # A read-only load (`mirrord latest`), which hashes the snapshot only when there is a companion to check:
    assert dict(Manifest.load(tmp_path).entries) == other
    assert [e["cause"] for e in parse_events(events.getvalue(), "manifest.companion_ignored")][1:] == [ignored["cause"]]


def test_a_companion_with_a_valid_checksum_but_unsafe_paths_is_refused(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Its checksum proves it intact, not made by us: its paths are held to split_rel's rule anyway."""
    monkeypatch.setattr(companion_module, "_READ_BYTES", 5)  # (and where chunks meet)
    for bad in ("../outside.pt", "/abs.pt", "run//step.pt", "run/./step.pt", "run/../step.pt", "run/", "",
                ".", "..", "zzz/..", "zzz/.", "zzz/"):  # (sorted first, between the two good ones, last)
        entries = {"a/ok.pt": pack(entry(1)), bad: pack(entry(2)), "zz/ok.pt": pack(entry(3))}
        data = encode_companion(entries, 0, bytes(32))
        assert data is not None
        path = tmp_path / COMPANION
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(CompanionError, match="not all safe relative paths"):
                read_companion(fd, 10)
        finally:
            os.close(fd)
    for tiny in (["a"], ["a", "b"], ["a", ".b", "c.."]):  # short enough to be checked whole: all fine
        data = encode_companion({p: pack(entry(1)) for p in tiny}, 0, bytes(32))
        assert data is not None
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert sorted(read_companion(fd, 10).entries) == sorted(tiny)
        finally:
            os.close(fd)


def test_an_entry_that_does_not_pack_means_no_companion() -> None:
    odd = ManifestEntry("run/step_1.pt", 1, "blake3", "AB" * 32, 1, 1, 1.0)  # upper case: would not come back
    assert encode_companion({odd.path: odd, entry(2).path: entry(2)}, 0, bytes(32)) is None


def test_non_utf8_names_survive(tmp_path: Path) -> None:
    name = os.fsdecode(b"run/step_\xff_1.pt")  # a lone surrogate, as a listing of such a name gives
    e = ManifestEntry(name, 1, "blake3", "ab" * 32, 1, 1, 1.0)
    data = encode_companion({name: e}, 0, bytes(32))
    assert data is not None
    (tmp_path / COMPANION).write_bytes(data)
    fd = os.open(tmp_path / COMPANION, os.O_RDONLY)
    try:
        assert read_companion(fd, 10).entries == {name: e}
    finally:
        os.close(fd)


def _fields(e: ManifestEntry) -> list[tuple[type, Any]]:
    """Every field with its type: 1 == 1.0 would hide an int read back where a float was written."""
    return [(type(v), v) for v in (getattr(e, f.name) for f in dataclasses.fields(ManifestEntry))]


def test_batches_of_one_record_length_and_mixed_ones_read_back_identical(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of one length are unpacked a batch at a time, a batch of mixed lengths one by one: each
    entry, objects or packed, comes back field for field what was written, and what the JSON gives."""
    monkeypatch.setattr(companion_module, "_BATCH", 4)
    made: list[ManifestEntry] = []
    for batch, algos in enumerate((["blake3"] * 4, ["sha256", "blake3"] * 2, ["xxh3_128"] * 4,
                                   ["blake3", "xxh3_128", "blake3", "blake3"], ["sha256"] * 3)):
        for i, algo in enumerate(algos):
            n = batch * 4 + i
            digest = f"{n:032x}" if algo == "xxh3_128" else f"{n:064x}"
            made.append(ManifestEntry(
                f"run_{batch}/step_{i}.pt", n * 7, algo, digest, 1_700_000_000 * 10**9 + n,
                None if n % 3 == 0 else n, 0.25 + n, None if n % 2 else 1_700_000_001 * 10**9 + n,
                (None, "ok", "unchecked")[n % 3], n % 4 and 1000 + n, 1_700_000_002 * 10**9 + n))
    entries = {e.path: e for e in made}
    assert sorted(entries) == [e.path for e in made]  # (the records are in this order: the batches above)
    from_json, _generation = manifest_module.decode_snapshot(encode_snapshot(entries), "json")
    data = encode_companion(entries, 0, bytes(32))
    assert data is not None
    (tmp_path / COMPANION).write_bytes(data)
    for packed_from in (len(made) + 1, len(made)):
        fd = os.open(tmp_path / COMPANION, os.O_RDONLY)
        try:
            held = read_companion(fd, packed_from).entries
        finally:
            os.close(fd)
        assert list(held) == list(entries)
        for e in made:
            if packed_from > len(made):
                assert type(held[e.path]) is ManifestEntry
                assert _fields(held[e.path]) == _fields(e) == _fields(from_json[e.path])  # type: ignore[arg-type]
            else:
                assert held[e.path] == pack(e)
                assert _fields(Manifest._adopting(held).entries[e.path]) == _fields(e)


def test_a_record_that_does_not_unpack_is_refused_in_either_kind_of_batch(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An algorithm or verdict code beyond the known ones (a checksum made over it, so only the unpack can
    tell): CompanionError, whether its batch is read at once or record by record."""
    monkeypatch.setattr(companion_module, "_BATCH", 2)
    for mixed in (False, True):
        for field in ("algo", "verdict"):
            entries = {e.path: e for e in (entry(3), entry(6) if not mixed else entry(5))}
            records = {p: pack(e) for p, e in entries.items()}
            bad = sorted(records)[1]
            at = RECORD_LAYOUT.size - (3 if field == "algo" else 2)
            record = records[bad]
            assert isinstance(record, bytes)
            records[bad] = record[:at] + b"\xff" + record[at + 1:]
            data = encode_companion(records, 0, bytes(32))
            assert data is not None
            (tmp_path / COMPANION).write_bytes(data)
            fd = os.open(tmp_path / COMPANION, os.O_RDONLY)
            try:
                with pytest.raises(CompanionError, match="does not unpack"):
                    read_companion(fd, 10)
            finally:
                os.close(fd)


def test_a_mirrors_size_hint_is_its_companions_count_and_zero_for_anything_else(
        tmp_path: Path, events: io.StringIO) -> None:
    """LocalMirror.size_hint (what `mirrord sync` decides a listing child by, before reading the manifest)
    reads the companion's header alone; no companion, a stranger's file or a torn header is 0, never an error."""
    from mirrord.store.companion import counted_entries
    from mirrord.store.volume import LocalMirror

    mirror = LocalMirror(tmp_path)
    assert mirror.size_hint() == 0  # no manifest at all
    compacted(tmp_path)
    assert mirror.size_hint() == N == counted_entries(tmp_path / COMPANION)
    whole = (tmp_path / COMPANION).read_bytes()
    (tmp_path / COMPANION).write_bytes(whole[: len(MAGIC) + 10])
    assert mirror.size_hint() == 0
    (tmp_path / COMPANION).write_bytes(b"x" * len(whole))
    assert mirror.size_hint() == 0
    (tmp_path / COMPANION).unlink()
    (tmp_path / COMPANION).mkdir()  # not a file: read fails
    assert mirror.size_hint() == 0
