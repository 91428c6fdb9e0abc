"""Fault injection for the recovery tests, set in the workers' environment and not in the
run's config (no user sets these): ENN_TEST_FAULTS="fail_at_step=13,fail_rank=3" makes
rank `fail_rank` SIGKILL itself at step `fail_at_step`; "oom_at_step=N" makes it raise an
out-of-memory error in step N. Each fires once per run (a marker file under RUN/faults/),
so that the retry runs clean. Apart from the loop, which only calls these at the two points
where a real fault would strike."""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Mapping

import torch

from enn_cluster.errors import UserError

log = logging.getLogger("enn_cluster.worker.fault_injection")
FAULTS_VAR = "ENN_TEST_FAULTS"


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
