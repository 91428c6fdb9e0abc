"""enn_cluster's Python API in one page: train, predict, plot (a few minutes on CPU).

    python examples/api_quickstart.py [--quick] [--runs-root DIR]

`train()` stages the arrays, writes the module's current weights as step 0, and runs
workers (here: 2 simulated nodes x 2 processes, HSDP on CPU + gloo). `predict()` runs the
prediction workers and returns the collected rows in input order. Pass
`cluster={"nodes": 2, "gpus_per_node": 8, "partition": "gpu", "container": IMAGE}` to
either call to run the same thing on Slurm.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import enn_cluster
from enn_cluster.errors import UserError


def make_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = (np.sin(x[:, :4]).sum(1, keepdims=True) + 0.5 * x[:, 4:5] ** 2).astype(np.float32)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and epochs")
    parser.add_argument("--runs-root", default="demo-runs")
    args = parser.parse_args()
    n, epochs = (2048, 2) if args.quick else (16384, 6)
    x, y = make_data(n)
    x_test, y_test = make_data(1024, seed=1)
    # any importable nn.Module works; its current weights become the step-0 checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    started = time.perf_counter()
    run = enn_cluster.train(
        model, x, y, run_dir=f"{args.runs_root}/api-quickstart-{time.strftime('%Y%m%d-%H%M%S')}",
        training={"epochs": epochs, "per_device_train_batch_size": 64, "lr": 3e-3,
                  "warmup_ratio": 0.05},
        data={"normalize_targets": True, "eval_fraction": 0.1},
        checkpoint={"every_steps": 50}, parallel={"nodes": 2, "procs_per_node": 2})
    print(f"trained: {run} in {time.perf_counter() - started:.1f} s")
    evals = run.metrics("eval")
    print("eval loss per epoch:", ", ".join(f"{e['eval_loss']:.4f}" for e in evals))
    pred = enn_cluster.predict(run, x_test)
    mse = float(np.mean((pred - y_test) ** 2))
    print(f"test MSE {mse:.4f} (target variance {float(y_test.var()):.4f})")
    try:
        print("plot:", run.plot())
    except UserError as exc:  # matplotlib is an optional extra
        print(exc)


if __name__ == "__main__":
    main()
