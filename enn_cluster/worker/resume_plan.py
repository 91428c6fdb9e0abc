"""The batch, data position and step budget after a resume, decided from the saved
trainer state and the config: a global batch changed on purpose is kept (and reported),
one from a run before the batch was frozen is restored, and the steps left are re-planned
from the resumed position. Pure but for `plan`, the trainer's own batch planner."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from enn_cluster.config.schedule import BatchPlan, replanned_total
from enn_cluster.worker.sampler import DataPosition


def saved_global_batch(state: dict, t) -> "int | None":
    """The global batch a checkpoint was trained with (older ones: from their mesh)."""
    if state.get("global_batch"):
        return int(state["global_batch"])
    mesh = state.get("mesh") or {}
    if mesh.get("replicate") and mesh.get("shard"):
        return (t.per_device_train_batch_size * t.gradient_accumulation_steps
                * int(mesh["replicate"]) * int(mesh["shard"]))
    return None


def replan_after_resume(state: dict, t, batch: BatchPlan, plan: Callable[..., BatchPlan],
                        n_rows: int, step: int, pos: DataPosition
                        ) -> "tuple[BatchPlan, DataPosition, int, dict]":
    """(batch, position, total steps, what changed about the batch for the resume record):
    for an unchanged batch the steps done plus the steps left is the uninterrupted run's
    budget; after an explicit change of the batch (or of training.epochs) the rest is
    re-planned from here."""
    saved = saved_global_batch(state, t)
    changed = {}
    if saved is not None and saved != batch.global_batch:
        if t.global_batch_size:  # changed on purpose: --set training.global_batch_size
            changed = {"global_batch_changed": [saved, batch.global_batch]}
        else:  # a run from before the batch was frozen keeps the one it had
            batch = plan(replace(t, global_batch_size=saved))
    gb = batch.global_batch
    if pos.consumed and (n_rows - pos.consumed) // gb == 0:
        pos = DataPosition(pos.epoch + 1, 0)  # the batch grew: tail too short
    total = replanned_total(t, n_rows, gb, step, pos.epoch, pos.consumed)
    return batch, pos, total, changed
