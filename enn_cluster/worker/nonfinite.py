"""What a step held when its loss or gradient went NaN/Inf: kept on the device until a log
step reads it, then written by rank 0 as RUN/nonfinite/step-N.json.

Every step records, with device-side selects only (no device-to-host read, see the
trainer), the newest non-finite step's number, lr, gradient norm and loss, and which of
this rank's gradient shards held a non-finite value. The log step that sees the skip
counter grow turns that into a dump: per parameter, the number of its gradient shards
that did (summed over the ranks; each replica holds the same shard, so divided by the
replicate size), and the step's row indices (rows of the staged training array) gathered
from every rank over the control lane.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from enn_cluster.storage import layout
from enn_cluster.storage.rundir import run_umask

DUMP_DIR = layout.NONFINITE


class NonFiniteWatch:
    def __init__(self, model: torch.nn.Module, device: torch.device, replicate: int,
                 history: int):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.replicate, self.history = replicate, max(history, 1)
        self.flags_kept = torch.zeros(len(named), dtype=torch.int64, device=device)
        self.scalars = torch.zeros(4, dtype=torch.float64, device=device)  # step lr norm loss
        self._slots = torch.arange(4, device=device)  # which slot holds which figure
        self.rows: dict[int, list[int]] = {}  # step -> this rank's rows, the last `history`

    def flags(self, shard_norms: torch.Tensor) -> torch.Tensor:
        """1 for each gradient shard holding a non-finite value (device tensor), read off
        the shards' norms taken before clipping (StepNorm.shard_norms: a clip by a
        non-finite norm turns every gradient element NaN). A norm is finite exactly when
        its elements are, short of an fp32 overflow, which skips the step too; counting
        elements took two more passes over the gradients and a temporary per shard."""
        return (~torch.isfinite(shard_norms)).to(torch.int64)

    def observe(self, step: int, rows: list[np.ndarray], flags: torch.Tensor,
                finite: torch.Tensor, lr: float, grad_norm: torch.Tensor,
                loss: torch.Tensor) -> None:
        """Keep this step's figures if it is non-finite (device-side selects only)."""
        self.rows[step] = np.concatenate(rows).tolist() if rows else []
        for old in [s for s in self.rows if s <= step - self.history]:
            del self.rows[old]
        bad = ~finite
        self.flags_kept = torch.where(bad, flags, self.flags_kept)
        # step and lr are host numbers: they enter as kernel arguments of `where` (Python
        # scalars), never as tensors built from them (a host-to-device copy, and a wait for
        # it, per step: tests/worker/test_trainer_units.py counts them)
        figures = torch.where(self._slots == 2, grad_norm.detach().double().reshape(()),
                              loss.detach().double().reshape(()))
        figures = torch.where(self._slots == 1, float(lr), figures)  # stays float64
        figures = torch.where(self._slots == 0, float(step), figures)
        self.scalars = torch.where(bad, figures, self.scalars)

    def dump(self, run_path: Path, lanes, extra: dict) -> Optional[Path]:
        """Collective (every rank calls it on the same log step). Rank 0 writes the dump of
        the newest non-finite step and returns its path; other ranks return None."""
        shards = self.flags_kept.clone()
        dist.all_reduce(shards)  # the accelerator lane, where the shards live
        step, lr, norm, loss = (float(v) for v in self.scalars.tolist())
        step = int(step)
        gathered = lanes.gather_objects(self.rows.get(step, []))
        if lanes.rank != 0:
            return None
        per_param = {n: int(c) // self.replicate for n, c in zip(self.names, shards.tolist())}
        record = {
            "step": step + 1,  # the optimizer step's number, as metrics count them
            "lr": lr, "grad_norm": norm, "loss": loss,
            "param_dtype": str(self.params[0].dtype).removeprefix("torch.") if self.params else None,
            "nonfinite_grad_shards": {n: c for n, c in per_param.items() if c},
            "parameters_checked": len(per_param),
            "rows": sorted({r for rows in gathered for r in rows}),
            "rows_by_rank": gathered,
            **extra,
        }
        out = run_path / DUMP_DIR / f"step-{step + 1}.json"
        with run_umask():
            out.parent.mkdir(exist_ok=True)
            tmp = out.with_name(f".{out.name}.{os.getpid()}")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, out)
        return out
