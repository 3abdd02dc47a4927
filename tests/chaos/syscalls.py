"""strace for the chaos suite: trace a real mirrord process, parse the trace, check the durability order.

The order every published name must follow (mirrord.store.atomic):

    openat(NAME.part, O_CREAT|O_EXCL) -> write* (NAME.part only) -> fsync(NAME.part)
    -> rename(NAME.part, NAME) -> fsync(directory of NAME)

The one file written under its final name is the manifest journal, opened only with O_APPEND: a
change counts once the write holding its record and an fsync of the journal completed (strace -T
gives each call's duration, so "completed before" is checked across threads, as group commit needs).

Copies are committed in groups (mirrord.service.commits): a worker renames its copy (a small one's
fsync and rename are left to the commit thread, which fsyncs every file of the group before renaming
any), and one fsync of each directory, by the commit thread, covers every rename of the group made in it. So for a
published checkpoint the directory fsync may come from another thread, after other work: what must
hold is that it started once the rename had returned, and that the journal record of the copy was
written only once that fsync had returned. The manifest's own files (snapshot, journal) still fsync
their directory at once, in the same thread, before anything else.

`strace -y` prints every file descriptor with the path it refers to at that moment, so "the fd of
the temp file" and "the directory fd" are checked by path, whichever fd number (or dup) was used.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mirrord.core.model import VERSIONS
from tests.chaos.harness import Zygote
from tests.support.wait import wait_for

TRACED = (
    "openat",
    "write",
    "pwrite64",
    "writev",
    "pwritev",
    "copy_file_range",
    "sendfile",
    "fsync",
    "fdatasync",
    "syncfs",
    "rename",
    "renameat",
    "renameat2",
    "unlink",
    "unlinkat",
    "mkdir",
    "mkdirat",
)
WRITES = {"write": 0, "pwrite64": 0, "writev": 0, "pwritev": 0, "copy_file_range": 2, "sendfile": 0}
LOCK_NAME = ".mirrord.lock"
MANIFEST_NAME = ".mirrord-manifest.json"
JOURNAL = re.compile(r"/\.mirrord-manifest\.journal\.\d+$")

_DURATION = re.compile(r" <(\d+\.\d+)>$")
_LINE = re.compile(r"^(?P<ts>\d+\.\d+) (?P<name>\w+)\((?P<args>.*)\)\s+= (?P<ret>-?\d+|\?)(?:<(?P<retpath>.*)>)?")
_FD = re.compile(r"^(?:-?\d+|AT_FDCWD)<(?P<path>.*)>$")


@dataclass(frozen=True)
class Call:
    ts: float
    tid: int
    seq: int
    name: str
    args: tuple[str, ...]
    ret: int | None
    ret_path: str | None
    text: str
    duration: float = 0.0

    @property
    def end(self) -> float:
        return self.ts + self.duration

    def fd_path(self, index: int) -> str | None:
        match = _FD.match(self.args[index]) if index < len(self.args) else None
        return _unescape(match["path"]) if match else None

    def string(self, index: int) -> str | None:
        arg = self.args[index] if index < len(self.args) else ""
        if arg.startswith('"'):
            return _unescape(arg[1 : arg.rindex('"')])
        return None

    def at_path(self, dir_index: int, name_index: int) -> str | None:
        """An *at() path argument resolved against its directory fd."""
        name = self.string(name_index)
        if name is None:
            return None
        if name.startswith("/"):
            return name
        base = self.fd_path(dir_index)
        return None if base is None else str(PurePosixPath(base) / name)


_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|[0-7]{1,3}|.)")
_SIMPLE = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"v": b"\v", b"f": b"\f", b"a": b"\a", b"b": b"\b"}


def _unescape(text: str) -> str:
    """Undo strace's C escapes; the trace is read as latin-1 so every byte survives, names are UTF-8."""

    def one(match: re.Match[bytes]) -> bytes:
        esc = match.group(1)
        if esc[:1] == b"x":
            return bytes([int(esc[1:], 16)])
        if esc[:1].isdigit():
            return bytes([int(esc, 8) & 0xFF])
        return _SIMPLE.get(esc, esc)

    return _ESCAPE.sub(one, text.encode("latin-1")).decode("utf-8", "surrogateescape")


def _split_args(text: str) -> tuple[str, ...]:
    """Split strace arguments at top-level commas (not inside "strings", <paths>, {structs} or [arrays])."""
    out, depth, start, i, quoted = [], 0, 0, 0, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "<{[":
            depth += 1
        elif c in ">}]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
        i += 1
    out.append(text[start:].strip())
    return tuple(a for a in out if a)


def parse(prefix: Path) -> list[Call]:
    """Every traced call of every thread (strace -ff -ttt -y -o PREFIX), in time order."""
    calls: list[Call] = []
    seq = 0
    for file in sorted(prefix.parent.glob(prefix.name + ".*")):
        tid = int(file.name.rsplit(".", 1)[1])
        for line in file.read_text(encoding="latin-1").splitlines():
            timed = _DURATION.search(line)
            match = _LINE.match(line[: timed.start()] if timed else line)
            if not match:
                continue
            ret = None if match["ret"] == "?" else int(match["ret"])
            retpath = _unescape(match["retpath"]) if match["retpath"] is not None else None
            calls.append(
                Call(
                    float(match["ts"]),
                    tid,
                    seq,
                    match["name"],
                    _split_args(match["args"]),
                    ret,
                    retpath,
                    line,
                    float(timed[1]) if timed else 0.0,
                )
            )
            seq += 1
    calls.sort(key=lambda c: (c.ts, c.seq))
    return calls


def write_target(call: Call) -> str | None:
    index = WRITES.get(call.name)
    return None if index is None else call.fd_path(index)


def rename_paths(call: Call) -> tuple[str, str] | None:
    if call.name == "rename":
        src, dst = call.string(0), call.string(1)
        return (src, dst) if src is not None and dst is not None else None
    if call.name in ("renameat", "renameat2"):
        src, dst = call.at_path(0, 1), call.at_path(2, 3)
        return (src, dst) if src is not None and dst is not None else None
    return None


def unlink_path(call: Call) -> str | None:
    if call.name == "unlink":
        return call.string(0)
    if call.name == "unlinkat":
        return call.at_path(0, 1)
    return None


def mkdir_path(call: Call) -> str | None:
    if call.name == "mkdir":
        return call.string(0)
    if call.name == "mkdirat":
        return call.at_path(0, 1)
    return None


def is_journal(path: str | None) -> bool:
    return path is not None and JOURNAL.search(path) is not None


def journal_changes(call: Call) -> tuple[set[str], set[str]]:
    """(paths recorded, paths removed) by the whole records in a write to the journal."""
    data = call.string(1)
    puts: set[str] = set()
    removes: set[str] = set()
    if data is None:
        return puts, removes
    for line in data.encode("utf-8", "surrogateescape").split(b"\n"):
        payload = line[9:]
        if len(line) < 10 or zlib.crc32(payload) != int(line[:8], 16):
            continue
        doc = json.loads(payload)
        puts.update(doc.get("put", {}))
        removes.update(doc.get("del", ()))
    return puts, removes


Record = tuple[float, float, set[str], set[str]]


def durable_journal_records(calls: list[Call]) -> list[Record]:
    """(when the write started, when it was durable, paths recorded, paths removed) for every journal
    write followed, in its thread, by a successful fsync of that journal (durable: when it returned)."""
    out = []
    for i, call in enumerate(calls):
        target = write_target(call)
        if not is_journal(target) or (call.ret or 0) <= 0:
            continue
        sync = next(
            (
                c
                for c in calls[i + 1 :]
                if c.tid == call.tid and c.name in ("fsync", "fdatasync") and c.fd_path(0) == target
            ),
            None,
        )
        if sync is not None and sync.ret == 0 and sync.ts >= call.end:
            out.append((call.ts, sync.end, *journal_changes(call)))
    return out


def _under(path: str | None, root: str) -> bool:
    return path is not None and (path == root or path.startswith(root.rstrip("/") + "/"))


def order_violations(calls: list[Call], mirror: Path, recorded: Iterable[str] = ()) -> tuple[list[str], dict[str, int]]:
    """Check the durability order of everything published under `mirror`; `recorded` is what the
    manifest held when the traced process started (a deletion of those needs a durable removal record).

    Returns (violations, counts) where counts has the number of published files, manifest writes,
    directories created and files unlinked that were checked.
    """
    root = str(mirror)
    violations: list[str] = []
    counts = {
        "published": 0,
        "manifest_writes": 0,
        "journal_appends": 0,
        "dirs_created": 0,
        "unlinked": 0,
        "committed_logged": 0,
    }
    by_thread: dict[int, list[Call]] = {}
    for call in calls:
        by_thread.setdefault(call.tid, []).append(call)

    for call in calls:
        target = write_target(call)
        if _under(target, root) and not (
            target.endswith(".part") or target.endswith("/" + LOCK_NAME) or is_journal(target)
        ):
            violations.append(f"write to a final name: {call.text}")
        if (
            call.name == "openat"
            and is_journal(call.ret_path)
            and ("O_WRONLY" in call.text or "O_RDWR" in call.text)
            and "O_APPEND" not in call.text
        ):
            violations.append(f"journal opened for writing without O_APPEND: {call.text}")
        if is_journal(target) and (call.ret or 0) > 0:
            counts["journal_appends"] += 1
    records = durable_journal_records(calls)
    ever_recorded = set(recorded)
    for call in calls:
        if is_journal(write_target(call)):
            ever_recorded |= journal_changes(call)[0]

    syncs = _dir_fsyncs(calls)
    for thread in by_thread.values():
        for i, call in enumerate(thread):
            if call.ret is None or call.ret < 0:
                continue
            renamed = rename_paths(call)
            if renamed and _under(renamed[1], root):
                violations += _check_publish(thread, i, renamed, calls, syncs)
                manifest = renamed[1].endswith(MANIFEST_NAME) or is_journal(renamed[1])
                counts["manifest_writes" if manifest else "published"] += 1
            made = mkdir_path(call)
            if _under(made, root):
                counts["dirs_created"] += 1
                violations += _check_next_fsync(thread, i, str(PurePosixPath(made).parent), "mkdir", call)
            gone = unlink_path(call)
            if _under(gone, root) and not gone.endswith(".part"):
                counts["unlinked"] += 1
                violations += _check_unlink(thread, i, gone, root, records, ever_recorded)
            if call.name == "write" and "copy.committed" in call.text:
                counts["committed_logged"] += 1
                violations += _check_committed_log(thread[i], root, records, calls, syncs)
    violations += recorded_before_dir_fsync(calls, records, root, syncs)
    return violations, counts


def _dir_fsyncs(calls: list[Call]) -> dict[str, list[Call]]:
    """Every successful fsync of a directory (any thread), by the directory's path, in time order. A
    directory is what a rename, mkdir or unlink was made in (the fsync of a .part or a journal is not).
    A successful syncfs (a group's, mirrord.store.atomic._make_durable) counts for every directory: the
    traced process only publishes on the mirror, one filesystem in these tests."""
    parents: set[str] = set()
    for call in calls:
        for path in (*(rename_paths(call) or ()), mkdir_path(call), unlink_path(call)):
            if path is not None:
                parents.add(str(PurePosixPath(path).parent))
    out: dict[str, list[Call]] = {}
    for call in calls:
        if call.name in ("fsync", "fdatasync") and call.ret == 0:
            path = call.fd_path(0)
            if path in parents:
                out.setdefault(path, []).append(call)
        elif call.name == "syncfs" and call.ret == 0:
            for parent in parents:
                out.setdefault(parent, []).append(call)
    return out


def _promoted_version(src: str, dst: str) -> bool:
    """`src` is the pending version of `dst` (mirrord.core.model.version_key), in the same mirror."""
    root, _, rel = src.partition(f"/{VERSIONS}/")
    return bool(rel) and dst == f"{root}/{rel}"


def _dir_fsync_after(syncs: dict[str, list[Call]], directory: str, rename: Call) -> Call | None:
    """The first successful fsync of `directory`, by any thread, that started after `rename` returned."""
    return next((s for s in syncs.get(directory, ()) if s.ts >= rename.end), None)


def _last_rename_onto(calls: list[Call], final: str, before: float) -> Call | None:
    """The last successful rename onto `final` that returned before `before` (any thread)."""
    found = None
    for call in calls:
        if call.ts > before:
            break
        renamed = rename_paths(call) if call.ret == 0 else None
        if renamed and renamed[1] == final and call.end <= before:
            found = call
    return found


def recorded_before_dir_fsync(
    calls: list[Call], records: list[Record], root: str, syncs: dict[str, list[Call]] | None = None
) -> list[str]:
    """A copy recorded in the journal before the fsync of its directory (after its rename) returned:
    after a power cut the manifest could vouch for a name the directory never kept. Every file a durable
    record puts, and that was renamed into place in this trace, is checked."""
    syncs = _dir_fsyncs(calls) if syncs is None else syncs
    out = []
    for start, _durable, puts, _removes in records:
        for rel in sorted(puts):
            final = str(PurePosixPath(root) / rel)
            rename = _last_rename_onto(calls, final, start)
            if rename is None:
                continue
            sync = _dir_fsync_after(syncs, str(PurePosixPath(final).parent), rename)
            if sync is None or sync.end > start:
                out.append(
                    f"{final}: recorded in the journal before the fsync of its directory after the rename "
                    f"returned: {rename.text}"
                )
    return out


def _check_publish(
    thread: list[Call], i: int, renamed: tuple[str, str], calls: list[Call], dir_syncs: dict[str, list[Call]]
) -> list[str]:
    src, dst = renamed
    rename = thread[i]
    out: list[str] = []
    if _promoted_version(src, dst):
        # A version kept beside a verified copy, promoted (docs/protocol.md, "A name copied again"): it was published
        # under its hidden name by the whole protocol (that rename is checked on its own); the promotion is
        # one atomic rename of that durable file, then both folders fsynced.
        if _last_rename_onto(calls, src, rename.ts) is None:
            out.append(f"{dst} promoted from {src}, which was not published in this trace: {rename.text}")
        for folder in {str(PurePosixPath(p).parent) for p in (src, dst)}:
            if _dir_fsync_after(dir_syncs, folder, rename) is None:
                out.append(f"{dst}: promoted from {src} without an fsync of {folder} after: {rename.text}")
        return out
    if src != dst + ".part":
        return [f"{dst} published from {src}, not from its temp name: {rename.text}"]
    manifest = dst.endswith(MANIFEST_NAME) or is_journal(dst)
    # The manifest's files are written, fsynced and renamed by one thread. A copy's temp file is created
    # and written by its worker, but a small one's fsync and rename may be left to its group's commit
    # thread (atomic.DirSyncs.publish_later): for a copy the order is checked across threads, by time.
    before = thread[:i] if manifest else [c for c in calls if (c.ts, c.seq) < (rename.ts, rename.seq)]
    created = [
        c
        for c in before
        if c.name == "openat" and c.ret_path == src and "O_CREAT" in c.text and "O_EXCL" in c.text and (c.ret or 0) >= 0
    ]
    if not created:
        return [f"{dst}: the temp file was not created exclusively before its rename"]
    start = created[-1]
    writes = [
        c
        for c in calls
        if start.ts <= c.ts <= rename.ts and c.seq != rename.seq and write_target(c) == src and (c.ret or 0) > 0
    ]
    syncs = [
        c
        for c in before
        if (c.ts, c.seq) > (start.ts, start.seq)
        and ((c.name in ("fsync", "fdatasync") and c.fd_path(0) == src) or c.name == "syncfs")
    ]
    if not syncs:
        out.append(f"{dst}: renamed without an fsync of its temp file")
    else:
        sync = syncs[-1]
        if sync.ret != 0:
            out.append(f"{dst}: renamed although the fsync of its temp file failed")
        if sync.end > rename.ts:
            out.append(f"{dst}: renamed before the fsync of its temp file returned: {rename.text}")
        late = [w for w in writes if (w.ts, w.seq) > (sync.ts, sync.seq)]
        if late:
            out.append(f"{dst}: data written after the fsync: {late[0].text}")
    if not writes and not manifest:
        out.append(f"{dst}: published with no data written to its temp file")
    directory = str(PurePosixPath(dst).parent)
    if manifest:  # the manifest's own files: the directory fsync at once, in this thread
        out += _check_next_fsync(thread, i, directory, "rename", rename)
    elif _dir_fsync_after(dir_syncs, directory, rename) is None:  # a copy: by its group's commit, any thread
        out.append(f"rename never followed by an fsync of {directory}: {rename.text}")
    return out


def _check_next_fsync(thread: list[Call], i: int, directory: str, what: str, call: Call) -> list[str]:
    """The first fsync after call i in this thread is of `directory`, with no write or rename before it."""
    for later in thread[i + 1 :]:
        if later.name in ("fsync", "fdatasync"):
            if later.fd_path(0) != directory:
                return [f"{what} not followed by an fsync of {directory} (fsync of {later.fd_path(0)}): {call.text}"]
            if later.ret != 0:
                return [f"{what}: fsync of {directory} failed and was ignored: {call.text}"]
            return []
        if write_target(later) is not None or rename_paths(later) or unlink_path(later):
            return [f"{what} followed by other I/O before the directory fsync: {later.text}"]
    return [f"{what} never followed by an fsync of {directory}: {call.text}"]


def _rel(path: str, root: str) -> str:
    return str(PurePosixPath(path).relative_to(root))


def _check_unlink(
    thread: list[Call], i: int, path: str, root: str, records: list[Record], recorded: set[str]
) -> list[str]:
    """A mirrored file is deleted only after a durable journal record of its removal; the unlink is fsynced.

    (A file that was never recorded - a prune of an unrecorded leftover - needs no record.)"""
    out = _check_next_fsync(thread, i, str(PurePosixPath(path).parent), "unlink", thread[i])
    rel = _rel(path, root)
    if rel in recorded and not any(rel in removes and durable <= thread[i].ts for _, durable, _, removes in records):
        out.append(f"{path}: unlinked before a durable journal record of its removal")
    return out


def _check_committed_log(
    log: Call, root: str, records: list[Record], calls: list[Call], syncs: dict[str, list[Call]]
) -> list[str]:
    """copy.committed is logged only after the file is durable (renamed, then its directory fsynced,
    by any thread: group commit), and after that, a journal record of it was written and fsynced."""
    match = re.search(r'\\"path\\": \\"(.*?)\\"', log.text)
    if not match:
        return []
    final = str(PurePosixPath(root) / _unescape(match[1]))
    rel = _rel(final, root)
    rename = _last_rename_onto(calls, final, log.ts)
    if rename is None:
        return [f"copy.committed logged for {final}, which was never renamed into place"]
    published = _dir_fsync_after(syncs, str(PurePosixPath(final).parent), rename)
    if published is None or published.end > log.ts:
        return [f"copy.committed logged for {final} before the fsync of its directory"]
    if not any(published.end <= start and durable <= log.ts and rel in puts for start, durable, puts, _ in records):
        return [f"copy.committed logged for {final} before a durable journal record of it"]
    return []


def syscall_counts(calls: list[Call]) -> dict[str, int]:
    """Per syscall, the largest number of invocations by any one thread (strace counts per tracee)."""
    per: dict[tuple[str, int], int] = {}
    for call in calls:
        per[(call.name, call.tid)] = per.get((call.name, call.tid), 0) + 1
    counts: dict[str, int] = {}
    for (name, _tid), n in per.items():
        counts[name] = max(counts.get(name, 0), n)
    return counts


def _proc_field(pid: int, key: str) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return line.split(":", 1)[1].strip()
    except FileNotFoundError:
        return ""
    return ""


def run_traced(
    zygote: Zygote,
    argv: list[str],
    log: Path,
    strace_args: list[str],
    *,
    patch: str | None = None,
    timeout: float = 120,
) -> int | None:
    """Fork a mirrord process stopped, attach strace to it, let it run; returns its exit status.

    Attaching to a forked, already-imported process keeps interpreter start-up out of the trace, so
    strace's per-thread invocation numbers (`when=N`) count only the work under test.
    """
    pid = zygote.spawn(argv, log, stop=True, patch=patch)
    wait_for(lambda: _proc_field(pid, "State").startswith("T"), 90, "the child to stop itself", interval=0.02)
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", *strace_args, "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_for(
            lambda: _proc_field(pid, "TracerPid") not in ("", "0") or tracer.poll() is not None,
            10,
            "strace to attach",
            interval=0.02,
        )
        if tracer.poll() is not None:
            raise AssertionError(f"strace failed: {tracer.communicate()[1].decode(errors='replace')}")
        os.kill(pid, signal.SIGCONT)
        status = zygote.wait(pid, timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            zygote.wait(pid, 30)
        tracer.wait(timeout=60)
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()
        if tracer.stderr is not None:
            tracer.stderr.close()
    return status


def trace_args(prefix: Path, syscalls: tuple[str, ...] = TRACED, string_limit: int = 65536) -> list[str]:
    """-ff: one file per thread; -ttt: ordering across threads; -T: durations (when a call returned);
    -y: fds as paths; -s: whole journal records; '?': a syscall this architecture lacks (rename,
    unlink, mkdir on arm64) is ignored rather than an error."""
    names = ",".join("?" + s for s in syscalls)
    return ["-ff", "-ttt", "-T", "-y", "-s", str(string_limit), "-o", str(prefix), "-e", "trace=" + names]
