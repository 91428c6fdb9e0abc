"""`enn-submit logs RUN` prints a rank's log of the run's newest attempt."""
from __future__ import annotations

import os

from helpers import cli, train_tiny


def test_logs_shows_the_newest_attempt_even_when_an_older_folder_is_touched_later(tmp_path):
    """Two launches (train, then resume) make two attempt folders. The newest is the
    resume's, whatever the folders' times say: a copy of the run (cp -r) or a late write
    into an older folder leaves them out of order, and on a filesystem with whole-second
    times a quick restart ties with the attempt before it."""
    run = train_tiny(tmp_path, "two")
    res = cli("resume", run, "--set", "training.max_steps=4", "--nodes", "1",
              "--procs-per-node", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    attempts = sorted(d.name for d in (run / "logs").iterdir() if d.is_dir())
    assert attempts == ["local-1-r0", "local-2-r0"], attempts
    older, newer = run / "logs" / "local-1-r0", run / "logs" / "local-2-r0"
    assert "resumed from step-2" not in (older / "rank-0.log").read_text()

    def shown() -> str:
        out = cli("logs", run, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert shown() == (newer / "rank-0.log").read_text()
    for later in (newer.stat().st_mtime, newer.stat().st_mtime + 60):  # a tie, then later
        os.utime(older, (later, later))
        text = shown()
        assert "resumed from step-2" in text and text.count("worker rank 0/") == 1, text[-2000:]


def test_the_newest_attempt_follows_jobs_jsonl_then_the_restart_count(tmp_path):
    """A Slurm job requeued after a local launch: its second attempt is the newest even
    with the oldest folder time; a folder no launch names falls back to its own time."""
    from enn_cluster.client.cli_ops import _latest_log_dir
    from enn_cluster.storage.job_record import JobRecord
    from enn_cluster.storage.rundir import RunDir

    run = RunDir(tmp_path)
    run.record_job(JobRecord(kind="local", task="train", time=100.0))
    run.record_job(JobRecord(kind="slurm", job_id="77", task="train", time=200.0))
    run.record_job(JobRecord(kind="slurm", job_id="77", task="train", time=300.0))  # requeue
    for name, mtime in (("local-1-r0", 150.0), ("slurm-77-r0", 250.0), ("slurm-77-r1", 50.0)):
        (run.logs / name).mkdir(parents=True)
        os.utime(run.logs / name, (mtime, mtime))
    assert _latest_log_dir(run).name == "slurm-77-r1"
    (run.logs / "torchrun-r0").mkdir()  # made now, by a launcher that records nothing
    assert _latest_log_dir(run).name == "torchrun-r0"
