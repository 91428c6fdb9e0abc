"""Async saves stage only the bytes a rank writes, into buffers allocated at start. On a
real 2x2 HSDP CPU mesh (4 gloo processes), where each shard is held by two replicas:
- the ranks together stage exactly one copy of the checkpoint (DCP's deduplicated plan),
  each rank less than its whole shard (what the old stager copied);
- `reserve` at start allocates every buffer: the first and second saves allocate nothing
  (counted by the stager's own state);
- the saved step loads back into a fresh model and optimizer equal to what was saved."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from helpers import ROOT, full_state

WORLD = 4


def _build(seed: int):
    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.worker.parallel import build_mesh, wrap_model

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    plan = MeshPlan("hsdp", 2, 2)
    model = wrap_model(model, plan, build_mesh(plan, torch.device("cpu")), torch.device("cpu"),
                       False)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)


def _step(model, optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    loss = model(torch.randn(4, 6, generator=g)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _local_bytes(state) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _local_bytes(value)
        elif isinstance(value, torch.Tensor):
            t = value.to_local() if isinstance(value, DTensor) else value
            total += t.numel() * t.element_size()
    return total


def _rank(rank: int, init: str, root: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from enn_cluster.worker import checkpoint as ckpt
    from enn_cluster.worker.checkpoint_async import new_stager, reserve, save_async
    from enn_cluster.worker.lanes import Lanes

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    lanes = Lanes(control=dist.new_group(backend="gloo"), checkpoint=dist.new_group(backend="gloo"),
                  device=torch.device("cpu"), rank=rank, world_size=WORLD)
    model, optimizer = _build(5)
    stager = new_stager()
    out = {"reserved": reserve(stager, model, optimizer, lanes)}
    out["after_reserve"] = stager.allocations
    assert not optimizer.state  # reserving made no optimizer step
    saves = []
    for step in (1, 2):
        _step(model, optimizer, rank)
        save_async(root, step, model, optimizer, {"step": step}, lanes, stager).result()
        saves.append((stager.allocations, stager.staged_bytes))
    out["saves"] = saves
    out["shard_bytes"] = _local_bytes(ckpt.state_of(model, optimizer))
    saved = full_state(ckpt.state_of(model, optimizer))
    fresh, fresh_optimizer = _build(6)
    _step(fresh, fresh_optimizer, rank)  # other values everywhere before the load
    ckpt.load(root, 2, fresh, fresh_optimizer, lanes)
    loaded = full_state(ckpt.state_of(fresh, fresh_optimizer))
    out["equal"] = saved.keys() == loaded.keys() and all(
        torch.equal(saved[k], loaded[k]) for k in saved)
    dist.destroy_process_group()
    torch.save(out, f"{root}/out.{rank}")
    os._exit(0)  # as the worker does (see test_hsdp_accumulation)


def _checkpoint_tensor_bytes(path) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from enn_cluster.storage.dcp_metadata import load_metadata

    meta = load_metadata(path / ".metadata")
    return sum(m.size.numel() * m.properties.dtype.itemsize
               for m in meta.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))


@pytest.mark.slow
def test_hsdp_async_save_stages_one_copy_into_buffers_reserved_at_start(tmp_path):
    from enn_cluster.storage import commits as store

    mp.spawn(_rank, args=(f"file://{tmp_path / 'rdzv'}", str(tmp_path)), nprocs=WORLD, join=True)
    got = [torch.load(tmp_path / f"out.{r}", weights_only=True) for r in range(WORLD)]
    assert store.committed_steps(tmp_path) == [1, 2]
    one_copy = _checkpoint_tensor_bytes(store.step_dir(tmp_path, 2))
    for save in (0, 1):
        staged = [g["saves"][save][1] for g in got]
        assert sum(staged) == one_copy, (staged, one_copy)
    for g in got:
        assert g["reserved"] > 0 and g["after_reserve"] > 0
        assert [a for a, _ in g["saves"]] == [g["after_reserve"]] * 2, g  # nothing new
        assert 0 < g["saves"][1][1] < g["shard_bytes"], g
        assert g["equal"]
    assert sum(g["shard_bytes"] for g in got) >= 1.9 * one_copy  # replicas hold it twice
