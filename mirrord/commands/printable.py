"""Untrusted text made safe for a terminal: anyone who can create a folder names the runs we print.

Control characters (C0, DEL, C1), bidirectional overrides and undecodable bytes are shown as Python
escapes (`\x1b`, `\u202e`, `\udcff`), so a name can neither set the window title, hide lines, move the
cursor nor write the clipboard (OSC 52), nor break one line of output into two.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` with every character a terminal would act on escaped."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)
