"""Apply a mesh plan to a model: HSDP (2-D mesh), FSDP (1-D) or DDP.

HSDP shards parameters inside a node (fast links) and replicates across nodes, so the
slow inter-node links carry one all-reduce of shards instead of all-gathers of weights.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from enn_cluster.config.run_config import MeshPlan
from enn_cluster.models import model_blocks, shard_units

log = logging.getLogger("enn_cluster.worker.parallel")


def build_mesh(plan: MeshPlan, device: torch.device):
    if plan.strategy == "hsdp":
        return init_device_mesh(device.type, (plan.replicate, plan.shard),
                                mesh_dim_names=("replicate", "shard"))
    if plan.strategy == "fsdp":
        return init_device_mesh(device.type, (plan.shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (plan.replicate,), mesh_dim_names=("replicate",))


def mixed_precision(use_bf16: bool, reduce_dtype: str = "fp32"):
    """bf16 parameters; gradient reductions in fp32 unless parallel.reduce_dtype says bf16
    (half the inter-node bytes, fewer mantissa bits in the sum: see docs/config.md)."""
    if not use_bf16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.bfloat16 if reduce_dtype == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def master_dtype(trainable: bool, use_bf16: bool) -> torch.dtype:
    """The dtype a parameter is kept in (pure): fp32 for every one that trains, whatever the
    weights were saved in (bf16 master weights and Adam moments lose most small updates);
    a frozen one (a LoRA run's base) in the compute dtype, bf16 when computing in bf16:
    half the memory, and the values the mixed-precision cast would make anyway."""
    if trainable or not use_bf16:
        return torch.float32
    return torch.bfloat16


@torch.no_grad()
def set_master_dtypes(model: nn.Module, use_bf16: bool) -> None:
    """Cast each floating parameter to its `master_dtype`, in place (free on the meta
    device). A bf16 config.json (every Llama-3 and Qwen2.5 one) makes transformers'
    from_config build bf16 parameters; a tied weight stays one parameter."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            want = master_dtype(param.requires_grad, use_bf16)
            if param.dtype != want:
                param.data = param.data.to(want)


def float8_emulated(device: torch.device) -> bool:
    """No float8 matmul on this device (CPU, a GPU before compute capability 8.9): torchao
    emulates it (same numerics, slow), so a config can be checked on a laptop."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def float8_linears(model: nn.Module, blocks: list[nn.Module], device: torch.device,
                   sharded: bool) -> int:
    """Swap the blocks' plain nn.Linear layers whose dims are multiples of 16 (what the
    float8 matmul takes) for torchao's Float8Linear: dynamic tensorwise scales and, under
    FSDP2, weights all-gathered in float8 (torchtitan's recipe). Embeddings, the head and
    anything outside the blocks stay in the compute dtype. Returns how many were swapped;
    parameter names do not change."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = {id(m) for block in blocks for m in block.modules()
              if type(m) is nn.Linear and m.in_features % 16 == 0 and m.out_features % 16 == 0}
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=sharded,
                                emulate=float8_emulated(device))
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, _: id(module) in chosen)
    log.info("float8: %d linear layers of the blocks (%s)", len(chosen),
             "emulated: no float8 matmul on this device" if config.emulate else "float8 matmuls")
    return len(chosen)


def float8_scales(model: nn.Module) -> None:
    """After each optimizer step: every float8 weight's scale in one all-reduce, instead of
    one per weight inside the next forward's all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def checkpointed_blocks(blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """The blocks whose activations are recomputed in the backward pass (pure): none, every
    other one (`every_other`: about half the activation memory for a sixth more compute),
    or all (`full`; `selective`, whose blocks' parts keep what its op policy saves)."""
    if mode in ("full", "selective"):
        return list(blocks)
    if mode == "every_other":
        return list(blocks[::2])
    return []


@functools.cache
def _saved_ops() -> tuple[frozenset, frozenset]:
    """(matmuls, other ops) whose outputs `selective` keeps: torchtitan's list (attention,
    float8's scaled matmul and amax, FSDP's reduce-scatter), the CPU attention included."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_mm", "max")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    if hasattr(torch.ops, "_c10d_functional"):
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default}), frozenset(ops)


def selective_contexts():
    """A checkpoint's context_fn for `selective` (torch's selective activation
    checkpointing): keep the attention's output and every other matmul's, recompute the
    rest (norms, activations, rotary, elementwise). The matmuls are counted per call, in
    the forward and again in the recompute, so both keep the same ones."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls, kept = _saved_ops()
    seen = {False: 0, True: 0}  # matmuls met in the forward, in the recompute

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            seen[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if seen[ctx.is_recompute] % 2 \
                else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def prepare_blocks(blocks: list[nn.Module], checkpointing: str = "none",
                   compile_blocks: bool = False) -> None:
    """Activation checkpointing and compilation applied to each block in place, before
    sharding (torchtitan's order): the composable forms keep every parameter's name, so
    checkpoints and the weights' names are the same with them on or off."""
    if checkpointing != "none":
        from torch.distributed._composable import checkpoint

        for block in checkpointed_blocks(blocks, checkpointing):
            if checkpointing != "selective":
                checkpoint(block)
                continue
            # per op, each part of the block (attention, MLP, norms) on its own: FSDP's
            # hooks on the block then run outside every checkpointed region, which
            # selective checkpointing needs (its recompute must replay the forward's ops)
            for part in block.children():
                checkpoint_forward(part, selective_contexts)
    if compile_blocks:
        for block in blocks:
            block.compile()


def checkpoint_forward(module: nn.Module, context_fn) -> None:
    """`module`'s forward run under torch.utils.checkpoint with `context_fn`, its parameters'
    names unchanged. The function form, not the composable hooks: torch.compile traces it
    as one region and applies a selective policy to its graph, where under the hooks the
    compiled forward stored nothing that the eager recompute then looked for ("aten.mm
    encountered during backward, but not found in storage", seen on an H200)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = checkpointed


def wrap_model(model: nn.Module, plan: MeshPlan, mesh, device: torch.device,
               use_bf16: bool, reduce_dtype: str = "fp32", checkpointing: str = "none",
               compile_blocks: bool = False, float8: bool = False) -> nn.Module:
    """Shard unit by unit (models.shard_units: a causal LM's embedding, then the blocks),
    then the root, so each unit's all-gather overlaps compute. The last unit stays gathered
    after its forward: the backward starts with it (torchtitan's choice, one all-gather
    less a step). `float8` swaps the blocks' linears first (float8_linears)."""
    if float8:
        float8_linears(model, model_blocks(model), device, sharded=plan.sharded)
    prepare_blocks(model_blocks(model), checkpointing, compile_blocks)
    if not plan.sharded:
        model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh}
    policy = mixed_precision(use_bf16, reduce_dtype)
    if policy is not None:
        kwargs["mp_policy"] = policy
    units = shard_units(model)
    for i, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=i < len(units) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model
