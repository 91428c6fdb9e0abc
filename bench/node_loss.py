"""Lose a node, keep training (issue 29): node death -> first step on the survivors.

A three-node dev Slurm cluster (slurm/dev/cluster.sh, root only; SlurmdTimeout left at
Slurm's 300 s) runs `enn-submit train --cluster slurm --container none --nodes 2-3`, one
task per node, overhead.py's model and data, a checkpoint every 20 steps. After step 25, n3
loses power (`cluster.sh node-down`: SIGKILL to its slurmd and tasks); its time of death
is taken just before. The batch shell probes the nodes and starts a new step on n1 and n2,
which resume from step 20 at world 4 (same global batch). Phases, from the run's
node_lost, resume and train records and the relaunched rank 0's first log line: the
detection (the survivors' tasks seen gone twice, when the probe starts), the probe (every
node asked at once; decided once the answers stop coming), the step launch, the workers'
start, their set-up and checkpoint load (verified), the first step.

The same with a spare (issue 37 section 2): `--nodes 2 --spare-nodes 1` trains on two nodes
(world 4) and keeps the third idle; the training node that is not the batch shell's loses
power, and the step starts again on the other one and the spare, at world 4 (no
resharding).

Baseline, on the same cluster in the same run: Slurm's requeue path (submit_latency's
preemption: USR2 to the batch shell -> checkpoint -> requeue -> first step after the
restart), Slurm's BeginTime hold measured, lifted and reported apart. Part of the `submit`
benchmark (`--only submit`), which brings the cluster up once for both.
"""
from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import yaml

from enn_cluster.storage import layout

from .measure import BenchContext, Result, Series, mlp_run
from .overhead import _data, _sizes
from .slurm_poll import idle, records, wait_for

NAME = "node loss on the local Slurm: node death -> first step on the survivors"
NAME_SPARE = "node loss with a spare on the local Slurm: node death -> first step"
TARGET_S = 20.0  # issue 37 section 3
SAVE_AT, DIE_AFTER, STEPS = 20, 25, 40


def _config(ctx: BenchContext, s: dict, x: Path, y: Path, name: str) -> Path:
    """The node-loss test's shape (tests/slurm/test_node_loss_continue.py): 3 nodes x 2 tasks, then
    2 x 2; a global batch of 12 micro-batches (2 or 3 per rank, accumulated)."""
    micro = s["batch"] // 2
    cfg = mlp_run(ctx, name, dict(s, batch=micro), x, y,
                  training={"max_steps": STEPS, "global_batch_size": micro * 12},
                  checkpoint={"every_steps": SAVE_AT, "keep_last": 3},
                  parallel={"nodes": 3, "procs_per_node": 2})
    path = ctx.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _lose_a_node(ctx: BenchContext, s: dict, x: Path, y: Path, env: dict, cluster_sh: str,
                 state: str, spare: bool) -> dict:
    name = "nodeloss-spare" if spare else "nodeloss"
    shape = ["--nodes", "2", "--spare-nodes", "1"] if spare else ["--nodes", "2-3"]
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(_config(ctx, s, x, y, name)), "--cluster", "slurm", "--container",
                          "none", "--time", "10", *shape, "--gpus-per-node", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit train exited {res.returncode}: {res.stderr[-800:]}")
    job = res.stdout.strip().splitlines()[-1]
    run = ctx.workdir / "runs" / name
    try:
        began = wait_for(lambda: (records(run, "start", 0) or [None])[0], 300)
        if began["world_size"] != (4 if spare else 6):
            raise RuntimeError(f"the job started at world {began['world_size']}")
        victim = _training_nodes(run, job)[1] if spare else "n3"  # not the batch shell's
        wait_for(lambda: True if any(r["step"] >= DIE_AFTER for r in records(run, "train", 0))
              else None, 300, 0.2)
        died = time.time()
        down = subprocess.run(["bash", cluster_sh, "node-down", state, victim],
                              capture_output=True, text=True, timeout=120)
        if down.returncode != 0:
            raise RuntimeError(f"cluster.sh node-down exited {down.returncode}: {down.stderr}")
        lost = wait_for(lambda: (records(run, "node_lost", died) or [None])[0], 240)
        resumed = wait_for(lambda: (records(run, "resume", died) or [None])[0], 240)
        first = wait_for(lambda: (records(run, "train", resumed["time"]) or [None])[0], 240)
        worker = _first_log_line(run / "logs" / f"slurm-{job}-r0-k{lost['relaunch']}")
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
        up = subprocess.run(["bash", cluster_sh, "up", state, "3"], capture_output=True,
                            text=True, timeout=300)  # the lost node back (ReturnToService=2)
    if up.returncode != 0:
        raise RuntimeError(f"cluster.sh up (node back) exited {up.returncode}: {up.stderr[-400:]}")
    if (lost["lost"], lost["world_size"], resumed["step"], resumed["from_world"]) != \
            ([victim], 4, SAVE_AT, 4 if spare else 6) or bool(lost.get("spare_in")) != spare:
        raise RuntimeError(f"went on unlike planned: {lost}, resumed {resumed}")
    probed = lost.get("probed", lost["ended"])  # a shell of before the probe's start was kept
    return {"total": first["time"] - died, "detection": probed - died,
            "probe": lost["detected"] - probed, "launch": lost["launched"] - lost["detected"],
            "start": worker - lost["launched"], "load": resumed["time"] - worker,
            "first_step": first["time"] - resumed["time"]}


def training_nodes(log: str) -> Optional[list[str]]:
    """The nodes a batch shell with spares trains on, from its "enn: training on n1,n2, 1
    spare node(s) held" line (train.sbatch); None before it is written. The one reader of
    that line, for this benchmark and tests/slurm/test_node_loss_continue.py."""
    if "enn: training on " not in log:
        return None
    return log.split("enn: training on ")[1].split()[0].rstrip(",").split(",")


def _training_nodes(run: Path, job: str) -> list[str]:
    def read():
        path = layout.batch_log(run, job)
        return training_nodes(path.read_text(errors="replace") if path.exists() else "")
    return wait_for(read, 60, 0.2)


def _first_log_line(logs: Path) -> float:
    """When the relaunched step's rank 0 logged first (local time, as submit_latency reads it)."""
    line = (logs / "rank-0.log").read_text().splitlines()[0]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _phases(o: dict) -> str:
    return (f"detection (tasks seen gone twice) {o['detection']:.1f} s, probe "
            f"{o['probe']:.1f} s, step launch "
            f"{o['launch']:.1f} s, workers' start (srun to rank 0's first log line) "
            f"{o['start']:.1f} s, set-up and checkpoint load (lanes, model build, verified "
            f"load) {o['load']:.1f} s, first step {o['first_step']:.1f} s")


def results(ctx: BenchContext, env: dict, cluster_sh: str, state: str,
            requeue: dict) -> list[Result]:
    """The node-loss figures, a shrink and a spare, against `requeue`
    (submit_latency._preempted on this cluster); a failure is that figure's alone ("failed:
    why"), never the submit figures'."""
    s = _sizes(ctx)
    x, y = _data(ctx, s)
    out = []
    for spare, name in ((False, NAME), (True, NAME_SPARE)):
        try:
            idle(env)
            ours = _lose_a_node(ctx, s, x, y, env, cluster_sh, state, spare)
            idle(env)
        except Exception as exc:  # noqa: BLE001 - reported in the table, not raised
            out.append(Result("submit", name,
                              skipped=f"failed: {type(exc).__name__}: {exc}"[:400]))
            continue
        ctx.log(f"{name}: {ours['total']:.1f} s ({_phases(ours)})")
        how = ("--nodes 2 --spare-nodes 1, the second training node powered off after step "
               "25: probe + new step on the other one and the spare, world 4 again" if spare
               else "--nodes 2-3, n3 powered off after step 25: probe + new step on n1,n2")
        shape = ("3 nodes (one spare) x 2 CPU tasks" if spare else "3 nodes x 2 CPU tasks")
        world = ("resumed at world 4 without resharding" if spare
                 else "resumed at world 4 with the same global batch")
        out.append(Result(
            "submit", name, "<=", TARGET_S, samples=[ours["total"]], unit="s",
            ours=Series(how, "s", [ours["total"]]),
            baseline=Series("Slurm's requeue: USR2 -> first step after the requeue (hold "
                            "lifted, not counted)", "s", [requeue["total"]]),
            note=(f"{shape}, MLP {s['features']}-{'x'.join(map(str, s['hidden']))}-1 + AdamW, "
                  f"checkpoint at {SAVE_AT}, {world}; SlurmdTimeout 300 s (Slurm would wait "
                  f"that long, then requeue). Ours by phase: {_phases(ours)}. Requeue "
                  f"baseline: checkpoint {requeue['saved']:.1f} s, requeued "
                  f"{requeue['requeued']:.1f} s, Slurm's BeginTime hold {requeue['hold']:.0f} s "
                  f"(apart), restart -> resumed {requeue['resumed']:.1f} s, first step "
                  f"{requeue['first_step']:.1f} s")))
    return out
