"""The fast constructors of the per-file records build exactly what the dataclasses' __init__ builds."""

import dataclasses
import re

import pytest

from mirrord.core.model import FileState, ManifestEntry, make_file_state, make_manifest_entry, step_of, step_reader


def test_make_file_state_sets_every_field_like_the_dataclass() -> None:
    values = [f"v{i}" for i, _ in enumerate(dataclasses.fields(FileState))]
    made = make_file_state(*values)  # type: ignore[arg-type]
    assert made == FileState(*values)  # type: ignore[arg-type]
    assert type(made) is FileState
    assert [getattr(made, f.name) for f in dataclasses.fields(FileState)] == values


def test_make_manifest_entry_sets_every_field_like_the_dataclass() -> None:
    values = [f"v{i}" for i, _ in enumerate(dataclasses.fields(ManifestEntry))]
    made = make_manifest_entry(*values)  # type: ignore[arg-type]
    assert made == ManifestEntry(*values)  # type: ignore[arg-type]
    assert type(made) is ManifestEntry
    assert [getattr(made, f.name) for f in dataclasses.fields(ManifestEntry)] == values


def test_fast_built_records_stay_frozen() -> None:
    state = make_file_state("a.pt", 1, 2, 3, 4, 5, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.size = 7  # type: ignore[misc]
    assert dataclasses.replace(state, size=7) == FileState("a.pt", 7, 2, 3, 4, 5, 6)


def test_step_reader_reads_each_name_as_step_of_does() -> None:
    """A name seen again (another run, the other side) gives the same step; a name without one, or with a
    group that is no number, gives None; the folder never counts (the reader is given bare names)."""
    regex = re.compile(r"step_(\d+|x)")
    read = step_reader(regex)
    names = ["a/step_10.pt", "b/step_10.pt", "step_10.pt", "step_3/final.pt", "a/step_x.pt", "a/last.pt",
             "a/step_10.pt"]
    read_names = [read(rel.rpartition("/")[2]) for rel in names]
    assert read_names == [step_of(rel, regex) for rel in names] == [10, 10, 10, None, None, None, 10]

