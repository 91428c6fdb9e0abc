"""Fault injection for the tests, set in the workers' environment and never in the run's
config (no user sets these); every hook the production modules call lives here, so that a
reader of those modules meets one named call at the point a real fault would strike.

- ENN_TEST_FAULTS="fail_at_step=13,fail_rank=3": rank `fail_rank` SIGKILLs itself at step
  `fail_at_step`; "oom_at_step=N": it raises an out-of-memory error in step N. Each fires
  once per run (a marker file under RUN/faults/), so that the retry runs clean.
- ENN_FAULT_HOLD_BEFORE_COMMIT="STEP:DIR": every rank holds at step STEP's commit
  (`hold_before_commit`).
- ENN_FAULT_SLOW_STAGING_S: an async save's copy starts this late (`staging_delay_s`).
- ENN_FAULT_DEVICE_ID: every rank claims this device (`claimed_device`), as two ranks on one
  GPU would.
- ENN_FAULT_DEVICE_MEMORY_BYTES: the device's memory, as a small GPU would report it
  (`device_memory`).
- ENN_FAULT_PREDICT_EXIT_AFTER_CHUNKS=K (with ENN_FAULT_PREDICT_RANK=R): rank R exits hard
  after its K-th chunk, once per prediction (`maybe_exit_after_chunks`).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Mapping, Optional

import torch

from enn_cluster.errors import UserError

log = logging.getLogger("enn_cluster.worker.fault_injection")
FAULTS_VAR = "ENN_TEST_FAULTS"
HOLD_BEFORE_COMMIT = "ENN_FAULT_HOLD_BEFORE_COMMIT"
SLOW_STAGING = "ENN_FAULT_SLOW_STAGING_S"
DEVICE_ID = "ENN_FAULT_DEVICE_ID"
DEVICE_MEMORY = "ENN_FAULT_DEVICE_MEMORY_BYTES"
EXIT_AFTER_CHUNKS, PREDICT_RANK = "ENN_FAULT_PREDICT_EXIT_AFTER_CHUNKS", "ENN_FAULT_PREDICT_RANK"


@dataclass(frozen=True)
class Faults:
    """The faults a test asked for; 0 disables each."""

    fail_at_step: int = 0  # rank fail_rank is SIGKILLed before this step
    fail_rank: int = 0
    oom_at_step: int = 0  # rank fail_rank runs out of memory in this step


def test_faults(environ: Mapping[str, str] = os.environ) -> Faults:
    """The faults of ENN_TEST_FAULTS (NAME=STEP pairs, comma-separated); none when unset."""
    return _parse(environ.get(FAULTS_VAR, ""))


test_faults.__test__ = False  # not a pytest test, whatever its name


@cache
def _parse(text: str) -> Faults:
    names, values = {f.name for f in fields(Faults)}, {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in names or not value.strip().isdigit():
            raise UserError(f"{FAULTS_VAR}: {item!r} is not NAME=N with NAME one of "
                            f"{', '.join(sorted(names))}")
        values[name] = int(value)
    return Faults(**values)


def fault_fires(run_path: Path, rank: int, fail_rank: int, at_step: int, step: int,
                name: str) -> bool:
    """Fault injection: rank `fail_rank` at `at_step`, once per run (a marker
    file), so that the retry runs clean."""
    if not at_step or step != at_step or rank != fail_rank:
        return False
    marker = run_path / "faults" / f"{name}-step-{step}"
    if marker.exists():
        return False
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(str(os.getpid()))
    return True


def maybe_inject_fault(t: Faults, run_path: Path, rank: int, step: int) -> None:
    """Before step `step` + 1: rank `fail_rank` kills itself at `fail_at_step`."""
    if not fault_fires(run_path, rank, t.fail_rank, t.fail_at_step, step, "fired"):
        return
    log.error("fault injection: rank %d kills itself (SIGKILL) at step %d", rank, step)
    # The kernel's kill -9, as an OOM killer or a scancel'd node would: no handler, no
    # flush, no goodbye to the peers. The pid is our own, never one read from a file.
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_inject_oom(t: Faults, run_path: Path, rank: int, step: int) -> None:
    """In step `step`: rank `fail_rank` runs out of memory at `oom_at_step`."""
    if fault_fires(run_path, rank, t.fail_rank, t.oom_at_step, step, "oom"):
        raise torch.OutOfMemoryError(f"fault injection: out of memory at step {step}")


def hold_before_commit(step: int, rank: int) -> None:
    """A node lost while a checkpoint is written: at step STEP, with every shard and DCP's
    .metadata on disk but no commit record, each rank touches DIR/held-rank-R and waits
    until DIR/release exists (at most 10 minutes). Once released, never again: the
    relaunched step passes STEP without holding."""
    at, _, where = os.environ.get(HOLD_BEFORE_COMMIT, "").partition(":")
    if not where or at != str(step) or (Path(where) / "release").exists():
        return
    (Path(where) / f"held-rank-{rank}").touch()
    deadline = time.monotonic() + 600
    while not (Path(where) / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def staging_delay_s() -> float:
    """How late an async save's copy starts (0: at once)."""
    return float(os.environ.get(SLOW_STAGING, "0") or 0)


def claimed_device() -> Optional[str]:
    """The device every rank claims instead of its own (None: its own)."""
    return os.environ.get(DEVICE_ID) or None


def device_memory() -> Optional[int]:
    """The device's memory in bytes instead of what the device reports (None: its own)."""
    value = os.environ.get(DEVICE_MEMORY)
    return int(value) if value else None


def maybe_exit_after_chunks(run_path: Path, name: str, rank: int, written: int) -> None:
    """Rank PREDICT_RANK exits hard after its EXIT_AFTER_CHUNKS-th chunk of prediction
    `name`, once per prediction (a marker under RUN/faults/)."""
    after = int(os.environ.get(EXIT_AFTER_CHUNKS, "0") or 0)
    if not after or written != after or rank != int(os.environ.get(PREDICT_RANK, "0")):
        return
    marker = run_path / "faults" / f"predict-{name}-fired"
    if marker.exists():
        return
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(str(os.getpid()))
    log.error("fault injection: rank %d exits hard after %d chunks", rank, written)
    os._exit(13)
