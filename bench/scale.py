"""Scale (only with `--only scale`): up to 32 local ranks, CPU + gloo, a tiny model.

The job's shape is 4 simulated nodes (ENN_SIM_NODES, via `enn-submit train --nodes 4`)
x 1, 2, 4 and 8 processes, so 4, 8, 16 and 32 ranks on a 4 x (W/4) HSDP mesh. For each
world size, and in alternating order:

- ours: `enn-submit train` in a fresh interpreter: create the run, stage the data,
  launch W workers under the elastic launcher, train `steps` steps, save the final
  checkpoint (sync). Times come from wall-clock stamps: the bench's clock before the
  subprocess starts, `jobs.jsonl` (launch), the first line of every rank's log (the
  slowest rank has imported torch and is about to join the process groups), the `time`
  of the first `train` record in metrics.jsonl (end of step 1), the last `train`
  record and the `checkpoint` record (the final save, committed).
- baseline: the bare FSDP2 loop of bench/bare_loop.py on the same mesh, model, data and
  per-rank batch, launched the same way (a fresh interpreter runs torch's elastic
  launcher with W spawned ranks): clock before the subprocess to end of step 1.

Then the 32-rank run is resumed on 16 ranks (`enn-submit resume --nodes 2
--procs-per-node 8`, DCP reshards 32 -> 16) and its time to first step is compared
with the fresh 16-rank run's. All figures are informational (no target): the point is
how they grow with the number of ranks on one machine, where every rank shares the
same few cores (startup is dominated by W interpreters importing torch at once).

`python -m bench.scale bare JSON` is the baseline's subprocess entry (prints stamps).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .measure import regression_arrays, BenchContext, Result, Series, mlp_run, ratios

NODES = 4
WORLDS = (4, 8, 16, 32)
RESUME_SHAPE = (2, 8)  # 16 ranks


def _sizes(ctx: BenchContext) -> dict:
    return {"hidden": [64, 64], "features": 16, "batch": 8, "rows": 8192, "steps": 20,
            "skip": 5, "lr": 1e-3, "seed": 0, "resume_steps": 10,
            # every world size runs once per side per repeat; 32 ranks on 2 cores is slow
            "repeats": 1 if ctx.quick else min(ctx.repeats, 2)}


def _data(ctx: BenchContext, s: dict) -> tuple[Path, Path]:
    return regression_arrays(ctx.workdir / "scale", s["rows"], s["features"], s["seed"])


# ---------------------------------------------------------------------------------------
# ours: enn-submit train / resume


def _log_start_times(log_root: Path, since: float) -> list[float]:
    """Per rank log, the wall-clock time (logging's asctime) of its first line at or after
    `since`: a resumed attempt appends to the same files."""
    out = []
    for path in sorted(log_root.rglob("rank-*.log")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    stamp, ms = line[:23].split(",")
                    at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3
                except ValueError:
                    continue
                if at >= since - 0.001:
                    out.append(at)
                    break
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _cli(ctx: BenchContext, argv: list[str]) -> float:
    """Run enn-submit in a fresh interpreter; return the wall-clock time it was started."""
    t0 = time.time()
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", *argv], capture_output=True,
                         text=True, env=ctx.subprocess_env(), timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit {argv[0]} exited {res.returncode}: {res.stderr[-800:]}")
    return t0


def _enn_train(ctx: BenchContext, s: dict, x: Path, y: Path, world: int, tag: str) -> dict:
    import yaml

    name = f"scale-{world}-{tag}"
    cfg = mlp_run(ctx, name, s, x, y,
                  checkpoint={"every_steps": 0, "keep_last": 1, "async_save": False},
                  parallel={"strategy": "hsdp", "nodes": NODES, "procs_per_node": world // NODES,
                            "timeout_s": 600})
    path = ctx.workdir / "scale" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = _cli(ctx, ["train", "--config", str(path), "--nodes", str(NODES),
                    "--procs-per-node", str(world // NODES)])
    run = ctx.workdir / "runs" / name
    return _timeline(run, t0, world)


def _timeline(run: Path, t0: float, world: int, after_step: int = 0) -> dict:
    recs = _records(run)
    train = [r for r in recs if r["kind"] == "train" and r["step"] > after_step]
    ckpts = [r for r in recs if r["kind"] == "checkpoint" and r["step"] > after_step]
    jobs = [json.loads(line) for line in (run / "jobs.jsonl").read_text().splitlines()
            if line.strip()]
    launched = jobs[-1]["time"]
    attempt = f"local-{len(jobs)}-r0"  # the launcher's logs/ folder for this launch
    starts = _log_start_times(run / "logs" / attempt, launched)
    if len(starts) != world:
        raise RuntimeError(f"{run.name}: {len(starts)} rank logs under {attempt}, expected {world}")
    # the `start` record (where the trainer writes one) ends setup: groups, mesh, model,
    # shard, and on resume choose_resume + load; step 1 follows it
    started = [r["time"] for r in recs if r["kind"] == "start" and r["time"] >= launched]
    setup_end = started[0] if started else train[0]["time"]
    out = {
        "ttfs": train[0]["time"] - t0,
        "launch": launched - t0,  # interpreter + CLI + prepare_run (staging)
        "ranks_up": max(starts) - launched,  # spawn + import torch, slowest rank
        "setup": setup_end - max(starts),  # process groups, mesh, shard (+ resume load)
        "step1": train[0]["time"] - setup_end,
        "step_time": statistics.median(r["step_time_s"] for r in train[1:]),
        "stamps": [r["time"] for r in train],
        "save": ckpts[-1]["time"] - train[-1]["time"],  # the final sync save, committed
    }
    resumes = [r for r in recs if r["kind"] == "resume"]
    if after_step:
        out["resume"] = resumes[-1] if resumes else None
    commit = json.loads((run / "checkpoints" / f"step-{ckpts[-1]['step']}" / "commit.json")
                        .read_text())
    out["save_seconds_commit"] = commit.get("save_seconds")
    return out


def _enn_resume(ctx: BenchContext, s: dict, world: int, tag: str) -> dict:
    run = ctx.workdir / "runs" / f"scale-{world}-{tag}"
    nodes, ppn = RESUME_SHAPE
    t0 = _cli(ctx, ["resume", str(run), "--nodes", str(nodes), "--procs-per-node", str(ppn),
                    "--set", f"training.max_steps={s['steps'] + s['resume_steps']}"])
    return _timeline(run, t0, nodes * ppn, after_step=s["steps"])


# ---------------------------------------------------------------------------------------
# baseline: the bare FSDP2 loop, launched the same way


def _bare(ctx: BenchContext, s: dict, x: Path, y: Path, world: int) -> dict:
    args = [str(x), str(y), s["hidden"], NODES, world // NODES, s["batch"], s["steps"],
            s["lr"], s["seed"], world]
    t0 = time.time()
    res = subprocess.run([ctx.python, "-m", "bench.scale", "bare", json.dumps(args)],
                         capture_output=True, text=True, env=ctx.subprocess_env(), timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("BARE-STAMPS ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"bare loop at {world} ranks exited {res.returncode}: "
                           f"{res.stderr[-800:]}")
    stamps = json.loads(lines[-1].split(" ", 1)[1])
    return {"ttfs": stamps[0] - t0, "stamps": stamps}


def _bare_main(args_json: str) -> int:
    from .bare_loop import train
    from .group import run_group

    x, y, hidden, replicate, shard, batch, steps, lr, seed, world = json.loads(args_json)
    out = run_group(train, world, x, y, hidden, replicate, shard, batch, steps, lr, seed)
    print("BARE-STAMPS " + json.dumps(out[0]), flush=True)
    return 0


# ---------------------------------------------------------------------------------------


def _sps(stamps: list[float], skip: int) -> float:
    window = stamps[skip:]
    return (len(window) - 1) / (window[-1] - window[0])


def run(ctx: BenchContext) -> list[Result]:
    s = _sizes(ctx)
    x, y = _data(ctx, s)
    ours: dict = {w: [] for w in WORLDS}
    bare: dict = {w: [] for w in WORLDS}
    resumed: list = []
    ctx.log(f"scale: worlds {WORLDS} on {NODES} simulated nodes, {s['repeats']} repeat(s), "
            f"{s['steps']} steps each, then resume 32 -> 16")
    for i in range(s["repeats"]):
        for world in WORLDS:
            order = ("enn", "bare") if (i + WORLDS.index(world)) % 2 == 0 else ("bare", "enn")
            for side in order:
                if side == "enn":
                    ours[world].append(_enn_train(ctx, s, x, y, world, str(i)))
                    ctx.log(f"scale: enn {world} ranks: time to first step "
                            f"{ours[world][-1]['ttfs']:.1f} s")
                else:
                    bare[world].append(_bare(ctx, s, x, y, world))
                    ctx.log(f"scale: bare {world} ranks: time to first step "
                            f"{bare[world][-1]['ttfs']:.1f} s")
        resumed.append(_enn_resume(ctx, s, WORLDS[-1], str(i)))
        ctx.log(f"scale: resume 32 -> 16 ranks: time to first step {resumed[-1]['ttfs']:.1f} s")
    return _results(s, ours, bare, resumed)


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _split(runs: list[dict]) -> str:
    return (f"enn split (medians): CLI + run dir + staging {_med(runs, 'launch'):.1f} s, "
            f"spawn + import torch (slowest rank) {_med(runs, 'ranks_up'):.1f} s, process "
            f"groups + mesh + model + shard{' + resume load' if 'resume' in runs[0] else ''} "
            f"{_med(runs, 'setup'):.1f} s, step 1 {_med(runs, 'step1'):.1f} s")


def _results(s: dict, ours: dict, bare: dict, resumed: list) -> list[Result]:
    top, low = WORLDS[-1], WORLDS[0]
    out = []
    for world in WORLDS:
        o, b = ours[world], bare[world]
        out.append(Result(
            "scale", f"scale: time to first step, {world} ranks, vs bare FSDP2", None, None,
            samples=ratios([r["ttfs"] for r in o], [r["ttfs"] for r in b]),
            ours=Series("enn-submit train: start to end of step 1", "s", [r["ttfs"] for r in o]),
            baseline=Series("bare FSDP2 loop, elastic launch: start to end of step 1", "s",
                            [r["ttfs"] for r in b]),
            note=(f"{NODES} simulated nodes x {world // NODES}; " + _split(o))))
    growth_o = {w: _med(ours[w], "ttfs") for w in WORLDS}
    growth_b = {w: _med(bare[w], "ttfs") for w in WORLDS}
    per_rank = (growth_o[top] - growth_o[low]) / (top - low)
    out.append(Result(
        "scale", f"scale: time to first step growth, {low} -> {top} ranks", None, None,
        samples=ratios([r["ttfs"] for r in ours[top]], [r["ttfs"] for r in ours[low]]),
        ours=Series(f"enn time to first step at {top} ranks", "s", [r["ttfs"] for r in ours[top]]),
        baseline=Series(f"enn time to first step at {low} ranks", "s",
                        [r["ttfs"] for r in ours[low]]),
        note=("enn " + ", ".join(f"{w}: {growth_o[w]:.1f} s" for w in WORLDS) +
              "; bare " + ", ".join(f"{w}: {growth_b[w]:.1f} s" for w in WORLDS) +
              f"; about {per_rank:.2f} s per added rank (ranks share the machine's cores)")))
    out.append(Result(
        "scale", f"scale: steps/s at {top} ranks vs bare FSDP2", None, None,
        samples=ratios([_sps(r["stamps"], s["skip"]) for r in ours[top]],
                       [_sps(r["stamps"], s["skip"]) for r in bare[top]]),
        ours=Series("enn, metrics.jsonl stamps", "steps/s",
                    [_sps(r["stamps"], s["skip"]) for r in ours[top]]),
        baseline=Series("bare FSDP2 loop", "steps/s",
                        [_sps(r["stamps"], s["skip"]) for r in bare[top]]),
        note=(f"MLP {s['features']}-{'x'.join(map(str, s['hidden']))}-1, batch {s['batch']}/rank, "
              f"{s['steps']} steps, first {s['skip']} excluded; enn step_time_s median "
              + ", ".join(f"{w}: {_med(ours[w], 'step_time') * 1e3:.0f} ms" for w in WORLDS))))
    out.append(Result(
        "scale", f"scale: checkpoint save, {top} vs {low} ranks", None, None,
        samples=ratios([r["save"] for r in ours[top]], [r["save"] for r in ours[low]]),
        ours=Series(f"final sync save + commit at {top} ranks", "s", [r["save"] for r in ours[top]]),
        baseline=Series(f"the same at {low} ranks", "s", [r["save"] for r in ours[low]]),
        note=("last train record to checkpoint record; " +
              ", ".join(f"{w}: {_med(ours[w], 'save'):.2f} s" for w in WORLDS) +
              "; the model is tiny, so this is coordination (planning, per-rank files, "
              "checksums, commit), not bandwidth")))
    fresh16 = ours[16]
    info = resumed[-1].get("resume") or {}
    out.append(Result(
        "scale", "scale: resume 32 -> 16 ranks, time to first step vs a fresh 16-rank start",
        None, None,
        samples=ratios([r["ttfs"] for r in resumed], [r["ttfs"] for r in fresh16]),
        ours=Series("enn-submit resume at 16 ranks (DCP reshard from 32)", "s",
                    [r["ttfs"] for r in resumed]),
        baseline=Series("enn-submit train at 16 ranks", "s", [r["ttfs"] for r in fresh16]),
        note=(f"resumed at step {info.get('step')} from world {info.get('from_world')} to "
              f"{info.get('world_size')}; resumed: {_split(resumed)}; fresh 16: "
              f"{_split(fresh16)}; resumed step_time_s median "
              f"{_med(resumed, 'step_time') * 1e3:.0f} ms")))
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "bare":
        sys.exit(_bare_main(sys.argv[2]))
    sys.exit("usage: python -m bench.scale bare JSON")
