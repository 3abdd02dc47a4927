"""Issue 34, item 2 with the real savers: a folder unit is mirrored only once the saver's own files say it is
whole, however long the saver pauses between its files (a pause held here by a gate the test opens).

For each saver a poller lists the mirror every 20 ms and never sees a unit folder under its final name in
more than one state or without the files of the finished save; the daemon says it judged the paused folder
incomplete (`unit.incomplete`) before the gate opens; `mirrord latest` never names a partial folder; and the
library's own load works from the mirror.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_trainers import MirrorPoller, assert_no_leftovers, latest_on_mirror
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for


def settings(layout: str) -> dict[str, Any]:
    return {
        "layout": layout,
        "copy": {"settle_seconds": 0.3, "workers": 2},
        "unit": {"settle_seconds": 1.0},
        "watch": {"rescan_interval_seconds": 2},
    }


@contextmanager
def saving(save: Callable[[], None]) -> Iterator[threading.Thread]:
    """`save` in a thread (it waits on the test's gate), joined at the end."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            save()
        except BaseException as exc:  # re-raised in the test
            errors.append(exc)

    thread = threading.Thread(target=run, name="saver", daemon=True)
    thread.start()
    yield thread
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors


def judged_incomplete(d: DaemonProcess, unit: str, poller: MirrorPoller, mirror: Path) -> None:
    """Until the daemon judged the paused folder quiet and not whole (or, the defect, published it)."""

    def seen() -> bool:
        assert not d.exited(), d.log_text()[-4000:]
        assert not (mirror / unit).exists(), f"{unit} published while its saver was paused: {poller.seen.get(unit)}"
        return bool(d.events("unit.incomplete", path=unit))

    wait_for(seen, 60, f"unit.incomplete for {unit}")


def mirrored(d: DaemonProcess, mirror: Path, rel: str, layout: str, latest: str | None = None) -> None:
    def done() -> bool:
        assert not d.exited(), d.log_text()[-4000:]
        return (mirror / rel).exists() and latest_on_mirror(mirror, layout) == (latest or rel)

    wait_for(done, 60, f"{rel} mirrored and named by latest", interval=0.3)


def assert_whole(poller: MirrorPoller, primary: Path, mirror: Path) -> None:
    """Every unit the poller saw, in exactly one state: the files (and sizes) of the finished save."""

    def whole(rel: str, view: dict[str, int]) -> bool:
        made = {p.name: p for p in (primary / rel).iterdir()}
        return set(view) == set(made) and all(view[n] == p.stat().st_size for n, p in made.items() if p.is_file())

    partial = poller.partial(whole)
    print(f"{mirror.parent.name}: {poller.listings} listings, {len(partial)} partial sightings")  # -s: the figures
    assert not poller.errors and poller.listings > 50
    assert partial == {}
    assert_no_leftovers(mirror)


# --- transformers save_pretrained with a pause between shards ----------------------------------------------


def test_save_pretrained_with_a_pause_between_shards_is_mirrored_whole(
    tmp_path: Path, daemon_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers import modeling_utils

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    gate, shards = threading.Event(), []
    real_save = modeling_utils.safe_save_file

    def gathered_then_saved(tensors: Any, filename: str, metadata: Any = None) -> None:
        if shards:  # the device-to-host gather before each later shard, held by the test
            assert gate.wait(60)
        shards.append(filename)
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(modeling_utils, "safe_save_file", gathered_then_saved)
    monkeypatch.setattr("tqdm.std.tqdm.monitor_interval", 0)  # no monitor thread left behind
    d = daemon_factory(settings("hf_model")).start()
    with MirrorPoller(mirror, re.compile(r"step_\d+")) as poller:
        with saving(lambda: model.save_pretrained(primary / "run" / "step_1", max_shard_size="40KB")):
            judged_incomplete(d, "run/step_1", poller, mirror)
            gate.set()
        assert len(shards) > 1
        mirrored(d, mirror, "run/step_1", "hf_model")
    assert_whole(poller, primary, mirror)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(mirror / "run" / "step_1")
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
    assert d.stop() == 0


# --- accelerate save_state with a slow registered object --------------------------------------------------


class SlowState:
    """A registered object whose state_dict() waits for the test's gate (a slow gather, a remote fetch)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        assert self.gate.wait(60)
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def test_accelerate_save_state_with_a_slow_registered_object_is_mirrored_whole(tmp_path: Path, daemon_factory) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import ProjectConfiguration

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    project = primary / "run"
    accelerator = accelerate.Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    slow = SlowState()
    accelerator.register_for_checkpointing(slow)
    d = daemon_factory(settings("accelerate")).start()
    with MirrorPoller(mirror, re.compile(r"checkpoint_\d+")) as poller:
        slow.value = 1
        accelerator.save_state()  # the run's first: nothing says how many objects are registered (a guess)
        mirrored(d, mirror, "run/checkpoints/checkpoint_0", "accelerate")
        slow.value, slow.gate = 2, threading.Event()
        with torch.no_grad():
            model.weight.add_(1.0)
        with saving(accelerator.save_state):
            judged_incomplete(d, "run/checkpoints/checkpoint_1", poller, mirror)
            slow.gate.set()
        mirrored(d, mirror, "run/checkpoints/checkpoint_1", "accelerate")
    assert_whole(poller, primary, mirror)
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    slow.value = 0
    accelerator.load_state(str(mirror / "run" / "checkpoints" / "checkpoint_1"))
    assert torch.equal(model.weight.detach(), expected) and slow.value == 2
    assert d.stop() == 0


# --- Megatron-style iterations with rank skew, written with torch.save ------------------------------------

TRACKER = "latest_checkpointed_iteration.txt"


def save_rank(save_dir: Path, iteration: int, rank: int) -> None:
    """What Megatron's legacy save writes for one tensor-parallel rank: torch.save in place."""
    folder = save_dir / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"iteration": iteration, "model": {"w": torch.full((64, 64), float(iteration * 10 + rank))}},
        folder / "model_optim_rng.pt",
    )


def load_megatron(save_dir: Path, ranks: int) -> tuple[int, list[dict[str, Any]]]:
    """Megatron's own resume, in short: the tracker names the iteration; every rank loads its file."""
    iteration = int((save_dir / TRACKER).read_text().strip())
    return iteration, [
        torch.load(save_dir / f"iter_{iteration:07d}" / f"mp_rank_{r:02d}" / "model_optim_rng.pt", weights_only=True)
        for r in range(ranks)
    ]


def test_megatron_iterations_with_rank_skew_are_mirrored_whole_tracker_after(tmp_path: Path, daemon_factory) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    save_dir = primary / "run"
    d = daemon_factory(settings("megatron")).start()
    with MirrorPoller(mirror, re.compile(r"iter_\d+")) as poller:
        for iteration in (1, 2):
            save_rank(save_dir, iteration, 0)  # rank 1 saves later (rank skew): held until the daemon judged it
            judged_incomplete(d, f"run/iter_{iteration:07d}", poller, mirror)
            if iteration > 1:  # the tracker never names an iteration the mirror lacks
                assert (mirror / "run" / TRACKER).read_text().strip() == str(iteration - 1)
            save_rank(save_dir, iteration, 1)
            (save_dir / TRACKER).write_text(str(iteration))  # rank 0, after the barrier
            mirrored(d, mirror, f"run/iter_{iteration:07d}", "megatron")
            wait_for(
                lambda i=iteration: (
                    (mirror / "run" / TRACKER).is_file() and (mirror / "run" / TRACKER).read_text().strip() == str(i)
                ),
                60,
                "the tracker mirrored",
            )
        save_rank(save_dir, 3, 0)  # a crash before rank 1 saved iteration 3; the restarted job saves 4
        save_rank(save_dir, 4, 0)
        save_rank(save_dir, 4, 1)
        (save_dir / TRACKER).write_text("4")
        mirrored(d, mirror, "run/iter_0000004", "megatron")
        wait_for(
            lambda: (mirror / "run" / TRACKER).read_text().strip() == "4",
            60,
            "the tracker mirrored after iteration 4 (it follows its iteration)",
        )
        wait_for(
            lambda: any("mp_rank_01" in e["why"] for e in d.events("unit.incomplete", path="run/iter_0000003")),
            60,
            "iteration 3, older than the tracker's, judged incomplete: rank 1 never saved it",
        )
    assert not (mirror / "run" / "iter_0000003").exists()
    assert_whole(poller, primary, mirror)
    iteration, states = load_megatron(mirror / "run", 2)
    assert iteration == 4 and [s["model"]["w"][0, 0].item() for s in states] == [40.0, 41.0]
    assert d.stop() == 0


# --- a custom folder without a marker: a file renamed into place is no evidence the folder is done -------------


def test_a_folder_whose_files_are_renamed_in_one_by_one_waits_for_the_whole_folder(
    tmp_path: Path, daemon_factory
) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    folder = primary / "run" / "ckpt_1"
    d = daemon_factory(
        {
            "layout": "custom",
            "patterns": ["ckpt_*"],
            "prune": {"step_pattern": r"ckpt_(\d+)"},
            "unit": {"kind": "folder", "settle_seconds": 3.0},
            "copy": {"settle_seconds": 0.3},
        }
    ).start()

    def renamed_in(name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.ones(32, 32)}, folder / f".{name}.tmp")
        (folder / f".{name}.tmp").rename(folder / name)

    with MirrorPoller(mirror, re.compile(r"ckpt_\d+")) as poller:
        renamed_in("model.pt")
        judged_incomplete(d, "run/ckpt_1", poller, mirror)  # quiet for copy.settle_seconds, not unit.settle_seconds
        renamed_in("optimizer.pt")
        wait_for(lambda: (mirror / "run" / "ckpt_1").exists(), 60, "ckpt_1 mirrored")
    assert_whole(poller, primary, mirror)
    assert d.stop() == 0
