"""read_object parses what json.loads parses, whatever the chunk boundaries and the whitespace."""

import json
from typing import Any

import pytest

from mirrord.store import jsonstream
from mirrord.store.jsonstream import NotAnObjectError, read_object

DOC = {
    "schema": "s", "version": 1, "journal": 12345678901234567890,
    "entries": {
        "a/step_1.pt": {"size": 10, "hash": {"algo": "blake3", "digest": "ab" * 32}, "mirrored_at": 1.5e9},
        'we"ird/\\name\u00e9\u4e2d.pt': {"size": 0, "list": [1, 2.5, None, True, "x,}"], "neg": -3e-7},
        "x": {},
        "lone\udcff": {"n": 123456789012345678901234567890},
    },
    "after": [{"k": "v"}],
}


def _parse(data: bytes, size: int) -> tuple[dict[str, Any], list[tuple[str, Any]], bool]:
    got: list[tuple[str, Any]] = []
    doc, found = read_object((data[i:i + size] for i in range(0, len(data), size)), "entries",
                             lambda k, v: got.append((k, v)))
    return doc, got, found


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("ascii_only", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1 << 20])
def test_every_chunking_and_layout_gives_what_json_loads_gives(indent: int | None, ascii_only: bool, size: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonstream, "LOOKAHEAD_CHARS", 5)  # boundaries inside every member, not only big ones
    data = json.dumps(DOC, indent=indent, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    doc, got, found = _parse(data, size)
    want = json.loads(data)
    assert found
    assert got == list(want.pop("entries").items())
    assert doc == want


def test_a_bom_and_surrounding_whitespace_are_accepted_as_json_loads_accepts_them() -> None:
    data = b"\xef\xbb\xbf \n" + json.dumps(DOC).encode("utf-8", "surrogatepass") + b"\n\n"
    assert json.loads(data)["schema"] == "s"
    doc, got, found = _parse(data, 4)
    assert found and len(got) == 4 and doc["after"] == [{"k": "v"}]


def test_without_the_member_and_empty_objects() -> None:
    assert _parse(b'{"a": 1}', 3) == ({"a": 1}, [], False)
    assert _parse(b"{}", 1) == ({}, [], False)
    assert _parse(b'{"entries": {}}', 1) == ({}, [], True)


@pytest.mark.parametrize("bad", [b"", b'{"a": 1', b'{"a": 1}x', b'{"a" 1}', b'{"entries": {"k": }}',
                                 b'{"entries": {"k": 1,}}', b'{"entries": {"k": 1} "b": 2}', b'{"a": 1}{}',
                                 b'{"entries": {"k": "\xff"}}', b'{"a": tru}', b'{"entries": {"k": 12'])
def test_what_json_loads_refuses_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(bad)
    for size in (1, 5, 1 << 20):
        with pytest.raises(ValueError):
            _parse(bad, size)


def test_a_document_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ValueError):
        _parse(b"[]", 1)


def test_a_member_that_is_not_an_object_is_named() -> None:
    with pytest.raises(NotAnObjectError):
        _parse(b'{"entries": [1, 2]}', 4)
