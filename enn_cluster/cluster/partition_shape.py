"""CPUs per task from the shape of the partition's nodes, asked of Slurm at submit time.

Why: a job that is not --exclusive gets only the CPUs it asks for, and without
--cpus-per-task that is one per task. SLURM_CPUS_ON_NODE / tasks (what the batch script
falls back to) is then 1, and the main thread, the NCCL proxy, gloo, the checkpoint thread
and the loader share one core. So when neither --cpus-per-task nor site.cpus_per_task is
set, the job asks for its share of the smallest node that can hold it: the node's usable
CPUs (CPUEfctv, less what the partition's MaxCPUsPerNode forbids) times the share of the
node's GPUs it takes (all of the node for a CPU job), divided by its tasks.
Deciding is pure (parse_*, cpus_per_task); only `cpus_from_slurm` asks Slurm, through
cluster/slurm.py (the partitions listed whole: no user value reaches its argv).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from enn_cluster.cluster.slurm import parse_scontrol, show


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: str  # Slurm's hostlist expression, e.g. gpu[001-064]
    default: bool = False
    max_cpus_per_node: Optional[int] = None  # MaxCPUsPerNode; None: UNLIMITED
    whole_nodes: bool = False  # OverSubscribe=EXCLUSIVE: every job gets whole nodes


@dataclass(frozen=True)
class NodeShape:
    name: str
    cpus: int  # CPUs a job may be given: CPUEfctv (Slurm >= 23.02), else CPUTot
    gpus: int


def _count(value: Optional[str]) -> Optional[int]:
    return int(value) if value and value.isdigit() else None


def parse_partitions(text: str) -> list[Partition]:
    """`scontrol -o show partition` (one line per partition) -> Partitions."""
    out = []
    for line in text.splitlines():
        f = parse_scontrol(line)
        if f.get("PartitionName"):
            out.append(Partition(
                f["PartitionName"], f.get("Nodes", "(null)"), f.get("Default") == "YES",
                _count(f.get("MaxCPUsPerNode")),
                f.get("OverSubscribe", "").startswith("EXCLUSIVE")))
    return out


def gpu_count(gres: str) -> int:
    """GPUs in a node's Gres field: 'gpu:8', 'gpu:h100:8(S:0-1)', 'gpu:a100:2,nvme:1',
    '(null)'; a GPU named without a count ('gpu', 'gpu:a100') is one, as in gres.conf."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if parts[-1].isdigit() else 1
    return total


def parse_nodes(text: str) -> list[NodeShape]:
    """`scontrol -o show node NODES` (one line per node) -> NodeShapes."""
    out = []
    for line in text.splitlines():
        f = parse_scontrol(line)
        cpus = _count(f.get("CPUEfctv")) or _count(f.get("CPUTot"))
        if f.get("NodeName") and cpus:
            out.append(NodeShape(f["NodeName"], cpus, gpu_count(f.get("Gres", ""))))
    return out


def cpus_per_task(nodes: Sequence[NodeShape], gpus_per_node: int, tasks_per_node: int,
                  max_cpus_per_node: Optional[int] = None,
                  whole_nodes: bool = False) -> Optional[int]:
    """floor(node CPUs x share / tasks) on the smallest node that has the GPUs asked for,
    at least 1; share = GPUs asked / the node's GPUs (at most 1), 1 for a CPU job or whole
    nodes. None when no node has the GPUs (Slurm refuses the job; nothing to size)."""
    fits = [n for n in nodes if n.gpus >= gpus_per_node]
    if not fits:
        return None

    def on(node: NodeShape) -> int:
        cpus = min(node.cpus, max_cpus_per_node or node.cpus)
        if gpus_per_node and node.gpus and not whole_nodes:
            return cpus * gpus_per_node // (node.gpus * tasks_per_node)
        return cpus // tasks_per_node

    return max(1, min(on(n) for n in fits))


def unreadable_config(environ: Mapping[str, str], exists=os.path.exists) -> Optional[str]:
    """Why scontrol cannot be asked, where that shows without asking: a SLURM_CONF that
    names no file makes it retry for 60 s before it gives up. None: ask."""
    named = environ.get("SLURM_CONF")
    if named and not exists(named):
        return f"SLURM_CONF={named} names no file"
    return None


def cpus_from_slurm(partition: Optional[str], gpus_per_node: int,
                    tasks_per_node: int) -> tuple[Optional[int], str]:
    """CPUs per task from the partition's nodes (None: the default partition), asked of
    scontrol; (None, why not) when Slurm cannot say."""
    why = unreadable_config(os.environ)
    if why:
        return None, why
    text, why = show("--all", "show", "partition")  # hidden ones and other groups' too
    if text is None:
        return None, why
    parts = parse_partitions(text)
    chosen = next((p for p in parts if (p.name == partition if partition else p.default)), None)
    if chosen is None or chosen.nodes == "(null)":
        return None, (f"Slurm knows no partition {partition!r} with nodes" if partition
                      else "Slurm names no default partition")
    text, why = show("show", "node", chosen.nodes)
    if text is None:
        return None, why
    value = cpus_per_task(parse_nodes(text), gpus_per_node, tasks_per_node,
                          chosen.max_cpus_per_node, chosen.whole_nodes)
    if value is None:
        return None, f"no node of partition {chosen.name} has {gpus_per_node} GPUs"
    return value, ""
