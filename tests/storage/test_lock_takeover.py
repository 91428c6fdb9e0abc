"""Taking over a stale run lock: two real processes race for it and exactly one wins. The
old takeover judged the lock, then unlinked whatever was there by then: a racer's fresh
claim. It is now renamed aside and only the stale file judged is removed. And the worker
inside a container, where no Slurm client answers, is told by the host side whether the job
that a lock names still lives."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from enn_cluster.errors import UserError
from enn_cluster.storage.lock_files import take_aside
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_lock import acquire_lock, clear_lock_of_job, read_lock
from helpers import ROOT

RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from enn_cluster.errors import UserError
    from enn_cluster.storage.rundir import RunDir
    from enn_cluster.storage.run_lock import acquire_lock, lock_owner
    run, judge_s = RunDir(Path(sys.argv[1])), float(sys.argv[2])
    while not (run.path / "go").exists():
        time.sleep(0.01)
    def slurm_job_alive(job_id):  # Slurm's answer about the stale job: slow, and "ended"
        time.sleep(judge_s)
        return False
    try:
        acquire_lock(run, lock_owner(), slurm_job_alive=slurm_job_alive)
        print("won", flush=True)
    except UserError as exc:
        print("refused " + str(exc), flush=True)
        sys.exit(0)
    while not (run.path / "stop").exists():  # hold the lock while the other one judges
        time.sleep(0.01)
""")


@pytest.mark.parametrize("judge_s", [(0.2, 1.5), (0.5, 0.5)])
def test_two_processes_racing_for_a_stale_lock_one_wins(tmp_path, judge_s):
    """(0.2, 1.5): the slow judge decides after the fast one has taken over; a blind unlink
    then deletes the winner's fresh claim and both run. (0.5, 0.5): they decide together."""
    run = RunDir(tmp_path)
    run.lock_path.write_text(json.dumps({"slurm_job_id": "5", "host": "slurm", "pid": 0}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(s)],
                               stdout=subprocess.PIPE, text=True, env=env) for s in judge_s]
    try:
        (tmp_path / "go").touch()
        said = [p.stdout.readline().strip() for p in racers]
    finally:
        (tmp_path / "stop").touch()
        codes = [p.wait(timeout=60) for p in racers]
    assert codes == [0, 0]
    assert sorted(s.split()[0] for s in said) == ["refused", "won"], said
    assert "in use by pid" in [s for s in said if s.startswith("refused")][0]
    assert not list(tmp_path.glob(".run.lock.stale-*")), "a lock was left aside"


def test_take_aside_removes_only_the_lock_judged(tmp_path):
    run = RunDir(tmp_path)
    stale = {"slurm_job_id": "5", "host": "slurm", "pid": 0}
    fresh = {"slurm_job_id": "6", "host": "slurm", "pid": 0}
    run.lock_path.write_text(json.dumps(fresh))  # a racer's claim replaced the stale one
    inode = run.lock_path.stat().st_ino
    assert take_aside(run.lock_path, stale) is False
    assert read_lock(run) == fresh and run.lock_path.stat().st_ino == inode
    run.lock_path.write_text(json.dumps(stale))
    assert take_aside(run.lock_path, stale) is True and not run.lock_path.exists()
    assert take_aside(run.lock_path, stale) is False  # the other renamer finds nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cancel_clears_only_the_lock_of_the_job_it_cancelled(tmp_path):
    run = RunDir(tmp_path)
    run.lock_path.write_text(json.dumps({"slurm_job_id": "14", "host": "slurm", "pid": 0}))
    assert clear_lock_of_job(run, "15") is False and run.lock_path.exists()
    assert clear_lock_of_job(run, "14") is True and not run.lock_path.exists()
    assert clear_lock_of_job(run, "14") is False


@pytest.mark.parametrize("told, outcome", [
    ("14:gone", "taken"), ("14:alive", "in use by Slurm job 14;"),
    ("13:gone", "taken for alive: no Slurm client"), ("", "taken for alive: no Slurm client"),
    ("14:maybe", "taken for alive: no Slurm client")])
def test_worker_without_a_slurm_client_uses_the_hosts_answer(tmp_path, monkeypatch, told, outcome):
    """Inside an image there is no Slurm client: a lock left by job 14 (cancelled while pending)
    is taken over when the host side said the job is gone, and a refusal for want of an
    answer says that nobody could ask. The liveness is the worker's own (worker_lock)."""
    from enn_cluster.cluster.slurm import lock_liveness

    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("ENN_LOCK_JOB_STATE", told)
    run = RunDir(tmp_path)
    run.lock_path.write_text(json.dumps({"slurm_job_id": "14", "host": "slurm", "pid": 0}))
    if outcome == "taken":
        assert acquire_lock(run, {"slurm_job_id": "20", "host": "n1", "pid": 7},
                            slurm_job_alive=lock_liveness())["pid"] == 7
        return
    assert lock_liveness() is None  # no Slurm client on PATH
    with pytest.raises(UserError, match=outcome):
        acquire_lock(run, {"slurm_job_id": "20", "host": "n1", "pid": 7},
                     slurm_job_alive=lock_liveness())
    assert json.loads(run.lock_path.read_text())["slurm_job_id"] == "14"


def _host_answer(tmp_path, lock_text, squeue: str, job_id="20"):
    """What the batch script's host side exports for the worker, asked of `squeue` (a
    script standing in for the controller's answer; empty: no squeue on this host)."""
    from enn_cluster.cluster import job_script

    run = tmp_path / "run"
    (run / "requeue").mkdir(parents=True, exist_ok=True)
    if lock_text is not None:
        (run / "run.lock").write_text(lock_text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("timeout", "head", "sed", "bash", "rm"):
        target = bin_dir / tool
        if not target.exists():
            target.symlink_to(subprocess.run(["bash", "-c", f"command -v {tool}"],
                                             capture_output=True, text=True).stdout.strip())
    if squeue:
        (bin_dir / "squeue").write_text("#!/bin/sh\n" + squeue + "\n")
        (bin_dir / "squeue").chmod(0o755)
    script = "\n".join(job_script.host_setup_lines()) + '\nprintf "<%s>" "${ENN_LOCK_JOB_STATE-}"\n'
    env = {"PATH": str(bin_dir), "SLURM_JOB_ID": job_id, "ENN_RUN_DIR": str(run),
           "MASTER_PORT": "1"}
    done = subprocess.run([str(bin_dir / "bash"), "-c", script], capture_output=True,
                          text=True, timeout=60, env=env)
    return done.stdout[done.stdout.index("<") + 1:done.stdout.index(">")]


LOCK_14 = json.dumps({"slurm_job_id": "14", "host": "slurm", "pid": 0, "submission": "t"})


@pytest.mark.parametrize("lock_text, squeue, told", [
    (LOCK_14, "echo CANCELLED", "14:gone"),
    (LOCK_14, "echo PENDING", "14:alive"),
    (LOCK_14, "echo PENDING; echo COMPLETED", "14:alive"),  # an array: the first line
    (LOCK_14, "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", "14:gone"),
    (LOCK_14, "echo 'Unable to contact slurm controller' >&2; exit 1", ""),  # cannot say
    (LOCK_14, "echo", ""),  # an answer that is no state
    (LOCK_14, "", ""),  # no squeue on this host either
    (LOCK_14.replace("14", "20"), "echo RUNNING", ""),  # the job itself
    ('{"slurm_job_id": "14; touch MARKER"}', "echo CANCELLED", ""),
    ('{"pid": 9, "host": "h"}', "echo CANCELLED", ""), (None, "echo x", ""),
])
def test_host_side_asks_slurm_about_the_lock_job_before_srun(tmp_path, lock_text, squeue,
                                                             told):
    assert _host_answer(tmp_path, lock_text, squeue) == told
    assert not list(tmp_path.rglob("MARKER"))
