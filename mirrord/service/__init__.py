"""The daemon's life: the lifecycle shell and its collaborators, workers, watcher, copier, systemd, endpoints."""
