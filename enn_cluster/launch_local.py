"""The embedded default: N local worker processes under torch's elastic launcher.

torchrun's machinery (not hand-written multiprocessing) gives us what a cluster gives:
the whole group is torn down when one worker dies, and restarted up to `max_restarts`
times, each restart resuming from the newest complete checkpoint.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import uuid
from pathlib import Path
from typing import Optional

from .environment import SIM_NODES_VAR

EXIT_STOPPED = 75  # as the worker's: stopped with a committed checkpoint
log = logging.getLogger("enn_cluster.launch_local")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(run_dir: str, task: str, name: Optional[str], step: Optional[int]) -> int:
    from .worker import run_task

    return run_task(run_dir, task, name, step)


def launch_local(run_dir: str, task: str = "train", *, nodes: int = 1, procs_per_node: int = 2,
                 max_restarts: int = 0, name: Optional[str] = None,
                 step: Optional[int] = None) -> int:
    """Run the worker on nodes x procs_per_node local processes; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[SIM_NODES_VAR] = str(nodes)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nodes * procs_per_node,
        run_id=f"enn-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
        monitor_interval=0.5, start_method="spawn")
    marker = Path(run_dir) / "requeue" / "local"
    marker.unlink(missing_ok=True)
    previous = signal.signal(signal.SIGUSR2, _forward_to_workers)
    try:
        results = elastic_launch(config, _entry)(run_dir, task, name, step)
    except SignalException as exc:
        # TERM/INT/HUP reached the launcher; the agent passed TERM to the workers, which
        # checkpoint at the next step boundary and leave the marker ("requeue me")
        log.warning("launcher stopped by signal %s", exc.sigval)
        if marker.exists():
            marker.unlink()
            return EXIT_STOPPED
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()), None)
        code = getattr(first, "exitcode", 1) or 1
        return code if code > 0 else 1
    finally:
        signal.signal(signal.SIGUSR2, previous)
    marker.unlink(missing_ok=True)
    codes = set(results.values())
    return max(codes) if codes else 1


def _forward_to_workers(signum, frame) -> None:
    """USR2 to the launcher means what it means to a worker: checkpoint and stop."""
    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
