"""Writing one staged memmap, durably and checksummed, and the data manifest beside it.

`write_memmap` is the one way a staged array reaches RUN/data: the new .npy under a
temporary name with its blocks claimed first (a full disk fails in one line, not SIGBUS),
filled by the caller while a running checksum follows, fsynced, renamed. Array staging
(`storage.staging`) and text staging (`storage.text_staging`) both write through it, so
every manifest entry has the same form.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Callable, Optional, TextIO

import numpy as np

from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import RunningChecksum
from enn_cluster.storage.rundir import atomic_write_text, fsync_dir

MANIFEST = "manifest.json"


def progress_bar(label: str, nbytes: int, stream: Optional[TextIO]):
    """A one-line byte counter on a terminal (tqdm); silent in logs, CI and captured
    output, so that an error after it is still the only line."""
    from tqdm import tqdm

    return tqdm(total=max(int(nbytes), 0), desc=label, file=stream, unit="B", unit_scale=True,
                unit_divisor=1024, mininterval=0.25, leave=True,
                disable=not getattr(stream, "isatty", lambda: False)(),
                bar_format="{desc} [{bar:24}] {percentage:5.1f}% {n_fmt}/{total_fmt} {rate_fmt}")


class _Tracked(RunningChecksum):
    """A running checksum that also moves a progress bar."""

    def __init__(self, bar) -> None:
        super().__init__()
        self.bar = bar

    def update(self, data) -> None:
        super().update(data)
        if self.bar is not None:
            self.bar.update(len(memoryview(data).cast("B")))


def write_memmap(dest: Path, shape: tuple, dtype: np.dtype,
                  fill: Callable[[np.memmap, RunningChecksum], None],
                  progress: Optional[TextIO] = None) -> dict:
    """`fill(out, running)` writes the data into `out` (the new .npy under a temporary
    name) and checksums it; then fsync and rename to `dest`."""
    if dtype.hasobject:
        raise UserError(f"{dest.name}: object arrays cannot be staged; convert to a numeric dtype")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    bar = progress_bar(f"stage {dest.stem}", nbytes, progress) if progress else None
    running = _Tracked(bar)
    try:
        out = _reserved_memmap(tmp, dest, shape, dtype)
        if out.size:
            fill(out, running)
        if bar is not None:
            bar.close()
        out.flush()
        del out
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"file": dest.name, "shape": list(shape), "dtype": dtype.str,
            "checksum": running.hexdigest(), "nbytes": running.size}


_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _reserved_memmap(tmp: Path, dest: Path, shape: tuple, dtype: np.dtype) -> np.memmap:
    """A new .npy memmap whose blocks are claimed first (posix_fallocate): a full
    filesystem fails here with a message, where a write through the map would die of SIGBUS."""
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        with open(tmp, "rb+") as fh:
            size = os.fstat(fh.fileno()).st_size
            try:
                os.posix_fallocate(fh.fileno(), 0, size)
            except OSError as exc:
                if exc.errno not in _NO_FALLOCATE:
                    raise
                st = os.statvfs(tmp)
                if st.f_bavail * st.f_frsize < size:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
        return out
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        raise UserError(f"runs_root: no space left in {dest.parent} for {dest.name} "
                        f"({int(np.prod(shape, dtype=np.int64)) * dtype.itemsize} bytes); "
                        "free space there or use a runs_root with room") from None


def held_out_rows(n: int, eval_fraction: float, has_eval: bool) -> dict:
    """train_rows and eval_rows of the manifest: without an eval file, the last
    `eval_fraction` of the rows are held out for evaluation."""
    held = int(n * eval_fraction) if not has_eval else 0
    return {"train_rows": [0, n - held], "eval_rows": [n - held, n] if held else None}


def write_manifest(data_dir: Path, manifest: dict) -> None:
    atomic_write_text(data_dir / MANIFEST, json.dumps(manifest, indent=1))
    fsync_dir(data_dir)
