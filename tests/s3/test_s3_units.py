"""Folder units (HF, DCP) on an object store: every file under its final key, the manifest record as the
unit's commit point (S3 cannot rename a prefix)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mirrord.config import Config, load_config
from mirrord.core.units import group_units
from mirrord.store.s3 import S3Mirror, open_s3_mirror
from tests.s3.seaweed import SeaweedServer
from tests.support.folders import write_dcp, write_hf
from tests.support.mirror import hash_file
from tests.support.units import unit_verified
from tests.support.unitsync import sync_units

WRITERS: dict[str, tuple[str, Callable[[Path, int], list[Path]]]] = {
    "hf": ("checkpoint-{}", write_hf),
    "dcp": ("step_{}", write_dcp),
}


def _sync(config: Config) -> tuple[int, S3Mirror]:
    mirror = open_s3_mirror(config.mirror_url or "", config.s3)
    return sync_units(config, mirror), mirror


@pytest.mark.parametrize("layout", ["hf", "dcp"])
def test_folder_units_on_s3(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path, layout: str
) -> None:
    name, write = WRITERS[layout]
    primary = tmp_path / "primary"
    for step in (10, 20):
        write(primary / "run" / name.format(step), step)
    config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": f"s3://{bucket}/{prefix}",
            "layout": layout,
            "copy": {"settle_seconds": 0},
            "s3": {"endpoint_url": seaweed.endpoint, "part_size": 5 << 20},
        },
    )
    jobs, mirror = _sync(config)
    assert jobs == 2
    source = {p.relative_to(primary).as_posix(): p for p in primary.rglob("*") if p.is_file()}
    listed = mirror.snapshot(config.patterns, config.rules).files
    assert set(listed) == set(source)  # DCP's .metadata too
    entries = mirror.load_manifest().entries
    for rel, path in source.items():
        with mirror.open_read(rel) as fh:
            assert fh.read() == path.read_bytes()
        assert entries[rel].digest == hash_file(path, entries[rel].algo)
    units = group_units(listed.values(), config.rules)
    assert len(units) == 2 and all(unit_verified(u, entries) for u in units.values())
    assert _sync(config)[0] == 0  # nothing left to do


def test_a_changed_unit_replaces_the_old_copy_whole(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """A unit published again: the new files under the same keys, and a file the new copy no longer
    has is deleted from the bucket (the old copy's entries first, then its objects)."""
    primary = tmp_path / "primary"
    unit = primary / "run" / "checkpoint-10"
    write_hf(unit, 10)
    config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": f"s3://{bucket}/{prefix}",
            "layout": "hf",
            "copy": {"settle_seconds": 0},
            "s3": {"endpoint_url": seaweed.endpoint, "part_size": 5 << 20},
        },
    )
    _sync(config)
    (unit / "scheduler.pt").unlink()
    write_hf(primary / "tmp", 11)
    (primary / "tmp" / "optimizer.pt").replace(unit / "optimizer.pt")  # a rewritten file
    for leftover in (primary / "tmp").iterdir():
        leftover.unlink()
    (primary / "tmp").rmdir()
    jobs, mirror = _sync(config)
    assert jobs == 1
    listed = mirror.snapshot(config.patterns, config.rules).files
    source = {p.relative_to(primary).as_posix(): p for p in primary.rglob("*") if p.is_file()}
    assert set(listed) == set(source) and "run/checkpoint-10/scheduler.pt" not in listed
    entries = mirror.load_manifest().entries
    assert set(entries) == set(source)
    with mirror.open_read("run/checkpoint-10/optimizer.pt") as fh:
        assert fh.read() == (unit / "optimizer.pt").read_bytes()


def test_a_unit_is_never_merged_into_an_older_copy(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str]
) -> None:
    """Staging a unit again while an older copy is there writes beside it (KEY.part/), never over it:
    commit refuses until the old copy is deleted, abort leaves the old copy intact, and the staging area
    is listed as such (swept when dead), never as files."""
    from mirrord.store.s3 import S3Settings, S3UnitStaging

    mirror = S3Mirror(f"s3://{bucket}/{prefix}", S3Settings(endpoint_url=seaweed.endpoint))

    def stage(data: bytes) -> S3UnitStaging:
        staging = mirror.begin_unit("run/checkpoint-70")
        up = staging.upload("model.safetensors", len(data))
        up.write(memoryview(data))
        up.seal(0)
        up.commit()
        return staging

    first = stage(b"weights")
    first.commit()
    second = stage(b"new")
    rules = load_config(
        environ={}, overrides={"primary": "/", "mirror": "s3://x-y/z", "layout": "hf"}, check_roots=False
    ).rules
    snap = mirror.snapshot((), rules)
    assert list(snap.staging) == ["run/checkpoint-70.part"]
    assert "run/checkpoint-70.part/model.safetensors" not in snap.files
    with pytest.raises(FileExistsError):
        second.commit()
    second.abort()
    with mirror.open_read("run/checkpoint-70/model.safetensors") as fh:
        assert fh.read() == b"weights"
    assert not mirror.snapshot((), rules).staging
    third = stage(b"newer")
    old = mirror.stat("run/checkpoint-70")
    assert old is not None and mirror.delete_folder("run/checkpoint-70", old)
    third.commit()
    with mirror.open_read("run/checkpoint-70/model.safetensors") as fh:
        assert fh.read() == b"newer"
    assert set(mirror.snapshot((), rules).files) == {"run/checkpoint-70/model.safetensors"}
