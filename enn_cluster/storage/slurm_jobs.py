"""Ask Slurm about a job: state, restarts, liveness. Thin wrappers over scontrol/squeue/sacct.

`scontrol show job` answers while the controller remembers the job (MinJobAge); `sacct`
answers later where accounting is configured. The parsing is pure and tested with text.
"""
from __future__ import annotations

import shutil
import subprocess
from typing import Optional

LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
               "REQUEUE_FED", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}


# Pending reasons that no amount of waiting changes: the request exceeds what the partition,
# account or QOS allow, or asks for features no node has (Slurm's default EnforcePartLimits=NO
# accepts such jobs and leaves them pending forever).
NEVER_STARTS = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
    "AccountNotAllowed", "QOSNotAllowed", "InvalidAccount", "InvalidQOS",
    "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit", "QOSMaxGRESPerJob",
    "QOSMaxCpuPerJobLimit", "AssocMaxNodesPerJobLimit", "AssocMaxWallDurationPerJobLimit"})


def describe(state: dict) -> str:
    """'PENDING (Reason=Priority)' or 'RUNNING': what `--wait` prints when it changes."""
    reason = state.get("reason")
    return f"{state['state']} (Reason={reason})" if reason and reason != "None" else state["state"]


def never_starts(state: dict) -> bool:
    """A pending job Slurm will never start as asked (see NEVER_STARTS)."""
    return state["state"] == "PENDING" and state.get("reason") in NEVER_STARTS


def parse_scontrol(text: str) -> dict:
    """`scontrol show job -o ID` -> {"JobState": ..., "Restarts": ..., ...}."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def slurm_client(cmd: list[str], timeout: float = 20) -> Optional[subprocess.CompletedProcess]:
    """A Slurm client command's result (output as text, not checked); None when the tool
    is missing or does not answer within `timeout` s."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def job_state(job_id: str) -> dict:
    res = slurm_client(["scontrol", "show", "job", "-o", str(job_id)])
    if res is not None and res.returncode == 0 and res.stdout.strip():
        f = parse_scontrol(res.stdout)
        return {"job_id": str(job_id), "state": f.get("JobState", "UNKNOWN"),
                "restarts": int(f.get("Restarts", "0") or 0), "reason": f.get("Reason"),
                "nodes": f.get("NodeList"), "exit_code": f.get("ExitCode")}
    res = slurm_client(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"])
    if res is not None and res.returncode == 0 and res.stdout.strip():
        state, _, code = res.stdout.strip().splitlines()[0].partition("|")
        return {"job_id": str(job_id), "state": state.split()[0], "exit_code": code}
    return {"job_id": str(job_id), "state": "UNKNOWN"}


def job_alive(job_id: str) -> bool:
    """True while Slurm may still run this job (pending, running, requeued)."""
    state = job_state(job_id)["state"]
    if state != "UNKNOWN":
        return state in LIVE_STATES
    res = slurm_client(["squeue", "-h", "-j", str(job_id)])
    return bool(res is not None and res.returncode == 0 and res.stdout.strip())


def job_fields(job_id: str) -> dict:
    """`scontrol show job` fields of a job the controller still knows ({} otherwise)."""
    res = slurm_client(["scontrol", "show", "job", "-o", str(job_id)])
    ok = res is not None and res.returncode == 0 and res.stdout.strip()
    return parse_scontrol(res.stdout) if ok else {}


def submission_comment(run_path) -> str:
    """The `--comment` enn-submit gives every job it submits for a run: a digest of the
    run's real path (rendered, so `render` shows it). Only a submission sets a job's
    comment, and a record copied from another run names a job whose comment is that run's."""
    import hashlib
    import os

    return "enn-cluster:" + hashlib.sha256(os.path.realpath(run_path).encode()).hexdigest()[:40]


def job_belongs_to_run(fields: dict, run_path) -> bool:
    """Is this Slurm job one of the run's? Only its comment says so: names are public in
    squeue and jobs.jsonl is writable by whoever can write the run, but a job's comment is
    set by its submitter alone."""
    return fields.get("Comment") == submission_comment(run_path)


def cancel(job_id: str) -> None:
    res = slurm_client(["scancel", str(job_id)])
    if res is None or res.returncode != 0:
        from enn_cluster.errors import UserError

        raise UserError(f"scancel {job_id} failed: {(res.stderr.strip() if res else 'scancel not found')}")
