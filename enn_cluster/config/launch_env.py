"""Names of the environment variables our launchers set for their workers, and the rule for
the rendezvous port: the one contract between the launching side (local launcher, submitit
path, batch scripts) and the worker, kept where both import it so that neither imports the
other; and the one way a launcher hands them values through its own environment.
"""
import os
from contextlib import contextmanager
from typing import Mapping

SIM_NODES_VAR = "ENN_SIM_NODES"  # local launcher: how many nodes the processes pretend to be
# local launcher: the GPUs per node the run asked for (its ranks may run on the CPU; the
# backend report says so, as SLURM_GPUS_ON_NODE lets it under Slurm)
GPUS_REQUESTED_VAR = "ENN_GPUS_REQUESTED"
LOCK_HELD_VAR = "ENN_LOCK_HELD"  # the launcher holds the run lock for its workers
LAUNCHER_PID_VAR = "ENN_LAUNCHER_PID"  # workers die with the local launcher
LAUNCH_ID_VAR = "ENN_LAUNCH_ID"  # one id per local launch: names its log directory
ATTEMPT_VAR = "ENN_LOCAL_ATTEMPT"  # local launcher: its restart count (it restarts, not elastic)
RELAUNCH_VAR = "ENN_RELAUNCH"  # Slurm: host_setup.sh's relaunch count after a lost node (0: none)
SUBMISSION_VAR = "ENN_SUBMISSION"  # enn-submit on Slurm: the token its claim on run.lock names
# the batch script's host side (it has scontrol; the image may not): 'JOBID:alive' or
# 'JOBID:gone' for the Slurm job that run.lock names, asked before srun
LOCK_JOB_STATE_VAR = "ENN_LOCK_JOB_STATE"

# MASTER_PORT when nobody exported one: BASE + job id % SPAN (20000-29999, below Linux's
# ephemeral ports 32768-60999), stable across requeues of one job. The batch scripts' host
# snippet exports it (cluster/job_script.host_setup_lines puts these numbers in);
# worker/environment.port_for_job derives the same for a site's own srun line.
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000


@contextmanager
def handed_to_workers(updates: Mapping[str, str]):
    """`updates` in this process's environment while the block launches (local workers
    inherit it, sbatch exports it to the job), and the environment as it was afterwards: a
    notebook or a script that launches twice keeps its own."""
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
