"""A folder nested deeper than a path can name (PATH_MAX, 4096 bytes): a listing error even for root."""

from __future__ import annotations

import os
from pathlib import Path


def deeper_than_path_max(root: Path) -> int:
    """Make root/d.../d... 18 x 251 bytes deep (> PATH_MAX) by descriptor; the deepest folder's descriptor
    (the caller closes it)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(18):
        os.mkdir("d" * 250, dir_fd=fd)
        child = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd
