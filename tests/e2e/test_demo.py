"""`make demo`, the README's first command, runs end to end: train 2x2, resume on 1x2,
verify, status, predict on 3 ranks, collect, plot, and the report it ends with."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np

from helpers import ROOT


def test_demo_runs_end_to_end(tmp_path):
    env = dict(os.environ, ENN_DEMO_RUNS=str(tmp_path / "runs"), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.demo"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    run = next((tmp_path / "runs").iterdir())
    loss = re.search(r"loss: first step ([0-9.]+), last step ([0-9.]+)", res.stdout)
    assert loss and float(loss.group(2)) < float(loss.group(1)) / 2, res.stdout[-2000:]
    preds = np.load(run / "demo-predictions.npy")
    assert preds.shape == (1000, 1) and np.isfinite(preds).all() and preds.std() > 0
    assert f"run directory: {run}" in res.stdout
