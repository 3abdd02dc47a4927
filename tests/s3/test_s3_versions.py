"""No verified copy on an S3 mirror is replaced by a weaker one (issue 41 item 4), as on a local one
(tests/integration/test_record.py): a real daemon, a real SeaweedFS, real legacy torch.save files."""

from __future__ import annotations

import time
from pathlib import Path

from mirrord.core.model import PENDING, VERSIONS, version_key
from mirrord.store.s3 import S3Mirror, S3Settings
from tests.integration.test_record import _committed, _legacy_save
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


def _stored(mirror: S3Mirror, rel: str) -> bytes:
    with mirror.open_read(rel) as f:
        return f.read()


def _version_recorded(mirror: S3Mirror, size: int) -> None:
    """Wait until the manifest records a pending version of r/step_3.pt of `size` bytes."""

    def recorded() -> bool:
        version = mirror.load_manifest().entries.get(version_key("r/step_3.pt"))
        return version is not None and (version.role, version.size) == (PENDING, size)

    wait_for(recorded, 60, f"a version of r/step_3.pt of {size} bytes recorded")


def test_a_torn_rewrite_is_kept_beside_the_verified_object_and_a_whole_one_takes_the_name_after_a_newer_step(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Case 5 on S3: step_1..3 saved by temp file and rename in a format no validator reads; the job restarts
    and dies half-way through rewriting step_3.pt in place. The torn bytes are uploaded beside the verified
    object (under .mirrord-versions/), never over it: the object, `mirrord latest` and `mirrord restore` keep
    the good step 3. The job then saves step 3 again, whole, in place, then step 4: a later save proves step
    3's returned, the new step 3 takes the name (a server-side copy), the old one is kept aside, still
    recorded, and retention (keep_last 10) retires it later through its guards; no version object is left."""
    url = f"s3://{bucket}/{prefix}"
    primary = tmp_path / "primary"
    (primary / "r").mkdir(parents=True)
    prune = {"enabled": True, "keep_last": 10, "min_age_seconds": 0}
    d = DaemonProcess(
        tmp_path,
        primary,
        Path("/unused"),
        env=s3_env,
        settings={"mirror": url, "s3": _settings(seaweed), "watch": {"rescan_interval_seconds": 1}, "prune": prune},
    )
    d.settings["mirror"] = url
    d.write_config()
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    try:
        d.start()
        good = []
        for step in (1, 2, 3):
            good.append(_legacy_save(primary / "r" / f"step_{step}.pt", step))
            _committed(d, f"r/step_{step}.pt", 1)
        assert {e.validation for e in mirror.load_manifest().entries.values()} == {"renamed"}

        torn = _legacy_save(primary / "r" / "step_3.pt", 3, width=128, rename=False, torn=True)
        _committed(d, "r/step_3.pt", 2)
        assert _stored(mirror, "r/step_3.pt") == good[2]
        _version_recorded(mirror, len(torn) // 2)  # the torn file, once it stopped changing
        assert _stored(mirror, f"{VERSIONS}/r/step_3.pt") == torn[: len(torn) // 2]
        entry = mirror.load_manifest().entries["r/step_3.pt"]
        assert (entry.size, entry.validation) == (len(good[2]), "renamed")
        latest = run_mirrord("latest", "--config", d.config_path, env=s3_env)
        assert latest.stdout.strip() == f"{url}/r/step_3.pt", latest.stderr
        restored = run_mirrord("restore", "--config", d.config_path, "--to", tmp_path / "restored", env=s3_env)
        assert restored.returncode == 0, restored.stderr
        assert (tmp_path / "restored" / "r" / "step_3.pt").read_bytes() == good[2]

        new = _legacy_save(primary / "r" / "step_3.pt", 3, width=96, rename=False)
        _version_recorded(mirror, len(new))
        assert _stored(mirror, "r/step_3.pt") == good[2]
        version = mirror.stat(f"{VERSIONS}/r/step_3.pt")
        assert version is not None and version.size == len(new)
        # Step 4 saved in a later second than step 3's upload (a trainer: minutes later), so that the name's
        # object, copied from it on the server, has a LastModified of its own, which the record must hold.
        uploaded_s = version.mtime_ns // 10**9
        wait_for(lambda: time.time() >= uploaded_s + 1, 5, "the next second")
        _legacy_save(primary / "r" / "step_4.pt", 4)
        assert d.wait_event("copy.version_promoted", path="r/step_3.pt", timeout=60)["kept_aside"]
        assert _stored(mirror, "r/step_3.pt") == new
        wait_for(lambda: d.events("prune.deleted", kind="step", step=3), 60, "the old step 3 retired")
        previous = d.events("prune.deleted", kind="step", step=3)[0]["path"]
        assert previous.startswith(f"{VERSIONS}/r/step_3.pt@") and mirror.stat(previous) is None
        entries = mirror.load_manifest().entries
        assert previous not in entries and entries["r/step_3.pt"].size == len(new)
        promoted = mirror.stat("r/step_3.pt")
        assert promoted is not None and entries["r/step_3.pt"].unchanged(promoted)  # (else copied again)
        assert mirror.stat(f"{VERSIONS}/r/step_3.pt") is None  # promoted: its key deleted
        assert d.stop() == 0
    finally:
        d.kill()
