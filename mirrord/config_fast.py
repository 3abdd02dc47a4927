"""The configuration of a quick command without pydantic: `latest` and `status` must answer in a blink,
and `sync` is timed whole by the scripts that run it; importing pydantic and building mirrord.config's
models costs more than answering (or than a sync of a few small checkpoints).

`fast_config` reads the same file, MIRRORD_* variables and flags as mirrord.config.explain_config, but
accepts only what it is sure is valid (known keys, the right types, within the models' bounds, checked
by the very functions the models call) and then holds the same values, defaults included. Anything else
(an unknown key, a value pydantic would coerce, inline S3 credentials, a Kubernetes variable to log) is
"unsure": it returns None and the command loads the pydantic Config, so every error message is the
models' own. tests/unit/test_config_fast.py holds the two to the same answers and to the same keys.

This module imports only the standard library (and mirrord.core.layouts for the rules; for an s3:// mirror,
mirrord.store.s3's URL check, which the command imports next anyway).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from mirrord.core.layouts import Layout, layout_for

ENV_PREFIX = "MIRRORD_"
ENV_CONFIG_FILE = "MIRRORD_CONFIG"
MIB = 1024 * 1024
DAY = 86_400.0
MIN_BANDWIDTH = 64 * 1024  # bytes/s: a 1 GB checkpoint still copies in under 5 hours
DEFAULT_PATTERNS = ("*.pt",)
DEFAULT_STEP_PATTERN = r"step_(\d+)"
S3_SCHEME = "s3://"


# --- checks shared with the pydantic models (mirrord.config calls these: one wording, one rule) -----------
def check_step_pattern(value: str) -> str:
    """prune.step_pattern: a regular expression with exactly one group, the step number."""
    try:
        compiled = re.compile(value)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from exc
    if compiled.groups != 1:
        raise ValueError("must contain exactly one capturing group (the step number)")
    return value


def check_host_port(value: str) -> str:
    """metrics.address: HOST:PORT."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9108)")
    return value


def check_bandwidth(value: int) -> int:
    """io.bandwidth_limit: 0 or a rate a copy can finish at."""
    if 0 < value < MIN_BANDWIDTH:
        raise ValueError(f"must be 0 (unlimited) or at least {MIN_BANDWIDTH} bytes/s, got {value}")
    return value


def check_endpoint_url(value: str) -> str:
    """s3.endpoint_url: an http(s):// URL."""
    if not re.match(r"https?://[^/\s]+", value):
        raise ValueError(f"{value!r} is not an http(s):// URL")
    return value


def check_node_name(value: str) -> str:
    """s3.node: "" (this host's name) or a plain name."""
    if value and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", value):
        raise ValueError(f"{value!r}: letters, digits, '.', '_' and '-' only")
    return value


def check_file_name(value: str) -> str:
    """unit.complete_marker: a plain file name."""
    if "/" in value or "\0" in value or value in (".", ".."):
        raise ValueError(f"{value!r} is not a file name (no '/')")
    return value


def split_patterns(value: Any) -> Any:
    """patterns given as one comma-separated string (a variable): a tuple."""
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return value


def check_patterns(value: tuple[str, ...]) -> tuple[str, ...]:
    """patterns: at least one file-name glob, each without '/' and with balanced brackets."""
    if not value:
        raise ValueError("at least one pattern is required (e.g. ['*.pt'])")
    for pattern in value:
        if not pattern.strip() or "/" in pattern or "\0" in pattern:
            raise ValueError(f"{pattern!r} is not a file-name pattern (no '/', not empty)")
        if pattern.count("[") != pattern.count("]"):
            raise ValueError(f"{pattern!r} has unbalanced brackets")
    return value


def layout_problems(layout: str, patterns: tuple[str, ...], step_pattern: str, unit_kind: str,
                    complete_marker: str) -> list[str]:
    """A named layout fixes its patterns, step and unit: a different value set beside it would be
    silently ignored, so it is an error that says which layout to use instead."""
    problems = []
    if layout not in ("torch", "custom"):
        if patterns != DEFAULT_PATTERNS:
            problems.append(f"patterns: layout = {layout!r} names its own checkpoints; "
                            'use layout = "custom" to choose patterns')
        if step_pattern != DEFAULT_STEP_PATTERN:
            problems.append(f"prune.step_pattern: layout = {layout!r} has its own; "
                            'use layout = "custom" to choose one')
    if layout != "custom" and (unit_kind, complete_marker) != ("file", ""):
        problems.append(f'unit: only used with layout = "custom" (layout is {layout!r})')
    if complete_marker and unit_kind != "folder":
        problems.append('unit.complete_marker: a marker file needs unit.kind = "folder"')
    return problems


class Roots(Protocol):
    """What check_paths reads of a configuration (the pydantic Config or a FastConfig)."""

    @property
    def primary(self) -> Path:
        """The primary directory, absolute."""

    @property
    def mirror(self) -> Path:
        """The mirror directory, absolute."""

    @property
    def mirror_must_be_mountpoint(self) -> bool:
        """Whether the mirror must be a mount point."""

    @property
    def mirror_url(self) -> str | None:
        """The s3:// URL, or None for a directory."""


def check_paths(config: Roots, need_primary: bool = True) -> list[str]:
    """Problems with the two roots that make mirroring unsafe or impossible.

    Commands that only read the mirror (verify, latest) pass need_primary=False.
    """
    problems = []
    primary, mirror = config.primary, config.mirror
    if config.mirror_url is not None:
        if need_primary and not primary.is_dir():
            problems.append(f"primary: {primary} does not exist or is not a directory")
        if config.mirror_must_be_mountpoint:
            problems.append("mirror_must_be_mountpoint: means nothing for an s3:// mirror; remove it")
        return problems
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
    elif need_primary:
        from mirrord.store.identity import overlap

        clash = overlap(primary, mirror)  # the same trees under other names (bind mounts)
        if clash:
            problems.append(f"mirror: {clash}")
    if mirror.exists() and not mirror.is_dir():
        problems.append(f"mirror: {mirror} exists and is not a directory")
    if config.mirror_must_be_mountpoint and not mirror.is_mount():
        problems.append(f"mirror: {mirror} is not a mount point (mirror_must_be_mountpoint = true)")
    return problems


# --- what the fast path knows: every key of the models, its kind and its default -------------------------
class UnsureError(Exception):
    """The fast path cannot be sure: the pydantic models decide (and word any error)."""


# dotted key -> (kind, default, bounds, choices or check). Kinds: int, float (finite), bool, choice, str,
# path, patterns, optional_int, optional_str; "refuse" keys (inline credentials: the models warn of them)
# keep their default, any other value is left to the models.
SCHEMA: dict[str, tuple[str, Any, Any]] = {
    "primary": ("path", "/data/checkpoints", None),
    "mirror": ("path", None, None),
    "layout": ("choice", "torch", ("torch", "lightning", "hf", "dcp", "deepspeed", "custom")),
    "patterns": ("patterns", DEFAULT_PATTERNS, None),
    "mirror_must_be_mountpoint": ("bool", False, None),
    "copy.workers": ("int", 2, (1, 64)),
    "copy.hash": ("choice", "blake3", ("blake3", "sha256", "xxh3_128")),
    "copy.settle_seconds": ("float", 2.0, (0, DAY)),
    "copy.stall_seconds": ("float", 120.0, (0.1, DAY)),
    "copy.max_attempts": ("int", 5, (1, 1000)),
    "copy.retry_backoff_seconds": ("float", 1.0, (0, 3600)),
    "copy.retry_backoff_max_seconds": ("float", 60.0, (0, DAY)),
    "copy.free_space_reserve_bytes": ("int", 256 * MIB, (0, None)),
    "copy.invalid_grace_seconds": ("float", 600.0, (0, 7 * DAY)),
    "prune.enabled": ("bool", True, None),
    "prune.keep_last": ("int", 12, (1, None)),
    "prune.keep_every": ("optional_int", None, (1, None)),
    "prune.min_age_seconds": ("float", 300.0, (0, 365 * DAY)),
    "prune.future_skew_seconds": ("float", 60.0, (0, DAY)),
    "prune.primary": ("bool", False, None),
    "prune.dry_run": ("bool", False, None),
    "prune.step_pattern": ("str", DEFAULT_STEP_PATTERN, check_step_pattern),
    "watch.mode": ("choice", "auto", ("auto", "native", "polling")),
    "watch.poll_interval_seconds": ("float", 2.0, (0.1, 3600)),
    "watch.rescan_interval_seconds": ("float", 60.0, (0.1, DAY)),
    "watch.parallel_listing": ("bool", True, None),
    "metrics.enabled": ("bool", True, None),
    "metrics.address": ("str", "127.0.0.1:9108", check_host_port),
    "log.format": ("choice", "auto", ("auto", "json", "console")),
    "log.level": ("choice", "info", ("debug", "info", "warning", "error")),
    "io.buffer_bytes": ("int", 8 * MIB, (64 * 1024, 256 * MIB)),
    "io.bandwidth_limit": ("int", 0, (0, None)),
    "io.drop_cache": ("bool", True, None),
    "io.direct_write": ("bool", False, None),
    "io.ionice": ("choice", "none", ("none", "best-effort", "idle")),
    "io.cpu_nice": ("int", 0, (0, 19)),
    "io.cpu_policy": ("choice", "normal", ("normal", "idle")),
    "daemon.heartbeat_seconds": ("float", 5.0, (0.1, 60)),
    "daemon.shutdown_grace_seconds": ("float", 30.0, (0, 3600)),
    "unit.kind": ("choice", "file", ("file", "folder")),
    "unit.complete_marker": ("str", "", check_file_name),
    "s3.endpoint_url": ("optional_str", None, check_endpoint_url),
    "s3.region": ("optional_str", None, None),
    "s3.addressing_style": ("choice", "auto", ("auto", "path", "virtual")),
    "s3.part_size": ("int", 8 * MIB, (5 * MIB, 5 * 1024 * MIB)),
    "s3.concurrency": ("int", 8, (1, 64)),
    "s3.files_in_flight": ("int", 8, (1, 64)),
    "s3.storage_class": ("optional_str", None, None),
    "s3.sign_payload": ("bool", False, None),
    "s3.lease_seconds": ("float", 120.0, (10, DAY)),
    "s3.node": ("str", "", check_node_name),
    "s3.max_attempts": ("int", 10, (1, 100)),
    "s3.units_span_nodes": ("bool", False, None),
    "s3.allow_inline_credentials": ("refuse", False, None),
    "s3.access_key_id": ("refuse", None, None),
    "s3.secret_access_key": ("refuse", None, None),
}
SECTIONS = ("copy", "prune", "watch", "metrics", "log", "io", "daemon", "unit", "s3")
_EXTRA_CHECKS = {"io.bandwidth_limit": check_bandwidth}
# Kubernetes service variables are ignored by the models' loader and logged: the fast path leaves
# that to it.
_KUBERNETES = re.compile(
    r"MIRRORD_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(ADDR|PORT|PROTO))?)?)"
)
# Text (a variable, a flag) is read only in its plainest spellings; pydantic's other coercions are its own.
_INT_TEXT = re.compile(r"0|[1-9][0-9]{0,17}")
_FLOAT_TEXT = re.compile(r"(0|[1-9][0-9]{0,14})(\.[0-9]{1,15})?")
_BOOL_TEXT = {"true": True, "false": False}


def _value(dotted: str, raw: Any, from_text: bool) -> Any:
    """The value the models would hold for `raw` at `dotted`; Unsure when not certain."""
    kind, _, spec = SCHEMA[dotted]
    if from_text and not isinstance(raw, str) and kind != "patterns":
        raise UnsureError(dotted)
    value: Any
    if kind in ("int", "optional_int"):
        if from_text:
            if not _INT_TEXT.fullmatch(raw):
                raise UnsureError(dotted)
            value = int(raw)
        elif type(raw) is int:
            value = raw
        else:
            raise UnsureError(dotted)
        lo, hi = spec
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise UnsureError(dotted)
    elif kind == "float":
        if from_text:
            if not _FLOAT_TEXT.fullmatch(raw):
                raise UnsureError(dotted)
            value = float(raw)
        elif type(raw) in (int, float):
            value = float(raw)
        else:
            raise UnsureError(dotted)
        lo, hi = spec
        if not math.isfinite(value) or value < lo or value > hi:
            raise UnsureError(dotted)
    elif kind == "bool":
        if from_text:
            if raw not in _BOOL_TEXT:
                raise UnsureError(dotted)
            value = _BOOL_TEXT[raw]
        elif type(raw) is bool:
            value = raw
        else:
            raise UnsureError(dotted)
    elif kind == "choice":
        if type(raw) is not str or raw not in spec:
            raise UnsureError(dotted)
        value = raw
    elif kind in ("str", "optional_str"):
        if type(raw) is not str:
            raise UnsureError(dotted)
        value = raw
        try:
            if spec is not None:
                spec(value)
        except ValueError as exc:
            raise UnsureError(dotted) from exc
    elif kind == "path":
        if type(raw) is not str or not raw.strip() or "\0" in raw:
            raise UnsureError(dotted)  # empty paths: the models decide
        value = _s3_mirror(dotted, raw) if raw.startswith("s3:") else Path(raw).absolute()
    elif kind == "patterns":
        if isinstance(raw, str):
            raw = split_patterns(raw)
        if type(raw) not in (list, tuple) or any(type(p) is not str for p in raw):
            raise UnsureError(dotted)
        value = tuple(raw)
        try:
            check_patterns(value)
        except ValueError as exc:
            raise UnsureError(dotted) from exc
    else:
        raise UnsureError(dotted)
    extra = _EXTRA_CHECKS.get(dotted)
    if extra is not None:
        try:
            extra(value)
        except ValueError as exc:
            raise UnsureError(dotted) from exc
    return value


def _s3_mirror(dotted: str, raw: str) -> Path:
    """An s3:// mirror as the models hold it (a Path, which folds '//': see FastConfig.mirror_url), once the
    models' own check (mirrord.store.s3.S3Location.parse) took it; any other s3: text is theirs."""
    if dotted != "mirror" or not raw.startswith(S3_SCHEME):
        raise UnsureError(dotted)
    from mirrord.store.s3 import S3Location

    try:
        S3Location.parse(raw)
    except ValueError as exc:
        raise UnsureError(dotted) from exc
    return Path(raw)


class FrozenSection:
    """One section's values as attributes, read-only (what the models' sections expose to a command)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{name}: the configuration is frozen")

    def __getattr__(self, name: str) -> Any:  # only for attributes not set: mypy sees Any
        raise AttributeError(name)


class FastConfig(FrozenSection):
    """The effective configuration of a quick command, as mirrord.config.Config would hold it."""

    @property
    def mirror_url(self) -> str | None:
        """The s3:// URL of an object-store mirror (None for a directory), as mirrord.config.Config says."""
        text = str(self.mirror)
        return S3_SCHEME + text.removeprefix("s3:/") if text.startswith("s3:/") else None

    @property
    def mirror_target(self) -> str | Path:
        """What mirrord.store.mirror.mirror_for takes: the s3:// URL, or the directory."""
        mirror: Path = self.mirror
        return self.mirror_url or mirror

    @property
    def copy(self) -> FrozenSection:
        """The [copy] section (stored as copy_, as the models do)."""
        section: FrozenSection = self.copy_
        return section

    @property
    def copy_workers(self) -> int:
        """Copies made at once: copy.workers, or s3.files_in_flight into an object store."""
        workers: int = self.s3.files_in_flight if self.mirror_url else self.copy_.workers
        return workers

    @property
    def rules(self) -> Layout:
        """The chosen layout's naming and completeness rules (mirrord.core.layouts)."""
        return layout_for(self.layout, self.patterns, self.prune.step_pattern, self.unit.kind,
                          self.unit.complete_marker)

    @property
    def step_regex(self) -> re.Pattern[str]:
        """The step-number pattern of the configured layout."""
        return self.rules.step_regex


def _merge(layer: Mapping[str, Any], from_text: bool, values: dict[str, Any]) -> None:
    """Check one layer's keys into `values` (dotted key -> value); later layers override earlier ones."""
    for key, raw in layer.items():
        if key in SECTIONS:
            if not isinstance(raw, Mapping):
                raise UnsureError(key)
            for sub, sub_raw in raw.items():
                dotted = f"{key}.{sub}"
                if dotted not in SCHEMA:
                    raise UnsureError(dotted)
                values[dotted] = _value(dotted, sub_raw, from_text)
        elif key in SCHEMA:
            values[key] = _value(key, raw, from_text)
        else:
            raise UnsureError(key)


def fast_config(path: Path | None, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None, need_primary: bool = True) -> FastConfig | None:
    """The configuration when it is surely valid, roots included; None when the models must decide."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get(ENV_CONFIG_FILE):
        path = Path(environ[ENV_CONFIG_FILE])
    values: dict[str, Any] = {}
    try:
        if path is not None:
            import tomllib  # (a command given its roots by flags or variables reads no file)

            try:
                data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
            except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not TOML: the models word it
                raise UnsureError("config") from exc
            folder = Path(path).absolute().parent
            for key in ("primary", "mirror"):  # relative to the file, as mirrord.config._read_file does
                value = data.get(key)
                if isinstance(value, str) and value.strip() and not Path(value).is_absolute() \
                        and not value.startswith(S3_SCHEME):
                    data[key] = str(folder / value)
            _merge(data, False, values)
        env: dict[str, Any] = {}
        for name in environ:
            if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
                continue
            if _KUBERNETES.fullmatch(name):
                raise UnsureError(name)
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            if dotted not in SCHEMA or name != ENV_PREFIX + dotted.replace(".", "__").upper():
                raise UnsureError(name)
            raw = environ[name]
            if dotted == "patterns" and raw.lstrip().startswith("["):
                try:
                    raw = json.loads(raw)
                except ValueError as exc:
                    raise UnsureError(name) from exc
            env[dotted] = raw
        for dotted, raw in env.items():
            values[dotted] = _value(dotted, raw, True)
        _merge(overrides or {}, False, values)
        if "mirror" not in values:
            raise UnsureError("mirror")
    except UnsureError:
        return None
    full = {k: spec[1] for k, spec in SCHEMA.items()}
    full["primary"] = Path(full["primary"]).absolute()
    full |= values
    if layout_problems(full["layout"], full["patterns"], full["prune.step_pattern"], full["unit.kind"],
                       full["unit.complete_marker"]):
        return None
    if full["s3.units_span_nodes"] and (full["layout"] != "dcp" or not str(full["mirror"]).startswith("s3:/")):
        return None  # the models word why
    top: dict[str, Any] = {k: v for k, v in full.items() if "." not in k}
    for section in SECTIONS:
        fields = {k.partition(".")[2]: v for k, v in full.items() if k.startswith(section + ".")}
        top["copy_" if section == "copy" else section] = FrozenSection(fields)
    config = FastConfig(top)
    if check_paths(config, need_primary):
        return None  # the models' loader reports them, with any other problem
    return config
