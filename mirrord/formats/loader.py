"""The drill's loader: `python -m mirrord.formats.loader LAYOUT ROOT KEY MEMORY_BYTES CPU_SECONDS` loads the
restored unit ROOT/KEY with its layout's own reader, in the process `mirrord drill` starts (the only one of the
drill that imports torch), bounded to MEMORY_BYTES of address space and CPU_SECONDS. Prints one JSON line:
{"loaded": [key]}, or {"file": key, "error": the loader's message} and exits 1."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # in a folder; a file unit is a torch.save file whatever its name


def load(path: Path, layout: str, in_folder: bool) -> bool:
    """Load `path` as its layout reads it: True, False for a file that reader leaves alone; raises what it raises."""
    import torch

    if path.name == ".metadata":  # dcp: the metadata, and every byte range it places in the storage files
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        for ref in FileSystemReader(path.parent).read_metadata().storage_data.values():
            size, end = (path.parent / ref.relative_path).stat().st_size, ref.offset + ref.length
            if size < end:
                raise EOFError(f"{ref.relative_path} has {size} bytes, the metadata places data up to byte {end}")
    elif path.suffix == ".safetensors":  # hf, hf_model: headers and every tensor, one at a time
        from safetensors import safe_open

        with safe_open(path, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors.get_tensor(name)
    elif not in_folder or (path.suffix in TORCH_SUFFIXES and layout not in ("hf", "hf_model", "dcp")):
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    else:
        return False
    return True


def main(layout: str, root: str, key: str, memory_bytes: str, cpu_seconds: str) -> int:
    """Print the verdict; exit 3, silent, when this user (nobody) cannot read the unit. Bounded first: its
    address space and CPU time, before torch is imported."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (int(memory_bytes),) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_seconds),) * 2)
    unit = Path(root, key)
    files = sorted(p for p in unit.rglob("*") if p.is_file()) if unit.is_dir() else [unit]
    if not all(os.access(p, os.R_OK) for p in files):
        return 3
    loaded = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            if load(path, layout, unit.is_dir()):
                loaded.append(rel)
        except Exception as exc:  # untrusted bytes: any exception is the loader's verdict on the file
            print(json.dumps({"file": rel, "error": f"{type(exc).__name__}: {exc}"}))
            return 1
    print(json.dumps({"loaded": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
