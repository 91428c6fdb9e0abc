"""Who a pid is: enough to prove that a pid in `run.lock` is still the launcher that wrote it.

A pid alone names whatever process has it now (or, as -1 or 0, every process the user may
signal). The lock records the launcher's host, boot id, start time (clock ticks since boot)
and a digest of its command line; `cancel` signals a pid only when all of them still agree.
The digest keeps the command line itself (which may name private paths) out of the file.

All of that can be copied from `/proc` of any process into a forged lock. What proves the
pid is *this run's* launcher is that it holds the run's lock file open (run_lock.acquire_lock
keeps the descriptor until release): `/proc/PID/fd` is listed only for the process's owner
and root, and no other process holds that very inode open.
"""
from __future__ import annotations

import hashlib
import os
import socket
from typing import Callable, Optional

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    try:
        with open(_BOOT_ID, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def identity(pid: int) -> Optional[dict]:
    """Start time and command-line digest of a live pid on this host; None when gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            stat = fh.read()
        with open(f"/proc/{int(pid)}/cmdline", "rb") as fh:
            cmdline = fh.read()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the name may hold spaces and parentheses
    return {"start_ticks": int(fields[19]), "cmdline_sha256": hashlib.sha256(cmdline).hexdigest()}


def own_identity() -> dict:
    """What a launcher writes about itself into the lock."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": boot_id(),
            **(identity(os.getpid()) or {})}


def holds_open(pid: int, path) -> bool:
    """Does `pid` hold the file at `path` (the same inode) open? False when we cannot see."""
    try:
        want = os.stat(path)
        fds = os.listdir(f"/proc/{int(pid)}/fd")
    except (OSError, ValueError):
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{int(pid)}/fd/{fd}")  # stat opens nothing: a FIFO is safe
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False


def launcher_problem(owner: dict, host: str, boot: str,
                     identity_of: Callable[[int], Optional[dict]]) -> Optional[str]:
    """Why the lock's pid cannot be proven to be its launcher (None: it is proven).
    'not running' means the recorded process is gone; anything else is a mismatch."""
    pid = owner.get("pid")
    # 1 is a launcher that is a PID namespace's init (a container's entrypoint): proven, as
    # any pid, by its start time and command line (elsewhere, pid 1 is another process)
    if type(pid) is not int or pid < 1:
        return f"its pid {pid!r} is not a launcher's"
    if owner.get("host") != host:
        return f"it ran on host {owner.get('host')!r}, not this host {host!r}"
    if not owner.get("boot_id") or owner.get("boot_id") != boot:
        return "it was written before this host last booted (or records no boot id)"
    now = identity_of(pid)
    if now is None:
        return "not running"
    for key in ("start_ticks", "cmdline_sha256"):
        if owner.get(key) is None or owner.get(key) != now.get(key):
            return f"pid {pid} is now another process ({key.split('_')[0]} differs)"
    return None
