"""From a configured `mirror` to its store: above store/mirror.py, store/volume.py and store/s3/, so the
seam imports none of its implementations."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mirrord.store.mirror import Mirror


def mirror_for(target: str | os.PathLike[str], s3: Any = None) -> Mirror:
    """The Mirror implementation for a configured `mirror`: a directory path, or an `s3://bucket/prefix`
    URL (mirrord.store.s3, settings from the [s3] section given as `s3`)."""
    if isinstance(target, str) and target.startswith("s3://"):
        from mirrord.store.s3 import open_s3_mirror

        return open_s3_mirror(target, s3)
    from mirrord.store.volume import LocalMirror

    return LocalMirror(Path(target))
