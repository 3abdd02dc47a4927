"""Starting `mirrord run`: handlers first, then the mirror's lock, roots pinned, the manifest read, and
the Daemon built on them and run."""

from __future__ import annotations

import os
from collections.abc import Callable

from mirrord import __version__
from mirrord.config import Config
from mirrord.core.retention import describe_policy
from mirrord.obs import log as logsetup
from mirrord.service.daemon import Daemon, Volumes
from mirrord.service.signals import SignalFlags
from mirrord.store.targets import mirror_for
from mirrord.store.volume import LocalVolume, exclude_each_other


def run_daemon(
    config: Config, reload_config: Callable[[], tuple[Config, bool]], signals: SignalFlags | None = None
) -> int:
    """Run until SIGTERM/SIGINT (0), or until the mirror lock is lost (1); raises StartupError when it
    cannot start as configured."""
    # Handlers first (cli.main may have installed them even earlier): a signal during start-up (lock,
    # manifest, listener) is recorded and acted on, never fatal.
    signals = (signals or SignalFlags()).install()
    log = logsetup.get_logger()
    try:
        log.info(
            "daemon.starting",
            version=__version__,
            pid=os.getpid(),
            primary=str(config.primary),
            mirror=str(config.mirror_target),
            retention=describe_policy(config.prune, config.retention_mode[0] == "follow"),
        )
        primary, mirror = LocalVolume(config.primary), mirror_for(config.mirror_target, config.s3)
        with mirror.lock():
            exclude_each_other(primary, mirror)  # whatever path leads there (bind mounts)
            daemon = Daemon(config, reload_config, Volumes(primary, mirror, mirror.read_manifest()), signals=signals)
            code = daemon.run()
    finally:
        signals.restore()
    logsetup.get_logger().info("daemon.stopped", copied=daemon.ledger.copied, failed=daemon.ledger.failed)
    return code
