"""Where a command may write a file the user named (`collect --out`, `plot --out`): checked
before anything is made, so that a bad target is one line, not a traceback after the work,
and nothing is left behind."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from enn_cluster.errors import UserError

PSEUDO_FS = ("/proc", "/sys", "/dev")  # kernel views: never a place for results
MAX_NAME_BYTES = 200  # NAME_MAX is 255: room for the temporary name written beside it


def check_local_target(flag: str, path: str, overwrite: bool) -> None:
    """A local output path: not under /proc, /sys or /dev; an existing target is a regular
    file (and only with overwrite); the nearest existing parent is a writable directory."""
    target = Path(os.path.abspath(os.path.expanduser(path)))
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in target.parts)
    if longest > MAX_NAME_BYTES or len(str(target).encode("utf-8", "surrogateescape")) > 4000:
        raise UserError(f"{flag}: {path[:80]}... is too long a path (a name of {longest} bytes; "
                        f"keep each name under {MAX_NAME_BYTES} bytes)")
    real = Path(os.path.realpath(target))
    if any(str(p) == root or str(p).startswith(root + "/") for p in (target, real)
           for root in PSEUDO_FS):
        raise UserError(f"{flag}: {path} is under {'/'.join(real.parts[:2]) or '/'} (a kernel "
                        "file system); write to a directory of your own")
    if os.path.lexists(target):
        st = os.stat(target) if os.path.exists(target) else os.lstat(target)
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"{flag}: {path} is a directory; name a file in it")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{flag}: {path} is not a regular file (a device, pipe or dangling "
                            "link); name a regular file")
        if not overwrite:
            raise UserError(f"{flag}: {path} exists; choose another path or pass --overwrite")
    parent = target.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag}: {parent} is not a directory, so {path} cannot be made; "
                        "choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag}: {parent} is not writable; choose another path")
