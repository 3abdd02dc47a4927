"""Sizes for people: binary units, one decimal ("1.5 GiB"). Messages that matter also give exact bytes."""

from __future__ import annotations

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB, whole bytes ('512 B')."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def bytes_both(n: int) -> str:
    """'1.5 GiB (1610612736 bytes)': readable, and exact for whoever does the arithmetic."""
    return f"{human_bytes(n)} ({n} bytes)"
