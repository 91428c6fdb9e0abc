"""A resume reads each shard from the filesystem once per replica group (replica_reads). On
a real 2x2 HSDP CPU mesh (4 gloo processes), each shard held by two replicas:
- a resume (verified while loading) reads exactly the bytes of the step's shard files, where
  every replica reading its own shards would read them twice, and restores what was saved
  on every rank (the replica that did not read a tensor got it by broadcast);
- loaded into another mesh (4 replicas of whole tensors; 4 shards, no replica), the values
  are the saved ones and a replica group still reads less than two copies;
- the reader choice is pure: the holder that checksums a file reads it, else the least
  loaded holder, the same answer on every holder."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from helpers import ROOT, full_state

WORLD = 4


def _build(seed: int, replicate: int, shard: int):
    from enn_cluster.config.run_config import MeshPlan
    from enn_cluster.worker.parallel import build_mesh, wrap_model

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    plan = MeshPlan("hsdp", replicate, shard)
    model = wrap_model(model, plan, build_mesh(plan, torch.device("cpu")), torch.device("cpu"),
                       False)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model, optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 64, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rank(rank: int, init: str, root: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from enn_cluster.worker import checkpoint as ckpt
    from enn_cluster.worker.lanes import Lanes

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    lanes = Lanes(control=dist.new_group(backend="gloo"), checkpoint=None,
                  device=torch.device("cpu"), rank=rank, world_size=WORLD)
    model, optimizer = _build(5, 2, 2)
    _step(model, optimizer, rank)
    ckpt.save(root, 1, model, optimizer, {"step": 1}, lanes)
    saved = full_state(ckpt.state_of(model, optimizer))
    out = {}
    for name, shape in (("resume", (2, 2)), ("whole", (4, 1)), ("sharded", (1, 4))):
        fresh, fresh_optimizer = _build(6, *shape)
        _step(fresh, fresh_optimizer, rank)  # other values everywhere before the load
        report: dict = {}
        found = ckpt.resume(root, fresh, fresh_optimizer, lanes, report=report)
        loaded = full_state(ckpt.state_of(fresh, fresh_optimizer))
        out[name] = {"step": found and found[0], "report": report,
                     "equal": saved.keys() == loaded.keys() and all(
                         torch.equal(saved[k], loaded[k]) for k in saved)}
    dist.destroy_process_group()
    torch.save(out, f"{root}/out.{rank}")
    os._exit(0)  # as the worker does (see test_hsdp_accumulation)


def _unsharded_entry_bytes(step_dir) -> int:
    """Stored bytes of the entries held whole by every rank: one chunk each (the sharded
    tensors here have two, one per shard)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from enn_cluster.storage.dcp_metadata import load_metadata

    meta = load_metadata(step_dir / ".metadata")
    whole = {fqn for fqn, m in meta.state_dict_metadata.items()
             if not isinstance(m, TensorStorageMetadata) or len(m.chunks) == 1}
    return sum(info.length for index, info in meta.storage_data.items() if index.fqn in whole)


@pytest.mark.slow
def test_a_resume_reads_one_copy_and_every_replica_gets_it(tmp_path):
    mp.spawn(_rank, args=(f"file://{tmp_path / 'rdzv'}", str(tmp_path)), nprocs=WORLD, join=True)
    got = [torch.load(tmp_path / f"out.{r}", weights_only=True) for r in range(WORLD)]
    for g in got:
        for name in ("resume", "whole", "sharded"):
            assert g[name]["step"] == 1 and g[name]["equal"], (name, g[name])
    report = got[0]["resume"]["report"]
    assert report["shard_bytes"] > 200_000, report  # the tensors, not the headers, decide
    # each file read once, whole, by the rank that checksums it; only the entries no mesh
    # replicates (AdamW's step counts, param_groups: about a kB each) are read by every
    # rank (every replica reading its own shards: 2 x shard_bytes)
    everyone = _unsharded_entry_bytes(tmp_path / "step-1")
    assert 0 < everyone < 0.1 * report["shard_bytes"]
    assert report["shard_bytes"] <= report["bytes_read"] \
        <= report["shard_bytes"] + WORLD * everyone, report
    # another mesh: the whole tensors come from two files each; still under two copies
    # (every replica reading for itself: four)
    whole = got[0]["whole"]["report"]
    assert whole["bytes_read"] < 2 * whole["shard_bytes"], whole
    assert all(g[n]["report"] == got[0][n]["report"] for g in got for n in g)


def test_the_holder_that_checksums_a_file_reads_it():
    from enn_cluster.worker.replica_reads import choose_readers

    # world 4, mesh [[0, 1], [2, 3]]: ranks 0 and 2 hold shard 0, 1 and 3 shard 1
    holders = {"a": [0, 2], "b": [0, 2], "c": [1, 3]}
    reads = {"a": [(2, 100)], "b": [(0, 100)], "c": [(3, 40)]}
    assert choose_readers(reads, holders, 4) == {"a": 2, "b": 0, "c": 3}
    # 3 nodes of 2 shrunk to 2 (world 6 -> 4): old rank 4's file (shard 0) is checksummed
    # by rank 4 % 4 = 0, a holder of shard 0: still one read per file
    assert choose_readers({"a": [(4, 10)]}, {"a": [0, 2]}, 4) == {"a": 0}


def test_with_no_checksumming_holder_the_least_loaded_reads():
    from enn_cluster.worker.replica_reads import choose_readers

    holders = {name: [0, 1] for name in "abcd"}
    reads = {"a": [(None, 300)], "b": [(None, 100)], "c": [(None, 100)], "d": [(None, 50)]}
    # a -> 0 (tie: lowest rank), b -> 1, c -> 1 (100 < 300), d -> 1 (200 < 300)
    assert choose_readers(reads, holders, 2) == {"a": 0, "b": 1, "c": 1, "d": 1}
    # the most checksummed bytes decide over load
    assert choose_readers({"a": [(0, 10), (1, 90)]}, {"a": [0, 1]}, 2) == {"a": 1}
    # every holder computes the same answer: it depends on the inputs alone
    assert choose_readers(reads, holders, 2) == choose_readers(dict(reversed(reads.items())),
                                                               holders, 2)
