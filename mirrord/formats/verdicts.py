"""The statuses a validator gives a checkpoint, apart from the validators: a reader of verdicts (the
manifest's, `mirrord latest`) needs the words, not the parsers, CRC-32 and ISA-L behind them."""

from __future__ import annotations

from typing import Final

OK, UNCHECKED, EMPTY = "ok", "unchecked", "empty"
TRUNCATED: Final = "truncated"
CRC_MISMATCH: Final = "crc_mismatch"
INVALID: Final = "invalid"
UNREADABLE: Final = "unreadable"
# An unchecked file its writer renamed into place (a commit): whole by construction, though no validator read it.
RENAMED: Final = "renamed"
PASSING = (OK, UNCHECKED, RENAMED)  # statuses a checkpoint may be published with
