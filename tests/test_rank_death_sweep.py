"""Kill -9 a random rank at a random moment (embedded default, elastic restarts): the group
is torn down, the retry resumes from the newest complete checkpoint, and the final
parameters equal an uninterrupted run's. ENN_FAULT_TRIALS=N runs more trials."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, full_params, metrics, small_config, write_config, cli

TRIALS = int(os.environ.get("ENN_FAULT_TRIALS", "1"))
STEPS = 150


def _cfg(tmp, name):
    return write_config(tmp / "run.yaml", **small_config(
        tmp, name, training={"max_steps": STEPS}, checkpoint={"every_steps": 20, "keep_last": 2}))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    assert cli("train", "--config", _cfg(tmp, "ref")).returncode == 0
    return full_params(tmp / "runs" / "ref" / "checkpoints" / f"step-{STEPS}")


def _worker_pids(run):
    pids = {}
    for log in (run / "logs").glob("local-*-r0/rank-*.log"):
        m = re.search(r"worker rank (\d+)/\d+ .* pid (\d+)", log.read_text())
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    return pids


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_rank_killed_at_random_step(reference, tmp_path, trial):
    rnd = random.Random(trial)
    run = tmp_path / "runs" / "kill"
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                             str(_cfg(tmp_path, "kill")), "--max-restarts", "2"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kill_step = rnd.randrange(25, 110)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and len(metrics(run, "train")) >= kill_step:
            break
        time.sleep(0.02)
    victim = rnd.randrange(4)
    killed_at = time.time()
    os.kill(_worker_pids(run)[victim], signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    resume = metrics(run, "resume")
    committed_before = [r["step"] for r in metrics(run, "checkpoint") if r["time"] < killed_at]
    assert [r["step"] for r in resume] == [max(committed_before)]
    ours = full_params(run / "checkpoints" / f"step-{STEPS}")
    for key, value in reference.items():
        assert (ours[key] == value).all(), (key, victim, kill_step)
