"""Prediction throughput: rows/s per process of `enn-submit predict` vs a plain forward loop.

Setup (not timed): a run trained for one step (an MLP, 64 features -> 3 x 512 -> 1) and
an input .npy of `rows` x 64 float32.

- ours: `enn-submit predict RUN --input X --procs-per-node W` at world 1 and 2. Each chunk
  record holds the seconds its rank spent reading, inferring, writing, fsyncing and
  checksumming it; rows/s per process = rows / the summed chunk seconds. Start-up
  (interpreter, rendezvous, checkpoint load, input copy) is outside the figure and is
  reported apart as the whole command's wall time.
- baseline: one process (bare_predict.py) that loads the same step's weights, runs the
  same model over the same memmap with the same batch size under `inference_mode`, fills
  one output array and writes it as .npy + fsync; the loop and the write are timed.

Both sides use one intra-op thread per process. Repeats alternate the order.
"""
from __future__ import annotations

import json
import subprocess
import time

import yaml

from .measure import BenchContext, Result, Series, ratios, regression_arrays, settle

HIDDEN = [512, 512, 512]


def _sizes(ctx: BenchContext) -> dict:
    return {"rows": 1 << 15 if ctx.quick else 1 << 18, "features": 64, "batch": 1024,
            "chunk_rows": 1 << 13 if ctx.quick else 1 << 15, "seed": 0}


def _train(ctx: BenchContext, s: dict, x, y):
    cfg = {"run_name": "predict-bench", "runs_root": str(ctx.workdir / "runs"),
           "model": {"name": "mlp", "hidden_sizes": HIDDEN},
           "data": {"train_path": str(x), "train_targets_path": str(y), "eval_fraction": 0.0},
           "training": {"max_steps": 1, "per_device_train_batch_size": 64, "seed": s["seed"]},
           "checkpoint": {"every_steps": 1, "keep_last": 1},
           "parallel": {"nodes": 1, "procs_per_node": 1}}
    path = ctx.workdir / "predict-bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _cli(ctx, "train", "--config", path)
    return ctx.workdir / "runs" / "predict-bench"


def _cli(ctx: BenchContext, *args) -> float:
    started = time.perf_counter()
    res = subprocess.run([ctx.python, "-m", "enn_cluster.client.cli", *map(str, args)],
                         capture_output=True, text=True, env=ctx.subprocess_env(), timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"enn-submit {args[0]} exited {res.returncode}: {res.stderr[-800:]}")
    return time.perf_counter() - started


def _ours(ctx: BenchContext, s: dict, run, x, world: int, name: str) -> tuple[float, float]:
    """(rows/s per process from the chunk records, the command's wall seconds)."""
    wall = _cli(ctx, "predict", run, "--input", x, "--name", name, "--nodes", 1,
                "--procs-per-node", world, "--batch-size", s["batch"],
                "--chunk-rows", s["chunk_rows"])
    manifest = json.loads((run / "predictions" / name / "manifest.json").read_text())
    rows = sum(c["rows"][1] - c["rows"][0] for c in manifest["chunks"])
    return rows / sum(c["seconds"] for c in manifest["chunks"]), wall


def _bare(ctx: BenchContext, s: dict, run, x, out) -> float:
    code = ("import json, sys; from bench.bare_predict import predict; "
            "print(json.dumps(predict(*sys.argv[1:5], int(sys.argv[5]))))")
    res = subprocess.run([ctx.python, "-c", code, str(run), str(x), str(out),
                          json.dumps(HIDDEN), str(s["batch"])], capture_output=True, text=True,
                         env=ctx.subprocess_env(), timeout=900, cwd=ctx.root)
    if res.returncode != 0:
        raise RuntimeError(f"bare predict exited {res.returncode}: {res.stderr[-800:]}")
    return json.loads(res.stdout.splitlines()[-1])["rows_per_s"]


def run(ctx: BenchContext) -> list[Result]:
    import numpy as np

    s = _sizes(ctx)
    x, y = regression_arrays(ctx.workdir / "predict", s["rows"], s["features"], s["seed"])
    run_dir = _train(ctx, s, x, y)
    ctx.log(f"predict: {s['rows']} rows, {ctx.repeats} repeats of world 1, world 2, bare")
    bare, ours = [], {1: [], 2: []}
    walls = {1: [], 2: []}
    for i in range(ctx.repeats):
        out = ctx.workdir / "predict" / f"bare-{i}.npy"
        sides = [("bare", None), ("ours", 1), ("ours", 2)]
        for side, world in (sides if i % 2 == 0 else sides[::-1]):
            settle()
            if side == "bare":
                bare.append(_bare(ctx, s, run_dir, x, out))
            else:
                rate, wall = _ours(ctx, s, run_dir, x, world, f"r{i}-w{world}")
                ours[world].append(rate)
                walls[world].append(wall)
        if i == 0:  # both sides computed the same numbers
            collected = ctx.workdir / "predict" / "ours.npy"
            _cli(ctx, "collect", run_dir, "--name", "r0-w1", "--out", collected)
            if not np.allclose(np.load(collected), np.load(out), rtol=1e-5, atol=1e-6):
                raise RuntimeError("enn-submit predict and the bare loop disagree")
        out.unlink()
    note = (f"{s['rows']} rows x {s['features']} float32, MLP {HIDDEN}, batch {s['batch']}, "
            f"chunks of {s['chunk_rows']} rows; 1 intra-op thread per process; whole command "
            f"wall time (start-up, checkpoint load, input copy included): world 1 "
            f"{np.median(walls[1]):.1f} s, world 2 {np.median(walls[2]):.1f} s")
    return [Result("predict", f"predict rows/s per process, world {w} vs bare loop", ">=", 0.9,
                   samples=ratios(ours[w], bare),
                   ours=Series(f"enn-submit predict, world {w}: rows / chunk seconds", "rows/s",
                               ours[w]),
                   baseline=Series("bare forward loop over the memmap + np.save + fsync",
                                   "rows/s", bare), note=note)
            for w in (1, 2)]
