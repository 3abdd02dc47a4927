"""The storage seam's contract (mirrord.store.mirror.Mirror), tested through the interface only.

Every implementation must pass these. `mirror_store` gives handles on one fresh, empty store; nothing
else here may know which implementation it is testing. A local implementation adds its name to `STORES`
and a branch in `_open_store`; one that needs a server overrides `mirror_store` in a module of its own
that star-imports these tests (the S3 mirror: tests/s3/test_contract.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mirrord.commands.verify import Finding, check_entry, deep_check, verify_mirror
from mirrord.core.model import FileState, ManifestEntry
from mirrord.errors import LockedError, MirrordError, SizeMismatchError
from mirrord.store.hashing import hash_stream
from mirrord.store.mirror import Mirror, ReadableStore, UnitStaging
from mirrord.store.resume import latest_key
from mirrord.store.targets import mirror_for
from mirrord.store.volume import ChangedError
from tests.support.checkpoints import checkpoint_bytes

STORES = ["local"]
PATTERNS = ("*.pt", "*.safetensors", "*.json")

MirrorFactory = Callable[[], Mirror]


def read_fully(store: ReadableStore, key: str) -> bytes:
    """A small object's whole content, read through the store."""
    with store.open_read(key) as f:
        return f.read()


@contextlib.contextmanager
def _open_store(kind: str, tmp_path: Path) -> Iterator[MirrorFactory]:
    if kind == "local":
        root = tmp_path / "mirror"
        yield lambda: mirror_for(root)
        return
    raise AssertionError(f"unknown store {kind}")


@pytest.fixture(params=STORES)
def mirror_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MirrorFactory]:
    """A factory of handles on one fresh, empty mirror (several handles: to test the lock)."""
    with _open_store(request.param, tmp_path) as factory:
        yield factory


@pytest.fixture
def mirror(mirror_store: MirrorFactory) -> Iterator[Mirror]:
    """One handle, holding the lock (as every writer does)."""
    m = mirror_store()
    with m.lock():
        yield m


def publish(mirror: Mirror, key: str, data: bytes, mtime_ns: int | None = None) -> int | None:
    """begin_upload -> write -> seal -> commit, as the copier does; returns the stored mtime (from
    commit where only publishing knows it, else from seal; None if the store keeps none)."""
    upload = mirror.begin_upload(key, len(data))
    try:
        upload.write(memoryview(data))
        stored = upload.seal(mtime_ns if mtime_ns is not None else time.time_ns())
        published = upload.commit()
    except BaseException:
        upload.abort()
        raise
    return stored if published is None else published


def publish_in(unit: UnitStaging, rel: str, data: bytes) -> None:
    """One file of a folder unit, uploaded whole and committed into the unit's staging."""
    upload = unit.upload(rel, len(data))
    upload.write(memoryview(data))
    upload.seal(time.time_ns())
    upload.commit()


def assert_empty(mirror: Mirror) -> None:
    """Nothing under any key: neither a file nor a partial upload."""
    snap = mirror.snapshot(PATTERNS)
    assert not snap.files and not snap.partials


def entry(key: str, size: int) -> ManifestEntry:
    return ManifestEntry(key, size, "blake3", "00" * 32, 1_700_000_000_000_000_000, 1, 1_700_000_000.0)


def record(mirror: Mirror, e: ManifestEntry) -> None:
    """Record one entry in the mirror's manifest (the caller holds the lock)."""
    manifest = mirror.read_manifest()
    manifest.record(e)
    manifest.close()


# -- upload ---------------------------------------------------------------------------------------------
def test_an_upload_is_invisible_until_commit_then_whole(mirror: Mirror) -> None:
    """Nothing under the key before commit (neither stat nor the listing); after, exactly the bytes."""
    data = b"checkpoint bytes " * 1000
    upload = mirror.begin_upload("run/step_1.pt", len(data))
    upload.write(memoryview(data[:100]))
    upload.write(memoryview(data[100:]))
    upload.seal(1_700_000_000_000_000_000)
    assert mirror.stat("run/step_1.pt") is None
    assert "run/step_1.pt" not in mirror.snapshot(PATTERNS).files
    upload.commit()
    state = mirror.stat("run/step_1.pt")
    assert state is not None and state.size == len(data) and state.is_regular
    assert read_fully(mirror, "run/step_1.pt") == data
    assert set(mirror.snapshot(PATTERNS).files) == {"run/step_1.pt"}


def test_seal_returns_the_stored_mtime(mirror: Mirror) -> None:
    """The mtime seal (or commit) reports is the one stat shows afterwards (None: the store keeps none)."""
    stored = publish(mirror, "step_2.pt", b"x" * 10, mtime_ns=1_700_000_000_123_456_789)
    state = mirror.stat("step_2.pt")
    assert state is not None
    if stored is not None:
        assert state.mtime_ns == stored


def test_skip_reads_back_as_zeros(mirror: Mirror) -> None:
    upload = mirror.begin_upload("sparse_step_3.pt", 4 + 1000 + 4)
    upload.write(memoryview(b"head"))
    upload.skip(1000)
    upload.write(memoryview(b"tail"))
    upload.seal(time.time_ns())
    upload.commit()
    assert read_fully(mirror, "sparse_step_3.pt") == b"head" + bytes(1000) + b"tail"


def test_a_trailing_hole_keeps_its_size(mirror: Mirror) -> None:
    upload = mirror.begin_upload("hole_step_4.pt", 8 + 4096)
    upload.write(memoryview(b"8 bytes!"))
    upload.skip(4096)
    upload.seal(time.time_ns())
    upload.commit()
    assert read_fully(mirror, "hole_step_4.pt") == b"8 bytes!" + bytes(4096)


def test_a_short_upload_fails_its_seal_and_leaves_nothing(mirror: Mirror) -> None:
    upload = mirror.begin_upload("short_step_5.pt", 100)
    upload.write(memoryview(b"only 20 bytes here.."))
    with pytest.raises(SizeMismatchError) as caught:
        upload.seal(time.time_ns())
    upload.abort()
    assert "short_step_5.pt" in caught.value.path
    assert mirror.stat("short_step_5.pt") is None
    assert_empty(mirror)


def test_abort_leaves_nothing_and_is_idempotent(mirror: Mirror) -> None:
    upload = mirror.begin_upload("run/step_6.pt", 10)
    upload.write(memoryview(b"0123456789"))
    upload.abort()
    upload.abort()
    assert mirror.stat("run/step_6.pt") is None
    assert_empty(mirror)


def test_abort_after_commit_keeps_the_object(mirror: Mirror) -> None:
    upload = mirror.begin_upload("step_7.pt", 3)
    upload.write(memoryview(b"abc"))
    upload.seal(time.time_ns())
    upload.commit()
    upload.abort()
    assert read_fully(mirror, "step_7.pt") == b"abc"


def test_commit_before_seal_is_refused(mirror: Mirror) -> None:
    upload = mirror.begin_upload("step_8.pt", 3)
    upload.write(memoryview(b"abc"))
    with pytest.raises(RuntimeError):
        upload.commit()
    upload.abort()
    assert mirror.stat("step_8.pt") is None


def test_a_republished_key_shows_the_old_bytes_until_commit(mirror: Mirror) -> None:
    publish(mirror, "step_9.pt", b"old")
    upload = mirror.begin_upload("step_9.pt", 5)
    upload.write(memoryview(b"newer"))
    upload.seal(time.time_ns())
    assert read_fully(mirror, "step_9.pt") == b"old"
    upload.commit()
    assert read_fully(mirror, "step_9.pt") == b"newer"


def test_a_retry_replaces_a_dead_upload_of_the_same_key(mirror: Mirror) -> None:
    """A writer that died mid-upload (never aborted) does not block the next upload of its key."""
    dead = mirror.begin_upload("step_10.pt", 100)
    dead.write(memoryview(b"partial"))
    publish(mirror, "step_10.pt", b"whole")
    assert read_fully(mirror, "step_10.pt") == b"whole"
    dead.abort()  # the late wake-up of the dead writer removes nothing of the retry's
    assert read_fully(mirror, "step_10.pt") == b"whole"


@pytest.mark.parametrize("key", ["/abs_step_1.pt", "../up_step_1.pt", "a/../b_step_1.pt", "./step_1.pt", ""])
def test_unsafe_keys_are_refused(mirror: Mirror, key: str) -> None:
    with pytest.raises(ValueError):
        mirror.stat(key)
    with pytest.raises(ValueError):
        mirror.begin_upload(key, 1)


# -- read, stat, list --------------------------------------------------------------------------------------
def test_reading_an_absent_key_raises_file_not_found(mirror: Mirror) -> None:
    assert mirror.stat("nothing_step_1.pt") is None
    with pytest.raises(FileNotFoundError):
        mirror.open_read("nothing_step_1.pt")
    with pytest.raises(FileNotFoundError):
        mirror.open_read("no/such/folder/step_1.pt")


def test_open_read_streams_large_objects_in_pieces(mirror: Mirror) -> None:
    data = bytes(range(256)) * 40_000  # 10 MB
    publish(mirror, "big_step_11.pt", data)
    got = bytearray()
    with mirror.open_read("big_step_11.pt") as f:
        while chunk := f.read(1 << 20):
            assert len(chunk) <= 1 << 20
            got += chunk
    assert bytes(got) == data


def test_snapshot_lists_matching_keys_in_folders_only(mirror: Mirror) -> None:
    for key in ("a/step_1.pt", "a/b/step_2.pt", "a/notes.txt", "model.safetensors"):
        publish(mirror, key, b"data")
    snap = mirror.snapshot(PATTERNS)
    assert set(snap.files) == {"a/step_1.pt", "a/b/step_2.pt", "model.safetensors"}
    assert snap.complete
    assert all(s.size == 4 and s.rel == k for k, s in snap.files.items())


def test_an_unfinished_upload_is_a_partial_never_a_file(mirror: Mirror) -> None:
    upload = mirror.begin_upload("run/step_12.pt", 10)
    upload.write(memoryview(b"01234"))
    snap = mirror.snapshot(PATTERNS)
    assert "run/step_12.pt" not in snap.files
    upload.abort()


def test_describe_names_the_store_and_the_key(mirror: Mirror) -> None:
    assert mirror.describe("run/step_1.pt").endswith("run/step_1.pt")
    assert mirror.describe()
    assert mirror.describe("run/step_1.pt") != mirror.describe()


def test_exists_once_locked(mirror: Mirror) -> None:
    assert mirror.exists()


# -- delete-if-unchanged -------------------------------------------------------------------------------------
def planned_then_republished(mirror: Mirror, key: str, data: bytes) -> FileState:
    """The state a deletion of `key` was planned on; `data` was published under the key since."""
    publish(mirror, key, b"planned")
    planned = mirror.stat(key)
    assert planned is not None
    publish(mirror, key, data)
    return planned


def test_delete_removes_the_planned_object(mirror: Mirror) -> None:
    publish(mirror, "run/step_13.pt", b"to delete")
    state = mirror.stat("run/step_13.pt")
    assert state is not None
    mirror.delete("run/step_13.pt", state)
    assert mirror.stat("run/step_13.pt") is None
    mirror.delete("run/step_13.pt", state)  # gone already: nothing to do


def test_delete_refuses_an_object_republished_since_it_was_planned(mirror: Mirror) -> None:
    planned = planned_then_republished(mirror, "step_14.pt", b"republished, longer")
    with pytest.raises(ChangedError) as caught:
        mirror.delete("step_14.pt", planned)
    assert "step_14.pt" in caught.value.path
    assert read_fully(mirror, "step_14.pt") == b"republished, longer"


# -- folder units --------------------------------------------------------------------------------------------
UNIT = {"model.safetensors": b"weights", "trainer_state.json": b"{}", "sub/optimizer.pt": b"optim"}


def test_a_committed_unit_has_every_file_under_its_key(mirror: Mirror) -> None:
    staging = mirror.begin_unit("run/checkpoint-50")
    assert staging.key == "run/checkpoint-50"
    for rel, data in UNIT.items():
        publish_in(staging, rel, data)
    staging.commit()
    for rel, data in UNIT.items():
        assert read_fully(mirror, f"run/checkpoint-50/{rel}") == data
    listed = set(mirror.snapshot(PATTERNS).files)
    assert listed == {
        "run/checkpoint-50/model.safetensors",
        "run/checkpoint-50/trainer_state.json",
        "run/checkpoint-50/sub/optimizer.pt",
    }


def test_an_aborted_unit_leaves_nothing(mirror: Mirror) -> None:
    staging = mirror.begin_unit("run/checkpoint-60")
    publish_in(staging, "model.safetensors", b"weights")
    staging.abort()
    staging.abort()
    assert mirror.stat("run/checkpoint-60/model.safetensors") is None
    assert not mirror.snapshot(PATTERNS).files


def test_a_unit_is_never_merged_into_an_existing_one(mirror: Mirror) -> None:
    first = mirror.begin_unit("checkpoint-70")
    for rel, data in UNIT.items():
        publish_in(first, rel, data)
    first.commit()
    second = mirror.begin_unit("checkpoint-70")
    publish_in(second, "model.safetensors", b"new")
    if second.replaces:  # the store replaces the older copy whole, itself: exactly the new files after
        second.commit()
        assert read_fully(mirror, "checkpoint-70/model.safetensors") == b"new"
        assert set(mirror.snapshot(PATTERNS).files) == {"checkpoint-70/model.safetensors"}
        return
    with pytest.raises(FileExistsError):
        second.commit()
    second.abort()
    assert read_fully(mirror, "checkpoint-70/model.safetensors") == b"weights"


def test_an_emptied_unit_folder_can_be_removed(mirror: Mirror) -> None:
    publish(mirror, "checkpoint-80/model.safetensors", b"w")
    assert mirror.delete_folder("checkpoint-80") is False
    state = mirror.stat("checkpoint-80/model.safetensors")
    assert state is not None
    mirror.delete("checkpoint-80/model.safetensors", state)
    assert mirror.delete_folder("checkpoint-80") is True
    assert mirror.delete_folder("checkpoint-80") is True  # already gone


# -- manifest ------------------------------------------------------------------------------------------------
def test_a_recorded_entry_is_seen_by_readers_and_survives_a_reopen(mirror_store: MirrorFactory) -> None:
    writer = mirror_store()
    with writer.lock():
        manifest = writer.read_manifest()
        manifest.record(entry("run/step_1.pt", 10))
        assert mirror_store().load_manifest().get("run/step_1.pt") == entry("run/step_1.pt", 10)
        manifest.close()
    again = mirror_store()
    with again.lock():
        assert set(again.read_manifest().entries) == {"run/step_1.pt"}


def test_an_empty_store_has_an_empty_manifest(mirror: Mirror) -> None:
    assert len(mirror.load_manifest()) == 0
    assert len(mirror.read_manifest()) == 0


def test_the_manifest_can_be_set_aside_for_a_rebuild(mirror: Mirror) -> None:
    record(mirror, entry("step_1.pt", 1))
    moved = mirror.set_manifest_aside(".damaged")
    assert moved and all(name.endswith(".damaged") for name in moved)
    assert len(mirror.load_manifest()) == 0
    assert mirror.set_manifest_aside(".damaged") == []


# -- lock, identity, space -------------------------------------------------------------------------------------
def test_one_lock_holder_at_a_time(mirror_store: MirrorFactory) -> None:
    first, second = mirror_store(), mirror_store()
    with first.lock():
        with pytest.raises(LockedError), second.lock():
            pass
        assert first.lock_problem() is None
    with second.lock():
        assert second.lock_problem() is None


def test_identity_holds_while_locked(mirror: Mirror) -> None:
    assert mirror.identity_problem() is None
    mirror.check_identity()


def test_space_is_known_or_none(mirror: Mirror) -> None:
    space = mirror.space()
    if space is not None:
        free, total = space
        assert 0 <= free <= total


def test_errors_name_the_key(mirror: Mirror) -> None:
    """Failures are MirrordErrors whose path is describe(key), not an internal name."""
    planned = planned_then_republished(mirror, "step_15.pt", b"republished, longer")
    with pytest.raises(MirrordError) as caught:
        mirror.delete("step_15.pt", planned)
    assert caught.value.path == mirror.describe("step_15.pt")


# -- the readers: verify and latest through the seam -----------------------------------------------------------
def _recorded(mirror: Mirror, key: str, data: bytes, step: int, mtime_ns: int) -> ManifestEntry:
    """Publish and record as the engine does (digest of the bytes, validation "ok")."""
    publish(mirror, key, data, mtime_ns)
    _, digest = hash_stream(io.BytesIO(data), "blake3")
    e = ManifestEntry(key, len(data), "blake3", digest, mtime_ns, step, 1_700_000_000.0, validation="ok")
    record(mirror, e)
    return e


def test_verify_reads_every_entry_back_through_the_store(mirror: Mirror) -> None:
    _recorded(mirror, "run/step_1.pt", checkpoint_bytes(1), 1, 1_700_000_000_000_000_000)
    bad = _recorded(mirror, "run/step_2.pt", checkpoint_bytes(2), 2, 1_700_000_001_000_000_000)
    record(mirror, dataclasses.replace(bad, digest="0" * 64))  # the bytes no longer match their record
    publish(mirror, "run/step_3.pt", b"unrecorded")
    checked, findings = verify_mirror(mirror, PATTERNS)
    assert checked == 2
    assert {(f.path, f.problem) for f in findings} == {
        ("run/step_2.pt", "hash_mismatch"),
        ("run/step_3.pt", "unrecorded"),
    }
    assert check_entry(mirror, dataclasses.replace(bad, path="run/step_9.pt")) == Finding(
        "run/step_9.pt", "missing", "in the manifest but not on the mirror"
    )
    assert deep_check(mirror, "run/step_1.pt") is None  # the torch zip validates from the stream
    deep = deep_check(mirror, "run/step_3.pt")
    assert deep is not None and deep.problem == "unchecked"  # no validator knows these bytes


def test_latest_answers_from_the_store_and_skips_a_damaged_newest(mirror: Mirror) -> None:
    _recorded(mirror, "run/step_1.pt", checkpoint_bytes(1), 1, 1_700_000_000_000_000_000)
    newest = _recorded(mirror, "run/step_2.pt", checkpoint_bytes(2), 2, 1_700_000_001_000_000_000)
    assert latest_key(mirror) == "run/step_2.pt"
    assert latest_key(mirror, verify=True) == "run/step_2.pt"
    record(mirror, dataclasses.replace(newest, digest="0" * 64))
    assert latest_key(mirror, verify=True) == "run/step_1.pt"
    assert latest_key(mirror, run_key="other") is None


def test_clone_publishes_the_same_bytes_under_a_second_key(mirror: Mirror) -> None:
    """An alias (last.ckpt) published from a stored twin: the new key holds exactly its bytes; the twin
    stays as it was; an existing key is replaced whole."""
    data = checkpoint_bytes(4, seed=7)
    stored = publish(mirror, "run/epoch=1-step=4.ckpt", data)
    publish(mirror, "run/last.ckpt", b"an older last.ckpt")
    twin = mirror.stat("run/epoch=1-step=4.ckpt")
    assert twin is not None and stored is not None
    state = mirror.clone("run/epoch=1-step=4.ckpt", "run/last.ckpt", twin)
    assert state is not None and state.size == len(data)
    assert read_fully(mirror, "run/last.ckpt") == data == read_fully(mirror, "run/epoch=1-step=4.ckpt")
    assert mirror.stat("run/last.ckpt") == state


def test_clone_of_a_source_that_changed_is_refused(mirror: Mirror) -> None:
    """The twin is no longer what was recorded (replaced since): nothing is published, the caller copies."""
    publish(mirror, "run/epoch=1-step=4.ckpt", checkpoint_bytes(4, seed=7))
    twin = mirror.stat("run/epoch=1-step=4.ckpt")
    assert twin is not None
    publish(mirror, "run/epoch=1-step=4.ckpt", checkpoint_bytes(4, seed=8) + b"longer")
    assert mirror.clone("run/epoch=1-step=4.ckpt", "run/last.ckpt", twin) is None
    assert mirror.stat("run/last.ckpt") is None
    assert mirror.clone("run/gone.ckpt", "run/last.ckpt", twin) is None


def test_rename_puts_a_version_over_its_name_and_keep_gives_a_second_name(mirror: Mirror) -> None:
    """A version promoted (mirrord.service.engine): the copy under the name is first kept under a second
    name (its bytes, the original untouched), then the version takes the name whole and its own key is gone."""
    old, new = checkpoint_bytes(3, seed=1), checkpoint_bytes(3, seed=2) + b"longer"
    publish(mirror, "run/step_3.pt", old)
    publish(mirror, ".mirrord-versions/run/step_3.pt", new)
    assert mirror.rename("run/step_3.pt", ".mirrord-versions/run/step_3.pt@1", keep=True)
    assert read_fully(mirror, ".mirrord-versions/run/step_3.pt@1") == old == read_fully(mirror, "run/step_3.pt")
    assert mirror.rename(".mirrord-versions/run/step_3.pt", "run/step_3.pt")
    assert read_fully(mirror, "run/step_3.pt") == new
    assert mirror.stat(".mirrord-versions/run/step_3.pt") is None
    assert set(mirror.snapshot(PATTERNS).versions) == {".mirrord-versions/run/step_3.pt@1"}
