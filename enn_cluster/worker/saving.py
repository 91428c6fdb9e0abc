"""The training loop's checkpoint writes: blocking or async (at most one in flight), each
save's time reported against the stop grace, and a failed write turned into an abort that
names the step still intact. The loop decides when to save and with what state; this
keeps the write in flight, its reused CPU buffers and its errors.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException

from enn_cluster.config.run_config import RunConfig
from enn_cluster.storage import commits as store
from enn_cluster.storage.metrics import MetricsLog
from enn_cluster.storage.rundir import RunDir
from enn_cluster.worker import checkpoint as ckpt
from enn_cluster.worker.checkpoint_async import PendingSave, new_stager, reserve, save_async
from enn_cluster.worker.lanes import Lanes

log = logging.getLogger("enn_cluster.worker.saving")


class TrainingAborted(RuntimeError):
    """Training cannot go on (non-finite losses, a checkpoint that could not be written);
    the message says what to check."""


class Saver:
    def __init__(self, cfg: RunConfig, run: RunDir, lanes: Lanes, metrics: MetricsLog):
        dev = lanes.device.type
        self.root, self.lanes, self.metrics = run.checkpoints, lanes, metrics
        self.keep_last = cfg.checkpoint.keep_last
        self.stop_grace_s = cfg.parallel.stop_grace_s
        self.writer_threads = cfg.checkpoint.threads_on(dev)
        self.async_periodic = cfg.checkpoint.async_on(dev)
        self.pending: Optional[PendingSave] = None
        self.stager = None  # async saves' CPU buffers, reused from save to save
        self.staging_wait_s = 0.0  # time optimizer steps waited for an async save's copy

    def reserve(self, model, optimizer) -> None:
        """Async saves' (pinned) buffers, allocated before the loop, not in the first save."""
        self.stager = new_stager()
        n = reserve(self.stager, model, optimizer, self.lanes)
        log.info("checkpoint staging: %.1f MB reserved for this rank's share of a save", n / 1e6)

    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def wait_staged(self) -> float:
        """Before an optimizer step: an async save may still be copying the parameters.
        Returns the seconds waited."""
        if self.pending is None:
            return 0.0
        began = time.perf_counter()
        self.pending.wait_staged()
        waited = time.perf_counter() - began
        self.staging_wait_s += waited
        return waited

    def save(self, step: int, model, optimizer, state: dict, async_save: bool) -> None:
        self.finish_pending(step)
        args = (self.root, step, model, optimizer, state, self.lanes)
        try:
            if async_save:
                self.stager = self.stager or new_stager()
                self.pending = save_async(*args, self.stager, self.keep_last,
                                          self.writer_threads)
            else:
                self._took(step, ckpt.save(*args, keep_last=self.keep_last,
                                           writer_threads=self.writer_threads))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise self._failed(step, exc) from exc
        self.metrics.write("checkpoint", step=step, async_save=async_save)

    def finish_pending(self, step: int) -> None:
        """Wait for the async save in flight (usually long done) and surface its error;
        `step` is the loop's, which the abort names."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except (Exception, CheckpointException) as exc:
                raise self._failed(step, exc) from exc
            self._took(pending.step, pending.seconds)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()

    def _took(self, step: int, seconds: float) -> None:
        ckpt.report_save_time(self.metrics, step, seconds, self.stop_grace_s)

    def _failed(self, step: int, exc: BaseException) -> TrainingAborted:
        """Stop training: going on without the checkpoint would silently drop state."""
        last = store.latest_committed(self.root)
        reason = (store.storage_problem(self.root) or
                  " ".join(str(exc).split())[:300] or type(exc).__name__)
        return TrainingAborted(
            f"checkpoint step-{step} could not be written to {self.root} "
            f"({reason}); free space or fix permissions there, then 'enn-submit resume' "
            f"continues from step-{last}, which is intact")
