"""The per-file records and reading a step from a name."""

import re

from mirrord.core.model import step_of


def test_step_of_reads_the_name_only() -> None:
    """A name seen again (another run) gives the same step; a name without one, or with a group that is no
    number, gives None; the folder never counts."""
    regex = re.compile(r"step_(\d+|x)")
    names = [
        "a/step_10.pt",
        "b/step_10.pt",
        "step_10.pt",
        "step_3/final.pt",
        "a/step_x.pt",
        "a/last.pt",
        "a/step_10.pt",
    ]
    assert [step_of(rel, regex) for rel in names] == [10, 10, 10, None, None, None, 10]
