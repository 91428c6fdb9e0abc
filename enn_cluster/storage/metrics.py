"""Rank-0 metrics as JSON lines: one record per line, appended, readable while running."""
from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Iterator, Optional

from enn_cluster.storage.run_files import LOG_LIMIT, append_run_file, read_run_bytes


def peak_memory_mb() -> float:
    """Peak accelerator memory where measurable, else this process's peak RSS."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
    except ImportError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


class MetricsLog:
    def __init__(self, path: Path, enabled: bool, sink=None) -> None:
        """`sink` (an MLflow logger, see tracking.py) also gets every record."""
        self.path = Path(path)
        self.enabled = enabled
        self.sink = sink
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = append_run_file(self.path) if enabled else None

    def write(self, kind: str, **fields) -> None:
        if not self._fh:
            return
        record = {"kind": kind, "time": round(time.time(), 3),
                  **{k: _clean(v) for k, v in fields.items()}}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self.sink is not None:
            self.sink.log(kind, record)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        if self._fh:
            self._fh.close()
            self._fh = None


def scan_metrics(path: Path) -> tuple[list[dict], int]:
    """Every record in `path`, and how many complete lines hold none. The file is read once,
    so a run appending while it is read cannot make it look damaged (a stat after the read
    could see a line the read did not); a last line with no newline yet is never counted."""
    try:
        data = read_run_bytes(path, LOG_LIMIT)
    except FileNotFoundError:
        return [], 0
    lines = data.split(b"\n")
    records, unreadable = [], 0
    for i, raw in enumerate(lines):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            continue
        record = _record(line)
        if record is not None:
            records.append(record)
        elif i < len(lines) - 1:  # complete, yet not a record: damage, not a write in flight
            unreadable += 1
    return records, unreadable


def _record(line: str) -> Optional[dict]:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None  # a line cut by a crash (or bytes that are not UTF-8)
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return None  # not a record rank 0 wrote (every one names its step)
    return record


def read_metrics(path: Path, kind: Optional[str] = None) -> Iterator[dict]:
    for record in scan_metrics(path)[0]:
        if kind is None or record.get("kind") == kind:
            yield record
