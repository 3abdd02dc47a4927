"""mirrord keeps a second, always-trustworthy copy of ML training checkpoints.

An artifact exists only when it is whole; before that it has no final name.
"""

__version__ = "0.1.0"
