"""What a run is doing, read from its directory (and Slurm, for Slurm jobs), as one dict
that status_text.py words. No torch."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from enn_cluster.errors import UserError
from enn_cluster.storage import backend_report
from enn_cluster.storage import commits as store
from enn_cluster.storage import node_loss
from enn_cluster.storage import oom_record
from enn_cluster.storage.attempts import attempt_dirs
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.metrics import scan_metrics
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import read_lock
from enn_cluster.storage.run_files import read_run_text


def run_status(path: Path, verified: Optional[dict] = None, slurm=None) -> dict:
    """`verified`: checksum results to reuse between calls (status --follow); `slurm`: the
    SlurmWatch that asks Slurm (status --follow keeps one, which backs off)."""
    from enn_cluster.cluster.slurm_watch import SlurmWatch

    slurm = slurm or SlurmWatch()
    run = RunDir(Path(path))
    last_train, last_eval, resumes, start, lost = None, None, 0, None, []
    found, unreadable = scan_metrics(run.metrics)
    for rec in found:
        kind = rec.get("kind")
        if kind == "train":
            last_train = rec
        elif kind == "eval":
            last_eval = rec
        elif kind == "resume" and not rec.get("initial_weights"):  # an API run's start
            resumes += 1
        elif kind == "start":
            start = rec
        elif kind == "node_lost":  # rank 0 of the relaunch: after the old step's last record
            lost.append(with_last_step(rec, last_train))
    if not found and unreadable:
        raise UserError(f"{run.metrics}: no readable record in it (a run writes JSON lines "
                        "there); it is damaged: move it aside to see the rest of the status")
    jobs = with_unrecorded_slurm_jobs(run.jobs(), _slurm_log_dirs(run))
    status = {
        "run_dir": str(run.path),
        "last_step": last_train["step"] if last_train else None,
        "last_loss": last_train["loss"] if last_train else None,
        "last_eval_loss": last_eval["eval_loss"] if last_eval else None,
        "resumes": resumes,
        "total_steps": start["total_steps"] if start else None,
        "step_time_s": last_train.get("step_time_s") if last_train else None,
        "samples_per_s": last_train.get("samples_per_s") if last_train else None,
        "checkpoints": store.committed_steps(run.checkpoints),
        "jobs": [job.as_json() for job in jobs],
        "lock": live_lock(run, slurm.job_alive),
        "node_losses": lost,
    }
    # a launcher holds the run but its workers have not started training yet (5-15 s of
    # imports and rendezvous): the totals shown are the previous launch's
    status["starting"] = bool(status["lock"]) and (
        start is None or start.get("time", 0) < status["lock"].get("time", 0))
    # "last complete" is a step whose bytes match their checksums, as resume will find it
    status["last_checkpoint"], status["corrupt_checkpoints"] = store.newest_verified(
        run.checkpoints, verified)
    attempt, reports = backend_report.newest_reports(attempt_dirs(run))
    status["backends"] = {"attempt": attempt, "ranks": reports,
                          "lines": backend_report.summarize(reports)}
    status["nonfinite"] = nonfinite_dumps(run.path / "nonfinite")
    status["oom"] = oom_record.read_record(run.path)
    status["save_over_grace"] = save_grace_line(run, jobs)
    job = newest_slurm_job(jobs)
    if job is not None:
        status["slurm"] = without_nodes_gone_on_from(slurm.job_state(job), lost)
        status["probing_since"] = node_loss.probing_since(run.path, job)
        status["ended"] = node_loss.read_ended(run.path, job)
        status["refused"] = node_loss.read_refusal(run.path, job)
        status["relaunch"] = with_last_step(node_loss.relaunch_pending(
            node_loss.read_relaunch(run.path, job), lost, job), last_train)
    return status


def without_nodes_gone_on_from(state: dict, lost: list[dict]) -> dict:
    """The job's state less the dead nodes it has already gone on without (a node_lost
    record of this job names them): Slurm keeps a lost node in a relaunched job's node list
    until it declares the node down, minutes later, and "node down ... stays RUNNING" would
    be said of a job that is training again on the nodes left."""
    gone = {n for r in lost if str(r.get("job_id")) == str(state.get("job_id"))
            for n in (r.get("lost") or [])}
    dead = state.get("dead_nodes")
    if not dead or not gone:
        return state
    return {**state, "dead_nodes": {n: s for n, s in dead.items() if n not in gone}}


def with_last_step(rec: Optional[dict], train: Optional[dict]) -> Optional[dict]:
    """A lost node's record with the newest training step logged before its ranks ended
    (`last_step`, `last_step_time`): every rank took part in that step's collectives, so
    the node was lost after it. `train`: the newest "train" record before `rec` in
    metrics.jsonl. Unchanged where the times do not say so."""
    when, ended = (train or {}).get("time"), (rec or {}).get("ended")
    if rec is None or not all(isinstance(v, (int, float)) for v in (when, ended)) \
            or when > ended:
        return rec
    return {**rec, "last_step": train.get("step"), "last_step_time": when}


def newest_slurm_job(jobs: list[JobRecord]) -> Optional[str]:
    """The id of the run's newest Slurm job (the one status and doctor speak of), or None."""
    ids = [j.job_id for j in jobs if j.is_slurm]
    return ids[-1] if ids else None


# worker log dirs: slurm-<job>-r<restart>[-k<relaunch after a lost node>]
_SLURM_ATTEMPT = re.compile(r"^slurm-(\d+)-r\d+(?:-k\d+)?$")


def _slurm_log_dirs(run: RunDir) -> list[tuple[str, float]]:
    """(name, mtime) of the workers' per-attempt log directories."""
    if not run.logs.is_dir():
        return []
    return [(d.name, d.stat().st_mtime) for d in run.logs.iterdir() if d.is_dir()]


def save_grace_line(run: RunDir, jobs: list[JobRecord]) -> Optional[str]:
    """The newest recorded save time against the stop signal's grace of the run's newest
    Slurm job (its recorded --signal-grace, else the site default); None when it fits."""
    found = store.last_save_seconds(run.checkpoints)
    slurm = [j for j in jobs if j.is_slurm]
    if found is None or not slurm:
        return None
    from enn_cluster.cluster.site import DEFAULTS

    return store.save_over_grace(*found, slurm[-1].signal_grace_s
                                 or DEFAULTS["signal_grace_s"])


def with_unrecorded_slurm_jobs(jobs: list[JobRecord],
                               log_dirs: list[tuple[str, float]]) -> list[JobRecord]:
    """`jobs` plus the Slurm jobs only the workers' logs know, in time order. A job from
    slurm/*.sbatch or a site's own srun line is recorded by its rank 0 once it takes the
    run lock (worker_lock); one that ended before that (or whose lock was refused) left
    only its slurm-<job>-r<n> log folder."""
    known = {str(j.job_id) for j in jobs}
    found: dict[str, float] = {}
    for name, mtime in log_dirs:
        match = _SLURM_ATTEMPT.match(name)
        if match and match.group(1) not in known:
            found[match.group(1)] = max(mtime, found.get(match.group(1), 0.0))
    if not found:
        return jobs
    extra = [JobRecord(kind="slurm", job_id=job, time=t, source="logs")
             for job, t in found.items()]
    return sorted(jobs + extra, key=lambda j: j.time if isinstance(j.time, (int, float)) else 0.0)


def live_lock(run: RunDir, job_alive=None):
    """The lock's owner, only while it is alive (a finished job leaves its lock behind)."""
    owner = read_lock(run)
    if not owner:
        return None
    if owner.get("slurm_job_id"):
        from enn_cluster.cluster.slurm import job_alive as ask
        from enn_cluster.storage.run_lock import for_run

        alive = for_run(run.path, job_alive or ask)
        return owner if alive(str(owner["slurm_job_id"])) else None
    from enn_cluster.storage.run_lock import owner_alive

    return owner if owner_alive(owner) else None


def nonfinite_dumps(folder: Path) -> Optional[dict]:
    """How many non-finite dumps the run holds and the newest one's content (None: none)."""
    import json

    found = sorted((int(m.group(1)), p) for p in folder.glob("step-*.json")
                   if (m := re.fullmatch(r"step-(\d+)\.json", p.name)))
    if not found:
        return None
    step, newest = found[-1]
    try:
        record = json.loads(read_run_text(newest))
    except (OSError, ValueError, RecursionError, UserError) as exc:
        record = {"unreadable": str(exc)[:80]}
    if not isinstance(record, dict):  # a run file is untrusted: valid JSON, wrong shape
        record = {"unreadable": f"a JSON {type(record).__name__}, not an object"}
    return {"count": len(found), "step": step, "path": str(newest), "record": record}
