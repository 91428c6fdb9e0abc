"""Time to recover: from a rank killed to the first training step after the restart.

Ours: `enn-submit train`, 4 CPU processes on a 2x2 HSDP mesh (overhead.py's model and
data), a checkpoint at step `save_at`, and rank 1 SIGKILLed after step `die_at`
(ENN_TEST_FAULTS fail_at_step); the local launcher restarts every rank (parallel.max_restarts=1),
which resume from the checkpoint (verified while loading) and train on. Time of death: the
fault marker's mtime, written just before the kill. First step: the `time` of the first
train record after the resume record. Baseline: bare_recover.py, the same model, data and
checkpoint under torchrun's own restart and plain `dcp.load`. The phases of ours (death to
the resume record, resume record to the first step) are reported apart. The two
alternate, `pairs` times.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from .measure import BenchContext, Result, Series, alternating, mlp_run, ratios
from .overhead import SHAPE, _data, _sizes


def _plan(ctx: BenchContext) -> dict:
    s = _sizes(ctx)
    return dict(s, save_at=10, die_at=15, pairs=1 if ctx.quick else 3)


def _ours(ctx: BenchContext, s: dict, x: Path, y: Path, i: int) -> dict:
    name = f"recover-{i}"
    cfg = mlp_run(ctx, name, s, x, y, training={"max_steps": s["die_at"] + 1},
                  checkpoint={"every_steps": s["save_at"], "keep_last": 2},
                  parallel={"strategy": "hsdp", "max_restarts": 1, **SHAPE})
    path = ctx.workdir / "overhead" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(path)], capture_output=True, text=True,
                         env=ctx.subprocess_env(
                             ENN_TEST_FAULTS=f"fail_at_step={s['die_at']},fail_rank=1"),
                         timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit train exited {res.returncode}: {res.stderr[-800:]}")
    run = ctx.workdir / "runs" / name
    died = (run / "faults" / f"fired-step-{s['die_at']}").stat().st_mtime
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = next(r for r in recs if r["kind"] == "resume")
    if resumed["step"] != s["save_at"]:
        raise RuntimeError(f"resumed from step {resumed['step']}, not {s['save_at']}")
    first = next(r["time"] for r in recs if r["kind"] == "train" and r["time"] > resumed["time"])
    shutil.rmtree(run)
    return {"total": first - died, "restart": resumed["time"] - died,
            "first_step": first - resumed["time"]}


def _bare(ctx: BenchContext, s: dict, x: Path, y: Path, i: int) -> float:
    from torch.distributed.launcher.api import LaunchConfig

    from enn_cluster.client.launch_local import elastic_run, free_port

    from .bare_recover import recover

    ckpt = ctx.workdir / f"bare-recover-{i}"
    ckpt.mkdir()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4,
                          run_id=f"bench-recover-{i}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=1,
                          start_method="spawn")  # torchrun's default monitor interval
    # A restart reuses the agent's store, where gloo finds the failed attempt's addresses
    # ("Connection refused", pytorch#135712); the documented switch gives each attempt a
    # store of its own (ours prefixes its keys with the attempt instead).
    out = elastic_run(config, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, recover,
                      str(x), str(y), s["hidden"], SHAPE["nodes"], SHAPE["procs_per_node"],
                      s["batch"], s["save_at"], s["die_at"], s["lr"], s["seed"], str(ckpt))
    died = float((ckpt / "died").read_text())
    shutil.rmtree(ckpt)
    return out[0] - died


def run(ctx: BenchContext) -> list[Result]:
    import statistics

    s = _plan(ctx)
    x, y = _data(ctx, s)
    ctx.log(f"recovery: {s['pairs']} pairs, a rank killed after step {s['die_at']}, "
            f"checkpoint at {s['save_at']}")
    ours, bare = [], []
    for i, side in alternating(s["pairs"]):
        if side == "ours":
            ours.append(_ours(ctx, s, x, y, i))
        else:
            bare.append(_bare(ctx, s, x, y, i))
    totals = [o["total"] for o in ours]
    phases = {k: statistics.median(o[k] for o in ours) for k in ("restart", "first_step")}
    return [Result(
        "recovery", "time to recover: rank killed -> first step after restart", "<=", 1.2,
        samples=ratios(totals, bare), unit="x",
        ours=Series("enn-submit train, local launcher restart + resume", "s", totals),
        baseline=Series("bare FSDP2 loop, torchrun restart + plain dcp.load", "s", bare),
        note=(f"4 CPU processes, 2x2 HSDP, MLP {s['features']}-{'x'.join(map(str, s['hidden']))}"
              f"-1 + AdamW state; ours by phase (median): death -> resumed (detection, "
              f"teardown, new workers, model build, checkpoint load) {phases['restart']:.2f} s, "
              f"resumed -> first step {phases['first_step']:.2f} s"))]
