"""The prefetching loader returns exactly the batches a synchronous gather gives, in the
trainer's row order (sampler.micro_batch_rows over epoch permutations), whatever was
prefetched ahead, right or wrong. Real memmaps on disk, a real background thread.
On CUDA the rows are gathered into reused pinned buffers (HostBuffers): no GPU here, so
the reuse rule and the gather into handed-out buffers are checked with plain tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from enn_cluster.worker.loader import (BatchLoader, HostBuffers, fills_buffers, gather_rows,
                                       take_rows)
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


class Allocations:
    """torch.empty, remembering what it handed out (plain memory stands in for pinned)."""

    def __init__(self) -> None:
        self.made: list[torch.Tensor] = []

    def __call__(self, shape, dtype) -> torch.Tensor:
        self.made.append(torch.empty(shape, dtype=dtype))
        return self.made[-1]


def test_a_buffer_is_handed_out_again_only_after_its_copy_is_done():
    made = Allocations()
    buffers = HostBuffers(made)
    first = buffers.take((4, 3), torch.float32)
    copy_done = False
    buffers.give_back(first, lambda: copy_done)
    second = buffers.take((4, 3), torch.float32)  # the copy reading `first` still runs
    assert second is not first and len(made.made) == 2
    buffers.give_back(second, lambda: copy_done)
    copy_done = True
    assert buffers.take((4, 3), torch.float32) is first
    assert buffers.take((4, 3), torch.float32) is second
    assert buffers.take((4, 3), torch.float32) is made.made[2]  # none left: a new one
    buffers.give_back(first, lambda: True)
    assert buffers.take((4, 3), torch.float64) is not first  # other dtype, other shape
    assert buffers.take((3, 4), torch.float32) is not first
    assert buffers.take([4, 3], torch.float32) is first


@pytest.mark.parametrize("scaled", [False, True])
def test_gather_into_reused_buffers_equals_todays_gather(arrays, scaled):
    x, y = arrays
    scaler = ({"mean": np.float32([0.5, -1.0]), "std": np.float32([2.0, 0.5])}
              if scaled else None)
    made = Allocations()
    buffers = HostBuffers(made)
    steps = _steps(900, 50, rank=0, dp=2, micro=16, accum=2, seed=3, steps=6)
    for _, rows_list in steps:
        for rows in rows_list:
            xb, yb = gather_rows(x, y, rows, scaler, alloc=buffers.take)
            rx, ry = _reference_batch(x, y, rows, scaler)
            assert xb.dtype == rx.dtype and yb.dtype == ry.dtype
            assert torch.equal(xb, rx) and torch.equal(yb, ry)
            assert any(xb is t for t in made.made) and any(yb is t for t in made.made)
            buffers.give_back(xb, lambda: True)
            buffers.give_back(yb, lambda: True)
    assert len(made.made) == 2  # one buffer for inputs, one for targets, reused throughout


def test_take_rows_refuses_rows_outside_the_array():
    src = np.arange(12, dtype=np.float64).reshape(6, 2)
    out = np.empty((2, 2), np.float32)
    take_rows(src, np.array([5, 0]), out)
    assert np.array_equal(out, np.float32([[10, 11], [0, 1]]))
    for rows in ([6, 0], [-1, 0]):  # numpy's 'clip' alone would quietly take rows 5 and 0
        with pytest.raises(IndexError):
            take_rows(src, np.array(rows), out)


def test_only_a_gather_that_takes_alloc_gets_buffers(arrays):
    x, y = arrays
    assert fills_buffers(lambda rows, alloc=None: gather_rows(x, y, rows, None, alloc))
    assert not fills_buffers(lambda rows: gather_rows(x, y, rows, None))
