"""Issue 29, lose a node and keep training: a --nodes MIN-MAX job (sbatch --no-kill) that
loses a node goes on, in the same allocation and without a person, on the nodes that still
answer, from the newest complete checkpoint at the new world size. A job without a range
keeps what Slurm does (it waits for the controller, which requeues it). Real daemons on a
3-node dev cluster; the node loses power through cluster.sh node-down (SIGKILL to its slurmd
and tasks), so no test here signals a pid of its own; SlurmdTimeout stays at Slurm's 300 s."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bench.node_loss import training_nodes
from enn_cluster.storage import commits as store
from enn_cluster.storage import layout
from enn_cluster.storage import node_loss
from enn_cluster.storage.rundir import RunDir
from helpers import (assert_same_steps, cli, metrics, outside_layout, small_config,
                     wait_train_step, write_config)
from pyxis_fixture import require_pyxis
from slurm_fixture import CLUSTER_SH

pytestmark = pytest.mark.slurm
SLURM = ("--cluster", "slurm", "--container", "none", "--time", "10")
STEPS = 60
SLURMD_TIMEOUT_S = 300  # Slurm's default, left as it is by cluster.sh


def _config(tmp_path, name: str, **parallel) -> dict:
    """60 steps of a global batch of 48 (6 ranks x 8 rows, or 4 ranks x 6 x 2 accumulation),
    a checkpoint every 10 steps."""
    return small_config(tmp_path, name, training={"max_steps": STEPS, "epochs": 30,
                                                  "global_batch_size": 48},
                        checkpoint={"every_steps": 10, "keep_last": 100},
                        parallel={"nodes": 3, "procs_per_node": 2, **parallel})


def _submit(*args, env=None) -> str:
    res = cli(*args, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def _node_down(cluster, node: str) -> float:
    when = time.time()
    down = subprocess.run(["bash", CLUSTER_SH, "node-down", cluster.state_dir, node],
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    return when


def _batch_log(run, job: str) -> str:
    path = layout.batch_log(run, job)
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.5)


def _steps(run) -> set:
    return {r["step"] for r in metrics(run, "train")}


def _wait_finished(run, timeout: float) -> None:
    """Until every step is logged and the last one committed."""
    _wait_for(lambda: (run / "metrics.jsonl").exists() and STEPS in _steps(run)
              and STEPS in store.committed_steps(run / "checkpoints"),
              f"{run}: no committed step {STEPS}", timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same config run through locally once for the module, 2 ranks (the global batch
    is what matters): the run every continuation must match."""
    where = tmp_path_factory.mktemp("uninterrupted")
    ref_cfg = write_config(where / "ref.yaml", **_config(where, "ref", nodes=1))
    done = cli("train", "--config", ref_cfg, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return where / "runs" / "ref"


def test_a_lost_node_and_the_job_goes_on_on_the_nodes_left(slurm_cluster3, tmp_path,
                                                           uninterrupted):
    """--nodes 2-3 gets n1-n3 (6 ranks); n3 loses power after step 25. The ranks on n1 and
    n2 fail, the batch shell sees its node's tasks gone while srun still waits for n3, probes
    the nodes, and starts a new step on n1 and n2 (4 ranks) long before the controller would
    declare n3 down. It resumes from the newest checkpoint committed before the loss and
    finishes all 60 steps with the uninterrupted run's learning rate at every step and its
    losses within float tolerance; metrics.jsonl, jobs.jsonl and `status` name the loss."""
    cfg = write_config(tmp_path / "run.yaml", **_config(tmp_path, "kept"))
    slurm_cluster3.wait_idle()  # every node free: the job must span all three
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "2-3", "--gpus-per-node", "2")
    run = tmp_path / "runs" / "kept"
    assert "#SBATCH --no-kill" in (run / "slurm" / job / f"{job}_submission.sh").read_text()
    wait_train_step(run, 25, timeout=180)
    assert metrics(run, "start")[0]["world_size"] == 6
    try:
        death = _node_down(slurm_cluster3, "n3")
        _wait_finished(run, timeout=240)
        state = slurm_cluster3.wait_job(job, ("COMPLETING", "COMPLETED"), timeout=60)
    finally:  # n3 comes back (its slurmd restarted; ReturnToService=2 takes it in)
        up = slurm_cluster3.up()
    assert up.returncode == 0, up.stderr
    log = _batch_log(run, job)
    assert "enn: lost node(s) n3: relaunching on 2 nodes (n1,n2), relaunch 1" in log, log[-3000:]
    assert "requeueing" not in log, log[-3000:]
    assert [s["world_size"] for s in metrics(run, "start")] == [6, 4]
    (lost,) = metrics(run, "node_lost")
    assert (lost["lost"], lost["nodes"], lost["world_size"], lost["relaunch"]) == \
        (["n3"], ["n1", "n2"], 4, 1)
    committed = [s for s in store.committed_steps(run / "checkpoints")
                 if store.read_commit(store.step_dir(run / "checkpoints", s))["time"] < death]
    assert lost["step"] == max(committed) >= 20, (lost, committed)
    # relaunched before SlurmdTimeout could have ended the wait: no one waited for Slurm
    assert death < lost["ended"] <= lost["detected"] <= lost["launched"] < death + SLURMD_TIMEOUT_S
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["from_world"], resume["world_size"]) == (lost["step"], 6, 4)
    assert resume["global_batch"] == 48
    (relaunch,) = [j for j in RunDir(run).jobs() if j.kind == "relaunch"]
    assert (relaunch.job_id, relaunch.lost, relaunch.step) == (job, ("n3",), lost["step"])
    status = cli("status", run, timeout=60)
    assert status.returncode == 0, status.stderr
    # when n3 was lost, as the records bound it: after the last step logged with it
    records = metrics(run)
    before = [r["step"] for r in records[:records.index(lost)] if r["kind"] == "train"][-1]
    assert before >= 25 and lost["step"] <= before, (before, lost)
    assert "node lost:       n3 between " in status.stdout, status.stdout
    assert f"(after step {before}, its last logged) and " in status.stdout, status.stdout
    assert f"(job {job}): went on with 2 node(s), world 4, from step {lost['step']}" in status.stdout
    doctor = cli("doctor", run, timeout=120)
    assert f"node n3 lost (job {job}): went on with 2 node(s) from step {lost['step']}" \
        in doctor.stdout, doctor.stdout
    _report_phases(run, death, lost, state)
    assert_same_steps(run, uninterrupted, STEPS)


def _report_phases(run, death: float, lost: dict, state: str) -> None:
    """The issue's measurement: node death to the first training step on the survivors."""
    after = [r for r in metrics(run) if r["time"] >= lost["launched"]]
    start = next(r for r in after if r["kind"] == "start")
    first = next(r for r in after if r["kind"] == "train")
    print(f"\nnode death -> ranks' tasks on n1 seen gone {lost['ended'] - death:.1f} s, "
          f"probe answered {lost['detected'] - death:.1f} s, step launched "
          f"{lost['launched'] - death:.1f} s, workers started {start['time'] - death:.1f} s, "
          f"first step (step {first['step']}) {first['time'] - death:.1f} s; job {state}")


HELD_STEP = 30  # the checkpoint being written when the node is lost


def test_a_node_lost_while_a_checkpoint_is_written(slurm_cluster3, tmp_path, uninterrupted):
    """Issue 29 item 7: n3 loses power while step-30 is being written. Deterministic: every
    rank holds after its shards and DCP's .metadata are on disk, before the commit record
    (ENN_FAULT_HOLD_BEFORE_COMMIT); n3 goes down while all six hold, then the survivors are
    released into the commit's collective, which fails. step-30 is left with .metadata and
    no commit.json: never chosen, never shown complete. The job goes on on n1 and n2 from
    step 20 and finishes as the uninterrupted run; the relaunch passes step 30 unheld."""
    held = tmp_path / "held"
    held.mkdir()
    cfg = write_config(tmp_path / "run.yaml", **_config(tmp_path, "torn"))
    slurm_cluster3.wait_idle()
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "2-3", "--gpus-per-node", "2",
                  env={"ENN_FAULT_HOLD_BEFORE_COMMIT": f"{HELD_STEP}:{held}"})
    run = tmp_path / "runs" / "torn"
    _wait_for(lambda: len(list(held.glob("held-rank-*"))) == 6, "not every rank held at the "
              f"commit of step {HELD_STEP}", timeout=240)
    torn = store.step_dir(run / "checkpoints", HELD_STEP)
    assert (torn / ".metadata").is_file() and not (torn / "commit.json").exists()
    try:
        _node_down(slurm_cluster3, "n3")
        (held / "release").touch()
        _wait_finished(run, timeout=240)
        slurm_cluster3.wait_job(job, ("COMPLETING", "COMPLETED"), timeout=60)
    finally:
        (held / "release").touch()
        up = slurm_cluster3.up()
    assert up.returncode == 0, up.stderr
    log = _batch_log(run, job)
    assert "enn: lost node(s) n3: relaunching on 2 nodes (n1,n2), relaunch 1" in log, log[-3000:]
    (lost,) = metrics(run, "node_lost")
    assert lost["step"] == HELD_STEP - 10, lost  # the newest complete one, not the torn one
    assert metrics(run, "resume")[-1]["step"] == HELD_STEP - 10
    # the torn attempt is moved aside by the relaunch's own save of step 30, never committed
    committed = store.committed_steps(run / "checkpoints")
    assert HELD_STEP in committed  # written again, whole, by the 4 survivors
    record = store.read_commit(store.step_dir(run / "checkpoints", HELD_STEP))
    assert record["world_size"] == 4, record
    for aside in (run / "checkpoints").glob(f"{torn.name}.torn-*"):
        assert not (aside / "commit.json").exists()
    assert cli("verify", run, timeout=120).returncode == 0
    assert_same_steps(run, uninterrupted, STEPS)


@pytest.mark.podman
@pytest.mark.slow
def test_a_lost_node_under_pyxis_and_the_job_goes_on(slurm_cluster3, test_image, tmp_path,
                                                      uninterrupted):
    """The same continuation in real containers (Pyxis, use_squashfuse=1: nothing unpacked,
    so no minutes of Enroot teardown at the end; on this module's three nodes): n3 loses power after step 25 with its Enroot container and task; the
    batch shell probes and starts a new containerised step on n1 and n2, which resume at
    world 4 from the newest checkpoint committed before the loss and finish as the
    uninterrupted run."""
    require_pyxis()
    slurm_cluster3.reconfigure("1")
    try:
        cfg = write_config(tmp_path / "run.yaml", **_config(tmp_path, "boxed"))
        slurm_cluster3.wait_idle()
        job = _submit("train", "--config", cfg, "--cluster", "slurm", "--container", test_image,
                      "--time", "10", "--nodes", "2-3", "--gpus-per-node", "2")
        run = tmp_path / "runs" / "boxed"
        wait_train_step(run, 25, timeout=300)
        try:
            death = _node_down(slurm_cluster3, "n3")
            _wait_finished(run, timeout=300)
            # Enroot's teardown may hold srun after the tasks end: the watcher probes meanwhile,
            # every node answers, nothing more
            slurm_cluster3.wait_job(job, ("COMPLETING", "COMPLETED"), timeout=240)
        finally:
            up = slurm_cluster3.up()
        assert up.returncode == 0, up.stderr
    finally:
        slurm_cluster3.reconfigure(None)
    log = _batch_log(run, job)
    assert "enn: lost node(s) n3: relaunching on 2 nodes (n1,n2), relaunch 1" in log, log[-3000:]
    assert "requeueing" not in log, log[-3000:]
    assert "relaunch 2" not in log, log[-3000:]  # the slow teardown is not taken for a loss
    (lost,) = metrics(run, "node_lost")
    assert lost["world_size"] == 4 and death < lost["launched"] < death + SLURMD_TIMEOUT_S
    assert [s["world_size"] for s in metrics(run, "start")] == [6, 4]
    assert metrics(run, "resume")[-1]["step"] == lost["step"] >= 20
    _report_phases(run, death, lost, "COMPLETED")
    assert_same_steps(run, uninterrupted, STEPS)


def test_a_spare_takes_the_lost_nodes_place_at_the_same_world_size(slurm_cluster3, tmp_path,
                                                                   uninterrupted):
    """Issue 37 section 2: --nodes 2 --spare-nodes 1 holds three nodes and trains on two
    (world 4), the batch shell's own first; the third waits. A training node loses power
    after step 25: the step starts again on the other training node and the spare, at
    world 4 again, so the checkpoint loads without resharding (from_world 4); the run
    finishes as the uninterrupted one, and status and metrics say which spare took whose
    place."""
    cfg = write_config(tmp_path / "run.yaml", **_config(tmp_path, "spare", nodes=2))
    slurm_cluster3.wait_idle()
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "2", "--spare-nodes", "1",
                  "--gpus-per-node", "2")
    run = tmp_path / "runs" / "spare"
    script = (run / "slurm" / job / f"{job}_submission.sh").read_text()
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    assert "ENN_SPARE_NODES=1" in script
    wait_train_step(run, 25, timeout=180)
    assert metrics(run, "start")[0]["world_size"] == 4
    log = _batch_log(run, job)
    trained = training_nodes(log)
    (spare,) = {"n1", "n2", "n3"} - set(trained)
    victim = trained[1]  # not the batch shell's node (the first): the job would end with it
    try:
        _node_down(slurm_cluster3, victim)
        _wait_finished(run, timeout=240)
        slurm_cluster3.wait_job(job, ("COMPLETING", "COMPLETED"), timeout=60)
    finally:
        up = slurm_cluster3.up()
    assert up.returncode == 0, up.stderr
    log = _batch_log(run, job)
    picked = f"{trained[0]},{spare}"
    assert f"enn: lost node(s) {victim}: relaunching on 2 nodes ({picked}), relaunch 1" in log, \
        log[-3000:]
    assert [s["world_size"] for s in metrics(run, "start")] == [4, 4]
    (lost,) = metrics(run, "node_lost")
    assert (lost["lost"], lost["nodes"], lost["spare_in"], lost["spares"], lost["world_size"]) \
        == ([victim], picked.split(","), [spare], [], 4)
    resume = metrics(run, "resume")[-1]
    assert (resume["step"], resume["from_world"], resume["world_size"]) == (lost["step"], 4, 4)
    status = cli("status", run, timeout=60)
    assert f"world 4, from step {lost['step']}; spare {spare} in place of {victim}" \
        in status.stdout, status.stdout
    assert_same_steps(run, uninterrupted, STEPS)


def test_a_job_without_a_node_range_keeps_waiting_for_slurm(slurm_cluster3, tmp_path):
    """--nodes 3, no range: no --no-kill, no probe, no relaunch. After n3's loss the ranks on
    n1 and n2 fail and srun waits, as before this change; once the controller declares n3
    down (here at once, by hand) the job ends NODE_FAIL and Slurm requeues it."""
    cfg = write_config(tmp_path / "run.yaml", **_config(tmp_path, "fixed"))
    slurm_cluster3.wait_idle()
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "3", "--gpus-per-node", "2")
    run = tmp_path / "runs" / "fixed"
    assert "#SBATCH --no-kill" not in (run / "slurm" / job / f"{job}_submission.sh").read_text()
    wait_train_step(run, 15, timeout=180)
    try:
        _node_down(slurm_cluster3, "n3")
        _wait_for(lambda: "srun: error: n1: task" in _batch_log(run, job),
                  "the ranks on n1 did not fail", timeout=90)
        time.sleep(8)  # longer than the watcher of a range job takes to probe
        assert slurm_cluster3.job_state(job)[0] == "RUNNING"
        assert not [*run.glob("requeue/relaunch-*"), *run.glob("requeue/probing-*")]
        assert "probing" not in _batch_log(run, job) and not metrics(run, "node_lost")
        res = slurm_cluster3.run(["scontrol", "update", "NodeName=n3", "State=DOWN",
                                  "Reason=enn-test-power-lost"])
        assert res.returncode == 0, res.stderr
        slurm_cluster3.wait_job(job, ("PENDING",), timeout=90)  # requeued by Slurm
        assert cli("cancel", run, timeout=60).returncode == 0
        slurm_cluster3.wait_job(job, ("CANCELLED",), timeout=60)
    finally:
        up = slurm_cluster3.up()
    assert up.returncode == 0, up.stderr
    assert [s["world_size"] for s in metrics(run, "start")] == [6]


def _hold_node(cluster, node: str) -> str:
    """Another user's job on the whole of `node` (running): the id to cancel."""
    res = cluster.run(["sbatch", "--parsable", f"--nodelist={node}", "--exclusive",
                       "--time=10", "--output=/dev/null", "--wrap", "sleep 600"])
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    cluster.wait_job(job, ("RUNNING",), timeout=60)
    return job


def test_a_range_is_granted_every_free_node_up_to_its_maximum(slurm_cluster3, tmp_path):
    """Issue 37: --nodes 2-3 at one task per node, as Slurm decides (no site file, no
    --ntasks): on the idle cluster it grants all three nodes (world 3); with n3 held by
    another job, the two that are free (world 2). sbatch never fixes the task count
    (no --ntasks-per-node); srun splits each granted node into its tasks."""
    def run_on_range(name: str) -> tuple[Path, str]:
        cfg = small_config(tmp_path, name, training={"max_steps": 4, "epochs": 30,
                                                     "global_batch_size": 48},
                           checkpoint={"every_steps": 2},
                           parallel={"nodes": 3, "procs_per_node": 1})
        res = cli("train", "--config", write_config(tmp_path / f"{name}.yaml", **cfg), *SLURM,
                  "--nodes", "2-3", "--procs-per-node", "1", "--gpus-per-node", "0", "--wait",
                  timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return tmp_path / "runs" / name, res.stdout.strip().splitlines()[-1]

    slurm_cluster3.wait_idle()
    run, job = run_on_range("idle")
    script = (run / "slurm" / job / f"{job}_submission.sh").read_text()
    assert "#SBATCH --nodes=2-3" in script and "--ntasks-per-node" not in script.split("# setup")[0]
    assert [s["world_size"] for s in metrics(run, "start")] == [3]
    blocker = _hold_node(slurm_cluster3, "n3")
    try:
        run, job = run_on_range("busy")
    finally:
        slurm_cluster3.run(["scancel", blocker])
    assert [s["world_size"] for s in metrics(run, "start")] == [2]
    assert "n3" not in slurm_cluster3.job_state(job)[1].split("NodeList=")[1].split()[0]


def test_fewer_nodes_left_than_the_minimum_frees_the_run_for_resume_at_once(slurm_cluster3,
                                                                              tmp_path):
    """--nodes 2-3 loses n2 and n3 at once: one node answers, fewer than 2, so there is no
    relaunch; srun is abandoned as failed and the EXIT trap decides as for any failure
    (here --max-restarts 0: stop, with the reason in the batch log). The shell records its
    end, so while Slurm still holds the job COMPLETING (it waits SlurmdTimeout for the lost
    nodes), `status` says what to run and `resume --nodes 1` is accepted at once: it
    continues at world 2 from the newest checkpoint."""
    cfg = write_config(tmp_path / "run.yaml", **_config(tmp_path, "short"))
    slurm_cluster3.wait_idle()
    job = _submit("train", "--config", cfg, *SLURM, "--nodes", "2-3", "--gpus-per-node", "2")
    run = tmp_path / "runs" / "short"
    wait_train_step(run, 15, timeout=180)
    try:
        _node_down(slurm_cluster3, "n2")
        _node_down(slurm_cluster3, "n3")
        _wait_for(lambda: "after 0 retries" in _batch_log(run, job), "the job did not stop",
                  timeout=120)
        _wait_for(lambda: node_loss.read_ended(run, job) is not None, "no ended record",
                  timeout=30)
        assert slurm_cluster3.job_state(job)[0] == "COMPLETING"  # until SlurmdTimeout
        ended = node_loss.read_ended(run, job)
        assert (ended["rc"], ended["lost"], ended["nodes"], ended["min"]) == \
            (1, ["n2", "n3"], ["n1"], 2), ended
        status = cli("status", run, timeout=60)
        assert status.returncode == 0, status.stderr
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("stopped:"))
        assert f"job {job} lost n2,n3" in line and "fewer than its minimum 2" in line, line
        assert line.endswith(f"continue with enn-submit resume {run} --nodes 1"), line
        assert "in use by" not in status.stdout, status.stdout
        again = _submit("resume", run, *SLURM, "--nodes", "1", "--gpus-per-node", "2")
        assert slurm_cluster3.job_state(job)[0] == "COMPLETING"  # accepted while it still was
        slurm_cluster3.wait_job(again, ("COMPLETED",), timeout=240)
    finally:
        up = slurm_cluster3.up()
    assert up.returncode == 0, up.stderr
    resume = metrics(run, "resume")[-1]
    assert (resume["from_world"], resume["world_size"]) == (6, 2), resume
    assert STEPS in store.committed_steps(run / "checkpoints")
    log = _batch_log(run, job)
    assert "enn: lost node(s) n2,n3; 1 answer, fewer than the job's minimum 2" in log, log[-3000:]
    assert f"enn: job {job} failed (exit 1) after 0 retries (limit 0)" in log, log[-3000:]
    assert not metrics(run, "node_lost")
    assert [s["world_size"] for s in metrics(run, "start")] == [6, 2]
    assert not list(run.glob("requeue/relaunch-*"))
    assert outside_layout(run) == []  # the batch shell's records included
