"""Stopping a job in real containers, under Pyxis use_squashfuse=0 and =1 (issue 15, item 1).

Slurm's warning goes to the batch shell (`--signal=B:USR2@N`); `scancel --batch
--signal=USR2` delivers the same signal the same way, at a moment the test picks. The shell's
trap writes RUN/requeue/stop-JOB, rank 0 sees it at a step boundary, every rank checkpoints,
and the host-side EXIT trap requeues the job. No signal reaches the step, so Enroot's fuse
daemons survive under use_squashfuse=1 (a step signal there ends in "Bus error").
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers import cli, metrics, small_config, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.podman]


def _wait_train_step(run: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and any(
                r["step"] >= step for r in metrics(run, "train")):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{run}: no train step {step} within {timeout} s")


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
    _wait_train_step(run, 3)
    sig = cluster.run(["scancel", "--batch", "--signal=USR2", job])
    assert sig.returncode == 0, sig.stderr
    cluster.wait_job(job, ("PENDING",), timeout=180)  # requeued by the host-side trap
    state, text = cluster.job_state(job)
    assert "Restarts=1" in text and "Reason=BeginTime" in text, text
    logs = "".join(p.read_text(errors="replace") for p in (run / "slurm").rglob("*_log.*"))
    assert "Bus error" not in logs and "Stale file handle" not in logs, logs[-3000:]
    stopped = [r for r in metrics(run, "train")][-1]["step"]
    rank0 = (run / "logs" / f"slurm-{job}-r0" / "rank-0.log").read_text()
    assert f"stopped at step {stopped} with a committed checkpoint" in rank0, rank0[-2000:]
    assert (run / "checkpoints" / f"step-{stopped}" / "commit.json").is_file()
    assert not (run / "requeue" / job).exists()  # consumed by the trap that requeued
    assert not (run / "requeue" / f"stop-{job}").exists()
    cluster.run(["scancel", job])
