"""`enn-submit predict` and `enn-submit collect` (placeholder until prediction lands)."""


def register(sub, add_shape_flags, commands) -> None:
    """Add the prediction subcommands to the parser and their handlers to `commands`."""
