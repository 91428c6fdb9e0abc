"""How a Slurm job ended or went on, as the batch shell (cluster/templates/host_setup.sh)
and the workers leave it in RUN_DIR/requeue/ for the workers, `status` and `doctor`:

- ``probing-JOB``: the epoch second the shell began asking which nodes still answer (the
  step's tasks on its node had ended, srun still waited); gone once the probe answered.
- ``relaunch-JOB``: ``key=value`` lines from the probe that found nodes missing: ``lost``
  and ``nodes`` (comma-separated host names); epoch seconds: ``ended`` (the step's tasks on
  the shell's node were first seen gone), ``probed`` (the probe began, once they were seen
  gone twice; absent in records of before it), ``detected`` (the probe decided), ``launched``;
  ``relaunch`` (its count in this attempt), ``world`` (the new step's task count; absent in
  records of before it). Rank 0 of the relaunched step records it once in metrics.jsonl and
  jobs.jsonl, with the step it resumed from and the new world size; until then `status`
  says a relaunch is under way (`relaunch_pending`).

- ``ended-JOB``: the batch shell left for good (not requeued): ``rc`` and ``time``, and
  where a lost node left fewer than the job's minimum: ``lost``, ``nodes`` (those that
  answered), ``min``. No task of the job runs after it; Slurm may still show the job
  COMPLETING for minutes (it waits for the lost node's cleanup), and this record is what
  frees the run for `resume` then (`ended_by_itself`) and what `status` explains.

- ``refused-JOB``: a rank refused its input (exit 2), one line saying why (worker/refusal.py
  writes it); the job is not requeued, and `status` and `doctor` show the line.

All are read as untrusted: regular files of bounded size, every value checked; anything
else reads as absent (the run goes on, only the record is lost).
"""
from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Optional

from enn_cluster.storage import layout
from enn_cluster.storage.job_record import RELAUNCH, JobRecord

MAX_BYTES = 4096
_HOST = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_NUMBER = re.compile(r"^\d{1,12}(\.\d{1,9})?$")


def _read_small(path: Path, encoding: str = "ascii") -> Optional[str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: no wait
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        return None
    return data.decode(encoding, "replace")


def _hosts(text: str) -> Optional[list[str]]:
    hosts = text.split(",") if text else []
    return hosts if hosts and all(_HOST.match(h) for h in hosts) else None


def parse_relaunch(text: str) -> Optional[dict]:
    """The relaunch record's fields, or None when one is missing or malformed."""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    lost, nodes = _hosts(fields.get("lost", "")), _hosts(fields.get("nodes", ""))
    times = [fields.get(k, "") for k in ("ended", "detected", "launched")]
    count = fields.get("relaunch", "")
    if lost is None or nodes is None or not all(_NUMBER.match(t) for t in times) \
            or not count.isdigit() or len(count) > 6:
        return None
    world, probed = fields.get("world", ""), fields.get("probed", "")
    return {"lost": lost, "nodes": nodes, "ended": float(times[0]), "detected": float(times[1]),
            "launched": float(times[2]), "relaunch": int(count),
            "world": int(world) if world.isdigit() and len(world) <= 9 else None,
            "probed": float(probed) if _NUMBER.match(probed) else None,
            # spare nodes (--spare-nodes): those taken into the step, those still held
            "spare_in": _hosts(fields.get("spare_in", "")) or [],
            "spares": _hosts(fields.get("spares", "")) or []}


def read_relaunch(run_path: Path, job_id: str) -> Optional[dict]:
    text = _read_small(layout.marker(run_path, "relaunch", job_id))
    return parse_relaunch(text) if text is not None else None


def probing_since(run_path: Path, job_id: str) -> Optional[float]:
    """When the batch shell of `job_id` began probing its nodes, or None (not probing)."""
    text = _read_small(layout.marker(run_path, "probing", job_id))
    text = (text or "").strip()
    return float(text) if _NUMBER.match(text) else None


def relaunch_under_way(run_path: Path, job_id: str, newest_attempt: Optional[str]) -> Optional[str]:
    """Why a live job's newest ranks may have exited while the job goes on, as one line:
    its batch shell is probing the nodes after a step ended, or it relaunched the step and
    the new workers have made no log folder yet (`slurm-JOB-rN-kK`, K the relaunch). None
    otherwise. Both last seconds to a minute; `doctor` must not call them a failure."""
    since = probing_since(run_path, job_id)
    if since is not None:
        return (f"job {job_id}: a step ended on its first node; its batch shell is asking "
                f"which nodes still answer (for {max(0, time.time() - since):.0f} s), to "
                "relaunch on those left")
    rec = read_relaunch(run_path, job_id)
    if rec is None or re.fullmatch(rf"slurm-{re.escape(str(job_id))}-r\d+-k{rec['relaunch']}",
                                   newest_attempt or ""):
        return None  # no relaunch, or its workers have started (worker/entry.py names the folder)
    return (f"job {job_id}: node {','.join(rec['lost'])} lost; relaunch {rec['relaunch']} "
            f"on {','.join(rec['nodes'])} is starting")


def relaunch_pending(rec: Optional[dict], recorded: list[dict], job_id: str) -> Optional[dict]:
    """The shell's relaunch record `rec` of job `job_id` while its new ranks have not yet
    resumed: no "node_lost" record among `recorded` (metrics.jsonl's) names this job and
    relaunch. None once one does, or where there is no record."""
    if rec is None or any(str(r.get("job_id")) == str(job_id) and r.get("relaunch") ==
                          rec["relaunch"] for r in recorded):
        return None
    return {**rec, "job_id": str(job_id)}


def record_relaunch(run, metrics, job_id: str, relaunch: int, world_size: int,
                    step: int) -> Optional[dict]:
    """Rank 0 of relaunch `relaunch`: the host's record of the lost node(s), with the step
    resumed from and the new world size, in metrics.jsonl ("node_lost") and jobs.jsonl
    (kind "relaunch"). None when the shell left no record for this relaunch."""
    rec = read_relaunch(run.path, job_id)
    if rec is None or rec["relaunch"] != relaunch:
        return None
    fields = {"job_id": job_id, "relaunch": relaunch, "lost": rec["lost"],
              "nodes": rec["nodes"], "ended": rec["ended"], "detected": rec["detected"],
              "launched": rec["launched"], "world_size": world_size, "step": step,
              **({"probed": rec["probed"]} if rec["probed"] is not None else {}),
              **({"spare_in": rec["spare_in"], "spares": rec["spares"]}
                 if rec["spare_in"] or rec["spares"] else {})}
    metrics.write("node_lost", **fields)
    run.record_job(JobRecord(kind=RELAUNCH, job_id=job_id, relaunch=relaunch,
                             lost=tuple(rec["lost"]), hosts=tuple(rec["nodes"]),
                             ended=rec["ended"], detected=rec["detected"],
                             launched=rec["launched"], world_size=world_size, step=step))
    return fields


def parse_ended(text: str) -> Optional[dict]:
    """The ended record's fields, or None when rc or time is missing or malformed; the
    node fields only where all three are well formed."""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    rc, when = fields.get("rc", ""), fields.get("time", "")
    if not (rc.isdigit() and len(rc) <= 3 and _NUMBER.match(when)):
        return None
    out = {"rc": int(rc), "time": float(when)}
    lost, nodes, least = _hosts(fields.get("lost", "")), fields.get("nodes", ""), fields.get("min", "")
    answered = _hosts(nodes) if nodes else []
    if lost is not None and answered is not None and least.isdigit() and len(least) <= 6:
        out.update(lost=lost, nodes=answered, min=int(least))
    return out


def read_ended(run_path: Path, job_id: str) -> Optional[dict]:
    text = _read_small(layout.marker(run_path, "ended", job_id))
    return parse_ended(text) if text is not None else None


def read_refusal(run_path: Path, job_id: str) -> Optional[str]:
    """Why a rank of `job_id` refused its input: the note's first line, printable characters
    only (it may hold a path in any script), or None where there is none."""
    text = _read_small(layout.marker(run_path, "refused", job_id), "utf-8")
    line = (text or "").split("\n", 1)[0]
    line = "".join(c if c.isprintable() else "?" for c in line).strip()
    return line[:400] or None


def ended_by_itself(run_path: Path, job_id) -> bool:
    """Did job `job_id`'s batch shell record its own end (nothing of it runs any more)?"""
    return read_ended(run_path, str(job_id)) is not None
