"""stop_request: a stop asked for through the run directory (issue 15, item 1)."""
from __future__ import annotations

from enn_cluster.worker import stop_request
from enn_cluster.worker.stop_request import StopPoller, record, requested, stop_file


def test_record_and_requested_are_per_job(tmp_path):
    assert not requested(tmp_path, "7") and not requested(tmp_path, None)
    path = record(tmp_path, "7")
    assert path == stop_file(tmp_path, "7") == tmp_path / "requeue" / "stop-7"
    assert requested(tmp_path, "7") and not requested(tmp_path, "8")


def test_only_rank_0_of_a_slurm_job_polls_and_at_most_once_per_interval(tmp_path):
    now = [100.0]
    poller = StopPoller(tmp_path, "7", rank=0, every_s=1.0, clock=lambda: now[0])
    assert poller.poll() is False
    record(tmp_path, "7")
    now[0] += 0.5
    assert poller.poll() is False  # looked 0.5 s ago: no stat now
    now[0] += 0.6
    assert poller.poll() is True
    assert StopPoller(tmp_path, "7", rank=1, clock=lambda: now[0]).poll() is False
    assert StopPoller(tmp_path, None, rank=0, clock=lambda: now[0]).poll() is False



def test_no_polling_outside_slurm(tmp_path):
    assert stop_request.POLL_EVERY_S <= 1.0
    assert StopPoller(tmp_path, "", rank=0).active is False
