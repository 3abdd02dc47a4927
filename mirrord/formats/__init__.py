"""Checkpoint formats: streaming validators that decide whether a file is a whole checkpoint."""
