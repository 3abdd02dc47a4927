"""`mirrord init`: a commented config file (and a systemd unit) to start from, from the copies in the package.

The example config, the unit and the alert rules ship inside the wheel (mirrord/data/), so an installed
mirrord can write them without a source checkout. Files are published atomically and never replace an
existing file unless asked to (`force`): the link that publishes them fails if the name exists.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path

from mirrord.store.atomic import write_bytes_atomic

EXAMPLE_CONFIG, SYSTEMD_UNIT, ALERT_RULES = "mirrord.toml", "mirrord.service", "alerts.yml"


def packaged(name: str) -> str:
    """The text of a file shipped in mirrord/data/ (example config, unit, alert rules)."""
    return (resources.files("mirrord") / "data" / name).read_text(encoding="utf-8")


class InitError(Exception):
    """A file would be overwritten, or a template no longer has the line init fills in."""


def _set_line(text: str, pattern: str, line: str, what: str) -> str:
    """Replace the first line matching `pattern` (top-level keys come before any [section])."""
    new, count = re.subn(pattern, line.replace("\\", "\\\\"), text, count=1, flags=re.MULTILINE)
    if count != 1:
        raise InitError(f"the packaged {what} has no line matching {pattern!r}")
    return new


# A mirror is a directory, or an s3:// URL kept as a str (the --mirror flag's type, cli.mirror_arg).
MirrorArg = Path | str | None

# Replaces the unit's loopback-only fence when the mirror is an object store (docs/deployment.md).
S3_NETWORK = """# The mirror is an s3:// object store: mirrord connects out to its endpoint, whose addresses (a name
# that resolves to many, changing addresses) cannot be listed in IPAddressAllow=, so this unit sets no
# IPAddressDeny=. With a fixed endpoint address, fence the rest off in a drop-in:
#   IPAddressDeny=any
#   IPAddressAllow=localhost 10.0.0.7"""


def starter_config(primary: Path | None, mirror: MirrorArg) -> str:
    """The example config, every key commented, with the roots filled in when given (as absolute paths)."""
    text = packaged(EXAMPLE_CONFIG)
    if primary is not None:
        text = _set_line(text, r"^primary = .*$", f"primary = {json.dumps(str(primary.absolute()))}", "config")
    if mirror is not None:
        shown = mirror if isinstance(mirror, str) else str(mirror.absolute())
        text = _set_line(text, r"^# mirror = .*$", f"mirror = {json.dumps(shown)}", "config")
    return text


def starter_unit(config_path: Path, primary: Path | None, mirror: MirrorArg, executable: str | None) -> str:
    """The packaged unit pointed at this config, these roots and (if known) this mirrord executable. An
    s3:// mirror writes nothing here (no ReadWritePaths=) and needs the network (no loopback fence)."""
    text = packaged(SYSTEMD_UNIT)
    binary = executable or "/usr/local/bin/mirrord"
    text = _set_line(text, r"^ExecStart=.*$", f"ExecStart={binary} run --config {config_path.absolute()}", "unit")
    if primary is not None and mirror is not None:
        roots = " ".join(str(p.absolute()) for p in (primary, mirror) if isinstance(p, Path))
        text = _set_line(text, r"^RequiresMountsFor=.*$", f"RequiresMountsFor={roots}", "unit")
    if isinstance(mirror, str):
        text = _set_line(text, r"^ReadWritePaths=.*$", "# ReadWritePaths= none: an s3:// mirror", "unit")
        text = _set_line(text, r"^# With a local mirror(?:.*\n)*?IPAddressAllow=localhost$", S3_NETWORK, "unit")
    elif mirror is not None:
        text = _set_line(text, r"^ReadWritePaths=.*$", f"ReadWritePaths={mirror.absolute()}", "unit")
    return text


def systemd_next_steps(config: Path, unit: Path, mirror: MirrorArg) -> list[str]:
    """What to run after `init --systemd`: the user the unit runs as, its rights, the unit's install."""
    steps = [
        "useradd --system --user-group --no-create-home --shell /usr/sbin/nologin mirrord",
        f"chgrp mirrord {config} && chmod 0640 {config}",
    ]
    if isinstance(mirror, Path):
        steps.append(f"mkdir -p {mirror.absolute()} && chown mirrord:mirrord {mirror.absolute()}")
    steps += [
        f"mirrord check-config --config {config}",
        f"install -m 0644 {unit} /etc/systemd/system/{SYSTEMD_UNIT} && systemctl daemon-reload "
        "&& systemctl enable --now mirrord",
    ]
    return steps


def systemd_warnings(primary: Path | None, mirror: MirrorArg, executable: str | None) -> list[str]:
    """Paths the unit's sandbox hides from the service: PrivateTmp gives it its own /tmp and /var/tmp,
    ProtectHome hides /root, /home and /run/user."""
    hidden = {
        "/tmp": "PrivateTmp",
        "/var/tmp": "PrivateTmp",
        "/root": "ProtectHome",
        "/home": "ProtectHome",
        "/run/user": "ProtectHome",
    }
    named = [("primary", primary), ("mirror", mirror), ("mirrord", Path(executable) if executable else None)]
    return [
        f"{what} {path.absolute()} is under {top}, which the unit's {setting}= hides from the service: "
        + ("install mirrord elsewhere (python3 -m venv /opt/mirrord)" if what == "mirrord" else "choose another folder")
        for what, path in named
        if isinstance(path, Path)
        for top, setting in hidden.items()
        if path.absolute().is_relative_to(top)
    ]


def write_files(files: dict[Path, str], force: bool) -> list[Path]:
    """Publish every file, or none if one exists and force is off (checked before writing anything);
    the files that were replaced."""
    existing = [p for p in files if p.exists() or p.is_symlink()]
    if existing and not force:
        raise InitError(f"{existing[0]} exists; not overwritten (--force replaces it)")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Without force, a file created since the check above is still never replaced (link, not rename).
        write_bytes_atomic(path, text.encode("utf-8"), overwrite=force)
    return existing


def mirrord_executable(argv0: str) -> str | None:
    """The absolute path of this `mirrord` console script (else the one on PATH), for ExecStart=."""
    found = argv0 if Path(argv0).name == "mirrord" and Path(argv0).is_file() else shutil.which("mirrord")
    return str(Path(found).absolute()) if found else None
