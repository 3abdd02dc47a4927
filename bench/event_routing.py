"""Folder layouts: what one turn of the daemon's main loop costs when watch events arrive for one new
checkpoint folder, in a Hugging Face tree of N mirrored `checkpoint-K/` folders (5 files each).

    python -m bench.event_routing [--folders 200] [--bursts 10] [--workdir DIR] [--out DIR] [--smoke]

* **full rescan per event batch** (mirrord before event routing): any event in a folder layout made the
  loop list both trees whole and plan every unit (what `drain_hints` returning True did);
* **routed to its unit** (now): the events name the folder they lie in; only that folder is listed on
  both sides and judged.

The daemon runs in-process (real volumes, real copies on its worker threads, a watcher stand-in that
delivers the events of the folder just written: one close per file). Each burst: write a new folder,
deliver its events, time one `Reconciler.work()` (the loop's turn: drain, list, judge, queue), then wait
until its copy is recorded so every burst starts from the same state. The two modes alternate burst by
burst. Results: bench/results/event_routing.{md,json} (smoke: WORKDIR only). No timing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import LoadSampler, load_average, log, md_table, write_json
from mirrord.config import Config, load_config
from mirrord.service.daemon import Daemon, Volumes
from mirrord.service.reconciler import Reconciler
from mirrord.service.watcher import Hint
from mirrord.store.volume import LocalMirror, LocalVolume

RESULTS = Path(__file__).resolve().parent / "results"
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")


def write_folder(folder: Path, step: int) -> list[Path]:
    """A small HF checkpoint folder: the Trainer's five files (real formats), trainer_state.json last."""
    from tests.support.folders import write_hf

    return write_hf(folder, step, width=8)


class StandInWatcher:
    """The daemon's watcher, delivering only what the bench emits."""

    def __init__(self, emit: Callable[[Hint], None]) -> None:
        self.emit = emit

    def start(self) -> None:
        """Nothing to start."""

    def is_alive(self) -> bool:
        return True

    def stop(self) -> None:
        """Nothing to stop."""


def full_rescan_drain(reconciler: Reconciler) -> Callable[[], bool]:
    """drain_hints as it was for folder layouts: any event asks for a full reconcile."""

    def drain() -> bool:
        had = bool(reconciler.inbox.hints)
        reconciler.inbox.hints.clear()
        return had

    return drain


def recorded(daemon: Daemon, prefix: str) -> bool:
    return sum(1 for rel in daemon.manifest.entries if rel.startswith(prefix)) == len(FILES)


def wait(cond: Callable[[], bool], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def measure(folders: int, bursts: int, work: Path) -> dict[str, Any]:
    primary, mirror = work / "primary", work / "mirror"
    shutil.rmtree(work, ignore_errors=True)
    run = primary / "run"
    log(f"event_routing: writing {folders} folders")
    for i in range(1, folders + 1):
        write_folder(run / f"checkpoint-{i}", i)
    config: Config = load_config(
        environ={},
        overrides={
            "primary": str(primary),
            "mirror": str(mirror),
            "layout": "hf",
            "copy": {"settle_seconds": 0, "workers": 2},
            "prune": {"enabled": False},
            "metrics": {"enabled": False},
            "watch": {"rescan_interval_seconds": 86400},
            "log": {"level": "warning"},
        },
        check_roots=False,
    )
    lm = LocalMirror(config.mirror)
    watchers: list[StandInWatcher] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(lm.lock())
        daemon = Daemon(
            config,
            lambda: (config, True),
            Volumes(LocalVolume(primary), lm, lm.read_manifest()),
            watcher_factory=lambda root, patterns, mode, poll, emit: (
                watchers.append(StandInWatcher(emit)) or watchers[-1]
            ),
        )
        stack.callback(daemon.shutdown)
        daemon.start()
        wait(lambda: len(daemon.manifest.entries) == folders * len(FILES), "the initial mirror")
        log(f"event_routing: {folders} folders mirrored; {bursts} bursts per mode")
        routed_drain = daemon.reconciler.drain_hints
        modes = {
            "full rescan per event batch": full_rescan_drain(daemon.reconciler),
            "routed to its unit": routed_drain,
        }
        seconds: dict[str, list[float]] = {m: [] for m in modes}
        step = folders
        with LoadSampler() as load:
            for _ in range(bursts):
                for mode, drain in modes.items():
                    step += 1
                    name = f"run/checkpoint-{step}"
                    written = write_folder(run / f"checkpoint-{step}", step)
                    daemon.reconciler.drain_hints = drain  # type: ignore[method-assign]
                    for path in written:
                        watchers[-1].emit(Hint(path.relative_to(primary).as_posix(), committed=False))
                    started = time.perf_counter()
                    daemon.reconciler.work()
                    seconds[mode].append(time.perf_counter() - started)
                    wait(lambda name=name: recorded(daemon, name + "/"), f"{name} mirrored")  # type: ignore[misc]
        daemon.reconciler.drain_hints = routed_drain  # type: ignore[method-assign]
    rows = []
    base = statistics.median(seconds["full rescan per event batch"])
    for mode, values in seconds.items():
        med = statistics.median(values)
        rows.append(
            {
                "mode": mode,
                "median_ms": round(med * 1000, 2),
                "max_ms": round(max(values) * 1000, 2),
                "ratio_to_full_rescan": round(med / base, 3),
                "bursts": len(values),
            }
        )
    return {
        "folders": folders,
        "files": (folders + 2 * bursts) * len(FILES),
        "rows": rows,
        "load_average": {**load.summary(), "after_1min": load_average()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.event_routing", description=__doc__.split("\n", 1)[0])
    p.add_argument("--folders", type=int, default=200)
    p.add_argument("--bursts", type=int, default=10)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="20 folders, 2 bursts; results stay in the workdir")
    args = p.parse_args(argv)
    folders, bursts = (20, 2) if args.smoke else (args.folders, args.bursts)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mirrord-bench-events-"))
    try:
        doc = measure(folders, bursts, work / "tree")
    finally:
        shutil.rmtree(work / "tree", ignore_errors=True)
    out = args.out or (work if args.smoke else RESULTS)
    table = md_table(
        ["mode", "median ms", "max ms", "ratio to full rescan", "bursts"],
        [[r["mode"], r["median_ms"], r["max_ms"], r["ratio_to_full_rescan"], r["bursts"]] for r in doc["rows"]],
    )
    text = (
        f"# Event routing: one loop turn for the events of one new folder\n\n"
        f"HF layout, {doc['folders']} mirrored `checkpoint-K/` folders of 5 files; one new folder per burst, "
        f"its 5 close events delivered at once, one `Reconciler.work()` timed "
        f"(`python -m bench.event_routing --folders {folders} --bursts {bursts}`).\n\n{table}\n\n"
        f"Load average (1 min) during the bursts: {doc['load_average']['load_min']}-"
        f"{doc['load_average']['load_max']}, mean {doc['load_average']['load_mean']}.\n"
    )
    write_json(out / "event_routing.json", doc)
    (out / "event_routing.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
