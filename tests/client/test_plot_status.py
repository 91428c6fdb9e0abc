"""`enn-submit status --follow` on a live run, and `enn-submit plot` marking a restart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from enn_cluster.storage.metrics import read_metrics, scan_metrics
from enn_cluster.client.plot import plot_series
from helpers import ROOT, cli, faults, small_config, write_config


def test_follow_a_live_run_then_plot_it_with_its_restart(tmp_path):
    cfg = small_config(tmp_path, "live", training={"max_steps": 60},
                       checkpoint={"every_steps": 10},
                       parallel={"nodes": 1, "procs_per_node": 2, "max_restarts": 1})
    env = dict(os.environ, PYTHONPATH=str(ROOT), **faults(fail_at_step=25))
    train = subprocess.Popen([sys.executable, "-m", "enn_cluster.client.cli", "train", "--config",
                              str(write_config(tmp_path / "c.yaml", **cfg))],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run = tmp_path / "runs" / "live"
    try:
        deadline = time.time() + 60  # the run directory appears once staging is done
        while not (run / "run.lock").exists() and train.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        follow = cli("status", run, "--follow", "--interval", "0.2", timeout=240)
        assert follow.returncode == 0, follow.stderr
        train.wait(timeout=240)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 0, train.stderr.read().decode()[-2000:]
    lines = follow.stdout.strip().splitlines()
    assert len(lines) >= 2, lines  # it followed the run, not just one snapshot
    assert any("running" in line and "not running" not in line for line in lines)
    assert lines[-1].startswith("step 60/60 (100%)") and lines[-1].endswith("not running")
    assert "ckpt step-60" in lines[-1]

    series = plot_series(read_metrics(run / "metrics.jsonl"))
    assert [r["step"] for r in series["restarts"]] == [20]  # crash at 25, resumed at 20
    assert series["loss"][0] == list(range(1, 61))  # redone steps counted once
    png = cli("plot", run, "--out", tmp_path / "m.png")
    assert png.returncode == 0, png.stderr
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_and_status_refuse_what_is_not_a_run(tmp_path):
    for args in (("plot", tmp_path), ("status", tmp_path, "--follow")):
        done = cli(*args)
        assert done.returncode == 2 and "RUN_DIR" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_wait_describes_state_and_reason_and_knows_jobs_that_never_start():
    from enn_cluster.cluster.slurm import describe, never_starts

    assert describe({"state": "PENDING", "reason": "Priority"}) == "PENDING (Reason=Priority)"
    assert describe({"state": "RUNNING", "reason": "None"}) == "RUNNING"
    assert never_starts({"state": "PENDING", "reason": "PartitionTimeLimit"})
    assert not never_starts({"state": "PENDING", "reason": "Resources"})
    assert not never_starts({"state": "RUNNING", "reason": "PartitionTimeLimit"})


def test_status_knows_slurm_jobs_that_only_left_worker_logs():
    """Issue 15 item 8: a hand-submitted job that ended before its rank 0 took the run lock
    (and so recorded itself in jobs.jsonl) is known only by its log folders."""
    from enn_cluster.client.status import with_unrecorded_slurm_jobs

    from enn_cluster.storage.job_record import JobRecord

    recorded = [JobRecord(kind="slurm", job_id="5", time=10.0)]
    dirs = [("slurm-5-r0", 11.0), ("slurm-9-r0", 20.0), ("slurm-9-r1", 30.0), ("local-r0", 40.0),
            ("slurm-7-r0", 5.0)]
    jobs = with_unrecorded_slurm_jobs(recorded, dirs)
    assert [(j.job_id, j.time) for j in jobs] == [("7", 5.0), ("5", 10.0), ("9", 30.0)]
    assert with_unrecorded_slurm_jobs(recorded, [("slurm-5-r1", 50.0)]) == recorded


def test_a_metrics_file_read_while_it_grows_never_looks_damaged(tmp_path):
    """status --follow reads while rank 0 appends: a line still being written is neither a
    record nor damage; a complete line that holds no record is damage."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    line = '{"kind": "train", "step": 1, "loss": 0.5}\n'
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "with open(sys.argv[1], 'a') as fh:\n"
        "    for n in range(40):\n"
        "        for ch in sys.argv[2]:\n"
        "            fh.write(ch); fh.flush(); time.sleep(0.0005)\n"), str(path), line])
    scans = []
    while writer.poll() is None:
        scans.append(scan_metrics(path))
    assert writer.wait() == 0
    assert len(scans) > 10
    assert all(unreadable == 0 for _, unreadable in scans)
    assert [len(records) for records, _ in scans] == sorted(len(r) for r, _ in scans)
    assert scan_metrics(path) == ([json.loads(line)] * 40, 0)
    path.write_text(line + '{"kind": "train", "step": "x"}\n{"kind": "tr')
    assert scan_metrics(path) == ([json.loads(line)], 1)


def test_status_escapes_terminal_controls_from_run_files(tmp_path):
    """metrics.jsonl is writable by the job (and often a group): a string in it holding a
    title change, a screen clear or a line separator is printed escaped, as one_line does."""
    run = tmp_path / "run"
    run.mkdir()
    write_config(run / "config.yaml", **small_config(tmp_path, "run"))
    evil = "\x1b]0;owned\x07\x1b[2J\u2028\x9b1m"
    (run / "metrics.jsonl").write_text(
        json.dumps({"kind": "start", "total_steps": 9}) + "\n"
        + json.dumps({"kind": "train", "step": 3, "loss": evil, "samples_per_s": 1.0}) + "\n"
        + json.dumps({"kind": "eval", "step": 3, "eval_loss": evil}) + "\n")
    for args in ([], ["--follow", "--interval", "0.1"]):
        done = cli("status", run, *args)
        assert done.returncode == 0, done.stderr
        assert not any(c in done.stdout for c in "\x1b\x07\u2028\x9b"), repr(done.stdout)
        assert "\\x1b]0;owned\\x07" in done.stdout


def test_a_nonfinite_dump_of_the_wrong_shape_is_reported_not_a_crash(tmp_path):
    """A run directory is untrusted: a dump that is valid JSON but not the record the trainer
    writes (a list, rows that are a number, shards that are a list) still gives one line."""
    from enn_cluster.client.status import nonfinite_dumps
    from enn_cluster.client.status_text import nonfinite_line

    folder = tmp_path / "nonfinite"
    folder.mkdir()
    (folder / "step-3.json").write_text('{"rows": 5, "nonfinite_grad_shards": [1], "loss": 1}')
    line = nonfinite_line(nonfinite_dumps(folder))
    assert "newest nonfinite/step-3.json: rows []" in line and "grads: none" in line, line
    (folder / "step-4.json").write_text(json.dumps({"rows": [7], "nonfinite_grad_shards":
                                                    {"head.bias": 1, "layers.0.weight": 2}}))
    line = nonfinite_line(nonfinite_dumps(folder))
    assert "rows [7]; non-finite grads: head.bias (1 shard), layers.0.weight (2 shards)" in line
    (folder / "step-5.json").write_text("[1, 2]")
    line = nonfinite_line(nonfinite_dumps(folder))
    assert "2 dump(s)" not in line and "3 dump(s); newest nonfinite/step-5.json: rows []" in line
    assert nonfinite_dumps(folder)["record"] == {"unreadable": "a JSON list, not an object"}


def test_a_torchrun_membership_change_shows_as_world_sizes(tmp_path):
    """Issue 37: torchrun's agents restarting the workers on fewer nodes leave one record per
    launch (each new group's rank 0 records itself, as worker_lock does); status shows the
    world size changing, and a run launched at one size shows no such line."""
    from enn_cluster.storage.job_record import JobRecord
    from enn_cluster.storage.rundir import RunDir

    cfg = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "tr"))
    assert cli("prepare", "--config", cfg).returncode == 0
    run = RunDir(tmp_path / "runs" / "tr")
    run.record_job(JobRecord(kind="torchrun", task="train", pid=11, world_size=4, nodes=2))
    done = cli("status", run.path)
    assert done.returncode == 0 and "world size:" not in done.stdout, done.stdout
    run.record_job(JobRecord(kind="torchrun", task="train", pid=12, world_size=4, nodes=2))
    run.record_job(JobRecord(kind="torchrun", task="train", pid=13, world_size=2, nodes=1))
    done = cli("status", run.path)
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("world size:")]
    assert line.startswith("world size:      4 (torchrun ") and " -> 2 (torchrun " in line, line
    assert line.count("->") == 1  # a relaunch at the same size is no change
