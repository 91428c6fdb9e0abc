"""The baseline of the `lm_overhead` benchmark: a bare FSDP2 + transformers loop.

No enn_cluster code runs here: plain `init_process_group`, a 2-D CPU mesh from
`init_device_mesh`, `AutoModelForCausalLM.from_pretrained` of the same weights directory on
every rank, `fully_shard` per decoder layer and then the root, and the same staged token
rows (train_x: input ids, train_y: labels) read through a memmap in the same order as the
trainer (one seeded permutation per epoch, rank-major micro-batches within a step). The
same work per step as the trainer, written the way a careful loop would be (see
bare_loop.py): gradient accumulation with HSDP's cross-replica all-reduce only on the last
micro-batch, packed documents kept apart as TRL's padding-free collator does (positions
restarting after each EOS), transformers' own masked causal-LM loss, the gradient norm in one
all-reduce then the clip, fused AdamW, the loss read every step, GC frozen over the
pre-training heap and run every 100 steps. Rank 0 returns the time at the end of each step.
"""
from __future__ import annotations

import os


def setup(model_dir: str, data_dir: str, replicate: int, shard: int, lr: float,
          bf16: bool = False):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    x = np.load(os.path.join(data_dir, "train_x.npy"), mmap_mode="r")
    y = np.load(os.path.join(data_dir, "train_y.npy"), mmap_mode="r")
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model.train()
    kwargs = {"mesh": mesh}
    if bf16:  # fp32 master weights (the bf16 file upcast above), bf16 compute
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    return x, y, model, opt


def document_end(data_dir: str):
    """The EOS that ends each packed document (None: rows are not packed text)."""
    import json

    with open(os.path.join(data_dir, "manifest.json")) as fh:
        text = json.load(fh).get("text") or {}
    return text.get("eos_token_id") if text.get("packing") else None


def positions(ids, eos):
    """Position ids restarting after each EOS (transformers masks packed sequences by them)."""
    import torch

    index = torch.arange(ids.shape[1]).expand_as(ids)
    after = torch.zeros_like(ids, dtype=torch.bool)
    after[:, 1:] = ids[:, :-1] == eos
    return index - torch.where(after, index, 0).cummax(dim=1).values


def step(model, opt, x, y, micro_rows: list, eos=None) -> float:
    """One optimizer step over this rank's micro-batches (`micro_rows`)."""
    import numpy as np
    import torch

    params = list(model.parameters())
    accum = len(micro_rows)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for k, rows in enumerate(micro_rows):
        model.set_requires_all_reduce(k == accum - 1)  # HSDP: replicas meet on the last one
        ids = torch.from_numpy(np.ascontiguousarray(x[rows])).long()
        labels = torch.from_numpy(np.ascontiguousarray(y[rows])).long()
        pos = None if eos is None else positions(ids, eos)
        loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        (loss / accum).backward()
        loss_sum += loss.detach().double()
    model.set_requires_all_reduce(True)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss_sum) / accum


def train(model_dir: str, data_dir: str, replicate: int, shard: int, micro: int, accum: int,
          steps: int, lr: float, seed: int, bf16: bool = False) -> list[float]:
    import torch.distributed as dist

    from .bare_loop import timed_loop

    x, y, model, opt = setup(model_dir, data_dir, replicate, shard, lr, bf16)
    rank, world = dist.get_rank(), dist.get_world_size()
    eos = document_end(data_dir)
    return timed_loop(len(x), micro * accum * world, steps, seed, lambda perm, pos: step(
        model, opt, x, y, [perm[pos + (k * world + rank) * micro:
                                pos + (k * world + rank + 1) * micro] for k in range(accum)],
        eos))
