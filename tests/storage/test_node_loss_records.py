"""Issue 29's pieces that decide, apart from the real-Slurm tests in
test_node_loss_continue.py: the batch shell's relaunch record read as untrusted, its record
in metrics.jsonl and jobs.jsonl, `status`'s lines, the relaunch's log folder and its place
in the attempts' order, and the rendezvous keys that keep a failed step out of the new one."""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import replace
from datetime import timedelta

from enn_cluster.client.status import node_loss_lines
from enn_cluster.storage import node_loss
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
        "detected": 1795634012.25, "launched": 1795634012.3, "relaunch": 1}
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
    assert job["kind"] == "relaunch" and {k: job[k] for k in fields} == fields


def test_status_names_the_lost_node_and_a_probe_under_way():
    st = {"node_losses": [{"lost": ["n3"], "nodes": ["n1", "n2"], "detected": 0.0,
                           "job_id": "7", "world_size": 4, "step": 20}],
          "probing_since": 5.0, "lock": {"pid": 1}, "slurm": None}
    lines = node_loss_lines(st)
    assert lines[0].startswith("node lost:       n3 at ")
    assert lines[0].endswith("(job 7): went on with 2 node(s), world 4, from step 20")
    assert lines[1].startswith("probing:         since ") and "still answer" in lines[1]
    assert node_loss_lines({**st, "lock": None}) == lines[:1]  # over: no probe to report


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
    """worker/entry.record_refusal writes requeue/refused-JOB; status and doctor read its
    first line as untrusted text: no terminal escape, no FIFO opened, nothing oversized."""
    from enn_cluster.worker.entry import record_refusal

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
    from enn_cluster.client.status import format_status

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
    run.record_job(kind="slurm", job_id="7")
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
