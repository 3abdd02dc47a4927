"""Inputs built to exhaust a recursion (issue 33, cases 10-12): a folder ~1,200 levels deep in the primary,
a trainer_state.json nested 100,000 deep, a DCP .metadata whose pickle nests a tuple 1,000,000 deep.

Each is met by real `mirrord sync`, `run` and `status` processes: none dies, the hostile unit gets a
readable verdict, and every other run is mirrored (docs/security.md, "Nesting and depth").
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp_torch

from mirrord.store.atomic import TEMP_SUFFIX
from tests.chaos.harness import Checkpoints, Report, World, Zygote, converged_violations, step_name, write_config
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for

# sync tries an invalid unit again until 3 x unit.settle_seconds have passed (30 s by default)
QUICK_SYNC = {"unit": {"settle_seconds": 1}}
# The daemon meets the hostile unit at start-up and again at a rescan: two reconciles, seconds apart.
RESCAN_OFTEN = {**QUICK_SYNC, "watch": {"rescan_interval_seconds": 2}}
DEPTH = 1_200  # a 2,400-byte path below the primary: far under PATH_MAX, far over the interpreter's recursion limit


def _make_deep(top: Path, depth: int = DEPTH) -> Path:
    """top/a/a/.../a, `depth` levels, made one level at a time (os.makedirs itself recurses)."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=fd)
            child = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return top


def _remove_deep(top: Path, depth: int = DEPTH) -> None:
    """Remove what _make_deep made, deepest first (shutil.rmtree recurses too)."""
    for level in range(depth, 0, -1):
        (top / "/".join(["a"] * level)).rmdir()
    top.rmdir()


def _sync(world: World, zygote: Zygote, tmp_path: Path, **sections: object) -> tuple[Path, Path, int]:
    config = write_config(tmp_path / "mirrord.toml", world, **sections)
    log = tmp_path / f"sync-{len(list(tmp_path.glob('sync-*.log')))}.log"
    return config, log, zygote.run(["sync", "--config", config], log, timeout=120)


def test_a_folder_1200_levels_deep_neither_stops_run_nor_its_watcher(
    world: World, checkpoints: Checkpoints, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """Deep at start-up, and another moved in while `run` watches: the daemon stays up and healthy, its
    watcher alive, and the runs beside them are mirrored, the second one from a watch event."""
    tally = report.scenario("hostile 3: a folder 1,200 levels deep in the primary (start-up, moved in)")
    world.install(f"run/{step_name(1)}", checkpoints.blobs[0])
    deep, later = _make_deep(world.primary / "deep"), _make_deep(tmp_path / "later")
    tally.fault("deep folder", 2)
    try:
        _config, log, code = _sync(world, zygote, tmp_path)
        tally.rounds += 1
        tally.check([f"sync exited {code}: {log.read_text()[-2000:]}"] if code != 0 else [])
        daemon = DaemonProcess(tmp_path, world.primary, world.mirror, {"watch": {"rescan_interval_seconds": 3600}})
        daemon.start(wait_ready=False)
        try:
            wait_for(lambda: daemon.exited() or daemon.http("/readyz")[0] == 200, 90, "the daemon to be ready")
            tally.check([f"run died at start-up: {daemon.log_text()[-3000:]}"] if daemon.exited() else [])
            tally.assert_clean()
            later.rename(world.primary / "later")
            world.install(f"run2/{step_name(2)}", checkpoints.blobs[1])  # only a watch event tells of it
            wait_for(
                lambda: daemon.exited() or (world.mirror / "run2" / step_name(2)).exists(),
                90,
                "the daemon to mirror run2 from a watch event",
            )
            tally.check([f"run died: {daemon.log_text()[-3000:]}"] if daemon.exited() else [])
            tally.assert_clean()
            status, body = daemon.http("/healthz")
            tally.check([f"/healthz {status}: {body}"] if status != 200 else [])
            died = [e for e in daemon.events() if "watch" in str(e.get("event")) and e.get("level") == "error"]
            tally.check([f"the watcher failed: {died}"] if died else [])
        finally:
            code = daemon.stop()
        tally.rounds += 1
        tally.check([f"run exited {code}"] if code != 0 else [])
        tally.check(converged_violations(world, {f"run/{step_name(1)}", f"run2/{step_name(2)}"}))
    finally:
        for top in (deep, later, world.primary / "later"):
            if top.exists():
                _remove_deep(top)
    tally.assert_clean()


def _mirrored_as_is(world: World, healthy: str, bad: str) -> list[str]:
    """Every file of the folder `healthy` is on the mirror with its bytes; nothing of the folder `bad` is."""
    found = [
        f"{healthy}/{p.name}: not mirrored as it is on the primary"
        for p in (world.primary / healthy).iterdir()
        if not (world.mirror / healthy / p.name).is_file()
        or (world.mirror / healthy / p.name).read_bytes() != p.read_bytes()
    ]
    return [*found, f"{bad}: mirrored although it is not whole"] if (world.mirror / bad).exists() else found


def _hf_unit(folder: Path, state: bytes) -> None:
    """A Hugging Face Trainer checkpoint folder: a real safetensors file and its trainer_state.json."""
    folder.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    (folder / "trainer_state.json").write_bytes(state)


def test_a_trainer_state_nested_100000_deep_is_invalid_and_other_runs_are_mirrored(
    world: World, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """One HF folder's trainer_state.json is `[` x 100,000: that folder is not mirrored and says why;
    `sync` and `run` carry on with the healthy run beside it."""
    tally = report.scenario("hostile 3: trainer_state.json nested 100,000 deep (hf layout)")
    _hf_unit(world.primary / "bad" / "checkpoint-5", b"[" * 100_000 + b"]" * 100_000)
    _hf_unit(world.primary / "good" / "checkpoint-7", json.dumps({"global_step": 7}).encode())
    tally.fault("deep JSON")
    _config, log, code = _sync(world, zygote, tmp_path, layout="hf", **QUICK_SYNC)
    tally.rounds += 1
    text = log.read_text()
    tally.check([f"sync crashed ({code}): {text[-2000:]}"] if code not in (0, 1) or "RecursionError" in text else [])
    tally.check(_mirrored_as_is(world, "good/checkpoint-7", "bad/checkpoint-5"), "sync")
    tally.check(["the deep trainer_state.json was not named in sync's log"] if "bad/checkpoint-5" not in text else [])
    daemon = DaemonProcess(tmp_path, world.primary, world.mirror, {"layout": "hf", **RESCAN_OFTEN})
    daemon.start(wait_ready=False)
    try:
        wait_for(lambda: daemon.exited() or len(daemon.events("reconcile.finished")) >= 2, 90, "two reconciles")
        tally.check([f"run died: {daemon.log_text()[-3000:]}"] if daemon.exited() else [])
        tally.assert_clean()
        status, body = daemon.http("/healthz")
        tally.check([f"/healthz {status}: {body}"] if status != 200 else [])
        tally.check(
            ["the deep trainer_state.json was not named in run's log"]
            if "bad/checkpoint-5" not in daemon.log_text()
            else []
        )
    finally:
        code = daemon.stop()
    tally.rounds += 1
    tally.check([f"run exited {code}"] if code != 0 else [])
    tally.check(_mirrored_as_is(world, "good/checkpoint-7", "bad/checkpoint-5"), "run")
    tally.assert_clean()


def _dcp_save(folder: Path) -> None:
    """A real single-process dcp.save of a small model (no process group)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp_torch.save({"model": model.state_dict()}, checkpoint_id=folder)


# A dict keyed by a tuple nested 1,000,000 deep (EMPTY_DICT, EMPTY_TUPLE, TUPLE1 x 1,000,000, BININT1 1,
# SETITEM, STOP): hashing the key recursed in C until the interpreter died by SIGSEGV.
DEEP_PICKLE = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"K\x01s."


def test_a_dcp_metadata_nesting_a_tuple_1000000_deep_is_invalid_without_a_crash(
    world: World, zygote: Zygote, tmp_path: Path, report: Report
) -> None:
    """`sync`, `run` and `status` over a DCP folder whose .metadata is that pickle: none dies by a signal,
    the folder is judged invalid and named, the healthy DCP run beside it is mirrored."""
    tally = report.scenario("hostile 3: DCP .metadata nesting a tuple 1,000,000 deep (dcp layout)")
    bad = world.primary / "bad" / "step_5"
    _dcp_save(bad)
    (bad / ".metadata").write_bytes(DEEP_PICKLE)
    _dcp_save(world.primary / "good" / "step_7")
    tally.fault("deep pickle")
    _config, log, code = _sync(world, zygote, tmp_path, layout="dcp", **QUICK_SYNC)
    tally.rounds += 1
    tally.check([f"sync died ({code}): {log.read_text()[-2000:]}"] if code not in (0, 1) else [])
    tally.check(_mirrored_as_is(world, "good/step_7", "bad/step_5"), "sync")
    tally.check(["bad/step_5 was not named in sync's log"] if "bad/step_5" not in log.read_text() else [])
    daemon = DaemonProcess(tmp_path, world.primary, world.mirror, {"layout": "dcp", **RESCAN_OFTEN})
    daemon.start(wait_ready=False)
    try:
        wait_for(lambda: daemon.exited() or len(daemon.events("reconcile.finished")) >= 2, 90, "two reconciles")
        tally.check([f"run died: {daemon.log_text()[-3000:]}"] if daemon.exited() else [])
        tally.assert_clean()
        out = tmp_path / "status.out"
        code = zygote.run(["status", "--config", daemon.config_path], tmp_path / "status.log", stdout=out)
        tally.rounds += 1
        tally.check([f"status died ({code}): {out.read_text()[-2000:]}"] if code < 0 or code > 3 else [])
    finally:
        code = daemon.stop()
    tally.rounds += 1
    tally.check([f"run exited {code}"] if code != 0 else [])
    tally.check(_mirrored_as_is(world, "good/step_7", "bad/step_5"), "run")
    tally.check([f"{p}: a temp name survived" for p in world.mirror.rglob(f"*{TEMP_SUFFIX}")])
    tally.assert_clean()
