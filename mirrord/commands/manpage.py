"""The mirrord(1) manual page in roff, generated from the argparse parser so it never drifts from --help.

Used by `mirrord man` and by the build step (setup.py) that ships `mirrord.1` in the wheel. No date in
the header: the same source always builds the same page.
"""

from __future__ import annotations

import argparse

from mirrord.commands.completion import Option, describe

ENVIRONMENT = (
    ("MIRRORD_CONFIG", "the TOML configuration file, when --config is not given"),
    (
        "MIRRORD_<KEY>, MIRRORD_<SECTION>__<KEY>",
        "override a key of the file, e.g. MIRRORD_MIRROR=/mnt/mirror, MIRRORD_COPY__WORKERS=4, "
        'MIRRORD_PATTERNS=\'["*.pt","*.ckpt"]\'; flags override both. Kubernetes service variables '
        "(MIRRORD_SERVICE_HOST, MIRRORD_PORT, ...) are ignored; any other unknown name is an error",
    ),
    ("NOTIFY_SOCKET", "set by systemd for a Type=notify service: READY=1, WATCHDOG=1, STOPPING=1 are sent there"),
)
EXIT_STATUS = (
    ("0", "success"),
    ("1", "the operation failed (a copy, a mismatch, no intact checkpoint, a refused prune)"),
    ("2", "bad usage or configuration: one message per problem, naming the key"),
)
FILES = (
    (".mirrord-manifest.json", "at the mirror root: size and content hash of every mirrored checkpoint"),
    (".mirrord.lock", "at the mirror root: one mirrord per mirror"),
    (".mirrord-drills.json", "at the mirror root: what each run's last drill found (the daemon's [drill])"),
)
# Sections after COMMANDS: title, font of the names (B bold, I italic), (name, text) items.
TAIL = (("ENVIRONMENT", "B", ENVIRONMENT), ("EXIT STATUS", "B", EXIT_STATUS), ("FILES", "I", FILES))


def _escape(text: str) -> str:
    """Plain text for roff: backslashes and hyphens escaped, no line may start with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n"))


def _option_lines(option: Option) -> list[str]:
    flags = ", ".join(f"\\fB{_escape(f)}\\fR" for f in option.flags)
    if option.takes_value:
        value = "{" + ",".join(option.choices) + "}" if option.choices else (option.kind.upper() or "VALUE")
        flags += f" \\fI{_escape(value)}\\fR"
    return [".TP", flags, _escape(option.help)]


def render(parser: argparse.ArgumentParser, version: str) -> str:
    """The man page for `parser`, in roff."""
    top, commands = describe(parser)
    lines = [
        f'.TH MIRRORD 1 "" "mirrord {_escape(version)}" "User Commands"',
        ".SH NAME",
        "mirrord \\- keep a second, always\\-trustworthy copy of ML training checkpoints",
        ".SH SYNOPSIS",
        ".B mirrord",
        "\\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
        ".br",
        ".B mirrord",
        "[\\fB\\-h\\fR] [\\fB\\-V\\fR]",
        ".SH DESCRIPTION",
        _escape(" ".join((parser.description or "").split())),
        ".SH OPTIONS",
    ]
    for option in top:
        lines += _option_lines(option)
    lines.append(".SH COMMANDS")
    for command in commands:
        sub = command.parser
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        lines += [
            f'.SS "{_escape(command.name)}"',
            _escape(" ".join((sub.description or "").split())),
            ".PP",
            ".nf",
            _escape(usage),
            ".fi",
        ]
        for positional in command.positionals:
            lines += [".TP", f"\\fI{_escape(positional.metavar)}\\fR", _escape(positional.help)]
        for option in command.options:
            lines += _option_lines(option)
    for title, font, items in TAIL:
        lines.append(f".SH {title}")
        for name, text in items:
            lines += [".TP", f"\\f{font}{_escape(name)}\\fR", _escape(text)]
    lines += [
        ".SH SEE ALSO",
        "\\fBmirrord init\\fR writes a commented configuration file; docs/ in the source tree documents every "
        "command, key and metric.",
    ]
    return "\n".join(lines) + "\n"
