"""mirrord's benchmark suite (not part of the installed package). Run `python -m bench --help`."""
