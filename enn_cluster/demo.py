"""`make demo`: train on a 2x2 HSDP mesh locally, resume on 1x2 for more steps, report.

It drives the real CLI (`enn-submit train`, `resume`, `status`, `verify`) in fresh
processes, exactly as a user would.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .metrics import read_metrics

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def _cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "enn_cluster.cli", *args]
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
    train = list(read_metrics(run_dir / "metrics.jsonl", "train"))
    evals = list(read_metrics(run_dir / "metrics.jsonl", "eval"))
    per_epoch = ", ".join(f"{e['eval_loss']:.4f}" for e in evals)
    print(f"\nloss: first step {train[0]['loss']:.4f}, last step {train[-1]['loss']:.4f}; "
          f"eval loss per epoch: {per_epoch}")
    print(f"run directory: {run_dir}\n  checkpoints: {run_dir / 'checkpoints'}\n"
          f"  metrics:     {run_dir / 'metrics.jsonl'}\n  logs:        {run_dir / 'logs'}")
    print(f"demo finished in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
