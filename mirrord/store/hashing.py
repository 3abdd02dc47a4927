"""Content hashes for the manifest. The algorithm is recorded next to every digest.

blake3 is the default: cryptographic strength at several GB/s, so hashing every byte costs the copy
little. xxh3_128 is faster but not collision resistant; sha256 is for sites that require it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO, Protocol

ALGORITHMS = ("blake3", "sha256", "xxh3_128")
HASH_BUFFER_BYTES = 8 * 1024 * 1024


class Hasher(Protocol):
    """An incremental hasher (hashlib's, blake3's or xxhash's)."""

    def update(self, data: bytes | memoryview, /) -> object:
        """Feed more bytes."""

    def hexdigest(self) -> str:
        """The digest of everything fed, in hex."""


def new_hasher(algo: str) -> Hasher:
    """A fresh incremental hasher for `algo` (one of ALGORITHMS)."""
    if algo == "blake3":  # each hash is imported when used: `latest` and `status` never hash
        import blake3

        return blake3.blake3()
    if algo == "sha256":
        import hashlib

        return hashlib.sha256()
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {', '.join(ALGORITHMS)}")


def hash_fd(fd: int, algo: str) -> tuple[int, str]:
    """Hash an open file from its current offset to EOF; returns (bytes read, hex digest)."""
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        return hash_stream(f, algo)


def hash_stream(stream: BinaryIO, algo: str, pace: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Hash a stream (a file, a mirror's open_read: every one has readinto, so no buffer is allocated per
    read) from where it is to its end; returns (bytes read, hex digest). `pace(n)` is told of every read."""
    hasher = new_hasher(algo)
    view = memoryview(bytearray(HASH_BUFFER_BYTES))
    total = 0
    while n := stream.readinto(view):  # type: ignore[attr-defined]  # (BinaryIO does not declare it)
        hasher.update(view[:n])
        total += n
        if pace is not None:
            pace(n)
    return total, hasher.hexdigest()
