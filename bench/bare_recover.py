"""The baseline for time to recover: the bare FSDP2 loop under torchrun's restart.

No enn_cluster code runs here. The ranks train bare_loop's model with plain `dcp.save`
of model + optimizer (torch's `get_state_dict`) at `save_at`; on the first attempt rank 1
SIGKILLs itself after `die_at` steps, as ours does; torchrun's agent (elastic_launch,
max_restarts=1, its default monitor interval) restarts every rank, which loads the
checkpoint with plain `dcp.load` and trains on. Rank 0 returns the wall-clock time at the
end of the first step after the restart; the dying rank writes its time of death.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def recover(x_path: str, y_path: str, hidden: list[int], replicate: int, shard: int,
            batch: int, save_at: int, die_at: int, lr: float, seed: int, ckpt: str) -> float:
    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .bare_loop import setup, step

    x, y, model, opt = setup(x_path, y_path, hidden, replicate, shard, lr, seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = Path(ckpt) / f"step-{save_at}"
    start = 0
    if (saved / ".metadata").exists():
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(saved))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = save_at
    restarted = start > 0
    gbatch = batch * world
    for n in range(start + 1, die_at + 2):
        if n == die_at + 1 and not restarted and rank == 1:
            Path(ckpt, "died").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        epoch, pos = divmod((n - 1) * gbatch, len(x) - len(x) % gbatch)
        perm = np.random.default_rng([seed, epoch]).permutation(len(x))
        step(model, opt, x, y, perm[pos + rank * batch: pos + (rank + 1) * batch])
        if restarted:
            stamp = time.time()
            dist.barrier()
            dist.destroy_process_group()
            return stamp
        if n == save_at:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(saved))
    dist.barrier()  # not reached on the first attempt: rank 1 dies in the loop
    dist.destroy_process_group()
    return 0.0
