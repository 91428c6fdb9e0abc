"""After non-finite steps were skipped: report them (a dump in RUN/nonfinite/, a warning,
a metrics record) and decide from training.nonfinite_policy whether training must stop.
nonfinite.py records what a step held; this is what the loop does about it at a log step."""
from __future__ import annotations

import logging
from pathlib import Path

from enn_cluster.worker.nonfinite import DUMP_DIR

log = logging.getLogger("enn_cluster.worker.nonfinite_policy")


def report_skipped(watch, run_path: Path, lanes, metrics, t, use_bf16: bool, step: int,
                   skipped: int, seen: int, in_row: int) -> None:
    """Dump the new skips (`watch`: the trainer's NonFiniteWatch), log and record them."""
    dump = watch.dump(run_path, lanes, {
        "bf16": use_bf16, "policy": t.nonfinite_policy,
        "skipped_total": skipped, "in_a_row": in_row})
    log.warning("non-finite loss/grad: %d step(s) skipped up to step %d (%d in a row)%s",
                skipped - seen, step, in_row, f"; dump {dump}" if dump else "")
    metrics.write("nonfinite", step=step, skipped=skipped, in_a_row=in_row,
                  dump=str(dump.relative_to(run_path)) if dump else None)


def abort_reason(t, in_row: int, step: int) -> "str | None":
    """Why training must stop under training.nonfinite_policy, or None to go on."""
    where = f"{DUMP_DIR}/ in the run directory"
    if t.nonfinite_policy == "abort":
        return (f"non-finite loss/grad at step {step} (training.nonfinite_policy=abort; "
                f"rows and non-finite parameters in {where}): check the data for NaN/Inf, "
                "lower training.lr, or enable grad clipping")
    if t.nonfinite_policy == "skip_then_abort" and in_row >= t.max_nonfinite_steps:
        return (f"{in_row} non-finite losses in a row at step {step} (rows and "
                f"non-finite parameters in {where}): check the data for NaN/Inf, lower "
                "training.lr, or enable grad clipping")
    return None
