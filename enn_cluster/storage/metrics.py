"""Rank-0 metrics as JSON lines: one record per line, appended, readable while running."""
from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Iterator, Optional


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
        self._fh = open(self.path, "a", encoding="utf-8") if enabled else None

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


def read_metrics(path: Path, kind: Optional[str] = None) -> Iterator[dict]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash (or bytes that are not UTF-8)
                if not isinstance(record, dict) or type(record.get("step", 0)) is not int:
                    continue  # not a record rank 0 wrote
                if kind is None or record.get("kind") == kind:
                    yield record
    except FileNotFoundError:
        return
