"""The pydantic-free configuration of `latest` and `status` (mirrord.config_fast) against the models: it
knows every key, and for any file, variables and flags it either says "unsure" (None) or holds exactly
what mirrord.config.explain_config holds. A key added to the models without teaching the fast path fails
here, and so does any drift of a bound, a default or a coercion."""

from __future__ import annotations

import math
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mirrord.config import Config, _settings, explain_config
from mirrord.config_fast import SCHEMA, FastConfig, fast_config
from mirrord.errors import ConfigError

KEYS = list(SCHEMA)


def test_every_key_of_the_models_is_known_to_the_fast_path() -> None:
    assert set(_settings()) == set(SCHEMA)
    # Inline credentials only: the models warn of them (every other [s3] key is read like the rest).
    assert {k for k, spec in SCHEMA.items() if spec[0] == "refuse"} == {
        "s3.allow_inline_credentials", "s3.access_key_id", "s3.secret_access_key"}


def test_defaults_are_the_models_defaults(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    fast = fast_config(None, {}, {"mirror": str(mirror)}, need_primary=False)
    assert fast is not None
    assert values(fast) == values(explain_config(None, {}, {"mirror": str(mirror)}, need_primary=False).config)


def values(config: Config | FastConfig) -> dict[str, Any]:
    """Every key's value, and what commands derive from them."""
    out: dict[str, Any] = {}
    for key in KEYS:
        node: Any = config
        for part in key.split("."):
            node = getattr(node, part)
        out[key] = (type(node), node)
    out["rules"] = config.rules
    out["step_regex"] = config.step_regex.pattern
    out["mirror_target"] = config.mirror_target
    out["mirror_url"] = config.mirror_url
    out["copy_workers"] = config.copy_workers
    return out


# Values near every bound and of every type the three sources can carry; most are wrong somewhere.
NUMBERS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 1, 19, 20, 64, 65, 1000, 1001, 3600, 3601, 86400,
                                                          86401, 604800, 65535, 65536, 8 * 1024 * 1024,
                                                          256 * 1024 * 1024, 2**70]),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 0.1, 0.09, 2.5]))
TEXTS = st.one_of(
    st.sampled_from(["", " ", "true", "false", "True", "yes", "on", "1", "0", "-1", "007", " 2", "1.5", "1e3",
                     "inf", "nan", "0.1", "60", "86400", "70000", "1_000", "None", "null",
                     "torch", "custom", "hf", "lightning", "blake3", "sha256", "md5", "auto", "json", "console",
                     "debug", "INFO", "idle", "best-effort", "native", "folder", "file", "done", "a/b", ".",
                     "*.pt", "*.pt,*.ckpt", '["*.pt", "*.ckpt"]', '["x/y"]', "[", "*[.pt", "step_(\\d+)",
                     "(\\d+)", "(a)(b)", "(", "127.0.0.1:9108", "[::1]:80", "host:99999", "nohost",
                     "s3://bucket/x", "relative/dir", "/abs/dir", "s3://bucket", "s3://b", "s3://bucket//run/",
                     "s3:/bucket/x", "s3://bucket/../x", "s3://bu/cket", "http://127.0.0.1:8333", "https://s3.example",
                     "ftp://host", "http://", "path", "virtual", "node-1", "bad name", "STANDARD", "dcp", "5242880"]),
    st.text(max_size=8),
)
SCALARS = st.one_of(NUMBERS, TEXTS, st.booleans())
FILE_VALUES = st.one_of(SCALARS, st.lists(TEXTS, max_size=3), st.dictionaries(st.sampled_from(["x", "kind"]),
                                                                              SCALARS, max_size=1))


@st.composite
def layers(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """(file data, MIRRORD_* variables, flags), each setting a few keys, known or not."""
    names = st.sampled_from([*KEYS, "copy", "s3", "copy.nope", "nope", "copy_"])
    file: dict[str, Any] = {}
    for key in draw(st.lists(names, max_size=5)):
        section, _, sub = key.rpartition(".")
        node = file.setdefault(section, {}) if section else file
        if isinstance(node, dict):
            node[sub] = draw(FILE_VALUES)
    env = {"MIRRORD_" + k.replace(".", "__").upper(): draw(TEXTS) for k in draw(st.lists(names, max_size=3))}
    if draw(st.booleans()):
        env[draw(st.sampled_from(["MIRRORD_SERVICE_HOST", "MIRRORD_COPY_WORKERS", "MIRRORD_NOPE"]))] = "1"
    flags: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(["primary", "mirror", "log.level", "log.format"]), max_size=2)):
        section, _, sub = key.rpartition(".")
        node = flags.setdefault(section, {}) if section else flags
        node[sub] = draw(TEXTS)
    return file, env, flags


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        (root / "mirror").mkdir()
        (root / "primary").mkdir()
        yield root


def toml_text(data: dict[str, Any]) -> str | None:
    """`data` as TOML (None when TOML cannot say it: nan and inf are, the rest is skipped)."""
    def scalar(v: Any) -> str | None:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        if isinstance(v, str):
            return '"' + v.encode("unicode_escape").decode().replace('"', '\\"') + '"'
        if isinstance(v, list):
            items = [scalar(x) for x in v]
            return None if None in items else "[" + ", ".join(i for i in items if i is not None) + "]"
        if isinstance(v, dict):
            items = [(k, scalar(x)) for k, x in v.items()]
            return None if any(i is None for _, i in items) else "{" + ", ".join(f"{k} = {i}" for k, i in items) + "}"
        return None

    lines = []
    for key, value in data.items():
        text = scalar(value)
        if text is None:
            return None
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers(), st.sampled_from([None, "mirror", "s3://bucket/run"]), st.booleans())
def test_the_fast_path_is_unsure_or_agrees_with_the_models(
    folder: Path, sources: tuple[dict[str, Any], dict[str, str], dict[str, Any]], with_mirror: str | None,
    need_primary: bool
) -> None:
    file, env, flags = sources
    if with_mirror is not None:  # most documents then pass the roots check too: both answers are compared in full
        file.setdefault("mirror", with_mirror)
        file.setdefault("primary", "primary")
    text = toml_text(file)
    if text is None:
        return
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return
    path = folder / "mirrord.toml"
    path.write_text(text)
    fast = fast_config(path, env, flags, need_primary=need_primary)
    try:
        model = explain_config(path, env, flags, need_primary=need_primary).config
    except ConfigError:
        assert fast is None
        return
    except ValueError:  # a NUL in a root path escapes the models' loader as os's own error: never fast
        assert fast is None
        return
    if fast is not None:
        assert values(fast) == values(model)


def test_a_plain_valid_config_is_taken_by_the_fast_path(folder: Path) -> None:
    """The common case must not fall back (else `latest` pays for pydantic again, silently)."""
    path = folder / "plain.toml"
    path.write_text('primary = "primary"\nmirror = "mirror"\nlayout = "custom"\npatterns = ["*.pt", "*.ckpt"]\n'
                    '[copy]\nworkers = 4\nsettle_seconds = 0\n[metrics]\naddress = "127.0.0.1:9200"\n'
                    '[unit]\nkind = "folder"\ncomplete_marker = "DONE"\n')
    env = {"MIRRORD_COPY__SETTLE_SECONDS": "0", "MIRRORD_LOG__FORMAT": "json", "MIRRORD_PRUNE__ENABLED": "false",
           "MIRRORD_METRICS__ADDRESS": "127.0.0.1:9999"}
    fast = fast_config(path, env, {"log": {"level": "debug"}})
    assert fast is not None
    assert values(fast) == values(explain_config(path, env, {"log": {"level": "debug"}}).config)
    assert fast.metrics.address == "127.0.0.1:9999" and fast.copy.workers == 4 and fast.log.level == "debug"
    with pytest.raises(AttributeError):
        fast.copy_.workers = 3


def test_a_plain_s3_config_is_taken_by_the_fast_path(folder: Path) -> None:
    """`sync` into an object store starts without pydantic too (its start-up is paid on every pass)."""
    path = folder / "s3.toml"
    path.write_text('primary = "primary"\nmirror = "s3://bucket/runs"\n[copy]\nsettle_seconds = 0\n'
                    '[s3]\nendpoint_url = "http://127.0.0.1:8333"\naddressing_style = "path"\n'
                    'part_size = 16777216\nfiles_in_flight = 4\nlease_seconds = 60\nnode = "node-1"\n')
    env = {"MIRRORD_S3__REGION": "eu-west-1", "MIRRORD_S3__CONCURRENCY": "6"}
    fast = fast_config(path, env)
    assert fast is not None
    assert values(fast) == values(explain_config(path, env).config)
    assert fast.mirror_target == "s3://bucket/runs" and fast.copy_workers == 4 and fast.s3.region == "eu-west-1"
    # Inline credentials are the models' (they warn of them), so is a units_span_nodes outside a dcp layout.
    for extra in ('access_key_id = "AK"\n', "units_span_nodes = true\n"):
        (folder / "s3-other.toml").write_text(path.read_text() + extra)
        assert fast_config(folder / "s3-other.toml", env) is None
