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


def test_a_cuda_device_s_pci_address_is_the_one_sysfs_names(tmp_path):
    """cuda_bus_ids formats torch's device properties (a GPU build's; a fake with the same
    attributes here): the address must find the device's numa_node in sysfs, domain
    included; a build without pci_domain_id is domain 0."""
    from types import SimpleNamespace

    dev = tmp_path / "bus/pci/devices/0001:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    props = SimpleNamespace(pci_domain_id=1, pci_bus_id=0x3B, pci_device_id=0)
    assert placement.pci_address(props) == "0001:3b:00.0"
    assert placement.pci_numa_node(placement.pci_address(props), str(tmp_path)) == 1
    old = SimpleNamespace(pci_bus_id=0xDB, pci_device_id=0x1F)
    assert placement.pci_address(old) == "0000:db:1f.0"


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


# -- rebinding a launcher's binding (issue 25 item 4) --------------------------------------

def _sysfs_topology(root, nodes: dict, gpus: dict, cgroup_cpus: str):
    """A fake /sys: NUMA nodes -> cpulist, GPU PCI address -> numa_node, and the job's
    cgroup (v2, at /sys/fs/cgroup/job) allowing `cgroup_cpus`."""
    for node, cpus in nodes.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for bus, node in gpus.items():
        (root / "bus/pci/devices" / bus).mkdir(parents=True)
        (root / "bus/pci/devices" / bus / "numa_node").write_text(f"{node}\n")
    (root / "fs/cgroup/job").mkdir(parents=True)
    (root / "fs/cgroup/job/cpuset.cpus.effective").write_text(cgroup_cpus + "\n")
    return str(root)


def _plans(root, buses, launcher, environ=None):
    numa = placement.numa_cpus(root)
    rank_numa = [placement.pci_numa_node(b, root) for b in buses]
    job = placement.job_cpus(root, "0::/job\n")
    return [placement.rebind_plan(r, rank_numa, numa, job, launcher[r], environ or {})
            for r in range(len(buses))]


P5_GPUS = {f"0000:{b}:00.0": n for b, n in (("53", 0), ("64", 0), ("75", 0), ("86", 0),
                                              ("97", 1), ("a8", 1), ("b9", 1), ("ca", 1))}


def test_block_cyclic_binding_on_two_sockets_is_rebound_near_each_gpu(tmp_path):
    """A p5 (2 sockets of 96 CPUs, GPUs 0-3 on socket 0): Slurm's block:cyclic with
    --cpus-per-task=24 alternates sockets, so ranks 1, 3, 4 and 6 sit on the far one.
    Every rank takes its share of its GPU's socket: disjoint, 24 CPUs each."""
    root = _sysfs_topology(tmp_path, {0: "0-95", 1: "96-191"}, P5_GPUS, "0-191")
    cyclic = [list(range(s * 96 + (r // 2) * 24, s * 96 + (r // 2) * 24 + 24))
              for r, s in enumerate([0, 1] * 4)]
    plans = [p if p is not None else cyclic[r]  # None: the launcher's was already the plan
             for r, p in enumerate(_plans(root, list(P5_GPUS), cyclic))]
    assert _plans(root, list(P5_GPUS), cyclic)[0] is None  # rank 0: 0-23 either way
    assert [p[:1] + p[-1:] for p in plans] == [
        [0, 23], [24, 47], [48, 71], [72, 95], [96, 119], [120, 143], [144, 167], [168, 191]]
    taken = [c for p in plans for c in p]
    assert len(taken) == len(set(taken)) == 192
    assert _plans(root, list(P5_GPUS), cyclic, {"ENN_CPU_BIND": "launcher"}) == [None] * 8


def test_eight_numa_nodes_one_gpu_each(tmp_path):
    """8 NUMA nodes of 12 CPUs (NPS4 on two sockets), one GPU on each, the job allowed
    half of every node: each rank gets the allowed CPUs of its own GPU's node."""
    nodes = {n: f"{n * 12}-{n * 12 + 11}" for n in range(8)}
    gpus = {f"0000:{0x10 + n:02x}:00.0": (7 - n) for n in range(8)}  # GPUs in reverse order
    allowed = ",".join(f"{n * 12}-{n * 12 + 5}" for n in range(8))
    root = _sysfs_topology(tmp_path, nodes, gpus, allowed)
    launcher = [list(range(r * 6, r * 6 + 6)) for r in range(8)]  # in CPU order, off node
    plans = _plans(root, list(gpus), launcher)
    for r, plan in enumerate(plans):
        node = 7 - r
        assert plan == list(range(node * 12, node * 12 + 6)), (r, plan)


def test_what_is_not_rebound(tmp_path):
    root = _sysfs_topology(tmp_path, {0: "0-95", 1: "96-191"}, P5_GPUS, "0-191")
    plan = [list(range(r * 24, r * 24 + 24)) for r in range(8)]
    assert _plans(root, list(P5_GPUS), plan) == [None] * 8  # already the plan
    # the job's CPUs all on the far socket: no local share to give, the launcher's stays
    far = _sysfs_topology(tmp_path / "far", {0: "0-95", 1: "96-191"}, P5_GPUS, "96-191")
    assert _plans(far, list(P5_GPUS)[:1], [[96]]) == [None]
    # a GPU whose node the kernel does not know (-1)
    unknown = _sysfs_topology(tmp_path / "unknown", {0: "0-3", 1: "4-7"},
                              {"0000:01:00.0": -1, "0000:02:00.0": 1}, "0-7")
    assert _plans(unknown, ["0000:01:00.0", "0000:02:00.0"], [[4], [0]]) == [None, None]


def test_the_jobs_cpus_from_its_cgroup(tmp_path):
    (tmp_path / "fs/cgroup/slurm/job_7/step_0").mkdir(parents=True)
    (tmp_path / "fs/cgroup/slurm/job_7/step_0/cpuset.cpus.effective").write_text("0-3,8\n")
    assert placement.job_cpus(str(tmp_path), "0::/slurm/job_7/step_0\n") == [0, 1, 2, 3, 8]
    (tmp_path / "fs/cgroup/cpuset/slurm/uid_1/job_8").mkdir(parents=True)
    (tmp_path / "fs/cgroup/cpuset/slurm/uid_1/job_8/cpuset.effective_cpus").write_text("4-5\n")
    v1 = "12:memory:/slurm/uid_1/job_8\n5:cpuset:/slurm/uid_1/job_8\n"
    assert placement.job_cpus(str(tmp_path), v1) == [4, 5]
    assert placement.job_cpus(str(tmp_path), "0::/elsewhere\n") is None
