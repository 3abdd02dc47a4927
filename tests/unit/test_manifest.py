"""The manifest: documented JSON schema, atomic persistence, loud failure on corruption, rollback."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from mirrord.errors import ManifestError
from mirrord.manifest import MANIFEST_NAME, SCHEMA, SCHEMA_VERSION, Manifest
from mirrord.model import ManifestEntry
from mirrord.volume import LocalMirror
from tests.helpers import names


def entry(path: str = "run/step_0010.pt", size: int = 2_470_000_000, step: int | None = 10) -> ManifestEntry:
    return ManifestEntry(
        path=path, size=size, algo="blake3", digest="ab" * 32,
        source_mtime_ns=1_700_000_000_123_456_789, step=step, mirrored_at=1_700_000_100.5,
    )


def doc(entries: Any) -> bytes:
    return json.dumps({"schema": SCHEMA, "version": SCHEMA_VERSION, "entries": entries}).encode()


GOOD = {"size": 1, "hash": {"algo": "blake3", "digest": "ab" * 32}, "source_mtime_ns": 5, "step": 1,
        "mirrored_at": 1.0}


def test_json_layout_is_the_documented_schema() -> None:
    """The on-disk format other tools read (see the README): schema, version, entries keyed by path."""
    data = json.loads(Manifest({"run/step_0010.pt": entry()}).to_bytes())
    assert data == {
        "schema": "mirrord-manifest",
        "version": 1,
        "entries": {
            "run/step_0010.pt": {
                "size": 2_470_000_000,
                "hash": {"algo": "blake3", "digest": "ab" * 32},
                "source_mtime_ns": 1_700_000_000_123_456_789,
                "step": 10,
                "mirrored_at": 1_700_000_100.5,
            }
        },
    }
    assert MANIFEST_NAME == ".mirrord-manifest.json"


def test_round_trip_keeps_every_field_exactly() -> None:
    """Nanosecond mtimes and sizes beyond 2**53 survive (JSON integers, not floats)."""
    made = (entry(), entry("step_0001.pt", size=2**60, step=None), entry("a/b/c/x.pt", step=0))
    entries = {e.path: e for e in made}
    assert Manifest.from_bytes(Manifest(entries).to_bytes()).entries == entries


def test_serialisation_is_deterministic() -> None:
    a, b = entry("b.pt"), entry("a.pt")
    assert Manifest({"b.pt": a, "a.pt": b}).to_bytes() == Manifest({"a.pt": b, "b.pt": a}).to_bytes()


def test_absent_manifest_is_empty(tmp_path: Path) -> None:
    assert len(Manifest.load(tmp_path)) == 0


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b'{"schema": "mirrord-manifest", "version": 1, "entries": {', id="truncated"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(b"[]", id="not-an-object"),
        pytest.param(b'{"schema": "other", "version": 1, "entries": {}}', id="wrong-schema"),
        pytest.param(b'{"schema": "mirrord-manifest", "version": 2, "entries": {}}', id="future-version"),
        pytest.param(b'{"schema": "mirrord-manifest", "version": 1}', id="no-entries"),
        pytest.param(doc({"a.pt": {k: v for k, v in GOOD.items() if k != "size"}}), id="entry-without-size"),
        pytest.param(doc({"a.pt": {**GOOD, "size": "big"}}), id="size-not-a-number"),
        pytest.param(doc({"a.pt": {**GOOD, "hash": "abc"}}), id="hash-not-an-object"),
        pytest.param(doc([]), id="entries-not-an-object"),
        pytest.param(doc({"a.pt": []}), id="entry-not-an-object"),
        pytest.param(doc({"../../etc/passwd": GOOD}), id="path-escapes-the-root"),
        pytest.param(doc({"/etc/passwd": GOOD}), id="absolute-path"),
        pytest.param(doc({"a.pt": {**GOOD, "hash": {"algo": "md5", "digest": "0"}}}), id="unknown-algorithm"),
    ],
)
def test_corrupt_manifest_raises_manifest_error_naming_the_file(tmp_path: Path, data: bytes) -> None:
    """Nothing may be trusted from a manifest that does not parse completely: one typed error, no crash."""
    (tmp_path / MANIFEST_NAME).write_bytes(data)
    with pytest.raises(ManifestError) as info:
        Manifest.load(tmp_path)
    assert info.value.path == str(tmp_path / MANIFEST_NAME)
    assert not info.value.transient


def test_unreadable_manifest_raises_manifest_error(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).mkdir()  # EISDIR on read: a real I/O error, even for root
    with pytest.raises(ManifestError, match="cannot read"):
        Manifest.load(tmp_path)


def test_record_and_remove_persist_every_change() -> None:
    written: list[bytes] = []
    manifest = Manifest(persist=written.append)
    manifest.record(entry("a.pt"))
    manifest.record(entry("b.pt"))
    manifest.remove("a.pt")
    manifest.remove("never-there.pt")  # nothing changes, nothing is written
    assert len(written) == 3
    assert list(Manifest.from_bytes(written[-1]).entries) == ["b.pt"]
    assert Manifest.from_bytes(written[-1]).entries == manifest.entries


class PersistError(Exception):
    pass


def _failing(_data: bytes) -> None:
    raise PersistError("disk full")


def test_failed_persist_rolls_back_a_new_entry() -> None:
    """Memory never claims what the disk does not record."""
    manifest = Manifest(persist=_failing)
    with pytest.raises(PersistError):
        manifest.record(entry("a.pt"))
    assert manifest.get("a.pt") is None and len(manifest) == 0


def test_failed_persist_restores_a_replaced_entry() -> None:
    old = entry("a.pt", size=1)
    manifest = Manifest({"a.pt": old}, persist=_failing)
    with pytest.raises(PersistError):
        manifest.record(entry("a.pt", size=2))
    assert manifest.get("a.pt") == old


def test_failed_persist_restores_a_removed_entry() -> None:
    old = entry("a.pt")
    manifest = Manifest({"a.pt": old}, persist=_failing)
    with pytest.raises(PersistError):
        manifest.remove("a.pt")
    assert manifest.entries == {"a.pt": old}


def test_entries_is_a_snapshot() -> None:
    manifest = Manifest()
    view = manifest.entries
    manifest.record(entry("a.pt"))
    assert view == {} and list(manifest.entries) == ["a.pt"]


def test_concurrent_records_all_reach_the_disk_in_order() -> None:
    """Each persisted document contains every change made before it (writes happen under the lock)."""
    written: list[bytes] = []
    manifest = Manifest(persist=written.append)

    def worker(n: int) -> None:
        for i in range(25):
            manifest.record(entry(f"w{n}/step_{i}.pt", step=i))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sizes = [len(Manifest.from_bytes(w)) for w in written]
    assert sizes == list(range(1, 201))
    assert Manifest.from_bytes(written[-1]).entries == manifest.entries


def test_local_mirror_persists_atomically_and_reloads(tmp_path: Path) -> None:
    mirror = LocalMirror(tmp_path)
    manifest = mirror.read_manifest()
    manifest.record(entry())
    assert names(tmp_path) == [MANIFEST_NAME]  # no .part left
    assert Manifest.load(tmp_path).entries == {"run/step_0010.pt": entry()}
    mirror.read_manifest().remove("run/step_0010.pt")
    assert len(Manifest.load(tmp_path)) == 0


def test_local_mirror_write_failure_is_a_manifest_error_and_rolls_back(tmp_path: Path) -> None:
    """A directory squatting on the temp name makes the write fail for real; the old file stays."""
    mirror = LocalMirror(tmp_path)
    manifest = mirror.read_manifest()
    manifest.record(entry("a.pt"))
    before = (tmp_path / MANIFEST_NAME).read_bytes()
    (tmp_path / f"{MANIFEST_NAME}.part").mkdir()
    with pytest.raises(ManifestError) as info:
        manifest.record(entry("b.pt"))
    assert info.value.path == str(tmp_path / MANIFEST_NAME)
    assert list(manifest.entries) == ["a.pt"]
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before
