"""Build the run's model from config + staged data shape and shard it on the mesh.

Training and prediction both come through here, so a checkpoint always meets the same
module structure, whatever the world size.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from enn_cluster.config.run_config import MeshPlan, RunConfig, plan_mesh
from enn_cluster.models import BUILTIN_MODELS, build_run_model, kind_of, output_size
from enn_cluster.storage.model_structure import FACTORY as STRUCTURE_FACTORY
from enn_cluster.worker.environment import WorkerEnv
from enn_cluster.worker.lanes import Lanes
from enn_cluster.worker.parallel import build_mesh, set_master_dtypes, wrap_model

log = logging.getLogger("enn_cluster.worker.model_setup")


@dataclass
class ShardedModel:
    model: nn.Module
    plan: MeshPlan
    mesh: object
    use_bf16: bool
    weights_from_checkpoint: bool = False  # a module given to the API: step-0 holds them
    float8_scales: bool = False  # parallel.float8_scales after every optimizer step

    @property
    def dp_size(self) -> int:
        return self.plan.world  # every rank reads its own data under FSDP, HSDP and DDP


def use_bf16(cfg: RunConfig, device: torch.device) -> bool:
    return cfg.training.bf16 == "true" or (cfg.training.bf16 == "auto" and device.type == "cuda")


def build_sharded_model(cfg: RunConfig, manifest: dict, env: WorkerEnv, lanes: Lanes,
                        input_shape: tuple) -> ShardedModel:
    """Built on the meta device, sharded, then only the local shards materialised (see
    meta_init); a model that must be built whole (a user factory without init_weights)
    is built with the same seed on every rank, so the full weights agree before sharding.
    A module given to the API gets storage for its shards only: the trainer's resume fills
    them from step 0 (the seed is set as for a whole build, for dropout's sake)."""
    from enn_cluster.worker import meta_init

    shape, n_out = tuple(input_shape), output_size(cfg, manifest)
    weights = kind_of(cfg).weights_dir(cfg)  # base weights read from files (a causal LM's)
    model = meta_built(cfg, shape, n_out)
    from_checkpoint = cfg.model.name == STRUCTURE_FACTORY
    how = meta_init.FULL_INIT if model is None else meta_init.META_FILES \
        if weights is not None else \
        meta_init.init_plan(model, from_checkpoint, builtin=cfg.model.name in BUILTIN_MODELS)
    if how in (meta_init.FULL_INIT, meta_init.META_CHECKPOINT, meta_init.META_FILES):
        torch.manual_seed(cfg.training.seed)
    if how == meta_init.FULL_INIT:
        check_whole_build(cfg.model.name, model, lanes.device)  # sized from the meta build
        model = build_run_model(cfg, shape, n_out)
        check_whole_build(cfg.model.name, model, lanes.device)  # no meta build: the real one
        model = model.to(lanes.device)
    kind_of(cfg).bind_data(model, manifest)
    plan = plan_mesh(cfg.parallel, env.world_size, env.local_world_size)
    mesh = build_mesh(plan, lanes.device)
    bf16 = use_bf16(cfg, lanes.device)
    set_master_dtypes(model, bf16)  # fp32 master weights whatever the files hold
    tmpls = meta_init.templates(model) if how == meta_init.META_BUILTIN else {}
    inner = model
    if how != meta_init.FULL_INIT and not plan.sharded:  # DDP replicates whole weights
        _materialize(cfg, inner, how, tmpls, lanes, weights)
    model = wrap_model(model, plan, mesh, lanes.device, bf16, cfg.parallel.reduce_dtype,
                       cfg.parallel.activation_checkpointing, cfg.training.compile,
                       cfg.training.float8)
    if how != meta_init.FULL_INIT and plan.sharded:  # FSDP/HSDP: local shards only
        _materialize(cfg, inner, how, tmpls, lanes, weights)
    return ShardedModel(model, plan, mesh, bf16, from_checkpoint,
                        float8_scales=cfg.training.float8 and plan.sharded)


def _materialize(cfg: RunConfig, model, how: str, tmpls: dict, lanes: Lanes, weights) -> None:
    from enn_cluster.worker import lm_weights, meta_init

    meta_init.materialize(model, how, tmpls, cfg.training.seed, lanes.device)
    if how == meta_init.META_FILES:
        lm_weights.initialize(model, weights, cfg.training.seed, lanes.control)


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """The device's total memory (None on CPU: host memory is not checked here). Tests
    name a figure by fault injection, as a small GPU would report it."""
    from enn_cluster.worker.fault_injection import device_memory

    if device_memory() is not None:
        return device_memory()
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def whole_build_refusal(name: str, param_bytes: int, device_bytes: Optional[int]) -> str:
    """Why a model built whole on every rank cannot fit the device ("" when it can; pure)."""
    if device_bytes is None or param_bytes <= device_bytes:
        return ""
    return (f"model.name: {name} has no init_weights(), so every rank builds it whole "
            f"({_size(param_bytes)} of parameters) on a device of "
            f"{_size(device_bytes)}; give the model an init_weights() method (or "
            "reset_parameters() on its layers) so that it is built on the meta device and "
            "each rank initialises only its shard, or use GPUs with more memory")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_whole_build(name: str, model: Optional[nn.Module], device: torch.device) -> None:
    """Refuse (exit 2) a whole build larger than the device, before it is moved there."""
    if model is None:
        return
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    why = whole_build_refusal(name, size, device_memory_bytes(device))
    if why:
        from enn_cluster.errors import UserError
        raise UserError(why)


def meta_built(cfg: RunConfig, shape: tuple, n_out: int):
    """The model built on the meta device, or None when its factory refuses that device (a
    factory calling transformers' from_pretrained does): such a model is built whole."""
    from enn_cluster.errors import UserError

    try:
        with torch.device("meta"):
            return build_run_model(cfg, shape, n_out)
    except UserError:
        raise
    except Exception as exc:  # the factory's own error; a whole build will meet it again
        log.info("model.name: %s cannot be built on the meta device (%s: %s); built whole",
                 cfg.model.name, type(exc).__name__, str(exc).splitlines()[0][:200])
        return None


def gradient_sync(sm: ShardedModel, sync: bool):
    """Skip gradient communication on all but the last micro-batch of an accumulation.
    HSDP skips only the inter-node all-reduce: the intra-node reduce-scatter still runs, so
    a rank keeps a shard of fp32 gradients instead of the whole unsharded set. A synced
    micro-batch calls nothing: each unsynced one turns the switch back on when it ends, and
    FSDP2's setter walks every module (twice per step, where there is no accumulation)."""
    if sync:
        return nullcontext()
    if not sm.plan.sharded:
        return sm.model.no_sync()
    if sm.plan.strategy == "hsdp":
        return _communicate(sm.model.set_requires_all_reduce)
    return _communicate(sm.model.set_requires_gradient_sync)


@contextmanager
def _communicate(setter):
    """FSDP2's switch (`setter`) off for this micro-batch, on again after."""
    setter(False)
    try:
        yield
    finally:
        setter(True)


def autocast(sm: ShardedModel, device: torch.device):
    """FSDP's policy casts parameters itself; DDP needs autocast for bf16."""
    if sm.use_bf16 and not sm.plan.sharded:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
