"""placement.place_task run for real, in a fresh process per case: it binds the process's
CPUs (os.sched_getaffinity read back in that process) near the rank's GPU when nothing
bound the task, leaves a launcher's binding alone (with a warning when it sits on another
NUMA node than the GPU) and returns the one line the worker logs. The node's layout comes
from a fake sysfs (two NUMA nodes, one CPU of this machine each, one GPU on each); the GPUs'
PCI addresses are passed in, since there is no GPU here. Threads that run before the
placement (a Python thread, the lanes' gloo and TCPStore threads) are bound too, read from
outside the process (/proc/PID/task/*/status)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from enn_cluster.worker.placement import parse_cpulist
from helpers import ROOT

CHILD = r"""
import json, logging, os, socket, sys, threading
import torch
from enn_cluster.worker.environment import WorkerEnv
from enn_cluster.worker.placement import place_task

sysfs, bind, local_rank, early, bus = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    sys.argv[4] == "early-threads", sys.argv[5:]
if bind:  # as srun --cpu-bind does, before the program starts
    os.sched_setaffinity(0, [int(c) for c in bind.split(",")])
if early:  # threads that exist before the placement: ours, and the lanes' native ones
    from enn_cluster.worker.lanes import open_lanes
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    open_lanes(WorkerEnv("local", 0, 0, 1, 1, 0, 1, "127.0.0.1", port), 60.0).barrier()
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append([r.levelname, r.getMessage()])
logging.getLogger().addHandler(handler)
logging.getLogger().setLevel(logging.DEBUG)
env = WorkerEnv(launcher="slurm", rank=2 + local_rank, local_rank=local_rank, world_size=4,
                local_world_size=2, node_rank=1, num_nodes=2, master_addr="n1",
                master_port=29500)
placed = place_task(env, torch.device("cuda", local_rank), sysfs_root=sysfs, bus_ids=bus)
print(json.dumps({"line": placed.line(), "report": placed.report(), "logged": records,
                  "threads": torch.get_num_threads(), "pid": os.getpid(),
                  "python_threads": threading.active_count(),
                  "affinity": sorted(os.sched_getaffinity(0))}), flush=True)
sys.stdin.read()  # the test reads every thread's mask, then lets the process end
os._exit(0)
"""
BUS = ["0000:1b:00.0", "0000:9c:00.0"]  # GPU 0 on NUMA node 0, GPU 1 on node 1


def _fake_sysfs(root, cpus):
    """Node 0 holds cpus[0], node 1 cpus[1]; the GPUs of BUS sit on nodes 0 and 1."""
    for node, cpu in enumerate(cpus[:2]):
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(f"{cpu}\n")
    (root / "devices/system/cpu").mkdir(parents=True)
    (root / "devices/system/cpu/online").write_text(",".join(map(str, cpus)) + "\n")
    for node, bus in enumerate(BUS):
        (root / "bus/pci/devices" / bus).mkdir(parents=True)
        (root / "bus/pci/devices" / bus / "numa_node").write_text(f"{node}\n")
    return root


def _place(sysfs, bind, local_rank, early_threads=False, masks=None) -> dict:
    """place_task in a fresh process; `masks` (a dict) gets every thread's CPUs, read
    from /proc while the process still runs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(sysfs),
                              ",".join(map(str, bind)), str(local_rank),
                              "early-threads" if early_threads else "-", *BUS],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(env, PYTHONPATH=str(ROOT)))
    try:
        line = ""  # the child's JSON line; torch 2.9's gloo prints its own lines before it
        while line := child.stdout.readline():
            if line.startswith("{"):
                break
        got = json.loads(line or "{}")
        if got and masks is not None:
            masks.update(_thread_masks(got["pid"]))
        _, err = child.communicate("", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and got, err
    return got


def _thread_masks(pid: int) -> dict[int, list[int]]:
    """Every thread of `pid` -> the CPUs it may run on (Cpus_allowed_list)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = parse_cpulist(line.split(":", 1)[1])
    return out


@pytest.fixture
def cpus():
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs to tell a placement from none")
    return mine


def test_unbound_task_is_bound_near_its_gpu(tmp_path, cpus):
    got = _place(_fake_sysfs(tmp_path, cpus), [], local_rank=1)
    assert got["affinity"] == [cpus[1]]  # GPU 1 is on node 1
    assert got["threads"] == 1
    assert got["logged"] == []  # the line below is the rank's only line, logged by the worker
    assert got["line"] == (f"placement: rank 3 local 1 gpu cuda:1 of [0,1] ({BUS[1]}) numa 1 "
                           f"cpus {cpus[1]} (1) threads 1 bound-by plan")


def test_launcher_binding_near_the_gpu_is_kept_quietly(tmp_path, cpus):
    got = _place(_fake_sysfs(tmp_path, cpus), [cpus[0]], local_rank=0)
    assert got["affinity"] == [cpus[0]] and got["logged"] == []
    assert got["line"].endswith(f"numa 0 cpus {cpus[0]} (1) threads 1 bound-by launcher")


def test_launcher_binding_on_another_numa_node_is_kept_with_a_warning(tmp_path, cpus):
    got = _place(_fake_sysfs(tmp_path, cpus), [cpus[0]], local_rank=1)
    assert got["affinity"] == [cpus[0]]
    assert got["line"].endswith(f"numa 1 cpus {cpus[0]} (1) threads 1 bound-by launcher")
    (level, message), = got["logged"]
    assert level == "WARNING"
    assert "cuda:1 on NUMA node 1" in message and "on NUMA node(s) 0" in message


def test_threads_started_before_the_placement_are_bound_too(tmp_path, cpus):
    masks: dict[int, list[int]] = {}
    got = _place(_fake_sysfs(tmp_path, cpus), [], local_rank=1, early_threads=True,
                 masks=masks)
    assert got["line"].endswith("bound-by plan") and got["affinity"] == [cpus[1]]
    # the main thread, our Python thread, and native threads Python does not know of
    # (TCPStore's server, gloo's): sched_setaffinity(0) alone binds only the first
    assert got["python_threads"] == 2 and len(masks) > 2, masks
    assert masks == {tid: [cpus[1]] for tid in masks}


def test_placement_report_says_what_the_line_says(tmp_path, cpus):
    got = _place(_fake_sysfs(tmp_path, cpus), [], local_rank=0)
    assert got["report"] == {"cpus": str(cpus[0]), "cpu_count": 1, "threads": 1,
                             "bound_by": "plan", "numa": 0,
                             "device": f"cuda:0 of [0,1] ({BUS[0]})"}


def test_launcher_binding_off_the_gpus_node_is_rebound_within_the_jobs_cpus(tmp_path, cpus):
    """Issue 25 item 4: the job's cgroup allows both CPUs (a fake cpuset at this process's
    own cgroup path), the launcher bound local rank 1 to node 0's CPU while its GPU is on
    node 1: the worker rebinds it (every thread) to node 1's CPU and says so."""
    sysfs = _fake_sysfs(tmp_path, cpus)
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            cpuset = sysfs / "fs/cgroup" / path.lstrip("/") / "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):
            cpuset = sysfs / "fs/cgroup/cpuset" / path.lstrip("/") / "cpuset.effective_cpus"
        else:
            continue
        cpuset.parent.mkdir(parents=True, exist_ok=True)
        cpuset.write_text(f"{cpus[0]},{cpus[1]}\n")
    masks: dict = {}
    got = _place(sysfs, [cpus[0]], local_rank=1, early_threads=True, masks=masks)
    assert got["affinity"] == [cpus[1]]
    assert set(map(tuple, masks.values())) == {(cpus[1],)}, masks
    assert got["line"].endswith(f"numa 1 cpus {cpus[1]} (1) threads 1 bound-by plan")
    (level, message), = [r for r in got["logged"] if "placement" in r[1]]
    assert level == "INFO" and message.startswith(
        f"placement: rank 3 rebound from the launcher's CPUs {cpus[0]} to {cpus[1]}, on its "
        "GPU's NUMA node 1")
