"""Folder layouts under a real daemon while a real trainer script writes: a poller listing the mirror
every 20 ms never sees a partial folder under a final name; retention keeps keep_last whole units on
both sides; nothing partial or empty is left; `latest` names the newest folder."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mirrord.formats.dcpmeta import storage_references
from mirrord.store.manifest import Manifest
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.folders import HF_FILES, write_dcp, write_hf
from tests.support.wait import wait_for

WRITERS: dict[str, Callable[[Path, int], list[Path]]] = {"hf": lambda f, s: write_hf(f, s, pause=0.05),
                                                       "dcp": write_dcp}
LAYOUTS = {
    # layout: (folder prefix, the files a whole unit holds)
    "hf": ("checkpoint-", set(HF_FILES)),
    "dcp": ("step_", {".metadata", "__0_0.distcp"}),
}


class Poller(threading.Thread):
    """Lists the mirror's run folder every 20 ms; any final-named unit folder must be whole."""

    def __init__(self, run: Path, prefix: str, whole: set[str], layout: str) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.prefix, self.whole, self.layout = run, prefix, whole, layout
        self.stop_event = threading.Event()
        self.listings = 0
        self.units_seen: set[str] = set()
        self.partial: list[str] = []

    def run(self) -> None:
        while not self.stop_event.wait(0.02):
            try:
                names = os.listdir(self.run_dir)  # noqa: PTH208 - one syscall per listing
            except FileNotFoundError:
                continue
            self.listings += 1
            for name in names:
                if name.startswith(self.prefix) and not name.endswith(".part"):
                    self._check(self.run_dir / name)

    def _check(self, folder: Path) -> None:
        try:
            files = {p.name: p.read_bytes() for p in folder.iterdir()}
        except (FileNotFoundError, NotADirectoryError):
            return  # renamed away by retention between the listing and the look
        self.units_seen.add(folder.name)
        if set(files) != self.whole:
            self.partial.append(f"{folder.name}: {sorted(files)}")
        elif self.layout == "dcp":
            needed = storage_references(files[".metadata"])
            if any(len(files[rel]) < size for rel, size in needed.items()):
                self.partial.append(f"{folder.name}: a file shorter than .metadata says")
        elif self.layout == "hf":
            json.loads(files["trainer_state.json"])


@pytest.mark.parametrize("layout", ["hf", "dcp"])
def test_trainer_layout_mirrored_whole_and_pruned_to_keep_last(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], layout: str
) -> None:
    prefix, whole = LAYOUTS[layout]
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "run"
    run.mkdir(parents=True)
    settings: dict[str, Any] = {
        "layout": layout,
        "copy": {"settle_seconds": 0.3},
        "io": {"bandwidth_limit": 65536},  # slow mirror: copies overlap the trainer and the poller
        "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 0, "primary": True},
        "watch": {"rescan_interval_seconds": 2},
    }
    daemon = daemon_factory(settings).start()
    poller = Poller(mirror / "run", prefix, whole, layout)
    poller.start()
    try:
        # The trainer: each checkpoint written file by file; the next one once the mirror has this one
        # (so every step is mirrored before retention's window passes it, and the primary may be pruned).
        for step in range(10, 70, 10):
            WRITERS[layout](run / f"{prefix}{step}", step)
            wait_for(lambda step=step: (mirror / "run" / f"{prefix}{step}").is_dir(), 120,  # type: ignore[misc]
                     f"{prefix}{step} on the mirror", interval=0.02)
        newest = {f"{prefix}{step}" for step in (50, 60)}

        def settled() -> bool:
            mirrored = {p.name for p in (mirror / "run").iterdir()}
            return mirrored == newest and {p.name for p in run.iterdir()} == newest

        wait_for(settled, 120, f"both sides pruned to {sorted(newest)}", interval=0.1)
    finally:
        poller.stop_event.set()
        poller.join(10)
    assert poller.partial == [], poller.partial
    print(f"poller[{layout}]: {poller.listings} listings, units seen whole: {sorted(poller.units_seen)}")
    assert poller.listings >= 20 and len(poller.units_seen) >= 3, (poller.listings, poller.units_seen)
    for name in newest:  # whole on the mirror, byte for byte, and recorded file by file
        assert {p.name for p in (mirror / "run" / name).iterdir()} == whole
        for member in whole:
            assert (mirror / "run" / name / member).read_bytes() == (run / name / member).read_bytes()
    entries = Manifest.load(mirror).entries
    assert sorted(entries) == sorted(f"run/{n}/{m}" for n in newest for m in whole)
    leftovers = [p for p in mirror.rglob("*") if p.name.endswith(".part") or (p.is_dir() and not any(p.iterdir()))]
    assert leftovers == []
    found = run_mirrord("latest", "--config", daemon.config_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(mirror / "run" / f"{prefix}60")
    deleted = daemon.events("prune.deleted", kind="unit")
    assert {e["volume"] for e in deleted} == {"primary", "mirror"}
    assert daemon.stop() == 0


def _write_deepspeed(run: Path, step: int) -> None:
    """DeepSpeed's save_checkpoint file for file (ZeRO stage 1, one rank), then the `latest` tag file."""
    from tests.support.checkpoints import save_checkpoint

    folder = run / f"global_step{step}"
    save_checkpoint(folder / "mp_rank_00_model_states.pt", step)
    save_checkpoint(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step + 1)
    (run / "latest").write_text(f"global_step{step}")


@pytest.mark.parametrize("layout", ["hf", "deepspeed"])
def test_a_unit_is_mirrored_from_its_watch_events_alone(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], layout: str
) -> None:
    """With the periodic rescan an hour away, the only full listing is the one at start: each new folder
    (and DeepSpeed's tag file) is listed, judged and mirrored from the events of its own files, and a
    folder still settling is judged again alone when its settle time is up."""
    run = tmp_path / "primary" / "run"
    run.mkdir(parents=True)
    mirror = tmp_path / "mirror"
    daemon = daemon_factory({"layout": layout, "copy": {"settle_seconds": 0.3},
                             "watch": {"rescan_interval_seconds": 3600}}).start()
    daemon.wait_event("daemon.ready")
    for step in (10, 20):
        if layout == "hf":
            write_hf(run / f"checkpoint-{step}", step, pause=0.05)
            name = f"checkpoint-{step}"
        else:
            _write_deepspeed(run, step)
            name = f"global_step{step}"
        # Manifest.load: recorded whole, so published (the record follows the folder's rename).
        wait_for(lambda name=name: any(rel.startswith(f"run/{name}/")  # type: ignore[misc]
                                       for rel in Manifest.load(mirror).entries), 120, f"{name} mirrored")
        for member in (run / name).iterdir():
            assert (mirror / "run" / name / member.name).read_bytes() == member.read_bytes()
    if layout == "deepspeed":
        wait_for(lambda: (mirror / "run" / "latest").is_file()
                 and (mirror / "run" / "latest").read_text() == "global_step20", 120, "latest mirrored")
    assert len(daemon.events("reconcile.finished")) == 1, "a full listing after start: not the events alone"
    assert not daemon.events("watch.rescan")
    assert daemon.stop() == 0
