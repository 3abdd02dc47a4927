"""Everything the running daemon derives from its config, in one object: a reload builds a new one from
the new config and swaps it whole, so no part can run on half of an old config and half of a new one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mirrord.config import Config
from mirrord.obs.log import get_logger
from mirrord.service.pruner import Pruner
from mirrord.service.retry import RetryPolicy
from mirrord.service.systemd import ping_interval


@dataclass(frozen=True)
class Settings:
    """The config and what follows from it: retries, the watchdog ping period, retention's pruner."""

    config: Config
    retry: RetryPolicy
    ping_every: float  # WATCHDOG=1 period: the heartbeat, or faster if systemd's watchdog needs it
    pruner: Pruner | None  # None when retention is off

    @classmethod
    def derive(
        cls, config: Config, watchdog_seconds: float | None, make_pruner: Callable[[Config], Pruner]
    ) -> Settings:
        """The settings for `config` under a watchdog of `watchdog_seconds` (None: no watchdog); warns when
        the configured heartbeat is too slow for that watchdog."""
        heartbeat = config.daemon.heartbeat_seconds
        every = ping_interval(heartbeat, watchdog_seconds)
        if every < heartbeat:
            get_logger().warning(
                "daemon.heartbeat_slower_than_watchdog",
                heartbeat_seconds=heartbeat,
                watchdog_seconds=watchdog_seconds,
                ping_every_seconds=every,
                hint="lower daemon.heartbeat_seconds below half of the unit's WatchdogSec",
            )
        return cls(
            config,
            RetryPolicy.from_config(config, rescans=True),
            every,
            make_pruner(config) if config.prune.enabled else None,
        )
