"""Submit latency on the local Slurm: command -> first training step (information).

A three-node dev cluster (slurm/dev/cluster.sh, root only; the node loss of
node_loss.py, measured here against the preemption below, needs three) runs both sides, in turn, with
overhead.py's model and data on 2 tasks:
- ours: `enn-submit train --cluster slurm --container none` (run directory, frozen config,
  staging, submitit's scripts, sbatch), then Slurm starts the batch shell, srun the
  workers; until the `time` of the first train record. The command's own return (job
  submitted) is reported apart.
- baseline: `sbatch` of a two-line script whose srun starts bare_loop's setup and one
  step on each task (env:// rendezvous on the node), rank 0 stamping the end of the step.
Each side waits for the node to be idle before it starts. Skipped without root or the
Slurm tools, or when another dev cluster holds the network slots.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

from enn_cluster.storage.metrics import scan_metrics

from .measure import BenchContext, Result, Series, alternating, mlp_run, ratios
from .overhead import _data, _sizes
from .slurm_poll import idle, records, wait_for

EXIT_BUSY = 3  # cluster.sh: every network slot is taken
BARE = """\
import os, sys, time
import torch.distributed as dist
from bench.bare_loop import setup, step
x, y, model, opt = setup(sys.argv[1], sys.argv[2], [1024] * 4, 1, 2, 1e-3, 0)
rank = dist.get_rank()
step(model, opt, x, y, list(range(rank * 64, (rank + 1) * 64)))
if rank == 0:
    open(sys.argv[3], "w").write(repr(time.time()))
dist.barrier()
dist.destroy_process_group()
"""


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the dev cluster's network namespaces and daemons)"
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [t for t in ("sbatch", "srun", "scontrol", "sinfo", "slurmctld", "slurmd",
                           "munged") if shutil.which(t, path=search) is None]
    return f"missing {' '.join(missing)} (slurm/dev/install-deps.sh)" if missing else None


def _first_train(metrics: Path):
    return next((r["time"] for r in scan_metrics(metrics)[0] if r["kind"] == "train"), None)


def _ours(ctx: BenchContext, s: dict, x: Path, y: Path, env: dict, i: int) -> dict:
    name = f"submit-{i}"
    cfg = mlp_run(ctx, name, s, x, y, training={"max_steps": 2}, checkpoint={"every_steps": 0})
    path = ctx.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    began = time.time()
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(path), "--cluster", "slurm", "--container", "none", "--time", "10",
                          "--nodes", "1", "--procs-per-node", "2"], capture_output=True,
                         text=True, env=env, timeout=300)
    submitted = time.time()
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit train exited {res.returncode}: {res.stderr[-800:]}")
    run = ctx.workdir / "runs" / name
    first = wait_for(lambda: _first_train(run / "metrics.jsonl"), 300)
    log = next((run / "logs").rglob("rank-0.log")).read_text().splitlines()[0]
    worker = datetime.strptime(log[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
    start = next(json.loads(line)["time"] for line in (run / "metrics.jsonl").read_text()
                 .splitlines() if json.loads(line)["kind"] == "start")
    return {"total": first - began, "submit": submitted - began, "worker": worker - submitted,
            "setup": start - worker, "first_step": first - start}


def _bare(ctx: BenchContext, x: Path, y: Path, env: dict, i: int, port: int) -> float:
    stamp = ctx.workdir / f"bare-first-{i}"
    task = (f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
            f"exec {shlex.quote(ctx.python)} -c {shlex.quote(BARE)} {shlex.quote(str(x))} "
            f"{shlex.quote(str(y))} {shlex.quote(str(stamp))}")
    script = ctx.workdir / f"bare-{i}.sh"
    script.write_text("#!/bin/bash\n"
                      f"#SBATCH --nodes=1 --ntasks-per-node=2 --time=10 "
                      f"--output={shlex.quote(str(ctx.workdir / f'bare-{i}.out'))}\n"
                      f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={port} OMP_NUM_THREADS=1 "
                      f"PYTHONPATH={shlex.quote(str(ctx.root))}\n"
                      f"srun bash -c {shlex.quote(task)}\n")
    began = time.time()
    res = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, env=env,
                         timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch exited {res.returncode}: {res.stderr[-400:]}")
    first = wait_for(lambda: float(stamp.read_text()) if stamp.exists() and stamp.read_text()
                  else None, 300)
    return first - began


def _job(env: dict, job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                          env=env).stdout


def _preempted(ctx: BenchContext, s: dict, x: Path, y: Path, env: dict) -> dict:
    """USR2 to the batch shell -> checkpoint -> requeue -> first step after the restart;
    Slurm's requeue hold (BeginTime) is measured, then lifted (StartTime=now), and left
    out of the total."""
    name = "preempt"
    cfg = mlp_run(ctx, name, s, x, y, training={"max_steps": 100000},
                  checkpoint={"every_steps": 0})
    path = ctx.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(path), "--cluster", "slurm", "--container", "none", "--time", "10",
                          "--nodes", "1", "--procs-per-node", "2"], capture_output=True,
                         text=True, env=env, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit train exited {res.returncode}: {res.stderr[-800:]}")
    job = res.stdout.strip().splitlines()[-1]
    run = ctx.workdir / "runs" / name
    try:
        wait_for(lambda: True if len(records(run, "train", 0)) >= 3 else None, 300)
        signalled = time.time()
        sig = subprocess.run(["scancel", "--batch", "--signal=USR2", job], capture_output=True,
                             text=True, env=env)
        if sig.returncode != 0:
            raise RuntimeError(f"scancel --signal=USR2 exited {sig.returncode}: {sig.stderr}")
        saved = wait_for(lambda: (records(run, "checkpoint", signalled) or [None])[0], 120)["time"]
        pending = wait_for(lambda: time.time() if "JobState=PENDING" in _job(env, job) else None,
                        120)
        text = _job(env, job)  # Reason=BeginTime: eligible only at EligibleTime
        begin = text.split("EligibleTime=", 1)[1].split()[0] if "EligibleTime=2" in text \
            else text.split("StartTime=", 1)[1].split()[0]
        hold = datetime.strptime(begin, "%Y-%m-%dT%H:%M:%S").timestamp() - pending
        time.sleep(2)  # an update in the requeue's first moments does not take (the notes)
        lift = subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                              capture_output=True, text=True, timeout=30)
        if lift.returncode != 0:
            raise RuntimeError(f"scontrol update StartTime=now: {lift.stderr.strip()}")
        released = time.time()
        resumed = wait_for(lambda: (records(run, "resume", released) or [None])[0], 120)["time"]
        first = wait_for(lambda: (records(run, "train", resumed) or [None])[0], 300)["time"]
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    return {"total": (pending - signalled) + (first - released), "saved": saved - signalled,
            "requeued": pending - saved, "hold": hold, "resumed": resumed - released,
            "first_step": first - resumed}


def run(ctx: BenchContext) -> list[Result]:
    from enn_cluster.client.launch_local import free_port

    from . import node_loss

    why = _missing()
    if why:
        return [Result("submit", "submit latency on the local Slurm", skipped=why)]
    s = _sizes(ctx)
    x, y = _data(ctx, s)
    state = tempfile.mkdtemp(prefix="enn-slurm-bench-", dir="/tmp")  # munged: searchable
    os.chmod(state, 0o755)
    cluster_sh = str(ctx.root / "slurm" / "dev" / "cluster.sh")
    env = dict(ctx.subprocess_env(), SLURM_CONF=os.path.join(state, "slurm.conf"))
    ctx.log("submit: bringing up a three-node dev Slurm cluster (the node loss needs 3)")
    up = subprocess.run(["bash", cluster_sh, "up", state, "3"], capture_output=True, text=True,
                        timeout=300)
    try:
        if up.returncode == EXIT_BUSY:
            return [Result("submit", "submit latency on the local Slurm",
                           skipped=up.stderr.strip()[-300:])]
        if up.returncode != 0:
            raise RuntimeError(f"cluster.sh up exited {up.returncode}: {up.stderr[-800:]}")
        ours, bare = [], []
        for i, side in alternating(1 if ctx.quick else 3):
            idle(env)
            if side == "ours":
                ours.append(_ours(ctx, s, x, y, env, i))
            else:
                bare.append(_bare(ctx, x, y, env, i, free_port()))
        idle(env)
        preempt = _preempted(ctx, s, x, y, env)
        idle(env)
        lost = node_loss.results(ctx, env, cluster_sh, state, preempt)
    finally:
        subprocess.run(["bash", cluster_sh, "down", state], capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
    totals = [o["total"] for o in ours]
    phase = {k: statistics.median(o[k] for o in ours)
             for k in ("submit", "worker", "setup", "first_step")}
    return [Result(
        "submit", "submit latency: command -> first step on the local Slurm, ours / sbatch",
        samples=ratios(totals, bare),
        ours=Series("enn-submit train --cluster slurm (1 node x 2 tasks)", "s", totals),
        baseline=Series("sbatch + srun of the bare loop's setup and one step", "s", bare),
        note=(f"ours by phase (median): the command returns (job submitted) "
              f"{phase['submit']:.2f} s; Slurm starts the job, the batch shell, srun and the "
              f"worker's imports until rank 0's first log line {phase['worker']:.2f} s; lanes, "
              f"model build, data checks and resume until the start record "
              f"{phase['setup']:.2f} s; the first step {phase['first_step']:.2f} s")),
        Result("submit", "preemption on the local Slurm: USR2 -> first step after the requeue",
               samples=[preempt["total"]], unit="s",
               note=(f"USR2 to the batch shell -> checkpoint committed {preempt['saved']:.2f} s "
                     f"-> job requeued (PENDING) {preempt['requeued']:.2f} s; Slurm's requeue "
                     f"hold (BeginTime) {preempt['hold']:.0f} s, lifted and not counted; "
                     f"restart -> resumed {preempt['resumed']:.2f} s -> first step "
                     f"{preempt['first_step']:.2f} s")), *lost]
