"""Shell completion for bash, zsh and fish, generated from the argparse parser so it never drifts from it.

`describe` reads the parser once into plain data (commands, their options, what each value is: one of
a few words, a file, a directory); each shell's script is then a pure function of that data. Used by
`mirrord completion SHELL` and by the build step (setup.py) that ships the scripts in the wheel.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One option or positional of a subcommand, as the completion scripts need it."""

    flags: tuple[str, ...]  # ("-h", "--help"); empty for a positional
    help: str
    takes_value: bool
    choices: tuple[str, ...] = ()
    kind: str = ""  # "file", "dir" or "" (free text) for a value without choices
    metavar: str = ""  # how --help names the value (a positional's name)


@dataclass(frozen=True)
class Command:
    """One subcommand with its options and positionals."""

    name: str
    summary: str
    options: tuple[Option, ...]
    positionals: tuple[Option, ...]
    parser: argparse.ArgumentParser  # for its usage and description (the man page)


def _option(action: argparse.Action) -> Option:
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    kind = "dir" if metavar == "DIR" else "file" if metavar in ("FILE", "PATH") else ""
    return Option(
        flags=tuple(action.option_strings),
        help=" ".join((action.help or "").split()),
        takes_value=action.nargs != 0,
        choices=tuple(str(c) for c in action.choices) if action.choices else (),
        kind=kind,
        metavar=metavar or action.dest.upper(),
    )


def describe(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Command, ...]]:
    """The top-level options and every subcommand, in the parser's order."""
    top: list[Option] = []
    commands: list[Command] = []
    for action in parser._actions:  # argparse has no public walk; every completion generator reads these
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                options = [_option(a) for a in sub._actions if a.option_strings]
                positionals = [_option(a) for a in sub._actions if not a.option_strings]
                commands.append(Command(name, summaries.get(name, ""), tuple(options), tuple(positionals), sub))
        elif action.option_strings:
            top.append(_option(action))
    return tuple(top), tuple(commands)


def script(shell: str, parser: argparse.ArgumentParser, prog: str = "mirrord") -> str:
    """The completion script for `shell` (bash, zsh or fish)."""
    writers = {"bash": _bash, "zsh": _zsh, "fish": _fish}
    if shell not in writers:
        raise ValueError(f"unknown shell {shell!r}; one of {', '.join(writers)}")
    return writers[shell](prog, *describe(parser))


def _values(option: Option, choices: Callable[[str], str], directory: str, file: str, free: str) -> str:
    """What a shell offers for an option's value: one of its choices, a directory, a file, or nothing."""
    if option.choices:
        return choices(" ".join(option.choices))
    return {"dir": directory, "file": file}.get(option.kind, free)


# --- bash ---------------------------------------------------------------------------------------------
def _bash_values(option: Option) -> str:
    return _values(
        option,
        lambda words: f'COMPREPLY=($(compgen -W {shlex.quote(words)} -- "$cur"))',
        'compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -d -- "$cur"))',
        'compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- "$cur"))',
        "COMPREPLY=()",
    )


def _bash(prog: str, top: Sequence[Option], commands: Sequence[Command]) -> str:
    func = "_" + re.sub(r"\W", "_", prog)
    top_words = [f for o in top for f in o.flags] + [c.name for c in commands]
    lines = [
        f"# bash completion for {prog}; generated from its argument parser (`{prog} completion bash`).",
        f"{func}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" cmd="" i',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case "${COMP_WORDS[i]}" in -*) ;; *) cmd="${COMP_WORDS[i]}"; break ;; esac',
        "    done",
        '    case "$cmd" in',
        f'        "") COMPREPLY=($(compgen -W {shlex.quote(" ".join(top_words))} -- "$cur")) ;;',
    ]
    for command in commands:
        lines.append(f"        {command.name})")
        valued = [o for o in command.options if o.takes_value]
        if valued:
            lines.append('            case "$prev" in')
            for option in valued:
                lines.append(f"                {'|'.join(option.flags)}) {_bash_values(option)}; return ;;")
            lines.append("            esac")
        words = [f for o in command.options for f in o.flags] + [c for p in command.positionals for c in p.choices]
        lines.append(f'            COMPREPLY=($(compgen -W {shlex.quote(" ".join(words))} -- "$cur"))')
        if any(p.kind for p in command.positionals):
            lines.append(
                '            [[ "$cur" != -* ]] && { compopt -o filenames 2>/dev/null; '
                'COMPREPLY+=($(compgen -f -- "$cur")); }'
            )
        lines.append("            ;;")
    lines += ["    esac", "}", f"complete -F {func} {prog}", ""]
    return "\n".join(lines)


# --- zsh ----------------------------------------------------------------------------------------------
def _zsh_text(text: str) -> str:
    """A description inside '...[...]' of an _arguments spec: no quotes, brackets or colons."""
    text = text.replace("'", "").replace("[", "(").replace("]", ")").replace(":", " -").replace("\\", "")
    return text[:100]


def _zsh_action(option: Option) -> str:
    return _values(option, lambda words: f"({words})", "_files -/", "_files", " ")


def _zsh_spec(option: Option) -> list[str]:
    desc = _zsh_text(option.help)
    specs = []
    exclusive = f"({' '.join(option.flags)})" if len(option.flags) > 1 else ""
    for flag in option.flags:
        spec = f"{exclusive}{flag}[{desc}]"
        if option.takes_value:
            spec += f":{flag.lstrip('-')}:{_zsh_action(option)}"
        specs.append(f"'{spec}'")
    return specs


def _zsh(prog: str, top: Sequence[Option], commands: Sequence[Command]) -> str:
    func = "_" + re.sub(r"\W", "_", prog)
    lines = [
        f"#compdef {prog}",
        f"# zsh completion for {prog}; generated from its argument parser (`{prog} completion zsh`).",
        f"{func}() {{",
        '    local curcontext="$curcontext" state line',
        "    typeset -A opt_args",
        "    _arguments -C \\",
    ]
    lines += [f"        {spec} \\" for o in top for spec in _zsh_spec(o)]
    lines += [
        "        '1:command:->command' \\",
        "        '*::argument:->argument'",
        "    case $state in",
        "        command)",
        "            local -a commands",
        "            commands=(",
    ]
    lines += [f"                '{c.name}:{_zsh_text(c.summary)}'" for c in commands]
    lines += [
        "            )",
        "            _describe -t commands command commands ;;",
        "        argument)",
        "            case $line[1] in",
    ]
    for command in commands:
        specs = [spec for o in command.options for spec in _zsh_spec(o)]
        for index, positional in enumerate(command.positionals, start=1):
            specs.append(f"'{index}:{_zsh_text(positional.help) or 'argument'}:{_zsh_action(positional)}'")
        lines.append(f"                {command.name}) _arguments \\")
        lines += [f"                    {spec} \\" for spec in specs[:-1]]
        lines.append(f"                    {specs[-1]} ;;" if specs else "                    ;;")
    lines += [
        "            esac ;;",
        "    esac",
        "}",
        # Autoloaded from $fpath, the file's body runs as the function; sourced, it registers itself.
        f'if [ "$funcstack[1]" = "{func}" ]; then {func} "$@"; else compdef {func} {prog}; fi',
        "",
    ]
    return "\n".join(lines)


# --- fish ---------------------------------------------------------------------------------------------
def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_values(option: Option, free: str) -> str:
    return _values(option, lambda words: f"-f -a {_fish_quote(words)}", "-F", "-F", free)


def _fish_option(prog: str, condition: str, option: Option) -> str:
    parts = [f"complete -c {prog} -n {_fish_quote(condition)}"]
    for flag in option.flags:
        parts.append(f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}")
    if option.takes_value:
        parts.append(f"-r {_fish_values(option, free='-f')}")
    parts.append(f"-d {_fish_quote(option.help[:100])}")
    return " ".join(parts)


def _fish(prog: str, top: Sequence[Option], commands: Sequence[Command]) -> str:
    lines = [
        f"# fish completion for {prog}; generated from its argument parser (`{prog} completion fish`).",
        f"complete -c {prog} -f",
    ]
    lines += [_fish_option(prog, "__fish_use_subcommand", o) for o in top]
    lines += [f"complete -c {prog} -n __fish_use_subcommand -a {c.name} -d {_fish_quote(c.summary)}" for c in commands]
    for command in commands:
        condition = f"__fish_seen_subcommand_from {command.name}"
        lines += [_fish_option(prog, condition, o) for o in command.options]
        lines += [
            f"complete -c {prog} -n {_fish_quote(condition)} {_fish_values(p, free='')}"
            for p in command.positionals
            if p.choices or p.kind
        ]
    return "\n".join(lines) + "\n"
