"""The scrub (issue 43.1): a real daemon re-reads the mirror against the manifest, once per scrub.interval_days
(here a second's worth, so that a test sees several passes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mirrord.store.manifest import Manifest
from mirrord.store.resume import latest_checkpoint
from mirrord.store.scan import state_from_stat
from tests.integration.test_prometheus_e2e import PrometheusServer
from tests.support.checkpoints import publish_checkpoint
from tests.support.wait import wait_for

SCRUB_EVERY_SECOND = {"scrub": {"interval_days": 1 / 86400}}


def _cached_pages(path: Path) -> int:
    """How many pages of the file are in the page cache (util-linux fincore)."""
    done = subprocess.run(["fincore", "--noheadings", "--output", "PAGES", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def _flip_a_bit(path: Path) -> None:
    """One bit of the middle byte flipped in place, the mtime put back: rot that no stat shows but ctime."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_flipped_bit_is_found_and_copied_again_from_the_primary(tmp_path, daemon_factory):
    """The copy's size and mtime still match its record (no rescan notices): the scrub reads it, finds
    other bytes, hashes the primary (still the recorded bytes) and copies it again."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    d = daemon_factory(SCRUB_EVERY_SECOND).start()
    wait_for(lambda: Manifest.load(mirror).entries, 90, "mirrored")
    _flip_a_bit(mirror / "r" / "step_0001.pt")
    wait_for(
        lambda: (mirror / "r" / "step_0001.pt").read_bytes() == (primary / "r" / "step_0001.pt").read_bytes(),
        90,
        "the copy repaired",
    )
    assert d.events("scrub.recopy", path="r/step_0001.pt", problem="hash_mismatch")
    wait_for(lambda: d.metric("mirrord_scrub_last_complete_timestamp_seconds"), 90, "a pass completed")
    assert d.metric("mirrord_scrub_bytes_total") > 0
    assert d.metric("mirrord_damaged_copies") == 0
    assert not d.events("scrub.damaged")
    assert d.stop() == 0


def test_a_damaged_copy_the_primary_no_longer_holds_is_kept_and_reported(tmp_path, daemon_factory):
    """The primary rotated step 2 away; its mirror copy rots: kept as it is, logged once, counted on /metrics,
    `latest` answers with step 1, and a real Prometheus fires MirrordDamagedCopy; once the primary holds the
    bytes again (a restore) the copy is repaired and the alert resolves."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    publish_checkpoint(primary / "r" / "step_0002.pt", 2)
    d = daemon_factory(SCRUB_EVERY_SECOND).start()
    prom = PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{d.port}"])  # (its first scrape takes seconds)
    try:
        wait_for(lambda: len(Manifest.load(mirror).entries) == 2, 90, "both mirrored")
        saved = (primary / "r" / "step_0002.pt").read_bytes()
        (primary / "r" / "step_0002.pt").unlink()
        _flip_a_bit(mirror / "r" / "step_0002.pt")
        damaged = (mirror / "r" / "step_0002.pt").read_bytes()
        wait_for(lambda: d.metric("mirrord_damaged_copies") == 1, 90, "mirrord_damaged_copies 1")
        assert d.wait_event("scrub.damaged", path="r/step_0002.pt", problem="hash_mismatch", timeout=30)
        passes = len(d.events("scrub.finished"))
        wait_for(lambda: len(d.events("scrub.finished")) > passes + 1, 90, "two more passes")
        assert len(d.events("scrub.damaged")) == 1
        assert d.metric("mirrord_damaged_copies") == 1
        assert (mirror / "r" / "step_0002.pt").read_bytes() == damaged
        assert latest_checkpoint(mirror, run="r") == mirror / "r" / "step_0001.pt"
        prom.wait_query('ALERTS{alertname="MirrordDamagedCopy", alertstate="firing"}', timeout=60)
        (primary / "r" / "step_0002.pt").write_bytes(saved)
        wait_for(lambda: (mirror / "r" / "step_0002.pt").read_bytes() == saved, 90, "the copy repaired")
        wait_for(lambda: not prom.query('ALERTS{alertname="MirrordDamagedCopy"}'), 60, "the alert resolved")
    finally:
        prom.stop()
    assert d.stop() == 0


def test_a_touched_copy_is_confirmed_again(tmp_path, daemon_factory):
    """A copy whose mtime changed (the primary rotated it away, nothing copies it again) holds its recorded
    bytes: its record takes its current stat, so retention counts it again."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    publish_checkpoint(primary / "r" / "step_0001.pt", 1)
    d = daemon_factory(SCRUB_EVERY_SECOND).start()
    wait_for(lambda: Manifest.load(mirror).entries, 90, "mirrored")
    (primary / "r" / "step_0001.pt").unlink()
    copy = mirror / "r" / "step_0001.pt"
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns - 3600 * 10**9))
    copy.read_bytes()
    assert _cached_pages(copy) > 0  # (read into the page cache: clean pages, the copy was fsynced)
    touched = state_from_stat("r/step_0001.pt", copy.stat())
    wait_for(
        lambda: Manifest.load(mirror).entries["r/step_0001.pt"].unchanged(touched), 90, "the record takes its stat"
    )
    assert d.wait_event("scrub.confirmed", path="r/step_0001.pt", timeout=30)  # (logged after the record)
    assert _cached_pages(copy) == 0  # the scrub's reads leave the page cache as they found it (io.drop_cache)
    assert not d.events("scrub.recopy")
    assert d.metric("mirrord_damaged_copies") == 0
    assert d.stop() == 0
