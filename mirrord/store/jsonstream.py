"""Read one JSON object from a stream of bytes, handing the members of its one big member over as they
are parsed, so that neither the file's text nor its parsed tree is ever in memory whole.

A manifest of 1,000,000 entries is 260 MB of JSON; `json.loads` would hold the bytes, their text and
every entry's parsed dict at once (1.5 GB) before the first entry is decoded. Here the text is held a
chunk at a time and each member is parsed by the json module's own C scanner, then dropped.
"""

from __future__ import annotations

import codecs
import json
import json.decoder
import json.scanner
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

CHUNK_BYTES = 1 << 20
# The text kept parsed ahead of the position: a member longer than this is parsed again with more text.
LOOKAHEAD_CHARS = 1 << 16

# (text, index) -> (value, end), StopIteration if there is none: what json.loads runs, in C.
_scan_value: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WHITESPACE: re.Pattern[str] = json.decoder.WHITESPACE  # type: ignore[attr-defined]
_INCOMPLETE = (json.JSONDecodeError, StopIteration)


class NotAnObjectError(ValueError):
    """The big member's value is not a JSON object."""


class _Text:
    """The not yet parsed text of the stream: `s` from `i` on, refilled a chunk at a time."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        # As json.loads decodes bytes: UTF-8 (a BOM skipped), lone surrogates kept.
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogatepass")
        self.s = ""
        self.i = 0
        self.eof = False

    def more(self) -> None:
        """Append the next chunk's text (at the end of the stream, mark it so)."""
        chunk = next(self._chunks, None)
        if chunk is None:
            self.eof = True
        self.s = self.s[self.i:] + self._decoder.decode(chunk or b"", final=chunk is None)
        self.i = 0

    def ahead(self) -> None:
        """At least LOOKAHEAD_CHARS of text after the position, unless the stream ends first."""
        while len(self.s) - self.i < LOOKAHEAD_CHARS and not self.eof:
            self.more()

    def skip_space(self) -> str:
        """Skip whitespace; the next character ('' at the end of the stream)."""
        while True:
            self.ahead()
            if self.i < len(self.s) and self.s[self.i] in " \t\n\r":
                self.i = _WHITESPACE.match(self.s, self.i).end()  # type: ignore[union-attr]  # \s* always matches
                continue
            return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, char: str) -> None:
        if self.skip_space() != char:
            raise ValueError(f"expected {char!r} at character {self.i} of a chunk")
        self.i += 1

    def parse(self, scan: Callable[[str, int], tuple[Any, int]], at: int) -> Any:
        """`scan` at the position + `at`; with more text and again while it ends before its value does."""
        while True:
            try:
                value, end = scan(self.s, self.i + at)
            except _INCOMPLETE:
                if self.eof:
                    raise
                self.more()
                continue
            if end >= len(self.s) and not self.eof:  # a number may go on in the next chunk
                self.more()
                continue
            self.i = end
            return value

    def key(self) -> str:
        if self.skip_space() != '"':
            raise ValueError(f"expected a member name at character {self.i} of a chunk")
        key: str = self.parse(_scan_string, 1)
        self.expect(":")
        self.skip_space()
        return key


def read_object(
    chunks: Iterable[bytes],
    member: str,
    each: Callable[[str, Any], None],
    first: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Parse the one JSON object `chunks` hold, as `json.loads` would, except its member `member`.

    That member's value must be an object: `each(key, value)` is called for each of its members in
    order, which are not kept (`first(members so far)` is called before the first). Returns the other
    members (the last of equal names wins) and whether `member` was there. ValueError for anything that
    is not one JSON object (NotAnObjectError when `member` is not an object).
    """
    text = _Text(chunks)
    doc: dict[str, Any] = {}
    found = False
    try:
        text.expect("{")
        if text.skip_space() == "}":
            text.i += 1
        else:
            while True:
                name = text.key()
                if name == member:
                    found = True
                    if first is not None:
                        first(doc)
                    _members(text, each)
                else:
                    doc[name] = text.parse(_scan_value, 0)
                if text.skip_space() == ",":
                    text.i += 1
                    continue
                text.expect("}")
                break
        if text.skip_space() != "":
            raise ValueError(f"extra data after the object at character {text.i} of a chunk")
    except StopIteration as exc:
        raise ValueError(f"expected a value at character {exc.value} of a chunk") from None
    return doc, found


def _members(text: _Text, each: Callable[[str, Any], None]) -> None:
    """The members of the object at the position, each handed to `each` as soon as it is parsed."""
    if text.skip_space() != "{":
        raise NotAnObjectError(f"the member is not an object (at character {text.i} of a chunk)")
    text.i += 1
    if text.skip_space() == "}":
        text.i += 1
        return
    scan_value, scan_string = _scan_value, _scan_string
    while True:
        # The common case without a call per step: our own compact form, the member fully in the text.
        s, i = text.s, text.i
        if len(s) - i < LOOKAHEAD_CHARS and not text.eof:
            text.ahead()
            s, i = text.s, text.i
        try:
            if s[i] != '"':
                raise IndexError
            key, i = scan_string(s, i + 1)
            if s[i] != ":":
                raise IndexError
            value, i = scan_value(s, i + 1)
            if s[i] not in ",}":
                raise IndexError
        except (IndexError, *_INCOMPLETE):
            # Whitespace, a chunk boundary, or an error: the careful way (which raises for an error).
            key = text.key()
            value = text.parse(scan_value, 0)
            each(key, value)
            if text.skip_space() == ",":
                text.i += 1
                continue
            text.expect("}")
            return
        each(key, value)
        text.i = i + 1
        if s[i] == "}":
            return
