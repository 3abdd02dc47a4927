"""safepickle: the structure of a pickle, read without importing or calling anything it names."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrord.formats.safepickle import Instance, UnreadableError, load


@dataclass
class Info:
    relative_path: str
    offset: int
    length: int


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self) -> None:
        self.a, self.b = 1, "two"


class Runs:
    """Unpickling this with pickle would run os.system with the test's command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_objects_become_inert_instances_with_their_class_name_and_fields(protocol: int) -> None:
    """A dataclass (NEWOBJ + BUILD), shared by two dict keys (memo), reads as one Instance with its fields."""
    info = Info("__0_0.distcp", 10, 20)
    got = load(pickle.dumps({"a": info, "b": info, "c": [Slotted()]}, protocol=protocol))
    assert got["a"] is got["b"]
    assert isinstance(got["a"], Instance)
    assert got["a"].cls == f"{__name__}.Info"
    assert got["a"].fields() == {"relative_path": "__0_0.distcp", "offset": 10, "length": 20}
    assert got["c"][0].fields() == {"a": 1, "b": "two"}  # slots: BUILD with (None, {slot: value})


def test_nothing_the_pickle_names_is_called(tmp_path: Path) -> None:
    """A REDUCE of os.system is recorded, never run: the file the command would create never appears."""
    marker = tmp_path / "ran"
    data = pickle.dumps(Runs(f"touch {marker}"))
    got = load(data)
    assert isinstance(got, Instance)
    assert got.cls in ("posix.system", "os.system")
    assert got.args == (f"touch {marker}",)
    assert not marker.exists()


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(plain, st.sampled_from([3, 4, 5]))
def test_plain_data_reads_as_pickle_itself_reads_it(value: object, protocol: int) -> None:
    """Primitives, tuples, lists and dicts (all the opcodes protocols 3-5 use for them) round-trip."""
    assert load(pickle.dumps(value, protocol=protocol)) == value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=0, max_value=199))
def test_garbage_and_damaged_pickles_raise_unreadable_and_nothing_else(junk: bytes, cut: int) -> None:
    """Random bytes, a truncated pickle or a byte flipped in one: a value or UnreadableError, never a crash."""
    good = pickle.dumps({"k": [Info("f", 1, 2), (1, 2.5, b"x")]}, protocol=4)
    flipped = bytearray(good)
    flipped[cut % len(good)] ^= 0xFF
    for data in (junk, good[: cut % len(good)], bytes(flipped)):
        with contextlib.suppress(UnreadableError):
            load(data)


def test_persistent_ids_are_refused() -> None:
    """torch.save's data.pkl refers to storages by persistent id: another program's objects, not read."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> str | None:
            return "storage-0" if obj == "tensor" else None

    out = io.BytesIO()
    Pickler(out, protocol=4).dump(["tensor"])
    with pytest.raises(UnreadableError, match="PERSID"):
        load(out.getvalue())


def test_a_pickle_without_stop_is_truncated() -> None:
    data = pickle.dumps([1, 2, 3], protocol=4)
    with pytest.raises(UnreadableError):
        load(data[:-1])


@pytest.mark.parametrize("depth", [102, 1_000_000])
def test_values_nested_too_deep_are_refused_before_anything_is_built(depth: int) -> None:
    """A dict key nested a million tuples deep would be hashed by C code recursing until the process
    dies (SIGSEGV): the opcodes are walked first, and nesting past MAX_DEPTH is unreadable."""
    deep_key = b"\x80\x04}" + b")" + b"\x85" * depth + b"K\x01s."
    with pytest.raises(UnreadableError, match="nested more than 100 deep"):
        load(deep_key)
    deep_list = b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."  # APPEND: each list into the one below
    with pytest.raises(UnreadableError, match="nested more than 100 deep"):
        load(deep_list)


def test_nesting_up_to_the_limit_and_long_flat_containers_read() -> None:
    """Depth counts nesting, not size: 100 levels read, and so does a list of 100,000 lists (APPENDS in batches)."""
    nested: object = 1
    for _ in range(99):
        nested = [nested]
    assert load(pickle.dumps({"k": nested}, protocol=4)) == {"k": nested}
    flat = [[i] for i in range(100_000)]
    assert load(pickle.dumps(flat, protocol=4)) == flat
