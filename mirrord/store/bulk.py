"""Building a million records at once without the cycle collector walking them again and again.

Every container allocated counts towards a collection, and a full one walks every live container: a
scan or a manifest load of 1,000,000 files makes several full collections over millions of objects
(a tenth of the reconcile's CPU time) and frees nothing, since the records hold no cycles.
"""

from __future__ import annotations

import gc
from _thread import allocate_lock  # threading.Lock itself, without loading threading (see mirrord.store.atomic)
from collections.abc import Iterator
from contextlib import contextmanager

_lock = allocate_lock()
_holders = 0  # threads inside collection_paused(); the collector is back on when the last one leaves
_we_paused = False


@contextmanager
def collection_paused() -> Iterator[None]:
    """Pause the cycle collector while bulk-building acyclic records (reference counting still frees
    memory); nested and concurrent uses are safe, and a collector that was off stays off."""
    global _holders, _we_paused
    with _lock:
        if _holders == 0 and gc.isenabled():
            gc.disable()
            _we_paused = True
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _we_paused:
                _we_paused = False
                gc.enable()
