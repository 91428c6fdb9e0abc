"""The run's batch and schedule: pure functions of the step, so resume is exact.

The global batch (rows per optimizer step) belongs to the run: it is frozen at the first
launch, like the seed. Every start, at whatever data-parallel size, splits it into
micro-batch x accumulation x ranks, so the step budget, the learning rate at every step,
the epoch boundaries and the order of the rows are those of an uninterrupted run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from enn_cluster.config.checks import MAX_GLOBAL_BATCH
from enn_cluster.config.run_config import TrainingConfig
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError

MAX_NODES_SUGGESTED = 64  # how far the "launch with" hint counts node numbers


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is read at this data-parallel size."""

    global_batch: int
    micro_batch: int  # rows per forward on one rank
    accumulation: int  # micro-batches per optimizer step
    dp_size: int


LR_SCHEDULES = ("cosine", "linear", "constant")


def lr_at(step: int, total_steps: int, base_lr: float, warmup_ratio: float,
          final_ratio: float = 0.1, schedule: str = "cosine") -> float:
    """The learning rate of the optimizer step that follows `step` completed steps:
    W = floor(total_steps * warmup_ratio) warmup steps at base_lr * (step + 1) / W, then
    `cosine` or `linear` decay from base_lr to final_ratio * base_lr at total_steps, or
    `constant` base_lr. A pure function of the step, so a resume continues it exactly."""
    warmup = int(total_steps * warmup_ratio)
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    span = max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    left = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return base_lr * (final_ratio + (1 - final_ratio) * left)


def requested_global_batch(t: TrainingConfig, dp_size: int) -> int:
    """The global batch a run has, or gets at its first launch at `dp_size` ranks."""
    gb = t.global_batch_size or t.per_device_train_batch_size * t.gradient_accumulation_steps * dp_size
    if gb > MAX_GLOBAL_BATCH:
        raise UserError(f"training.per_device_train_batch_size: {t.per_device_train_batch_size} "
                        f"x gradient_accumulation_steps {t.gradient_accumulation_steps} x {dp_size} "
                        f"ranks is a global batch of {gb} rows, more than {MAX_GLOBAL_BATCH}; "
                        "make them smaller")
    return gb


def fitting_node_counts(global_batch: int, procs_per_node: int, limit: int = MAX_NODES_SUGGESTED) -> list[int]:
    return [n for n in range(1, limit + 1) if global_batch % (n * procs_per_node) == 0]


def plan_batch(t: TrainingConfig, dp_size: int, procs_per_node: int = 0) -> BatchPlan:
    """Split the run's global batch over `dp_size` ranks: the largest micro-batch up to
    per_device_train_batch_size that divides each rank's share, the rest as accumulation."""
    gb = requested_global_batch(t, dp_size)
    if gb % dp_size:
        raise _no_split(gb, dp_size, procs_per_node)
    share = gb // dp_size
    micro = largest_divisor_at_most(share, t.per_device_train_batch_size)
    return BatchPlan(gb, micro, share // micro, dp_size)


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of n that is <= cap, in sqrt(n) steps (n may be 2**31)."""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            best = max([best] + [m for m in (d, n // d) if m <= cap])
    return best


def _no_split(gb: int, dp_size: int, procs_per_node: int) -> UserError:
    """The CLI's hint lists the counts after the flag; the API's says "one of" them."""
    hint = api_hint = counts = ""
    if procs_per_node:
        fitting = fitting_node_counts(gb, procs_per_node)
        if fitting:
            counts = ", ".join(map(str, fitting[:8]))
            hint = "launch with {nodes} {counts} at {procs_said}, or "
            api_hint = "launch with {nodes} one of {counts} and {procs_said}, or "
        else:
            counts = ", ".join(map(str, [p for p in range(1, 17) if gb % p == 0][:6]))
            hint, api_hint = "use {procs} {counts}, or ", "use {procs} one of {counts}, or "
    rest = "change it on purpose with {batch}"
    return UserError("the run's global batch of {gb} rows does not split over {dp_size} "
                     "data-parallel ranks", field="training.global_batch_size", gb=gb,
                     dp_size=dp_size, fix=hint + rest, api_fix=api_hint + rest,
                     nodes=INPUTS["nodes"], procs=INPUTS["procs_per_node"], counts=counts,
                     procs_said=Said(INPUTS["procs_per_node"], procs_per_node),
                     batch=Said(INPUTS["set"], "training.global_batch_size=N"))


def total_steps(t: TrainingConfig, n_rows: int, global_batch: int) -> int:
    """Optimizer steps of the whole run: max_steps, or epochs of whole global batches."""
    per_epoch = n_rows // global_batch
    if per_epoch == 0:
        raise UserError(f"training.global_batch_size: a global batch of {global_batch} rows "
                        f"exceeds the {n_rows} training rows; lower "
                        "training.per_device_train_batch_size (first launch) or set "
                        "training.global_batch_size")
    return t.max_steps or t.epochs * per_epoch


def replanned_total(t: TrainingConfig, n_rows: int, global_batch: int, step: int, epoch: int,
                    consumed: int) -> int:
    """After the global batch was changed on purpose: the steps done, plus what the rest
    of the run takes at the new batch (max_steps stays a step count)."""
    if t.max_steps:
        return t.max_steps
    per_epoch = n_rows // global_batch
    if per_epoch == 0:
        total_steps(t, n_rows, global_batch)  # raises the message
    this_epoch = max((n_rows - consumed) // global_batch, 0)
    return step + this_epoch + max(t.epochs - epoch - 1, 0) * per_epoch


def pause_step(pause_at: int, first_step: int, total_steps: int) -> int:
    """Where this launch ends (pure): training.pause_at_step when the launch starts before
    it, else the schedule's end; a resume from the pause goes on to the end."""
    return pause_at if first_step < pause_at < total_steps else total_steps
