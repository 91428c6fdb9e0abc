"""The run lock, held by the worker when no launcher of ours holds it.

Our launchers (the local one, `enn-submit` on Slurm) take the lock before workers start.
A worker started by anything else (torchrun, a site's own srun line or the admin sbatch
templates) takes it itself on rank 0, records the launch in jobs.jsonl and releases the
lock at the end, so two jobs never write one run, whoever started them.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Mapping, Optional

from enn_cluster.cluster.slurm import lock_liveness
from enn_cluster.config.launch_env import LOCK_HELD_VAR, SUBMISSION_VAR
from enn_cluster.errors import UserError
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import acquire_lock, lock_owner, read_lock, release_lock
from enn_cluster.worker.environment import WorkerEnv


def needs_own_lock(env: WorkerEnv, environ: Mapping[str, str], owner: Optional[dict]) -> bool:
    """False where a launcher of ours already holds the lock for this very job."""
    if environ.get(LOCK_HELD_VAR) == "1":
        return False
    if owner and owner.get("submission") and owner["submission"] == environ.get(SUBMISSION_VAR):
        return False  # enn-submit's claim for this job, before or after it named the job id
    if env.launcher == "slurm" and owner and owner.get("submitted_by") == "enn-submit" \
            and str(owner.get("slurm_job_id")) == str(env.job_id):
        return False
    return True


@contextmanager
def hold_run_lock(run: RunDir, env: WorkerEnv, lanes, task: str):
    """Rank 0 takes the lock (if needed) and every rank learns the outcome over the
    control lane, so a refused job ends on all ranks with the same one-line error."""
    mine, refusal = None, None
    if lanes.rank == 0 and needs_own_lock(env, os.environ, read_lock(run)):
        try:
            mine = acquire_lock(run, {**lock_owner(), "launcher": env.launcher},
                                slurm_job_alive=lock_liveness())
            run.record_job(JobRecord(kind=env.launcher, task=task, job_id=env.job_id,
                                     pid=os.getpid(), world_size=env.world_size,
                                     nodes=env.num_nodes))
        except UserError as exc:
            refusal = str(exc)
    refusal = lanes.broadcast_object(refusal)
    if refusal:
        raise UserError(refusal)
    try:
        yield
    finally:
        if mine is not None:
            release_lock(run, mine)
