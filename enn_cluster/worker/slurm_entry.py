"""What submitit runs on every Slurm task: the same worker entry as `python -m
enn_cluster.worker`. Its own small module, importing nothing heavy at module level, because
the login node imports it to hand submitit the function by reference."""
from __future__ import annotations

import sys
from typing import Optional

# what submit hands the job with worker_entry (the cluster side imports this module alone)
from enn_cluster.worker.code_identity import code_identity  # noqa: F401


def worker_entry(run_dir: str, task: str, name: Optional[str], step: Optional[int],
                 submitted: Optional[str] = None) -> int:
    """What submitit runs on every task (`submitted`: the submitting enn_cluster's
    `code_identity`). A non-zero code must reach srun (kill-on-bad-exit, the host-side
    requeue trap), so it leaves through sys.exit rather than a return value."""
    import atexit

    from enn_cluster.worker.entry import EXIT_FAILED, exit_now, run_entry

    try:
        code = run_entry(run_dir, task, name, step, submitted)
    except Exception:
        # a peer died, a collective timed out: submitit records the error and raises it;
        # then leave as `python -m enn_cluster.worker` does, without the finalisation of a
        # process holding torch (seconds on a busy node), which the tasks' end waits for,
        # and with it the relaunch on the nodes left after a lost node (host_setup.sh)
        atexit.register(exit_now, EXIT_FAILED)
        raise
    # submitit writes the task's result, then the interpreter finalises: leave before the
    # C++ static destructors, where a native thread still winding down aborts the task
    # ("terminate called without an active exception") and fails a finished job.
    atexit.register(exit_now, code)
    if code:
        sys.stdout.flush()
        sys.exit(code)
    return code
