"""What a real cluster does to a run besides stopping it (issue 15): a node lost mid-job,
slurmctld restarted mid-job, two clients racing `resume` on one run. Real daemons on the
local dev cluster; the node is lost the way power goes (slurm/dev/cluster.sh node-down:
SIGKILL to its slurmd, slurmstepd and tasks), so no test here signals a pid of its own."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from enn_cluster.storage import commits as store
from enn_cluster.storage import layout
from helpers import (
    ROOT,
    cli,
    faults,
    metrics,
    small_config,
    train_tiny,
    wait_train_step,
    write_config,
)
from slurm_fixture import CLUSTER_SH

pytestmark = pytest.mark.slurm
SLURM = ("--cluster", "slurm", "--container", "none", "--time", "10")


def _cluster_sh(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", CLUSTER_SH, *map(str, args)], capture_output=True,
                          text=True, timeout=180)


def _submit(*args) -> str:
    res = cli(*args, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def _committed_before(run, when: float) -> list[int]:
    ckpts = run / "checkpoints"
    return [s for s in store.committed_steps(ckpts)
            if store.read_commit(store.step_dir(ckpts, s))["time"] < when]


def test_a_requeued_node_range_job_restarts_on_the_nodes_that_are_free(slurm_cluster, tmp_path):
    """--nodes 1-2 gets both nodes; USR2 to the batch shell stops it with a checkpoint and
    the shell's trap requeues it. Slurm fixed the job's task count (2 nodes x 2) when it
    first allocated it, so with n2 drained the requeued job would wait for n2 forever; the
    trap puts the count back at one node's worth, and the job restarts on n1 alone,
    resuming at world 2 where it stopped: no step lost or repeated."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "shrink", training={"max_steps": 100}, checkpoint={"every_steps": 1000}))
    slurm_cluster.wait_idle()
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "1-2", "--gpus-per-node", "2")
    run = tmp_path / "runs" / "shrink"
    wait_train_step(run, 20)
    res = slurm_cluster.run(["scancel", "--batch", "--signal=USR2", job])
    assert res.returncode == 0, res.stderr
    slurm_cluster.wait_job(job, ("PENDING",), timeout=90)
    try:
        res = slurm_cluster.run(["scontrol", "update", "NodeName=n2", "State=DRAIN",
                                 "Reason=enn-test"])
        assert res.returncode == 0, res.stderr
        slurm_cluster.release_requeued(job)
        slurm_cluster.wait_job(job, ("COMPLETED",), timeout=180)
    finally:
        slurm_cluster.run(["scontrol", "update", "NodeName=n2", "State=RESUME"])
    assert [s["world_size"] for s in metrics(run, "start")] == [4, 2]
    stopped = [r["step"] for r in metrics(run, "checkpoint") if r["step"] < 100]
    assert len(stopped) == 1, metrics(run, "checkpoint")
    resume = metrics(run, "resume")
    assert [(r["step"], r["from_world"], r["world_size"]) for r in resume] == [(stopped[0], 4, 2)]
    assert [r["step"] for r in metrics(run, "train")] == list(range(1, 101))
    assert not (run / "requeue" / job).exists()
    assert "(restarts 1)" in cli("status", run).stdout


def test_a_lost_node_then_resume_on_the_survivor(slurm_cluster, tmp_path):
    """n2 loses power at step >= 25 of a --nodes 2 job (no range: a range job goes on by
    itself, test_node_loss_continue.py). Once Slurm declares it down (here at once;
    slurmctld does after SlurmdTimeout) the job ends NODE_FAIL and Slurm requeues it with
    the node count it had, 2: it waits for n2. `enn-submit cancel` and `resume --nodes 1-2`
    continue on n1 from the newest commit, at world 2."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "lost", training={"max_steps": 100},
        checkpoint={"every_steps": 10, "keep_last": 100}))
    shape = ("--nodes", "1-2", "--gpus-per-node", "2")
    slurm_cluster.wait_idle()  # both nodes free: the job must span n1 and n2
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "2", "--gpus-per-node", "2")
    run = tmp_path / "runs" / "lost"
    wait_train_step(run, 25)
    assert metrics(run, "start")[0]["world_size"] == 4
    try:
        down = _cluster_sh("node-down", slurm_cluster.state_dir, "n2")
        assert down.returncode == 0, down.stderr
        res = slurm_cluster.run(["scontrol", "update", "NodeName=n2", "State=DOWN",
                                 "Reason=enn-test-power-lost"])
        assert res.returncode == 0, res.stderr
        slurm_cluster.wait_job(job, ("PENDING",), timeout=90)  # requeued by Slurm
        cancel = cli("cancel", run, timeout=60)
        assert cancel.returncode == 0, cancel.stderr
        slurm_cluster.wait_job(job, ("CANCELLED",), timeout=60)
        job2 = _submit("resume", run, *SLURM, *shape)
        slurm_cluster.wait_job(job2, ("COMPLETED",), timeout=240)
    finally:  # n2 comes back: up (with the session's Pyxis setting) restarts its slurmd,
        up = slurm_cluster.up()  # and ReturnToService=2 takes it in
    assert up.returncode == 0, up.stderr
    assert [s["world_size"] for s in metrics(run, "start")][-1] == 2
    resume = metrics(run, "resume")[-1]
    assert (resume["from_world"], resume["world_size"]) == (4, 2)
    assert resume["step"] == max(_committed_before(run, resume["time"])) >= 20
    assert metrics(run, "train")[-1]["step"] == 100


def test_slurmctld_restarted_mid_job_and_the_job_runs_on(slurm_cluster, tmp_path):
    """A controller restart (an upgrade, a crash) leaves running jobs running: no stop, no
    resume, every step once; `status` still knows the job."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "ctld", training={"max_steps": 120}, checkpoint={"every_steps": 1000}))
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "2", "--gpus-per-node", "2")
    run = tmp_path / "runs" / "ctld"
    wait_train_step(run, 20)
    res = _cluster_sh("restart-ctld", slurm_cluster.state_dir)
    assert res.returncode == 0, res.stderr
    assert slurm_cluster.wait_job(job, ("COMPLETED",), timeout=180) == "COMPLETED"
    _, text = slurm_cluster.job_state(job)
    assert "Restarts=0" in text, text
    assert [r["step"] for r in metrics(run, "train")] == list(range(1, 121))
    assert not metrics(run, "resume")
    assert f"{job} COMPLETED" in cli("status", run).stdout


def test_two_clients_racing_resume_submit_one_job(slurm_cluster, tmp_path):
    """Both start at once; the run lock is claimed before sbatch, so exactly one submits
    and the other is refused in one line (exit 2). One job, one resume."""
    run = train_tiny(tmp_path, "race")
    argv = [sys.executable, "-m", "enn_cluster.client.cli", "resume", str(run), *SLURM,
            "--nodes", "1", "--gpus-per-node", "1", "--set", "training.max_steps=6"]
    env = {**slurm_cluster.env, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for _ in range(2)]
    outs = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in outs)
    assert codes == [0, 2], outs
    (job,) = [out.strip().splitlines()[-1] for code, out, _ in outs if code == 0]
    (refusal,) = [err for code, _, err in outs if code == 2]
    assert refusal.count("\n") == 1 and "is in use by" in refusal, refusal
    assert slurm_cluster.wait_job(job, ("COMPLETED",), timeout=120) == "COMPLETED"
    assert [j.get("job_id") for j in _jobs(run) if j.get("kind") == "slurm"] == [job]
    assert [r["step"] for r in metrics(run, "resume")] == [2]
    assert metrics(run, "train")[-1]["step"] == 6


def _jobs(run) -> list[dict]:
    lines = (run / "jobs.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_a_rank_refusing_its_input_alone_is_never_requeued(slurm_cluster, tmp_path):
    """Issue 18, exit codes: rank 1 alone runs out of memory at micro-batch 1 (a fault hook
    raises torch.OutOfMemoryError on CPU), which is bad input: exit 2, never retried. Its
    peer waits in a collective, so srun's --kill-on-bad-exit terminates it and srun returns
    143, not 2; the rank's refusal marker, not srun's code, keeps the host-side trap from
    requeueing, though --max-restarts allows 3."""
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "refused", training={"per_device_train_batch_size": 1}))
    res = cli("train", "--config", cfg, *SLURM, "--nodes", "1", "--gpus-per-node", "0",
              "--procs-per-node", "2", "--max-restarts", "3", "--wait", timeout=240,
              env=faults(oom_at_step=2, fail_rank=1))
    job = res.stdout.strip().splitlines()[-1]
    assert res.returncode == 1 and slurm_cluster.job_state(job)[0] == "FAILED", res.stderr
    _, text = slurm_cluster.job_state(job)
    assert "Restarts=0" in text, text
    run = tmp_path / "runs" / "refused"
    (event,) = json.loads((run / "oom.json").read_text())["events"]
    assert (event["rank"], event["micro_batch"]) == (1, 1)
    batch_log = layout.batch_log(run, job).read_text()
    refusal = (f"enn: job {job} refused its input (exit 2), not requeueing: out of memory at "
               "step 2 on rank 1 with micro-batch 1")
    assert refusal in batch_log, batch_log[-3000:]
    assert "srun: error" in batch_log and "requeueing job" not in batch_log, batch_log[-3000:]
    # issue 40: its peer, failing in the collective rank 1 left, says why in one line
    peer = (run / "slurm" / job / f"{job}_0_log.err").read_text(errors="replace")
    assert f"enn_cluster worker: leaving: another rank of job {job} refused its input: out " \
        "of memory at step 2 on rank 1" in peer and "Traceback" not in peer, peer[-3000:]
    # --wait ends with the batch log's last lines and where the ranks' logs are
    lines = res.stderr.splitlines()
    assert f"Slurm job {job}: FAILED" in res.stderr and any(refusal in line for line in lines), res.stderr
    assert f"the ranks' logs: enn-submit logs {run} --rank R" in lines, res.stderr
    # issue 40: the reason is where an operator looks next, status and doctor
    status = cli("status", run, timeout=60)
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("refused:"))
    assert f"job {job} refused its input and was not requeued: out of memory at step 2 on " \
        "rank 1 with micro-batch 1" in line and line.endswith(f"enn-submit resume {run}"), line
    doctor = cli("doctor", run, timeout=120)
    logs = next(ln for ln in doctor.stdout.splitlines() if ln.startswith("logs "))
    assert doctor.returncode == 1 and logs.split()[1] == "problem", doctor.stdout
    assert f"job {job} refused its input (not requeued): out of memory at step 2" in logs, logs
