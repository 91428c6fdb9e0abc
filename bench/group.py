"""Run a function on N local processes under torch's elastic launcher (as torchrun does).

Used for the in-process benchmarks (checkpoint I/O, the bare FSDP2 loop). The function
must live in an importable module; each rank's return value comes back in a dict.
"""
from __future__ import annotations

import os
import uuid
from typing import Callable

from enn_cluster.client.launch_local import elastic_run, free_port


def run_group(entry: Callable, nprocs: int, *args) -> dict:
    """Call `entry(*args)` on `nprocs` spawned ranks; return {rank: return value}."""
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.2, start_method="spawn")
    # for the ranks alone: left in this process, OMP_NUM_THREADS=1 would reach every later
    # benchmark's jobs (a Slurm task takes it over its planned thread count)
    return elastic_run(config, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                       entry, *args)


def max_over_ranks(lanes, seconds: float) -> float:
    """A collective operation takes as long as its slowest rank."""
    return max(lanes.gather_objects(seconds))
