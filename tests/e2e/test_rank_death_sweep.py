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
# it reads from the workers' logs. "kill": SIGKILL the victim once the run has trained
# `at_step` steps. "stop": SIGSTOP it, wait for any peer's watchdog to fire, then let it go
# on (SIGCONT: the stall ends, as a stuck filesystem's does; unless the launcher, seeing
# the peers fail, has ended it first). Prints the launcher's exit
# code, the signal's time, how long the watchdog took and the launcher's stderr tail.
DRIVER = textwrap.dedent("""
    import json, os, re, signal, subprocess, sys, time
    from pathlib import Path
    from helpers import metrics
    mode, cfg, run = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    at_step, victim = int(sys.argv[4]), int(sys.argv[5])
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train",
                             "--config", cfg, "--max-restarts", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and len(metrics(run, "train")) >= at_step:
            break
        time.sleep(0.02)
    logs = {}
    for log in (run / "logs").glob("local-*-r0/rank-*.log"):
        m = re.search(r"worker rank (\\d+)/\\d+ .* pid (\\d+)", log.read_text())
        if m:
            logs[int(m.group(1))] = (int(m.group(2)), log)
    signalled_at, fired_after = time.time(), None
    if mode == "kill":
        os.kill(logs[victim][0], signal.SIGKILL)
    else:
        os.kill(logs[victim][0], signal.SIGSTOP)
        peers = [log for rank, (_, log) in logs.items() if rank != victim]
        while not any("watchdog: no progress" in log.read_text() for log in peers) \\
                and time.time() < signalled_at + 90:
            time.sleep(0.2)
        fired_after = time.time() - signalled_at
        try:
            os.kill(logs[victim][0], signal.SIGCONT)
        except ProcessLookupError:  # the launcher already ended it, having seen the peers fail
            pass
    _, err = proc.communicate(timeout=240)
    print(json.dumps({"rc": proc.returncode, "signalled_at": signalled_at,
                      "fired_after": fired_after, "err": err[-2000:]}))
""")


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_rank_killed_at_random_step(reference, tmp_path, trial):
    rnd = random.Random(trial)
    run = tmp_path / "runs" / "kill"
    kill_step, victim = rnd.randrange(25, 110), rnd.randrange(4)
    res = in_pid_namespace(DRIVER, "kill", _cfg(tmp_path, "kill"), run, kill_step, victim)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, out["err"]
    resume = metrics(run, "resume")
    committed_before = [r["step"] for r in metrics(run, "checkpoint")
                        if r["time"] < out["signalled_at"]]
    assert [r["step"] for r in resume] == [max(committed_before)]
    ours = full_params(run / "checkpoints" / f"step-{STEPS}")
    for key, value in reference.items():
        assert (ours[key] == value).all(), (key, victim, kill_step)


def test_a_stopped_rank_is_found_by_the_watchdog_and_the_retry_ends_identical(reference,
                                                                              tmp_path):
    """Issue 13 item 2: SIGSTOP rank 2 at step 30 (own PID namespace; not a checkpoint step:
    saves are timed by their barriers). Collectives would
    wait 120 s; the peers' watchdog (parallel.watchdog_s 6) ends them first, each logging
    where its lanes were and every thread's stack; the elastic retry resumes from the
    newest checkpoint and ends bit-identical to the uninterrupted run."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "stall", training={"max_steps": STEPS},
        checkpoint={"every_steps": 20, "keep_last": 2},
        parallel={"timeout_s": 120, "watchdog_s": 6}))
    run = tmp_path / "runs" / "stall"
    res = in_pid_namespace(DRIVER, "stop", cfg, run, 30, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, out["err"]
    assert out["fired_after"] < 60, out  # found by the watchdog, not the 120 s timeout
    first = next((run / "logs").glob("local-*-r0"))
    for rank in (0, 1, 3):
        text = (first / f"rank-{rank}.log").read_text()
        # its own watchdog, or the collective that failed when a peer's watchdog ended it
        assert "watchdog: no progress" in text or "training failed:" in text, text[-2000:]
        assert "last on each lane:" in text, text[-2000:]
        assert "most recent call first" in text, text[-2000:]  # faulthandler's stacks
    resume = metrics(run, "resume")
    committed = [r["step"] for r in metrics(run, "checkpoint") if r["time"] < out["signalled_at"]]
    assert [r["step"] for r in resume] == [max(committed)]
    ours = full_params(run / "checkpoints" / f"step-{STEPS}")
    for key, value in reference.items():
        assert (ours[key] == value).all(), key
