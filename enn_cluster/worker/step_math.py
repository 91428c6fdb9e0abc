"""The optimizer step's pieces that need no run: the gradient norm and clip, the fused
AdamW that skips a non-finite step on the device, Python's collector at fixed steps, and
the cadence of log reads and periodic checkpoints."""
from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

GC_EVERY_STEPS = 100


@contextmanager
def scheduled_gc():
    """Python's collector at fixed steps only, on every rank alike: a full collection
    walks every object the model and data loader hold, and a rank paused in one stalls
    all the others at the next collective. What exists before training (modules,
    optimizer state) is frozen out of collections; cycles made while training are
    collected every GC_EVERY_STEPS steps."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def replicas(param, world_size: int) -> int:
    """How many ranks hold the same copy of this rank's part of `param`: a DTensor's
    replicated mesh dimensions (HSDP's replicate dimension, none under FSDP), every rank
    for a plain tensor (DDP). Pure."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return world_size
    mesh = param.device_mesh
    copies = world_size // mesh.size()  # a mesh smaller than the world: each copy a group
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


class StepNorm:
    """The gradient norm, the clip and the loss sum of a step from this rank's gradient
    shards, with one all-reduce: the shards' norms come from one fused pass over local
    tensors (they also give the non-finite flags), each shard's squared norm is weighted
    by 1/replicas so that a sum over every rank counts it once, and the loss sum rides in
    the same tensor. get_total_norm on DTensors costs a DTensor dispatch per gradient, a
    second reduction for the loss and, for the flags, another pass: 0.8 ms of CPU per
    step more on the benchmark's MLP (bench/README, overhead)."""

    def __init__(self, params: list, device: torch.device, world_size: int):
        self.params = params
        self.world_size = world_size
        self.weights = torch.tensor([1.0 / replicas(p, world_size) for p in params],
                                    dtype=torch.float64, device=device)
        self._no_grad = torch.zeros(0, device=device)  # a parameter no loss reached

    def shard_norms(self) -> torch.Tensor:
        """Each gradient shard's 2-norm on this rank (in the gradients' dtype)."""
        if not self.params:
            return self._no_grad
        return torch.stack(torch._foreach_norm(
            [_local(p.grad) if p.grad is not None else self._no_grad for p in self.params]))

    def reduce(self, shard_norms: torch.Tensor, loss_sum: torch.Tensor, max_norm: float,
               counted: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(global gradient norm, loss summed over the ranks), device tensors nothing waits
        for; the gradients clipped to `max_norm` in place (clip_grads_with_norm_'s rule).
        A NaN/Inf in any rank's gradients makes the norm non-finite on every rank.

        With `counted` (this rank's learned tokens, or rows, in the step) the gradients and
        `loss_sum` are sums over them, not means: the sums of every rank divided by the
        step's count over all ranks (carried in the same all-reduce) make the mean over the
        global batch, each token weighted alike however the ranks' micro-batches split
        them; the loss returned is then that mean."""
        squares = (shard_norms.double().square() * self.weights).sum()
        parts = [squares, loss_sum.double().reshape(())]
        if counted is not None:
            parts.append(counted.double().reshape(()))
        both = torch.stack(parts)
        dist.all_reduce(both)  # the accelerator lane, where the gradients live
        # the data-parallel reduction averaged the ranks' sums: x world / count is the mean
        mean = self.world_size / both[2].clamp(min=1) if counted is not None else None
        norm = both[0].sqrt() if mean is None else both[0].sqrt() * mean
        scale = mean
        if math.isfinite(max_norm) and self.params:
            clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            scale = clip if scale is None else scale * clip
        if scale is not None and self.params:
            torch._foreach_mul_([_local(p.grad) for p in self.params if p.grad is not None],
                                scale.to(torch.float32))
        loss = both[1] if counted is None else both[1] / both[2].clamp(min=1)
        return norm, loss


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def new_optimizer(params, t) -> torch.optim.Optimizer:
    """AdamW's fused kernel, whose `found_inf` input skips a step on the device itself
    (parameters, moments and step count untouched): the non-finite guard needs no
    device-to-host read per step."""
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=True,
                             betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def apply_hyperparameters(optimizer: torch.optim.Optimizer, t) -> None:
    """A loaded optimizer state brings its groups' settings from the checkpoint (fused=False
    from an older one, the betas, eps and weight decay it was saved with): the run's config
    decides them, so a resume with new values takes them, as it takes a new lr."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None
        group["betas"], group["eps"] = (t.adam_beta1, t.adam_beta2), t.adam_eps
        group["weight_decay"] = t.weight_decay


@dataclass
class Cadence:
    """Which steps read loss and norm back from the device, and which save. `log_every`
    (logging.steps_on), `every_steps` and `every_minutes` (checkpoint.*); `clock` is
    time.monotonic, a test's clock in tests."""

    log_every: int
    every_steps: int = 0
    every_minutes: float = 0.0
    clock: object = time.monotonic
    last_save_t: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.last_save_t = self.clock()  # the first time-based save counts from the start

    def step_due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def log_step(self, step: int, total_steps: int) -> bool:
        """Every `log_every` steps, each step-based checkpoint and the last step (a stop or
        a time-based save, agreed during the step, reads after it)."""
        return step % self.log_every == 0 or step >= total_steps or self.step_due(step)

    def time_due(self) -> int:
        """This rank's vote (0/1) for a time-based save at the step it is about to run;
        the step's control-lane all-reduce makes it every rank's decision."""
        return int(bool(self.every_minutes) and
                   self.clock() - self.last_save_t >= self.every_minutes * 60)

    def saved(self) -> None:
        self.last_save_t = self.clock()
