"""A Hugging Face LM's weights on a sharded (or replicated) model with empty storage.

Each rank reads only its own shards of the pretrained weights, straight from the
safetensors files (torch's HuggingFaceStorageReader through DCP: slices of each tensor, cast
as they are read), so no rank ever holds a whole copy. What the files do not hold is made
here: non-persistent buffers (rotary frequencies) by the model's own init, LoRA adapters
from a generator seeded by the run seed and the parameter's name (A uniform in
+-1/sqrt(fan_in), as peft's default; B zero), so they are the same at every world size.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from enn_cluster.config.hf_name import weights_dir
from enn_cluster.errors import UserError
from enn_cluster.models.causal_lm import CausalLM
from enn_cluster.models.weight_names import folder_targets, is_adapter
from enn_cluster.storage.base_weights import identity
from enn_cluster.storage.dcp_io import SafeLoadPlanner
from enn_cluster.worker.meta_init import copy_local, name_generator

log = logging.getLogger("enn_cluster.worker.lm_weights")


@torch.no_grad()
def initialize(model: CausalLM, weights: Path, seed: int, group) -> None:
    """Fill a model whose tensors have storage but no values (collective over `group`)."""
    init_computed(model, seed)
    load_base(model, weights, group)


@torch.no_grad()
def init_computed(model: CausalLM, seed: int) -> None:
    """What no file holds, computed alike on every rank: the non-persistent buffers
    (transformers' own rule: rotary inv_freq) and the adapters (seeded by name)."""
    base = model.base()
    for module in base.modules():
        if module._non_persistent_buffers_set:
            base._init_weights(module)
    init_adapters(model, seed)


def init_adapters(model: nn.Module, seed: int) -> None:
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        if ".lora_A." in name:
            bound = param.shape[1] ** -0.5
            full = (torch.rand(param.shape, generator=name_generator(seed, name)) * 2 - 1) * bound
        else:
            full = torch.zeros(param.shape)
        copy_local(param, full)


def load_base(model: nn.Module, weights: Path, group) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader

    # the headers again (prepare checked them): the folder may have changed since, and an
    # external launcher makes no client check; a file cut short is one line, not DCP's trace
    targets = folder_targets(model, weights)  # under the folder's names (weight_names)
    try:
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(weights)),
                 planner=SafeLoadPlanner(), process_group=group)
    # DCP wraps every rank's error in a CheckpointException (a BaseException)
    except (Exception, CheckpointException) as exc:
        failures = getattr(exc, "failures", None) or {}
        inner = next(iter(failures.values()), (exc,))[0]
        first = next((line for line in str(inner).splitlines() if line.strip()),
                     type(inner).__name__)
        raise UserError(f"model.name: the weights in {weights} do not fit the model its "
                        f"config.json describes ({first[:200]}); point hf: at the directory "
                        "save_pretrained wrote") from None
    log.info("base weights: %d tensors read from %s (this rank's shards)", len(targets), weights)


def frozen_base_identity(cfg, model, lanes):
    """The identity of the base weights a LoRA run trains on (rank 0 reads the files, every
    rank gets it); None when every weight trains (the checkpoints hold them all)."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return lanes.broadcast_object(identity(weights_dir(cfg.model.name)) if lanes.rank == 0
                                  else None)
