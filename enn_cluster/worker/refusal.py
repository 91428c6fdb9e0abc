"""A rank that refuses its input (exit 2, a UserError: version skew, bad data, out of
memory at micro-batch 1) under Slurm: the note it leaves in RUN/requeue/refused-JOB (read by
the batch shell's EXIT trap, `status`, `doctor`, `logs`: storage/node_loss.read_refusal),
and how the job's other ranks, whose own failure follows from it (srun's
--kill-on-bad-exit, a peer gone from a collective, a container torn down under them),
leave pointing at it in one line instead of a traceback that buries it."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from enn_cluster.storage import layout, node_loss

log = logging.getLogger("enn_cluster.worker")


def record_refusal(run_dir: str, job_id: str, message: str) -> None:
    """RUN/requeue/refused-JOBID: the host-side trap never requeues a job whose input a
    rank refused. srun's own exit code cannot say so: when one rank exits 2 first,
    --kill-on-bad-exit terminates its peers and srun returns 143, which reads as a failure
    to retry. A run directory that cannot hold the file leaves srun's code to decide."""
    from enn_cluster.storage.rundir import atomic_write_text

    try:
        path = layout.marker(run_dir, "refused", job_id)
        if path.parent.is_dir():
            atomic_write_text(path, " ".join(message.split())[:400] + "\n")
    except OSError as exc:
        print(f"enn_cluster worker: could not record the refusal: {exc}", file=sys.stderr)


def leave_if_peer_refused(run_dir: str, slurm_job: Optional[str]) -> bool:
    """Did another rank of Slurm job `slurm_job` refuse its input (requeue/refused-JOB)?
    Then say so in one line: this rank's own failure that follows (a peer gone from the
    rendezvous, a container torn down under it) is not the reason, and a traceback of it
    buried the refusal in the batch log."""
    note = node_loss.read_refusal(Path(run_dir), slurm_job) if slurm_job else None
    if note:
        os.write(2, f"enn_cluster worker: leaving: another rank of job {slurm_job} refused "
                    f"its input: {note}\n".encode("utf-8", "replace"))
    return note is not None


def to_rank_log_only(message: str) -> None:
    """`message` and the exception being handled, in this rank's log file alone (where
    there is one yet), not on stderr: the batch log keeps the one line that matters."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), sys.exc_info())
    for handler in logging.getLogger("enn_cluster").handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
