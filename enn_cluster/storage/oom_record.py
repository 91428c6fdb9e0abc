"""RUN/oom.json: the OOM governor's record. Every out-of-memory event (step, rank, the
batch split it ran with, the memory figures) and the micro-batch cap that follows from
them; each new attempt of the run reads the cap and splits the same global batch into
smaller micro-batches with more accumulation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from enn_cluster.storage.rundir import atomic_write_text

NAME = "oom.json"


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
