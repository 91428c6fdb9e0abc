"""The CLI's run commands that need no torch (render, logs, cancel), and the one place
parsed Slurm flags become a SlurmRequest. The work itself is in `launching`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from enn_cluster.client.launching import (
    ConfigOnlyRun,
    cancel_run,
    checked_shape,
    launch,
    load_flagged_config,
    slurm_spec,
)
from enn_cluster.cluster.submit_slurm import SlurmRequest
from enn_cluster.errors import UserError
from enn_cluster.storage.attempts import attempt_dirs
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import read_lock


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
    return SlurmRequest(site_config=site_config(args),
        partition=args.partition, account=args.account, qos=args.qos, time=args.time,
        container=args.container, python=args.python, site=args.site, job_name=args.job_name,
        signal_grace=args.signal_grace, cpus_per_task=getattr(args, "cpus_per_task", None),
        mem_gb=getattr(args, "mem_gb", None),
        mounts=tuple(args.mounts or ()), exclusive=bool(args.exclusive),
        nodes=None if args.nodes is None else str(args.nodes),
        wait=bool(getattr(args, "wait", False)))


def launch_shape(args, cfg):
    """The shape the flags ask for; a local run's also checked against this machine."""
    return checked_shape(cfg, args.nodes, args.gpus_per_node, args.procs_per_node,
                         local=getattr(args, "cluster", "local") != "slurm")


def launch_from_flags(args, run: RunDir, task: str, shape, restarts: int, name=None,
                      step=None, cfg=None) -> int:
    """Start the workers where --cluster says, for a run that exists (resume, predict);
    `cfg`: the run's config as the command loaded it."""
    slurm = slurm_request(args) if args.cluster == "slurm" else None
    return launch(run, task, shape, restarts, slurm, name=name, step=step, cfg=cfg)


def cmd_render(args) -> int:
    """Print, byte for byte, the batch script `train`/`resume`/`predict --cluster slurm`
    would hand to sbatch for this run (dry run, nothing written); CPUs per task sized as
    submit sizes them, from the partition's nodes where Slurm can be asked from here."""
    from enn_cluster.client.prepare import shape_from_flags
    from enn_cluster.cluster.submit_slurm import (
        batch_script,
        sized_for_nodes,
        slurm_executor,
        submitit_folder,
    )
    from enn_cluster.storage.rundir import run_dir_for

    target = Path(args.target)
    if RunDir(target).has_config:
        run = RunDir(target.resolve())
        cfg = run.load_config()
    else:
        cfg = load_flagged_config(str(target), args.overrides, args.site,
                                  read_site=lambda: site_config(args))
        run = run_dir_for(cfg)
    shape = shape_from_flags(cfg, args.nodes, args.gpus_per_node, args.procs_per_node)
    restarts = cfg.parallel.max_restarts if args.max_restarts is None else args.max_restarts

    spec_run = run if run.has_config else ConfigOnlyRun(run.path, cfg)
    spec, warning = sized_for_nodes(
        slurm_spec(slurm_request(args), spec_run, args.task, shape, restarts, args.name))
    sys.stdout.write(batch_script(slurm_executor(spec, submitit_folder(run.path))))
    if warning:  # submit refuses a GPU job that this line names
        print(f"enn-submit: warning: submit refuses this job: {warning}"
              if spec.gpus_per_node else warning, file=sys.stderr)
    return 0


def _latest_log_dir(run: RunDir) -> Path:
    """The newest attempt (storage.attempts: by launch, then restart count)."""
    dirs = attempt_dirs(run)
    if not dirs:
        raise UserError(f"{run.path}: no logs yet")
    return dirs[-1]


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
    return cancel_run(RunDir(Path(args.run_dir).resolve()))
