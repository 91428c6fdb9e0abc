"""Fault injection for the recovery tests: training.fail_at_step SIGKILLs rank
training.fail_rank and training.oom_at_step raises an out-of-memory error in its step,
each once per run (a marker file under RUN/faults/), so that the retry runs clean. Apart
from the loop, which only calls these at the two points where a real fault would strike."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import torch

log = logging.getLogger("enn_cluster.worker.fault_injection")


def fault_fires(run_path: Path, rank: int, fail_rank: int, at_step: int, step: int,
                name: str) -> bool:
    """Fault injection: rank training.fail_rank at `at_step`, once per run (a marker
    file), so that the retry runs clean."""
    if not at_step or step != at_step or rank != fail_rank:
        return False
    marker = run_path / "faults" / f"{name}-step-{step}"
    if marker.exists():
        return False
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(str(os.getpid()))
    return True


def maybe_inject_fault(t, run_path: Path, rank: int, step: int) -> None:
    """Before step `step` + 1: rank training.fail_rank kills itself at training.fail_at_step."""
    if not fault_fires(run_path, rank, t.fail_rank, t.fail_at_step, step, "fired"):
        return
    log.error("fault injection: rank %d kills itself (SIGKILL) at step %d", rank, step)
    # The kernel's kill -9, as an OOM killer or a scancel'd node would: no handler, no
    # flush, no goodbye to the peers. The pid is our own, never one read from a file.
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_inject_oom(t, run_path: Path, rank: int, step: int) -> None:
    """In step `step`: rank training.fail_rank runs out of memory at training.oom_at_step."""
    if fault_fires(run_path, rank, t.fail_rank, t.oom_at_step, step, "oom"):
        raise torch.OutOfMemoryError(f"fault injection: out of memory at step {step}")
