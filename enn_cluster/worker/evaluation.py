"""Validation: which arrays a staged run evaluates on (its own eval split, or rows held
out of train) and the mean eval loss over them. Every rank runs the same number of
forwards, since FSDP's all-gathers are collectives; a rank with fewer rows pads with a
weight-0 batch."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from enn_cluster.models import input_dtype, loss_weight, model_loss
from enn_cluster.storage.staging import open_array
from enn_cluster.worker.loader import gather_rows
from enn_cluster.worker.model_setup import autocast
from enn_cluster.worker.sampler import shard_rows


def eval_arrays(manifest: dict, data_dir, x, y):
    """(eval x, eval y, [first row, end row]) or three Nones where the run has no eval."""
    if "eval_x" in manifest["entries"]:
        ex, ey = open_array(data_dir, "eval_x"), open_array(data_dir, "eval_y")
        return ex, ey, [0, len(ex)]
    if manifest.get("eval_rows"):
        return x, y, manifest["eval_rows"]
    return None, None, None


def device_batch(x, y, rows: np.ndarray, scaler, device, dtype=torch.float32):
    xb, yb = gather_rows(x, y, rows, scaler, dtype=dtype)
    return xb.to(device, non_blocking=True), yb.to(device)


@torch.no_grad()
def mean_eval_loss(sm, task: str, micro: int, eval_x, eval_y, eval_rows, scaler, lanes,
                   progress, step: int) -> float:
    """Mean eval loss over every learned token (a language model) or row, as training
    weighs them; every rank runs the same number of forwards (FSDP collectives)."""
    if eval_x is None:
        return float("nan")
    n = eval_rows[1] - eval_rows[0]
    start, stop = shard_rows(n, lanes.rank, lanes.world_size)
    longest = max(shard_rows(n, r, lanes.world_size)[1] -
                  shard_rows(n, r, lanes.world_size)[0] for r in range(lanes.world_size))
    totals = torch.zeros(2, dtype=torch.float64, device=lanes.device)
    sm.model.eval()
    for off in range(0, longest, micro):
        rows = np.arange(start + off, min(start + off + micro, stop)) + eval_rows[0]
        count = len(rows)
        if count == 0:
            rows = np.array([eval_rows[0]])  # keep step with the others, weight 0
        progress.at("accelerator", f"evaluation after step {step}")
        xb, yb = device_batch(eval_x, eval_y, rows, scaler, lanes.device,
                              input_dtype(sm.model))
        with autocast(sm, lanes.device):
            loss = model_loss(sm.model, task, xb, yb)
        weight = float(loss_weight(sm.model, yb)) if count else 0.0  # learned tokens, or rows
        totals += torch.tensor([float(loss) * weight, weight], dtype=torch.float64,
                               device=lanes.device)
    sm.model.train()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1]) if totals[1] else float("nan")
