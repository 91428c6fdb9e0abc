"""A module given to `enn_cluster.train` as an object, shipped as its structure alone.

The caller's module is pickled with every tensor of its state dict replaced by a meta
tensor (shape, dtype and strides, no bytes): its weights travel once, as the run's step-0
checkpoint, so that each rank can build the structure on the meta device, shard it and
load only its own shards (no rank ever holds the whole model). Tensors outside the state
dict (non-persistent buffers, plain attributes) are in no checkpoint: they ship as they are.
"""
from __future__ import annotations

import io
import pickle

import torch
from torch import nn

FACTORY = "enn_cluster.storage.model_structure:from_structure"  # model.name of such a run


class _StructurePickler(pickle.Pickler):
    """Pickles the tensors whose ids are in `weights` as meta tensors; references are
    kept (a weight tied to two modules is one meta tensor). Nothing is copied."""

    def __init__(self, fh, weights: set, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        super().__init__(fh, protocol=protocol)
        self.weights, self.protocol = weights, protocol

    def reducer_override(self, obj):
        if id(obj) not in self.weights:
            return NotImplemented
        meta = torch.empty_like(obj.detach(), device="meta")
        if type(obj) is nn.Parameter:  # (rebuild, (data, requires_grad, hooks[, state]))
            rebuild, args = obj.__reduce_ex__(self.protocol)[:2]
            return rebuild, (meta, *args[1:])
        if type(obj) is torch.Tensor:
            return meta.__reduce_ex__(self.protocol)
        return NotImplemented  # a tensor subclass: shipped whole rather than guessed at


def structure_bytes(model: nn.Module) -> bytes:
    """`model` pickled without the bytes of its state dict (pure; raises what pickle raises)."""
    weights = {id(t) for t in model.state_dict(keep_vars=True).values()
               if isinstance(t, torch.Tensor)}
    buf = io.BytesIO()
    _StructurePickler(buf, weights).dump(model)
    return buf.getvalue()


@torch.no_grad()
def with_storage(model: nn.Module, device) -> nn.Module:
    """Real, uninitialised storage on `device` for every meta tensor of `model` (sharded or
    whole), for a checkpoint to fill; tensors that hold values keep them, on `device`. A
    tensor shared by several modules stays shared (a plain module's to_empty unties it)."""
    slots = [(m, name, t) for m in model.modules()
             for name, t in (*m.named_parameters(recurse=False, remove_duplicate=False),
                             *m.named_buffers(recurse=False, remove_duplicate=False))]
    model.to_empty(device=device)
    first: dict = {}
    for module, name, old in slots:
        new = first.setdefault(id(old), getattr(module, name))
        if getattr(module, name) is not new:
            setattr(module, name, new)
        elif not old.is_meta:
            new.copy_(old)
    return model


def from_structure(n_features: int, n_outputs: int, path: str) -> nn.Module:
    """The factory the workers call for such a model. Under `torch.device("meta")` (training
    builds there, then shards) its weights stay meta; anywhere else (prediction,
    `Run.load_model`, doctor) they get storage on the default device, for a checkpoint to
    fill. A pickle written before structures were shipped holds its weights: returned as is."""
    with open(path, "rb") as fh:
        model = pickle.load(fh)
    device = torch.get_default_device()
    if device.type != "meta" and any(t.is_meta for t in model.state_dict().values()
                                     if isinstance(t, torch.Tensor)):
        with_storage(model, device)
    return model
