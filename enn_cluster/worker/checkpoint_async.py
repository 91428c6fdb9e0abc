"""Async checkpoints: the training loop pays for taking the state dict, nothing more.

A save hands the live (sharded) state dict to one background thread, which copies it
into reused CPU buffers, then writes, commits and prunes exactly like a blocking save,
on the checkpoint lane (a gloo group only this thread uses). Forward and backward only
read the parameters, so the copy overlaps them; the trainer calls `wait_staged()` before
the optimizer step that would change them. Errors surface in `result()` on every rank,
because each collective step of the write agrees on failure.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint import staging

from enn_cluster.worker import checkpoint as ckpt
from enn_cluster.worker.lanes import Lanes
from enn_cluster.worker.placement import use_device

SLOW_STAGING = "ENN_FAULT_SLOW_STAGING_S"  # tests: the copy starts this late (seconds)


class _StockStager:
    """DCP's BlockingAsyncStager (a fresh CPU copy per save), with the `close()` that
    DefaultStager has and torch 2.8's BlockingAsyncStager lacks."""

    def __init__(self) -> None:
        self._inner = staging.BlockingAsyncStager(cache_staged_state_dict=False)

    def stage(self, state: dict) -> dict:
        return self._inner.stage(state)

    def close(self) -> None:
        getattr(self._inner, "close", lambda: None)()


def new_stager():
    """Staging buffers live as long as the trainer: a second save copies into the first's
    memory instead of faulting in fresh pages. On GPU hosts they are pinned and the copies
    are non-blocking, on the checkpoint thread's side stream (torch then synchronises the
    device, which blocks only that thread). DefaultStager came in torch 2.9; before it,
    DCP's stock BlockingAsyncStager does the copy."""
    default = getattr(staging, "DefaultStager", None)
    options = getattr(staging, "StagingOptions", None)
    if default is None or options is None:
        return _StockStager()
    cuda = torch.cuda.is_available()
    return default(options(use_pinned_memory=cuda, use_shared_memory=False,
                           use_async_staging=False, use_non_blocking_copy=cuda))


class PendingSave:
    """One checkpoint being written in the background."""

    def __init__(self, step: int, root: Path, state: dict, snap: ckpt.Snapshot,
                 lanes: Lanes, stager, keep_last: Optional[int], writer_threads: int = 1) -> None:
        self.step = step
        self.error: Optional[BaseException] = None
        self.seconds = 0.0  # the write's, once done
        self.writer_threads = writer_threads
        self._staged = threading.Event()
        lanes_bg = dataclasses.replace(lanes, control=lanes.checkpoint)
        ready = None
        if lanes.device.type == "cuda":  # the copy waits for the step that made the values
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(lanes.device))
        self._thread = threading.Thread(
            target=self._run, args=(root, state, snap, lanes_bg, stager, keep_last, ready),
            name=f"enn-checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, root, state, snap, lanes, stager, keep_last, ready) -> None:
        try:
            use_device(lanes.device)
            try:
                time.sleep(float(os.environ.get(SLOW_STAGING, "0")))
                staged = _stage(stager, state, lanes.device, ready)
            finally:
                self._staged.set()
            self.seconds = ckpt.write(root, self.step, staged, snap, lanes, keep_last,
                                      self.writer_threads)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self.error = exc

    def wait_staged(self) -> None:
        """Block until the parameters may change again (before an optimizer step)."""
        self._staged.wait()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> None:
        """Wait for the commit; re-raise the background error, if any."""
        self._thread.join()
        if self.error is not None:
            raise self.error


def _stage(stager, state: dict, device, ready) -> dict:
    """Copy to the staging buffers; on CUDA on a side stream of this thread, after the
    event that marks the end of the step the state comes from."""
    if ready is None:
        return stager.stage(state)
    side = torch.cuda.Stream(device)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        return stager.stage(state)


def save_async(root: Path, step: int, model, optimizer, trainer_state: dict, lanes: Lanes,
               stager, keep_last: Optional[int] = None, writer_threads: int = 1) -> PendingSave:
    """Start writing step-N; the state dict is taken now, between steps, while FSDP's
    parameters are sharded (a forward would swap in the unsharded ones)."""
    return PendingSave(step, root, ckpt.state_of(model, optimizer), ckpt.snapshot(trainer_state),
                       lanes, stager, keep_last, writer_threads)
