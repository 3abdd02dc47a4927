"""Configuration: built once from defaults, a TOML file, MIRRORD_* variables and flags; frozen; validated loudly.

Precedence (lowest first): embedded defaults < TOML file < environment < command-line flags.
Nothing is silently corrected: every problem becomes one message that names the key, and says where
the bad value came from (the file, the variable, the flag). `mirror` has no default: copying into a
made-up path on the root disk is worse than refusing to start. Relative paths in a file are relative
to the file's folder; everywhere else to the working directory; the Config holds them absolute.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import time
import tomllib
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mirrord.errors import ConfigError
from mirrord.layouts import Layout, layout_for
from mirrord.paths import S3Location, overlap
from mirrord.trusted import UntrustedFileError, read_trusted

ENV_PREFIX = "MIRRORD_"
ENV_CONFIG_FILE = "MIRRORD_CONFIG"
CONFIG_LIMIT = 1024 * 1024  # a config file is a few KiB; anything past this bound is not one
# Kubernetes gives every pod of a namespace with a Service named `mirrord` these variables
# (MIRRORD_SERVICE_HOST, MIRRORD_SERVICE_PORT[_NAME], MIRRORD_PORT, MIRRORD_PORT_9108_TCP[_ADDR|_PORT|_PROTO]).
# They are not settings: ignored (and logged once) instead of stopping the sidecar as unknown keys.
# Keys a former release knew: an old config that still sets one is refused with what to do instead.
REMOVED_KEYS = {
    "watch.parallel_listing": "the daemon lists the mirror itself",
}
KUBERNETES_SERVICE_VARIABLE = re.compile(
    r"MIRRORD_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(ADDR|PORT|PROTO))?)?)"
)


MIB = 1024 * 1024
DAY = 86_400.0
MIN_BANDWIDTH = 64 * 1024  # bytes/s: a 1 GB checkpoint still copies in under 5 hours
DEFAULT_PATTERNS = ("*.pt",)
DEFAULT_STEP_PATTERN = r"step_(\d+)"
S3_SCHEME = "s3://"


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


def matching(regex: str, what: str) -> AfterValidator:
    """A text field that must match `regex` whole; else "VALUE WHAT" names it."""

    def check(value: str) -> str:
        if not re.fullmatch(regex, value, re.DOTALL):
            raise ValueError(f"{value!r}{what}")
        return value

    return AfterValidator(check)


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


def beside_file(config_file: str | Path, relative: str) -> str:
    """A relative path in a config file, taken from the file's folder; printed as ./var, not ./config/../var
    (the folder is resolved first, so its `..` is the parent the kernel would take)."""
    base, parts = Path(config_file).resolve().parent, Path(relative).parts
    while parts and parts[0] == "..":
        base, parts = base.parent, parts[1:]
    return str(base.joinpath(*parts))


# Whether a command needs the primary root: it must exist (True), it is not used (False), or it may appear
# later (the daemon waits for it).
PrimaryNeed = bool | Literal["later"]


def check_paths(config: Config, need_primary: PrimaryNeed = True) -> list[str]:
    """Problems with the two roots that make mirroring unsafe or impossible.

    Commands that only read the mirror (verify, latest) pass need_primary=False; the daemon passes "later":
    a primary root that does not exist yet (a disk being replaced) is a state it waits out, not an error.
    """
    problems = []
    primary, mirror, local = config.primary, config.mirror, config.mirror_url is None
    if need_primary is True or (need_primary == "later" and local and primary.exists()):
        if not primary.is_dir():
            problems.append(f"primary: {primary} does not exist or is not a directory")
        elif local and not os.access(primary, os.R_OK | os.X_OK):
            problems.append(f"primary: {primary} is not readable")
    if not local:
        if config.mirror_must_be_mountpoint:
            problems.append("mirror_must_be_mountpoint: means nothing for an s3:// mirror; remove it")
        return problems
    rp, rm = primary.resolve(), mirror.resolve()
    if rp == rm:
        problems.append(f"mirror: {mirror} is the same directory as primary")
    elif rm.is_relative_to(rp):
        problems.append(f"mirror: {mirror} is inside primary {primary}")
    elif rp.is_relative_to(rm):
        problems.append(f"primary: {primary} is inside mirror {mirror}")
    elif need_primary and primary.exists():
        clash = overlap(primary, mirror)  # the same trees under other names (bind mounts)
        if clash:
            problems.append(f"mirror: {clash}")
    if mirror.exists() and not mirror.is_dir():
        problems.append(f"mirror: {mirror} exists and is not a directory")
    elif not mirror.exists() and not mirror.parent.is_dir():  # a mistyped path would fill the wrong disk
        problems.append(
            f"mirror: neither {mirror} nor its parent {mirror.parent} exists; mirrord creates only "
            "the mirror folder itself: create the path, or correct it"
        )
    if config.mirror_must_be_mountpoint and not mirror.is_mount():
        problems.append(f"mirror: {mirror} is not a mount point (mirror_must_be_mountpoint = true)")
    return problems


MASK = "********"


class Variable(str):
    """The text of a MIRRORD_* variable: the only place a number or boolean is written as a string."""


class _Section(BaseModel):
    # Every interval and rate is finite and within bounds a real deployment can use: an infinite
    # heartbeat freezes the gauges and the watchdog pings, a nanosecond rescan burns a core and floods the
    # log, a 1 byte/s bandwidth cap never finishes a copy. Errors name the key and the bound.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: Any) -> Any:
        """TOML's `true` is not 1, nor "5" the number 5: a number or boolean key takes only a TOML number or
        boolean, or a MIRRORD_* variable's text (a Variable, which pydantic converts)."""
        annotation = cls.model_fields[info.field_name].annotation
        kinds = {annotation, *typing.get_args(annotation)}
        if isinstance(value, bool) and bool not in kinds:
            raise ValueError(f"{str(value).lower()} is a boolean, not a number: write the number")
        if type(value) is str and kinds & {int, float, bool}:
            kind = "boolean" if bool in kinds else "number"
            raise ValueError(f"{value!r} is a string, not a {kind} (in a TOML file, write it without quotes)")
        return value


class CopyConfig(_Section):
    """[copy]: how many workers, which hash, when a file is settled, when a copy is stalled, retries."""

    workers: int = Field(2, ge=1, le=64)
    hash: Literal["blake3", "sha256", "xxh3_128"] = "blake3"
    settle_seconds: float = Field(2.0, ge=0, le=DAY)
    stall_seconds: float = Field(120.0, ge=0.1, le=DAY)
    max_attempts: int = Field(5, ge=1, le=1000)
    retry_backoff_seconds: float = Field(1.0, ge=0, le=3600)
    retry_backoff_max_seconds: float = Field(60.0, ge=0, le=DAY)
    free_space_reserve_bytes: int = Field(256 * MIB, ge=0)
    small_file_bytes: int = Field(64 * MIB, ge=0)
    invalid_grace_seconds: float = Field(600.0, ge=0, le=7 * DAY)


class PruneConfig(_Section):
    """[prune]: retention (keep_last, keep_every) and its guards (min age, primary side, dry run)."""

    enabled: bool = True
    mode: Literal["auto", "keep_last", "follow"] = "auto"
    keep_last: int = Field(12, ge=1)
    keep_every: int | None = Field(None, ge=1)
    min_age_seconds: float = Field(300.0, ge=0, le=365 * DAY)
    future_skew_seconds: float = Field(60.0, ge=0, le=DAY)
    primary: bool = False
    keep_branch_tips: bool = True
    dry_run: bool = False
    step_pattern: Annotated[str, AfterValidator(check_step_pattern)] = DEFAULT_STEP_PATTERN


class WatchConfig(_Section):
    """[watch]: native or polling events, and the periodic rescan that makes events hints."""

    mode: Literal["auto", "native", "polling"] = "auto"
    poll_interval_seconds: float = Field(2.0, ge=0.1, le=3600)
    rescan_interval_seconds: float = Field(60.0, ge=0.1, le=DAY)


class MetricsConfig(_Section):
    """[metrics]: the address of /metrics, /healthz, /readyz and /status."""

    enabled: bool = True
    address: Annotated[str, AfterValidator(check_host_port)] = "127.0.0.1:9108"
    # false: runs are labelled by a digest of their name, which /metrics then tells no local user (docs/security.md)
    run_names: bool = True

    @property
    def host(self) -> str:
        """The host part of the address (IPv6 without brackets)."""
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        """The port part of the address."""
        return int(self.address.rpartition(":")[2])


class LogConfig(_Section):
    """[log]: JSON lines or console rendering, and the level."""

    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class IoConfig(_Section):
    """[io]: buffer size, bandwidth limit, page-cache dropping, I/O and CPU priority of copies."""

    buffer_bytes: int = Field(8 * MIB, ge=64 * 1024, le=256 * MIB)
    # bytes/s, 0 = no cap: copies are paced from pressure stall information (mirrord.service.pacing); a cap
    # is for a shared network link
    bandwidth_limit: Annotated[int, AfterValidator(check_bandwidth)] = Field(0, ge=0)
    drop_cache: bool = True
    pacing: bool = True  # copies and the scrub back off while others need the device (mirrord.service.pacing)
    ionice: Literal["none", "best-effort", "idle"] = "idle"  # I/O class of copy threads (bfq honours idle)
    cpu_nice: int = Field(0, ge=0, le=19)  # nice value of copy threads (0 = as the daemon)
    cpu_policy: Literal["normal", "idle"] = "idle"  # "idle": SCHED_IDLE copy threads (Linux)


def is_s3_url(value: object) -> bool:
    """`mirror = "s3://bucket/prefix"` selects the object-store mirror (mirrord.store.s3)."""
    return isinstance(value, str) and value.startswith(S3_SCHEME)


class S3Config(_Section):
    """The object-store mirror. Credentials come from the standard chain (AWS_* variables, a profile,
    an instance or pod role), never from this file unless allow_inline_credentials says so."""

    # None: AWS itself; e.g. http://127.0.0.1:8333 for SeaweedFS/MinIO
    endpoint_url: Annotated[str, matching(r"https?://[^/\s]+.*", " is not an http(s):// URL")] | None = None
    region: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    part_size: int = Field(8 * MIB, ge=5 * MIB, le=5 * 1024 * MIB)  # S3's limits for a part
    concurrency: int = Field(8, ge=1, le=64)  # parts in flight, all files together; ranged GETs per object read
    # Files uploaded at once: replaces copy.workers for an object store (an upload mostly waits on the network).
    files_in_flight: int = Field(8, ge=1, le=64)
    storage_class: str | None = None
    # Over plain http, also sign a SHA-256 of every payload byte (over https the payload is never signed:
    # TLS and the CRC32 the server checks). Costs a SHA-256 pass; SeaweedFS does not check it.
    sign_payload: bool = False
    lease_seconds: float = Field(120.0, ge=10, le=DAY)
    # The lease's name; "" = this host's name.
    node: Annotated[str, matching(r"[A-Za-z0-9._-]{0,128}", ": letters, digits, '.', '_' and '-' only")] = ""
    max_attempts: int = Field(10, ge=1, le=100)  # per request, botocore's standard retry mode
    # Every request gives up within this many seconds, retries included (a trainer waiting on `latest`
    # never hangs on an endpoint that accepts and never answers); docs/s3.md.
    timeout_seconds: float = Field(30.0, ge=1, le=3600)
    # DCP folders whose ranks' files are saved on several nodes: each node uploads its share; the unit is
    # complete once the nodes' shares hold every file its .metadata lists (mirrord.core.contributions).
    units_span_nodes: bool = False
    allow_inline_credentials: bool = False  # (before the keys: their check reads it)
    access_key_id: str | None = None
    secret_access_key: str | None = None

    @field_validator("secret_access_key")
    @classmethod
    def _no_inline_secret(cls, value: str | None, info: Any) -> str | None:
        if value is not None and not info.data.get("allow_inline_credentials", False):
            raise ValueError(
                "a secret in the configuration is refused: use the standard credential chain "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, an instance or pod role), "
                "or set s3.allow_inline_credentials = true"
            )
        return value


class DaemonConfig(_Section):
    """[daemon]: the heartbeat period and the shutdown grace period."""

    heartbeat_seconds: float = Field(5.0, ge=0.1, le=60)
    shutdown_grace_seconds: float = Field(30.0, ge=0, le=3600)


class DrillConfig(_Section):
    """[drill]: how often the daemon proves each run's newest checkpoint restores and loads (0: never)."""

    interval_hours: float = Field(24.0, ge=0, le=365 * 24)


class ScrubConfig(_Section):
    """[scrub]: how often the daemon re-reads every copy on the mirror against its recorded hash."""

    # The whole mirror is read once per interval, its bytes spread over it; 0 = off. A fraction is accepted.
    interval_days: float = Field(7.0, ge=0, le=365)
    # An S3 mirror too (every object downloaded again: egress is billed; the store keeps checksums of its own).
    s3: bool = False


class UnitConfig(_Section):
    """What a checkpoint is with layout = "custom" (the named layouts fix it), and how long a folder unit
    with no evidence of its end must be quiet."""

    kind: Literal["file", "folder"] = "file"
    complete_marker: Annotated[str, matching(r"(?!\.\.?\Z)[^/\0]*", " is not a file name (no '/')")] = ""
    # How long a folder unit must be quiet where only a pause can say it is whole (any folder layout).
    settle_seconds: float = Field(30.0, ge=0, le=DAY)


class Config(_Section):
    """mirrord's whole configuration: built once from the file, the environment and flags, then frozen."""

    primary: Path = Path("/data/checkpoints")
    mirror: Path  # no default: a missing mirror is an error, never a silently invented path
    layout: Literal["torch", "lightning", "hf", "hf_model", "accelerate", "dcp", "deepspeed", "megatron", "custom"] = (
        "torch"
    )
    patterns: Annotated[tuple[str, ...], BeforeValidator(split_patterns), AfterValidator(check_patterns)] = (
        DEFAULT_PATTERNS
    )
    mirror_must_be_mountpoint: bool = False
    copy_: CopyConfig = Field(default_factory=CopyConfig, alias="copy")
    prune: PruneConfig = Field(default_factory=PruneConfig)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    io: IoConfig = Field(default_factory=IoConfig)
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    drill: DrillConfig = Field(default_factory=DrillConfig)
    unit: UnitConfig = Field(default_factory=UnitConfig)
    scrub: ScrubConfig = Field(default_factory=ScrubConfig)
    s3: S3Config = Field(default_factory=S3Config)

    model_config = ConfigDict(populate_by_name=True)  # merged with _Section's

    @model_validator(mode="after")
    def _layout_owns_its_names(self) -> Config:
        """A named layout fixes its patterns, step and unit: a different value set beside it would be
        silently ignored, so it is an error that says which layout to use instead."""
        layout, unit, problems = self.layout, self.unit, []
        if layout not in ("torch", "hf_model", "custom"):
            if self.patterns != DEFAULT_PATTERNS:
                problems.append(
                    f'patterns: layout = {layout!r} names its own checkpoints; use layout = "custom" to choose patterns'
                )
            if self.prune.step_pattern != DEFAULT_STEP_PATTERN:
                problems.append(
                    f'prune.step_pattern: layout = {layout!r} has its own; use layout = "custom" to choose one'
                )
        if layout != "custom" and (unit.kind, unit.complete_marker) != ("file", ""):
            problems.append(f'unit: only used with layout = "custom" (layout is {layout!r})')
        if unit.complete_marker and unit.kind != "folder":
            problems.append('unit.complete_marker: a marker file needs unit.kind = "folder"')
        if self.prune.mode == "follow" and self.prune.primary:
            problems.append(
                'prune.primary = true: not with prune.mode = "follow" (the trainer owns its disk and '
                'deletes its own checkpoints; set prune.mode = "keep_last" for mirrord to bound it)'
            )
        mode, why = self.retention_mode
        # Explicit beats implicit: a count the mode in force would silently ignore is an error, not a no-op.
        problems += [
            f'prune.{key}: no effect with prune.mode "follow" ({why}); pick one: remove prune.{key} to keep '
            f'what the trainer keeps, or set prune.mode = "keep_last" for mirrord to keep the newest steps itself'
            for key in ("keep_last", "keep_every")
            if self.prune.enabled and mode == "follow" and key in self.prune.model_fields_set
        ]
        if self.s3.units_span_nodes and (self.layout != "dcp" or self.mirror_url is None):
            problems.append(
                's3.units_span_nodes: only for layout = "dcp" with an s3:// mirror (a DCP folder '
                "whose ranks are saved on several nodes, mirrored into one prefix)"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @field_validator("primary", "mirror", mode="before")
    @classmethod
    def _root_text(cls, value: Any, info: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("must not be empty")
        if info.field_name == "mirror" and is_s3_url(value):
            S3Location.parse(value)  # ValueError: one line naming what is wrong
        return value

    @field_validator("primary", "mirror")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        """Relative to the working directory (a file's relative paths were joined to its folder before).
        An s3:// mirror is kept as it is (see mirror_url)."""
        return value if str(value).startswith("s3:/") else value.absolute()

    @property
    def mirror_target(self) -> str | Path:
        """What mirrord.store.targets.mirror_for takes: the s3:// URL, or the directory."""
        return self.mirror_url or self.mirror

    @property
    def mirror_url(self) -> str | None:
        """The s3:// URL of an object-store mirror (None for a directory). `mirror` holds it as a Path,
        which folds '//' to '/': this is the URL as written."""
        text = str(self.mirror)
        return S3_SCHEME + text.removeprefix("s3:/") if text.startswith("s3:/") else None

    @property
    def copy_workers(self) -> int:
        """Copies made at once: copy.workers, or s3.files_in_flight into an object store (a disk wants few
        writers; an upload mostly waits on the network, so several files go at once)."""
        return self.s3.files_in_flight if self.mirror_url else self.copy.workers

    @property
    def copy(self) -> CopyConfig:  # type: ignore[override]
        """The [copy] section (stored as copy_ so it does not shadow BaseModel.copy)."""
        return self.copy_

    @property
    def step_regex(self) -> re.Pattern[str]:
        """The step-number pattern of the configured layout."""
        return self.rules.step_regex

    @property
    def retention_mode(self) -> tuple[str, str]:
        """The retention mode in force ("keep_last" or "follow") and why, in a sentence for `check-config`."""
        mode = self.prune.mode
        if mode != "auto":
            return mode, f"prune.mode = {mode!r}"
        if self.layout not in ("hf", "lightning"):
            return "keep_last", f"prune.mode = 'auto': layout {self.layout!r} only appends, nothing ranks its steps"
        if self.prune.primary:
            return "keep_last", "prune.mode = 'auto' with prune.primary = true: mirrord bounds the primary itself"
        return "follow", (
            f"prune.mode = 'auto': layout {self.layout!r} rotates or ranks its own checkpoints "
            "(save_total_limit, save_top_k): what it keeps on the primary is its choice"
        )

    @property
    def rules(self) -> Layout:
        """The chosen layout's naming and completeness rules (mirrord.layouts)."""
        return layout_for(
            self.layout, self.patterns, self.prune.step_pattern, self.unit.kind, self.unit.complete_marker
        )

    def to_toml_dict(self) -> dict[str, Any]:
        """The effective configuration as plain data, for `check-config`."""
        data = self.model_dump(mode="json", by_alias=True) | {"mirror": str(self.mirror_target)}
        if data["s3"]["secret_access_key"] is not None:  # never printed, not even when allowed inline
            data["s3"]["secret_access_key"] = MASK
        return data


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, a section merged key by key into the same section of `base`."""
    return base | {
        key: _deep_merge(base[key], value) if isinstance(value, Mapping) and isinstance(base.get(key), dict) else value
        for key, value in extra.items()
    }


# Where a value came from, as check-config prints it: "default", "file PATH", "environment NAME", "flag --NAME".
DEFAULT = "default"


def _suffix(origin: str) -> str:
    """For an error message: where to go and fix the value."""
    kind, _, detail = origin.partition(" ")
    return f" ({'in' if kind == 'file' else 'from'} {detail})" if detail else ""


@dataclass
class _Layer:
    """One source of settings: nested data plus the origin of each dotted key in it."""

    data: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _settings() -> dict[str, Any]:
    """Every dotted key a user can set, with its annotation."""
    keys: dict[str, Any] = {}
    for name, f in Config.model_fields.items():
        key, section = f.alias or name, f.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            keys |= {f"{key}.{sub}": sf.annotation for sub, sf in section.model_fields.items()}
        else:
            keys[key] = f.annotation
    return keys


def env_name(dotted: str) -> str:
    """copy.workers -> MIRRORD_COPY__WORKERS."""
    return ENV_PREFIX + dotted.replace(".", "__").upper()


def _closest(name: str, candidates: list[str]) -> str | None:
    same_letters = [c for c in candidates if c.replace("_", "") == name.replace("_", "")]  # a missing or extra _
    found = same_letters or difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


def read_environment(environ: Mapping[str, str]) -> _Layer:
    """MIRRORD_KEY and MIRRORD_SECTION__KEY variables as nested config data.

    Values stay strings for pydantic to coerce (MIRRORD_MIRROR=2024 is a folder named 2024); only a
    list-typed key given as a JSON list ('["*.pt","*.ckpt"]') is decoded. Unknown names are problems
    that name the variable and suggest the closest one; Kubernetes service variables are set aside in
    `ignored`.
    """
    layer, settings = _Layer(), _settings()
    known = {env_name(k): k for k in settings}
    removed = {env_name(k): k for k in REMOVED_KEYS}
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX) and n != ENV_CONFIG_FILE):
        raw, dotted = environ[name], known.get(name)
        if KUBERNETES_SERVICE_VARIABLE.fullmatch(name):
            layer.ignored.append(name)
        elif name in removed:
            old = removed[name]
            layer.problems.append(f"{name}: {old} was removed ({REMOVED_KEYS[old]}); unset the variable")
        elif dotted is None:
            hint = _closest(name, sorted(known))
            layer.problems.append(
                f"{name}: unknown setting"
                + (
                    f"; did you mean {hint} ({known[hint]})?"
                    if hint
                    else f"; settings are {ENV_PREFIX}<KEY> or {ENV_PREFIX}<SECTION>__<KEY>, see check-config"
                )
            )
        else:
            # A list-typed key (patterns) may be given as a JSON list, else comma-separated; the rest as the string.
            structured = typing.get_origin(settings[dotted]) in (list, tuple) and raw.lstrip().startswith("[")
            try:
                value = json.loads(raw) if structured else raw
            except ValueError as exc:
                layer.problems.append(f"{dotted}: {name} is not valid JSON ({exc}); e.g. {name}='[\"*.pt\"]'")
                continue
            value = Variable(value) if isinstance(value, str) else value
            section, _, key = dotted.rpartition(".")
            (layer.data.setdefault(section, {}) if section else layer.data)[key] = value
            layer.origins[dotted] = f"environment {name}"
    return layer


def _read_file(path: Path, content: bytes | None = None) -> _Layer:
    """The file's layer; `content`, when given, is its bytes as already read (see read_stable)."""
    try:
        raw = read_trusted(path, CONFIG_LIMIT, follow=True)[1] if content is None else content
        data = tomllib.loads(raw.decode("utf-8"))
    except UntrustedFileError as exc:
        if Path(path).is_dir():
            raise ConfigError([f"config: {path} is a directory: name the TOML file itself"]) from exc
        raise ConfigError(
            [f"config: {exc}: another user could change what this daemon does (chown root and chmod go-w it)"]
        ) from exc
    except OSError as exc:
        raise ConfigError([f"config: cannot read {path}: {exc.strerror or exc}"]) from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"config: {path} is not valid TOML: {exc}"]) from exc
    for key in ("primary", "mirror"):  # relative to the file, not to wherever the command happens to run
        value = data.get(key)
        if isinstance(value, str) and value.strip() and not Path(value).is_absolute() and not is_s3_url(value):
            data[key] = beside_file(path, value)
    origin = f"file {Path(path).absolute()}"
    return _Layer(data, {k: origin for k in _dotted_keys(data)})


def _dotted_keys(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        yield prefix + key
        if isinstance(value, Mapping):
            yield from _dotted_keys(value, f"{prefix}{key}.")


def _format_errors(exc: ValidationError, origins: Mapping[str, str]) -> list[str]:
    problems = []
    settings = _settings()
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        origin = origins.get(key, DEFAULT)
        if err["type"] == "extra_forbidden" and key in REMOVED_KEYS:
            problems.append(f"{key}: removed ({REMOVED_KEYS[key]}){_suffix(origin)}; delete the key")
        elif err["type"] == "extra_forbidden":
            depth = key.count(".")  # names at that depth, sections included (`[prun]` -> prune)
            names = {".".join(k.split(".")[: depth + 1]) for k in settings if k.count(".") >= depth}
            hint = _closest(key, sorted(names))
            section, _, name = key.rpartition(".")
            if section and name in settings and origin.startswith("file "):
                problems.append(
                    f"{key}: unknown key{_suffix(origin)}; {name} is a top-level key: put it above "
                    f"the file's first [section] (below [{section}] it is read as part of it)"
                )
                continue
            problems.append(f"{key}: unknown key{_suffix(origin)}" + (f"; did you mean {hint}?" if hint else ""))
        elif err["type"] == "missing" and key == "mirror":
            problems.append(
                "mirror: not set (there is no default); give --mirror DIR, MIRRORD_MIRROR=DIR "
                'or mirror = "DIR" in the config file'
            )
        elif key == "(root)":  # whole-config rules: each problem already starts with its key
            for problem in err["msg"].removeprefix("Value error, ").split("\n"):
                named = problem.split(":", 1)[0]
                problems.append(problem + _suffix(origins.get(named, DEFAULT)))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            where = _suffix(origin)
            if origin.startswith("environment ") and isinstance(err["input"], str):
                shown = MASK if key == "s3.secret_access_key" else repr(err["input"])
                where = f" (from {origin.partition(' ')[2]}={shown})"
            problems.append(f"{key}: {msg}{where}")
    return problems


@dataclass(frozen=True)
class LoadedConfig:
    """The Config, plus what `check-config` and the start-up log tell a person about it."""

    config: Config
    file: Path | None
    origins: Mapping[str, str]  # dotted key -> where its value came from (absent: default)
    ignored_environment: tuple[str, ...]  # Kubernetes service variables, not settings

    def origin(self, dotted: str) -> str:
        """Where the value of `dotted` came from (default, file, environment or flag)."""
        return self.origins.get(dotted, DEFAULT)


def explain_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    check_roots: bool = True,
    need_primary: PrimaryNeed = True,
    content: bytes | None = None,
) -> LoadedConfig:
    """load_config, also saying where each value came from. `overrides` are the command-line flags."""
    environ = os.environ if environ is None else environ
    path = config_path(path, environ)
    layers = [_read_file(path, content)] if path is not None else []
    env = read_environment(environ)
    flags = dict(overrides or {})  # --primary, --mirror, --log-level, --log-format: spelled from the key
    layers += [env, _Layer(flags, {k: "flag --" + k.replace(".", "-").replace("_", "-") for k in _dotted_keys(flags)})]
    data: dict[str, Any] = functools.reduce(_deep_merge, (layer.data for layer in layers), {})
    origins = {key: origin for layer in layers for key, origin in layer.origins.items()}  # the last layer wins
    problems = list(env.problems)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems += _format_errors(exc, origins) + (_root_problems(data, need_primary) if check_roots else [])
        raise ConfigError(problems) from exc
    if check_roots:
        problems += check_paths(config, need_primary)
    if problems:
        raise ConfigError(problems)
    file = Path(path).absolute() if path is not None else None
    return LoadedConfig(config, file, origins, tuple(env.ignored))


def load_config(*args: Any, **kwargs: Any) -> Config:
    """Build the one Config of this process (explain_config's arguments); raise ConfigError listing every
    problem at once."""
    return explain_config(*args, **kwargs).config


def _root_problems(data: Mapping[str, Any], need_primary: PrimaryNeed) -> list[str]:
    """Path problems, reported alongside schema problems when the root keys themselves are valid."""
    roots = {k: data[k] for k in ("primary", "mirror", "mirror_must_be_mountpoint") if k in data}
    try:
        return check_paths(Config.model_validate(roots), need_primary)
    except ValidationError:
        return []


def config_path(path: Path | None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The config file in use: --config, else $MIRRORD_CONFIG, else none."""
    named = (os.environ if environ is None else environ).get(ENV_CONFIG_FILE)
    return Path(named) if path is None and named else path


def read_stable(
    path: Path,
    quiet: float = 1.0,
    timeout: float = 5.0,
    pause: float = 0.1,
    *,
    sleep: Callable[[float], object] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> tuple[bytes, bool]:
    """The file's bytes, and whether they were stable: unchanged (inode, size, mtime, content) across
    reads for `quiet` seconds of our own (monotonic) observation; gives up after `timeout` seconds.
    Reads are `pause` apart; `sleep` and `monotonic` are the clock (a test's clock moves when it says).

    An editor or a script writing the file in place can be caught half-way by a SIGHUP. A file that
    was written to a temp name and renamed into place (what config-management tools do) is whole.
    The file's mtime is not trusted to say how old it is: a clock step would make a fresh file look old.
    """
    started = monotonic()
    previous, unchanged_since = _read_with_stat(path), started
    while True:
        sleep(pause)
        current, now = _read_with_stat(path), monotonic()
        if current != previous:
            previous, unchanged_since = current, now
        elif now - unchanged_since >= quiet:
            return current[-1], True
        if now - started >= timeout:
            return current[-1], False


def _read_with_stat(path: Path) -> tuple[int, int, int, bytes]:
    st, data = read_trusted(path, CONFIG_LIMIT, follow=True)
    return st.st_ino, st.st_size, st.st_mtime_ns, data


def reload_config(
    path: Path | None, overrides: Mapping[str, Any] | None = None, need_primary: PrimaryNeed = True
) -> tuple[Config, bool]:
    """For SIGHUP: (the new Config, whether the file was stable while it was read)."""
    path, content, stable = config_path(path), None, True
    try:
        if path is not None:
            content, stable = read_stable(path)
    except UntrustedFileError:
        pass  # _read_file says why
    except OSError as exc:
        raise ConfigError([f"config: cannot read {path}: {exc.strerror or exc}"]) from exc
    return load_config(path, overrides=overrides, need_primary=need_primary, content=content), stable


def risky_changes(old: Config, new: Config) -> list[str]:
    """Changes that make retention delete more or sooner: applied only from a stable read."""
    a, b = old.prune, new.prune
    checks = [
        (b.enabled and not a.enabled, "prune.enabled turned on"),
        (a.dry_run and not b.dry_run, "prune.dry_run turned off"),
        (b.primary and not a.primary, "prune.primary turned on"),
        (b.keep_last < a.keep_last, f"prune.keep_last lowered from {a.keep_last} to {b.keep_last}"),
        (
            a.keep_every is not None and b.keep_every != a.keep_every,
            f"prune.keep_every changed from {a.keep_every} to {b.keep_every}",
        ),
        (
            b.min_age_seconds < a.min_age_seconds,
            f"prune.min_age_seconds lowered from {a.min_age_seconds:g} to {b.min_age_seconds:g}",
        ),
        (b.step_pattern != a.step_pattern, "prune.step_pattern changed"),
    ]
    return [change for risky, change in checks if risky]
