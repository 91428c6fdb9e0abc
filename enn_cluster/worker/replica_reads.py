"""A load that reads each shard from the filesystem once per replica group, not once per
replica.

Under HSDP every node holds the same shards, and a plain DCP load has each holder read them:
N nodes read the checkpoint N times from Lustre. Here the holders of one local tensor (the
ranks that differ only along the mesh's replicate dimension) split the tensors between
them. Each is read by the holder that checksums its file: the writer at an unchanged world
size, and still after a change of node count alone, so that each file is read once, by
the rank that verifies it. Otherwise the holder with the fewest bytes so far reads it. The
reader then broadcasts it over the replicate group: the accelerator fabric on GPUs.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from enn_cluster.storage.commits import owner_rank
from enn_cluster.storage.dcp_io import SafeLoadPlanner


@dataclass(frozen=True)
class Share:
    """A replicated local tensor that rank `src` reads and broadcasts along mesh `dim`."""
    fqn: str
    src: int
    dim: int


def holders(t) -> tuple[Optional[int], list[int]]:
    """(mesh dimension, global ranks holding the same local tensor as this rank) for a
    DTensor replicated along exactly one mesh dimension larger than 1; (None, []) else."""
    if not isinstance(t, DTensor):
        return None, []
    mesh = t.device_mesh
    dims = [i for i, p in enumerate(t.placements) if p.is_replicate() and mesh.size(i) > 1]
    if len(dims) != 1:
        return None, []
    index: list = list(mesh.get_coordinate())
    index[dims[0]] = slice(None)
    return dims[0], mesh.mesh[tuple(index)].reshape(-1).tolist()


def choose_readers(reads: dict[str, list[tuple[Optional[int], int]]],
                   holders_of: dict[str, list[int]], world: int) -> dict[str, int]:
    """{tensor: the rank that reads it}. `reads`: per tensor, (writer rank of the file,
    bytes) of each part to read. A file is checksummed by rank writer % world
    (ShardVerifier): the holder that checksums most of a tensor's bytes reads it; with none,
    the holder with the fewest bytes so far. Pure and deterministic: every holder of a
    tensor computes the same answer from the same metadata."""
    loads: dict = defaultdict(int)
    out = {}
    for fqn in sorted(reads):
        group = tuple(holders_of[fqn])
        verified: dict = defaultdict(int)
        for writer, nbytes in reads[fqn]:
            if writer is not None and writer % world in group:
                verified[writer % world] += nbytes
        reader = min(group, key=lambda r: (-verified[r], loads[group, r], r))
        loads[group, reader] += sum(n for _, n in reads[fqn])
        out[fqn] = reader
    return out


class ReplicaSplitPlanner(SafeLoadPlanner):
    """SafeLoadPlanner that reads only the replicated tensors chosen for this rank; `share`
    (after the load, collective over every replicate group) hands them to the others."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shares: list[Share] = []

    def create_local_plan(self):
        plan = super().create_local_plan()
        reads: dict = {}
        holders_of: dict = {}
        dims: dict = {}
        for item in plan.items:
            fqn = item.dest_index.fqn
            if fqn not in dims:  # once per tensor, not per part read
                dims[fqn], holders_of[fqn] = holders(self.state_dict.get(fqn))
            if dims[fqn] is None:
                continue
            info = self.metadata.storage_data[item.storage_index]
            nbytes = math.prod(item.lengths) * self.state_dict[fqn].element_size()
            reads.setdefault(fqn, []).append((owner_rank(info.relative_path), nbytes))
        readers = choose_readers(reads, holders_of, dist.get_world_size())
        self.shares = [Share(fqn, readers[fqn], dims[fqn]) for fqn in sorted(readers)]
        me = dist.get_rank()
        return dataclasses.replace(
            plan, items=[i for i in plan.items if readers.get(i.dest_index.fqn, me) == me])

    def share(self) -> None:
        """Broadcast every replicated tensor from its reader, all in flight at once."""
        pending = []
        for s in self.shares:
            t = self.state_dict[s.fqn]
            with torch.no_grad():
                local = t.to_local()
            if local.numel() == 0:
                continue
            buf = local if local.is_contiguous() else local.contiguous()
            work = dist.broadcast(buf, src=s.src, group=t.device_mesh.get_group(s.dim),
                                  async_op=True)
            pending.append((work, local, buf))
        for work, local, buf in pending:
            work.wait()
            if buf is not local:
                local.copy_(buf)
