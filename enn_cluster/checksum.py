"""File checksums for commit records and manifests.

CRC32 (zlib, about 4 GB/s here) catches torn writes and bit rot, which is what a commit
record guards against; it is not a defence against tampering.
"""
from __future__ import annotations

import zlib
from pathlib import Path

ALGORITHM = "crc32"
_BLOCK = 8 << 20


class RunningChecksum:
    """Checksum of a stream fed in pieces (staging copies, chunk writes)."""

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)
        self.size += len(memoryview(data).cast("B"))

    def hexdigest(self) -> str:
        return f"{ALGORITHM}:{self.value:08x}"


def file_checksum(path: Path) -> tuple[int, str]:
    """(size, checksum) of a file, read in 8 MiB blocks."""
    running = RunningChecksum()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(_BLOCK)
            if not block:
                break
            running.update(block)
    return running.size, running.hexdigest()


def bytes_checksum(data) -> str:
    running = RunningChecksum()
    running.update(data)
    return running.hexdigest()
