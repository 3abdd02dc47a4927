"""Configuration: built once from defaults, a TOML file, MIRRORD_* variables and flags; frozen; validated loudly.

Precedence (lowest first): embedded defaults < TOML file < environment < command-line flags.
Nothing is silently corrected: every problem becomes one message that names the key.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mirrord.errors import ConfigError

ENV_PREFIX = "MIRRORD_"
ENV_CONFIG_FILE = "MIRRORD_CONFIG"
MIB = 1024 * 1024


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CopyConfig(_Section):
    workers: int = Field(2, ge=1, le=64)
    hash: Literal["blake3", "sha256", "xxh3_128"] = "blake3"
    settle_seconds: float = Field(2.0, ge=0)
    stall_seconds: float = Field(120.0, gt=0)
    max_attempts: int = Field(5, ge=1)
    retry_backoff_seconds: float = Field(1.0, ge=0)
    retry_backoff_max_seconds: float = Field(60.0, ge=0)
    free_space_reserve_bytes: int = Field(256 * MIB, ge=0)
    invalid_grace_seconds: float = Field(600.0, ge=0)


class PruneConfig(_Section):
    enabled: bool = True
    keep_last: int = Field(12, ge=1)
    keep_every: int | None = Field(None, ge=1)
    min_age_seconds: float = Field(300.0, ge=0)
    future_skew_seconds: float = Field(60.0, ge=0)
    primary: bool = False
    dry_run: bool = False
    step_pattern: str = r"step_(\d+)"

    @field_validator("step_pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        if compiled.groups != 1:
            raise ValueError("must contain exactly one capturing group (the step number)")
        return value


class WatchConfig(_Section):
    mode: Literal["auto", "native", "polling"] = "auto"
    poll_interval_seconds: float = Field(2.0, gt=0)
    rescan_interval_seconds: float = Field(60.0, gt=0)


class MetricsConfig(_Section):
    enabled: bool = True
    address: str = "127.0.0.1:9108"

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9108)")
        return value

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


class LogConfig(_Section):
    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class IoConfig(_Section):
    buffer_bytes: int = Field(8 * MIB, ge=64 * 1024, le=256 * MIB)
    bandwidth_limit: int = Field(0, ge=0)
    drop_cache: bool = True
    ionice: Literal["none", "best-effort", "idle"] = "none"


class DaemonConfig(_Section):
    heartbeat_seconds: float = Field(5.0, gt=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0)


class Config(_Section):
    primary: Path = Path("/data/checkpoints")
    mirror: Path = Path("/mnt/mirror/checkpoints")
    patterns: tuple[str, ...] = ("*.pt",)
    mirror_must_be_mountpoint: bool = False
    copy_: CopyConfig = Field(default_factory=CopyConfig, alias="copy")
    prune: PruneConfig = Field(default_factory=PruneConfig)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    io: IoConfig = Field(default_factory=IoConfig)
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("patterns", mode="before")
    @classmethod
    def _split_patterns(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("patterns")
    @classmethod
    def _valid_patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one pattern is required (e.g. ['*.pt'])")
        for pattern in value:
            if not pattern.strip() or "/" in pattern or "\0" in pattern:
                raise ValueError(f"{pattern!r} is not a file-name pattern (no '/', not empty)")
            if pattern.count("[") != pattern.count("]"):
                raise ValueError(f"{pattern!r} has unbalanced brackets")
        return value

    @property
    def copy(self) -> CopyConfig:  # type: ignore[override]
        """The [copy] section (stored as copy_ so it does not shadow BaseModel.copy)."""
        return self.copy_

    @property
    def step_regex(self) -> re.Pattern[str]:
        return re.compile(self.prune.step_pattern)

    def to_toml_dict(self) -> dict[str, Any]:
        """The effective configuration as plain data, for `check-config`."""
        data = self.model_dump(mode="json", by_alias=True)
        return data


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_env_value(raw: str) -> Any:
    """JSON where it parses (numbers, booleans, lists), the raw string otherwise."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """MIRRORD_KEY and MIRRORD_SECTION__KEY variables as nested config data."""
    data: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_env_value(raw)
    return data


def _format_errors(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        key = key.replace("copy_", "copy")
        if err["type"] == "extra_forbidden":
            problems.append(f"{key}: unknown key")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{key}: {msg}")
    return problems


def check_paths(config: Config, need_primary: bool = True) -> list[str]:
    """Problems with the two roots that make mirroring unsafe or impossible.

    Commands that only read the mirror (verify, latest) pass need_primary=False.
    """
    problems = []
    primary, mirror = config.primary, config.mirror
    if not need_primary:
        pass
    elif not primary.is_dir():
        problems.append(f"primary: {primary} does not exist or is not a directory")
    elif not os.access(primary, os.R_OK | os.X_OK):
        problems.append(f"primary: {primary} is not readable")
    rp, rm = primary.resolve(), mirror.resolve()
    if rp == rm:
        problems.append(f"mirror: {mirror} is the same directory as primary")
    elif rm.is_relative_to(rp):
        problems.append(f"mirror: {mirror} is inside primary {primary}")
    elif rp.is_relative_to(rm):
        problems.append(f"primary: {primary} is inside mirror {mirror}")
    if mirror.exists() and not mirror.is_dir():
        problems.append(f"mirror: {mirror} exists and is not a directory")
    elif mirror.is_dir() and not os.access(mirror, os.W_OK | os.X_OK):
        problems.append(f"mirror: {mirror} is not writable")
    if config.mirror_must_be_mountpoint and not mirror.is_mount():
        problems.append(f"mirror: {mirror} is not a mount point (mirror_must_be_mountpoint = true)")
    return problems


def load_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    check_roots: bool = True,
    need_primary: bool = True,
) -> Config:
    """Build the one Config of this process; raise ConfigError listing every problem at once."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get(ENV_CONFIG_FILE):
        path = Path(environ[ENV_CONFIG_FILE])
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError([f"config: cannot read {path}: {exc.strerror or exc}"]) from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError([f"config: {path} is not valid TOML: {exc}"]) from exc
    data = _deep_merge(data, env_overrides(environ))
    data = _deep_merge(data, overrides or {})
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems = _format_errors(exc)
        if check_roots:
            problems += _root_problems(data, need_primary)
        raise ConfigError(problems) from exc
    if check_roots:
        problems = check_paths(config, need_primary)
        if problems:
            raise ConfigError(problems)
    return config


def _root_problems(data: Mapping[str, Any], need_primary: bool) -> list[str]:
    """Path problems, reported alongside schema problems when the root keys themselves are valid."""
    roots = {k: data[k] for k in ("primary", "mirror", "mirror_must_be_mountpoint") if k in data}
    try:
        return check_paths(Config.model_validate(roots), need_primary)
    except ValidationError:
        return []
