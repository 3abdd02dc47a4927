"""Python copy baselines, run as their own process so they pay interpreter start-up like `mirrord sync`.

python -m bench.tools shutil SRC DST    shutil.copy2 each file, fsync it, fsync its directory
python -m bench.tools naive SRC DST     read(1 MiB) / write / sha256, NAME.part, fsync, rename, fsync dir:
                                        the straightforward protocol the issue measured at 2.36x cp+sync
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_shutil(src: Path, dst: Path) -> None:
    for p in sorted(src.rglob("*.pt")):
        out = dst / p.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, out)
        _fsync_path(out)
        _fsync_path(out.parent, directory=True)


def copy_naive(src: Path, dst: Path) -> None:
    for p in sorted(src.rglob("*.pt")):
        out = dst / p.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        digest = hashlib.sha256()
        with p.open("rb") as fin, part.open("wb") as fout:
            while chunk := fin.read(1 << 20):
                digest.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        part.replace(out)
        _fsync_path(out.parent, directory=True)
        digest.hexdigest()


def main(argv: list[str]) -> int:
    mode, src, dst = argv
    {"shutil": copy_shutil, "naive": copy_naive}[mode](Path(src), Path(dst))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
