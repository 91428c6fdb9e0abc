"""RUN/oom.json: the OOM governor's record. Every out-of-memory event (step, rank, the
batch split it ran with, the memory figures) and the micro-batch cap that follows from
them; each new attempt of the run reads the cap and splits the same global batch into
smaller micro-batches with more accumulation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from enn_cluster.storage import layout
from enn_cluster.storage.rundir import atomic_write_text

NAME = layout.OOM


def read_record(run_path: Path) -> Optional[dict]:
    try:
        record = json.loads((run_path / NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # damaged: the governor starts again from the configured micro-batch
    return record if isinstance(record, dict) and isinstance(record.get("micro_batch_cap"), int) \
        else None


def micro_batch_cap(run_path: Path) -> Optional[int]:
    record = read_record(run_path)
    return record["micro_batch_cap"] if record else None


def add_event(run_path: Path, event: dict, cap: int) -> dict:
    """Append `event` and lower the cap to `cap` (never raise it: two ranks running out of
    memory in one step both record, the smaller cap wins)."""
    record = read_record(run_path) or {"micro_batch_cap": cap, "events": []}
    record["micro_batch_cap"] = min(cap, record["micro_batch_cap"])
    record["events"] = [*record.get("events", []), event]
    atomic_write_text(run_path / NAME, json.dumps(record, indent=1) + "\n")
    return record


def floor_event(record: Optional[dict]) -> Optional[dict]:
    """The newest event when it ran at micro-batch 1: nothing left to halve, so every
    retry would run out of memory again (the governor refuses it)."""
    if record and record.get("events") and record["events"][-1].get("micro_batch", 2) <= 1:
        return record["events"][-1]
    return None


def summary(record: dict) -> str:
    """One line for status and doctor: the newest event and what followed from it."""
    ev = record["events"][-1]
    head = (f"out of memory at step {ev['step']} on rank {ev['rank']} (micro-batch "
            f"{ev['micro_batch']} x {ev['accumulation']})")
    if floor_event(record):
        figures = ", ".join(f"{k} {v}" for k, v in (ev.get("memory") or {}).items())
        return (f"{head} with memory {figures}: nothing left to halve, the run stops until "
                f"{NAME} is removed")
    return (f"{head}; since then micro-batch <= {record['micro_batch_cap']}, same global batch "
            f"{ev['global_batch']} ({len(record['events'])} event(s), {NAME})")
