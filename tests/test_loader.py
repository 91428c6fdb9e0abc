"""The prefetching loader returns exactly the batches a synchronous gather gives, in the
trainer's row order (sampler.micro_batch_rows over epoch permutations), whatever was
prefetched ahead, right or wrong. Real memmaps on disk, a real background thread."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from enn_cluster.worker.loader import BatchLoader, gather_rows
from enn_cluster.worker.sampler import (DataPosition, advance, epoch_permutation, micro_batch_rows)


def _reference_batch(x, y, rows, scaler):
    """Trainer._batch as it was before the loader (host side), written out again."""
    xb = torch.from_numpy(np.ascontiguousarray(x[np.asarray(rows)], dtype=np.float32))
    yb = np.asarray(y[np.asarray(rows)])
    if scaler is not None:
        yb = (yb.astype(np.float32) - scaler["mean"]) / scaler["std"]
    return xb, torch.from_numpy(np.ascontiguousarray(yb))


@pytest.fixture
def arrays(tmp_path):
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.float64, (1000, 6))
    x[:] = rng.normal(size=x.shape)
    y = np.lib.format.open_memmap(tmp_path / "y.npy", "w+", np.float32, (1000, 2))
    y[:] = rng.normal(size=y.shape)
    x.flush(), y.flush()
    return (np.load(tmp_path / "x.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r"))


def _steps(n_rows, offset, rank, dp, micro, accum, seed, steps):
    """The trainer's rows, step by step, across epochs: (epoch, rows of each micro-batch)."""
    pos, out = DataPosition(), []
    for _ in range(steps):
        perm = epoch_permutation(n_rows, seed, pos.epoch)
        out.append((pos.epoch, [micro_batch_rows(perm, pos.consumed, rank, dp, micro, k) + offset
                                for k in range(accum)]))
        pos = advance(pos, n_rows, micro * accum * dp)
    return out


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_batches_equal_todays_gather_in_order(arrays, scaled, prefetch):
    x, y = arrays
    scaler = ({"mean": np.float32([0.5, -1.0]), "std": np.float32([2.0, 0.5])}
              if scaled else None)
    loader = BatchLoader(lambda rows: gather_rows(x, y, rows, scaler), torch.device("cpu"),
                         prefetch=prefetch)
    steps = _steps(900, 50, rank=1, dp=2, micro=16, accum=3, seed=7, steps=25)  # 2+ epochs
    try:
        for i, (epoch, rows_list) in enumerate(steps):
            got = list(loader.batches(rows_list))
            assert len(got) == len(rows_list)
            for (xb, yb), rows in zip(got, rows_list):
                rx, ry = _reference_batch(x, y, rows, scaler)
                assert xb.dtype == torch.float32 and torch.equal(xb, rx) and torch.equal(yb, ry)
            if i + 1 < len(steps):
                nxt_epoch, nxt = steps[i + 1]
                # the trainer prefetches only within an epoch; a wrong guess must not matter
                guess = nxt if nxt_epoch == epoch else [r[::-1] for r in rows_list]
                loader.prefetch(guess)
    finally:
        loader.close()


def test_wrong_and_partial_prefetches_are_dropped(arrays):
    x, y = arrays
    loader = BatchLoader(lambda rows: gather_rows(x, y, rows, None), torch.device("cpu"))
    try:
        a, b, c = np.arange(0, 8), np.arange(8, 16), np.arange(16, 24)
        loader.prefetch([a, b])
        (xb,), = [[t[0] for t in loader.batches([b])]]  # skips a: gathered fresh or from queue
        assert torch.equal(xb, torch.from_numpy(np.asarray(x[b], np.float32)))
        loader.prefetch([c])
        got = [t[0] for t in loader.batches([a, c])]
        assert torch.equal(got[0], torch.from_numpy(np.asarray(x[a], np.float32)))
        assert torch.equal(got[1], torch.from_numpy(np.asarray(x[c], np.float32)))
    finally:
        loader.close()
