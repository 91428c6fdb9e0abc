"""The OOM governor: an out-of-memory error in a step halves the micro-batch for the rest
of the run, with twice the accumulation, so the global batch (and the math) stays the
same.

Ranks cannot redo the step in place: the rank that ran out of memory stops mid-step while
its peers wait in FSDP's collectives for it. So it records the event (RUN/oom.json, with
the memory figures) and leaves; its peers' collectives fail; the restart path (elastic
locally, the host-side requeue on Slurm) starts a new attempt, which reads the cap and
resumes from the newest checkpoint with the smaller micro-batch. At micro-batch 1 there
is nothing left to halve: the run stops with the figures (exit 2, never retried).
"""
from __future__ import annotations

import logging
import resource
import time

import torch

from enn_cluster.errors import UserError
from enn_cluster.storage import oom_record

log = logging.getLogger("enn_cluster.worker.oom_governor")


class OutOfMemoryRecorded(RuntimeError):
    """This rank ran out of memory and recorded it: the attempt ends, the next one halves
    the micro-batch."""


def memory_figures(device: torch.device) -> dict:
    """What the device (or, on CPU, this process) held when memory ran out, in MiB."""
    mib = 1024 * 1024
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"device": str(device), "allocated_mb": torch.cuda.memory_allocated(device) // mib,
                "reserved_mb": torch.cuda.memory_reserved(device) // mib,
                "peak_allocated_mb": torch.cuda.max_memory_allocated(device) // mib,
                "free_mb": free // mib, "total_mb": total // mib}
    return {"device": "cpu", "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def _floor_message(event: dict) -> str:
    figures = ", ".join(f"{k} {v}" for k, v in event["memory"].items())
    return (f"out of memory at step {event['step']} on rank {event['rank']} with micro-batch 1 "
            f"(memory: {figures}): nothing left to halve; run on more GPUs (FSDP shards the "
            "model over them), use a smaller model, or set training.bf16=true; then remove "
            "oom.json from the run directory and resume")


def refuse_after_floor(run_path) -> None:
    """A retry after an OOM at micro-batch 1 would run out of memory again: every attempt
    (a launcher may restart on any exit) stops at once with the same message."""
    event = oom_record.floor_event(oom_record.read_record(run_path))
    if event:
        raise UserError(_floor_message(event))


def record(run_path, step: int, rank: int, batch, device: torch.device, exc: BaseException):
    """Called by the rank that ran out of memory; raises what ends its attempt."""
    figures = memory_figures(device)
    event = {"step": step, "rank": rank, "micro_batch": batch.micro_batch,
             "accumulation": batch.accumulation, "global_batch": batch.global_batch,
             "memory": figures, "error": " ".join(str(exc).split())[:300], "time": time.time()}
    if batch.micro_batch <= 1:
        oom_record.add_event(run_path, event, 1)
        raise UserError(_floor_message(event))
    cap = batch.micro_batch // 2
    oom_record.add_event(run_path, event, cap)
    log.error("out of memory at step %d (micro-batch %d x accumulation %d; %s): the next "
              "attempt runs micro-batch <= %d with more accumulation, same global batch %d",
              step, batch.micro_batch, batch.accumulation, figures, cap, batch.global_batch)
    raise OutOfMemoryRecorded(f"out of memory at step {step} on rank {rank}") from exc
