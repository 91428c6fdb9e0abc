"""Start the kernel writing dirty pages to disk while we go on producing more.

A large file written and then fsynced waits at the end for every byte to reach the disk;
asking for write-out of each finished stretch (Linux `sync_file_range` with
SYNC_FILE_RANGE_WRITE, as RocksDB's bytes_per_sync and PostgreSQL's flush_after do) lets
the disk work while the next stretch is serialized, and the closing fsync finds little
left. It only starts write-out: durability still comes from that fsync. Where the call
is missing (not Linux, or a libc without it) this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache
from typing import Optional

SYNC_FILE_RANGE_WRITE = 2
EVERY = 32 << 20  # bytes between requests: large enough to cost nothing per call


@lru_cache(maxsize=1)
def _sync_file_range() -> Optional[ctypes._CFuncPtr]:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = fn.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask for write-out of `length` bytes at `offset` of `fd` (0: to the end of the file)
    without waiting for it. False where the kernel or filesystem cannot (nothing lost)."""
    fn = _sync_file_range()
    return fn is not None and fn(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0


class WritebackTracker:
    """Counts bytes written at the end of a file and starts write-out of each `every`."""

    def __init__(self, every: int = EVERY) -> None:
        self.every, self.requested, self.written = every, 0, 0

    def wrote(self, fd_of, n: int) -> None:
        """`n` more bytes reached the file; `fd_of()` flushes any user-space buffer and
        gives the descriptor (called only when a request is due)."""
        self.written += n
        if self.written - self.requested >= self.every:
            start_writeback(fd_of(), self.requested, self.written - self.requested)
            self.requested = self.written
