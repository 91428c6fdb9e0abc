"""Preemption on the embedded default: USR2, TERM or INT (Ctrl-C) to the launcher
checkpoints at the next step boundary and exits 75; resuming loses no step and ends
bit-identical, and no step directory is left torn."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, cli, full_params, metrics, small_config, write_config

STEPS = 60


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    cfg = write_config(tmp / "run.yaml", **small_config(
        tmp, "whole", training={"max_steps": STEPS}, checkpoint={"every_steps": 1000}))
    assert cli("train", "--config", cfg).returncode == 0
    return tmp / "runs" / "whole"


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return full_params(uninterrupted_run / "checkpoints" / f"step-{STEPS}")


def _stopped_by(sig, tmp_path):
    """Train at 4 ranks and send `sig` to the launcher after step 15: (run, stop step)."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "pre", training={"max_steps": STEPS}, checkpoint={"every_steps": 1000}))
    run = tmp_path / "runs" / "pre"
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config", str(cfg)],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and len(metrics(run, "train")) >= 15:
            break
        time.sleep(0.05)
    sent_at = time.time()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert time.time() - sent_at < 30
    stop = metrics(run, "checkpoint")[-1]["step"]
    assert 15 <= stop < STEPS
    assert metrics(run, "train")[-1]["step"] == stop  # nothing past the step boundary is lost
    assert cli("verify", run).returncode == 0
    assert not list((run / "checkpoints").glob("*.torn-*"))
    rank0 = "".join(p.read_text() for p in (run / "logs").glob("*/rank-0.log"))
    assert f"continue with: enn-submit resume {run}" in rank0  # a local stop: no requeue
    assert "requeue" not in rank0
    assert all((p / "commit.json").exists() for p in (run / "checkpoints").glob("step-*"))
    return run, stop


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # USR2: the next test
def test_signal_checkpoints_and_resume_is_exact(uninterrupted, tmp_path, sig):
    run, stop = _stopped_by(sig, tmp_path)
    res = cli("resume", run)
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in metrics(run, "resume")] == [stop]
    assert [r["step"] for r in metrics(run, "train")] == list(range(1, STEPS + 1))
    ours = full_params(run / "checkpoints" / f"step-{STEPS}")
    for key, value in uninterrupted.items():
        assert (ours[key] == value).all(), key


def test_a_stop_resumed_at_another_world_size_matches_the_uninterrupted_run(
        uninterrupted_run, tmp_path):
    """Issue 18: a run stopped (USR2) at 4 ranks and resumed at 2 takes the same steps
    with exactly the same learning rates, losses within float tolerance and the same
    final weights within tolerance as the run that went through at 4. (TERM and INT
    above resume at the same world size, bit-identical.)"""
    run, stop = _stopped_by(signal.SIGUSR2, tmp_path)
    res = cli("resume", run, "--nodes", "1", "--procs-per-node", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["world_size"], resume["from_world"]) == (stop, 2, 4)
    ours = {r["step"]: r for r in metrics(run, "train")}
    theirs = {r["step"]: r for r in metrics(uninterrupted_run, "train")}
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    for step in theirs:
        assert ours[step]["lr"] == theirs[step]["lr"], step
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=1e-2, abs=1e-5), step
    mine = full_params(run / "checkpoints" / f"step-{STEPS}")
    base = full_params(uninterrupted_run / "checkpoints" / f"step-{STEPS}")
    for key in base:
        assert (mine[key] - base[key]).norm() <= 1e-2 * base[key].norm(), key


def test_second_job_on_a_live_run_is_refused(tmp_path):
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "busy", training={"max_steps": 400}, parallel={"nodes": 1, "procs_per_node": 1}))
    run = tmp_path / "runs" / "busy"
    proc = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config", str(cfg)],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (run / "run.lock").exists() and time.time() < deadline:
            time.sleep(0.05)
        res = cli("resume", run, timeout=60)
        assert res.returncode == 2, res.stderr
        assert f"in use by pid {proc.pid}" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
