"""Data staging (`enn_cluster.storage.staging.stage_array` from a .npy) vs `shutil.copyfile`, and
prediction collection (`enn_cluster.client.collect`, bench/collect.py) vs a raw concatenation.

Both sides read a source whose pages were evicted (posix_fadvise DONTNEED) and make the
result durable: the baseline is `shutil.copyfile` (sendfile in the kernel) + fsync, as
`stage_array` fsyncs its memmap before the rename. Repeats alternate the order.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from .measure import BenchContext, Result, drop_cache, settle, throughput, timed

MB = 1e6


def _copy_durable(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as fh:
        os.fsync(fh.fileno())


def run(ctx: BenchContext) -> list[Result]:
    return [stage_result(ctx)]


def stage_result(ctx: BenchContext) -> Result:
    import numpy as np

    from enn_cluster.storage.staging import stage_array

    rows = (8 << 10) if ctx.quick else (64 << 10)
    base = ctx.workdir / "staging"
    base.mkdir()
    src = base / "x.npy"
    rng = np.random.default_rng(0)
    np.save(src, rng.standard_normal((rows, 1024), dtype=np.float32))
    nbytes = src.stat().st_size
    ctx.log(f"staging: {nbytes / MB:.0f} MB .npy, {ctx.repeats} repeats")
    raw_s, ours_s = [], []
    for i in range(ctx.repeats):
        raw_dst, ours_dst = base / f"raw-{i}.npy", base / f"staged-{i}.npy"

        def raw() -> None:
            raw_s.append(timed(lambda: _copy_durable(src, raw_dst)))

        def ours() -> None:
            ours_s.append(timed(lambda: stage_array(str(src), ours_dst)))

        for fn in ((raw, ours) if i % 2 == 0 else (ours, raw)):
            drop_cache([src])
            settle()
            fn()
        raw_dst.unlink()
        ours_dst.unlink()
    shutil.rmtree(base)
    return throughput(
        "staging", "staging (stage_array from .npy) vs copyfile", ">=", 0.8, nbytes,
        ("stage_array: copy_file_range + xxh3 of the copied data + fsync + rename", ours_s),
        ("shutil.copyfile + fsync", raw_s),
        f"{nbytes / MB:.0f} MB float32 array; source pages evicted before each side")


def collect_result(ctx: BenchContext) -> Result:
    if importlib.util.find_spec("enn_cluster.client.collect") is None:
        return Result("collect", "collect vs raw concatenation", ">=", 0.8,
                      skipped="not measured (enn_cluster.client.collect not available)")
    from . import collect

    return collect.run(ctx)
