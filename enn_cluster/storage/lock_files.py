"""Taking the run lock over, and holding it: the file-level moves, apart from the judging.

A lock judged stale is removed by renaming it aside, never by a blind unlink: between the
judging and the unlink a racing client may have put its fresh claim there. The holder keeps
the lock's descriptor open while it holds it (`hold`); `cancel` takes an open descriptor on
that very file for the proof that a pid is this run's launcher (process_identity.holds_open).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

_HELD: dict = {}  # lock path -> the descriptor this process keeps open while it holds it


def hold(lock_path: Path, fd: int) -> None:
    close_held(lock_path)
    _HELD[str(lock_path)] = fd


def close_held(lock_path: Path) -> None:
    fd = _HELD.pop(str(lock_path), None)
    if fd is not None:
        os.close(fd)


def take_aside(lock_path: Path, judged: dict) -> bool:
    """Remove the lock judged stale, and only that one: rename it aside (of two takers, one
    rename wins; the other finds nothing), then look at what was moved. A fresh claim that
    replaced the stale lock in between is linked back (never over another) and kept."""
    aside = lock_path.with_name(f".{lock_path.name}.stale-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(lock_path, aside)
    except FileNotFoundError:
        return False
    try:
        moved = json.loads(aside.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        moved = None
    if moved == judged:
        aside.unlink(missing_ok=True)
        return True
    try:
        os.link(aside, lock_path)
    except OSError:
        pass  # a third claim took the path meanwhile: it holds the lock now
    aside.unlink(missing_ok=True)
    return False
