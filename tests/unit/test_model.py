"""The per-file records and reading a step from a name."""

import re

from mirrord.core.model import step_of, step_reader


def test_step_reader_reads_each_name_as_step_of_does() -> None:
    """A name seen again (another run, the other side) gives the same step; a name without one, or with a
    group that is no number, gives None; the folder never counts (the reader is given bare names)."""
    regex = re.compile(r"step_(\d+|x)")
    read = step_reader(regex)
    names = ["a/step_10.pt", "b/step_10.pt", "step_10.pt", "step_3/final.pt", "a/step_x.pt", "a/last.pt",
             "a/step_10.pt"]
    read_names = [read(rel.rpartition("/")[2]) for rel in names]
    assert read_names == [step_of(rel, regex) for rel in names] == [10, 10, 10, None, None, None, 10]

