"""Reading a file of a run directory as untrusted input: one function for every reader.

A run directory is shared and writable by a job, often by a group, so any of its files
may have been replaced by a FIFO (a plain open blocks for ever), a symlink to `/dev/zero`
(a read never ends), a directory, a symlink loop or a symlink out of the run. Every reader
of a run file opens it here: `O_NONBLOCK | O_NOFOLLOW` (a FIFO opens without waiting, a
symlink is refused), `fstat` must say a regular file, and what is read is capped.
A missing file stays FileNotFoundError: each caller knows what absence means.
"""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Optional, TextIO

from enn_cluster.errors import UserError

RECORD_LIMIT = 16 << 20  # config.yaml, run.lock, commit.json, manifests, request.json
LOG_LIMIT = 1 << 30  # metrics.jsonl and jobs.jsonl grow with the run
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def _refusal(field: str, path: Path, what: str) -> UserError:
    return UserError(f"{field}: {path} is {what}, not a regular file of this run; replace it "
                     "with the file the run wrote (or remove it)")


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words (pure)."""
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


@contextmanager
def open_run_file(path, field: Optional[str] = None) -> Iterator[BinaryIO]:
    """The file at `path`, opened for binary reading once it is known to be a regular
    file reached without a final symlink. UserError (naming `field`, else the file's
    name) for anything else; FileNotFoundError when it is missing."""
    path = Path(path)
    field = field or path.name
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if path.is_symlink():
            raise _refusal(field, path, "a symbolic link") from None
        raise UserError(f"{field}: cannot open {path} ({exc.strerror or exc}); fix its "
                        "permissions or restore it") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refusal(field, path, kind_of(mode))
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh


def append_run_file(path, field: Optional[str] = None) -> TextIO:
    """A run file opened to append text (created if missing): the writer's side of the same
    rule, so a FIFO there (an open for writing waits for a reader) or a symlink out of the
    run is refused by name instead of blocking the job or writing elsewhere."""
    path = Path(path)
    field = field or path.name
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as exc:
        if path.is_symlink():
            raise _refusal(field, path, "a symbolic link") from None
        what = kind_of(os.stat(path).st_mode) if os.path.exists(path) else None
        if what is not None:  # a FIFO without a reader (ENXIO), a directory (EISDIR)
            raise _refusal(field, path, what) from None
        raise UserError(f"{field}: cannot open {path} ({exc.strerror or exc}); fix its "
                        "permissions") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refusal(field, path, kind_of(mode))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def check_run_file(path, field: Optional[str] = None) -> None:
    """Absent, or a regular file reached without a final symlink (nothing is opened)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{field or path.name}: cannot look at {path} ({exc.strerror}); "
                        "restore it") from None
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else kind_of(mode)
        raise _refusal(field or path.name, path, what)


def read_run_bytes(path, limit: int = RECORD_LIMIT, field: Optional[str] = None) -> bytes:
    """All of a run file, refused (UserError) when it is not a regular file or is larger
    than `limit` bytes."""
    path = Path(path)
    field = field or path.name
    with open_run_file(path, field) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise UserError(f"{field}: {path} is {size} bytes, more than the {limit} such a "
                            "file can hold; restore the file the run wrote")
        return _read_at_most(fh, size)


def _read_at_most(fh: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes (what fstat said: a file appended to meanwhile is read as it was)."""
    parts, left = [], n
    while left > 0:
        part = fh.read(min(left, 8 << 20))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_run_text(path, limit: int = RECORD_LIMIT, field: Optional[str] = None) -> str:
    """A run file as UTF-8 text (UnicodeDecodeError as str.decode raises it)."""
    return read_run_bytes(path, limit, field).decode("utf-8")


def inside_run(path, root) -> bool:
    """Whether `path`, with every symlink resolved, still lies under `root` (resolved)."""
    try:
        Path(path).resolve(strict=True).relative_to(Path(root).resolve(strict=True))
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, elsewhere
        return False
    return True
