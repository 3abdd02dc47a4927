"""The lease of an object-store mirror when the server hangs (SIGSTOP): it renews on its own thread, the
daemon's probes keep answering, and nothing is committed while the lease is not safe to publish under."""

from __future__ import annotations

from pathlib import Path

import pytest

from mirrord.core.model import ManifestEntry
from mirrord.errors import TransientError
from mirrord.store.s3 import S3Mirror, S3Settings
from tests.s3.seaweed import SeaweedServer
from tests.s3.test_s3_commands import _settings
from tests.support.checkpoints import save_checkpoint
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for

LEASE_SECONDS = 10  # the smallest allowed: safe for 2/3 of it after a renewal, calls bounded by 1 s


def _entry(path: str) -> ManifestEntry:
    return ManifestEntry(path, 1, "blake3", "0" * 64, 1, 1, 1.0)


def test_a_lease_not_renewed_in_time_refuses_every_commit_until_it_is(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str]
) -> None:
    mirror = S3Mirror(
        f"s3://{bucket}/{prefix}", S3Settings(endpoint_url=seaweed.endpoint, node="n", lease_seconds=LEASE_SECONDS)
    )
    with mirror.lock():
        manifest = mirror.read_manifest()
        manifest.record(_entry("run/step_1.pt"))
        upload = mirror.begin_upload("run/step_2.pt", 5)
        upload.write(memoryview(b"bytes"))
        upload.seal(0)
        seaweed.pause()
        try:
            wait_for(lambda: mirror.write_problem() is not None, 120, "the lease to go stale while the server hangs")
            problem = mirror.write_problem()
            assert problem is not None and "nothing is published until it is renewed" in problem
            assert mirror.lock_problem() is None  # not lost: nobody took it, it may come back
            # Refused before anything is sent (a request to the stopped server would hang, then time out):
            with pytest.raises(TransientError, match="nothing is published"):
                manifest.record(_entry("run/step_3.pt"))
            with pytest.raises(TransientError, match="nothing is published"):
                upload.commit()
        finally:
            seaweed.resume()
        wait_for(lambda: mirror.write_problem() is None, 120, "the lease renewed once the server answers")
        assert set(mirror.load_manifest().entries) == {"run/step_1.pt"}  # nothing refused came in late
        assert mirror.stat("run/step_2.pt") is None
        upload.commit()  # renewed with If-Match on our own ETag: nobody held it meanwhile, publishing resumes
        manifest.record(_entry("run/step_3.pt"))
    assert set(mirror.load_manifest().entries) == {"run/step_1.pt", "run/step_3.pt"}
    assert mirror.stat("run/step_2.pt") is not None


def _health(daemon: DaemonProcess) -> tuple[int, str]:
    return daemon.http("/healthz")


def test_daemon_probes_answer_while_the_server_hangs_and_it_publishes_only_under_a_renewed_lease(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    url = f"s3://{bucket}/{prefix}"
    primary = tmp_path / "primary"
    primary.mkdir()
    daemon = DaemonProcess(
        tmp_path,
        primary,
        Path("/unused"),
        env=s3_env,
        settings={"mirror": url, "s3": _settings(seaweed, node="hang", lease_seconds=LEASE_SECONDS)},
    )
    daemon.settings["mirror"] = url
    daemon.write_config()
    mirror = S3Mirror(url, S3Settings(endpoint_url=seaweed.endpoint))
    with daemon:
        save_checkpoint(primary / "run/step_1.pt", 1)
        wait_for(lambda: "run/step_1.pt" in mirror.load_manifest().entries, 180, "step 1 mirrored")
        assert daemon.metric("mirrord_mirror_writable") == 1
        seaweed.pause()
        try:
            save_checkpoint(primary / "run/step_2.pt", 2)  # due while the server hangs
            wait_for(
                lambda: _health(daemon)[0] == 503 and "nothing is published" in _health(daemon)[1],
                120,
                "/healthz to say the lease is not renewed",
            )
            assert daemon.metric("mirrord_mirror_writable") == 0  # /metrics answers too
            daemon.wait_event("s3.lease_stale", timeout=60)
            assert not daemon.events("copy.committed", path="run/step_2.pt")
        finally:
            seaweed.resume()
        wait_for(lambda: "run/step_2.pt" in mirror.load_manifest().entries, 300, "step 2 mirrored once renewed")
        wait_for(lambda: _health(daemon)[0] == 200, 120, "healthy again")
        assert daemon.metric("mirrord_mirror_writable") == 1
        events = [
            e
            for e in daemon.events()
            if e.get("event") in ("s3.lease_stale", "s3.lease_renewed")
            or (e.get("event") == "copy.committed" and e.get("path") == "run/step_2.pt")
        ]
        names = [e["event"] for e in events]
        # Published only after the lease was renewed: never while it was stale.
        assert names.index("s3.lease_stale") < names.index("s3.lease_renewed") < names.index("copy.committed")
    assert not daemon.events("mirror.lock_lost")


def test_a_lease_renewal_refused_at_once_is_retried_after_a_pause_not_in_a_loop(
    seaweed: SeaweedServer, bucket: str, prefix: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The server stopped under a running daemon (the README's quick start stopping weed): every renewal
    fails at once (connection refused), and each retry still waits a twelfth of the lease. The retry
    used to come at once, in a loop: 35,000 `s3.lease_renew_failed` lines in 40 s."""
    primary = tmp_path / "primary"
    primary.mkdir()
    url = f"s3://{bucket}/{prefix}"
    settings = _settings(seaweed, node="gone", lease_seconds=LEASE_SECONDS, timeout_seconds=5)
    daemon = DaemonProcess(tmp_path, primary, Path("/unused"), env=s3_env, settings={"mirror": url, "s3": settings})
    daemon.settings["mirror"] = url
    daemon.write_config()
    node_lease = f"{url}/.mirrord-leases/gone"
    with daemon:
        seaweed.stop()
        try:
            stale = daemon.wait_event("s3.lease_stale", timeout=120, path=node_lease)
            failed = daemon.events("s3.lease_renew_failed", path=node_lease)
            before_stale = [e for e in failed if e["timestamp"] <= stale["timestamp"]]
            assert any("Connection refused" in e["cause"] for e in before_stale), before_stale
            # Tries at least LEASE_SECONDS / 12 apart within the 2/3 of a lease it stays safe after the last
            # renewal: at most 9 (a loop makes hundreds).
            assert 1 <= len(before_stale) <= 9, len(before_stale)
        finally:
            seaweed.start()  # the session's server: the next tests need it
        daemon.wait_event("s3.lease_renewed", timeout=120, path=node_lease)
