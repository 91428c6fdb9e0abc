"""Talking to Slurm (cluster/slurm.py, the one gateway): squeue's and sinfo's machine-readable
lines and scontrol's text read with their spaces (real output, tests/data/slurm, captured on
slurm/dev/cluster.sh with Slurm 22.05.8), a requeued job's hold, a pending job's reason and a
node Slurm no longer hears from shown by status, the polls of --wait and status --follow
backing off (a fake clock: nothing sleeps), a machine that cannot submit refused before
anything else, and the gateway against the real controller."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from enn_cluster.client import status as status_mod
from enn_cluster.client.status_text import pending_fix_lines, progress_line, slurm_lines
from enn_cluster.cluster.slurm_watch import Backoff, SlurmWatch, node_hint, wait_for_job
from enn_cluster.cluster.submit_slurm import check_slurm_here, slurm_problem
from enn_cluster.errors import UserError
from enn_cluster.cluster import slurm
from enn_cluster.cluster.slurm import dead_nodes, describe, held_until, parse_scontrol, parse_squeue
from helpers import ROOT, TESTS, small_config, write_config

DATA = TESTS / "data" / "slurm"


def captured(name: str) -> str:
    return (DATA / name).read_text()


def job(job_id: str) -> dict:
    """A job of one batched squeue call (tests/data/slurm/README-squeue.txt)."""
    return parse_squeue(captured("squeue_pending_reasons.txt"))[job_id]


# -- squeue's lines --------------------------------------------------------------------

def test_one_squeue_line_per_job_keeps_free_text_whole():
    jobs = parse_squeue(captured("squeue_pending_reasons.txt"))
    assert sorted(jobs, key=int) == ["2", "8", "10", "11", "12", "13", "14"]
    assert jobs["2"]["comment"] == "enn-cluster:abc def"  # a space
    assert jobs["14"]["comment"] == "enn-cluster:x|y z"  # the separator itself, kept
    assert jobs["8"]["comment"].endswith("|x y") and jobs["11"]["comment"] is None
    assert jobs["2"]["state"] == "RUNNING" and jobs["2"]["nodes"] == "n1"
    assert jobs["13"]["node_count"] == 2 and jobs["13"]["nodes"] is None
    # squeue spells reasons with spaces; scontrol (and NEVER_STARTS, and our messages) with _
    assert jobs["12"]["reason"] == "ReqNodeNotAvail,_UnavailableNodes:n3"
    assert jobs["11"]["reason"].startswith("Nodes_required_for_job_are_DOWN,_DRAINED")


def test_the_squeue_command_asks_every_job_at_once_in_the_fields_parsed():
    cmd = slurm.squeue_command(["4", "7", "9"])
    assert cmd[:6] == ["squeue", "-h", "-t", "all", "-j", "4,7,9"]
    assert cmd[-1].split(",") == [f"{name}:|" for name in slurm.JOB_FIELDS]
    assert slurm.JOB_FIELDS[-1] == "Comment"  # free text last: split with a maximum


def test_sacct_answers_for_jobs_the_controller_forgot():
    found = slurm.parse_sacct("41|COMPLETED|0:0\n42|CANCELLED by 0|0:15\n")
    assert found["41"] == {"job_id": "41", "state": "COMPLETED", "exit_code": "0:0"}
    assert found["42"]["state"] == "CANCELLED"


# -- scontrol's text (the partition shape) ----------------------------------------------

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

def test_a_requeued_job_says_slurm_holds_it_until_when():
    state = job("8")
    start = "2026-11-27 11:20:08"
    assert state["restarts"] == 1 and state["reason"] == "BeginTime"
    assert held_until(state) == f"requeued, held by Slurm until {start} (BeginTime)"
    assert describe(state) == f"PENDING (Reason=BeginTime): {held_until(state)}"
    assert f"held:            {held_until(state)}" in slurm_lines(state)
    line = progress_line(_status(state))
    assert f"slurm PENDING (held until {start})" in line


def test_a_job_not_held_shows_no_hold():
    state = job("2")
    assert held_until(state) is None and describe(state) == "RUNNING"
    assert held_until({**state, "state": "PENDING", "reason": "Priority"}) is None
    begin = {**state, "state": "PENDING", "reason": "BeginTime", "restarts": 0}
    assert held_until(begin).startswith("held by Slurm until")  # sbatch --begin: no requeue


# -- a node Slurm no longer hears from --------------------------------------------------

def test_a_node_not_responding_under_a_running_job_is_named():
    dead = dead_nodes(captured("sinfo_one_not_responding.txt"))
    assert dead == {"n2": "COMPLETING*"}  # listed once per partition, named once
    assert dead_nodes(captured("sinfo_one_down.txt")) == {"n2": "COMPLETING*", "n3": "DOWN"}
    assert dead_nodes("n1|idle~\nn4|mixed+drain\nn5|fail\n") == {"n1": "IDLE~", "n5": "FAIL"}
    (running,) = parse_squeue(captured("squeue_on_a_node_not_responding.txt")).values()
    state = {**running, "dead_nodes": dead}
    assert state["state"] == "RUNNING" and state["nodes"] == "n2"
    (hint,) = [line for line in slurm_lines(state) if line.startswith("node down:")]
    assert "n2 (COMPLETING*)" in hint and "SlurmdTimeout" in hint
    assert "node n2 not answering" in progress_line(_status(state))
    assert node_hint({**state, "dead_nodes": {}}) is None
    assert node_hint({**state, "state": "COMPLETING"}) is None


def test_the_nodes_are_asked_once_and_only_while_it_runs():
    running = job("2")
    asked = []
    watch = SlurmWatch(ask_job=lambda j: running,
                       ask_nodes=lambda n: asked.append(n) or {"n1": "DOWN"})
    assert watch.job_state("2")["dead_nodes"] == {"n1": "DOWN"}
    assert watch.job_alive("2") and asked == ["n1"]
    held = SlurmWatch(ask_job=lambda j: job("8"), ask_nodes=lambda n: asked.append(n) or {})
    assert "dead_nodes" not in held.job_state("8") and asked == ["n1"]


# -- a pending job's reason --------------------------------------------------------------

def test_a_job_waiting_for_a_down_node_says_which_and_what_to_run():
    named, unnamed = job("12"), job("11")
    assert "waits for node n3 that Slurm has down, drained or reserved" in \
        slurm.pending_why(named)
    assert "waits for nodes that Slurm has down" in slurm.pending_why(unnamed)
    st = {**_status(unnamed), "run_dir": "/runs/a b"}
    (fix,) = pending_fix_lines(st)
    assert "enn-submit cancel '/runs/a b', then enn-submit resume '/runs/a b' --nodes 2" in fix
    assert "pending:         waits for nodes" in "\n".join(slurm_lines(unnamed))


def test_waiting_its_turn_names_the_reason_and_asks_nothing_of_anyone():
    waiting = job("13")
    assert slurm.pending_why(waiting) == \
        "waits behind jobs of higher priority (Reason=Priority)"
    assert pending_fix_lines({**_status(waiting), "run_dir": "/r"}) == []
    limit = {**waiting, "reason": "QOSMaxNodePerUserLimit"}
    assert "leave room under a limit (Reason=QOSMaxNodePerUserLimit)" in slurm.pending_why(limit)
    assert slurm.pending_why(job("8")) is None  # held until a time: held_until says so
    assert slurm.pending_why(job("2")) is None  # running


def test_a_job_that_can_never_start_says_what_to_change():
    never = job("14")
    assert slurm.never_starts(never) and "never start it as asked" in slurm.pending_why(never)
    (fix,) = pending_fix_lines({**_status(never), "run_dir": "/r"})
    assert fix.startswith("to run:          enn-submit cancel /r, then enn-submit resume /r")


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


def test_backoff_asks_at_0_1_2_3_4_then_a_quarter_of_the_time_since_then_once_a_minute():
    clock, asked = FakeClock(), []
    backoff = Backoff(start=clock())
    while clock.now < 1000 + 300:
        if backoff.due(clock()):
            asked.append(clock.now - 1000)
            backoff.asked(clock())
        clock.sleep(0.5)
    assert asked[:10] == [0, 1, 2, 3, 4, 5.5, 7.5, 10, 13.5, 18]
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert max(gaps) == 60 and gaps[-1] == 60  # submitit's InfoWatcher cap
    assert all(b - a <= max(1, (b - 0) / 4) + 0.5 for a, b in zip(asked, asked[1:]))
    assert len([t for t in asked if t < 180]) == 17  # polite: not once a second


def test_a_job_that_ends_is_seen_within_a_third_of_its_time_in_that_state():
    """submitit's halving saw an 8.1 s step end at 16 s; a quarter of the elapsed time
    per wait sees any end within a third of the time since the last change (or 1 s)."""
    for ends_at in (0.5, 3.2, 8.1, 20.0, 33.3, 100.0, 170.0):
        backoff, now = Backoff(start=0.0), 0.0
        while True:
            now += backoff.wait_s(now)
            backoff.asked(now)
            if now >= ends_at:
                break
        assert now - ends_at <= max(1.0, ends_at / 3) + 1e-9, (ends_at, now)


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
    assert [round(t, 2) for t in pending] == \
        [0, 1, 2, 3, 4, 5.33, 7.11, 9.48, 12.64, 16.86, 22.47, 29.97, 39.95, 53.27, 71.03, 94.71]
    after = [t for t in asked if 100 <= t]  # RUNNING seen at 126.28, a quarter of 100 late
    assert [round(t - after[0], 2) for t in after[:5]] == [0, 1, 2, 3, 4]  # starts over
    assert 126 < after[0] < 127
    assert asked[-1] - asked[-2] <= 60 and asked[-1] >= 400
    assert len(asked) < 40  # a 1 s poll would have asked 400 times
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
    assert [t - 1000 for t in asked] == [0, 1, 2, 3, 4, 5.5, 7.5, 10, 13.5, 18]


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
    assert "no sbatch on PATH" in str(slurm_problem(False, None))
    assert slurm_problem(True, _ping("ping_up.txt")) is None
    assert "Slurm is not configured on this machine" in str(slurm_problem(
        True, _ping("ping_unconfigured.txt")))
    down = str(slurm_problem(True, _ping("ping_controller_down.txt")))
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


@pytest.mark.slurm
def test_the_gateway_asks_every_job_in_one_squeue_call(slurm_cluster, tmp_path, monkeypatch):
    """Against the real controller: one squeue call answers a running job (its comment with a
    space and a '|' whole), a finished one, one that can never start, and one Slurm never
    had; scontrol, asked apart, agrees on each state."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "asked"
    for tool in ("squeue", "sacct"):  # count the calls; the real tool answers
        real = shutil.which(tool, path=slurm_cluster.env.get("PATH"))
        (bin_dir / tool).write_text(f'#!/bin/sh\necho {tool} >> "{log}"\nexec {real} "$@"\n')
        (bin_dir / tool).chmod(0o755)

    def sbatch(*args) -> str:
        done = slurm_cluster.run(["sbatch", "--parsable", "-o", "/dev/null", *args])
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    running = sbatch("-N1", "--comment", "enn-cluster:a b|c", "--wrap", "sleep 60")
    ended = sbatch("-N1", "--wrap", "exit 3")
    never = sbatch("-N9", "--wrap", "true")
    try:
        slurm_cluster.wait_job(running, ("RUNNING",), timeout=30)
        slurm_cluster.wait_job(ended, ("FAILED",), timeout=30)
        monkeypatch.setenv("PATH", f"{bin_dir}:{slurm_cluster.env['PATH']}")
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
        states = slurm.job_states([running, ended, never, "999999"])
        assert log.read_text().split() == ["squeue", "sacct"]  # sacct: only for 999999
        for job in (running, ended, never):
            assert states[job]["state"] == slurm_cluster.job_state(job)[0]
        assert states[running]["comment"] == "enn-cluster:a b|c"
        assert states[never]["reason"].startswith("Partition") and slurm.never_starts(states[never])
        assert states["999999"]["state"] == "UNKNOWN"
        assert slurm.job_alive(running) and not slurm.job_alive(ended)
    finally:
        slurm_cluster.run(["scancel", running, never])


def test_a_node_the_job_went_on_without_is_no_longer_said_to_hold_it():
    """Issue 37: after the in-job relaunch, Slurm keeps the lost node in the job's node list
    (IDLE*) until it declares it down; status names the loss (node lost: ...), not a node
    that keeps a RUNNING job waiting to be requeued. Another job's loss changes nothing."""
    (running,) = parse_squeue(captured("squeue_on_a_node_not_responding.txt")).values()
    state = {**running, "dead_nodes": dead_nodes(captured("sinfo_one_down.txt"))}
    mine = [{"kind": "node_lost", "job_id": running["job_id"], "lost": ["n2"]}]
    other = [{"kind": "node_lost", "job_id": "9999", "lost": ["n2", "n3"]}]
    shown = status_mod.without_nodes_gone_on_from(state, mine)
    assert shown["dead_nodes"] == {"n3": "DOWN"}
    (hint,) = [line for line in slurm_lines(shown) if line.startswith("node down:")]
    assert "n3 (DOWN)" in hint and "n2" not in hint
    assert status_mod.without_nodes_gone_on_from(state, other) == state
    gone = status_mod.without_nodes_gone_on_from(state, mine + [{**mine[0], "lost": ["n3"]}])
    assert not [line for line in slurm_lines(gone) if line.startswith("node down:")]
