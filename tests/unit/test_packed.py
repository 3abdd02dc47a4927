"""A packed manifest entry comes back exactly as it went in; what cannot is kept as it is."""

import dataclasses

import pytest

from mirrord.core.model import ManifestEntry
from mirrord.store.packed import Entries, pack, unpack

BASE = ManifestEntry("run/step_7.pt", 123, "blake3", "0f" * 32, 1_700_000_000_123_456_789, 7, 1.7e9 + 0.25)


@pytest.mark.parametrize("changes", [
    {}, {"step": None}, {"step": 0}, {"mirror_mtime_ns": 2_147_483_647 * 10**9}, {"mirror_mtime_ns": -5},
    {"validation": "ok"}, {"validation": "unchecked"}, {"mirror_ino": 2**63 - 1, "mirror_ctime_ns": 3},
    {"algo": "xxh3_128", "digest": "ab" * 16}, {"algo": "sha256", "digest": ""}, {"size": 0, "mirrored_at": 0.0},
])
def test_entries_that_pack_come_back_identical(changes: dict[str, object]) -> None:
    entry = dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]
    held = pack(entry)
    assert type(held) is bytes
    assert unpack(entry.path, held) == entry


@pytest.mark.parametrize("changes", [
    {"digest": "AB" * 32}, {"digest": "not hex"}, {"digest": "ab cd"}, {"size": 2**64}, {"step": -(2**63) - 1},
    {"validation": "something new"},
])
def test_entries_that_would_not_come_back_identical_are_kept_as_they_are(changes: dict[str, object]) -> None:
    entry = dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]
    assert pack(entry) is entry
    assert unpack(entry.path, entry) is entry


def test_entries_is_a_mapping_of_whole_entries() -> None:
    other = dataclasses.replace(BASE, path="b.pt", digest="AB" * 32)
    view = Entries({BASE.path: pack(BASE), other.path: pack(other)})
    assert view == {BASE.path: BASE, other.path: other}
    assert view.get("missing") is None and view.get(BASE.path) == BASE and "b.pt" in view and len(view) == 2
    assert list(view.values()) == [BASE, other]
