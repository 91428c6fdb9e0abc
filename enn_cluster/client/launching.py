"""Run a task of a run, watch it, cancel it: the functions behind both the CLI and the
Python API. They take values (a LaunchShape, a SlurmRequest), never parsed CLI flags, so
the two front ends cannot drift; each front end only turns its own input into these.

No torch here: these must answer fast on a login node.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from enn_cluster.cluster.submit_slurm import SlurmRequest, build_spec, submit, submitit_folder
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import RunDir, remove_new_run, run_dir_for
from enn_cluster.storage.run_lock import read_lock
from enn_cluster.storage.run_files import check_run_file

if TYPE_CHECKING:  # prepare stages data (numpy): imported by the commands that launch
    from enn_cluster.client.prepare import LaunchShape


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


def checked_shape(cfg, nodes, gpus_per_node: Optional[int], procs_per_node: Optional[int], *,
                  local: bool) -> "LaunchShape":
    """The shape asked for (the CLI's flags, the API's `cluster=` dict); a local run's also
    checked against this machine."""
    from enn_cluster.client.prepare import shape_from_flags

    shape = shape_from_flags(cfg, nodes, gpus_per_node, procs_per_node)
    if local:
        check_local_capacity(shape, procs_per_node is not None)
    return shape


def create_train_run(cfg, shape: "LaunchShape", restarts: int, slurm: Optional[SlurmRequest],
                     arrays: Optional[dict] = None, populate_extra=None,
                     gpu_mem_gb: Optional[float] = None):
    """A new run for `train`: a job Slurm cannot take and a plan that cannot fit the GPUs
    (`gpu_mem_gb` each; default: the site's, else 80) are refused before anything is
    written, then the run directory with its staged data. Returns (run, the config frozen into it,
    the JobSpec built for Slurm or None)."""
    from enn_cluster.client.model_shape import check_fits
    from enn_cluster.client.prepare import prepare_run_and_config

    spec = check_slurm_spec(slurm, cfg, "train", shape, restarts) if slurm is not None else None
    if gpu_mem_gb is None and slurm is not None:
        gpu_mem_gb = slurm.site_config.gpu_mem_gb
    check_fits(cfg, shape.nodes, shape.gpus_per_node, gpu_mem_gb, arrays_given=bool(arrays))
    run, frozen = prepare_run_and_config(cfg, shape, arrays=arrays, populate_extra=populate_extra)
    return run, frozen, spec


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


def max_restarts(requested: Optional[int], cfg) -> int:
    value = cfg.parallel.max_restarts if requested is None else requested
    if value < 0:
        raise UserError(f"--max-restarts: {value} must be >= 0")
    return value


def check_control_files(run: RunDir) -> None:
    """A hand-edited run.lock or jobs.jsonl, or a metrics file that is not a regular file
    (the workers would block opening a FIFO), is refused in one line before anything is
    written (the lock would otherwise be found only after the config was re-frozen)."""
    read_lock(run)
    run.jobs()
    check_run_file(run.metrics)


LOCAL_PROCS_PER_CPU = 4  # the most local processes per CPU we start without being told to


def check_local_capacity(shape: LaunchShape, procs_given: bool, cpus: Optional[int] = None) -> None:
    """The local launcher starts every process on this machine: a shape meant for GPU nodes
    (`--nodes 4 --gpus-per-node 8`) would start 32 trainers on a login node. Refused beyond a
    few processes per CPU unless --procs-per-node says the number on purpose."""
    cpus = cpus or os.cpu_count() or 1
    cap = max(8, LOCAL_PROCS_PER_CPU * cpus)
    if not procs_given and shape.world > cap:
        raise UserError(f"--procs-per-node: a local run would start {shape.nodes} x "
                        f"{shape.procs_per_node} = {shape.world} processes on this machine "
                        f"({cpus} CPUs; at most {cap} unless asked for); pass --procs-per-node "
                        "to mean it, or --cluster slurm to run on the cluster")


def launch(run: RunDir, task: str, shape: LaunchShape, restarts: int,
           slurm: Optional[SlurmRequest] = None, name: Optional[str] = None,
           step: Optional[int] = None, spec=None, cfg=None) -> int:
    """Start the workers: through Slurm when `slurm` is given, else here (local launcher).
    `spec`: the JobSpec already built from `slurm` for this run (built once per submit).
    `cfg`: the run's config as the command holds it; read from the run only when not given
    (the detached launcher, a command that has not loaded it)."""
    from enn_cluster.client.prepare import run_local

    cfg = run.load_config() if cfg is None else cfg
    if slurm is not None:
        return submit_to_slurm(slurm, run, task, shape, restarts, name=name, step=step,
                               spec=spec, cfg=cfg)
    code = run_local(run, task, shape, restarts, name=name, step=step, cfg=cfg)
    if code == 0 and task == "train":
        print(f"done: checkpoints in {run.checkpoints}, metrics in "
              f"{run.path / cfg.logging.metrics_path}", file=sys.stderr)
    elif code == 75:
        print(f"stopped with a committed checkpoint; continue with: enn-submit resume {run.path}",
              file=sys.stderr)
    return code


def launch_detached(run: RunDir, task: str, shape: LaunchShape, restarts: int) -> subprocess.Popen:
    """`launch` (local) in a process of its own session that outlives the caller: a
    notebook's `wait=False`. Its output goes to logs/api-launcher.log."""
    spec = json.dumps({"run": str(run.path), "task": task, "nodes": shape.nodes,
                       "procs_per_node": shape.procs_per_node,
                       "gpus_per_node": shape.gpus_per_node, "restarts": restarts})
    with open(run.logs / "api-launcher.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "enn_cluster.client.launching", spec],
                                stdout=log, stderr=log, start_new_session=True)


def slurm_spec(request: SlurmRequest, run: RunDir, task: str, shape: LaunchShape,
               restarts: int, name: Optional[str] = None, cfg=None):
    """The JobSpec for `run`; `cfg` as in `launch` (`render` passes none)."""
    return build_spec(request, run, task, shape, restarts, name=name,
                      cfg=run.load_config() if cfg is None else cfg)


def submit_to_slurm(request: SlurmRequest, run: RunDir, task: str, shape: LaunchShape,
                    restarts: int, name: Optional[str] = None, step: Optional[int] = None,
                    spec=None, *, cfg) -> int:
    spec = spec or slurm_spec(request, run, task, shape, restarts, name, cfg=cfg)
    job_id = submit(run, spec, step=step, cfg=cfg)
    print(f"submitted Slurm job {job_id} for {run.path}", file=sys.stderr)
    print(job_id)
    return wait_for_job(job_id, run=run) if request.wait else 0


def wait_for_job(job_id: str, poll_s: float = 1.0, run: Optional[RunDir] = None) -> int:
    """Block until the job leaves Slurm's live states, printing each new state and reason;
    0 only when it COMPLETED. A job Slurm will never start as asked is cancelled at once.
    A job that ended otherwise shows the end of its batch log (srun's and the host-side
    trap's lines) and the command for the ranks' logs, where `run` is known."""
    from enn_cluster.storage.slurm_jobs import (
        LIVE_STATES,
        cancel,
        describe,
        job_state,
        never_starts,
    )

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
                            "it: ask for fewer nodes, GPUs, CPUs (--cpus-per-task; unset, it "
                            "is sized from the partition's nodes) or less --time, or another "
                            "--partition")
        if state["state"] not in LIVE_STATES:
            if state["state"] == "COMPLETED":
                return 0
            if run is not None:
                print("\n".join(failed_job_lines(run.path, job_id)), file=sys.stderr)
            return 1
        time.sleep(poll_s)


def failed_job_lines(run_dir: Path, job_id: str, tail_lines: int = 20) -> list[str]:
    """The end of a finished job's batch log (its last 8 KiB at most) and where to look next."""
    log = Path(str(submitit_folder(run_dir)).replace("%j", job_id)) / f"{job_id}_0_log.err"
    lines = [f"Slurm job {job_id}: batch log {log}:"]
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 8192))
            text = fh.read().decode("utf-8", errors="replace")
        lines += [f"  | {line}" for line in text.splitlines()[-tail_lines:]]
    except OSError as exc:
        lines = [f"Slurm job {job_id}: no batch log to show ({exc.strerror}: {log})"]
    return lines + [f"the ranks' logs: enn-submit logs {shlex.quote(str(run_dir))} --rank R"]


class ConfigOnlyRun(RunDir):
    """A run directory that does not exist yet: render needs its path and config only."""

    def __init__(self, path: Path, cfg) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_cfg", cfg)

    def load_config(self):
        return self._cfg


def check_slurm_spec(request: SlurmRequest, cfg, task: str, shape: LaunchShape, restarts: int,
                     name: Optional[str] = None):
    """Build (and so validate) the job for a run that does not exist yet: bad Slurm flags,
    a run directory path Pyxis cannot carry, are refused before anything is written."""
    from enn_cluster.client.prepare import with_shape

    return slurm_spec(request, run_dir_for(cfg), task, shape, restarts, name,
                      cfg=with_shape(cfg, shape))


def cancel_run(run: RunDir) -> int:
    """Cancel the run's live Slurm job, or stop its local launcher: only a job or process
    proven to be this run's is signalled (a forged lock or jobs.jsonl names someone else's)."""
    from enn_cluster.storage.slurm_jobs import job_alive

    RunDir.existing(run.path)
    owner = read_lock(run)
    jobs = [j for j in run.jobs() if j.get("kind") == "slurm"]
    if jobs and job_alive(str(jobs[-1]["job_id"])):
        return _cancel_slurm(run, str(jobs[-1]["job_id"]))
    if owner and not owner.get("slurm_job_id"):
        return _stop_launcher(run, owner)
    print(f"{run.path}: nothing is running")
    return 0


def _cancel_slurm(run: RunDir, job_id: str) -> int:
    from enn_cluster.storage.run_lock import clear_lock_of_job
    from enn_cluster.storage.slurm_jobs import cancel, job_belongs_to_run, job_fields

    if not job_belongs_to_run(job_fields(job_id), run.path):
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

    why = launcher_problem(owner, socket.gethostname(), boot_id(), identity)
    if why is None and not holds_open(owner["pid"], run.lock_path):
        why = (f"pid {owner['pid']} does not hold {run.lock_path.name} open, so it is not this "
               "run's launcher (a lock copied from another process?)")
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
    from enn_cluster.client.prepare import LaunchShape

    _spec = json.loads(sys.argv[1])
    try:
        sys.exit(launch(RunDir(Path(_spec["run"])), _spec["task"],
                        LaunchShape(_spec["nodes"], _spec["procs_per_node"], _spec["gpus_per_node"]),
                        _spec["restarts"]))
    except UserError as exc:
        print(f"enn-submit: error: {exc}", file=sys.stderr)
        sys.exit(2)
