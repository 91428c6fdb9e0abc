"""Run a task of a run, watch it, cancel it: the functions behind both the CLI and the
Python API. They take a LaunchPlan (launch_plan.plan_launch), never parsed CLI flags, so
the two front ends cannot drift; each front end only turns its own input into a plan.

No torch here: these must answer fast on a login node.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Callable, Optional

from enn_cluster.client.launch_plan import LaunchPlan
from enn_cluster.cluster.slurm_watch import wait_for_job
from enn_cluster.cluster.submit_slurm import submit
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import RunDir, remove_new_run, run_dir_for
from enn_cluster.storage.run_lock import read_lock
from enn_cluster.storage.run_files import check_run_file


def load_flagged_config(config: Optional[str], overrides: list, site: Optional[str],
                        run_name: Optional[str] = None, runs_root: Optional[str] = None,
                        read_site=None):
    """The CLI's config: the file, --set and the name flags (verbatim strings: 'exp #3'
    stays 'exp #3', 0010 stays 0010), through `resolved_config`. `read_site()`: the site
    config as this command reads it once (default: from `site`)."""
    from enn_cluster.cluster.site import load_site
    from enn_cluster.config.yaml_file import read_yaml

    verbatim = {k: v for k, v in (("run_name", run_name), ("runs_root", runs_root))
                if v is not None}
    data = read_yaml(config) if config is not None else {}  # "" is refused, not the defaults
    return resolved_config(data, list(overrides), verbatim, read_site or (lambda: load_site(site)))


def resolved_config(data: dict, overrides: list, verbatim: dict, read_site):
    """The one config step of a new run, for the CLI and the API alike: `data` (a config
    file's), then `overrides` (--set KEY=VALUE, YAML values), then `verbatim` (top-level
    values taken as given); the site's runs_root where none of them names one, so a run
    lands on the shared filesystem whatever the caller's cwd. `read_site()` is called
    every time: a site file named but missing or malformed is refused even when the run
    does not need its runs_root."""
    from enn_cluster.config.loading import layered_config

    named = "runs_root" in data or "runs_root" in verbatim or \
        any(o.startswith("runs_root=") for o in overrides)
    site_root = read_site().runs_root  # read even when not needed: a bad site is refused
    if site_root and not named:
        verbatim = {**verbatim, "runs_root": site_root}
    return layered_config(data, overrides, verbatim)


def create_train_run(plan: LaunchPlan, arrays: Optional[dict] = None, populate_extra=None,
                     gpu_mem_gb: Optional[float] = None) -> tuple[RunDir, LaunchPlan]:
    """A new run for `train`: a job Slurm cannot take and a plan that cannot fit the GPUs
    (`gpu_mem_gb` each; default: the site's, else 80) are refused before anything is
    written, then the run directory with its staged data. Returns the run and the plan
    with its Slurm job built for it."""
    from enn_cluster.client.model_shape import check_fits
    from enn_cluster.client.prepare import prepare_run_and_config

    plan = plan.for_job(run_dir_for(plan.cfg).path)
    if gpu_mem_gb is None and plan.slurm is not None:
        gpu_mem_gb = plan.slurm.site_options().gpu_mem_gb
    check_fits(plan.cfg, plan.shape.nodes, plan.shape.gpus_per_node, gpu_mem_gb,
               arrays_given=bool(arrays))
    run, frozen = prepare_run_and_config(plan, arrays=arrays, populate_extra=populate_extra)
    return run, replace(plan, cfg=frozen)


@contextmanager
def removed_if_never_run(run: RunDir):
    """Around the first submit of a run the command itself made: when sbatch refuses it, the
    run never ran, and the command leaves nothing behind (refused as a whole)."""
    try:
        yield
    except UserError:
        if not run.jobs():
            remove_new_run(run)
        raise


def check_control_files(run: RunDir) -> None:
    """A hand-edited run.lock or jobs.jsonl, or a metrics file that is not a regular file
    (the workers would block opening a FIFO), is refused in one line before anything is
    written (the lock would otherwise be found only after the config was re-frozen)."""
    read_lock(run)
    run.jobs()
    check_run_file(run.metrics)


@dataclass(frozen=True)
class Started:
    """What `start` did: the Slurm job it submitted (None: a local launch), and the exit
    code of what it waited for (None: it did not wait)."""

    job_id: Optional[str]
    code: Optional[int]


def start(run: RunDir, plan: LaunchPlan, name: Optional[str] = None,
          step: Optional[int] = None, *, wait: Optional[bool] = None, fresh: bool = False,
          announce: Optional[Callable[[str], None]] = None, own_process: bool = False) -> Started:
    """The one Slurm-or-local branch of a launch, for the CLI and the API alike: the plan's
    Slurm job to sbatch (`announce(job_id)` once submitted; `fresh`: a run this command just
    made, removed if sbatch refuses it), else the local launcher here. `wait`: wait for the
    job or the launcher (default: the Slurm request's --wait; a local launch waits); a local
    launch not waited for runs detached (`launch_detached`). `own_process`: this process is
    ours (the CLI's, a detached launcher's), which the local workers may be forked from."""
    from enn_cluster.client.prepare import run_local

    if plan.slurm is not None:
        with removed_if_never_run(run) if fresh else nullcontext():
            job_id = submit_plan(run, plan, name, step)
        if announce is not None:
            announce(job_id)
        wait = plan.slurm.wait if wait is None else wait
        return Started(job_id, wait_for_job(job_id, run=run) if wait else None)
    if wait is False:
        launch_detached(run, plan, name, step)
        return Started(None, None)
    return Started(None, run_local(run, plan, name=name, step=step, fork=own_process))


def launch(run: RunDir, plan: LaunchPlan, name: Optional[str] = None,
           step: Optional[int] = None) -> int:
    """The CLI's launch (`start`): its Slurm job id on stdout, or what the local launch
    came to on stderr; the exit code."""
    def submitted(job_id: str) -> None:
        print(f"submitted Slurm job {job_id} for {run.path}", file=sys.stderr)
        print(job_id, flush=True)

    started = start(run, plan, name, step, announce=submitted, own_process=True)
    if started.job_id is not None:
        return started.code or 0
    code = started.code
    if code == 0 and plan.task == "train":
        print(f"done: checkpoints in {run.checkpoints}, metrics in "
              f"{run.path / plan.cfg.logging.metrics_path}", file=sys.stderr)
    elif code == 75:
        print(f"stopped with a committed checkpoint; continue with: enn-submit resume {run.path}",
              file=sys.stderr)
    return code


def submit_plan(run: RunDir, plan: LaunchPlan, name: Optional[str] = None,
                step: Optional[int] = None) -> str:
    """Hand the plan's job for `run` (built once: reused when the plan holds it) to Slurm;
    returns the job id."""
    spec = plan.for_job(run.path, name).spec
    return submit(run, spec, step=step, cfg=plan.cfg)


def launch_detached(run: RunDir, plan: LaunchPlan, name: Optional[str] = None,
                    step: Optional[int] = None) -> subprocess.Popen:
    """`launch` (local) in a process of its own session that outlives the caller: a
    notebook's `wait=False`. The child is handed this very plan (pickled, on its stdin:
    the config as this call froze it, the shape, the restarts), not a description to
    rebuild one from. Its output goes to logs/api-launcher.log."""
    with open(run.logs / "api-launcher.log", "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.launching"],
                                 stdin=subprocess.PIPE, stdout=log, stderr=log,
                                 start_new_session=True)
    with child.stdin as pipe:
        pickle.dump((str(run.path), plan, name, step), pipe)
    return child


def detached_child(handed: BinaryIO) -> int:
    """`launch_detached`'s child: the plan from `handed`, then `launch`, with no stdin
    left for the workers (they must not read the notebook's)."""
    path, plan, name, step = pickle.load(handed)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        return launch(RunDir(Path(path)), plan, name, step)
    except UserError as exc:
        print(f"enn-submit: error: {exc}", file=sys.stderr)
        return 2



def cancel_run(run: RunDir) -> int:
    """Cancel the run's live Slurm job, or stop its local launcher: only a job or process
    proven to be this run's is signalled (a forged lock or jobs.jsonl names someone else's)."""
    from enn_cluster.cluster.slurm import alive, job_state

    RunDir.existing(run.path)
    owner = read_lock(run)
    jobs = [j for j in run.jobs() if j.is_slurm]
    state = job_state(jobs[-1].job_id) if jobs else None  # one answer: alive, and whose
    if state is not None and alive(state):
        return _cancel_slurm(run, state)
    if owner and not owner.get("slurm_job_id"):
        return _stop_launcher(run, owner)
    print(f"{run.path}: nothing is running")
    return 0


def _cancel_slurm(run: RunDir, state: dict) -> int:
    from enn_cluster.cluster.slurm import cancel, job_belongs_to_run
    from enn_cluster.storage.run_lock import clear_lock_of_job

    job_id = state["job_id"]
    if not job_belongs_to_run(state, run.path):
        raise UserError(f"jobs.jsonl: Slurm job {job_id} is not proven this run's (its comment "
                        "is not the one enn-submit gave it for this run); not cancelling it: "
                        f"use scancel {job_id} yourself if you mean it")
    cancel(job_id)
    cleared = clear_lock_of_job(run, job_id)
    print(f"cancelled Slurm job {job_id}" + (f"; removed its {run.lock_path.name}" if cleared else ""))
    return 0


def _stop_launcher(run: RunDir, owner: dict) -> int:
    import socket

    from enn_cluster.storage.process_identity import (
        boot_id,
        holds_open,
        identity,
        launcher_problem,
    )
    from enn_cluster.storage.run_lock import signal_refusal

    why = launcher_problem(owner, socket.gethostname(), boot_id(), identity)
    if why is None and not holds_open(owner["pid"], run.lock_path):
        why = (f"pid {owner['pid']} does not hold {run.lock_path.name} open, so it is not this "
               "run's launcher (a lock copied from another process?)")
    if why is None:  # the pid holds this very file: it must be this run's own, naming it
        why = signal_refusal(run, owner)
    if why == "not running":
        print(f"{run.path}: nothing is running (the lock's launcher has exited)")
        return 0
    if why is not None:
        raise UserError(f"run.lock: not signalling pid {owner.get('pid')}: {why}; if the run "
                        f"is not running, remove {run.lock_path}")
    os.kill(owner["pid"], signal.SIGTERM)
    print(f"sent SIGTERM to local launcher pid {owner['pid']}")
    return 0


if __name__ == "__main__":  # launch_detached's child
    sys.exit(detached_child(sys.stdin.buffer))
