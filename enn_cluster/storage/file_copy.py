"""Copying between open files inside the kernel: no user-space buffer, no second copy.

copy_file_range where the filesystem allows it (reflinks on some), sendfile otherwise
(across filesystems). Used to stage local .npy inputs and to assemble prediction chunks.
Linux only.
"""
from __future__ import annotations

import errno
import os
from typing import Callable, Optional

BLOCK = 16 << 20  # per call: progress and checksumming follow the copy in these steps

_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _copy_block(src: int, dst: int, src_off: int, dst_off: int, count: int) -> int:
    try:
        return os.copy_file_range(src, dst, count, src_off, dst_off)
    except OSError as exc:  # e.g. across file systems: sendfile copies in the kernel too
        if exc.errno not in _NO_COPY_RANGE:
            raise
    os.lseek(dst, dst_off, os.SEEK_SET)
    return os.sendfile(dst, src, src_off, count)


def kernel_copy(src: int, dst: int, src_off: int, dst_off: int, count: int,
                on_block: Optional[Callable[[int, int], None]] = None) -> int:
    """Copy up to `count` bytes between open files in the kernel (copy_file_range, or
    sendfile), in blocks; `on_block(pos, n)` sees each block after it lands. Returns the
    bytes copied: fewer where the source ends early."""
    pos = 0
    while pos < count:
        n = _copy_block(src, dst, src_off + pos, dst_off + pos, min(BLOCK, count - pos))
        if not n:
            break
        if on_block is not None:
            on_block(pos, n)
        pos += n
    return pos
