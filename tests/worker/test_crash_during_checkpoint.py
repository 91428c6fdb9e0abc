"""Kill -9 a whole job (launcher + workers, like a node crash) at random moments while it
checkpoints every step: resume never picks a torn checkpoint and older ones stay intact."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from enn_cluster.storage import commits as store
from helpers import ROOT, cli, metrics, small_config, write_config

TRIALS = int(os.environ.get("ENN_FAULT_TRIALS", "2"))


def _start(cfg):
    return subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config", str(cfg)],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_while_checkpointing(tmp_path, trial):
    rnd = random.Random(1000 + trial)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "crash", model={"hidden_sizes": [512, 512, 512]},
        training={"max_steps": 400}, checkpoint={"every_steps": 1, "keep_last": 4},
        parallel={"nodes": 1, "procs_per_node": 2}))
    run = tmp_path / "runs" / "crash"
    proc = _start(cfg)
    deadline = time.time() + 120
    while time.time() < deadline and len(store.committed_steps(run / "checkpoints")) < 2:
        time.sleep(0.05)
    time.sleep(rnd.uniform(0.0, 1.5))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    committed = store.committed_steps(run / "checkpoints")
    assert committed, "no checkpoint committed before the kill"
    before = {s: json.loads((store.step_dir(run / "checkpoints", s) / "commit.json").read_text())
              for s in committed}
    for step in committed:  # every checkpoint that claims to be complete is intact
        assert store.verify_checkpoint(store.step_dir(run / "checkpoints", step)) == []
    res = cli("resume", run, "--set", f"training.max_steps={max(committed) + 3}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert metrics(run, "resume")[-1]["step"] == max(committed)
    for step, record in before.items():  # older checkpoints untouched (unless pruned)
        path = store.step_dir(run / "checkpoints", step)
        if path.exists():
            assert json.loads((path / "commit.json").read_text()) == record
    assert cli("verify", run).returncode == 0
