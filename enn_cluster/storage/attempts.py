"""The order of a run's attempts (logs/<attempt>/ folders): by the launch's time in
jobs.jsonl, then the restart count. Folder times alone mislead: whole-second times (Lustre)
tie a quick restart with the attempt before it, and a copy of the run (cp -r) or a late write
reorders them; they decide only for folders no recorded launch names (a launcher's own
ENN_ATTEMPT_TAG). `logs`, `doctor` and `status` all ask this one question."""
from __future__ import annotations

import re
from pathlib import Path

from enn_cluster.errors import UserError
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.rundir import RunDir


def launch_times(jobs: list[JobRecord]) -> dict[str, float]:
    """When each recorded launch began, keyed as its attempt folders are named
    (local-K: the K-th line of jobs.jsonl; slurm-JOB: that job's first line)."""
    times: dict[str, float] = {}
    for k, job in enumerate(jobs, 1):
        t = job.time
        if not isinstance(t, (int, float)):
            continue
        if job.kind == "local":
            times[f"local-{k}"] = t
        elif job.is_slurm and job.job_id:
            times.setdefault(f"slurm-{job.job_id}", t)
    return times


def attempt_order(name: str, folder_time: float, times: dict[str, float]) -> tuple:
    """Sort key of an attempt folder named LAUNCH-rN."""
    m = re.match(r"^(.*)-r(\d+)(?:-k(\d+))?$", name)  # -kK: the K-th relaunch after a lost node
    if not m:
        return (times.get(name.rpartition("-r")[0], folder_time), 0, 0, folder_time)
    launch, restarts, relaunch = m.group(1), int(m.group(2)), int(m.group(3) or 0)
    return (times.get(launch, folder_time), restarts, relaunch, folder_time)


def attempt_dirs(run: RunDir) -> list[Path]:
    """The run's attempt folders, oldest first ([] before any worker started)."""
    dirs = [d for d in run.logs.iterdir() if d.is_dir()] if run.logs.is_dir() else []
    try:
        times = launch_times(run.jobs())
    except UserError:  # a hand-edited jobs.jsonl: folder times still order the rest
        times = {}
    return sorted(dirs, key=lambda d: attempt_order(d.name, d.stat().st_mtime, times))
