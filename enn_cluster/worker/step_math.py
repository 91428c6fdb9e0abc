"""The optimizer step's pieces that need no run: the gradient norm and clip, the fused
AdamW that skips a non-finite step on the device, Python's collector at fixed steps, and
the cadence of log reads and periodic checkpoints."""
from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

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


def clip_and_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global gradient norm (a device tensor: nothing waits for it), clipped to `max_norm`,
    in one all-reduce: the sharded norm is completed once and the clip then uses it
    (clip_grad_norm_ on DTensors reduces twice)."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # takes parameters
    return norm


def new_optimizer(params, t) -> torch.optim.Optimizer:
    """AdamW's fused kernel, whose `found_inf` input skips a step on the device itself
    (parameters, moments and step count untouched): the non-finite guard needs no
    device-to-host read per step."""
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=True)


def keep_fused(optimizer: torch.optim.Optimizer) -> None:
    """A loaded optimizer state (an older checkpoint) may carry fused=False in its groups."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None


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
