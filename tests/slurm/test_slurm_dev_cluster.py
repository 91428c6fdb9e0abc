"""The local dev cluster (slurm/dev/cluster.sh) behaves like a real multi-node Slurm cluster.

Real daemons, real jobs: these need root and the Slurm packages (see tests/slurm_fixture.py).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from slurm_fixture import CLUSTER_SH

pytestmark = pytest.mark.slurm

# Rank 0 (on n1) listens; rank 1 (on n2) resolves n1 by name and connects, retrying until the
# listener is up. Every wait is bounded.
TCP_PROGRAM = textwrap.dedent("""
    import os, socket, time
    rank, host = int(os.environ["SLURM_PROCID"]), socket.gethostname()
    if rank == 0:
        srv = socket.create_server(("0.0.0.0", 29517), reuse_port=True)
        srv.settimeout(20)
        conn, (peer, _) = srv.accept()
        conn.settimeout(10)
        print(f"{host} got {conn.recv(64).decode()!r} from {peer}", flush=True)
        conn.sendall(host.encode())
    else:
        addr = socket.gethostbyname("n1")
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = socket.create_connection((addr, 29517), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        conn.settimeout(10)
        conn.sendall(f"hello from {host}".encode())
        print(f"{host} resolved n1={addr} reply={conn.recv(64).decode()}", flush=True)
""")


def test_srun_two_nodes_two_tasks_each(slurm_cluster):
    proc = slurm_cluster.run(["srun", "-N2", "--ntasks-per-node=2", "hostname"], timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["n1", "n1", "n2", "n2"]


def test_gpus_per_node_sets_cuda_visible_devices(slurm_cluster):
    proc = slurm_cluster.run(
        ["srun", "-N1", "--gpus-per-node=2", "bash", "-c",
         'echo "$CUDA_VISIBLE_DEVICES $SLURM_GPUS_ON_NODE"'], timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0,1", "2"]


def test_too_many_gpus_is_refused(slurm_cluster):
    proc = slurm_cluster.run(["srun", "-N1", "--gpus-per-node=9", "true"], timeout=30)
    assert proc.returncode != 0


def test_sbatch_wait_job_writes_file(slurm_cluster, tmp_path):
    out = tmp_path / "result.txt"
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=1 --ntasks=1 --time=2
        #SBATCH --output={tmp_path}/slurm-%j.out
        set -euo pipefail
        {sys.executable} -c 'import socket; print("written on", socket.gethostname())' > {out}
        """))
    proc = slurm_cluster.run(["sbatch", "--wait", "--parsable", str(script)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    assert out.read_text().split()[:2] == ["written", "on"]
    # Finished jobs stay visible to the controller (MinJobAge).
    assert slurm_cluster.wait_job(job_id, "COMPLETED", timeout=10) == "COMPLETED"


def test_step_on_n2_reaches_listener_on_n1(slurm_cluster):
    proc = slurm_cluster.run(
        ["srun", "-N2", "--nodelist=n1,n2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
         sys.executable, "-c", TCP_PROGRAM], timeout=45)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prefix = _network(slurm_cluster.state_dir)["prefix"]
    lines = sorted(proc.stdout.splitlines())
    assert lines == [f"n1 got 'hello from n2' from {prefix}.12",
                     f"n2 resolved n1={prefix}.11 reply=n1"]


def _network(state_dir):
    """The slot's names that cluster.sh recorded (bridge, prefix, ctld_port)."""
    text = Path(state_dir, "network").read_text()
    return dict(line.split("=", 1) for line in text.splitlines())


def _cluster_sh(*args):
    return subprocess.run(["bash", CLUSTER_SH, *args], capture_output=True, text=True,
                          timeout=120)


def _pids_from(state_dir):
    pid_files = [os.path.join(state_dir, "munge", "munged.pid")]
    run_dir = os.path.join(state_dir, "run")
    pid_files += [os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".pid")]
    return [int(Path(f).read_text()) for f in pid_files]


def _alive(pid):
    return os.path.exists(f"/proc/{pid}")


def test_a_second_cluster_runs_beside_the_first(slurm_cluster, tmp_path):
    """Two test runs on one machine (a CI check beside a developer's run) must not collide."""
    other = tempfile.mkdtemp(prefix="enn-slurm-other-", dir="/tmp")
    os.chmod(other, 0o755)
    try:
        proc = _cluster_sh("up", other, "1")
        assert proc.returncode == 0, proc.stderr
        mine, theirs = _network(slurm_cluster.state_dir), _network(other)
        assert mine["bridge"] != theirs["bridge"] and mine["prefix"] != theirs["prefix"]
        env = {**os.environ, "SLURM_CONF": os.path.join(other, "slurm.conf")}
        proc = subprocess.run(["srun", "-N1", "hostname"], capture_output=True, text=True,
                              timeout=30, env=env)
        assert proc.returncode == 0 and proc.stdout.split() == ["n1"], proc.stderr
    finally:
        down = _cluster_sh("down", other)
        shutil.rmtree(other, ignore_errors=True)
    assert down.returncode == 0, down.stderr
    # Taking the other one down left ours running.
    assert _cluster_sh("status", slurm_cluster.state_dir).returncode == 0
    proc = slurm_cluster.run(["srun", "-N2", "hostname"], timeout=30)
    assert proc.returncode == 0 and sorted(proc.stdout.split()) == ["n1", "n2"], proc.stderr


def test_a_powered_off_node_comes_back_free_of_the_job_it_lost(slurm_cluster):
    """`node-down` kills n2's slurmd and its tasks; the job that ran there is cancelled and
    stays COMPLETING, n2 not responding (the controller's kill did not reach it; it retries
    later and would wait SlurmdTimeout, 300 s, to declare n2 down). `up` declares n2 DOWN
    before its slurmd starts again, as Slurm would after that timeout, so the job ends and
    n2 is idle (ReturnToService=2) as soon as the slurmd answers: `up` succeeds with 15 s
    to get every node ready, where waiting for the controller's next kill took 35 s."""
    slurm_cluster.wait_idle()
    res = slurm_cluster.run(["sbatch", "--parsable", "-N2", "--output=/dev/null",
                             "--wrap", "srun sleep 600"])
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    slurm_cluster.wait_job(job, ("RUNNING",), timeout=60)
    try:
        down = _cluster_sh("node-down", slurm_cluster.state_dir, "n2")
        assert down.returncode == 0, down.stderr
        assert slurm_cluster.run(["scancel", job]).returncode == 0
        deadline = time.monotonic() + 90
        while _node_states(slurm_cluster)["n2"] != "comp*":  # the kill found no n2
            assert time.monotonic() < deadline, _node_states(slurm_cluster)
            time.sleep(0.5)
    finally:
        up = slurm_cluster.up(ready_s=15)
    assert up.returncode == 0, up.stderr
    state, text = slurm_cluster.job_state(job)
    assert state == "CANCELLED", text
    assert _node_states(slurm_cluster) == {"n1": "idle", "n2": "idle"}


def _node_states(cluster) -> dict:
    words = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
    return dict(zip(words[::2], words[1::2]))


# Last in this file: it restarts the session's cluster (same state dir, same slot).
def test_down_cleans_up_and_up_again_works(slurm_cluster):
    assert slurm_cluster.up().returncode == 0  # up again, with the same (Pyxis) settings
    assert _cluster_sh("status", slurm_cluster.state_dir).returncode == 0
    # A process that escaped its job (setsid) must not outlive the cluster.
    proc = slurm_cluster.run(["srun", "-w", "n1", "bash", "-c",
                              "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!"], timeout=30)
    assert proc.returncode == 0, proc.stderr
    stray = int(proc.stdout.strip())
    assert _alive(stray)
    daemons = _pids_from(slurm_cluster.state_dir)
    network = _network(slurm_cluster.state_dir)
    assert len(daemons) == 2 + len(slurm_cluster.nodes) and all(map(_alive, daemons))

    for _ in range(2):  # down is safe to repeat
        proc = slurm_cluster.down()
        assert proc.returncode == 0, proc.stderr
    assert not any(map(_alive, daemons + [stray]))
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    slot = Path(slurm_cluster.state_dir, "slot").read_text().strip()
    assert f"enn-s{slot}-n" not in netns
    assert not os.path.exists(f"/run/enn-slurm-dev/slot-{slot}")
    assert subprocess.run(["ip", "link", "show", network["bridge"]],
                          capture_output=True).returncode != 0
    assert _cluster_sh("status", slurm_cluster.state_dir).returncode != 0

    proc = slurm_cluster.up()
    assert proc.returncode == 0, proc.stderr
    proc = slurm_cluster.run(["srun", "-N2", "hostname"], timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["n1", "n2"]
