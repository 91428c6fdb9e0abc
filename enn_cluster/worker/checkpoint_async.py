"""Async checkpoints: the training loop pays for taking the state dict, nothing more.

A save hands the live (sharded) state dict to one background thread, which plans the
save, copies the items this rank writes (not its replicas' share) into reused CPU buffers
(checkpoint_staging), then writes, commits and prunes exactly like a blocking save, on
the checkpoint lane (a gloo group only this thread uses). Forward and backward only
read the parameters, so the copy overlaps them; the trainer calls `wait_staged()` before
the optimizer step that would change them. Errors surface in `result()` on every rank,
because each collective step of the write agrees on failure.
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Optional

import torch

from enn_cluster.worker import checkpoint as ckpt
from enn_cluster.worker.checkpoint_staging import StagingBuffers, StagingPlanner, reserve_state
from enn_cluster.worker.lanes import Lanes
from enn_cluster.worker.placement import use_device


def new_stager() -> StagingBuffers:
    """Staging buffers live as long as the trainer: a second save copies into the first's
    memory. On GPU hosts they are pinned and the copies non-blocking, on the checkpoint
    thread's side stream. `reserve` allocates them before the first save."""
    return StagingBuffers()


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
            planner = StagingPlanner(stager, self._staged.set, ready, lanes.device)
            try:
                self.seconds = ckpt.write(root, self.step, state, snap, lanes, keep_last,
                                          self.writer_threads, planner)
            finally:
                self._staged.set()  # a failure before the plan was known
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


def save_async(root: Path, step: int, model, optimizer, trainer_state: dict, lanes: Lanes,
               stager, keep_last: Optional[int] = None, writer_threads: int = 1) -> PendingSave:
    """Start writing step-N; the state dict is taken now, between steps, while FSDP's
    parameters are sharded (a forward would swap in the unsharded ones)."""
    return PendingSave(step, root, ckpt.state_of(model, optimizer), ckpt.snapshot(trainer_state),
                       lanes, stager, keep_last, writer_threads)


def reserve(stager: StagingBuffers, model, optimizer, lanes: Lanes) -> int:
    """Collective: allocate the staging buffers of this rank's share of a save, at start
    (see checkpoint_staging.reserve_state). Returns the bytes reserved."""
    return stager.reserve(reserve_state(model, optimizer, ckpt.state_of), lanes)
