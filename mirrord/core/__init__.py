"""The pure core: models, copy and prune planners, retention policies, guards, run branches; no I/O."""
