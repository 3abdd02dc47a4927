"""Issue 16 with the real libraries: transformers' Trainer, torch.distributed.checkpoint and Lightning
train tiny models on CPU (tests/support/train_*.py) while a real daemon mirrors their checkpoints.

For each: a poller lists the mirror every 20 ms during training and never sees a checkpoint folder under
its final name that is not whole; once training is over the mirror holds exactly the units the trainer
kept, with no staging or empty folder left; then the primary is deleted and training resumes **from the
mirror** with the library's own resume call, and the loss of every resumed step is exactly the loss of
the uninterrupted run (fixed seeds, one CPU thread).
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mirrord.store.manifest import Manifest
from tests.support.cli import run_mirrord
from tests.support.daemon import DaemonProcess
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT = 300


def train(module: str, out: Path, *args: str | Path, log: Path) -> dict[int, float]:
    """Run `python -m tests.support.<module> OUT ARGS` to the end; its losses by step."""
    cmd = [sys.executable, "-m", f"tests.support.{module}", str(out), *map(str, args)]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=TRAIN_TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text(errors="replace")
    assert code == 0, f"{module} exited {code}:\n{text[-4000:]}"
    losses = {}
    for line in text.splitlines():
        if line.startswith('{"step"'):
            event = json.loads(line)
            losses[event["step"]] = event["loss"]
    return losses


class MirrorPoller:
    """Lists the mirror every 20 ms: every folder under a final unit name, with its files and their sizes
    (or a file unit's size).

    A folder unit is published by one rename of a whole staging folder, so every listing of a final name
    must show the same files with the same sizes, and those of a whole checkpoint.
    """

    def __init__(self, root: Path, unit: re.Pattern[str]) -> None:
        self.root = root
        self.unit = unit
        self.seen: dict[str, set[frozenset[tuple[str, int]]]] = {}
        self.listings = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mirror-poller", daemon=True)

    def __enter__(self) -> MirrorPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception as exc:  # a failed listing must fail the test, not vanish in a thread
                self.errors.append(repr(exc))
            self._stop.wait(0.02)

    def _poll(self) -> None:
        if not self.root.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                if not self.unit.fullmatch(name):
                    continue
                path = Path(dirpath) / name
                files = set()
                try:
                    if name in filenames:  # a file unit: its one name and size
                        files.add((name, path.stat(follow_symlinks=False).st_size))
                    else:
                        with os.scandir(path) as it:
                            for entry in it:
                                files.add((entry.name, entry.stat(follow_symlinks=False).st_size))
                except FileNotFoundError:
                    continue  # gone between the two listings (retention): a disappearance, not a partial view
                self.seen.setdefault(path.relative_to(self.root).as_posix(), set()).add(frozenset(files))
        self.listings += 1

    def partial(self, whole: Callable[[str, dict[str, int]], bool]) -> dict[str, list[dict[str, int]]]:
        """Every unit seen in more than one state, or in a state `whole` rejects."""
        bad = {}
        for rel, states in self.seen.items():
            views = [dict(s) for s in states]
            if len(views) != 1 or not whole(rel, views[0]):
                bad[rel] = views
        return bad


def leftovers(mirror: Path) -> list[str]:
    """Staging folders, temp files and empty folders anywhere on the mirror (the staging area itself stays)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(mirror):
        for name in dirnames + filenames:
            if name.endswith((".part", ".tmp")):
                found.append(f"{dirpath}/{name}")
        if Path(dirpath) not in (mirror, mirror / ".mirrord-staging") and not dirnames and not filenames:
            found.append(f"{dirpath} (empty)")
    return found


def assert_no_leftovers(mirror: Path) -> None:
    """No leftovers, once a running daemon's own passing temp files (a journal being started) are gone."""
    wait_for(lambda: leftovers(mirror) == [], 30, "no leftovers on the mirror", context=lambda: repr(leftovers(mirror)))


def unit_names(folder: Path, pattern: re.Pattern[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if pattern.fullmatch(p.name)) if folder.is_dir() else []


def latest_on_mirror(mirror: Path, layout: str) -> str | None:
    out = run_mirrord(
        "latest", "--json", "--mirror", mirror, env={"MIRRORD_METRICS__ENABLED": "false", "MIRRORD_LAYOUT": layout}
    )
    return json.loads(out.stdout).get("relative_path") if out.stdout.strip() else None


def settings(layout: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "layout": layout,
        "copy": {"settle_seconds": 0.5, "workers": 2},
        # hf and lightning follow the trainer (prune.mode "auto"), where a keep_last would be a config error
        "prune": {"enabled": True, "min_age_seconds": 0, **({} if layout in ("hf", "lightning") else {"keep_last": 2})},
        "watch": {"rescan_interval_seconds": 2},
    }
    for key, value in extra.items():
        base.setdefault(key, {}).update(value)
    return base


def wait_converged(
    d: DaemonProcess, primary: Path, mirror: Path, pattern: re.Pattern[str], newest: str, layout: str
) -> None:
    """Until the mirror holds the units the trainer kept, and `latest` names the newest."""

    def converged() -> bool:
        if d.exited():
            raise AssertionError(f"daemon exited:\n{d.log_text()[-4000:]}")
        return (
            unit_names(mirror / "run", pattern) == unit_names(primary / "run", pattern)
            and latest_on_mirror(mirror, layout) == newest
        )

    try:
        wait_for(converged, 120, f"the mirror to hold the trainer's units, latest {newest}", interval=0.5)
    except AssertionError as exc:
        listing = sorted(str(p.relative_to(mirror)) for p in mirror.rglob("*")) if mirror.exists() else []
        raise AssertionError(
            f"{exc}\nprimary: {unit_names(primary / 'run', pattern)}\nmirror: {listing}\n"
            f"latest: {latest_on_mirror(mirror, layout)}\nlog:\n{d.log_text()[-6000:]}"
        ) from None


def assert_mirrored_whole(poller: MirrorPoller, mirror: Path, files: set[str]) -> None:
    """The poller listed the mirror all along and saw every unit only whole (exactly `files`), and nothing
    (staging, temp file, empty folder) is left on the mirror."""
    assert not poller.errors and poller.listings > 50
    assert poller.partial(lambda rel, view: set(view) == files) == {}
    assert_no_leftovers(mirror)


def assert_deep_verified(mirror: Path, layout: str) -> None:
    """`mirrord verify --deep` finds nothing: every mirrored file checked by its own format's validator."""
    deep = run_mirrord("verify", "--deep", "--mirror", mirror, env={"MIRRORD_LAYOUT": layout})
    assert deep.returncode == 0, deep.stdout + deep.stderr


# --- transformers Trainer: checkpoint-N/ folders ------------------------------------------------------------

HF_UNIT = re.compile(r"checkpoint-\d+")


def test_hf_trainer_mirrored_while_it_rotates_and_resumed_from_the_mirror(
    tmp_path: Path, gated_primary, daemon_factory
) -> None:
    """save_steps=2, save_total_limit=2 on 12 steps, while a gate holds every copy of optimizer.pt in flight
    until the trainer is done: the folders held are rotated away while they are copied, and none is left
    partial or empty on the mirror."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    gated_primary.stall("optimizer.pt")
    d = daemon_factory(settings("hf")).start()
    with MirrorPoller(mirror, HF_UNIT) as poller:
        uninterrupted = train(
            "train_hf",
            gated_primary.backing / "run",
            "--steps",
            12,
            "--save-steps",
            2,
            "--save-total-limit",
            2,
            "--step-seconds",
            0.5,
            log=tmp_path / "a.log",
        )
        assert unit_names(primary / "run", HF_UNIT) == ["checkpoint-10", "checkpoint-12"]
        wait_for(lambda: d.events("copy.started"), 120, "a copy held at the gate")
        gated_primary.unstall()
        wait_converged(d, primary, mirror, HF_UNIT, "run/checkpoint-12", "hf")
    files = {p.name for p in (primary / "run" / "checkpoint-12").iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert_mirrored_whole(poller, mirror, files)
    assert d.metric("mirrord_copies_total", 'result="failed"') == 0
    assert not d.events("copy.failed")
    assert_deep_verified(mirror, "hf")  # safetensors, JSON and torch zips, each by its format
    cut_short = [e["path"] for e in d.events("copy.source_gone")]
    assert cut_short, "no copy was overtaken by the trainer's rotation: the test did not test it"
    print(f"hf: {poller.listings} listings, units seen {sorted(poller.seen)}, source_gone {cut_short}")
    assert d.stop() == 0
    shutil.rmtree(gated_primary.backing / "run")  # the primary is lost: everything below comes from the mirror
    resumed = train(
        "train_hf",
        tmp_path / "resumed",
        "--steps",
        12,
        "--save-steps",
        2,
        "--resume",
        mirror / "run" / "checkpoint-10",
        log=tmp_path / "b.log",
    )
    assert resumed == {step: uninterrupted[step] for step in (11, 12)}


# --- torch.distributed.checkpoint: step_N/ folders with .metadata -----------------------------------------

DCP_UNIT = re.compile(r"step_\d+")


def test_dcp_save_mirrored_whole_and_resumed_with_dcp_load_from_the_mirror(tmp_path: Path, daemon_factory) -> None:
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings("dcp")).start()
    with MirrorPoller(mirror, DCP_UNIT) as poller:
        uninterrupted = train(
            "train_dcp",
            primary / "run",
            "--steps",
            12,
            "--save-steps",
            2,
            "--keep",
            2,
            "--step-seconds",
            0.3,
            log=tmp_path / "a.log",
        )
        wait_converged(d, primary, mirror, DCP_UNIT, "run/step_12", "dcp")
    assert unit_names(mirror / "run", DCP_UNIT) == ["step_10", "step_12"]
    files = {p.name for p in (primary / "run" / "step_12").iterdir()}
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files)
    assert_mirrored_whole(poller, mirror, files)
    print(f"dcp: {poller.listings} listings, units seen {sorted(poller.seen)}")
    assert_deep_verified(mirror, "dcp")
    assert d.stop() == 0
    shutil.rmtree(primary)
    resumed = train(
        "train_dcp",
        tmp_path / "resumed",
        "--steps",
        12,
        "--save-steps",
        2,
        "--resume",
        mirror / "run" / "step_10",
        log=tmp_path / "b.log",
    )
    assert resumed == {step: uninterrupted[step] for step in (11, 12)}


# --- DeepSpeed: global_stepN/ folders named by the `latest` tag file --------------------------------------

DS_UNIT = re.compile(r"global_step\d+")


class TagPoller(MirrorPoller):
    """Also reads the mirror's run/latest at every listing: the folder it names must be on the mirror then
    (the tag file is published after the folder, so `load_checkpoint(mirror)` never follows it into
    nothing)."""

    def __init__(self, root: Path, unit: re.Pattern[str]) -> None:
        super().__init__(root, unit)
        self.tags: set[str] = set()
        self.dangling: list[str] = []

    def _poll(self) -> None:
        tag_file = self.root / "run" / "latest"
        try:
            tag = tag_file.read_text().strip()
        except FileNotFoundError:
            tag = None
        super()._poll()
        if tag is not None:
            self.tags.add(tag)
            # Listed after the tag was read: a folder retention removed meanwhile is an older one.
            if not (self.root / "run" / tag).is_dir() and (self.root / "run" / "latest").read_text().strip() == tag:
                self.dangling.append(tag)


def test_deepspeed_save_checkpoint_mirrored_whole_and_resumed_from_the_mirrors_latest(
    tmp_path: Path, daemon_factory
) -> None:
    """engine.save_checkpoint every 2 steps of 12 (ZeRO stage 1: model states and the optimizer's
    partition in each global_stepN/, then `latest`), the oldest removed beyond 2: the mirror keeps the
    two folders whole and `latest` naming the newest; `engine.load_checkpoint(<mirror>)` (which follows
    the mirror's `latest`) continues with steps 13-16 exactly as an uninterrupted 16-step run."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    d = daemon_factory(settings("deepspeed")).start()
    with TagPoller(mirror, DS_UNIT) as poller:
        mirrored = train(
            "train_deepspeed",
            primary / "run",
            "--steps",
            12,
            "--save-steps",
            2,
            "--keep",
            2,
            "--step-seconds",
            0.3,
            log=tmp_path / "a.log",
        )
        assert unit_names(primary / "run", DS_UNIT) == ["global_step10", "global_step12"]
        wait_converged(d, primary, mirror, DS_UNIT, "run/global_step12", "deepspeed")
        wait_for(
            lambda: (
                (mirror / "run" / "latest").is_file() and (mirror / "run" / "latest").read_text() == "global_step12"
            ),
            120,
            "latest mirrored",
        )
        # The poller lists every 20 ms on its own thread: on a loaded machine its next listing can come
        # after the wait above returned; stop it only once it has read the final tag too.
        wait_for(lambda: "global_step12" in poller.tags, 60, "the poller read the final tag")
    assert unit_names(mirror / "run", DS_UNIT) == ["global_step10", "global_step12"]
    files = {p.name for p in (primary / "run" / "global_step12").iterdir()}
    assert files == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert_mirrored_whole(poller, mirror, files)
    assert poller.dangling == [] and "global_step12" in poller.tags, (poller.dangling, d.log_text()[-6000:])
    assert d.metric("mirrord_copies_total", 'result="failed"') == 0
    print(f"deepspeed: {poller.listings} listings, units seen {sorted(poller.seen)}, tags seen {sorted(poller.tags)}")
    assert_deep_verified(mirror, "deepspeed")
    assert d.stop() == 0
    shutil.rmtree(primary)
    resumed = train(
        "train_deepspeed",
        tmp_path / "resumed",
        "--steps",
        16,
        "--save-steps",
        0,
        "--resume",
        mirror / "run",
        log=tmp_path / "b.log",
    )
    assert str(mirror / "run" / "global_step12") in (tmp_path / "b.log").read_text()
    uninterrupted = train(
        "train_deepspeed", tmp_path / "reference", "--steps", 16, "--save-steps", 0, log=tmp_path / "c.log"
    )
    assert mirrored == {step: uninterrupted[step] for step in range(1, 13)}
    assert resumed == {step: uninterrupted[step] for step in range(13, 17)}


def test_deepspeeds_latest_picker_on_the_mirror_never_follows_a_folder_in_flight(
    tmp_path: Path, gated_primary, daemon_factory
) -> None:
    """DeepSpeed's own picker (`engine.load_checkpoint(dir)` with no tag reads dir/latest, then loads that
    folder) run against the mirror while the gate holds global_step4's copy in flight (its saver has
    already written `latest` naming it on the primary): it resumes global_step2; once the gate opens,
    global_step4."""
    saved, run, mirror = tmp_path / "saved", gated_primary.backing / "run", tmp_path / "mirror" / "run"
    train("train_deepspeed", saved, "--steps", 4, "--save-steps", 2, "--keep", 0, log=tmp_path / "a.log")
    run.mkdir()
    shutil.copytree(saved / "global_step2", run / "global_step2")
    (run / "latest").write_text("global_step2")
    d = daemon_factory(settings("deepspeed", watch={"rescan_interval_seconds": 0.5})).start()
    wait_for(lambda: (mirror / "latest").is_file(), 120, "global_step2 and its tag mirrored")

    def resumed(log: str) -> str:
        train(
            "train_deepspeed", tmp_path / log, "--steps", 4, "--save-steps", 0, "--resume", mirror, log=tmp_path / log
        )
        line = next(x for x in (tmp_path / log).read_text().splitlines() if x.startswith('{"resumed"'))
        return Path(json.loads(line)["resumed"]).parent.name  # the model states file it loaded

    gated_primary.stall("mp_rank_00_model_states.pt")
    shutil.copytree(saved / "global_step4", run / "global_step4")
    (run / "latest").write_text("global_step4")
    staging = tmp_path / "mirror" / ".mirrord-staging"
    wait_for(lambda: staging.is_dir() and any(staging.iterdir()), 120, "global_step4's copy held in flight")
    assert resumed("held.log") == "global_step2"
    assert (mirror / "latest").read_text() == "global_step2"
    gated_primary.unstall()
    wait_for(lambda: (mirror / "latest").read_text() == "global_step4", 120, "global_step4 and its tag mirrored")
    assert resumed("after.log") == "global_step4"
    assert d.stop() == 0


# --- Lightning: epoch=E-step=N.ckpt files and last.ckpt ----------------------------------------------------

LIGHTNING_STEP = re.compile(r"epoch=\d+-step=\d+\.ckpt")


def mirrored_lightning_run(base: Path, last: str, epochs: int, step_seconds: float = 0.1) -> dict[str, Any]:
    """One Lightning run on base/primary, mirrored by a daemon to base/mirror until retention settled."""
    primary, mirror = base / "primary", base / "mirror"
    primary.mkdir(parents=True)
    d = DaemonProcess(base, primary, mirror, settings("lightning"))
    try:
        d.start()
        with MirrorPoller(mirror, LIGHTNING_STEP) as poller:
            losses = train(
                "train_lightning",
                primary / "run",
                "--epochs",
                epochs,
                "--keep",
                2,
                "--last",
                last,
                "--step-seconds",
                step_seconds,
                log=base / "train.log",
            )
            wait_converged(
                d, primary, mirror, LIGHTNING_STEP, f"run/epoch={epochs - 1}-step={2 * epochs}.ckpt", "lightning"
            )
            # The trainer's final last.ckpt, not an earlier epoch's (which already had the name on the mirror).
            wait_for(lambda: same_last_ckpt(primary / "run", mirror / "run"), 120, "the final last.ckpt mirrored")
        run = {
            "losses": losses,
            "primary": primary,
            "mirror": mirror,
            "poller": poller,
            "failed": d.metric("mirrord_copies_total", 'result="failed"'),
            "last_copies": len(d.events("copy.committed", path="run/last.ckpt")),
            "last_aliased": d.events("copy.aliased", path="run/last.ckpt"),
            "aliased_metric": d.metric("mirrord_copies_total", 'result="aliased"'),
        }
        print(f"lightning ({last}): {poller.listings} listings, units seen {sorted(poller.seen)}")
        assert d.stop() == 0
        return run
    finally:
        d.kill()


def same_last_ckpt(primary: Path, mirror: Path) -> bool:
    """Whether the mirror's last.ckpt is the primary's: the same bytes, or a link to the same step's name."""
    src, dst = primary / "last.ckpt", mirror / "last.ckpt"
    if src.is_symlink():
        return dst.is_symlink() and dst.readlink().name == src.readlink().name
    return dst.is_file() and not dst.is_symlink() and filecmp.cmp(src, dst, shallow=False)


def test_lightning_steps_and_last_ckpt_copy_mirrored_and_resumed_from_the_mirror(tmp_path: Path) -> None:
    """ModelCheckpoint(save_top_k=2, save_last=True) for 6 epochs of 2 steps: the mirror keeps the two
    steps the trainer kept and last.ckpt (the same bytes); Trainer.fit(ckpt_path=<mirror step 10>) gives
    steps 11 and 12 exactly.

    last.ckpt is a second torch.save of the step just saved (the same bytes from the second epoch on): it
    is published on the mirror as a hard link of that step's mirrored copy (copy.aliased, no byte
    written), never copied again in full; Trainer.fit(ckpt_path=<mirror last.ckpt>) continues exactly."""
    run = mirrored_lightning_run(tmp_path / "copy", "copy", 6, step_seconds=1.0)  # 2 s an epoch: each save seen
    assert not run["poller"].errors and run["poller"].listings > 50
    assert len(run["poller"].seen) >= 2
    assert run["poller"].partial(lambda rel, view: True) == {}  # a step file is never seen with two sizes
    assert run["failed"] == 0
    mirrored = run["mirror"] / "run"
    assert unit_names(mirrored, LIGHTNING_STEP) == ["epoch=4-step=10.ckpt", "epoch=5-step=12.ckpt"]
    assert (mirrored / "last.ckpt").read_bytes() == (run["primary"] / "run" / "last.ckpt").read_bytes()
    # An alias of the newest mirrored step: one inode, two names; at most the first epoch's last.ckpt
    # (which records no last_model_path yet, so differs from its step) was ever copied in full.
    last, newest = (mirrored / "last.ckpt").stat(), (mirrored / "epoch=5-step=12.ckpt").stat()
    assert (last.st_ino, last.st_nlink) == (newest.st_ino, 2)
    assert len(run["last_aliased"]) >= 2, run["last_aliased"]  # re-published on later saves, as a link each time
    assert run["last_aliased"][-1]["twin"] == "run/epoch=5-step=12.ckpt"
    assert all(e["bytes_written"] == 0 for e in run["last_aliased"])
    assert run["last_copies"] <= 1, run["last_copies"]
    assert run["aliased_metric"] == len(run["last_aliased"])
    entries = Manifest.load(run["mirror"]).entries
    assert entries["run/last.ckpt"].digest == entries["run/epoch=5-step=12.ckpt"].digest
    assert entries["run/last.ckpt"].step is None
    print(
        f"lightning (copy): last.ckpt copied {run['last_copies']} time(s), aliased {len(run['last_aliased'])} time(s)"
    )
    assert_no_leftovers(run["mirror"])
    shutil.rmtree(run["primary"])
    resumed = train(
        "train_lightning",
        tmp_path / "resumed",
        "--epochs",
        6,
        "--resume",
        mirrored / "epoch=4-step=10.ckpt",
        log=tmp_path / "resumed.log",
    )
    assert resumed == {s: run["losses"][s] for s in (11, 12)}
    # Resuming from the mirror's last.ckpt (step 12) continues as a 7-epoch run without a stop does.
    longer = train("train_lightning", tmp_path / "longer", "--epochs", 7, log=tmp_path / "longer.log")
    from_last = train(
        "train_lightning",
        tmp_path / "from-last",
        "--epochs",
        7,
        "--resume",
        mirrored / "last.ckpt",
        log=tmp_path / "from-last.log",
    )
    assert from_last == {s: longer[s] for s in (13, 14)}


def test_lightning_last_ckpt_link_is_recreated_on_the_mirror(tmp_path: Path) -> None:
    """save_last="link" for 7 epochs: last.ckpt is a symlink to the newest step; on the mirror it is a
    relative symlink to the mirrored step (never to the primary), and loads as step 14; resuming from
    the mirror's step 12 gives steps 13 and 14 exactly."""
    import torch

    run = mirrored_lightning_run(tmp_path / "link", "link", 7)
    assert run["failed"] == 0
    mirrored = run["mirror"] / "run"
    assert unit_names(mirrored, LIGHTNING_STEP) == ["epoch=5-step=12.ckpt", "epoch=6-step=14.ckpt"]
    assert (mirrored / "last.ckpt").readlink() == Path("epoch=6-step=14.ckpt")
    assert_no_leftovers(run["mirror"])
    shutil.rmtree(run["primary"])
    assert torch.load(mirrored / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 14
    resumed = train(
        "train_lightning",
        tmp_path / "resumed",
        "--epochs",
        7,
        "--resume",
        mirrored / "epoch=5-step=12.ckpt",
        log=tmp_path / "resumed.log",
    )
    assert resumed == {s: run["losses"][s] for s in (13, 14)}
