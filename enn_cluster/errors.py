"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input (config, flag, path): the message names the field and the fix."""

    exit_code = 2


class ToolMissing(UserError):
    """An external program (podman, mksquashfs, sbatch, ...) is not installed."""
