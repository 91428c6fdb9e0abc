"""Build on the meta device, shard, then initialise only the local shards.

No rank ever holds the whole model: each parameter is initialised as a full tensor on
the CPU, one module at a time (at most one layer), by that module's own rule, and only
this rank's slice of it is kept. Every parameter draws from a generator seeded by the
run seed and the parameter's name, so the weights are the same at every world size
and mesh shape (a run started on 2 processes equals one started on 4).

Models built here: the built-ins, any model that has an `init_weights()` method
(torchtitan's convention: it initialises its own, already sharded, parameters), and a
module given to the Python API as an object, whose local shards are left for the run's
step-0 checkpoint to fill (the trainer's resume). A user factory without `init_weights`
is built whole, as before: its `__init__` may hold custom init.
"""
from __future__ import annotations

import copy
import zlib
from typing import Callable, Optional

import torch
from torch import nn

from enn_cluster.storage.model_structure import with_storage

FULL_INIT = "full"  # build_plan values
META_BUILTIN = "meta-builtin"
META_OWN = "meta-init_weights"
META_CHECKPOINT = "meta-checkpoint"  # the weights are in the run's step-0 checkpoint
META_FILES = "meta-files"  # base weights in files of the kind's (an LM's safetensors: lm_weights)


def init_plan(model: nn.Module, from_checkpoint: bool = False, builtin: bool = True) -> str:
    """How to materialise a model built on the meta device (pure). Only a built-in model
    is initialised by our per-module rules: a user factory's `__init__` may set weights
    (a zeroed head, a loaded embedding) or buffers that the rules would silently replace."""
    if not all(p.is_meta for p in model.parameters()):
        return FULL_INIT  # built with real tensors anyway (e.g. unpickled weights)
    if from_checkpoint:
        return META_CHECKPOINT
    if callable(getattr(model, "init_weights", None)):
        return META_OWN
    if builtin and all(_rule_for(name, module) is not None for name, module in _owners(model)):
        return META_BUILTIN
    return FULL_INIT


def _owners(model: nn.Module):
    """(qualified name, module) for every module that owns parameters directly."""
    return [(name, m) for name, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False))]


def name_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _rule_for(name: str, module: nn.Module) -> Optional[Callable]:
    """A function (template module on CPU, generator) -> {param name: full tensor}."""
    if isinstance(module, nn.MultiheadAttention):
        return _mha_rule
    if type(module).__name__ == "NonDynamicallyQuantizableLinear":
        return _mha_out_proj_rule
    if callable(getattr(module, "reset_parameters", None)) and \
            not any(True for c in module.children() for _ in c.parameters()):
        return _reset_rule
    if type(module).__name__ == "FeatureTransformer":
        return _position_rule
    return None


def _position_rule(tmpl: nn.Module, gen: torch.Generator) -> dict:
    """The built-in transformer's learned positions: N(0, 0.02), as at construction."""
    return {"pos": torch.randn(tmpl.pos.shape, generator=gen) * 0.02}


def _reset_rule(tmpl: nn.Module, gen: torch.Generator) -> dict:
    """The module's own reset_parameters (nn.Linear, nn.LayerNorm, ...), on a CPU copy
    under a fork of the global RNG seeded for this module."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        tmpl.reset_parameters()
    return dict(tmpl.named_parameters(recurse=False))


def _mha_out_proj_rule(tmpl: nn.Module, gen: torch.Generator) -> dict:
    """An attention block's output projection: a Linear's weight, the zero bias that
    MultiheadAttention._reset_parameters leaves it."""
    out = _reset_rule(tmpl, gen)
    if "bias" in out:
        out["bias"] = torch.zeros_like(out["bias"])
    return out


def _mha_rule(tmpl: nn.MultiheadAttention, gen: torch.Generator) -> dict:
    """nn.MultiheadAttention._reset_parameters for the tensors the module owns itself."""
    out = {}
    for pname, p in tmpl.named_parameters(recurse=False):
        if pname.endswith("bias") and pname.startswith("in_proj"):
            out[pname] = torch.zeros(p.shape)
        elif pname.startswith("bias_"):
            out[pname] = torch.randn(p.shape, generator=gen) * (2.0 / sum(p.shape[-2:])) ** 0.5
        else:
            fan_out, fan_in = p.shape[0], p.shape[1]
            bound = (6.0 / (fan_in + fan_out)) ** 0.5
            out[pname] = torch.rand(p.shape, generator=gen) * 2 * bound - bound
    return out


def templates(model: nn.Module) -> dict:
    """name -> (rule, meta template) for every parameter-owning module, taken before
    sharding (FSDP swaps module classes). Leaves are copied (meta: no memory); rules
    that read shapes only keep the module itself."""
    out = {}
    for name, module in _owners(model):
        rule = _rule_for(name, module)
        keep = rule in (_mha_rule, _position_rule)
        out[name] = (rule, module if keep else copy.deepcopy(module))
    return out


@torch.no_grad()
def materialize(model: nn.Module, plan: str, tmpls: dict, seed: int,
                device: torch.device) -> None:
    """Give the meta model (sharded, or whole for DDP) real tensors on `device`."""
    with_storage(model, device)  # to_empty alone would untie weights shared by two modules
    if plan in (META_CHECKPOINT, META_FILES):  # storage only: a checkpoint holds the values
        return
    if plan == META_OWN:
        model.init_weights()
        return
    targets = dict(model.named_modules())
    for name in list(tmpls):
        rule, tmpl = tmpls.pop(name)  # one module's full tensors alive at a time
        cpu = tmpl.to_empty(device="cpu") if rule in (_reset_rule, _mha_out_proj_rule) else tmpl
        full = rule(cpu, name_generator(seed, name))
        for pname, value in full.items():
            copy_local(getattr(targets[name], pname), value)
        del tmpl, cpu, full
    for buf_owner, module in targets.items():  # buffers: none in the built-ins; be loud
        if any(True for _ in module.buffers(recurse=False)):
            raise RuntimeError(f"meta init: {buf_owner or 'model'} has buffers; build it whole")


def copy_local(param: torch.Tensor, full: torch.Tensor) -> None:
    """This rank's slice of `full` into `param` (a DTensor shard, or a plain tensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh,
                                  param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.device, param.dtype))
