"""Talking to Slurm: scontrol's text read with its spaces (real output, tests/data/slurm,
captured on slurm/dev/cluster.sh with Slurm 22.05.8, which has no `scontrol --json`), a
requeued job's hold and a node Slurm no longer hears from shown by status, the polls of
--wait and status --follow backing off (a fake clock: nothing sleeps), and a machine that
cannot submit refused before anything else."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from enn_cluster.client.status import progress_line, slurm_lines
from enn_cluster.cluster.slurm_watch import Backoff, SlurmWatch, node_hint, wait_for_job
from enn_cluster.cluster.submit_slurm import check_slurm_here, slurm_problem
from enn_cluster.errors import UserError
from enn_cluster.storage.slurm_jobs import (
    dead_nodes,
    describe,
    held_until,
    parse_scontrol,
    state_from_fields,
)
from helpers import ROOT, TESTS, small_config, write_config

DATA = TESTS / "data" / "slurm"


def captured(name: str) -> str:
    return (DATA / name).read_text()


def job(name: str, job_id: str = "3") -> dict:
    return state_from_fields(job_id, parse_scontrol(captured(name)))


# -- scontrol's text -------------------------------------------------------------------

def test_values_with_spaces_stay_whole():
    f = parse_scontrol(captured("job_running_spaces.txt"))
    assert f["WorkDir"] == "/tmp/enn adapt wd"
    assert f["Comment"] == "enn-cluster:abc def"
    assert f["JobName"] == "two words"
    assert f["StdOut"] == "/tmp/enn adapt wd/slurm-3.out"
    assert f["JobState"] == "RUNNING" and f["UserId"] == "root(0)"
    assert f["TRES"] == "cpu=1,mem=500M,node=1,billing=1"  # '=' inside a value
    assert f["AllocNode:Sid"] == "localhost:11423" and f["CPUs/Task"] == "1"
    assert f["Power"] == ""  # an empty value at the end of the line


def test_a_nodes_os_with_spaces_and_an_empty_value():
    f = parse_scontrol(captured("node_down.txt"))
    assert f["OS"].startswith("Linux ") and " #1 SMP" in f["OS"]
    assert f["State"] == "DOWN+NOT_RESPONDING" and f["RealMemory"] == "4000"


def test_of_several_lines_the_first_one_wins():
    assert parse_scontrol("JobId=1 JobState=RUNNING\nJobId=2 JobState=PENDING Extra=x\n") \
        == {"JobId": "1", "JobState": "RUNNING", "Extra": "x"}


# -- a requeued job's hold --------------------------------------------------------------

@pytest.mark.parametrize("name", ["job_requeued_begintime.txt",
                                  "job_requeued_after_node_down.txt"])
def test_a_requeued_job_says_slurm_holds_it_until_when(name):
    state = job(name)
    start = parse_scontrol(captured(name))["StartTime"].replace("T", " ")
    assert held_until(state) == f"requeued, held by Slurm until {start} (BeginTime)"
    assert describe(state) == f"PENDING (Reason=BeginTime): {held_until(state)}"
    assert f"held:            {held_until(state)}" in slurm_lines(state)
    line = progress_line(_status(state))
    assert f"slurm PENDING (held until {start})" in line


def test_a_job_not_held_shows_no_hold():
    state = job("job_running_spaces.txt")
    assert held_until(state) is None and describe(state) == "RUNNING"
    assert held_until({**state, "state": "PENDING", "reason": "Priority"}) is None
    begin = {**state, "state": "PENDING", "reason": "BeginTime", "restarts": 0}
    assert held_until(begin).startswith("held by Slurm until")  # sbatch --begin: no requeue


# -- a node Slurm no longer hears from --------------------------------------------------

def test_a_node_not_responding_under_a_running_job_is_named():
    dead = dead_nodes(captured("nodes_one_not_responding.txt"))
    assert dead == {"n2": "MIXED+NOT_RESPONDING"}
    assert dead_nodes(captured("node_down.txt")) == {"n2": "DOWN+NOT_RESPONDING"}
    state = {**job("job_running_node_not_responding.txt", "4"), "dead_nodes": dead}
    assert state["state"] == "RUNNING" and state["nodes"] == "n[1-2]"
    (hint,) = [line for line in slurm_lines(state) if line.startswith("node down:")]
    assert "n2 (MIXED+NOT_RESPONDING)" in hint and "SlurmdTimeout" in hint
    assert "node n2 not answering" in progress_line(_status(state))
    assert node_hint({**state, "dead_nodes": {}}) is None
    assert node_hint({**state, "state": "COMPLETING"}) is None


def test_the_nodes_are_asked_once_and_only_while_it_runs():
    running = job("job_running_node_not_responding.txt", "4")
    asked = []
    watch = SlurmWatch(ask_job=lambda j: running,
                       ask_nodes=lambda n: asked.append(n) or {"n2": "DOWN"})
    assert watch.job_state("4")["dead_nodes"] == {"n2": "DOWN"}
    assert watch.job_alive("4") and asked == ["n[1-2]"]
    held = SlurmWatch(ask_job=lambda j: job("job_requeued_begintime.txt"),
                      ask_nodes=lambda n: asked.append(n) or {})
    assert "dead_nodes" not in held.job_state("3") and asked == ["n[1-2]"]


def _status(slurm: dict) -> dict:
    return {"last_step": 3, "total_steps": 10, "last_loss": 0.5, "last_eval_loss": None,
            "samples_per_s": None, "step_time_s": None, "lock": None,
            "last_checkpoint": None, "slurm": slurm}


# -- backing off ------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_backoff_asks_at_0_2_4_8_16_then_once_a_minute():
    clock, asked = FakeClock(), []
    backoff = Backoff(start=clock())
    while clock.now < 1000 + 300:
        if backoff.due(clock()):
            asked.append(clock.now - 1000)
            backoff.asked(clock())
        clock.sleep(0.5)
    assert asked[:6] == [0, 2, 4, 8, 16, 32]
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert max(gaps) == 60 and gaps[-1] == 60  # submitit's InfoWatcher cap


def test_wait_asks_less_often_while_nothing_changes_and_soon_after_a_change(capsys):
    clock, asked = FakeClock(), []
    timeline = [(0, "PENDING"), (100, "RUNNING"), (400, "COMPLETED")]

    def ask(job_id):
        t = clock.now - 1000
        asked.append(t)
        state = [s for at, s in timeline if at <= t][-1]
        return {"job_id": job_id, "state": state, "reason": "None"}

    assert wait_for_job("7", ask=ask, clock=clock, sleep=clock.sleep) == 0
    pending = [t for t in asked if t < 100]
    assert pending == [0, 2, 4, 8, 16, 32, 64]  # then 124 (60 s at most): RUNNING seen
    after = [t for t in asked if 100 <= t]
    assert after[:5] == [124, 126, 128, 132, 140]  # a change starts the schedule over
    assert asked[-1] - asked[-2] == 60 and asked[-1] >= 400
    assert len(asked) < 25  # a 1 s poll would have asked 400 times
    err = capsys.readouterr().err
    assert err.splitlines() == ["Slurm job 7: PENDING", "Slurm job 7: RUNNING",
                                "Slurm job 7: COMPLETED"]


def test_follow_reuses_answers_until_the_next_ask_is_due():
    clock, asked = FakeClock(), []
    watch = SlurmWatch(clock=clock, ask_job=lambda j: asked.append(clock.now) or
                       {"job_id": j, "state": "PENDING", "reason": "Priority"})
    for _ in range(40):  # status --follow redraws every 0.5 s for 20 s
        watch.job_state("9")
        watch.job_alive("9")
        clock.sleep(0.5)
    assert [t - 1000 for t in asked] == [0, 2, 4, 8, 16]


def test_one_status_asks_once_per_job():
    asked = []
    watch = SlurmWatch(ask_job=lambda j: asked.append(j) or {"job_id": j, "state": "PENDING"})
    watch.job_state("5"), watch.job_alive("5"), watch.job_state("5")
    assert asked == ["5"]


# -- a machine that cannot submit --------------------------------------------------------

def _ping(name: str) -> subprocess.CompletedProcess:
    *out, rc = captured(name).strip().splitlines()
    return subprocess.CompletedProcess([], int(rc.split("=")[1]), "\n".join(out), "")


def test_what_scontrol_ping_says_decides():
    assert "no sbatch on PATH" in slurm_problem(False, None)
    assert slurm_problem(True, _ping("ping_up.txt")) is None
    assert "Slurm is not configured on this machine" in slurm_problem(
        True, _ping("ping_unconfigured.txt"))
    down = slurm_problem(True, _ping("ping_controller_down.txt"))
    assert "controller does not answer" in down and "is DOWN" in down
    odd = subprocess.CompletedProcess([], 1, "", "scontrol: error: something else")
    assert slurm_problem(True, odd) is None and slurm_problem(True, None) is None  # sbatch says


@pytest.mark.skipif(shutil.which("scontrol") is None or shutil.which("sbatch") is None,
                    reason="no Slurm client installed")
def test_a_real_unconfigured_slurm_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode == 0:
        pytest.skip("this machine's Slurm is configured")
    with pytest.raises(UserError, match=r"^--cluster slurm: Slurm is not configured"):
        check_slurm_here()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/usr/bin/sbatch"), reason="no Slurm client installed")
def test_sbatch_that_finds_no_configuration_says_slurm_is_not_configured(tmp_path):
    """No scontrol to ask first (sbatch alone on PATH): sbatch's own refusal is read."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").symlink_to("/usr/bin/sbatch")
    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "noconf"))
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}  # none configured
    env.update(PATH=str(bin_dir), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                          str(cfg), "--cluster", "slurm", "--container", "none", "--time", "10",
                          "--nodes", "1", "--procs-per-node", "1"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    (line,) = [x for x in res.stderr.splitlines() if not x.startswith("sbatch: ")]  # its own
    assert "Slurm is not configured on this machine" in line, line
    assert "Could not establish a configuration source" in line, line
    assert not (tmp_path / "runs" / "noconf").exists()
