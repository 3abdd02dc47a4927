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
from tests.support.gate import FuseMount
from tests.support.wait import wait_for

WRITERS: dict[str, Callable[[Path, int], list[Path]]] = {
    "hf": lambda f, s: write_hf(f, s, pause=0.05),
    "dcp": write_dcp,
}
GATED = {"hf": "optimizer.pt", "dcp": "__0_0.distcp"}  # each layout's largest file, held at the gate
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
    tmp_path: Path, gated_primary: FuseMount, daemon_factory: Callable[..., DaemonProcess], layout: str
) -> None:
    """Each unit's copy is held in flight at a gate (its largest file) while the poller lists the mirror,
    then released; retention prunes both sides as the steps go by."""
    prefix, whole = LAYOUTS[layout]
    mirror = tmp_path / "mirror"
    run = gated_primary.backing / "run"
    run.mkdir(parents=True)
    settings: dict[str, Any] = {
        "layout": layout,
        "copy": {"settle_seconds": 0.3},
        "prune": {"enabled": True, "keep_last": 2, "min_age_seconds": 0, "primary": True},
        "watch": {"rescan_interval_seconds": 0.5},
    }
    daemon = daemon_factory(settings).start()
    poller = Poller(mirror / "run", prefix, whole, layout)
    poller.start()
    try:
        # The trainer: each checkpoint written file by file; the next one once the mirror has this one
        # (so every step is mirrored before retention's window passes it, and the primary may be pruned).
        for step in range(10, 70, 10):
            unit = f"run/{prefix}{step}"
            gated_primary.stall(GATED[layout])
            WRITERS[layout](run / f"{prefix}{step}", step)
            wait_for(
                lambda unit=unit: daemon.events("copy.started", path=unit),
                120,  # type: ignore[misc]
                f"{unit}'s copy held in flight",
            )
            listed = poller.listings
            wait_for(
                lambda listed=listed: poller.listings >= listed + 5,
                60,  # type: ignore[misc]
                "the poller listing the mirror while the copy is held",
            )
            gated_primary.unstall()
            wait_for(
                lambda step=step: (mirror / "run" / f"{prefix}{step}").is_dir(),
                120,  # type: ignore[misc]
                f"{prefix}{step} on the mirror",
                interval=0.02,
            )
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

    def leftovers() -> list[Path]:
        return [p for p in mirror.rglob("*") if p.name.endswith(".part") or (p.is_dir() and not any(p.iterdir()))]

    # A unit retired last is renamed out of the run folder first, then removed in the staging area: wait
    # for that removal; then only the staging area itself stays, empty.
    wait_for(lambda: leftovers() == [mirror / ".mirrord-staging"], 30, "no staging leftovers", interval=0.1)
    found = run_mirrord("latest", "--config", daemon.config_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(mirror / "run" / f"{prefix}60")
    deleted = daemon.events("prune.deleted", kind="unit")
    assert {e["volume"] for e in deleted} == {"primary", "mirror"}
    assert daemon.stop() == 0


def test_a_folder_unit_with_an_invalid_file_is_judged_once_until_it_changes(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """checkpoint-20/ is complete by the hf rule (trainer_state.json parses, the weights whole, every file
    settled) but its optimizer.pt is a torn torch zip (cut in half). It is read once, fails its
    validator, and is not read again on the rescans that follow while it stays the same (before: a full
    re-read of the folder on every rescan, and the verdict forgotten at once, so never reported); after
    copy.invalid_grace_seconds it is logged and counted once, naming the file; rewritten whole, it is
    mirrored and the verdict is gone."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "run"
    run.mkdir(parents=True)
    daemon = daemon_factory(
        {
            "layout": "hf",
            "copy": {"settle_seconds": 0.3, "invalid_grace_seconds": 2.0},
            "watch": {"rescan_interval_seconds": 0.5},
        }
    ).start()
    write_hf(run / "checkpoint-10", 10)
    wait_for(lambda: (mirror / "run" / "checkpoint-10").is_dir(), 120, "checkpoint-10 mirrored")
    write_hf(run / "checkpoint-20", 20)
    optimizer = run / "checkpoint-20" / "optimizer.pt"
    torn = optimizer.read_bytes()
    optimizer.write_bytes(torn[: len(torn) // 2])  # its zip directory is gone
    failed = daemon.wait_event("copy.failed", path="run/checkpoint-20", reason="invalid_source", timeout=120)
    assert "optimizer.pt" in failed["cause"]
    reported = daemon.wait_event("copy.invalid_source", path="run/checkpoint-20", timeout=120)
    assert "optimizer.pt" in reported["cause"] and reported["published"] is False
    rescans = len(daemon.events("reconcile.finished"))
    wait_for(lambda: len(daemon.events("reconcile.finished")) >= rescans + 6, 120, "six more rescans")
    assert len(daemon.events("copy.started", path="run/checkpoint-20")) == 1
    assert len(daemon.events("copy.failed", path="run/checkpoint-20")) == 1
    assert len(daemon.events("copy.invalid_source")) == 1
    assert daemon.metric("mirrord_copies_total", 'result="invalid_source"') == 1
    assert daemon.metric("mirrord_invalid_sources") == 1
    assert not (mirror / "run" / "checkpoint-20").exists()
    assert [p.name for p in (mirror / "run").iterdir()] == ["checkpoint-10"]  # nothing staged is left
    optimizer.write_bytes(torn)  # the trainer saves it again, whole
    daemon.wait_event("copy.committed", path="run/checkpoint-20", timeout=120)
    wait_for(lambda: daemon.metric("mirrord_invalid_sources") == 0, 60, "the verdict forgotten")
    assert (mirror / "run" / "checkpoint-20" / "optimizer.pt").read_bytes() == torn
    assert len(daemon.events("copy.started", path="run/checkpoint-20")) == 2
    assert daemon.stop() == 0


def test_a_changed_folder_unit_is_swapped_in_whole_never_missing_or_mixed(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """The trainer saves checkpoint-10/ again and again with other bytes (another width each time). A
    poller listing the mirror every few ms sees, from the first time checkpoint-10/ appears, always a
    checkpoint-10/, and always exactly one whole version of it (before: the old copy was deleted file by
    file under its final name before the new one was renamed there, so a listing could see a part of
    the old one, or none). No staging or aside folder is left; `latest` names it."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    run = primary / "run"
    run.mkdir(parents=True)
    daemon = daemon_factory(
        {"layout": "hf", "copy": {"settle_seconds": 0.3}, "watch": {"rescan_interval_seconds": 1}}
    ).start()
    unit = mirror / "run" / "checkpoint-10"
    seen: list[frozenset[tuple[str, int]] | None] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.003):
            try:
                view = frozenset((p.name, p.stat().st_size) for p in unit.iterdir())
            except FileNotFoundError:
                view = None  # no checkpoint-10/ (or it went between two calls)
            if view is not None or seen:
                seen.append(view)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    versions = set()
    try:
        for width in (16, 24, 32, 40, 48):
            write_hf(run / "checkpoint-10", 10, width=width, pause=0.05)
            versions.add(frozenset((p.name, p.stat().st_size) for p in (run / "checkpoint-10").iterdir()))
            source = (run / "checkpoint-10" / "optimizer.pt").read_bytes()

            def recorded(source: bytes = source) -> bool:
                entry = Manifest.load(mirror).entries.get("run/checkpoint-10/optimizer.pt")
                return (
                    entry is not None and entry.size == len(source) and (unit / "optimizer.pt").read_bytes() == source
                )

            wait_for(recorded, 120, f"width {width} mirrored and recorded")
    finally:
        stop.set()
        poller.join(10)
    assert len(versions) == 5 and len(seen) > 100, (len(versions), len(seen))
    missing = sum(view is None for view in seen)
    mixed = {view for view in seen if view is not None and view not in versions}
    print(
        f"swap: {len(seen)} listings of checkpoint-10/, {missing} without it, {len(mixed)} partial or mixed, "
        f"{len(daemon.events('copy.replaced_unit', path='run/checkpoint-10'))} replacements"
    )
    assert missing == 0 and mixed == set(), (missing, mixed)
    assert len(daemon.events("copy.replaced_unit", path="run/checkpoint-10", how="swapped")) >= 4
    assert sorted(p.name for p in (mirror / "run").iterdir()) == ["checkpoint-10"]
    entries = Manifest.load(mirror).entries
    assert sorted(entries) == sorted(f"run/checkpoint-10/{name}" for name in HF_FILES)
    found = run_mirrord("latest", "--config", daemon.config_path)
    assert found.stdout.strip() == str(unit), found.stdout + found.stderr
    assert daemon.stop() == 0


def test_checkpoint_like_names_the_layout_cannot_handle_are_warned_once_per_pattern(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Under the default layout ("torch"): `final.pt` and `best.pt` carry no step (retention would never
    prune them), Lightning's `*.ckpt` and a Trainer's `checkpoint-N/` are not selected (never
    mirrored). The daemon says so once per file name pattern for the whole run (not once per file, not
    on every rescan), naming a path and the layout that would select it; `check-config` prints the same."""
    primary = tmp_path / "primary"
    for rel in ("a/final.pt", "a/best.pt", "b/epoch=0-step=2.ckpt", "b/epoch=1-step=4.ckpt", "b/last.ckpt"):
        (primary / rel).parent.mkdir(parents=True, exist_ok=True)
        (primary / rel).write_bytes(b"not read")
    write_hf(primary / "c" / "checkpoint-5", 5)
    daemon = daemon_factory({"watch": {"rescan_interval_seconds": 0.5}, "copy": {"settle_seconds": 0}}).start()
    rescans = len(daemon.events("reconcile.finished"))
    wait_for(lambda: len(daemon.events("reconcile.finished")) >= rescans + 6, 120, "six rescans")
    (primary / "b" / "epoch=2-step=6.ckpt").write_bytes(b"another one")  # same pattern: no new warning
    (primary / "a" / "model.pth").write_bytes(b"a new pattern")
    rescans = len(daemon.events("reconcile.finished"))
    wait_for(lambda: len(daemon.events("reconcile.finished")) >= rescans + 4, 120, "four more rescans")
    no_step = daemon.events("checkpoint.no_step")
    not_selected = daemon.events("checkpoint.not_selected")
    assert sorted(e["pattern"] for e in no_step) == ["*.pt"], no_step  # final.pt, best.pt, optimizer.pt...
    assert no_step[0]["path"] in ("a/best.pt", "a/final.pt", "c/checkpoint-5/optimizer.pt")
    assert "never prunes" in no_step[0]["why"]
    by_pattern = {e["pattern"]: e for e in not_selected}
    assert sorted(by_pattern) == ["*.ckpt", "*.pth", "checkpoint-N/"], not_selected
    assert by_pattern["*.ckpt"]["path"].startswith("b/") and 'layout = "lightning"' in by_pattern["*.ckpt"]["why"]
    assert by_pattern["checkpoint-N/"]["path"].startswith("c/checkpoint-5/")
    assert 'layout = "hf"' in by_pattern["checkpoint-N/"]["why"]
    assert by_pattern["*.pth"]["path"] == "a/model.pth"
    assert daemon.stop() == 0
    checked = run_mirrord("check-config", "--config", daemon.config_path)
    assert checked.returncode == 0, checked.stderr
    warnings = [line for line in checked.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 4, warnings
    assert any("b/epoch=" in w and 'layout = "lightning" would select it' in w for w in warnings)
    assert any("no step in its name" in w and "'*.pt'" in w for w in warnings)


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
    daemon = daemon_factory(
        {"layout": layout, "copy": {"settle_seconds": 0.3}, "watch": {"rescan_interval_seconds": 3600}}
    ).start()
    daemon.wait_event("daemon.ready")
    for step in (10, 20):
        if layout == "hf":
            write_hf(run / f"checkpoint-{step}", step, pause=0.05)
            name = f"checkpoint-{step}"
        else:
            _write_deepspeed(run, step)
            name = f"global_step{step}"
        # Manifest.load: recorded whole, so published (the record follows the folder's rename).
        wait_for(
            lambda name=name: any(
                rel.startswith(f"run/{name}/")  # type: ignore[misc]
                for rel in Manifest.load(mirror).entries
            ),
            120,
            f"{name} mirrored",
            context=lambda: daemon.log_text()[-4000:],
        )
        for member in (run / name).iterdir():
            assert (mirror / "run" / name / member.name).read_bytes() == member.read_bytes()
    if layout == "deepspeed":
        wait_for(
            lambda: (
                (mirror / "run" / "latest").is_file() and (mirror / "run" / "latest").read_text() == "global_step20"
            ),
            120,
            "latest mirrored",
        )
    assert len(daemon.events("reconcile.finished")) == 1, "a full listing after start: not the events alone"
    assert not daemon.events("watch.rescan")
    assert daemon.stop() == 0


def test_a_folder_that_loses_its_weights_mid_copy_is_never_published(
    tmp_path: Path, gated_primary: FuseMount, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Issue 42 case 6: an HF checkpoint-10/ (7 files) starts copying; model.safetensors and optimizer.pt are
    unlinked while the copy is held at the gate (a trainer killed inside its own rotation's rmtree). Before,
    the daemon copied the folder again and committed it with 5 files and no weights, and `latest` named it.
    Now it is judged not whole (files gone since it was seen whole, no weights) and never published."""
    run, mirror = gated_primary.backing / "run", tmp_path / "mirror"
    staged = gated_primary.backing / "staged"
    write_hf(staged, 10)
    (staged / "config.json").write_text('{"model_type": "linear"}')
    (staged / "training_args.bin").write_bytes(b"\0" * 64)
    run.mkdir()
    gated_primary.stall("optimizer.pt")
    daemon = daemon_factory(
        {"layout": "hf", "copy": {"settle_seconds": 0.3}, "watch": {"rescan_interval_seconds": 0.5}}
    )
    daemon.start()
    staged.rename(run / "checkpoint-10")  # whole at once, as it is seen
    daemon.wait_event("copy.started", 120, path="run/checkpoint-10")
    for name in ("model.safetensors", "optimizer.pt"):
        (run / "checkpoint-10" / name).unlink()
    gated_primary.unstall()

    def judged_or_published() -> bool:
        told = daemon.events("unit.incomplete", path="run/checkpoint-10")
        return (mirror / "run" / "checkpoint-10").exists() or any("gone since" in e["why"] for e in told)

    wait_for(judged_or_published, 120, "checkpoint-10 judged not whole, or published")
    assert not (mirror / "run" / "checkpoint-10").exists(), sorted(p.name for p in (mirror / "run").iterdir())
    assert not any(e["path"].startswith("run/checkpoint-10") for e in daemon.events("copy.committed"))
    latest = run_mirrord(
        "latest", "--json", "--mirror", mirror, env={"MIRRORD_LAYOUT": "hf", "MIRRORD_METRICS__ENABLED": "false"}
    )
    assert not latest.stdout.strip() or json.loads(latest.stdout).get("relative_path") is None, latest.stdout
    assert daemon.stop() == 0
