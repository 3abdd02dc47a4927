"""The subcommands behind `mirrord`, one module each, plus what they share for output."""
