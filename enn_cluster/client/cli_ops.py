"""The CLI's run commands that need no torch (render, logs, cancel), and the one place
parsed Slurm flags become a SlurmRequest. The work itself is in `launching`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from enn_cluster.client.launch_plan import LaunchPlan, Machine, plan_launch
from enn_cluster.client.launching import cancel_run, load_flagged_config
from enn_cluster.cluster.submit_slurm import SlurmRequest, check_slurm_here
from enn_cluster.config.launch_options import asked
from enn_cluster.config.launch_shape import ShapeRequest
from enn_cluster.errors import UserError
from enn_cluster.storage.attempts import attempt_dirs
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import read_lock


def say_last(line) -> None:
    """A line the user must not miss (newer checkpoints passed over: step_choice), as the
    last of the command's output, after its stdout."""
    if line:
        sys.stdout.flush()
        print(line, file=sys.stderr)


def site_config(args):
    """The site config of this command, read once: the shape defaults, the runs root and the
    job spec all ask for it."""
    if getattr(args, "site_config", None) is None:
        from enn_cluster.cluster.site import load_site

        args.site_config = load_site(args.site)
    return args.site_config


def slurm_request(args) -> SlurmRequest:
    """The Slurm flags of a parsed command line (render has no --wait); mounts are checked
    here so that an error names the flag the user typed."""
    from enn_cluster.cluster.pyxis import parse_mounts

    for mount in args.mounts or ():
        if any(c in mount for c in "\n\r\0\t"):
            raise UserError(f"--mount: {mount!r} holds a line break or control character; "
                            "write SRC:DST[:FLAGS] on one line")
    parse_mounts(list(args.mounts or ()), "--mount")
    return SlurmRequest(asked(lambda name: getattr(args, name, None)),
                        wait=bool(getattr(args, "wait", False)), site_config=site_config(args))


def plan_from_flags(args, cfg, task: str = "train", run_dir=None, *,
                    machine: bool = True) -> LaunchPlan:
    """The launch plan of a command's flags (launch_plan.plan_launch): on Slurm with
    --cluster slurm (render: always), else checked against this machine (`machine`: the
    processes start here). Its warnings are printed here, once."""
    slurm = slurm_request(args) if getattr(args, "cluster", None) == "slurm" or \
        args.command == "render" else None
    if slurm is not None and args.command != "render":
        check_slurm_here()  # before the image and the rest of the job are looked for
    plan = plan_launch(cfg, ShapeRequest.from_flags(args), task, slurm=slurm,
                       machine=Machine.here() if slurm is None and machine else None,
                       run_dir=run_dir, name=getattr(args, "name", None) if run_dir else None)
    for line in plan.warnings:
        print(f"enn-submit: warning: {line}", file=sys.stderr)
    return plan


def cmd_render(args) -> int:
    """Print, byte for byte, the batch script `train`/`resume`/`predict --cluster slurm`
    would hand to sbatch for this run (dry run, nothing written); CPUs per task sized as
    submit sizes them, from the partition's nodes where Slurm can be asked from here.
    --admin: the admin template with the same job's values fixed in it (a site that
    submits with its own sbatch keeps that file)."""
    from enn_cluster.cluster.job_script import render_batch_script
    from enn_cluster.cluster.submit_slurm import (
        batch_script,
        sized_for_nodes,
        slurm_executor,
        submitit_folder,
    )
    from enn_cluster.storage.rundir import run_dir_for

    target = Path(args.target).expanduser()
    if RunDir(target).has_config:
        run = RunDir.existing(target)
        cfg = run.load_config()
    else:
        cfg = load_flagged_config(str(target), args.overrides, args.site,
                                  read_site=lambda: site_config(args))
        run = run_dir_for(cfg)
    plan = plan_from_flags(args, cfg, args.task, run.path)
    spec, warning = sized_for_nodes(plan.spec)
    sys.stdout.write(render_batch_script(spec) if args.admin
                     else batch_script(slurm_executor(spec, submitit_folder(run.path))))
    if warning:  # submit refuses a GPU job that this line names
        print(f"enn-submit: warning: submit refuses this job: {warning}"
              if spec.gpus_per_node else warning, file=sys.stderr)
    return 0


def _latest_log_dir(run: RunDir) -> Path:
    """The newest attempt (storage.attempts: by launch, then restart count)."""
    dirs = attempt_dirs(run)
    if not dirs:
        raise UserError(f"{run.path}: no logs yet{_why_no_logs(run)}")
    return dirs[-1]


def _why_no_logs(run: RunDir) -> str:
    """Where to look instead when no rank wrote a log: the newest Slurm job's refusal (a
    rank refused before its log began: version skew) and that job's batch log."""
    from enn_cluster.client.status import newest_slurm_job
    from enn_cluster.storage import layout, node_loss

    job = newest_slurm_job(run.jobs())
    if job is None:
        return ""
    note = node_loss.read_refusal(run.path, job)
    batch = layout.batch_log(run.path, job)
    return ((f": job {job} refused its input (not requeued): {note}" if note else "")
            + (f"; its batch log: {batch}" if batch.is_file() else ""))


def cmd_logs(args) -> int:
    run = RunDir.existing(args.run_dir)
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
    return cancel_run(RunDir.existing(args.run_dir))
