"""Configuration: defaults < TOML < MIRRORD_* < flags; every problem is one message naming its key, exit 2.

Also: no default mirror; relative paths in a file are relative to the file; environment values are
strings the schema coerces, and a bad one names its variable; Kubernetes service variables are
ignored; check-config prints pasteable TOML saying where each value came from.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mirrord import cli
from mirrord.commands.config_toml import value_to_toml
from mirrord.config import Config, check_paths, explain_config, load_config, read_environment
from mirrord.errors import ConfigError
from tests.support.cli import run_mirrord
from tests.support.privileges import run_as_nobody

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "mirrord.toml"
PREFIX = "mirrord: config error: "


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def _problems(stderr: str) -> list[str]:
    """The config problems printed on stderr; fails if stderr holds anything else."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert all(line.startswith(PREFIX) for line in lines), stderr
    return [line.removeprefix(PREFIX) for line in lines]


@pytest.fixture(autouse=True)
def _no_mirrord_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets itself: MIRRORD_* variables of the calling shell must not leak in."""
    for name in list(os.environ):
        if name.startswith("MIRRORD_"):
            monkeypatch.delenv(name)


@pytest.fixture
def mirrord_main(capsys: pytest.CaptureFixture[str]) -> Callable[..., Outcome]:
    """cli.main in this process (fast); the console script itself is run by the subprocess tests."""

    def run(*argv: str | Path) -> Outcome:
        capsys.readouterr()
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return Outcome(code, out, err)

    return run


def _write(tmp_path: Path, toml: str) -> Path:
    path = tmp_path / "mirrord.toml"
    path.write_text(toml, encoding="utf-8")
    return path


# --- the shipped file and the defaults ---------------------------------------------------------------


def test_shipped_file_parses_and_equals_the_embedded_defaults() -> None:
    """config/mirrord.toml documents the defaults; only the two roots are site-specific."""
    shipped = load_config(SHIPPED, environ={}, overrides={"mirror": "/m"}, check_roots=False).model_dump()
    defaults = Config(mirror=Path("/m")).model_dump()
    for key in ("primary", "mirror"):
        shipped.pop(key)
        defaults.pop(key)
    assert shipped == defaults


def test_copies_are_paced_from_evidence_at_idle_priority_by_default() -> None:
    """No fixed cap by default (issue 44): copies are paced from pressure, at SCHED_IDLE and the idle I/O
    class; a cap is still accepted, and still refused below its minimum."""
    io = Config(mirror=Path("/m")).io
    assert (io.bandwidth_limit, io.pacing, io.ionice, io.cpu_policy) == (0, True, "idle", "idle")
    capped = Config.model_validate({"mirror": "/m", "io": {"bandwidth_limit": 100 * 2**20}})
    assert capped.io.bandwidth_limit == 100 * 2**20
    with pytest.raises(ValueError, match="at least"):
        Config.model_validate({"mirror": "/m", "io": {"bandwidth_limit": 1}})


def test_shipped_file_mentions_every_key() -> None:
    """Every key of every section is in the shipped file, set or commented out, so it is documented."""
    text = SHIPPED.read_text(encoding="utf-8")
    parsed = tomllib.loads(text)
    for name, field in Config.model_fields.items():
        key = field.alias or name
        sub = getattr(field.annotation, "model_fields", None)
        if sub is None:
            assert key in parsed or f"# {key} =" in text, f"top-level key {key!r} missing from {SHIPPED.name}"
            continue
        assert f"[{key}]" in text, f"section [{key}] missing from {SHIPPED.name}"
        for sub_key in sub:
            assert sub_key in parsed.get(key, {}) or f"# {sub_key} =" in text, f"{key}.{sub_key} undocumented"


def test_defaults_need_no_file(primary: Path, mirror: Path) -> None:
    """`--primary A --mirror B` alone is a complete configuration."""
    config = load_config(None, environ={}, overrides={"primary": str(primary), "mirror": str(mirror)})
    assert (config.primary, config.mirror) == (primary, mirror)
    assert config.patterns == ("*.pt",)
    assert (config.copy.workers, config.copy.hash, config.copy.settle_seconds) == (2, "blake3", 2.0)
    assert (config.prune.keep_last, config.prune.step_pattern) == (12, r"step_(\d+)")
    assert (config.metrics.address, config.log.format, config.log.level) == ("127.0.0.1:9108", "auto", "info")


def test_config_is_frozen(primary: Path, mirror: Path) -> None:
    """Built once, never changed afterwards."""
    config = load_config(None, environ={}, overrides={"primary": str(primary), "mirror": str(mirror)})
    with pytest.raises(ValueError, match="frozen"):
        config.primary = mirror  # type: ignore[misc]


# --- precedence ---------------------------------------------------------------------------------------


def test_precedence_file_then_environment_then_flags(tmp_path: Path, primary: Path, mirror: Path) -> None:
    """The console script: a flag beats MIRRORD_*, which beats the file, which beats the default."""
    other = tmp_path / "other"
    other.mkdir()
    config_file = _write(
        tmp_path,
        (
            f'primary = "{other}"\nmirror = "{tmp_path / "m-file"}"\n'
            '[copy]\nworkers = 3\nhash = "sha256"\n[log]\nlevel = "debug"\n[prune]\nkeep_last = 7\n'
        ),
    )
    env = {
        "MIRRORD_PRIMARY": str(primary),
        "MIRRORD_MIRROR": str(tmp_path / "m-env"),
        "MIRRORD_COPY__WORKERS": "4",
        "MIRRORD_LOG__LEVEL": "warning",
    }
    result = run_mirrord("check-config", "--config", config_file, "--mirror", mirror, "--log-level", "error", env=env)
    assert result.returncode == 0, result.stderr
    effective = tomllib.loads(result.stdout)
    assert effective["primary"] == str(primary)  # environment over file
    assert effective["mirror"] == str(mirror)  # flag over environment over file
    assert effective["copy"]["workers"] == 4  # environment over file
    assert effective["copy"]["hash"] == "sha256"  # file over default
    assert effective["log"]["level"] == "error"  # flag over environment over file
    assert effective["prune"]["keep_last"] == 7  # file over default
    assert effective["prune"]["min_age_seconds"] == 300.0  # default


def test_config_file_from_environment_and_the_flag_wins(
    tmp_path: Path,
    primary: Path,
    mirror: Path,
    monkeypatch: pytest.MonkeyPatch,
    mirrord_main: Callable[..., Outcome],
) -> None:
    """MIRRORD_CONFIG names the file; --config overrides it."""
    (tmp_path / "a.toml").write_text("[copy]\nworkers = 5\n", encoding="utf-8")
    (tmp_path / "b.toml").write_text("[copy]\nworkers = 6\n", encoding="utf-8")
    monkeypatch.setenv("MIRRORD_CONFIG", str(tmp_path / "a.toml"))
    roots = ("--primary", primary, "--mirror", mirror)
    from_env = mirrord_main("check-config", *roots)
    from_flag = mirrord_main("check-config", *roots, "--config", tmp_path / "b.toml")
    assert tomllib.loads(from_env.stdout)["copy"]["workers"] == 5
    assert tomllib.loads(from_flag.stdout)["copy"]["workers"] == 6


def test_environment_values_are_strings_the_schema_coerces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MIRRORD_SECTION__KEY nests; values stay strings (only list keys are JSON) and pydantic types them."""
    env = {
        "MIRRORD_COPY__WORKERS": "4",
        "MIRRORD_PRUNE__DRY_RUN": "true",
        "MIRRORD_PRUNE__MIN_AGE_SECONDS": "2.5",
        "MIRRORD_PATTERNS": '["*.pt", "*.ckpt"]',
        "MIRRORD_MIRROR": "2024",
        "MIRRORD_CONFIG": "/ignored.toml",
        "OTHER": "x",
    }
    assert read_environment(env).data == {
        "copy": {"workers": "4"},
        "prune": {"dry_run": "true", "min_age_seconds": "2.5"},
        "patterns": ["*.pt", "*.ckpt"],
        "mirror": "2024",
    }
    del env["MIRRORD_CONFIG"]
    monkeypatch.chdir(tmp_path)
    config = load_config(None, environ=env, check_roots=False)
    assert (config.copy.workers, config.prune.dry_run, config.prune.min_age_seconds) == (4, True, 2.5)
    assert config.patterns == ("*.pt", "*.ckpt")
    assert config.mirror == tmp_path / "2024"  # a folder named 2024, not the number
    comma = load_config(None, environ={"MIRRORD_MIRROR": "/m", "MIRRORD_PATTERNS": "*.pt,*.ckpt"}, check_roots=False)
    assert comma.patterns == ("*.pt", "*.ckpt")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "MIRRORD_COPY_WORKERS",
            "4",
            "MIRRORD_COPY_WORKERS: unknown setting; did you mean MIRRORD_COPY__WORKERS (copy.workers)?",
        ),
        (
            "MIRRORD_COPY__WOKERS",
            "4",
            "MIRRORD_COPY__WOKERS: unknown setting; did you mean MIRRORD_COPY__WORKERS (copy.workers)?",
        ),
        ("MIRRORD_MIROR", "/m", "MIRRORD_MIROR: unknown setting; did you mean MIRRORD_MIRROR (mirror)?"),
        (
            "MIRRORD_COPY__WORKERS",
            "abc",
            "copy.workers: Input should be a valid integer, unable to parse string as "
            "an integer (from MIRRORD_COPY__WORKERS='abc')",
        ),
        ("MIRRORD_PATTERNS", '["*.pt"', "patterns: MIRRORD_PATTERNS is not valid JSON"),
        # Shaped like a section key: stays an error even though it resembles Kubernetes' names.
        ("MIRRORD_SERVICE__HOST", "10.0.0.1", "MIRRORD_SERVICE__HOST: unknown setting"),
        ("MIRRORD_METRICS__PORT", "9108", "MIRRORD_METRICS__PORT: unknown setting"),
        (
            "MIRRORD_WATCH__PARALLEL_LISTING",
            "false",
            "MIRRORD_WATCH__PARALLEL_LISTING: watch.parallel_listing was "
            "removed (the daemon lists the mirror itself); unset the variable",
        ),
    ],
)
def test_environment_problems_name_the_variable(
    primary: Path,
    mirror: Path,
    monkeypatch: pytest.MonkeyPatch,
    mirrord_main: Callable[..., Outcome],
    name: str,
    value: str,
    expected: str,
) -> None:
    """A bad variable is reported with its own name, and a misspelt one with the closest real one."""
    monkeypatch.setenv(name, value)
    result = mirrord_main("check-config", "--primary", primary, "--mirror", mirror)
    assert (result.returncode, result.stdout) == (2, "")
    [problem] = _problems(result.stderr)
    assert problem.startswith(expected), problem


def test_kubernetes_service_variables_are_ignored_and_logged_once(primary: Path, mirror: Path) -> None:
    """What Kubernetes injects for a Service named `mirrord` does not stop the sidecar; one log line says so."""
    injected = {
        "MIRRORD_SERVICE_HOST": "10.96.0.12",
        "MIRRORD_SERVICE_PORT": "9108",
        "MIRRORD_SERVICE_PORT_METRICS": "9108",
        "MIRRORD_PORT": "tcp://10.96.0.12:9108",
        "MIRRORD_PORT_9108_TCP": "tcp://10.96.0.12:9108",
        "MIRRORD_PORT_9108_TCP_PROTO": "tcp",
        "MIRRORD_PORT_9108_TCP_PORT": "9108",
        "MIRRORD_PORT_9108_TCP_ADDR": "10.96.0.12",
    }
    result = run_mirrord(
        "check-config",
        "--primary",
        primary,
        "--mirror",
        mirror,
        "--log-format",
        "json",
        env={**injected, "MIRRORD_COPY__WORKERS": "3"},
    )
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["copy"]["workers"] == 3
    [event] = [json.loads(line) for line in result.stderr.splitlines()]
    assert event["event"] == "config.environment_ignored"
    assert sorted(event["variables"]) == sorted(injected)


# --- one message per problem, naming the key, exit 2 ----------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "key", "words"),
    [
        ("[prune]\nkeep_last = 0\n", "prune.keep_last", "greater than or equal to 1"),
        ("wokers = 2\n", "wokers", "unknown key"),
        ("[copy]\nwokers = 2\n", "copy.wokers", "unknown key"),
        ("[prune]\nstep_pattern = 'step_(\\d+'\n", "prune.step_pattern", "regular expression"),
        ("[prune]\nstep_pattern = 'step_\\d+'\n", "prune.step_pattern", "capturing group"),
        ('patterns = ["runs/*.pt"]\n', "patterns", "not a file-name pattern"),
        ('patterns = ["step_[0-9.pt"]\n', "patterns", "unbalanced brackets"),
        ("patterns = []\n", "patterns", "at least one pattern"),
        ('[copy]\nhash = "md5"\n', "copy.hash", "blake3"),
        ('[metrics]\naddress = "9108"\n', "metrics.address", "HOST:PORT"),
        (
            "[watch]\nparallel_listing = true\n",
            "watch.parallel_listing",
            "removed (the daemon lists the mirror itself)",
        ),
    ],
)
def test_invalid_value_exits_2_naming_the_key(
    tmp_path: Path,
    primary: Path,
    mirror: Path,
    mirrord_main: Callable[..., Outcome],
    toml: str,
    key: str,
    words: str,
) -> None:
    """One problem, one line on stderr that starts with the key; nothing on stdout."""
    result = mirrord_main("check-config", "--config", _write(tmp_path, toml), "--primary", primary, "--mirror", mirror)
    assert result.returncode == 2
    assert result.stdout == ""
    [problem] = _problems(result.stderr)
    assert problem.startswith(f"{key}: ") and words in problem, problem


def test_console_script_exits_2_on_an_unknown_key(tmp_path: Path, primary: Path, mirror: Path) -> None:
    """The real process: status 2, the message on stderr, nothing on stdout."""
    config_file = _write(tmp_path, "[copy]\nwokers = 2\n")
    result = run_mirrord("sync", "--config", config_file, "--primary", primary, "--mirror", mirror)
    assert (result.returncode, result.stdout) == (2, "")
    assert _problems(result.stderr) == [f"copy.wokers: unknown key (in {config_file}); did you mean copy.workers?"]
    assert list(mirror.iterdir()) == []


def test_invalid_environment_value_names_the_key(
    primary: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch, mirrord_main: Callable[..., Outcome]
) -> None:
    monkeypatch.setenv("MIRRORD_COPY__WORKERS", "many")
    result = mirrord_main("check-config", "--primary", primary, "--mirror", mirror)
    assert result.returncode == 2
    [problem] = _problems(result.stderr)
    assert problem.split(":")[0] == "copy.workers" and "MIRRORD_COPY__WORKERS='many'" in problem


def test_unparsable_file_exits_2(
    tmp_path: Path, primary: Path, mirror: Path, mirrord_main: Callable[..., Outcome]
) -> None:
    result = mirrord_main(
        "check-config", "--config", _write(tmp_path, "[copy\nworkers = 2\n"), "--primary", primary, "--mirror", mirror
    )
    assert result.returncode == 2
    [problem] = _problems(result.stderr)
    assert problem.startswith("config: ") and "not valid TOML" in problem


def test_missing_config_file_exits_2(
    tmp_path: Path, primary: Path, mirror: Path, mirrord_main: Callable[..., Outcome]
) -> None:
    result = mirrord_main(
        "check-config", "--config", tmp_path / "absent.toml", "--primary", primary, "--mirror", mirror
    )
    assert result.returncode == 2
    [problem] = _problems(result.stderr)
    assert problem.startswith("config: ") and "absent.toml" in problem


@pytest.fixture
def root_problems(mirrord_main: Callable[..., Outcome]) -> Callable[[Path, Path], list[str]]:
    def check(primary: Path, mirror: Path) -> list[str]:
        result = mirrord_main("check-config", "--primary", primary, "--mirror", mirror)
        assert result.returncode == 2, result.stdout
        return _problems(result.stderr)

    return check


def test_missing_primary(tmp_path: Path, mirror: Path, root_problems: Callable[[Path, Path], list[str]]) -> None:
    [problem] = root_problems(tmp_path / "nowhere", mirror)
    assert problem.startswith("primary: ") and "does not exist" in problem


def test_the_daemon_may_wait_for_a_missing_primary(tmp_path: Path, mirror: Path) -> None:
    """`run` loads a config whose primary root does not exist yet (it waits for it); a primary that is a
    file is still refused, and so is a missing one for every other command."""
    config = Config(primary=tmp_path / "nowhere", mirror=mirror)
    assert check_paths(config, "later") == []
    assert check_paths(config) != []
    (tmp_path / "file").write_bytes(b"")
    assert check_paths(Config(primary=tmp_path / "file", mirror=mirror), "later") != []


def test_primary_that_is_a_file(tmp_path: Path, mirror: Path, root_problems: Callable[[Path, Path], list[str]]) -> None:
    (tmp_path / "file").write_bytes(b"")
    [problem] = root_problems(tmp_path / "file", mirror)
    assert problem.startswith("primary: ") and "not a directory" in problem


def test_mirror_equal_to_primary(primary: Path, root_problems: Callable[[Path, Path], list[str]]) -> None:
    [problem] = root_problems(primary, primary)
    assert problem.startswith("mirror: ") and "same directory" in problem


def test_mirror_equal_to_primary_through_a_symlink(
    tmp_path: Path, primary: Path, root_problems: Callable[[Path, Path], list[str]]
) -> None:
    """Resolved paths are compared: an alias of the primary is the primary."""
    (tmp_path / "alias").symlink_to(primary)
    [problem] = root_problems(primary, tmp_path / "alias")
    assert problem.startswith("mirror: ") and "same directory" in problem


def test_mirror_inside_primary(primary: Path, root_problems: Callable[[Path, Path], list[str]]) -> None:
    [problem] = root_problems(primary, primary / "backup")
    assert problem.startswith("mirror: ") and "inside primary" in problem


def test_primary_inside_mirror(mirror: Path, root_problems: Callable[[Path, Path], list[str]]) -> None:
    (mirror / "ckpt").mkdir()
    [problem] = root_problems(mirror / "ckpt", mirror)
    assert problem.startswith("primary: ") and "inside mirror" in problem


def test_sibling_with_a_common_prefix_is_not_inside(tmp_path: Path, mirrord_main: Callable[..., Outcome]) -> None:
    """/x/ckpt and /x/ckpt-mirror are siblings, not nested (a string-prefix test would say otherwise)."""
    (tmp_path / "ckpt").mkdir()
    result = mirrord_main("check-config", "--primary", tmp_path / "ckpt", "--mirror", tmp_path / "ckpt-mirror")
    assert result.returncode == 0, result.stderr


def _main_captured(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def test_unreadable_primary(world_tmp: Path) -> None:
    """Permission bits bind only a non-root process: cli.main runs in a child that dropped to nobody."""
    primary, mirror = world_tmp / "primary", world_tmp / "mirror"
    primary.mkdir(mode=0o700)
    mirror.mkdir()
    mirror.chmod(0o777)
    argv = ["check-config", "--primary", str(primary), "--mirror", str(mirror)]
    outcome = run_as_nobody(_main_captured, argv)
    code, stderr = outcome["value"]
    assert code == 2
    [problem] = _problems(stderr)
    assert problem.startswith("primary: ") and "not readable" in problem


def test_every_problem_is_reported_at_once(tmp_path: Path, mirrord_main: Callable[..., Outcome]) -> None:
    """An operator fixes everything in one round: value problems and root problems appear together."""
    config_file = _write(tmp_path, "[prune]\nkeep_last = 0\n[copy]\nwokers = 2\n")
    result = mirrord_main(
        "check-config", "--config", config_file, "--primary", tmp_path / "nowhere", "--mirror", tmp_path / "m"
    )
    assert result.returncode == 2
    keys = sorted(p.split(": ")[0] for p in _problems(result.stderr))
    assert keys == ["copy.wokers", "primary", "prune.keep_last"]


def test_load_config_lists_one_problem_per_key(primary: Path, mirror: Path) -> None:
    """The library API reports the problems as a list, one per key."""
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            environ={},
            overrides={
                "primary": str(primary),
                "mirror": str(mirror),
                "prune": {"keep_last": 0, "step_pattern": "("},
                "nope": 1,
            },
        )
    keys = sorted(p.split(": ")[0] for p in info.value.problems)
    assert keys == ["nope", "prune.keep_last", "prune.step_pattern"]


# --- check-config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_check_config_prints_the_effective_configuration(
    tmp_path: Path,
    primary: Path,
    mirror: Path,
    monkeypatch: pytest.MonkeyPatch,
    mirrord_main: Callable[..., Outcome],
    fmt: str,
) -> None:
    """The printed document (TOML for a person, --format json for machines) loads back to the same Config.

    The TOML is pasted into a file as is: `--config` on it gives the same configuration.
    """
    monkeypatch.setenv("MIRRORD_COPY__WORKERS", "3")
    config_file = _write(tmp_path, "[prune]\nkeep_every = 1000\nstep_pattern = 'it(\\d+)\\.pt'\n")
    result = mirrord_main(
        "check-config", "--config", config_file, "--primary", primary, "--mirror", mirror, "--format", fmt
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout) if fmt == "json" else tomllib.loads(result.stdout)
    assert (printed["primary"], printed["mirror"]) == (str(primary), str(mirror))
    assert printed["copy"]["workers"] == 3
    assert printed["prune"]["step_pattern"] == r"it(\d+)\.pt"
    expected = load_config(config_file, overrides={"primary": str(primary), "mirror": str(mirror)})
    assert load_config(None, environ={}, overrides=printed) == expected
    if fmt == "toml":
        pasted = tmp_path / "pasted.toml"
        pasted.write_text(result.stdout, encoding="utf-8")
        monkeypatch.delenv("MIRRORD_COPY__WORKERS")
        assert load_config(pasted) == expected


def test_check_config_says_where_each_value_came_from(
    tmp_path: Path,
    primary: Path,
    mirror: Path,
    monkeypatch: pytest.MonkeyPatch,
    mirrord_main: Callable[..., Outcome],
) -> None:
    """Every value line ends in a comment naming its origin: default, file PATH, environment NAME, flag NAME."""
    config_file = _write(tmp_path, f'primary = "{primary}"\n[prune]\nkeep_last = 7\n')
    monkeypatch.setenv("MIRRORD_COPY__WORKERS", "3")
    result = mirrord_main("check-config", "--config", config_file, "--mirror", mirror, "--log-level", "debug")
    assert result.returncode == 0, result.stderr
    origins, table = {}, ""
    for line in result.stdout.splitlines():
        if line.startswith("["):
            table = line.strip("[]") + "."
        elif " = " in line and not line.startswith("#"):
            key, _, rest = line.partition(" = ")
            origins[table + key] = rest.rpartition("  # ")[2]
    parsed = tomllib.loads(result.stdout)
    values = {f"{t}.{k}" for t, v in parsed.items() if isinstance(v, dict) for k in v}
    values |= {k for k, v in parsed.items() if not isinstance(v, dict)}
    assert set(origins) == values and all(origins.values())  # a comment on every value
    assert origins["primary"] == f"file {config_file}"
    assert origins["mirror"] == "flag --mirror"
    assert origins["copy.workers"] == "environment MIRRORD_COPY__WORKERS"
    assert origins["prune.keep_last"] == f"file {config_file}"
    assert origins["log.level"] == "flag --log-level"
    assert origins["copy.hash"] == origins["prune.min_age_seconds"] == origins["prune.primary"] == "default"
    assert "# keep_every = (not set)  # default" in result.stdout.splitlines()
    explained = explain_config(config_file, overrides={"mirror": str(mirror)})
    assert str(explained.origin("copy.workers")) == "environment MIRRORD_COPY__WORKERS"
    assert str(explained.origin("copy.hash")) == "default"


# --- no default mirror, relative paths -------------------------------------------------------------------


def test_a_missing_mirror_is_an_error_naming_the_key(tmp_path: Path, primary: Path) -> None:
    """`mirrord sync --primary p` used to copy into a built-in /mnt/mirror/checkpoints on the root disk."""
    result = run_mirrord("sync", "--primary", primary, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    [problem] = _problems(result.stderr)
    assert problem.startswith("mirror: not set (there is no default)") and "--mirror" in problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["primary"]


def test_relative_paths_in_a_file_are_relative_to_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same file means the same folders wherever the command runs; flags stay relative to the cwd."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "ckpt").mkdir()
    (tmp_path / "backup").mkdir()  # a mirror's parent must exist
    config_file = _write(etc, 'primary = "ckpt"\nmirror = "../backup/ckpt"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(config_file, environ={})
    assert config.primary == etc.resolve() / "ckpt"
    assert config.mirror == tmp_path.resolve() / "backup" / "ckpt"  # as printed: no etc/../
    from_flag = load_config(config_file, environ={}, overrides={"mirror": "m"})
    assert from_flag.mirror == elsewhere / "m"
    from_env = load_config(config_file, environ={"MIRRORD_MIRROR": "e"})
    assert from_env.mirror == elsewhere / "e"


@given(st.text())
def test_every_string_is_written_as_toml_that_reads_back(value: str) -> None:
    """check-config may print any path or pattern: each one survives the trip through TOML."""
    assert tomllib.loads(f"key = {value_to_toml(value)}\n") == {"key": value}
