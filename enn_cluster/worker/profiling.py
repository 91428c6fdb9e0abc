"""torch.profiler over a window of optimizer steps (profiling.steps), one Chrome trace per
rank in RUN/profiles/steps-FIRST-LAST/rank-R.json.

The window is in optimizer steps, the same on every rank, so every rank starts and stops
tracing at the same step and rank 0 can upload the folder once all traces are written.
A restart inside the window traces again from where it resumed and replaces the files.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch

from enn_cluster.storage import layout

log = logging.getLogger("enn_cluster.worker.profiling")


class StepProfiler:
    def __init__(self, window: Optional[tuple[int, int]], run_path: Path, rank: int,
                 device: torch.device):
        self.window, self.rank, self.device = window, rank, device
        self.folder = (run_path / layout.PROFILES / f"steps-{window[0]}-{window[1]}"
                       if window else None)
        self.prof = None

    def before_step(self, step: int) -> None:
        """`step`: the optimizer step about to run (1-based)."""
        if self.window is None or self.prof is not None:
            return
        first, last = self.window
        if first <= step <= last:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            log.info("profiling steps %d-%d (from step %d)", first, last, step)

    def after_step(self, step: int, final: bool = False) -> Optional[Path]:
        """`step`: the optimizer step just done. Returns the trace written at the window's
        end (every rank at the same step), or at the run's end (`final`: it stopped or
        finished inside the window), else None."""
        if self.prof is None or (step < self.window[1] and not final):
            return None
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        out = self.folder / f"rank-{self.rank}.json"
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, out)
        log.info("profile of steps %d-%d written to %s", *self.window, out)
        return out

    def close(self) -> None:
        """After a failure inside the window: the open trace is dropped, never half-written."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
