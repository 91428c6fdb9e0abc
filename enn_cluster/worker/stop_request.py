"""A stop asked for through the run directory, so that no signal has to reach the job step.

Why: under Pyxis with `use_squashfuse=1`, a signal Slurm delivers to a step reaches every
process of the step, Enroot's squashfuse and fuse-overlayfs daemons included; they die, the
container's filesystem goes with them and the task ends in "Bus error". So Slurm's warning
goes to the batch shell alone (`--signal=B:USR2@N`, `scancel --batch --signal=USR2`); its
trap (templates/host_setup.sh) writes RUN/requeue/stop-JOBID. Rank 0 polls that file at step
boundaries (one stat, at most once a second) and the control lane's per-step all-reduce makes
every rank stop at the same step. (A signal that still reaches a task before the trainer's
handlers exist is remembered by worker.install_early_stop_handlers.)
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

from enn_cluster.storage import layout

POLL_EVERY_S = 1.0


def stop_file(run_dir: str | os.PathLike, job_id: str) -> Path:
    """Where the batch shell (or an early handler) records a stop request for `job_id`."""
    return layout.marker(run_dir, "stop", job_id)


def requested(run_dir: str | os.PathLike, job_id: Optional[str]) -> bool:
    """Whether a stop was asked for this job (a Slurm job id; None: never)."""
    return bool(job_id) and stop_file(run_dir, job_id).exists()


def record(run_dir: str | os.PathLike, job_id: str) -> Path:
    """Ask the job's workers to checkpoint and stop at their next step boundary."""
    path = stop_file(run_dir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{int(time.time())}\n")
    return path


class StopPoller:
    """`poll()` is True once a stop was asked; only rank 0 looks, at most every `every_s`."""

    def __init__(self, run_dir: str | os.PathLike, job_id: Optional[str], rank: int,
                 every_s: float = POLL_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.job_id, self.every_s, self.clock = run_dir, job_id, every_s, clock
        self.active = rank == 0 and bool(job_id)
        self.next_check = float("-inf")

    def poll(self) -> bool:
        if not self.active or self.clock() < self.next_check:
            return False
        self.next_check = self.clock() + self.every_s
        return requested(self.run_dir, self.job_id)

