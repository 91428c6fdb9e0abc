"""Where a rank runs on its node: which CPUs it may use and which GPU it drives.

Why: under srun every task starts with whatever CPUs and GPUs Slurm's binding gave it
(`--cpus-per-task`, `--cpu-bind`, `--gpus-per-task`, `--gpu-bind=closest|single:1`), or
with the whole node when nothing is bound. The decisions here are pure functions of what
the process sees (its affinity, the visible devices, the node's NUMA layout); the worker
applies them once, before any process group starts a thread, logs one line per rank saying
what it got and keeps the same in the rank's backend report.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

log = logging.getLogger(__name__)


def parse_cpulist(text: str) -> list[int]:
    """Linux cpulist format ('0-3,8,10-11', as in /sys/devices/system/node/node0/cpulist)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: Sequence[int]) -> str:
    """The inverse of parse_cpulist, for log lines: [0,1,2,3,8] -> '0-3,8'."""
    out, ordered = [], sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def task_cpus(environ: Mapping[str, str], affinity: int, online: int, local_world: int) -> int:
    """CPUs this task may keep busy (OMP_NUM_THREADS): what Slurm granted
    (SLURM_CPUS_PER_TASK, never more than the affinity), else the affinity when a launcher
    bound the task, else the node's CPUs shared among the node's tasks."""
    granted = environ.get("SLURM_CPUS_PER_TASK", "")
    if granted.isdigit() and int(granted) > 0:
        return max(min(int(granted), affinity), 1)
    if affinity < online:
        return max(affinity, 1)
    return max(online // max(local_world, 1), 1)


def numa_cpus(sysfs_root: str = "/sys") -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from /sys/devices/system/node/node*/cpulist ({} if absent)."""
    base = Path(sysfs_root) / "devices" / "system" / "node"
    out: dict[int, list[int]] = {}
    for node in sorted(base.glob("node[0-9]*")):
        try:
            out[int(node.name[4:])] = parse_cpulist((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return out


def online_cpus(sysfs_root: str = "/sys") -> int:
    """CPUs the node has online (/sys/devices/system/cpu/online), else os.cpu_count()."""
    try:
        return len(parse_cpulist((Path(sysfs_root) / "devices/system/cpu/online").read_text()))
    except (OSError, ValueError):
        return os.cpu_count() or 1


def pci_numa_node(bus_id: str, sysfs_root: str = "/sys") -> int:
    """NUMA node of a PCI device ('0000:1b:00.0'); -1 when unknown (as the kernel says)."""
    try:
        path = Path(sysfs_root) / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node"
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


def cpu_plan(local_rank: int, rank_numa: Sequence[int], numa: Mapping[int, Sequence[int]],
             allowed: Sequence[int]) -> list[int]:
    """CPUs for `local_rank` when nothing bound the tasks: the ranks whose GPUs sit on one
    NUMA node split that node's allowed CPUs evenly, in order (a rank with an unknown node,
    -1, splits all allowed CPUs with the other unknown ones). Never empty."""
    node = rank_numa[local_rank]
    pool = [c for c in numa.get(node, allowed) if c in set(allowed)] or list(allowed)
    peers = [r for r, n in enumerate(rank_numa) if n == node]
    share = max(len(pool) // len(peers), 1)
    k = peers.index(local_rank) % len(pool)
    return list(pool[k * share:(k + 1) * share])


def job_cpus(sysfs_root: str = "/sys", cgroup_text: Optional[str] = None) -> Optional[list[int]]:
    """The CPUs this job step may use on the node: its cgroup's cpuset (v2
    cpuset.cpus.effective, v1 cpuset.effective_cpus), wider than a task's own affinity when
    a launcher bound each task. None when it cannot be read."""
    if cgroup_text is None:
        try:
            cgroup_text = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    base = Path(sysfs_root) / "fs" / "cgroup"
    for line in cgroup_text.splitlines():
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            candidate = base / path.lstrip("/") / "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):
            candidate = base / "cpuset" / path.lstrip("/") / "cpuset.effective_cpus"
        else:
            continue
        try:
            cpus = parse_cpulist(candidate.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return None


def rebind_plan(local_rank: int, rank_numa: Sequence[int], numa: Mapping[int, Sequence[int]],
                job: Optional[Sequence[int]], launcher_cpus: Sequence[int],
                environ: Mapping[str, str]) -> Optional[list[int]]:
    """CPUs for a task a launcher bound (Slurm's default block:cyclic with --cpus-per-task
    puts every other rank on the far socket from its GPU): the plan over the job's allowed
    CPUs (`job`, its cgroup), which every rank of the node computes alike, so the ranks'
    shares stay disjoint; a rank whose binding was already local takes its share too, for
    that reason. None: keep the launcher's (the job's CPUs or a GPU's node unknown, a
    share that would not be on the GPU's node, the launcher's binding already the plan's,
    or ENN_CPU_BIND=launcher asks to keep it)."""
    node = rank_numa[local_rank]
    if (environ.get("ENN_CPU_BIND") == "launcher" or not job or node not in numa
            or any(n < 0 or n not in numa for n in rank_numa)):
        return None
    plan = cpu_plan(local_rank, rank_numa, numa, job)
    if not set(plan) <= set(numa[node]) or sorted(plan) == sorted(launcher_cpus):
        return None
    return plan


def numa_mismatch(rank: int, device: str, gpu_node: Optional[int], cpus: Sequence[int],
                  numa: Mapping[int, Sequence[int]]) -> Optional[str]:
    """The warning to log when a launcher bound a rank to CPUs outside its GPU's NUMA node
    (every host-to-device copy then crosses the socket link); None when they agree or
    either side is unknown."""
    mine = set(cpus)
    nodes = sorted(n for n, node_cpus in numa.items() if mine & set(node_cpus))
    if gpu_node is None or gpu_node < 0 or not nodes or nodes == [gpu_node]:
        return None
    return (f"placement: rank {rank} drives {device} on NUMA node {gpu_node}, but the launcher "
            f"bound it to CPUs {format_cpulist(cpus)} on NUMA node(s) "
            f"{','.join(map(str, nodes))}; bind CPUs near the GPU (srun --gpu-bind=closest "
            "with --cpu-bind) or leave the task unbound and the worker places it")


def visible_devices(environ: Mapping[str, str], device_count: int) -> list[str]:
    """The devices this process sees, as CUDA_VISIBLE_DEVICES names them (indices or
    UUIDs); all `device_count` when it is unset."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return [str(i) for i in range(device_count)]
    return [v.strip() for v in value.split(",") if v.strip()][:device_count]


def choose_device(local_rank: int, local_world: int, device_count: int) -> int:
    """The device index (within what is visible) a rank drives, never assuming
    cuda:LOCAL_RANK: one visible device (--gpus-per-task=1, --gpu-bind=single:1) -> 0;
    every node GPU visible -> LOCAL_RANK; a share bound per NUMA domain (--gpu-bind=closest
    shows 4 of 8) -> LOCAL_RANK modulo what is visible."""
    if device_count < 1:
        raise ValueError("no CUDA device is visible to this task")
    if device_count == 1:
        return 0
    if device_count >= local_world:
        return local_rank
    return local_rank % device_count


def device_clashes(claims: Sequence[tuple[str, str]]) -> dict[str, list[int]]:
    """Ranks (by position in `claims`) that share a device: claims are (host, device id)
    per rank; the result maps 'host:device' to the ranks when more than one holds it."""
    holders: dict[str, list[int]] = {}
    for rank, (host, device) in enumerate(claims):
        holders.setdefault(f"{host}:{device}", []).append(rank)
    return {k: v for k, v in holders.items() if len(v) > 1}


def use_device(device) -> None:
    """Make `device` this thread's current CUDA device. Every thread we start calls it
    first: a new thread's current device is 0, so pinning memory or creating a stream there
    would put a context on GPU 0 for every rank of the node."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)


def affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def bind_threads(cpus: Sequence[int], task_dir: str = "/proc/self/task") -> None:
    """Bind every thread of this process to `cpus`, not only the caller: sched_setaffinity(0)
    binds the calling thread, and threads already running (CUDA's, a library's) would keep
    the old mask. Rescans until no new thread shows up, since one started meanwhile by an
    unbound thread inherits the old mask."""
    bound: set[int] = set()
    while new := {int(t) for t in os.listdir(task_dir)} - bound:
        for tid in new:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # it ended meanwhile
                pass
        bound |= new


def describe(rank: int, local_rank: int, cpus: Sequence[int], threads: int, source: str,
             device: Optional[str] = None, numa: Optional[int] = None) -> str:
    """The one line each rank logs about its placement (docs/admin.md shows examples)."""
    gpu = f"gpu {device} numa {numa}" if device is not None else "gpu none"
    return (f"placement: rank {rank} local {local_rank} {gpu} cpus {format_cpulist(cpus)} "
            f"({len(cpus)}) threads {threads} bound-by {source}")


@dataclass(frozen=True)
class Placement:
    """What one rank got: one log line, and the same in its backend report."""
    rank: int
    local_rank: int
    cpus: tuple[int, ...]
    threads: int
    bound_by: str  # launcher (Slurm bound the task), plan (the worker did), none
    device: Optional[str] = None  # 'cuda:1 of [0,1] (0000:9c:00.0)'; None on CPU
    numa: Optional[int] = None  # the GPU's NUMA node (-1: the kernel does not know)

    def line(self) -> str:
        return describe(self.rank, self.local_rank, self.cpus, self.threads, self.bound_by,
                        self.device, self.numa)

    def report(self) -> dict:
        return {"cpus": format_cpulist(self.cpus), "cpu_count": len(self.cpus),
                "threads": self.threads, "bound_by": self.bound_by, "device": self.device,
                "numa": self.numa}


def cuda_bus_ids() -> list[str]:
    """PCI addresses of the visible CUDA devices, in torch's index order ([] on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [pci_address(torch.cuda.get_device_properties(i))
            for i in range(torch.cuda.device_count())]


def pci_address(props) -> str:
    """A CUDA device's PCI address as sysfs names it (/sys/bus/pci/devices/DDDD:BB:DD.0),
    from its properties; a torch build without `pci_domain_id` means domain 0."""
    return (f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
            f"{props.pci_device_id:02x}.0")


def place_task(env, device, sysfs_root: str = "/sys",
               bus_ids: Optional[Sequence[str]] = None) -> Placement:
    """Bind this task's CPUs near its GPU when no launcher bound it, or when a launcher
    bound it on another NUMA node than its GPU and the job's CPUs are known (rebind_plan);
    every thread of the process, so call it before the process groups start theirs. Size
    torch's threads to what it got, and say what it got; warn when a launcher's binding
    stays on another NUMA node than the GPU. `bus_ids` (the visible GPUs' PCI addresses)
    default to CUDA's."""
    import torch

    cpus, online = affinity(), online_cpus(sysfs_root)
    source = "launcher" if len(cpus) < online else "none"
    bus = list(bus_ids) if bus_ids is not None else \
        (cuda_bus_ids() if device.type == "cuda" else [])
    node = pci_numa_node(bus[device.index], sysfs_root) if bus else None
    lw, numa = env.local_world_size, numa_cpus(sysfs_root)
    rank_numa = [pci_numa_node(bus[choose_device(r, lw, len(bus))], sysfs_root)
                 for r in range(lw)] if bus and len(bus) >= lw else []
    rebind = rebind_plan(env.local_rank, rank_numa, numa, job_cpus(sysfs_root), cpus,
                         os.environ) if source == "launcher" and rank_numa else None
    if rebind is not None:
        log.info("placement: rank %d rebound from the launcher's CPUs %s to %s, on its GPU's "
                 "NUMA node %d (ENN_CPU_BIND=launcher keeps the launcher's)", env.rank,
                 format_cpulist(cpus), format_cpulist(rebind), node)
        cpus, source = rebind, "plan"
        bind_threads(cpus)
    elif source == "none" and rank_numa:
        cpus = cpu_plan(env.local_rank, rank_numa, numa, cpus)
        bind_threads(cpus)
        source = "plan"
    elif source == "launcher" and (warning := numa_mismatch(env.rank, str(device), node,
                                                             cpus, numa)):
        log.warning(warning)
    threads = task_cpus(os.environ, len(cpus), online, lw)
    if source != "plan" and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = max(int(os.environ["OMP_NUM_THREADS"]), 1)  # the user's, or the launcher's
    torch.set_num_threads(threads)
    visible = ",".join(visible_devices(os.environ, len(bus)))
    name = f"{device} of [{visible}] ({bus[device.index]})" if bus else None
    return Placement(env.rank, env.local_rank, tuple(cpus), threads, source, name, node)
