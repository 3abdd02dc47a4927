"""Observability: Prometheus metrics, structured logs, human-readable sizes."""
