"""A launcher that is not ours is a first-class client: `enn-submit prepare` makes the run,
torchrun starts the very same worker entry, which takes the run lock, records itself in
jobs.jsonl and exits with the same codes as under every other launcher."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from helpers import ROOT, cli, metrics, small_config, write_config


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _prepare(tmp_path, **over):
    cfg = write_config(tmp_path / "run.yaml", **small_config(
        tmp_path, "ext", training={"epochs": 1}, parallel={"nodes": 1, "procs_per_node": 2},
        **over))
    res = cli("prepare", "--config", cfg)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / "ext"
    assert res.stdout.strip() == str(run)
    assert "torchrun" in res.stderr and not list((run / "checkpoints").iterdir())
    return run


def test_torchrun_trains_a_prepared_run_and_records_itself(tmp_path):
    run = _prepare(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "enn_cluster.worker", str(run), "--task", "train"],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert metrics(run, "train")[-1]["step"] == 448 // 16
    jobs = [json.loads(line) for line in (run / "jobs.jsonl").read_text().splitlines()]
    assert [(j["kind"], j["world_size"]) for j in jobs] == [("torchrun", 2)]
    assert not (run / "run.lock").exists()  # released at the end
    assert cli("verify", run).returncode == 0


def test_a_worker_refuses_a_run_held_by_a_live_process_with_exit_2(tmp_path):
    """The lock names a live process (this test) on this host: the worker entry refuses
    with one line and exit 2 (bad input, never retried), directly and through Slurm's
    entry function alike, and leaves the lock as it was."""
    run = _prepare(tmp_path)
    lock = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": 0})
    (run / "run.lock").write_text(lock)
    direct = subprocess.run([sys.executable, "-m", "enn_cluster.worker", str(run)],
                            capture_output=True, text=True, timeout=120, env=_env())
    slurm_entry = subprocess.run(
        [sys.executable, "-c", "import sys; from enn_cluster.cluster.submit_slurm import worker_entry; "
         "worker_entry(sys.argv[1], 'train', None, None)", str(run)],
        capture_output=True, text=True, timeout=120, env=_env())
    for res in (direct, slurm_entry):
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"in use by pid {os.getpid()}" in res.stderr and "Traceback" not in res.stderr
    assert (run / "run.lock").read_text() == lock
    assert not (run / "jobs.jsonl").exists()


def test_a_taken_rendezvous_port_is_one_line_and_a_retryable_failure(tmp_path):
    """Something else listens on MASTER_PORT: rank 0 says so in one line and exits 1 (a
    failure the host side retries, probing for a free port), not 2 and not a traceback."""
    run = _prepare(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        res = subprocess.run([sys.executable, "-m", "enn_cluster.worker", str(run)],
                             capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert f"MASTER_PORT={port} is taken on {socket.gethostname()}" in last, res.stderr
    assert "Traceback" not in res.stderr
    assert not (run / "jobs.jsonl").exists() and not (run / "run.lock").exists()


def test_the_documented_elastic_torchrun_trains_a_run_prepared_for_a_node_range(tmp_path):
    """docs/quickstart.md's torchrun block, run as written from a checkout-like directory
    (its .venv and examples/ linked in), on a free port: the elastic agent starts at the
    range's minimum, and the run trains to its end under it; prepare's own hint for a range
    names the same rendezvous flags."""
    import re

    text = (ROOT / "docs" / "quickstart.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "torchrun" in b]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in (".venv", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    script = block.replace("127.0.0.1:29400", f"127.0.0.1:{port}")
    done = subprocess.run(["bash", "-euc", script], capture_output=True, text=True,
                          timeout=600, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchrun --nnodes 1:2 --rdzv-backend c10d" in done.stderr  # prepare's hint
    run = tmp_path / "demo-runs" / "elastic"
    jobs = [json.loads(line) for line in (run / "jobs.jsonl").read_text().splitlines()]
    assert [(j["kind"], j["world_size"]) for j in jobs] == [("torchrun", 2)]
    last = metrics(run, "train")[-1]["step"]
    assert f"training done at step {last}" in done.stderr  # to the end, not a stop
    assert (run / "checkpoints" / f"step-{last}" / "commit.json").is_file()
    assert cli("verify", run).returncode == 0
