"""`mirrord drill`: each layout's newest checkpoint, mirrored by `mirrord sync` for real, restored into a scratch
folder and loaded by its library in a bounded child process; a checkpoint whose bytes match the record but that
the library refuses fails the drill, naming the mirror file and the loader's message."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mirrord.store.drill import LOAD_MEMORY_BYTES, LOAD_SECONDS
from tests.support.checkpoints import save_checkpoint
from tests.support.cli import child_env, mirrord_argv, run_mirrord
from tests.support.folders import write_dcp, write_hf
from tests.support.wait import wait_for


class Custom:
    """A class of the trainer's own: torch.save pickles it, torch.load(weights_only=True) refuses it."""


def _ranks(folder: Path, *names: str) -> None:
    for rank, name in enumerate(names):
        save_checkpoint(folder / name, 10 + rank)


def _deepspeed(run: Path) -> None:
    _ranks(run / "global_step10", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (run / "latest").write_text("global_step10")


def _megatron(run: Path) -> None:
    _ranks(run / "iter_0000010", "mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("10")


def _accelerate(run: Path) -> None:
    write_hf(run / "checkpoint_10", 10)  # model.safetensors and torch.save files
    (run / "checkpoint_10" / "trainer_state.json").rename(run / "checkpoint_10" / "random_states_0.pkl")


# layout: (writes one unit into the run folder, the unit's key, files the drill loads)
WRITERS: dict[str, tuple[Callable[[Path], object], str, int]] = {
    "torch": (lambda run: save_checkpoint(run / "step_10.pt", 10), "run/step_10.pt", 1),
    "custom": (lambda run: save_checkpoint(run / "step_10.pt", 10), "run/step_10.pt", 1),
    "lightning": (lambda run: save_checkpoint(run / "epoch=0-step=10.ckpt", 10), "run/epoch=0-step=10.ckpt", 1),
    "hf": (lambda run: write_hf(run / "checkpoint-10", 10), "run/checkpoint-10", 1),  # model.safetensors
    "hf_model": (lambda run: write_hf(run / "checkpoint-10", 10), "run/checkpoint-10", 1),
    "accelerate": (_accelerate, "run/checkpoint_10", 4),  # model.safetensors, optimizer.pt, scheduler, rng_state
    "dcp": (lambda run: write_dcp(run / "step_10", 10), "run/step_10", 1),  # .metadata and its references
    "deepspeed": (_deepspeed, "run/global_step10", 2),
    "megatron": (_megatron, "run/iter_0000010", 2),
}
SETTLED = {"MIRRORD_COPY__SETTLE_SECONDS": "0", "MIRRORD_UNIT__SETTLE_SECONDS": "0", "MIRRORD_PRUNE__ENABLED": "false"}


def _mirrored(tmp_path: Path, layout: str, write: Callable[[Path], object]) -> tuple[Path, dict[str, str]]:
    """The unit `write` makes, synced to a fresh mirror; (mirror, the environment that names the layout)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    write(primary / "run")
    env = {**SETTLED, "MIRRORD_LAYOUT": layout}
    synced = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert synced.returncode == 0, synced.stderr
    return mirror, env


def _scratch_left(mirror: Path) -> list[str]:
    return [p.name for p in mirror.iterdir() if p.name.startswith(".mirrord-drill-")]


@pytest.mark.parametrize("layout", WRITERS)
def test_the_newest_unit_of_each_layout_is_restored_and_loaded(tmp_path: Path, layout: str) -> None:
    """With only --mirror (no config file, no layout: the record names it): the unit comes back byte for byte
    and the reader of its layout loads it (hf: the safetensors only, not the trainer's pickles); the scratch copy
    is gone afterwards."""
    write, key, loads = WRITERS[layout]
    mirror, _ = _mirrored(tmp_path, layout, write)
    done = run_mirrord("drill", "--mirror", mirror, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert (document["command"], document["ok"], document["structure_only"]) == ("drill", True, False)
    [drilled] = document["runs"]
    assert (drilled["run"], drilled["relative_path"], drilled["error"]) == ("run", key, None)
    assert len(drilled["loaded"]) == loads, drilled["loaded"]
    assert all(rel.startswith(key) for rel in drilled["loaded"])
    assert _scratch_left(mirror) == []


def _newer_format(path: Path) -> None:
    """A torch.save file whose archive says it was written by a newer format (version 99) than torch reads."""
    save_checkpoint(path, 30)
    with zipfile.ZipFile(path) as src:
        members = [(i.filename, src.read(i)) for i in src.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name, data in members:
            out.writestr(name, b"99\n" if name.endswith("/version") else data)


def test_a_checkpoint_its_library_refuses_fails_the_drill_naming_the_file(tmp_path: Path) -> None:
    """Run `bad`'s newest checkpoint matches its record byte for byte, but torch.load(weights_only=True) refuses
    its pickle; run `newer`'s was written by a newer format than this torch reads: exit 1 with each mirror file
    and torch's own message; run `good` still passes; no scratch left."""

    def write(run: Path) -> None:
        save_checkpoint(run.parent / "good" / "step_10.pt", 10)
        (run.parent / "bad").mkdir()
        torch.save({"step": 20, "trainer": Custom()}, run.parent / "bad" / "step_20.pt")
        (run.parent / "newer").mkdir()
        _newer_format(run.parent / "newer" / "step_30.pt")

    mirror, env = _mirrored(tmp_path, "torch", write)
    verified = run_mirrord("verify", "--mirror", mirror, env=env)
    assert verified.returncode == 0, verified.stdout  # the bytes are the recorded ones
    done = run_mirrord("drill", "--mirror", mirror, "--json", env=env)
    assert done.returncode == 1
    assert f"drill good: {mirror / 'good' / 'step_10.pt'}: loaded 1 file(s)" in done.stderr  # (stdout: the JSON)
    failed = f"drill bad: {mirror / 'bad' / 'step_20.pt'}: FAILED {mirror / 'bad' / 'step_20.pt'}: UnpicklingError"
    assert failed in done.stderr
    assert "Unsupported global" in done.stderr and "Custom" in done.stderr
    newer = f"drill newer: {mirror / 'newer' / 'step_30.pt'}: FAILED {mirror / 'newer' / 'step_30.pt'}: RuntimeError"
    assert newer in done.stderr and "PyTorch file with version 99" in done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] is False
    bad, good, _ = document["runs"]
    assert (good["run"], good["error"], bad["run"], bad["file"]) == (
        "good",
        None,
        "bad",
        str(mirror / "bad" / "step_20.pt"),
    )
    assert bad["error"].startswith("UnpicklingError: Weights only load failed")
    assert _scratch_left(mirror) == []


def test_a_rank_file_weights_only_refuses_fails_the_drill_naming_that_member(tmp_path: Path) -> None:
    """A deepspeed folder whose rank-1 file holds a pickle weights_only refuses: the drill names that file."""

    def write(run: Path) -> None:
        _deepspeed(run)
        torch.save({"optimizer": Custom()}, run / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    mirror, _ = _mirrored(tmp_path, "deepspeed", write)
    done = run_mirrord("drill", "--mirror", mirror)
    assert done.returncode == 1
    member = mirror / "run" / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert f"drill run: {mirror / 'run' / 'global_step10'}: FAILED {member}: UnpicklingError" in done.stderr
    assert _scratch_left(mirror) == []


def test_the_loader_never_imports_a_module_planted_in_the_working_directory(tmp_path: Path) -> None:
    """A `torch.py` where the operator runs the drill is not the torch the loader imports (python -P)."""
    mirror, env = _mirrored(tmp_path, "torch", lambda run: save_checkpoint(run / "step_10.pt", 10))
    (tmp_path / "torch.py").write_text("raise SystemExit('the planted torch.py was imported')\n")
    done = run_mirrord("drill", "--mirror", mirror, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "planted" not in done.stderr


def test_a_damaged_newest_copy_fails_the_drill(tmp_path: Path) -> None:
    """A flipped byte in the newest mirror copy: the drill does not fall back silently to an older unit."""
    mirror, env = _mirrored(tmp_path, "torch", lambda run: [save_checkpoint(run / f"step_{s}.pt", s) for s in (1, 2)])
    newest = mirror / "run" / "step_2.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    done = run_mirrord("drill", "--mirror", mirror, env=env)
    assert done.returncode == 1
    assert f"FAILED {newest}: the mirror's copy does not match the manifest" in done.stderr
    assert _scratch_left(mirror) == []


def test_without_torch_the_drill_checks_structure_only_and_says_so(tmp_path: Path) -> None:
    shim = tmp_path / "no-torch"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # as if not installed\n")
    mirror, env = _mirrored(tmp_path, "torch", lambda run: save_checkpoint(run / "step_10.pt", 10))
    done = run_mirrord(
        "drill", "--mirror", mirror, env={**env, "PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    )
    assert done.returncode == 0, done.stderr
    assert "not loaded (structure only: torch is not installed)" in done.stdout


def test_a_mirror_that_is_not_there_is_empty_or_lacks_the_run(tmp_path: Path) -> None:
    absent = run_mirrord("drill", "--mirror", tmp_path / "absent")
    assert (absent.returncode, absent.stdout) == (2, "")
    assert "does not exist" in absent.stderr
    (tmp_path / "empty").mkdir()
    empty = run_mirrord("drill", "--mirror", tmp_path / "empty", "--json")
    assert empty.returncode == 1
    assert json.loads(empty.stdout)["error"]["cause"] == "no verified checkpoint in the manifest"
    assert _scratch_left(tmp_path / "empty") == []
    mirror, env = _mirrored(tmp_path, "torch", lambda run: save_checkpoint(run / "step_10.pt", 10))
    other = run_mirrord("drill", "--mirror", mirror, "--run", "other", env=env)
    assert other.returncode == 1
    assert "no run 'other' on the mirror; its runs: 'run'" in other.stderr


# A sitecustomize that makes every Python process of the command write, at exit, its argv and limits.
RECORDER = """
import atexit, json, os, resource, sys
def _record():
    limits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU)]
    with open(os.environ["DRILL_RECORD"], "a") as out:
        out.write(json.dumps({"argv": sys.argv, "limits": limits}) + "\\n")
atexit.register(_record)
"""


def loader_seen(tmp_path: Path, env: dict[str, str], *args: str | Path) -> dict[str, object]:
    """`mirrord drill ARGS` (exit 0) watched by RECORDER: what the loader process recorded."""
    shim, record = tmp_path / "recorder", tmp_path / "record.jsonl"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(RECORDER)
    path = f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    done = run_mirrord("drill", *args, env={**env, "PYTHONPATH": path, "DRILL_RECORD": str(record)}, timeout=300)
    assert done.returncode == 0, done.stderr
    processes = [json.loads(line) for line in record.read_text().splitlines()]
    [loader] = [p for p in processes if p["argv"][0].endswith("loader.py")]
    return dict(loader)


def test_the_scratch_copy_is_on_the_mirrors_side_and_the_loader_is_bounded(tmp_path: Path) -> None:
    """The loader read a hidden folder in the mirror's root (gone afterwards), under the memory and CPU limits."""
    mirror, env = _mirrored(tmp_path, "torch", lambda run: save_checkpoint(run / "step_10.pt", 10))
    loader = loader_seen(tmp_path, env, "--mirror", mirror)
    _, layout, scratch, key, *_bounds = loader["argv"]
    assert (layout, key) == ("torch", "run/step_10.pt")
    assert Path(scratch).parent == mirror and Path(scratch).name.startswith(".mirrord-drill-")
    assert not Path(scratch).exists()
    size = (mirror / key).stat().st_size
    assert loader["limits"] == [LOAD_MEMORY_BYTES + size, LOAD_SECONDS]


@pytest.mark.host  # a read-only bind mount
@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_a_read_only_mirror_is_drilled_through_the_system_temp_dir(tmp_path: Path) -> None:
    """TOUCHES THE HOST: bind-mounts the mirror read-only; the scratch copy goes to TMPDIR, and is gone after."""
    mirror, env = _mirrored(tmp_path, "torch", lambda run: save_checkpoint(run / "step_10.pt", 10))
    view, temp = tmp_path / "ro-mirror", tmp_path / "temp"
    view.mkdir()
    temp.mkdir()
    subprocess.run(["mount", "--bind", str(mirror), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        loader = loader_seen(tmp_path, {**env, "TMPDIR": str(temp)}, "--mirror", view)
    finally:
        subprocess.run(["umount", str(view)], check=True)
    assert Path(str(loader["argv"][2])).parent == temp
    assert list(temp.iterdir()) == []


# A sitecustomize that holds the loader process (not the command) once started, its pid in $DRILL_STARTED.
HOLD_LOADER = """
import os, sys, time
if "mirrord.formats.loader" in sys.orig_argv:
    open(os.environ["DRILL_STARTED"], "w").write(str(os.getpid()))
    time.sleep(600)
"""


def test_sigterm_during_the_load_kills_the_loader_and_removes_the_scratch_copy(tmp_path: Path) -> None:
    """The drill stops as sync does on SIGTERM (exit 143): the loader it started is gone, and so is the copy."""
    mirror, env = _mirrored(tmp_path, "torch", lambda run: save_checkpoint(run / "step_10.pt", 10))
    shim, started = tmp_path / "hold", tmp_path / "started"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_LOADER)
    path = f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = child_env({**env, "PYTHONPATH": path, "DRILL_STARTED": str(started)})
    drill = subprocess.Popen([*mirrord_argv(), "drill", "--mirror", str(mirror)], env=env, start_new_session=True)
    try:
        wait_for(lambda: started.exists() and started.read_text() != "", 120, "the loader started")
        assert _scratch_left(mirror) != []
        drill.send_signal(signal.SIGTERM)
        assert drill.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):  # (nothing is left of the group when the drill did its job)
            os.killpg(drill.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.read_text()), 0)
    assert _scratch_left(mirror) == []
