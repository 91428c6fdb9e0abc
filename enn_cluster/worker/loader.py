"""Micro-batches gathered ahead of the training thread.

Why: rows are read at random from the memmap; gathered on the training thread, from
pageable memory, they stall the accelerator (`non_blocking` does nothing from pageable
memory). One background thread gathers the rows the trainer names, in the order it names
them, into pinned buffers (only when CUDA exists) and starts the host-to-device copies on a
side stream; the consumer's stream waits on an event, not on the host. Which rows make a
batch is the trainer's decision alone (sampler.micro_batch_rows): this module only fetches
them, so the batches are exactly those of a synchronous gather.
"""
from __future__ import annotations

import collections
import inspect
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from enn_cluster.errors import UserError
from enn_cluster.worker.placement import use_device

Batch = tuple[torch.Tensor, torch.Tensor]


Alloc = Callable[[tuple, torch.dtype], torch.Tensor]  # (shape, dtype) -> host tensor


def take_rows(src, rows: np.ndarray, out: np.ndarray) -> None:
    """`src[rows]` written into `out` (cast to its dtype). The rows are checked here so that
    numpy's 'clip' mode, which unlike 'raise' needs no temporary copy, never clips."""
    if rows.size and (rows.min() < 0 or rows.max() >= len(src)):
        raise IndexError(f"rows {rows.min()}..{rows.max()} outside 0..{len(src) - 1}")
    np.take(src, rows, axis=0, out=out, mode="clip")


def _targets(y, rows: np.ndarray, scaler: Optional[dict]) -> np.ndarray:
    yb = np.asarray(y[rows])
    if scaler is not None:
        yb = (yb.astype(np.float32) - scaler["mean"]) / scaler["std"]
    return np.ascontiguousarray(yb)


def input_numpy_dtype(x, dtype: torch.dtype) -> np.dtype:
    """The host dtype of a batch of `x` for a model that takes `dtype` (models.input_dtype):
    float32 for values; for token ids, the staged integers as they are (int32), so that no
    float cast (FSDP's mixed precision casts floating inputs to bf16, which moves every id
    above 256) ever sees them. Pure."""
    if dtype.is_floating_point:
        return np.dtype(np.float32)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"token ids must be staged as integers, not {x.dtype}")
    return np.dtype(x.dtype)


def host_rows(rows, dtype: torch.dtype) -> np.ndarray:
    """Input rows (a slice of a staged array) as a model that takes `dtype` gets them:
    float32 values, or int64 token ids (-1 pads kept), where an array of floats is taken
    only when every value is a whole number. Pure."""
    rows = np.asarray(rows)
    if dtype.is_floating_point:
        return np.array(rows, dtype=np.float32)
    if np.issubdtype(rows.dtype, np.integer):
        return rows.astype(np.int64)
    if not (np.all(np.isfinite(rows)) and np.array_equal(np.floor(rows), rows)):
        raise UserError("--input: the model takes token ids, and these rows hold values "
                        "that are not whole numbers; give the ids as integers "
                        "(x.astype('int64'))")
    return rows.astype(np.int64)


def gather_rows(x, y, rows: np.ndarray, scaler: Optional[dict],
                alloc: Optional[Alloc] = None, dtype: torch.dtype = torch.float32) -> Batch:
    """The host tensors of one batch: inputs as the model takes them (`dtype`: float32
    values, or integer token ids kept integer), targets normalised when a scaler is given
    (training runs on normalised targets; prediction undoes it). With `alloc` (the
    loader's pinned buffers on CUDA) the inputs are gathered straight into the tensors it
    hands out, and the targets (a few columns) copied there, so nothing is pinned again."""
    rows = np.asarray(rows)
    yb = _targets(y, rows, scaler)
    host = input_numpy_dtype(x, dtype)
    if alloc is None:
        return torch.from_numpy(np.ascontiguousarray(x[rows], dtype=host)), \
            torch.from_numpy(yb)
    xt = alloc((len(rows), *x.shape[1:]), torch.from_numpy(np.empty(0, host)).dtype)
    take_rows(x, rows, xt.numpy())
    yt = alloc(yb.shape, torch.from_numpy(yb).dtype)
    yt.numpy()[...] = yb
    return xt, yt


class HostBuffers:
    """Reusable host buffers, keyed by shape and dtype.

    Why: pinning a fresh batch costs a page-locked allocation and a second copy. A buffer
    comes back with a `done` predicate (on CUDA: the query of the event recorded after the
    copy that reads it) and is handed out again only once that says the copy finished, so
    a batch still on its way to the device is never overwritten. Used from the loader
    thread and, for a batch not prefetched, from the training thread.
    """

    def __init__(self, alloc: Alloc) -> None:
        self._alloc = alloc
        self._lock = threading.Lock()
        self._returned: dict[tuple, list[tuple[torch.Tensor, Callable[[], bool]]]] = {}

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            queue = self._returned.get((tuple(shape), dtype), [])
            for i, (_, done) in enumerate(queue):
                if done():
                    return queue.pop(i)[0]
        return self._alloc(tuple(shape), dtype)

    def give_back(self, buffer: torch.Tensor, done: Callable[[], bool]) -> None:
        with self._lock:
            key = (tuple(buffer.shape), buffer.dtype)
            self._returned.setdefault(key, []).append((buffer, done))


def _pinned(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def fills_buffers(gather: Callable) -> bool:
    """Whether `gather` takes an `alloc` keyword (gather_rows' contract), so the loader can
    hand it pinned buffers; a plain `gather(rows)` keeps the copy-then-pin path."""
    try:
        return "alloc" in inspect.signature(gather).parameters
    except (TypeError, ValueError):
        return False


class _Staged:
    """One batch on its way: device tensors plus the event that says the copy is done."""

    def __init__(self, xb: torch.Tensor, yb: torch.Tensor, event=None) -> None:
        self.xb, self.yb, self.event = xb, yb, event

    def ready(self) -> Batch:
        if self.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.event)
            self.xb.record_stream(stream)  # the allocator must not reuse them under us
            self.yb.record_stream(stream)
        return self.xb, self.yb


class BatchLoader:
    """Fetch row-index arrays in order, ahead of use.

    `batches(rows_list)` yields one (x, y) per row array, in order; rows announced earlier
    with `prefetch` (the next step's, say) are already gathered. A batch whose rows differ
    from what was prefetched is gathered on the spot, so the result never depends on what
    was guessed ahead. `prefetch=False` gathers synchronously (the bench's baseline).
    """

    def __init__(self, gather: Callable[..., Batch], device: torch.device,
                 prefetch: bool = True) -> None:
        self.gather, self.device = gather, device
        self.cuda = device.type == "cuda"
        self._pool = (ThreadPoolExecutor(1, "enn-loader", initializer=use_device,
                                         initargs=(device,)) if prefetch else None)
        self._stream = torch.cuda.Stream(device) if (self.cuda and prefetch) else None
        self._buffers = (HostBuffers(_pinned) if self._stream is not None
                         and fills_buffers(gather) else None)
        self._pending: collections.deque[tuple[np.ndarray, Future]] = collections.deque()

    def _stage(self, rows: np.ndarray) -> _Staged:
        if self._buffers is not None:  # gathered into pinned buffers, reused after the copy
            xb, yb = self.gather(rows, alloc=self._buffers.take)
            staged = self._copy(xb, yb)
            self._buffers.give_back(xb, staged.event.query)
            self._buffers.give_back(yb, staged.event.query)
            return staged
        xb, yb = self.gather(rows)
        if not self.cuda:
            return _Staged(xb, yb)
        if self._stream is None:  # synchronous: the current stream copies
            return _Staged(xb.to(self.device, non_blocking=True),
                           yb.to(self.device, non_blocking=True))
        return self._copy(xb.pin_memory(), yb.pin_memory())

    def _copy(self, xb: torch.Tensor, yb: torch.Tensor) -> _Staged:
        """Start the pinned host tensors' copies on the side stream; the event marks their end."""
        with torch.cuda.stream(self._stream):
            xd = xb.to(self.device, non_blocking=True)
            yd = yb.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Staged(xd, yd, event)

    def prefetch(self, rows_list: Iterable[np.ndarray]) -> None:
        """Start gathering these rows now, in order, behind what is already queued."""
        if self._pool is None:
            return
        for rows in rows_list:
            rows = np.asarray(rows)
            self._pending.append((rows, self._pool.submit(self._stage, rows)))

    def _take(self, rows: np.ndarray) -> _Staged:
        while self._pending:
            queued, future = self._pending.popleft()
            if np.array_equal(queued, rows):
                return future.result()
            future.cancel()  # a guess that did not come true
        return self._stage(rows)

    def batches(self, rows_list: Sequence[np.ndarray]) -> Iterator[Batch]:
        """One batch per row array, in order; all of them are queued before the first is
        returned, so later micro-batches gather while earlier ones compute."""
        rows_list = [np.asarray(r) for r in rows_list]
        queued = [q for q, _ in self._pending]
        matched = 0
        while matched < min(len(queued), len(rows_list)) and \
                np.array_equal(queued[matched], rows_list[matched]):
            matched += 1
        if matched == len(queued):
            self.prefetch(rows_list[matched:])
        for rows in rows_list:
            yield self._take(rows).ready()

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
