"""A module given to `enn_cluster.train` as an object, shipped as its structure alone.

The caller's module is pickled with every tensor of its state dict replaced by a meta
tensor (shape, dtype and strides, no bytes): its weights travel once, as the run's step-0
checkpoint, so that each rank can build the structure on the meta device, shard it and
load only its own shards (no rank ever holds the whole model). Tensors outside the state
dict (non-persistent buffers, plain attributes) are in no checkpoint: they ship as they are.

`model.pkl` lies in the run directory, which a job (and often a group) can write: it is
read back through an allow-list (`StructureUnpickler`: torch's tensor and parameter
rebuilders, dtypes, builtin containers, and `nn.Module` subclasses importable by name
outside the standard library), after its size and checksum are checked against
`model.pkl.commit.json`, written with it. Any other global is refused by name, before the
module holding it is imported.
"""
from __future__ import annotations

import builtins
import importlib
import io
import json
import pickle
import sys
from pathlib import Path

import torch
from torch import nn

from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import bytes_checksum
from enn_cluster.storage.dcp_metadata import torch_value
from enn_cluster.storage.rundir import atomic_write_bytes, atomic_write_text
from enn_cluster.storage.run_files import read_run_bytes, read_run_text

FACTORY = "enn_cluster.storage.model_structure:from_structure"  # model.name of such a run
RECORD_SUFFIX = ".commit.json"  # model.pkl -> model.pkl.commit.json
_PICKLE_LIMIT = 1 << 36  # a pickle written before structures were shipped holds weights
_REBUILDERS = {"_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
               "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage",
               "_rebuild_device_tensor_from_cpu_tensor"}
_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range"}


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


def _storage_from_bytes(data: bytes):
    """torch.storage._load_from_bytes (how plain pickle ships a tensor's bytes) without
    its nested unrestricted torch.load: torch's own weights-only loader."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _module_class(module: str, name: str):
    """An nn.Module subclass named by `module` and qualified `name`, or None. The standard
    library is never imported from here (importing a module runs its code)."""
    if module.partition(".")[0] in sys.stdlib_module_names or module == "__main__":
        return None
    try:
        found = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) and issubclass(found, nn.Module) else None


class _Refused(pickle.UnpicklingError):
    """A global off the allow-list (the message names it)."""


class StructureUnpickler(pickle.Unpickler):
    """What a pickled module holds, and nothing else: see the module docstring."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if module == "torch._utils" and name in _REBUILDERS:
            return getattr(importlib.import_module(module), name)
        if (module, name) in {("collections", "OrderedDict"), ("torch", "Size"),
                              ("torch", "device")}:
            return getattr(importlib.import_module(module), name)
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if module == "torch" and torch_value(name) is not None:
            return torch_value(name)
        cls = _module_class(module, name)
        if cls is not None:
            return cls
        raise _Refused(f"refers to {module}.{name}, which is neither a torch tensor type "
                       "nor an nn.Module class")


def record_path(path) -> Path:
    return Path(str(path) + RECORD_SUFFIX)


def write_structure(path, data: bytes) -> None:
    """`data` at `path` with its commit record beside it (size and checksum)."""
    path = Path(path)
    atomic_write_bytes(path, data)
    record = {"files": {path.name: {"size": len(data), "checksum": bytes_checksum(data)}}}
    atomic_write_text(record_path(path), json.dumps(record, indent=1, sort_keys=True))


def _recorded(path: Path) -> dict:
    """The size and checksum recorded for `path` (UserError when unusable)."""
    where = record_path(path)
    fix = ("re-create the run with enn_cluster.train, or, if you made this file yourself "
           "and trust it, record it with enn_cluster.storage.model_structure."
           "write_structure(path, data)")
    try:
        record = json.loads(read_run_text(where))
        info = record["files"][path.name]
        size, checksum = info["size"], info["checksum"]
    except FileNotFoundError:
        raise UserError(f"model.kwargs.path: {path} has no commit record ({where.name}); "
                        f"{fix}") from None
    except (ValueError, TypeError, KeyError):
        raise UserError(f"model.kwargs.path: {where} is not a commit record of "
                        f"{path.name}; {fix}") from None
    return {"size": size, "checksum": checksum}


def read_structure(path) -> nn.Module:
    """The module pickled at `path`, once its bytes match their record, through the
    allow-list. UserError (one line, naming the refused global) for anything else."""
    path = Path(path)
    info = _recorded(path)
    try:
        data = read_run_bytes(path, _PICKLE_LIMIT, "model.kwargs.path")
    except FileNotFoundError:
        raise UserError(f"model.kwargs.path: {path} does not exist; restore the run's "
                        "model.pkl") from None
    try:
        checksum = bytes_checksum(data, like=str(info["checksum"]))
    except ValueError as exc:
        raise UserError(f"model.kwargs.path: {record_path(path)}: {exc}") from None
    if len(data) != info["size"] or checksum != info["checksum"]:
        raise UserError(f"model.kwargs.path: {path} does not match its commit record "
                        f"(size {len(data)}, recorded {info['size']}); it was changed "
                        "after the run was made: restore it or re-create the run")
    try:
        model = StructureUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:  # a global off the allow-list, named
        raise UserError(f"model.kwargs.path: {path} {str(exc)[:300]}; refusing to load "
                        "it") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a hostile pickle is one answer
        why = (str(exc).splitlines() or [""])[0][:200]
        raise UserError(f"model.kwargs.path: {path} does not unpickle "
                        f"({type(exc).__name__}: {why}); refusing to load it") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model.kwargs.path: {path} holds a {type(model).__name__}, not an "
                        "nn.Module")
    return model


def from_structure(n_features: int, n_outputs: int, path: str) -> nn.Module:
    """The factory the workers call for such a model. Under `torch.device("meta")` (training
    builds there, then shards) its weights stay meta; anywhere else (prediction,
    `Run.load_model`, doctor) they get storage on the default device, for a checkpoint to
    fill. A pickle written before structures were shipped holds its weights: returned as is."""
    model = read_structure(path)
    device = torch.get_default_device()
    if device.type != "meta" and any(t.is_meta for t in model.state_dict().values()
                                     if isinstance(t, torch.Tensor)):
        with_storage(model, device)
    return model
