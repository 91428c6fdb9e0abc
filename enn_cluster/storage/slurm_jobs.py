"""Ask Slurm about a job: state, restarts, liveness. Thin wrappers over scontrol/squeue/sacct.

`scontrol show job` answers while the controller remembers the job (MinJobAge); `sacct`
answers later where accounting is configured. The parsing is pure and tested with text.
"""
from __future__ import annotations

import re
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
    """'PENDING (Reason=Priority)' or 'RUNNING': what `--wait` prints when it changes; a
    job Slurm holds until a time says until when (held_until)."""
    reason = state.get("reason")
    text = f"{state['state']} (Reason={reason})" if reason and reason != "None" else state["state"]
    held = held_until(state)
    return f"{text}: {held}" if held else text


def held_until(state: dict) -> Optional[str]:
    """'requeued, held by Slurm until 2026-11-25 22:44:51 (BeginTime)' for a pending job
    that waits for its begin time: a requeued job waits so (Slurm sets it 2-3 min ahead
    after a requeue), as does one submitted with --begin. None otherwise."""
    if state.get("state") != "PENDING" or state.get("reason") != "BeginTime":
        return None
    when = (state.get("start_time") or "").replace("T", " ")
    until = f" until {when}" if when and when not in ("Unknown", "N/A", "None") else ""
    return f"{'requeued, ' if state.get('restarts') else ''}held by Slurm{until} (BeginTime)"


# A node's State flags that mean Slurm no longer hears from it, or has given it up.
DEAD_NODE_FLAGS = ("DOWN", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "POWER_DOWN")


def dead_nodes(node_lines: str) -> dict:
    """`scontrol -o show node NODES` -> {node: State} for the nodes Slurm no longer hears
    from ('MIXED+NOT_RESPONDING', 'DOWN+NOT_RESPONDING', 'IDLE*')."""
    out = {}
    for fields in parse_scontrol_lines(node_lines):
        state = fields.get("State", "")
        flags = set(re.split(r"[+*]", state))
        if fields.get("NodeName") and (state.endswith("*") or flags & set(DEAD_NODE_FLAGS)):
            out[fields["NodeName"]] = state
    return out


def nodes_not_answering(nodelist: str) -> dict:
    """The nodes of `nodelist` Slurm no longer hears from, asked in one `scontrol show
    node` ({} when none, or when Slurm cannot say)."""
    if not nodelist or nodelist == "(null)":
        return {}
    res = slurm_client(["scontrol", "-o", "show", "node", nodelist])
    ok = res is not None and res.returncode == 0
    return dead_nodes(res.stdout) if ok else {}


def never_starts(state: dict) -> bool:
    """A pending job Slurm will never start as asked (see NEVER_STARTS)."""
    return state["state"] == "PENDING" and state.get("reason") in NEVER_STARTS


# A key of `scontrol -o show` output: at the start or after a space, capitalised, then "="
# ('WorkDir=', 'AllocNode:Sid=', 'CPUs/Task=', 'MCS_label='). A value runs to the next key,
# so values with spaces (WorkDir, Comment, JobName, a node's OS) stay whole; a value that
# itself holds " Word=" would be cut there (Slurm 22.05 here has no `scontrol --json`).
_KEY = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_:/]*)=")


def parse_scontrol(text: str) -> dict:
    """`scontrol show job -o ID` -> {"JobState": ..., "Restarts": ..., ...}; of several
    lines (an array job), the first one's value of each key."""
    fields: dict = {}
    for line in text.splitlines():
        keys = list(_KEY.finditer(line))
        for key, after in zip(keys, keys[1:] + [None]):
            value = line[key.end():after.start() if after else len(line)]
            fields.setdefault(key.group(1), value.rstrip())
    return fields


def parse_scontrol_lines(text: str) -> list[dict]:
    """`scontrol -o show node|partition ...`: one dict per line."""
    return [parse_scontrol(line) for line in text.splitlines() if line.strip()]


def slurm_client(cmd: list[str], timeout: float = 20) -> Optional[subprocess.CompletedProcess]:
    """A Slurm client command's result (output as text, not checked); None when the tool
    is missing or does not answer within `timeout` s."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def state_from_fields(job_id: str, f: dict) -> dict:
    """`scontrol show job` fields -> what status and --wait show of a job."""
    restarts = f.get("Restarts", "0")
    return {"job_id": job_id, "state": f.get("JobState", "UNKNOWN"),
            "restarts": int(restarts) if restarts.isdigit() else 0, "reason": f.get("Reason"),
            "nodes": f.get("NodeList"), "exit_code": f.get("ExitCode"),
            "start_time": f.get("StartTime")}


def job_state(job_id: str) -> dict:
    res = slurm_client(["scontrol", "show", "job", "-o", str(job_id)])
    if res is not None and res.returncode == 0 and res.stdout.strip():
        return state_from_fields(str(job_id), parse_scontrol(res.stdout))
    res = slurm_client(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"])
    if res is not None and res.returncode == 0 and res.stdout.strip():
        state, _, code = res.stdout.strip().splitlines()[0].partition("|")
        return {"job_id": str(job_id), "state": state.split()[0], "exit_code": code}
    return {"job_id": str(job_id), "state": "UNKNOWN"}


def job_alive(job_id: str, ended_by_itself: bool = False) -> bool:
    """True while Slurm may still run this job (pending, running, requeued). A job whose
    batch shell recorded its end (`ended_by_itself`, storage/node_loss.py) is over once
    it is only COMPLETING: Slurm is waiting for a lost node's cleanup, nothing runs."""
    state = job_state(job_id)["state"]
    if state != "UNKNOWN":
        return state in LIVE_STATES and not (ended_by_itself and state == "COMPLETING")
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
