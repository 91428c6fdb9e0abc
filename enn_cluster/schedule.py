"""Learning-rate schedule and step budget: pure functions of the step, so resume is exact."""
from __future__ import annotations

import math

from .config import TrainingConfig
from .errors import UserError


def lr_at(step: int, total_steps: int, base_lr: float, warmup_ratio: float,
          final_ratio: float = 0.1) -> float:
    """Linear warmup, then cosine decay to `final_ratio * base_lr` at `total_steps`."""
    warmup = int(total_steps * warmup_ratio)
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return base_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def global_batch(t: TrainingConfig, dp_size: int) -> int:
    return t.per_device_train_batch_size * t.gradient_accumulation_steps * dp_size


def total_steps(t: TrainingConfig, n_rows: int, dp_size: int) -> int:
    """Optimizer steps of the whole run: max_steps, or epochs of whole global batches."""
    gb = global_batch(t, dp_size)
    per_epoch = n_rows // gb
    if per_epoch == 0:
        raise UserError(f"training.per_device_train_batch_size: a global batch of {gb} rows "
                        f"({t.per_device_train_batch_size} x {t.gradient_accumulation_steps} "
                        f"accumulation x {dp_size} ranks) exceeds the {n_rows} training rows; "
                        "lower the batch size")
    return t.max_steps or t.epochs * per_epoch
