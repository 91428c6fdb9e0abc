"""Striping of a new run's `checkpoints/` on Lustre (checkpoint.lustre_stripe_count).

Why: a directory made on Lustre gets the filesystem's default layout, usually one stripe,
so each DCP shard file (gigabytes per rank at 8B-70B) lands on one OST and a save runs at
one OST's bandwidth. Files inherit their directory's layout, so setting it once on the
empty `checkpoints/` when the run is made stripes every later checkpoint. It is set where
the run directory is made (the client, on a login node that mounts Lustre with its `lfs`
tool), not in the workers (images rarely hold `lfs`). Elsewhere nothing happens: no `lfs`
on PATH, or `lfs getstripe` refusing the directory, means it is not on Lustre. A refusal
of `setstripe` (quota, permissions) leaves the default layout and says so; it never stops
the run.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional

LFS_TIMEOUT_S = 30  # a hung Lustre client must not hang the submit


def stripe_command(directory: Path, count: int) -> Optional[list[str]]:
    """The `lfs setstripe` argv for `count` stripes (-1: every OST), or None for 0 (the
    filesystem's default is kept). Pure."""
    if count == 0:
        return None
    return ["lfs", "setstripe", "-c", str(count), "--", str(directory)]


def stripe_new_directory(directory: Path, count: int) -> Optional[str]:
    """Set `count` stripes on the empty `directory` when it is on Lustre; the line to show
    the user (None: nothing was asked, or not Lustre here)."""
    argv = stripe_command(directory, count)
    lfs = shutil.which("lfs")
    if argv is None or lfs is None:
        return None
    argv[0] = lfs
    try:
        on_lustre = subprocess.run([lfs, "getstripe", "-d", "--", str(directory)],
                                   capture_output=True, timeout=LFS_TIMEOUT_S).returncode == 0
        if not on_lustre:
            return None
        res = subprocess.run(argv, capture_output=True, text=True, timeout=LFS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"checkpoints/ keeps Lustre's default layout: lfs did not answer ({exc})"
    if res.returncode != 0:
        said = (res.stderr.strip().splitlines() or ["no message"])[-1][:160]
        return f"checkpoints/ keeps Lustre's default layout: lfs setstripe failed ({said})"
    osts = "every OST" if count == -1 else f"{count} OSTs"
    return f"checkpoints/ striped over {osts} (Lustre; checkpoint.lustre_stripe_count)"
