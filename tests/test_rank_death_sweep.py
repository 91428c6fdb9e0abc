"""Kill -9 a random rank at a random moment (embedded default, elastic restarts): the group
is torn down, the retry resumes from the newest complete checkpoint, and the final
parameters equal an uninterrupted run's. ENN_FAULT_TRIALS=N runs more trials."""
from __future__ import annotations

import json
import os
import random
import textwrap

import pytest

from helpers import cli, full_params, in_pid_namespace, metrics, small_config, write_config

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


# Runs as pid 1 of its own PID namespace (helpers.in_pid_namespace): it signals pids that
# it reads from the workers' logs. Prints the launcher's exit code, the kill time and the
# launcher's stderr tail as JSON.
DRIVER = textwrap.dedent("""
    import json, os, re, signal, subprocess, sys, time
    from pathlib import Path
    from helpers import metrics
    cfg, run, kill_step, victim = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train",
                             "--config", cfg, "--max-restarts", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and len(metrics(run, "train")) >= kill_step:
            break
        time.sleep(0.02)
    pids = {}
    for log in (run / "logs").glob("local-*-r0/rank-*.log"):
        m = re.search(r"worker rank (\\d+)/\\d+ .* pid (\\d+)", log.read_text())
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    killed_at = time.time()
    os.kill(pids[victim], signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    print(json.dumps({"rc": proc.returncode, "killed_at": killed_at, "err": err[-2000:]}))
""")


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_rank_killed_at_random_step(reference, tmp_path, trial):
    rnd = random.Random(trial)
    run = tmp_path / "runs" / "kill"
    kill_step, victim = rnd.randrange(25, 110), rnd.randrange(4)
    res = in_pid_namespace(DRIVER, _cfg(tmp_path, "kill"), run, kill_step, victim)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, out["err"]
    resume = metrics(run, "resume")
    committed_before = [r["step"] for r in metrics(run, "checkpoint") if r["time"] < out["killed_at"]]
    assert [r["step"] for r in resume] == [max(committed_before)]
    ours = full_params(run / "checkpoints" / f"step-{STEPS}")
    for key, value in reference.items():
        assert (ours[key] == value).all(), (key, victim, kill_step)
