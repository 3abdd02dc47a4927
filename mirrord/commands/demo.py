"""`mirrord demo`: a simulated trainer, a real daemon and a local mirror, narrated, in about a minute.

    trainer (this process) --step_N.pt.part -> rename--> DIR/primary/demo-run/
    `mirrord run` (a child process, its own config)  --> DIR/mirror/demo-run/ + manifest, prunes both sides
    this process follows the daemon's JSON log and tells a person what happened

The daemon is the same `mirrord run` an operator starts, so what the demo shows is what production
does. The trainer writes real torch.save checkpoints when torch is installed (the daemon itself never
needs torch), otherwise zip archives laid out like them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from mirrord.commands.banner import mirrord_command
from mirrord.commands.config_toml import render as render_toml
from mirrord.commands.status import collect, http_get, render
from mirrord.config import load_config
from mirrord.errors import ManifestError
from mirrord.obs.sizes import human_bytes
from mirrord.store.atomic import TEMP_SUFFIX, atomic_output
from mirrord.store.manifest import Manifest

MARKER = ".mirrord-demo"
RUN = "demo-run"
READY_TIMEOUT = 30.0
SETTLE_TIMEOUT = 60.0  # after the last commit: copies finish and retention catches up
STOP_TIMEOUT = 15.0


class DemoError(Exception):
    """The demo cannot start as asked (a directory it must not touch, a daemon that will not start)."""


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs: where, how many steps, how often, and how many to keep (defaults: the flags of
    `mirrord demo`)."""

    directory: Path
    steps: int
    interval: float
    keep_last: int
    use_torch: bool | None  # None: torch if importable


# --- the directory ---------------------------------------------------------------------------------------
def prepare(directory: Path) -> tuple[Path, Path]:
    """DIR/primary and DIR/mirror, empty. Only a directory a previous demo made (marker file) is wiped."""
    if directory.exists() and not directory.is_dir():
        raise DemoError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MARKER).is_file():
        raise DemoError(f"{directory} is not empty and was not made by `mirrord demo`; choose another with --dir")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("made by `mirrord demo`; the demo may wipe this directory\n")
    primary, mirror = directory / "primary", directory / "mirror"
    for root in (primary, mirror):
        if root.is_symlink() or root.is_file():
            root.unlink()
        elif root.exists():
            shutil.rmtree(root)
        root.mkdir()
    return primary, mirror


def free_port() -> int:
    """A port nothing listens on right now, for the demo daemon's endpoints."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(directory: Path, port: int, keep_last: int) -> Path:
    """A config a person can reuse: `mirrord run --config DIR/mirrord.toml` continues the demo."""
    settings = {
        "primary": str((directory / "primary").resolve()),
        "mirror": str((directory / "mirror").resolve()),
        "patterns": ["*.pt"],
        "copy": {"settle_seconds": 0.5, "retry_backoff_seconds": 0.2, "free_space_reserve_bytes": 0},
        "prune": {"enabled": True, "keep_last": keep_last, "min_age_seconds": 1.0, "primary": True},
        "watch": {"rescan_interval_seconds": 1.0},
        "daemon": {"heartbeat_seconds": 1.0, "shutdown_grace_seconds": 5.0},
        "metrics": {"address": f"127.0.0.1:{port}"},
        "log": {"format": "json", "level": "info"},
    }
    why = {
        "prune.min_age_seconds": "demo (production: 300); a file this young is never deleted: still written?",
        "prune.primary": "demo: old steps go on the primary too, once the mirror holds newer verified ones",
    }
    path = directory / "mirrord.toml"
    path.write_text(
        "# Written by `mirrord demo`, with short timings so that everything happens within a minute;\n"
        "# config/mirrord.toml documents every key and its production default.\n"
        + render_toml(settings, lambda key: why.get(key, ""))
    )
    return path


# --- the trainer ---------------------------------------------------------------------------------------
Save = Callable[[Path, int], None]  # writes step N at a path the way a careful trainer does (NAME.part, rename)


def trainer(use_torch: bool | None, out: TextIO) -> tuple[Save, str]:
    """How the demo's trainer saves, and what to call it: torch.save through mirrord.torch.atomic_save when
    torch is there (imported and the model built now, before the clock starts: that takes seconds), else zips."""
    has_torch = importlib.util.find_spec("torch") is not None
    if not (has_torch if use_torch is None else use_torch):
        return write_zip_checkpoint, "zip" if has_torch else "zip, torch not installed"
    print("preparing the trainer (importing torch) ...", file=out, flush=True)
    import torch

    from mirrord.torch import atomic_save

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def save(path: Path, step: int) -> None:
        for param in model.parameters():  # one "training step": gives Adam its state
            param.grad = torch.randn_like(param)
        optimizer.step()
        atomic_save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)

    return save, "torch.save"


def write_zip_checkpoint(path: Path, step: int, tensors: int = 6, tensor_bytes: int = 256 * 1024) -> None:
    """A zip laid out like torch.save's (one folder, data.pkl, data/<n> records), published atomically.

    Not loadable by torch.load, but `mirrord verify --deep` checks its CRCs like a real one.
    """
    folder = path.stem
    shapes = {f"layer{i}.weight": [tensor_bytes // 4] for i in range(tensors)}
    with atomic_output(path) as out, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{folder}/data.pkl", pickle.dumps({"step": step, "shapes": shapes}))
        zf.writestr(f"{folder}/byteorder", "little")
        for i in range(tensors):
            zf.writestr(f"{folder}/data/{i}", os.urandom(tensor_bytes))
        zf.writestr(f"{folder}/version", "3\n")


# --- following the daemon ------------------------------------------------------------------------------
class LogFollower:
    """The daemon's JSON log events, as they are appended (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_events(self) -> Iterator[dict[str, Any]]:
        """The daemon's log events written since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a traceback or other non-JSON output: it stays in the log file
            if isinstance(event, dict):
                yield event


@dataclass
class Narrator:
    """Turns daemon events and trainer commits into one readable line each."""

    out: TextIO
    keep_last: int
    started: float = field(default_factory=time.monotonic)
    mirrored: int = 0
    pruned: Counter[str] = field(default_factory=Counter)  # volume -> files deleted there
    _told: set[tuple[str, str]] = field(default_factory=set)

    def say(self, who: str, text: str) -> None:
        """One narrated line, stamped with the seconds since the demo began."""
        print(f"[{time.monotonic() - self.started:6.1f}s] {who:8} {text}", file=self.out, flush=True)

    def event(self, e: dict[str, Any]) -> None:
        """Narrate one daemon log event (the ones a person watching cares about)."""
        name, path, reason = e.get("event", ""), e.get("path", ""), e.get("reason", "")
        say = partial(self.say, "mirrord")
        if name == "daemon.ready":
            say("ready: first reconcile done, watching for checkpoints")
        elif name == "watch.mode":
            say(f"watching with {e.get('mode')} events ({e.get('why', '')})")
        elif name == "copy.committed":
            self.mirrored += 1
            say(
                f"mirrored  {path}  {human_bytes(e.get('size', 0))} in {e.get('seconds', 0):.2f}s, "
                "verified and recorded"
            )
        elif name == "prune.deleted":
            volume = e.get("volume", "mirror")
            self.pruned[volume] += 1
            say(f"pruned    {path} on the {volume} (below the newest {self.keep_last} verified steps)")
        elif name == "prune.skipped" and (path, reason) not in self._told:
            self._told.add((path, reason))
            why = {"recent_mtime": "younger than prune.min_age_seconds", "newest": "the newest verified step"}.get(
                reason, reason
            )
            say(f"kept      {path} on the {e.get('volume')} for now: {why}")
        elif name == "copy.failed":
            retry = "; will retry" if e.get("will_retry") else ""
            say(f"copy of {path} failed ({reason}): {e.get('cause')}{retry}")
        elif e.get("level") == "error":
            detail = e.get("cause") or e.get("detail") or e.get("problems") or ""
            say(f"ERROR {name} {path} {detail}".rstrip())


# --- the demo ------------------------------------------------------------------------------------------
def _steps_on(root: Path) -> list[int]:
    names = sorted(p.name for p in (root / RUN).glob("step_*.pt")) if (root / RUN).is_dir() else []
    return [int(n[len("step_") : -len(".pt")]) for n in names]


def settled(primary: Path, mirror: Path, expected: list[int]) -> bool:
    """Both sides hold exactly the expected steps, the manifest vouches for them, no copy is half-done."""
    try:
        recorded = sorted(e.step for e in Manifest.load(mirror).entries.values() if e.step is not None)
    except ManifestError:  # unreadable now: asked again on the next poll
        return False
    no_parts = not any(p.name.endswith(TEMP_SUFFIX) for p in (mirror / RUN).glob("*"))
    return _steps_on(primary) == _steps_on(mirror) == recorded == expected and no_parts


def _child_env() -> dict[str, str]:
    """The demo's config only: the caller's MIRRORD_* variables must not redirect the demo daemon."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MIRRORD_") and k != "NOTIFY_SOCKET"}


def _wait_ready(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the daemon exited ({proc.returncode}) before it was ready; see {log_path}")
        if http_get(f"http://127.0.0.1:{port}/readyz", 0.5)[0] == 200:
            return
        time.sleep(0.1)
    raise DemoError(f"the daemon was not ready after {READY_TIMEOUT:.0f} s; see {log_path}")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> int:
    """Run the whole demo; 0 when both sides end with exactly the newest keep_last steps, verified.

    1 when they do not (or the daemon died); 130 on Ctrl-C. The daemon is stopped in every case.
    """
    say = partial(print, file=out, flush=True)
    directory = options.directory
    primary, mirror = prepare(directory)
    port = free_port()
    config_path = write_config(directory, port, options.keep_last)
    config = load_config(config_path, environ={})
    log_path = directory / "mirrord.log"
    expected = list(range(max(1, options.steps - options.keep_last + 1), options.steps + 1))

    say(
        f"mirrord demo: a simulated trainer commits {options.steps} checkpoint(s), one every "
        f"{options.interval:g} s;\nmirrord mirrors each one as it is committed and keeps the newest "
        f"{options.keep_last} on both sides."
    )
    say(
        f"  primary  {primary}   (the trainer writes here)\n"
        f"  mirror   {mirror}   (mirrord's trustworthy copy)\n"
        f"  config   {config_path}\n"
        f"  log      {log_path}   (the daemon's JSON events)\n"
        f"  metrics  http://127.0.0.1:{port}/metrics  /healthz  /readyz\n"
    )

    save, kind = trainer(options.use_torch, out)
    narrator = Narrator(out, options.keep_last)
    follower = LogFollower(log_path)
    # Ctrl-C and SIGTERM end the demo even when inherited as ignored (a background job of a script starts
    # with SIGINT ignored, and Python then installs no handler): as `mirrord run` does.
    previous_handlers = {signum: signal.signal(signum, signal.default_int_handler) for signum in STOP_SIGNALS}
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mirrord", "run", "--config", str(config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_child_env(),
        )
    failure: str | None = "interrupted"
    try:
        _wait_ready(proc, port, log_path)
        failure = _drive(options, (save, kind), narrator, follower, proc, primary, mirror, expected)
        for event in follower.new_events():
            narrator.event(event)
        elapsed = time.monotonic() - narrator.started
        if failure is None:
            say(
                f"\nDone in {elapsed:.0f} s: {options.steps} checkpoint(s) committed, {narrator.mirrored} "
                f"mirrored, {narrator.pruned['mirror']} pruned on the mirror and "
                f"{narrator.pruned['primary']} on the primary.\nBoth sides hold steps "
                f"{', '.join(map(str, expected))} of {RUN}.\n"
            )
        else:
            say(f"\nThe demo failed: {failure}; see {log_path}.\n")
        say(f"$ {mirrord_command()} status --config {config_path}")
        say(render(collect(config)))
    except KeyboardInterrupt:
        say("\ninterrupted: stopping the demo daemon")
    finally:
        for signum in STOP_SIGNALS:  # while the daemon stops, another Ctrl-C kills it rather than orphan it
            signal.signal(signum, lambda _signum, _frame: proc.kill())
        code = _stop(proc)
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
    command = mirrord_command()
    say(f"\nThe demo daemon stopped (exit {code}). Try next:")
    for verb in ("status", "verify --deep", "latest"):
        say(f"  {command} {verb} --config {config_path}")
    say(f"  {command} run --config {config_path}   # keep mirroring; drop *.pt files into {primary}")
    if command != "mirrord":
        say(f"(`mirrord` is not on PATH here: {command} is the one this demo used; or activate its venv)")
    if failure == "interrupted":
        return 130
    return 0 if failure is None and code == 0 else 1


def _drive(
    options: DemoOptions,
    trainer: tuple[Save, str],
    narrator: Narrator,
    follower: LogFollower,
    proc: subprocess.Popen[bytes],
    primary: Path,
    mirror: Path,
    expected: list[int],
) -> str | None:
    """Commit a step every interval while narrating, then wait for the mirror to settle; None or what failed."""
    step = 0
    next_commit = time.monotonic()
    deadline = float("inf")
    while True:
        for event in follower.new_events():
            narrator.event(event)
        if proc.poll() is not None:
            return f"the daemon exited unexpectedly (exit {proc.returncode})"
        now = time.monotonic()
        if step < options.steps and now >= next_commit:
            step += 1
            path = primary / RUN / f"step_{step:04d}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            trainer[0](path, step)
            narrator.say(
                "trainer",
                f"committed {RUN}/{path.name}  {human_bytes(path.stat().st_size)} ({trainer[1]}, .part -> rename)",
            )
            next_commit += options.interval
            if step == options.steps:
                deadline = time.monotonic() + SETTLE_TIMEOUT
        elif step == options.steps and settled(primary, mirror, expected):
            return None
        elif now > deadline:
            return (
                f"the mirror did not reach the expected state (steps {expected} on both sides) "
                f"within {SETTLE_TIMEOUT:.0f} s of the last commit"
            )
        time.sleep(0.05)
