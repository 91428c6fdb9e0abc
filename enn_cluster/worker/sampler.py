"""Which rows each data-parallel rank reads at each step: pure, seeded, resumable.

An epoch is one seeded permutation of the training rows. A position is (epoch, rows
consumed in that epoch): it does not depend on how many ranks read, so a run resumed at
another world size continues at exactly the next unseen row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    consumed: int = 0  # rows of this epoch already used, summed over all ranks


def epoch_permutation(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def micro_batch_rows(perm: np.ndarray, consumed: int, dp_rank: int, dp_size: int,
                     micro_batch: int, accum_index: int) -> np.ndarray:
    """Rows for one micro-batch of one rank within the optimizer step starting at `consumed`."""
    start = consumed + (accum_index * dp_size + dp_rank) * micro_batch
    return perm[start:start + micro_batch]


def steps_left_in_epoch(n_rows: int, consumed: int, global_batch: int) -> int:
    """Whole optimizer steps left; the ragged tail of an epoch is dropped."""
    return max((n_rows - consumed) // global_batch, 0)


def advance(pos: DataPosition, n_rows: int, global_batch: int) -> DataPosition:
    consumed = pos.consumed + global_batch
    if steps_left_in_epoch(n_rows, consumed, global_batch) == 0:
        return DataPosition(pos.epoch + 1, 0)
    return DataPosition(pos.epoch, consumed)


def shard_rows(n_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous [start, stop) of `n_rows` for one rank (evaluation, prediction)."""
    per, extra = divmod(n_rows, world)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)
