"""Operations on runs from the login node: submit to Slurm, render, logs, cancel, wait.

No torch here: these commands must answer fast on a login node.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from .errors import UserError
from .rundir import RunDir, read_lock


def _spec(args, run: RunDir, task: str, shape, restarts: int, name: Optional[str] = None):
    from .submit_slurm import build_spec

    nodes = str(args.nodes) if args.nodes is not None else None
    args.nodes_range = nodes if nodes and "-" in nodes else None
    return build_spec(args, run, task, shape, restarts, name=name)


def submit_to_slurm(args, run: RunDir, task: str, shape, restarts: int,
                    name: Optional[str] = None, step: Optional[int] = None) -> int:
    from .submit_slurm import submit

    spec = _spec(args, run, task, shape, restarts, name)
    job_id = submit(run, spec, step=step)
    print(f"submitted Slurm job {job_id} for {run.path}", file=sys.stderr)
    print(job_id)
    if getattr(args, "wait", False):
        return wait_for_job(job_id)
    return 0


def wait_for_job(job_id: str, poll_s: float = 1.0) -> int:
    """Block until the job leaves Slurm's live states, printing each new state and reason;
    0 only when it COMPLETED. A job Slurm will never start as asked is cancelled at once."""
    from .slurm_state import LIVE_STATES, cancel, describe, job_state, never_starts

    shown = None
    while True:
        state = job_state(job_id)
        if describe(state) != shown:
            shown = describe(state)
            print(f"Slurm job {job_id}: {shown}", file=sys.stderr, flush=True)
        if never_starts(state):
            cancel(job_id)
            raise UserError(f"Slurm job {job_id} can never start: Reason={state['reason']} "
                            "(beyond the partition's, account's or QOS's limits); cancelled "
                            "it: ask for fewer nodes, GPUs or less --time, or another --partition")
        if state["state"] not in LIVE_STATES:
            return 0 if state["state"] == "COMPLETED" else 1
        time.sleep(poll_s)


def cmd_render(args) -> int:
    """Print, byte for byte, the batch script `train`/`resume`/`predict --cluster slurm`
    would hand to sbatch for this run (dry run, nothing written)."""
    from .cli import load_flagged_config
    from .launch import shape_from_flags
    from .submit_slurm import batch_script, slurm_executor, submitit_folder
    from .rundir import run_dir_for

    target = Path(args.target)
    if (target / "config.yaml").exists():
        run = RunDir(target.resolve())
        cfg = run.load_config()
    else:
        cfg = load_flagged_config(str(target), args.overrides, args.site)
        run = run_dir_for(cfg)
    shape = shape_from_flags(cfg, args.nodes, args.gpus_per_node, args.procs_per_node)
    restarts = cfg.parallel.max_restarts if args.max_restarts is None else args.max_restarts

    spec_run = run if (run.path / "config.yaml").exists() else _ConfigOnlyRun(run.path, cfg)
    spec = _spec(args, spec_run, args.task, shape, restarts, args.name)
    sys.stdout.write(batch_script(slurm_executor(spec, submitit_folder(run.path))))
    return 0


def check_slurm_spec(args, cfg, task: str, shape, restarts: int, name: Optional[str] = None):
    """Build (and so validate) the job for a run that does not exist yet: bad Slurm flags,
    a run directory path Pyxis cannot carry, are refused before anything is written."""
    from .launch import with_shape
    from .rundir import run_dir_for

    run = run_dir_for(cfg)
    return _spec(args, _ConfigOnlyRun(run.path, with_shape(cfg, shape)), task, shape, restarts,
                 name)


class _ConfigOnlyRun(RunDir):
    """A run directory that does not exist yet: render needs its path and config only."""

    def __init__(self, path: Path, cfg) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_cfg", cfg)

    def load_config(self):
        return self._cfg


def _latest_log_dir(run: RunDir) -> Path:
    dirs = [d for d in run.logs.iterdir() if d.is_dir()] if run.logs.exists() else []
    if not dirs:
        raise UserError(f"{run.path}: no logs yet")
    return max(dirs, key=lambda d: d.stat().st_mtime)


def cmd_logs(args) -> int:
    run = RunDir(Path(args.run_dir).resolve())
    if not run.config_path.is_file():
        raise UserError(f"RUN_DIR: {run.path} is not a run directory (no config.yaml)")
    path = _latest_log_dir(run) / f"rank-{args.rank}.log"
    if not path.exists():
        raise UserError(f"--rank {args.rank}: no log at {path}")
    with open(path, encoding="utf-8", errors="replace") as fh:
        sys.stdout.write(fh.read())
        sys.stdout.flush()
        while args.follow:
            line = fh.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            elif read_lock(run) is None:
                break  # nothing holds the run: the job is over
            else:
                time.sleep(0.5)
    return 0


def cmd_cancel(args) -> int:
    """Cancel the run's live Slurm job, or stop its local launcher: only a job or process
    proven to be this run's is signalled (a forged lock or jobs.jsonl names someone else's)."""
    from .slurm_state import job_alive

    run = RunDir(Path(args.run_dir).resolve())
    if not run.config_path.is_file():
        raise UserError(f"RUN_DIR: {run.path} is not a run directory (no config.yaml)")
    owner = read_lock(run)
    jobs = [j for j in run.jobs() if j.get("kind") == "slurm"]
    if jobs and job_alive(str(jobs[-1]["job_id"])):
        return _cancel_slurm(run, str(jobs[-1]["job_id"]), jobs)
    if owner and not owner.get("slurm_job_id"):
        return _stop_launcher(run, owner)
    print(f"{run.path}: nothing is running")
    return 0


def _cancel_slurm(run: RunDir, job_id: str, jobs: list) -> int:
    from .slurm_state import cancel, job_belongs_to_run, job_fields

    fields = job_fields(job_id)
    names = {str(j["job_name"]) for j in jobs if str(j.get("job_id")) == job_id
             and j.get("job_name")}
    if not job_belongs_to_run(fields, str(run.path), names):
        raise UserError(f"jobs.jsonl: Slurm job {job_id} (name {fields.get('JobName')!r}) is not "
                        f"this run's (neither its name nor its paths match {run.path}); "
                        "not cancelling it: use scancel yourself if you mean it")
    cancel(job_id)
    print(f"cancelled Slurm job {job_id}")
    return 0


def _stop_launcher(run: RunDir, owner: dict) -> int:
    import socket

    from .process_identity import boot_id, identity, launcher_problem

    why = launcher_problem(owner, socket.gethostname(), boot_id(), identity)
    if why == "not running":
        print(f"{run.path}: nothing is running (the lock's launcher has exited)")
        return 0
    if why is not None:
        raise UserError(f"run.lock: not signalling pid {owner.get('pid')}: {why}; if the run "
                        f"is not running, remove {run.lock_path}")
    os.kill(owner["pid"], signal.SIGTERM)
    print(f"sent SIGTERM to local launcher pid {owner['pid']}")
    return 0
