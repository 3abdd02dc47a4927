"""`mirrord restore` and mirrord.torch.restore_latest from an S3 mirror (a real SeaweedFS), real torch.save files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mirrord.store.s3 import S3Mirror, S3Settings
from mirrord.torch import atomic_save, restore_latest
from tests.s3.seaweed import READER_KEY, READER_SECRET, SeaweedServer
from tests.s3.test_s3_commands import _config
from tests.support.cli import run_mirrord
from tests.support.drill import LAYOUT_TRAINERS, Trainer, restore_drill


def _train(run: Path, steps: list[int]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for step in steps:
        atomic_save({"step": step, "w": torch.randn(512, 512)}, run / f"step_{step:04d}.pt")


def test_restore_from_s3_publishes_the_newest_and_falls_back_past_a_damaged_object(
    seaweed: SeaweedServer,
    bucket: str,
    prefix: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run folder wiped: restore brings step 30 back from the bucket, identical, with its source mtime
    (sync then copies nothing); the object of step 30 damaged: nothing published, step 20 restored;
    restore_latest does the same from Python."""
    primary = tmp_path / "primary"
    _train(primary / "a", [10, 20, 30])
    originals = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (primary / "a").iterdir()}
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    shutil.rmtree(primary / "a")

    done = run_mirrord("restore", "--config", config, env=s3_env, timeout=300)
    assert done.returncode == 0, done.stderr
    restored = primary / "a" / "step_0030.pt"
    assert done.stdout.strip() == str(restored)
    assert (restored.read_bytes(), restored.stat().st_mtime_ns) == originals["step_0030.pt"]
    again = run_mirrord("sync", "--json", "--config", config, env=s3_env, timeout=300)
    assert again.returncode == 0 and json.loads(again.stdout)["copied"] == [], again.stderr

    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, addressing_style="path"))
    damaged = bytearray(originals["step_0030.pt"][0])
    damaged[len(damaged) // 2] ^= 0xFF
    mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/a/step_0030.pt", Body=bytes(damaged))
    elsewhere = tmp_path / "elsewhere"
    done = run_mirrord("restore", "--json", "--config", config, "--to", elsewhere, env=s3_env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["relative_path"] == "a/step_0020.pt"
    assert "DAMAGED" in done.stderr and "a/step_0030.pt" in done.stderr
    assert sorted(p.name for p in (elsewhere / "a").iterdir()) == ["step_0020.pt"]
    pinned = run_mirrord("restore", "--step", "30", "--config", config, "--to", tmp_path / "pinned", env=s3_env)
    assert pinned.returncode == 1 and "a/step_0030.pt" in pinned.stderr
    assert not (tmp_path / "pinned" / "a" / "step_0030.pt").exists()

    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    resume = restore_latest(url, tmp_path / "python")
    assert resume == tmp_path / "python" / "a" / "step_0020.pt"
    assert torch.load(resume, weights_only=True)["step"] == 20


def test_an_object_replaced_by_a_larger_one_is_never_read(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 41 case 3 on S3: the newest object replaced by a larger one (its bytes and 64 MiB more). latest
    names step 20 and restore brings step 20 back, naming the object and both sizes; neither sends a GET for
    the grown object (its HEAD size is compared with the record first; botocore's events count the GETs)."""
    from mirrord.store.restore import restore
    from mirrord.store.resume import latest_key

    primary = tmp_path / "primary"
    _train(primary / "a", [10, 20, 30])
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, addressing_style="path"))
    grown_key = f"{prefix}/a/step_0030.pt"
    recorded = (primary / "a" / "step_0030.pt").stat().st_size
    body = (primary / "a" / "step_0030.pt").read_bytes() + bytes(64 << 20)
    mirror.client.put_object(Bucket=bucket, Key=grown_key, Body=body)
    got: list[str] = []
    mirror.client.meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: got.append(params["Key"])
    )
    assert latest_key(mirror, "a") == "a/step_0020.pt"
    assert grown_key not in got
    restored = restore(mirror, tmp_path / "resume")
    assert restored.key == "a/step_0020.pt"
    assert [str(d) for d in restored.damaged] == [
        f"{url}/a/step_0030.pt: {len(body)} bytes on the mirror, recorded {recorded}: not restored"
    ]
    assert grown_key not in got and f"{prefix}/a/step_0020.pt" in got
    assert sorted(p.name for p in (tmp_path / "resume" / "a").iterdir()) == ["step_0020.pt"]


def test_an_object_replaced_while_restore_reads_it_is_passed_over(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 41 case 6 on S3: the newest object (two 8 MiB parts) replaced by other bytes once restore has
    read its first buffer: the ranged GET of the second part is refused (If-Match), and restore falls back to
    step 20, naming the object, instead of failing."""
    from mirrord.store.restore import restore

    primary = tmp_path / "primary"
    (primary / "a").mkdir(parents=True)
    for step in (20, 30):
        atomic_save({"step": step, "w": torch.randn(2048, 1536)}, primary / "a" / f"step_{step:04d}.pt")  # 12 MiB
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, addressing_style="path"))
    replaced: list[str] = []

    def replace_once(done: int, total: int, key: str) -> None:
        if key == "a/step_0030.pt" and not replaced:
            replaced.append(key)
            body = (primary / "a" / "step_0020.pt").read_bytes()
            mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)

    restored = restore(mirror, tmp_path / "resume", progress=replace_once)
    assert replaced and restored.key == "a/step_0020.pt"
    assert [d.path for d in restored.damaged] == [f"{url}/a/step_0030.pt"]
    assert torch.load(restored.path, weights_only=True)["step"] == 20


@pytest.mark.trainers
@pytest.mark.parametrize("trainer", LAYOUT_TRAINERS, ids=lambda t: t.layout)
def test_restore_drill_from_a_local_mirror_and_from_seaweedfs_with_no_config(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path, trainer: Trainer
) -> None:
    """Issue 41's drill for every layout (tests/support/drill.py restore_drill): `mirrord restore --mirror M --to D`
    with no config file brings the newest checkpoint back whole from a local mirror and from S3, with the files
    the layout's resume reads beside it (DeepSpeed's `latest`, Megatron's tracker, Lightning's `last.ckpt`); the
    library's own resume continues at the next step with the losses of an uninterrupted run."""
    from tests.s3.test_s3_commands import _settings

    figures = restore_drill(tmp_path, trainer, f"s3://{bucket}/{prefix}", _settings(seaweed), s3_env)
    print(f"restore drill figures ({trainer.layout}):", figures)


def test_read_only_credentials_run_the_read_only_commands(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Credentials that may only read and list: latest, verify and restore work; sync cannot write (exit 1)."""
    primary = tmp_path / "primary"
    _train(primary / "a", [10, 20])
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    reader = {**s3_env, "AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET}
    for argv in (["latest"], ["verify"], ["restore", "--to", str(tmp_path / "restored")]):
        done = run_mirrord(*argv, "--config", config, env=reader, timeout=300)
        assert done.returncode == 0, (argv, done.stderr)
    assert (tmp_path / "restored" / "a" / "step_0020.pt").read_bytes() == (primary / "a" / "step_0020.pt").read_bytes()
    _train(primary / "a", [30])
    refused = run_mirrord("sync", "--config", config, env=reader, timeout=300)
    assert refused.returncode != 0
    assert "AccessDenied" in refused.stderr + refused.stdout, refused.stderr


def test_an_hf_folder_comes_back_whole_from_s3_with_no_config(
    seaweed: SeaweedServer,
    bucket: str,
    prefix: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41 case 1 on S3: HF checkpoint-100 and -200 of exp1 mirrored with layout hf; the record alone
    tells restore_latest(url, dest, run="exp1") (no layout) that checkpoint-200 is a folder of five files."""
    from tests.support.folders import HF_FILES, write_hf

    primary = tmp_path / "primary"
    for step in (100, 200):
        write_hf(primary / "exp1" / f"checkpoint-{step}", step)
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, "hf", prune={"enabled": False})
    done = run_mirrord("sync", "--config", config, env=s3_env, timeout=300)
    assert done.returncode == 0, done.stderr

    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    resume = restore_latest(url, tmp_path / "restored", run="exp1")
    assert resume == tmp_path / "restored" / "exp1" / "checkpoint-200"
    assert sorted(p.name for p in resume.iterdir()) == sorted(HF_FILES)
    for name in HF_FILES:
        assert (resume / name).read_bytes() == (primary / "exp1" / "checkpoint-200" / name).read_bytes()


def test_a_file_of_several_parts_comes_back_whole_and_a_failed_or_damaged_part_publishes_nothing(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """A 20 MiB checkpoint (three 8 MiB parts: the first streamed, the others ranged GETs in parallel) comes
    back byte for byte; the ranged GET of its last part refused mid-restore: the error names
    the object, nothing is left under the final name nor a temp file; its last part damaged on the server: the
    hash refuses it (DamagedCopyError naming the object) and nothing is published."""
    from botocore.exceptions import ClientError

    from mirrord.errors import DamagedCopyError, MirrordError
    from mirrord.store.restore import restore

    primary = tmp_path / "primary"
    (primary / "a").mkdir(parents=True)
    atomic_save({"step": 30, "w": torch.randn(2048, 2560)}, primary / "a" / "step_0030.pt")
    original = (primary / "a" / "step_0030.pt").read_bytes()
    assert len(original) > 16 << 20
    url = f"s3://{bucket}/{prefix}"
    config = _config(tmp_path / "mirrord.toml", primary, url, seaweed, prune={"enabled": False})
    assert run_mirrord("sync", "--config", config, env=s3_env, timeout=300).returncode == 0
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint, addressing_style="path"))

    restored = restore(mirror, tmp_path / "whole")
    assert restored.path.read_bytes() == original

    def refuse_last_part(params: dict[str, Any], **_: Any) -> None:
        if params.get("headers", {}).get("Range", "").startswith(f"bytes={16 << 20}-"):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "revoked"}}, "GetObject")

    mirror.client.meta.events.register("before-call.s3.GetObject", refuse_last_part)
    with pytest.raises(MirrordError, match=r"a/step_0030\.pt") as refused:
        restore(mirror, tmp_path / "refused")
    assert not isinstance(refused.value, DamagedCopyError)
    assert list((tmp_path / "refused" / "a").iterdir()) == []
    mirror.client.meta.events.unregister("before-call.s3.GetObject", refuse_last_part)

    damaged = bytearray(original)
    damaged[len(damaged) - 100] ^= 0xFF
    mirror.client.put_object(Bucket=bucket, Key=f"{prefix}/a/step_0030.pt", Body=bytes(damaged))
    with pytest.raises(DamagedCopyError, match=r"a/step_0030\.pt.*does not match the manifest"):
        restore(mirror, tmp_path / "damaged")
    assert list((tmp_path / "damaged" / "a").iterdir()) == []
