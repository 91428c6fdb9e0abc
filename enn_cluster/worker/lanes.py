"""The two communication lanes of a worker.

- accelerator lane: the default process group (NCCL on GPU, gloo on CPU) that carries
  gradients; the DeviceMesh is built on it.
- control lane: a separate gloo group for barriers, decisions (stop now? which checkpoint?)
  and checkpoint planning (async checkpoint writes get a gloo group of their own), so that slow filesystem work never sits inside an NCCL
  watchdog and decisions never queue behind gradient traffic.
Every collective has the configured timeout: a dead peer ends the job, it never hangs it.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from enn_cluster.errors import UserError
from enn_cluster.worker import control_net
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
    # The step id too: a relaunch inside the job (a lost node) meets on the same port, and a
    # rank of the failed step that still runs must never join it.
    step = f"/step-{env.step_id}" if env.step_id else ""
    return dist.PrefixStore(f"enn/job-{env.job_id or 'none'}{step}/attempt-{env.restart_count}",
                            store)


class PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port: a failure the retry can mend."""


def lane_device(env: WorkerEnv) -> torch.device:
    """The device this rank drives, from what is visible and its local rank alone (no
    process group yet), so the worker can place itself before any group starts a thread.
    Never cuda:LOCAL_RANK blindly: Slurm may show a task 1 or 4 GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", choose_device(env.local_rank, env.local_world_size,
                                              torch.cuda.device_count()))


def open_lanes(env: WorkerEnv, timeout_s: float, rendezvous_s: float = 0.0,
               barrier_s: float = 0.0, device: Optional[torch.device] = None) -> Lanes:
    """`timeout_s`: the accelerator lane's collectives; `rendezvous_s`: ranks meeting at
    start; `barrier_s`: the control and checkpoint lanes (checkpoint barriers). 0: timeout_s.
    `device`: lane_device's choice unless given. Ranks sharing a GPU are refused before
    the accelerator lane exists (check_devices)."""
    device = device or lane_device(env)
    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(env, timedelta(seconds=rendezvous_s or timeout_s))
    if control_net.machines(env) > 1:  # lo is wrong only across machines
        judged(store, env.rank, env.world_size, "hosts", control_net.peer_post(os.environ),
               control_net.loopback_refusal)
    claim = device_claim(device)
    if claim is not None:
        check_devices(store, env.rank, env.world_size, claim)
    common = dict(store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device, **common)
    else:
        dist.init_process_group(backend="gloo", **common)
    barrier = timedelta(seconds=barrier_s or timeout_s)
    control = dist.new_group(backend="gloo", timeout=barrier)
    # An async save runs its collectives in a writer thread; sharing the control lane with
    # the training loop's per-step decisions would interleave two collectives on one group.
    checkpoint = dist.new_group(backend="gloo", timeout=barrier)
    return Lanes(control=control, checkpoint=checkpoint, device=device, rank=env.rank,
                 world_size=env.world_size)


def device_id(device: torch.device) -> str:
    """A name for the physical GPU that is the same whatever CUDA_VISIBLE_DEVICES says."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def device_claim(device: torch.device) -> Optional[str]:
    """The physical device this rank claims (None on CPU: nothing to share). Tests name one
    by fault injection, as two ranks on one GPU would claim it, to refuse a CPU run."""
    from enn_cluster.worker.fault_injection import claimed_device

    if claimed_device():
        return claimed_device()
    return device_id(device) if device.type == "cuda" else None


def judged(store, rank: int, world_size: int, topic: str, post: str, judge) -> None:
    """A check over the rendezvous store before any process group: every rank posts
    `post` under TOPIC/RANK, rank 0 judges them all (`judge(posts)` -> a refusal or ''),
    and every rank raises the refusal alike (UserError, exit 2)."""
    store.set(f"{topic}/{rank}", post)
    if rank == 0:
        keys = [f"{topic}/{r}" for r in range(world_size)]
        store.wait(keys)
        store.set(f"{topic}/refusal", judge([v.decode() for v in store.multi_get(keys)]))
    refusal = store.get(f"{topic}/refusal").decode()
    if refusal:  # rank 0 may host the store: it leaves once every rank has read this
        if store.add(f"{topic}/refused", 1) == world_size:
            store.set(f"{topic}/all-refused", "1")
        if rank == 0:
            store.wait([f"{topic}/all-refused"])
        raise UserError(refusal)


def check_devices(store, rank: int, world_size: int, device: str) -> None:
    """Refuse to train when two ranks of a node drive one GPU, over the rendezvous store
    before any process group: NCCL's eager init would otherwise fail first with its own
    'Duplicate GPU detected', a failure that is retried, not this line (exit 2)."""
    judged(store, rank, world_size, "devices", json.dumps([socket.gethostname(), device]),
           lambda posts: _refusal(device_clashes([tuple(json.loads(p)) for p in posts])))


def _refusal(clashes: dict[str, list[int]]) -> str:
    if not clashes:
        return ""
    where, ranks = next(iter(clashes.items()))
    return (f"devices: ranks {', '.join(map(str, ranks))} share {where}; give each task its "
            "own GPU (one task per GPU with --gpus-per-task=1 or --gpu-bind=single:1, or "
            "fix CUDA_VISIBLE_DEVICES)")


def close_lanes() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
