"""Where a rank runs: CPUs per task, binding plans and device choice, as pure functions
checked against tables. Sources for the Slurm behaviour they mirror:
- srun(1) --cpus-per-task, SRUN_CPUS_PER_TASK (Slurm 22.05 release notes: srun no longer
  reads SLURM_CPUS_PER_TASK from sbatch), https://slurm.schedmd.com/srun.html
- srun --gpu-bind=closest|single:N and --gpus-per-task set CUDA_VISIBLE_DEVICES per task
  (so a task sees 1 or the GPUs of its NUMA domain), https://slurm.schedmd.com/srun.html
- Linux cpulist format: Documentation/admin-guide/cputopology.rst"""
from __future__ import annotations

import os

import pytest

from enn_cluster.worker import placement


@pytest.mark.parametrize("text,cpus", [
    ("0-3", [0, 1, 2, 3]), ("0-1,8,10-11\n", [0, 1, 8, 10, 11]), ("5", [5]), ("", [])])
def test_cpulist_round_trip(text, cpus):
    assert placement.parse_cpulist(text) == cpus
    assert placement.parse_cpulist(placement.format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("environ,affinity,online,local_world,expected", [
    ({"SLURM_CPUS_PER_TASK": "12"}, 12, 96, 8, 12),  # srun --cpus-per-task=12
    ({"SLURM_CPUS_PER_TASK": "12"}, 4, 96, 8, 4),  # a cgroup narrower than the request
    ({}, 12, 96, 8, 12),  # bound by --cpu-bind / a launcher: its affinity
    ({}, 96, 96, 8, 12),  # nothing bound: the node's CPUs shared by its 8 tasks
    ({}, 2, 2, 4, 1),  # more tasks than CPUs: at least one
    ({"SLURM_CPUS_PER_TASK": "x"}, 96, 96, 8, 12),
])
def test_task_cpus(environ, affinity, online, local_world, expected):
    assert placement.task_cpus(environ, affinity, online, local_world) == expected


NUMA2 = {0: list(range(0, 48)), 1: list(range(48, 96))}


@pytest.mark.parametrize("local_rank,rank_numa,numa,allowed,expected", [
    # 8 H100 on 2 sockets (GPUs 0-3 on node 0, 4-7 on node 1): 12 cores each, local to the GPU
    (0, [0, 0, 0, 0, 1, 1, 1, 1], NUMA2, range(96), list(range(0, 12))),
    (5, [0, 0, 0, 0, 1, 1, 1, 1], NUMA2, range(96), list(range(60, 72))),
    # unknown NUMA (-1): split all allowed CPUs
    (1, [-1, -1], NUMA2, range(8), [4, 5, 6, 7]),
    # more ranks than CPUs on the node: never empty
    (3, [0, 0, 0, 0], {0: [0, 1]}, [0, 1], [1]),
    # the node's CPUs outside the allowed set are not handed out
    (0, [1], NUMA2, range(0, 50), [48, 49]),
])
def test_cpu_plan(local_rank, rank_numa, numa, allowed, expected):
    assert placement.cpu_plan(local_rank, rank_numa, numa, list(allowed)) == expected


def test_numa_and_pci_from_a_fake_sysfs(tmp_path):
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / "devices/system/node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "devices/system/node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    dev = tmp_path / "bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    assert placement.numa_cpus(str(tmp_path)) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert placement.pci_numa_node("0000:1B:00.0", str(tmp_path)) == 1
    assert placement.pci_numa_node("0000:99:00.0", str(tmp_path)) == -1
    assert placement.numa_cpus(str(tmp_path / "none")) == {}


def test_describe_is_one_line():
    line = placement.describe(9, 1, [12, 13, 14, 15], 4, "slurm", "cuda:0 (GPU-ab12)", 0)
    assert line == ("placement: rank 9 local 1 gpu cuda:0 (GPU-ab12) numa 0 cpus 12-15 (4) "
                    "threads 4 bound-by slurm")


@pytest.mark.parametrize("local_rank,local_world,count,expected", [
    (5, 8, 8, 5),  # every node GPU visible: LOCAL_RANK
    (5, 8, 1, 0),  # --gpus-per-task=1 or --gpu-bind=single:1: the one it sees
    (5, 8, 4, 1),  # --gpu-bind=closest on 2 sockets: 4 of 8 visible, rank 5 -> its 2nd
    (0, 1, 8, 0),  # one task driving one of many visible GPUs
])
def test_choose_device(local_rank, local_world, count, expected):
    assert placement.choose_device(local_rank, local_world, count) == expected


def test_choose_device_needs_a_device():
    with pytest.raises(ValueError, match="no CUDA device"):
        placement.choose_device(0, 8, 0)


@pytest.mark.parametrize("claims,expected", [
    ([("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a")], {}),  # same id on two hosts: fine
    ([("n1", "GPU-a"), ("n1", "GPU-a"), ("n2", "GPU-c"), ("n2", "GPU-c")],
     {"n1:GPU-a": [0, 1], "n2:GPU-c": [2, 3]}),  # cuda:0 assumed under --gpus-per-task=1
])
def test_device_clashes(claims, expected):
    assert placement.device_clashes(claims) == expected


@pytest.mark.parametrize("environ,count,expected", [
    ({}, 2, ["0", "1"]), ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4, ["4", "5", "6", "7"]),
    ({"CUDA_VISIBLE_DEVICES": "GPU-ab"}, 1, ["GPU-ab"]), ({"CUDA_VISIBLE_DEVICES": ""}, 0, []),
])
def test_visible_devices(environ, count, expected):
    assert placement.visible_devices(environ, count) == expected


NUMA_SPLIT = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


@pytest.mark.parametrize("gpu_node,cpus,cpu_nodes", [
    (1, [4, 5], None),  # bound near the GPU
    (1, [0, 1], "0"),  # --cpu-bind put the rank on the other socket
    (0, [2, 3, 4], "0,1"),  # straddles both: some copies cross the link
    (-1, [0, 1], None), (None, [0, 1], None),  # GPU's node unknown, or no GPU
    (0, [9], None),  # CPUs the layout does not list: nothing to compare
])
def test_numa_mismatch(gpu_node, cpus, cpu_nodes):
    warning = placement.numa_mismatch(5, "cuda:1", gpu_node, cpus, NUMA_SPLIT)
    if cpu_nodes is None:
        assert warning is None
    else:
        assert f"rank 5 drives cuda:1 on NUMA node {gpu_node}" in warning
        assert f"CPUs {placement.format_cpulist(cpus)} on NUMA node(s) {cpu_nodes};" in warning
    assert placement.numa_mismatch(5, "cuda:1", 0, [0], {}) is None  # no layout at all


def test_online_cpus_from_a_fake_sysfs(tmp_path):
    (tmp_path / "devices/system/cpu").mkdir(parents=True)
    (tmp_path / "devices/system/cpu/online").write_text("0-5,8\n")
    assert placement.online_cpus(str(tmp_path)) == 7
    assert placement.online_cpus(str(tmp_path / "none")) == (os.cpu_count() or 1)
