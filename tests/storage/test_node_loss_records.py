"""Issue 29's pieces that decide, apart from the real-Slurm tests in
test_node_loss_continue.py: the batch shell's relaunch record read as untrusted, its record
in metrics.jsonl and jobs.jsonl, `status`'s lines, the relaunch's log folder and its place
in the attempts' order, and the rendezvous keys that keep a failed step out of the new one."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import replace
from datetime import timedelta

from enn_cluster.client.status import with_last_step
from enn_cluster.client.status_text import node_loss_lines, progress_line
from enn_cluster.cluster.job_spec import JobSpec
from enn_cluster.cluster.job_script import render_batch_script
from enn_cluster.storage import node_loss
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.attempts import attempt_order
from enn_cluster.storage.metrics import MetricsLog
from enn_cluster.storage.rundir import RunDir
from enn_cluster.worker.entry import _attempt_tag
from enn_cluster.worker.environment import WorkerEnv, discover

GOOD = ("lost=n3\nnodes=n1,n2\nended=1795634000.5\ndetected=1795634012.25\n"
        "relaunch=1\nlaunched=1795634012.3\n")


def _write(run, name: str, text: str) -> None:
    (run / "requeue").mkdir(parents=True, exist_ok=True)
    (run / "requeue" / name).write_text(text)


def test_a_relaunch_record_is_read_with_every_field_checked(tmp_path):
    assert node_loss.parse_relaunch(GOOD) == {
        "lost": ["n3"], "nodes": ["n1", "n2"], "ended": 1795634000.5,
        "detected": 1795634012.25, "launched": 1795634012.3, "relaunch": 1, "world": None,
        "probed": None, "spare_in": [], "spares": []}
    spared = node_loss.parse_relaunch(GOOD + "spare_in=n4\nspares=n5,n6\n")
    assert (spared["spare_in"], spared["spares"]) == (["n4"], ["n5", "n6"])
    assert node_loss.parse_relaunch(GOOD + "spare_in=$(x)\n")["spare_in"] == []
    assert node_loss.parse_relaunch(GOOD + "world=4\n")["world"] == 4
    assert node_loss.parse_relaunch(GOOD + "probed=1795634001.5\n")["probed"] == 1795634001.5
    assert node_loss.parse_relaunch(GOOD + "probed=$(x)\n")["probed"] is None
    assert node_loss.parse_relaunch(GOOD + "world=four\n")["world"] is None  # older shells: none
    for bad in (GOOD.replace("n3", "$(reboot)"), GOOD.replace("nodes=n1,n2\n", ""),
                GOOD.replace("1795634012.25", "soon"), GOOD.replace("relaunch=1", "relaunch=-1"),
                GOOD.replace("nodes=n1,n2", "nodes=n1,,n2"), ""):
        assert node_loss.parse_relaunch(bad) is None, bad
    run = tmp_path / "run"
    _write(run, "relaunch-7", GOOD)
    assert node_loss.read_relaunch(run, "7")["lost"] == ["n3"]
    assert node_loss.read_relaunch(run, "8") is None
    _write(run, "relaunch-9", GOOD + "#" * node_loss.MAX_BYTES)  # too big to be ours
    assert node_loss.read_relaunch(run, "9") is None
    os.symlink(run / "requeue" / "relaunch-7", run / "requeue" / "relaunch-10")
    assert node_loss.read_relaunch(run, "10") is None  # a link is not the shell's file
    _write(run, "probing-7", "1795634001\n")
    assert node_loss.probing_since(run, "7") == 1795634001.0
    _write(run, "probing-8", "now\n")
    assert node_loss.probing_since(run, "8") is None and node_loss.probing_since(run, "9") is None


def test_rank_0_of_the_relaunch_records_the_loss_once_in_both_files(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    _write(run.path, "relaunch-7", GOOD)
    log = MetricsLog(run.path / "metrics.jsonl", enabled=True)
    assert node_loss.record_relaunch(run, log, "7", relaunch=2, world_size=4, step=20) is None
    assert not (run.path / "metrics.jsonl").read_text()  # another relaunch's record: nothing
    assert not (run.path / "jobs.jsonl").exists()
    fields = node_loss.record_relaunch(run, log, "7", relaunch=1, world_size=4, step=20)
    log.close()
    (rec,) = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert rec["kind"] == "node_lost" and rec["lost"] == ["n3"] and rec["nodes"] == ["n1", "n2"]
    assert (rec["world_size"], rec["step"], rec["job_id"], rec["detected"]) == \
        (4, 20, "7", 1795634012.25)
    (job,) = run.jobs()
    assert job.kind == "relaunch" and job.hosts == ("n1", "n2") and job.lost == ("n3",)
    assert (job.job_id, job.relaunch, job.world_size, job.step, job.detected) == \
        ("7", 1, 4, 20, fields["detected"])


def test_status_names_the_lost_node_and_a_probe_under_way():
    st = {"node_losses": [{"lost": ["n3"], "nodes": ["n1", "n2"], "detected": 0.0,
                           "job_id": "7", "world_size": 4, "step": 20}],
          "probing_since": 5.0, "lock": {"pid": 1}, "slurm": None}
    lines = node_loss_lines(st)
    assert lines[0].startswith("node lost:       n3 by ")  # no step logged before it ended
    assert lines[0].endswith("(job 7): went on with 2 node(s), world 4, from step 20")
    assert lines[1].startswith("probing:         since ") and "still answer" in lines[1]
    assert node_loss_lines({**st, "lock": None}) == lines[:1]  # over: no probe to report
    spared = {**st["node_losses"][0], "nodes": ["n1", "n4"], "spare_in": ["n4"],
              "spares": ["n5"]}
    (line,) = node_loss_lines({"node_losses": [spared], "lock": None})
    assert line.endswith("world 4, from step 20; spare n4 in place of n3; 1 spare(s) still held")


def test_a_relaunch_logs_into_its_own_folder_ordered_after_the_step_it_replaces(monkeypatch):
    monkeypatch.delenv("ENN_ATTEMPT_TAG", raising=False)
    monkeypatch.delenv("ENN_LAUNCH_ID", raising=False)
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
               "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "7",
               "SLURM_STEP_ID": "3", "ENN_RELAUNCH": "1"}
    env = discover(environ)
    assert (env.step_id, env.relaunch, env.num_nodes) == ("3", 1, 2)
    assert _attempt_tag(env) == "slurm-7-r0-k1"
    assert _attempt_tag(replace(env, relaunch=0)) == "slurm-7-r0"
    times = {"slurm-7": 100.0}
    folders = {"slurm-7-r1": 50.0, "slurm-7-r0-k1": 40.0, "slurm-7-r0": 60.0,
               "slurm-7-r0-k2": 30.0}
    ordered = sorted(folders, key=lambda f: attempt_order(f, folders[f], times))
    assert ordered == ["slurm-7-r0", "slurm-7-r0-k1", "slurm-7-r0-k2", "slurm-7-r1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_of_the_failed_step_never_joins_the_relaunch_on_the_same_port():
    """Same job, same port: the relaunched step's keys carry its step id, so a rank of the
    failed step that still runs finds none of them and writes none the new step reads."""
    from enn_cluster.worker.lanes import rendezvous_store

    new = WorkerEnv("slurm", 0, 0, 1, 1, 0, 1, "127.0.0.1", _free_port(), job_id="7",
                    step_id="3", relaunch=1)
    store = rendezvous_store(new, timedelta(seconds=10))
    store.set("addr/0", "new")
    stale = rendezvous_store(replace(new, rank=1, step_id="0", relaunch=0), timedelta(seconds=10))
    assert not stale.check(["addr/0"])
    stale.set("addr/0", "stale")
    peer = rendezvous_store(replace(new, rank=1), timedelta(seconds=10))
    assert store.get("addr/0") == peer.get("addr/0") == b"new"


def test_a_refusal_note_is_written_by_the_worker_and_read_as_one_printable_line(tmp_path):
    """worker/refusal.record_refusal writes requeue/refused-JOB; status and doctor read its
    first line as untrusted text: no terminal escape, no FIFO opened, nothing oversized."""
    from enn_cluster.worker.refusal import record_refusal

    (tmp_path / "requeue").mkdir()
    record_refusal(str(tmp_path), "41", "data.train_path: /d/x\u00e9.npy \x1b[2J is missing;\nfix it")
    assert node_loss.read_refusal(tmp_path, "41") == \
        "data.train_path: /d/x\u00e9.npy ?[2J is missing; fix it"
    assert node_loss.read_refusal(tmp_path, "42") is None
    os.mkfifo(tmp_path / "requeue" / "refused-43")
    assert node_loss.read_refusal(tmp_path, "43") is None
    _write(tmp_path, "refused-44", "x" * (node_loss.MAX_BYTES + 1))
    assert node_loss.read_refusal(tmp_path, "44") is None
    (tmp_path / "requeue" / "refused-45").mkdir()
    assert node_loss.read_refusal(tmp_path, "45") is None
    (tmp_path / "requeue" / "refused-46").symlink_to(tmp_path / "requeue" / "refused-41")
    assert node_loss.read_refusal(tmp_path, "46") is None  # never followed


def test_status_names_the_slurm_job_that_holds_the_run_not_a_pid_0():
    """Issue 37 section 4: a Slurm job's lock reads "Slurm job J (at step S)", never
    "pid 0 on slurm"; a local launcher's names its pid and host."""
    from enn_cluster.client.status_text import format_status

    st = {"run_dir": "/r", "last_step": 190, "last_loss": 0.5, "last_eval_loss": None,
          "checkpoints": [180], "last_checkpoint": 180, "corrupt_checkpoints": {},
          "resumes": 0, "jobs": [{}],
          "lock": {"pid": 0, "host": "slurm", "slurm_job_id": "12", "time": 1.0}}
    lines = format_status(st).splitlines()
    assert lines[-1] == "in use by:       Slurm job 12 (at step 190)", lines
    st["lock"] = {"pid": 4321, "host": "login1", "time": 1.0}
    st["starting"] = True
    assert format_status(st).splitlines()[-1] == \
        "in use by:       pid 4321 on login1 (starting: no step of this launch yet)"


def test_doctor_says_a_relaunch_is_under_way_not_that_the_ranks_failed(tmp_path):
    """issue 40: while the batch shell probes after a lost node, and until the relaunched
    workers start, the newest attempt's ranks have exited 1 but the job goes on: doctor's
    logs line says so (warning), and says `problem` again once the job is not live."""
    from enn_cluster.client.doctor import check_logs

    run = RunDir(tmp_path / "run")
    (run.path / "logs").mkdir(parents=True)
    run.record_job(JobRecord(kind="slurm", job_id="7"))
    first = run.path / "logs" / "slurm-7-r0"
    first.mkdir()
    for rank in (0, 1):
        (first / f"rank-{rank}.log").write_text("training\n")
        (first / f"exit-rank-{rank}.json").write_text('{"code": 1}')
    failed = check_logs(run, live=True, q="RUN")
    assert (failed.level, failed.detail) == ("problem", "slurm-7-r0: rank 0 exited 1, rank 1 exited 1")
    _write(run.path, "probing-7", "%d\n" % time.time())  # as host_setup.sh writes it
    probing = check_logs(run, live=True, q="RUN")
    assert probing.level == "warning", probing
    assert probing.detail.startswith("job 7: a step ended on its first node; its batch shell "
                                     "is asking which nodes still answer (for "), probing
    assert " s), to relaunch on those left; slurm-7-r0: rank 0 exited 1" in probing.detail
    assert check_logs(run, live=False, q="RUN").level == "problem"  # the job is over
    (run.path / "requeue" / "probing-7").unlink()
    _write(run.path, "relaunch-7", GOOD)
    starting = check_logs(run, live=True, q="RUN")
    assert starting.level == "warning" and starting.detail.startswith(
        "job 7: node n3 lost; relaunch 1 on n1,n2 is starting; slurm-7-r0: rank 0 exited 1"), starting
    relaunched = run.path / "logs" / "slurm-7-r0-k1"  # the relaunched workers have started
    relaunched.mkdir()
    (relaunched / "rank-0.log").write_text("resumed\n")
    after = check_logs(run, live=True, q="RUN")
    assert after.level == "warning" and not after.detail.startswith("job 7"), after


SCONTROL = """#!/bin/bash
case "$1" in
  show) printf 'n1\nn2\nn3\n' ;;  # show hostnames n[1-3]
  listpids) echo 'PID JOBID STEPID LOCALID GLOBALID'  # the step's tasks on this node
    if [ -e "$STUB/tasks" ]; then echo '4242 7 0 0 0'; fi ;;
esac
"""
SRUN = """#!/bin/bash
case " $* " in
  *" true "*)  # the batch shell's probe of one node: n3 lost power, never answers
    cp -- "$RUN/requeue/probing-7" "$STUB/seen-probing" 2>/dev/null
    case " $* " in *" --nodelist=n3 "*) exec sleep 30 ;; esac
    exit 0 ;;
esac
printf '%s\n' "$*" >> "$STUB/steps"
if [ ! -e "$STUB/tasks-ended" ]; then  # the first step: its task here fails, srun waits on n3
  : > "$STUB/tasks"; sleep 2.5; rm -f -- "$STUB/tasks"; : > "$STUB/tasks-ended"
  exec sleep 60 </dev/null >/dev/null 2>&1
fi
mkdir -p "$STUB/seen" && cp -r -- "$RUN/requeue" "$STUB/seen/"  # what status reads now
"""


def test_the_batch_shell_records_a_relaunch_that_status_reports_until_rank_0_resumes(tmp_path):
    """Issue 37 section 4, on the records the real batch shell writes (host_setup.sh in a
    rendered --nodes 2-3 script, srun and scontrol as stubs): n3 stops answering, the shell
    probes, writes relaunch-JOB (with the new world size) and starts the step on n1,n2.
    While the new ranks start, `status` says "relaunching on n1,n2 (world 2, from step 20)"
    with when the node was lost; once rank 0 records the loss, the relaunch line goes and
    the node-lost line keeps both times."""
    run, stub = tmp_path / "run", tmp_path / "stub"
    (run / "requeue").mkdir(parents=True)
    (stub / "bin").mkdir(parents=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stub / "bin" / name).write_text(text)
        (stub / "bin" / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_batch_script(JobSpec(job_name="enn-range", run_dir=str(run),
                                                  nodes="2-3", gpus_per_node=1)))
    env = {"PATH": f"{stub / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB": str(stub),
           "RUN": str(run), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]",
           "SLURM_JOB_NUM_NODES": "3", "SLURMD_NODENAME": "n1", "ENN_PROBE_S": "1"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    log = done.stderr  # sbatch's --output would take it to the batch log
    assert done.returncode == 0, log[-3000:]
    assert "enn: lost node(s) n3: relaunching on 2 nodes (n1,n2), relaunch 1" in log, log
    first, again = (stub / "steps").read_text().splitlines()
    assert "--nodes=3 --ntasks-per-node=1 --ntasks=3" in first, first
    assert "--nodes=2 --ntasks-per-node=1 --ntasks=2 --nodelist=n1,n2" in again, again
    assert float((stub / "seen-probing").read_text()) > 0  # status's "probing:" line meanwhile
    seen = stub / "seen"
    assert node_loss.probing_since(seen, "7") is None  # the probe had answered
    rec = node_loss.read_relaunch(seen, "7")
    assert (rec["lost"], rec["nodes"], rec["world"], rec["relaunch"]) == \
        (["n3"], ["n1", "n2"], 2, 1)
    assert rec["ended"] <= rec["detected"] <= rec["launched"]

    # status while the new ranks start: rank 0 has recorded nothing yet
    last_train = {"kind": "train", "step": 27, "time": rec["ended"] - 3.0}
    pending = with_last_step(node_loss.relaunch_pending(rec, [], "7"), last_train)
    st = {"node_losses": [], "relaunch": pending, "last_checkpoint": 20, "probing_since": None,
          "lock": {"slurm_job_id": "7"}, "slurm": {"job_id": "7", "state": "RUNNING"},
          "last_step": 27, "last_loss": 0.5, "last_eval_loss": None, "starting": False}
    (line,) = node_loss_lines(st)
    clock = lambda t, fmt="%H:%M:%S": time.strftime(fmt, time.localtime(t))  # noqa: E731
    assert line == (
        f"relaunching:     on n1,n2 (world 2, from step 20): job 7 lost n3 between "
        f"{clock(rec['ended'] - 3.0, '%Y-%m-%d %H:%M:%S')} (after step 27, its last logged) "
        f"and {clock(rec['ended'])} (the ranks on the first node had ended), detected "
        f"{clock(rec['detected'])}; relaunch 1 launched at {clock(rec['launched'])}, its "
        "ranks are starting"), line
    assert "relaunching on n1,n2" in progress_line({**st, "total_steps": 60, "last_checkpoint": 20})
    assert node_loss_lines({**st, "lock": None, "slurm": {"state": "FAILED"}}) == []  # over

    # rank 0 of the relaunch records the loss (trainer.py): the relaunch is no longer pending
    runner = RunDir(seen)
    log_file = MetricsLog(seen / "metrics.jsonl", enabled=True)
    node_loss.record_relaunch(runner, log_file, "7", relaunch=1, world_size=2, step=20)
    log_file.close()
    recorded = [with_last_step(json.loads(x), last_train)
                for x in (seen / "metrics.jsonl").read_text().splitlines()]
    assert node_loss.relaunch_pending(rec, recorded, "7") is None
    assert node_loss.relaunch_pending(rec, recorded, "8") is not None  # another job's record
    (line,) = node_loss_lines({**st, "node_losses": recorded, "relaunch": None})
    assert line.startswith("node lost:       n3 between ") and "(after step 27, its last " \
        f"logged) and {clock(rec['ended'])}" in line, line
    assert line.endswith("(job 7): went on with 2 node(s), world 2, from step 20"), line
