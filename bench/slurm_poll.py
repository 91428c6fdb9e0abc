"""Polling the local dev Slurm and a run's metrics while a benchmark waits on them: the
Slurm benchmarks (submit_latency, node_loss) share these."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from enn_cluster.storage.metrics import scan_metrics


def wait_for(what, timeout: float, poll: float = 0.05):
    """`what()`'s first value that is not None, polled; RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found is not None:
            return found
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f} s")


def idle(env: dict) -> None:
    """Until every node is idle and no job is queued: each side starts on a quiet cluster."""
    def check():
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                             env=env).stdout.split()
        jobs = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=env).stdout
        return True if out and all(s == "idle" for s in out) and not jobs.strip() else None
    wait_for(check, 120, 0.2)


def records(run: Path, kind: str, after: float) -> list:
    """The run's `kind` records after `after`, read as the job appends (scan_metrics leaves
    out a line still being written)."""
    return [r for r in scan_metrics(run / "metrics.jsonl")[0]
            if r["kind"] == kind and r["time"] > after]
