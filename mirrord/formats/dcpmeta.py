"""What a torch.distributed.checkpoint `.metadata` file promises, read without torch and without
running the pickle.

`dcp.save(state, checkpoint_id=DIR)` (FileSystemWriter) writes the data files (`__0_0.distcp`, one or
more per rank) first and `.metadata` last: a pickle of torch dataclasses whose `storage_data` maps
every saved item to a `_StorageInfo(relative_path, offset, length)`. A folder is whole when `.metadata`
reads and every file it references is there, at least as long as the last byte range it holds.

`pickle.load` would import torch and run whatever the file names (torch's own FileSystemReader does
exactly that); here mirrord.formats.safepickle unpickles with inert stand-ins for every class, after
bounding how deeply its values nest, so a hostile file can name any callable and none runs.

    storage_references(data)   each referenced file -> the size it must have at least (pure)
    judge(needed, sizes)       (status, detail) given the sizes found (pure; a folder or one .distcp of
                               it over any store: mirrord.store.resume.dcp_check)
"""

from __future__ import annotations

from collections.abc import Mapping

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
FORMAT = "dcp"
# A .metadata lists one entry per tensor shard: a few MB for the largest models. Bigger is not one.
MAX_METADATA_BYTES = 256 * 1024 * 1024
_METADATA_CLASS = "torch.distributed.checkpoint.metadata.Metadata"


class MetadataError(ValueError):
    """The bytes are not a DCP .metadata this reader understands.

    `status` is the validator status it amounts to: "invalid" (torn, not DCP, an unsafe reference) or
    "unchecked" (a storage layer whose index this reader does not know).
    """

    def __init__(self, detail: str, status: str = "invalid") -> None:
        super().__init__(detail)
        self.status = status


def storage_references(data: bytes) -> dict[str, int]:
    """Each file the checkpoint's data lives in -> the size it must have at least (end of its last range).

    Raises MetadataError when the bytes are not such a pickle (torn, not DCP, or an unknown format).
    """
    if len(data) > MAX_METADATA_BYTES:
        raise MetadataError(f"{len(data)} bytes: too large for a .metadata file", "unchecked")
    from mirrord.formats import safepickle  # here: only a .metadata read needs pickle

    try:
        top = safepickle.load(data)
    except safepickle.UnreadableError as exc:
        raise MetadataError(str(exc)) from exc
    if not isinstance(top, safepickle.Instance) or top.cls != _METADATA_CLASS:
        raise MetadataError(f"holds a {_describe(top)}, not a torch.distributed.checkpoint Metadata")
    storage = top.fields().get("storage_data")
    if not isinstance(storage, Mapping) or not storage:
        raise MetadataError("no storage_data: written by a storage layer this reader does not know", "unchecked")
    needed: dict[str, int] = {}
    for info in storage.values():
        if not (isinstance(info, safepickle.Instance) and info.cls.endswith("._StorageInfo")):
            raise MetadataError(f"a storage_data entry is a {_describe(info)}, not a storage record", "unchecked")
        fields = info.fields()
        rel, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
        if not (
            isinstance(rel, str)
            and isinstance(offset, int)
            and isinstance(length, int)
            and _count(offset)
            and _count(length)
        ):
            raise MetadataError("a storage record lacks relative_path, offset or length")
        if not _safe_rel(rel):
            raise MetadataError(f"a storage record names an unsafe path: {rel!r}")
        needed[rel] = max(needed.get(rel, 0), offset + length)
    return needed


def judge(needed: Mapping[str, int], sizes: Mapping[str, int | None]) -> tuple[str, str]:
    """(status, detail) for a checkpoint whose referenced files have `sizes` (None: missing)."""
    for name in sorted(needed):
        size = sizes.get(name)
        if size is None:
            return "truncated", f"{name} is referenced by {METADATA_NAME} but missing"
        if size < needed[name]:
            return "truncated", f"{name} holds {size} bytes; {METADATA_NAME} places data up to byte {needed[name]}"
    return "ok", f"{len(needed)} file(s) referenced by {METADATA_NAME}, each present with its size"


def _safe_rel(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _describe(value: object) -> str:
    from mirrord.formats import safepickle

    return value.cls if isinstance(value, safepickle.Instance) else type(value).__name__
