"""Stopping a job in real containers, under Pyxis use_squashfuse=0 and =1 (issue 15, items
1 and 3).

Slurm's warning goes to the batch shell (`--signal=B:USR2@N`); `scancel --batch
--signal=USR2` delivers the same signal the same way, at a moment the test picks. The shell's
trap writes RUN/requeue/stop-JOB, rank 0 sees it at a step boundary, every rank checkpoints,
and the host-side EXIT trap requeues the job. No signal reaches the step, so Enroot's fuse
daemons survive under use_squashfuse=1 (a step signal there ends in "Bus error").
"""
from __future__ import annotations

import re

import pytest

from helpers import cli, metrics, small_config, wait_for_file, wait_train_step, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.podman]


@pytest.mark.parametrize("squashfuse", [1, 0])
def test_usr2_to_the_batch_shell_checkpoints_and_requeues(pyxis_cluster, test_image, tmp_path,
                                                          squashfuse):
    cluster = pyxis_cluster(squashfuse)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, f"pre{squashfuse}", training={"epochs": 400},
        logging={"every_steps": 1}))
    res = cli("train", "--config", cfg, "--cluster", "slurm", "--container", test_image,
              "--time", "10", "--nodes", "2", "--gpus-per-node", "2", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    job = res.stdout.strip().splitlines()[-1]
    run = tmp_path / "runs" / f"pre{squashfuse}"
    wait_train_step(run, 3, timeout=240)
    sig = cluster.run(["scancel", "--batch", "--signal=USR2", job])
    assert sig.returncode == 0, sig.stderr
    cluster.wait_job(job, ("PENDING",), timeout=180)  # requeued by the host-side trap
    state, text = cluster.job_state(job)
    assert "Restarts=1" in text and "Reason=BeginTime" in text, text
    logs = "".join(p.read_text(errors="replace") for p in (run / "slurm").rglob("*_log.*"))
    assert "Bus error" not in logs and "Stale file handle" not in logs, logs[-3000:]
    # a checkpointed stop is a clean exit to srun: no peer killed by --kill-on-bad-exit
    assert "Terminated" not in logs and "exit code" not in logs, logs[-3000:]
    stopped = [r for r in metrics(run, "train")][-1]["step"]
    rank0 = (run / "logs" / f"slurm-{job}-r0" / "rank-0.log").read_text()
    assert f"stopped at step {stopped} with a committed checkpoint" in rank0, rank0[-2000:]
    assert (run / "checkpoints" / f"step-{stopped}" / "commit.json").is_file()
    assert not (run / "requeue" / job).exists()  # consumed by the trap that requeued
    assert not (run / "requeue" / f"stop-{job}").exists()
    cluster.run(["scancel", job])


def test_a_step_signal_before_training_starts_stops_the_run_cleanly(pyxis_cluster, test_image,
                                                                    tmp_path):
    """Issue 15 item 3: `scancel --signal=USR2` (to every process of the step) as soon as the
    worker in the container has started, before its first step. The task catches stop
    signals before it imports torch, so the run checkpoints at its first step boundary and
    the host requeues it; no in-container `scontrol` (submitit's own handler) ever runs.
    Under use_squashfuse=0: with =1 a step signal also reaches Enroot's fuse daemon, and a
    step signal while Pyxis still unpacks the image fails its set-up (docs/admin.md: stop
    jobs with `scancel --batch --signal=USR2`)."""
    cluster = pyxis_cluster(0)
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "early", training={"max_steps": 400}, logging={"every_steps": 1}))
    res = cli("train", "--config", cfg, "--cluster", "slurm", "--container", test_image,
              "--time", "10", "--nodes", "1", "--gpus-per-node", "2", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    job = res.stdout.strip().splitlines()[-1]
    run = tmp_path / "runs" / "early"
    wait_for_file(run / "logs" / f"slurm-{job}-r0" / "rank-0.log", timeout=180)
    sig = cluster.run(["scancel", "--signal=USR2", job])
    assert sig.returncode == 0, sig.stderr
    cluster.wait_job(job, ("PENDING",), timeout=180)  # requeued by the host-side trap
    _, text = cluster.job_state(job)
    assert "Restarts=1" in text, text
    logs = "".join(p.read_text(errors="replace") for p in (run / "slurm").rglob("*_log.*"))
    assert "Traceback" not in logs and "scontrol" not in logs, logs[-3000:]
    rank0 = (run / "logs" / f"slurm-{job}-r0" / "rank-0.log").read_text()
    stopped = int(re.search(r"stopped at step (\d+) with a committed checkpoint", rank0)[1])
    assert (run / "checkpoints" / f"step-{stopped}" / "commit.json").is_file()
    assert stopped <= 3, rank0[-2000:]  # the first boundary (a step may be under way)
    cluster.run(["scancel", job])
