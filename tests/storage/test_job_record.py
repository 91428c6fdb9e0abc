"""jobs.jsonl holds one typed record (storage/job_record.py, issue 41 section 2); the four
shapes older versions wrote still read, so a run made by any version keeps its history."""
from __future__ import annotations

import json

from enn_cluster.client.status import newest_slurm_job, run_status
from enn_cluster.storage.attempts import launch_times
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.rundir import RunDir

# one line of each shape, as the versions before JobRecord wrote them (json.dumps, sorted keys)
OLD_LINES = [
    {"kind": "local", "name": None, "nodes": 1, "pid": 4242, "procs_per_node": 2,
     "task": "train", "time": 100.0},
    {"image": "/img/e.sqsh", "job_id": "77", "job_name": "enn-r", "kind": "slurm",
     "name": None, "nodes": "2-3", "signal_grace_s": 120, "task": "train",
     "tasks_per_node": 4, "time": 200.0},
    {"job_id": None, "kind": "torchrun", "nodes": 1, "pid": 99, "task": "train",
     "time": 300.0, "world_size": 2},
    {"detected": 401.5, "ended": 401.0, "job_id": "77", "kind": "relaunch", "launched": 402.0,
     "lost": ["n3"], "nodes": ["n1", "n2"], "relaunch": 1, "step": 20, "time": 402.5,
     "world_size": 8},
]


def test_records_in_every_older_shape_still_read(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "jobs.jsonl").write_text(
        "".join(json.dumps(line, sort_keys=True) + "\n" for line in OLD_LINES))
    local, slurm, torchrun, relaunch = run.jobs()
    assert (local.kind, local.nodes, local.tasks_per_node, local.pid) == ("local", 1, 2, 4242)
    assert (slurm.job_id, slurm.nodes, slurm.tasks_per_node, slurm.signal_grace_s,
            slurm.image) == ("77", "2-3", 4, 120, "/img/e.sqsh")
    assert (torchrun.kind, torchrun.world_size, torchrun.job_id) == ("torchrun", 2, None)
    assert (relaunch.hosts, relaunch.lost, relaunch.relaunch, relaunch.step,
            relaunch.world_size) == (("n1", "n2"), ("n3",), 1, 20, 8)
    assert newest_slurm_job(run.jobs()) == "77"
    assert launch_times(run.jobs()) == {"local-1": 100.0, "slurm-77": 200.0}
    shown = run_status(run.path)["jobs"]  # status's records: the one schema, as JSON
    assert shown[0] == {"kind": "local", "nodes": 1, "pid": 4242, "tasks_per_node": 2,
                        "task": "train", "time": 100.0}
    assert shown[1] == {k: v for k, v in OLD_LINES[1].items() if v is not None}
    assert [job["kind"] for job in shown] == ["local", "slurm", "torchrun", "relaunch"]


def test_a_record_reads_back_as_written_and_keeps_keys_it_does_not_know(tmp_path):
    run = RunDir(tmp_path)
    written = JobRecord(kind="slurm", job_id="8", nodes="2-4", tasks_per_node=8, task="train",
                        signal_grace_s=90)
    run.record_job(written)
    run.record_job(JobRecord(kind="relaunch", job_id="8", relaunch=1, hosts=("a", "b"),
                             lost=("c",), step=5, time=7.0))
    with open(tmp_path / "jobs.jsonl", "a") as fh:  # a later version's key, one bare line
        fh.write(json.dumps({"kind": "slurm", "job_id": 9, "time": 9.0, "gpu_type": "h100"})
                 + "\n")
    first, second, third = run.jobs()
    assert isinstance(first.time, float) and first == JobRecord(**{**vars(written),
                                                                    "time": first.time})
    assert second.as_json() == {"kind": "relaunch", "job_id": "8", "relaunch": 1,
                                "hosts": ["a", "b"], "lost": ["c"], "step": 5, "time": 7.0}
    assert (third.job_id, third.extra) == ("9", {"gpu_type": "h100"})
    assert third.as_json()["gpu_type"] == "h100"
