"""`make demo`: train on a 2x2 HSDP mesh locally, resume on 1x2 for more steps, predict
on 3 ranks, collect, report.

It drives the real CLI (`enn-submit train`, `resume`, `verify`, `status`, `predict`,
`collect`, and `plot` where matplotlib is installed) in fresh processes, as a user would.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from enn_cluster.storage.metrics import read_metrics
from enn_cluster.storage.rundir import RunDir

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def _cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "enn_cluster.client.cli", *args]
    print("$ enn-submit " + " ".join(args), flush=True)
    code = subprocess.call(cmd)
    if code != 0:
        sys.exit(code)


def main() -> None:
    run_name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    runs_root = os.environ.get("ENN_DEMO_RUNS", "demo-runs")
    run_dir = Path(runs_root).resolve() / run_name
    started = time.perf_counter()
    _cli("train", "--config", str(CONFIG), "--run-name", run_name, "--runs-root", runs_root,
         "--cluster", "local", "--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "2")
    _cli("resume", str(run_dir), "--cluster", "local", "--nodes", "1", "--gpus-per-node", "0",
         "--procs-per-node", "2", "--set", "training.epochs=4")
    _cli("verify", str(run_dir))
    _cli("status", str(run_dir))
    mse = _predict(run_dir)
    metrics = RunDir(run_dir).metrics
    train = list(read_metrics(metrics, "train"))
    evals = list(read_metrics(metrics, "eval"))
    per_epoch = ", ".join(f"{e['eval_loss']:.4f}" for e in evals)
    print(f"\nloss: first step {train[0]['loss']:.4f}, last step {train[-1]['loss']:.4f}; "
          f"eval loss per epoch: {per_epoch}")
    print(f"prediction of the first 1000 training rows: MSE {mse:.4f} against their targets "
          f"(target variance {_target_var(run_dir):.4f})")
    print(f"run directory: {run_dir}\n  checkpoints: {run_dir / 'checkpoints'}\n"
          f"  metrics:     {metrics}\n  predictions: {run_dir / 'predictions'}\n"
          f"  logs:        {run_dir / 'logs'}")
    print(f"demo finished in {time.perf_counter() - started:.1f} s")


def _predict(run_dir: Path) -> float:
    """Predict rows whose targets we know, on another world size (3 ranks)."""
    import numpy as np

    x = np.load(run_dir / "data" / "train_x.npy", mmap_mode="r")[:1000]
    y = np.load(run_dir / "data" / "train_y.npy", mmap_mode="r")[:1000]
    np.save(run_dir / "demo-input.npy", x)
    _cli("predict", str(run_dir), "--input", str(run_dir / "demo-input.npy"), "--name", "demo",
         "--nodes", "1", "--procs-per-node", "3", "--chunk-rows", "250")
    out = run_dir / "demo-predictions.npy"
    _cli("collect", str(run_dir), "--name", "demo", "--out", str(out))
    if importlib.util.find_spec("matplotlib") is not None:
        _cli("plot", str(run_dir), "--out", str(run_dir / "metrics.png"))
    pred = np.load(out)
    return float(np.mean((pred.reshape(len(y), -1) - np.asarray(y).reshape(len(y), -1)) ** 2))


def _target_var(run_dir: Path) -> float:
    import numpy as np

    return float(np.var(np.load(run_dir / "data" / "train_y.npy", mmap_mode="r")[:1000]))


if __name__ == "__main__":
    main()
