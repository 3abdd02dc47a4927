"""Issue 42's property, against the pure planner in follow mode: over random sequences of trainer saves (each
followed by its own rotation to K), wipes, `mirrord restore`s, restarts from scratch and manual deletions, with
the planner's sightings carried from pass to pass as a daemon carries them, the mirror never deletes a
checkpoint the trainer still keeps, never deletes an abandoned branch's tip, and keeps, per branch, nothing
beyond what the trainer keeps and the K newest mirrored (what a wipe or an rm took stays until K newer came)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st

from mirrord.config import PruneConfig
from mirrord.core.model import FileState, ManifestEntry, Snapshot
from mirrord.core.retention import PruneRequest, Sightings, plan_prune
from mirrord.layouts import layout_for

NOW = 1_700_000_000.0
NS = 1_000_000_000
LAYOUT = layout_for("lightning")
EXAMPLES = 400


def rel(step: int) -> str:
    return f"run/epoch=0-step={step}.ckpt"


@dataclass
class World:
    """The primary, the mirror and its manifest, the trainer's own bookkeeping, and which branch (a restart
    from scratch starts one) wrote each mirror copy."""

    keep: int
    record: bool = False  # the trainer's rotation rule is on record (HF's save_total_limit in training_args.bin)
    primary: dict[str, FileState] = field(default_factory=dict)
    mirror: dict[str, FileState] = field(default_factory=dict)
    manifest: dict[str, ManifestEntry] = field(default_factory=dict)
    bytes_of: dict[str, int] = field(default_factory=dict)  # primary path -> which bytes (a save's number)
    branch_of: dict[str, int] = field(default_factory=dict)  # mirror path -> the branch that wrote it
    reached: dict[int, int] = field(default_factory=dict)  # branch -> the highest step mirrord copied of it
    trainer: list[int] = field(default_factory=list)  # the steps the trainer keeps, oldest first
    branch: int = 0
    step: int = 0
    clock: int = int((NOW - 86_400) * NS)
    inode: int = 1
    seq: int = 0
    sightings: Sightings = field(default_factory=lambda: Sightings(since=0))

    def tick(self) -> int:
        self.clock += NS
        self.inode += 1
        return self.clock

    def save(self) -> None:
        """The trainer saves the next step, then rotates to its K newest (as HF's save_total_limit does)."""
        self.step += 10
        mtime = self.tick()
        self.primary[rel(self.step)] = FileState(rel(self.step), 100, mtime, ino=self.inode, ctime_ns=mtime)
        self.bytes_of[rel(self.step)] = mtime
        self.trainer.append(self.step)
        while len(self.trainer) > self.keep:
            self.primary.pop(rel(self.trainer.pop(0)), None)

    def restore(self) -> None:
        """The drill: the run folder lost, `mirrord restore` puts the newest mirrored checkpoint back with its
        recorded bytes and mtime (a new inode); the trainer resumes from it with the bookkeeping it saved there."""
        self.primary.clear()
        if not self.mirror:
            return
        newest = max(self.mirror, key=lambda r: (self.branch_of[r], self.manifest[r].step or 0))
        entry = self.manifest[newest]
        mtime = self.tick()
        self.primary[newest] = FileState(newest, entry.size, entry.source_mtime_ns, ino=self.inode, ctime_ns=mtime)
        self.bytes_of[newest] = int(entry.digest)
        self.trainer = [entry.step or 0]  # (the saves after it replaced; a trainer rotates what its disk holds)
        self.step = entry.step or 0

    def restart(self) -> None:
        """A job restarted from scratch in the same (wiped) folder: a new branch, its own bookkeeping."""
        self.primary.clear()
        self.trainer, self.step, self.branch = [], 0, self.branch + 1

    def sync(self) -> None:
        """mirrord copies what is new or changed (the same bytes copied again keep their record's seq)."""
        for path, state in self.primary.items():
            entry = self.manifest.get(path)
            if entry is not None and (entry.source_ino, entry.source_mtime_ns) == (state.ino, state.mtime_ns):
                continue
            same = entry is not None and int(entry.digest) == self.bytes_of[path]
            if not same:
                self.seq += 1
                self.branch_of[path] = self.branch
            self.manifest[path] = ManifestEntry(
                path, state.size, "blake3", str(self.bytes_of[path]), state.mtime_ns, int(path.split("=")[-1][:-5]),
                NOW, validation="ok", source_ino=state.ino, source_ctime_ns=state.ctime_ns,
                seq=entry.seq if same and entry is not None else self.seq,
            )  # fmt: skip
            self.mirror[path] = FileState(path, state.size, state.mtime_ns, ino=self.tick())
            self.reached[self.branch] = max(self.reached.get(self.branch, 0), self.manifest[path].step or 0)

    def prune(self) -> set[int]:
        """One daemon pass: copy, plan, delete; the steps deleted."""
        self.sync()
        request = PruneRequest(
            PruneConfig(min_age_seconds=0),
            LAYOUT.step_regex,
            NOW,
            layout=LAYOUT,
            follow=True,
            sightings=self.sightings,
            keeps={"run": self.keep} if self.record else {},
        )
        plan = plan_prune(Snapshot(dict(self.primary)), Snapshot(dict(self.mirror)), dict(self.manifest), request)
        assert plan.sightings is not None and not plan.refused
        self.sightings = plan.sightings
        for d in plan.deletions:
            del self.mirror[d.rel], self.manifest[d.rel]
        return {d.step for d in plan.deletions if d.step is not None}

    def tips(self) -> set[int]:
        """The newest mirrored step of every abandoned branch, while it is above the newest step of every later
        branch (a later run that passed it no longer reads as a rollback: it saves over that name)."""
        tops: dict[int, int] = {}
        for path, branch in self.branch_of.items():
            if path in self.mirror and branch < self.branch:
                tops[branch] = max(tops.get(branch, 0), self.manifest[path].step or 0)
        later = {b: max([self.step] + [s for a, s in self.reached.items() if a > b]) for b in tops}
        return {tip for b, tip in tops.items() if tip > later[b]}


ACTIONS = st.sampled_from(["save"] * 4 + ["prune"] * 3 + ["rm", "wipe", "restore", "restart"])


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    keep=st.integers(1, 4),
    record=st.booleans(),
    actions=st.lists(st.tuples(ACTIONS, st.integers(0, 99)), min_size=8, max_size=60),
)
def test_follow_deletes_only_what_the_trainer_rotated_out(
    keep: int, record: bool, actions: list[tuple[str, int]]
) -> None:
    """With the trainer's rule on record, or else with what the daemon saw; there, the daemon has seen the trainer
    at its limit (K checkpoints at once): before that, K is a lower bound and an `rm` is told from a rotation
    only by the newer saves that follow it (docs/retention.md, known limits)."""
    world = World(keep, record, sightings=Sightings(most={} if record else {"run": keep}, since=0))
    for action, pick in actions:
        if action == "rm":
            if world.primary:
                del world.primary[sorted(world.primary)[pick % len(world.primary)]]
            continue
        if action != "prune":
            world.primary.clear() if action == "wipe" else getattr(world, action)()
            continue
        tips, kept = world.tips(), {s for s in world.trainer if rel(s) in world.mirror}
        deleted = world.prune()
        event("a pass deleted" if deleted else "a pass deleted nothing")
        assert not deleted & kept, f"deleted {deleted & kept}, which the trainer keeps"
        assert not deleted & tips, f"deleted the tips {deleted & tips}"
        for branch in range(world.branch + 1):
            steps = sorted(
                world.manifest[p].step or 0 for p, b in world.branch_of.items() if b == branch and p in world.mirror
            )
            extra = set(steps[:-keep]) - (set(world.trainer) if branch == world.branch else set())
            held = {s for s in extra if rel(s) in world.primary}  # (on the primary: the trainer's own, followed)
            assert extra <= held, f"branch {branch}: {sorted(extra - held)} kept beyond K={keep} newest: {steps}"
