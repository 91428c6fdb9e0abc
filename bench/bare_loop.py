"""The baseline for the runtime-overhead benchmark: a bare, hand-written FSDP2 HSDP loop.

No enn_cluster code runs here: plain `init_process_group`, a 2-D DeviceMesh, the same
MLP architecture (Linear + GELU + Dropout blocks, a linear head), `fully_shard` per block
and on the root, and the same .npy data read through a memmap. It does the same work per
step as the trainer, written the way a careful hand-written loop would be, so that the
ratio measures our runtime and not a handicap of the baseline:
- fused AdamW (ours uses the fused kernel);
- the gradient norm completed in one all-reduce, then the clip with it (plain
  `clip_grad_norm_` on DTensors reduces twice);
- the loss read on the host every step (the benchmark logs every step);
- Python's collector frozen over the pre-training heap, run every 100 steps.
What ours does on top (and is counted against it): the control-lane all-reduce of the
loss and the stop/save decision, metrics records, the watchdog, the non-finite counts.
Rank 0 returns the wall-clock time at the end of every step.
"""
from __future__ import annotations

import gc
import os
import time


def _model(n_features: int, hidden: list[int], n_outputs: int):
    from torch import nn

    sizes = [n_features, *hidden]
    blocks = [nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Dropout(0.0))
              for a, b in zip(sizes[:-1], sizes[1:])]
    return nn.Sequential(*blocks, nn.Linear(sizes[-1], n_outputs)), blocks


def setup(x_path: str, y_path: str, hidden: list[int], replicate: int, shard: int, lr: float,
          seed: int):
    """Process group, 2-D mesh, memmapped data, the sharded model and fused AdamW."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    x = np.load(x_path, mmap_mode="r")
    y = np.load(y_path, mmap_mode="r")
    torch.manual_seed(seed)
    model, blocks = _model(x.shape[1], hidden, y.shape[1])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    return x, y, model, opt


def step(model, opt, x, y, rows) -> None:
    """One optimizer step on `rows`: the norm in one all-reduce, the clip, the loss read."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    params = list(model.parameters())
    xb = torch.from_numpy(np.ascontiguousarray(x[rows], dtype=np.float32))
    yb = torch.from_numpy(np.ascontiguousarray(y[rows], dtype=np.float32))
    loss = F.mse_loss(model(xb), yb)
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()


def timed_loop(n_rows: int, gbatch: int, steps: int, seed: int, one_step) -> list[float]:
    """`one_step(perm, pos)` `steps` times in the trainer's order (one seeded permutation
    per epoch, the ragged tail dropped), Python's collector frozen over the heap before it
    and run every 100 steps; then the process group ends. Rank 0 gets the time at the end
    of every step."""
    import numpy as np
    import torch.distributed as dist

    perm, epoch, pos = None, -1, 0
    stamps = []
    gc.collect()
    gc.freeze()
    gc.disable()
    for n in range(1, steps + 1):
        if perm is None or pos + gbatch > n_rows:
            epoch, pos = epoch + 1, 0
            perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        one_step(perm, pos)
        pos += gbatch
        if n % 100 == 0:
            gc.collect()
        stamps.append(time.time())
    gc.enable()
    gc.unfreeze()
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return stamps if rank == 0 else []


def train(x_path: str, y_path: str, hidden: list[int], replicate: int, shard: int,
          batch: int, steps: int, lr: float, seed: int) -> list[float]:
    import torch.distributed as dist

    x, y, model, opt = setup(x_path, y_path, hidden, replicate, shard, lr, seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    return timed_loop(len(x), batch * world, steps, seed, lambda perm, pos: step(
        model, opt, x, y, perm[pos + rank * batch: pos + (rank + 1) * batch]))
