"""The two communication lanes of a worker.

- accelerator lane: the default process group (NCCL on GPU, gloo on CPU) that carries
  gradients; the DeviceMesh is built on it.
- control lane: a separate gloo group for barriers, decisions (stop now? which checkpoint?)
  and checkpoint planning (async checkpoint writes get a gloo group of their own), so that slow filesystem work never sits inside an NCCL
  watchdog and decisions never queue behind gradient traffic.
Every collective has the configured timeout: a dead peer ends the job, it never hangs it.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from enn_cluster.errors import UserError
from enn_cluster.worker.environment import WorkerEnv
from enn_cluster.worker.placement import choose_device, device_clashes


@dataclass
class Lanes:
    control: Any  # gloo ProcessGroup
    checkpoint: Any  # gloo ProcessGroup owned by background (async) checkpoint writes
    device: torch.device
    rank: int
    world_size: int

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def gather_objects(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def all_max(self, values: list[float]) -> list[float]:
        """One small all-reduce for several per-step decisions (flags as 0/1)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return t.tolist()

    def start_sum(self, values: list[float]) -> Callable[[], list[float]]:
        """Start a SUM all-reduce in the background; call the result to wait for it (the
        trainer overlaps it with the gradient-norm reduction)."""
        t = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.control, async_op=True)

        def result() -> list[float]:
            work.wait()
            return t.tolist()
        return result

    def all_min(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return t.tolist()


def rendezvous_store(env: WorkerEnv, timeout: timedelta):
    """The TCPStore the process groups meet in, with a prefix per restart attempt.

    Under torch's elastic agent the store outlives a failed attempt, and a restarted
    group would otherwise read the dead group's addresses ("Connection refused").
    """
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = env.rank == 0 and not use_agent_store
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=is_master, timeout=timeout)
    except dist.DistNetworkError as exc:
        if is_master and "EADDRINUSE" in str(exc):
            raise PortTaken(f"rendezvous: MASTER_PORT={env.master_port} is taken on "
                            f"{socket.gethostname()} (another job or service listens there); "
                            "this attempt fails, and its retry probes for a free port "
                            "(or set MASTER_PORT to a free one)") from None
        raise
    # The job id in the prefix: peers that reach another job's store on a shared port
    # wait for keys it never writes (a clear rendezvous timeout), never join that job.
    return dist.PrefixStore(f"enn/job-{env.job_id or 'none'}/attempt-{env.restart_count}", store)


class PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port: a failure the retry can mend."""


def open_lanes(env: WorkerEnv, timeout_s: float, rendezvous_s: float = 0.0,
               barrier_s: float = 0.0) -> Lanes:
    """`timeout_s`: the accelerator lane's collectives; `rendezvous_s`: ranks meeting at
    start; `barrier_s`: the control and checkpoint lanes (checkpoint barriers). 0: timeout_s."""
    use_cuda = torch.cuda.is_available()
    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(env, timedelta(seconds=rendezvous_s or timeout_s))
    common = dict(store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    if use_cuda:  # never cuda:LOCAL_RANK blindly: Slurm may show a task 1 or 4 GPUs
        device = torch.device("cuda", choose_device(env.local_rank, env.local_world_size,
                                                    torch.cuda.device_count()))
        torch.cuda.set_device(device)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device, **common)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo", **common)
    barrier = timedelta(seconds=barrier_s or timeout_s)
    control = dist.new_group(backend="gloo", timeout=barrier)
    # An async save runs its collectives in a writer thread; sharing the control lane with
    # the training loop's per-step decisions would interleave two collectives on one group.
    checkpoint = dist.new_group(backend="gloo", timeout=barrier)
    lanes = Lanes(control=control, checkpoint=checkpoint, device=device, rank=env.rank,
                  world_size=env.world_size)
    if use_cuda:
        check_devices(lanes, device_id(device))
    return lanes


def device_id(device: torch.device) -> str:
    """A name for the physical GPU that is the same whatever CUDA_VISIBLE_DEVICES says."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def check_devices(lanes: Lanes, device: str) -> None:
    """Refuse to train when two ranks of a node drive one GPU (all ranks raise alike)."""
    claims = lanes.gather_objects((socket.gethostname(), device))
    clashes = device_clashes(claims)
    if clashes:
        where, ranks = next(iter(clashes.items()))
        raise UserError(f"devices: ranks {', '.join(map(str, ranks))} share {where}; give "
                        "each task its own GPU (one task per GPU with --gpus-per-task=1 or "
                        "--gpu-bind=single:1, or fix CUDA_VISIBLE_DEVICES)")


def close_lanes() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
