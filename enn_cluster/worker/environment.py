"""Who am I in the job: rank, world, node and master, from Slurm, torchrun or our launcher.

All functions here are pure (environ in, data out) so they are tested with plain dicts.
The worker applies the result to `os.environ` in one place before torch reads it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from enn_cluster.config.launch_env import (
    ATTEMPT_VAR,
    RELAUNCH_VAR,
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    SIM_NODES_VAR,
)
from enn_cluster.errors import UserError
from enn_cluster.worker.placement import task_cpus

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass(frozen=True)
class WorkerEnv:
    launcher: str  # slurm | torchrun | local
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: Optional[str] = None
    restart_count: int = 0
    step_id: Optional[str] = None  # Slurm's step: a relaunch inside the job is a new one
    relaunch: int = 0  # host_setup.sh's relaunches on the nodes left after a lost node


def expand_hostlist(text: str) -> list[str]:
    """Expand Slurm's compact host list ('n[1-3,07],gpu-a1' -> n1 n2 n3 n07 gpu-a1)
    (storage/hostlist.py; no `scontrol` needed inside the container)."""
    from enn_cluster.storage.hostlist import expand_hostlist as expand

    try:
        return expand(text)
    except ValueError as exc:
        raise UserError(f"environment: SLURM_JOB_NODELIST={text!r} is not a Slurm host list "
                        f"({exc}; e.g. n[1-3],gpu7); launch through srun, or set "
                        "MASTER_ADDR") from None


def expand_tasks_per_node(text: str) -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE format)."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
        if not m:
            raise ValueError(f"bad tasks-per-node spec {text!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def port_for_job(job_id: str) -> int:
    """A rendezvous port derived from the job id: stable across requeues of one job. Our
    batch scripts' host snippet exports the same port (one rule: config/launch_env.py); this
    fallback serves a site's own srun line, which runs no snippet of ours."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return MASTER_PORT_BASE + int(digits) % MASTER_PORT_SPAN


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise UserError(f"environment: {name} is not set; start workers with srun, "
                            "torchrun or enn-submit")
        return default
    return int(value)


def detect_launcher(environ: Mapping[str, str]) -> str:
    if SIM_NODES_VAR in environ and "RANK" in environ:
        return "local"
    if "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ:
        return "torchrun"
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return "slurm"
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "torchrun"
    return "single"


def discover(environ: Mapping[str, str]) -> WorkerEnv:
    launcher = detect_launcher(environ)
    if launcher == "slurm":
        return _from_slurm(environ)
    if launcher == "single":
        return WorkerEnv("single", 0, 0, 1, 1, 0, 1, "127.0.0.1",
                         int(environ.get("MASTER_PORT", "29500")))
    world = _int(environ, "WORLD_SIZE")
    rank = _int(environ, "RANK")
    if launcher == "local":
        nodes = _int(environ, SIM_NODES_VAR)
        if nodes <= 0 or world % nodes:
            raise UserError(f"environment: {SIM_NODES_VAR}={nodes} does not divide WORLD_SIZE={world}")
        local_world = world // nodes
        node_rank, local_rank = divmod(rank, local_world)
    else:
        local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
        local_rank = _int(environ, "LOCAL_RANK", rank % local_world)
        nodes = max(world // local_world, 1)
        node_rank = _int(environ, "GROUP_RANK", rank // local_world)
    return WorkerEnv(launcher, rank, local_rank, world, local_world, node_rank, nodes,
                     environ.get("MASTER_ADDR", "127.0.0.1"), _int(environ, "MASTER_PORT", 29500),
                     environ.get("SLURM_JOB_ID"),
                     # the local launcher restarts by launching again (ATTEMPT_VAR)
                     _int(environ, "TORCHELASTIC_RESTART_COUNT", 0) + _int(environ, ATTEMPT_VAR, 0))


def _from_slurm(environ: Mapping[str, str]) -> WorkerEnv:
    world = _int(environ, "SLURM_NTASKS")
    node_rank = _int(environ, "SLURM_NODEID", 0)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    hosts = expand_hostlist(nodelist) if nodelist else ["127.0.0.1"]
    per_node_spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    per_node = expand_tasks_per_node(per_node_spec) if per_node_spec else [world]
    job_id = environ.get("SLURM_JOB_ID", "0")
    rank, local_rank = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID", 0)
    block = sum(per_node[:node_rank]) + local_rank
    if node_rank < len(per_node) and rank != block:
        raise UserError(f"SLURM_DISTRIBUTION: rank {rank} is task {local_rank} of node "
                        f"{node_rank}, where a block layout puts rank {block}: the tasks are "
                        f"not laid out node by node ({environ.get('SLURM_DISTRIBUTION') or 'a site default'}), "
                        "so each node's shard group would span nodes; start the step with "
                        "srun --distribution=block (enn-submit's scripts do)")
    return WorkerEnv(
        launcher="slurm", rank=rank,
        local_rank=local_rank, world_size=world,
        local_world_size=per_node[min(node_rank, len(per_node) - 1)],
        node_rank=node_rank, num_nodes=len(per_node),
        master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=_int(environ, "MASTER_PORT", port_for_job(job_id)),
        job_id=job_id, restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
        step_id=environ.get("SLURM_STEP_ID"), relaunch=_int(environ, RELAUNCH_VAR, 0))


def clean_environment(environ: Mapping[str, str], env: WorkerEnv,
                      cpus_per_task: Optional[int] = None,
                      cpus: Optional[tuple[int, int]] = None) -> dict:
    """The environment torch should see: one launcher's view, no stale leftovers.

    A Slurm step inherits whatever the submitting shell had (an old RANK, a torchrun
    WORLD_SIZE); torch's env:// init would trust those. We drop them and write the
    values we discovered, and size intra-op threads to the CPUs this task got
    (`cpus`: affinity and online counts, read from the process when not given).
    """
    clean = {k: v for k, v in environ.items() if env.launcher not in ("slurm", "single")
             or k not in TORCHRUN_VARS}
    clean.update({
        "RANK": str(env.rank), "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size), "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank), "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    })
    if "OMP_NUM_THREADS" not in environ:
        affinity, online = cpus or (len(os.sched_getaffinity(0)), os.cpu_count() or 1)
        threads = cpus_per_task or task_cpus(environ, affinity, online, env.local_world_size)
        clean["OMP_NUM_THREADS"] = str(max(threads, 1))
    return clean
