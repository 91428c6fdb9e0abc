"""The one module that asks Slurm anything: job states, node states, the partition shape,
ping, cancel. Everything else takes its answers (or a callable, as the run lock does).

Why one gateway, machine-readable: scraping `scontrol show job -o` cuts a value that holds
" Word=" and took two calls for one answer. Jobs come from one `squeue --Format` call per
poll for every id asked (as submitit's watcher does), each field followed by '|' and the
free-text comment last, so a '|' inside it stays whole; jobs the controller has forgotten
(MinJobAge) from one `sacct --parsable2` call where accounting runs. Nodes come from
`sinfo`. Only the partition shape still reads `scontrol -o show partition|node` (sinfo has
no CPUEfctv); its fields hold no spaces. Parsing is pure and tested with captured text;
the shell side (templates/host_setup.sh) matches states from LIVE_STATES, rendered in.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Iterable, Optional

from enn_cluster.errors import UserError
from enn_cluster.storage.run_lock import run_identity

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

# A node's state words that mean Slurm no longer hears from it, or has given it up; sinfo
# marks a node that does not answer with a trailing '*', a powered-off one with '~'.
DEAD_NODE_STATES = ("DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "POWERED_DOWN", "POWER_DOWN")

# squeue --Format fields, in order; the comment (free text) last.
JOB_FIELDS = ("JobID", "State", "Reason", "RestartCnt", "NodeList", "NumNodes", "StartTime",
              "Comment")


def client(cmd: list[str], timeout: float = 20) -> Optional[subprocess.CompletedProcess]:
    """A Slurm client command's result (output as text, not checked); None when the tool
    is missing or does not answer within `timeout` s."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def can_ask() -> bool:
    """Is there a Slurm client here? Inside a container image there usually is none."""
    return shutil.which("squeue") is not None


# -- jobs ---------------------------------------------------------------------------------

def squeue_command(ids: Iterable[str]) -> list[str]:
    """One squeue call for every job in `ids`, finished ones the controller still holds too."""
    return ["squeue", "-h", "-t", "all", "-j", ",".join(ids),
            "-O", ",".join(f"{name}:|" for name in JOB_FIELDS)]


def _reason(text: str) -> Optional[str]:
    """squeue's reason in scontrol's spelling (spaces as '_'): one word per reason, as
    NEVER_STARTS and the messages name it."""
    text = text.strip()
    return text.replace(" ", "_") if text else None


def parse_squeue(text: str) -> dict[str, dict]:
    """squeue_command's output -> {job id: state}; of an array's lines, the first."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        parts = line.split("|", len(JOB_FIELDS) - 1)
        if len(parts) < len(JOB_FIELDS):
            continue
        job_id, state, reason, restarts, nodes, count, start, comment = parts
        job_id = job_id.strip().split("_")[0]
        comment = comment[:-1] if comment.endswith("|") else comment
        out.setdefault(job_id, {
            "job_id": job_id, "state": state.strip().split()[0] if state.strip() else "UNKNOWN",
            "restarts": int(restarts) if restarts.strip().isdigit() else 0,
            "reason": _reason(reason), "nodes": nodes.strip() or None,
            "node_count": int(count) if count.strip().isdigit() else None,
            "exit_code": None, "start_time": start.strip() or None,
            "comment": None if comment in ("", "(null)") else comment})
    return out


def parse_sacct(text: str) -> dict[str, dict]:
    """`sacct -n -X --parsable2 -o JobIDRaw,State,ExitCode` -> {job id: state}."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        job_id, _, rest = line.partition("|")
        state, _, code = rest.partition("|")
        if job_id.strip() and state.strip():
            out.setdefault(job_id.strip(), {"job_id": job_id.strip(),
                                            "state": state.split()[0], "exit_code": code})
    return out


def job_states(ids: Iterable) -> dict[str, dict]:
    """Every job's state in at most two calls: squeue for what the controller holds, sacct
    for the rest; a job neither knows is UNKNOWN."""
    ids = list(dict.fromkeys(str(i) for i in ids))
    found: dict[str, dict] = {}
    if ids:
        res = client(squeue_command(ids))
        if res is not None and res.returncode == 0:
            found.update(parse_squeue(res.stdout))
    missing = [i for i in ids if i not in found]
    if missing:
        res = client(["sacct", "-n", "-X", "--parsable2", "-j", ",".join(missing),
                      "-o", "JobIDRaw,State,ExitCode"])
        if res is not None and res.returncode == 0:
            found.update({k: v for k, v in parse_sacct(res.stdout).items() if k in missing})
    return {i: found.get(i, {"job_id": i, "state": "UNKNOWN"}) for i in ids}


def job_state(job_id) -> dict:
    return job_states([job_id])[str(job_id)]


def alive(state: dict, ended_by_itself: bool = False) -> bool:
    """True while Slurm may still run this job (pending, running, requeued). A job whose
    batch shell recorded its end (`ended_by_itself`, storage/node_loss.py) is over once
    it is only COMPLETING: Slurm is waiting for a lost node's cleanup, nothing runs."""
    return state["state"] in LIVE_STATES and not (ended_by_itself
                                                  and state["state"] == "COMPLETING")


def job_alive(job_id, ended_by_itself: bool = False) -> bool:
    """The run lock's liveness callable (storage/run_lock.for_run) where Slurm can be asked."""
    return alive(job_state(job_id), ended_by_itself)


def job_belongs_to_run(state: dict, run_path) -> bool:
    """Is this Slurm job one of the run's? Only its comment says so: names are public in
    squeue and jobs.jsonl is writable by whoever can write the run, but a job's comment is
    set by its submitter alone (storage/run_lock.run_identity)."""
    return state.get("comment") == run_identity(run_path)


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


# Pending reasons that mean the job waits for nodes Slurm has down, drained or reserved.
NODES_UNAVAILABLE = ("ReqNodeNotAvail", "Nodes_required_for_job_are_DOWN")


def unavailable_nodes(reason: Optional[str]) -> Optional[str]:
    """'n3' of 'ReqNodeNotAvail,_UnavailableNodes:n3'; None where the reason names none."""
    _, _, nodes = (reason or "").partition("UnavailableNodes:")
    return nodes.strip(",_ ") or None


def pending_why(state: dict) -> Optional[str]:
    """What a pending job waits for, in words, with Slurm's reason (None: not pending, or
    held until a begin time, which held_until says)."""
    reason = state.get("reason") or "None"
    if state.get("state") != "PENDING" or reason in ("None", "BeginTime"):
        return None
    if reason in NEVER_STARTS:
        return (f"Slurm will never start it as asked (Reason={reason}: beyond the partition's, "
                "account's or QOS's limits)")
    if reason.startswith(NODES_UNAVAILABLE):
        named = unavailable_nodes(reason)
        return (f"waits for {'node ' + named if named else 'nodes'} that Slurm has down, "
                f"drained or reserved (Reason={reason}); `sinfo -R` says why")
    words = {"Resources": "waits for nodes to become free",
             "Priority": "waits behind jobs of higher priority",
             "Dependency": "waits for the jobs it depends on",
             "JobHeldUser": "held by its user (scontrol release JOBID)",
             "JobHeldAdmin": "held by an administrator"}
    if reason in words:
        return f"{words[reason]} (Reason={reason})"
    if (reason.startswith(("QOS", "Assoc")) and "PerUser" in reason) or reason.endswith("Limit"):
        return f"waits until running jobs leave room under a limit (Reason={reason})"
    return f"Reason={reason}"


def never_starts(state: dict) -> bool:
    """A pending job Slurm will never start as asked (see NEVER_STARTS)."""
    return state["state"] == "PENDING" and state.get("reason") in NEVER_STARTS


def cancel(job_id) -> None:
    res = client(["scancel", str(job_id)])
    if res is None or res.returncode != 0:
        raise UserError(f"scancel {job_id} failed: "
                        f"{res.stderr.strip() if res else 'scancel not found'}")


def ping() -> Optional[subprocess.CompletedProcess]:
    """`scontrol ping`'s result; None: no scontrol, or no answer in time."""
    return client(["scontrol", "ping"], timeout=15)


# -- nodes --------------------------------------------------------------------------------

def dead_nodes(text: str) -> dict:
    """`sinfo -h -N -n NODES -o '%N|%T'` -> {node: STATE} for the nodes Slurm no longer
    hears from ('IDLE*', 'MIXED*', 'DOWN*', 'DOWN'); a node listed once per partition
    counts once."""
    out = {}
    for line in text.splitlines():
        node, _, state = line.strip().partition("|")
        state = state.strip().upper()
        words = set(re.split(r"[+*~#$@^-]", state)) - {""}
        if node and (state.endswith(("*", "~")) or words & set(DEAD_NODE_STATES)):
            out[node] = state
    return out


def nodes_not_answering(nodelist: Optional[str]) -> dict:
    """The nodes of `nodelist` Slurm no longer hears from, asked in one sinfo call ({} when
    none, or when Slurm cannot say)."""
    if not nodelist or nodelist == "(null)":
        return {}
    res = client(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%T"])
    ok = res is not None and res.returncode == 0
    return dead_nodes(res.stdout) if ok else {}


# -- the partition shape (scontrol -o: sinfo has no CPUEfctv) -----------------------------

# A key of `scontrol -o show` output: at the start or after a space, capitalised, then "=".
# A value runs to the next key (a node's OS keeps its spaces); one holding " Word=" would be
# cut there, which is why jobs are read from squeue instead.
_KEY = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_:/]*)=")


def parse_scontrol(text: str) -> dict:
    """One `scontrol -o show ...` line -> {"NodeName": ..., "CPUTot": ...}; of several
    lines, the first one's value of each key."""
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


def show(*args: str) -> tuple[Optional[str], str]:
    """`scontrol -o ARGS`'s output, or None and why not (the partition shape's questions)."""
    res = client(["scontrol", "-o", *args], timeout=15)
    if res is None:
        return None, "no scontrol here, or it did not answer"
    if res.returncode != 0:
        said = (res.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"scontrol {' '.join(args)}: {said[:120]}"
    return res.stdout, ""


def lock_liveness():
    """What a run lock's Slurm owner is judged by here (storage/run_lock takes it as a
    callable): Slurm's answer where a client is installed, None (the host side's answer
    passed in, else taken for alive) inside an image without one."""
    return job_alive if can_ask() else None
