"""Prefetching loader: training steps/s with `loader.BatchLoader` gathering the next
micro-batches in a background thread vs the same loop gathering on the training thread
(prefetch=False), same rows, same model, back to back in one process.

On this CPU-only machine the gather and the step compete for 2 cores, so the ratio shows
how much of the random memmap gather the thread hides; on a GPU host the step runs on the
device and the copy on a side stream, and the ratio is the one to watch.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from enn_cluster.worker.loader import BatchLoader, gather_rows
from enn_cluster.worker.sampler import epoch_permutation, micro_batch_rows

from .measure import BenchContext, Result, Series, ratios


def _data(ctx: BenchContext, rows: int, features: int):
    path = ctx.workdir / f"prefetch-x-{rows}x{features}.npy"
    if not path.exists():
        x = np.lib.format.open_memmap(path, "w+", np.float32, (rows, features))
        for start in range(0, rows, 65536):
            stop = min(start + 65536, rows)
            x[start:stop] = np.random.default_rng(start).normal(size=(stop - start, features))
        x.flush()
        del x
    y = np.zeros((rows, 1), np.float32)
    return np.load(path, mmap_mode="r"), y


def steps_per_s(x, y, prefetch: bool, steps: int, micro: int, accum: int) -> float:
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = BatchLoader(lambda rows: gather_rows(x, y, rows, None), torch.device("cpu"),
                         prefetch=prefetch)
    perm = epoch_permutation(len(x), 0, 0)
    per_step = micro * accum

    def rows_of(step):
        consumed = (step * per_step) % (len(x) - per_step)
        return [micro_batch_rows(perm, consumed, 0, 1, micro, k) for k in range(accum)]
    try:
        started = time.perf_counter()
        for step in range(steps):
            for xb, yb in loader.batches(rows_of(step)):
                torch.nn.functional.mse_loss(model(xb), yb).backward()
            loader.prefetch(rows_of(step + 1))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return steps / (time.perf_counter() - started)
    finally:
        loader.close()


def run(ctx: BenchContext) -> list[Result]:
    rows, features = (200_000, 256) if ctx.quick else (1_000_000, 256)
    steps, micro, accum = (20, 1024, 2) if ctx.quick else (60, 2048, 2)
    x, y = _data(ctx, rows, features)
    ours, base = Series("BatchLoader, prefetch", "steps/s"), Series("gather on the loop", "steps/s")
    for i in range(ctx.repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        for prefetch in order:
            (ours if prefetch else base).values.append(
                steps_per_s(x, y, prefetch, steps, micro, accum))
    return [Result("prefetch", "training steps/s with the prefetching loader vs without",
                   samples=ratios(ours.values, base.values), ours=ours, baseline=base,
                   note=f"{rows} x {features} float32 memmap, random rows, {micro} x {accum} "
                        "micro-batches per step; informational on CPU")]
