"""Prediction's weights: one replica per rank, in the inference dtype from the start.

- Every rank builds the model on the meta device, casts it there (free) and gives it empty
  tensors on its device: no random init, no fp32 copy of the whole model.
- The first rank of each node reads the checkpoint (the readers together, through DCP,
  which reshards any saved world size) straight into tensors of the inference dtype, each
  cast as it is read, and hands them to its node's other ranks one tensor at a time over a
  node-local gloo group: in bf16, half the bytes of fp32.
- Rank 0 alone, when predicting in bf16, reads fp32: it runs the first batch of chunk 0
  through those weights (the precision check's fp32 re-run), then casts them into its
  replica tensor by tensor, freeing each fp32 tensor as it goes. That read is the only
  fp32 copy of the whole model anywhere; it is skipped once chunk 0 is committed.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from enn_cluster.models import build_run_model, output_size
from enn_cluster.storage import commits as store
from enn_cluster.storage.model_structure import with_storage
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.staging import read_manifest
from enn_cluster.worker import checkpoint as ckpt
from enn_cluster.worker.model_setup import meta_built

log = logging.getLogger("enn_cluster.worker.predict")


def node_groups(nodes: list) -> tuple[list[int], dict]:
    """From every rank's node (index = rank): the first rank of each node (the one that reads
    the checkpoint) and each node's ranks, leader first. Pure."""
    members: dict = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    return sorted(r[0] for r in members.values()), members


def empty_replica(cfg, manifest: dict, input_shape: tuple, dtype: torch.dtype,
                  device: torch.device) -> nn.Module:
    """The model in `dtype` on `device`, in eval mode, its tensors not yet filled (the
    checkpoint fills every one of its state dict). Built on the meta device; a model that
    comes out real anyway (it loads its own weights), or whose non-persistent buffers only
    its constructor computes (no `init_weights()` to redo them), is built whole. Tensors
    that hold values on meta (a module shipped as its structure keeps its non-persistent
    buffers) keep them."""
    shape, n_out = tuple(input_shape), output_size(cfg, manifest)
    model = meta_built(cfg, shape, n_out)
    if model is None:  # its factory refuses the meta device: built whole
        return build_run_model(cfg, shape, n_out).to(dtype=dtype).to(device).eval()
    buffers = dict(model.named_buffers())
    lost = sorted(name for name in set(buffers) - set(model.state_dict()) if buffers[name].is_meta)
    own_init = callable(getattr(model, "init_weights", None))
    real = not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if real or (lost and not own_init):
        log.info("prediction model built whole, then cast to %s: %s", dtype,
                 f"buffers {lost} are not in its state dict" if lost
                 else "its factory made real tensors")
        if not real:
            model = build_run_model(cfg, shape, n_out)
        return model.to(dtype=dtype).to(device).eval()
    model.to(dtype=dtype)  # on meta: floating tensors only, no memory
    with_storage(model, device)
    if lost:  # its own init recomputes them; the weights it draws are overwritten
        with torch.no_grad():
            model.init_weights()
    return model.eval()


def _read_targets(state: dict, fp32: bool) -> dict:
    """Where this reader's DCP load writes: the replica itself (DCP casts each tensor as it
    reads it), or for rank 0's precision check fp32 tensors on the host: one per tensor of
    the replica, so that tied weights (two names, one tensor) stay one tensor there too
    (functional_call refuses two values for a tied pair)."""
    if not fp32:
        return dict(state)
    shared: dict = {}
    return {key: shared.setdefault(
        (value.data_ptr(), value.shape, value.stride(), value.dtype),
        torch.empty(value.shape, dtype=torch.float32 if value.is_floating_point() else value.dtype))
        for key, value in state.items()}


def _fp32_forward(model: nn.Module, weights: dict, rows: np.ndarray) -> torch.Tensor:
    """The replica's forward on `rows` with the fp32 host weights swapped in (no second
    model): the precision check's reference."""
    from torch.func import functional_call

    extra = {name: b.detach().to("cpu", torch.float32 if b.is_floating_point() else b.dtype)
             for name, b in model.named_buffers() if name not in weights}
    from enn_cluster.models import input_dtype
    from enn_cluster.worker.loader import host_rows

    with torch.inference_mode():
        inputs = torch.from_numpy(host_rows(rows, input_dtype(model)))
        return functional_call(model, {**weights, **extra}, (inputs,)).float()


@torch.no_grad()
def fill(state: dict, read: Optional[dict], src: int, group) -> None:
    """Fill the replica one tensor at a time: a reader casts rank 0's fp32 tensors into it
    (each freed as it goes), the node's other ranks receive every tensor from `src`
    (through one host tensor at a time where the replica is on a GPU)."""
    for key in sorted(state):
        dst = state[key]
        if read is not None:
            got = read.pop(key)
            if got is not dst:  # cast on the host, then copy: no fp32 on the device
                dst.copy_(got if dst.device == got.device else got.to(dst.dtype))
            del got
            host = dst if group is None or dst.device.type == "cpu" else dst.cpu()
        else:
            host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=dst.dtype)
        if group is not None:
            dist.broadcast(host, src=src, group=group)
        if host is not dst and read is None:
            dst.copy_(host)


@contextmanager
def node_readers(lanes, node: int, cfg):
    """(the rank that reads for this node, the readers' group, this node's group or None):
    the first rank of each node reads the shared filesystem (the readers together, through
    DCP) and hands each tensor to its node's other ranks (collective; the groups are
    destroyed on exit). With one rank per node every rank reads and no node group exists."""
    leaders, members = node_groups(lanes.gather_objects(node))
    src = members[node][0]
    if len(leaders) == lanes.world_size:
        yield src, lanes.control, None
        return
    wait = timedelta(seconds=cfg.checkpoint.barrier_timeout_s or cfg.parallel.timeout_s)
    readers = dist.new_group(leaders, backend="gloo", timeout=wait)
    groups = {n: dist.new_group(ranks, backend="gloo", timeout=wait)
              for n, ranks in sorted(members.items())}
    try:
        yield src, readers, groups[node]
    finally:
        for group in [readers, *groups.values()]:
            dist.destroy_process_group(group)


def load_replica(run: RunDir, cfg, step: int, input_shape: tuple, lanes, node: int,
                 dtype: torch.dtype, check_rows: Optional[np.ndarray] = None):
    """(this rank's replica with the weights of step-N, the fp32 output on `check_rows`
    or None). `check_rows` is given on rank 0 only (the first batch of chunk 0 in bf16).
    Read from the shared filesystem once per node, so that eight ranks on a node do not
    each pull the whole checkpoint through Lustre."""
    model = empty_replica(cfg, read_manifest(run.data_dir), input_shape, dtype, lanes.device)
    state = model.state_dict()
    path = store.step_dir(run.checkpoints, step)
    reference = None
    with node_readers(lanes, node, cfg) as (src, readers, group):
        read = _read_targets(state, fp32=check_rows is not None) if lanes.rank == src else None
        if read is not None:
            ckpt.safe_load({"model": read}, path, process_group=readers)
            if check_rows is not None:
                reference = _fp32_forward(model, read, check_rows)
        fill(state, read, src, group)
    log.info("weights of step-%d: %s (%s%s)", step, "read from the checkpoint for this node"
             if lanes.rank == src else f"received from rank {src} on this node",
             "read in float32 for the precision check, " if reference is not None else "",
             str(dtype).replace("torch.", ""))
    return model, reference
