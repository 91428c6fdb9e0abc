"""Every thread the worker starts selects its rank's CUDA device first (placement.use_device).

A new thread's current CUDA device is 0: a stager thread that pins memory or a loader thread
that creates a stream without selecting its device puts a context on GPU 0 for every rank
of the node. No GPU here, so this checks the source: each worker module that starts a
thread also calls use_device. Host-only modules are listed with the reason."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from enn_cluster.worker import placement

PACKAGE = Path(__file__).resolve().parents[1] / "enn_cluster"
STARTS_THREAD = re.compile(r"threading\.Thread\(|ThreadPoolExecutor\(")
HOST_ONLY = {"storage/staging.py": "runs on the submit host before any worker; no device",
             "worker/watchdog.py": "reads the progress record, dumps stacks, exits: no torch call"}


def test_every_worker_thread_selects_its_device():
    starters = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                      if STARTS_THREAD.search(p.read_text()))
    assert "worker/loader.py" in starters and "worker/checkpoint_async.py" in starters
    missing = [name for name in starters if name not in HOST_ONLY
               and "use_device(" not in (PACKAGE / name).read_text()
               and "initializer=use_device" not in (PACKAGE / name).read_text()]
    assert not missing, f"threads started without placement.use_device: {missing}"


def test_use_device_is_a_no_op_off_cuda():
    placement.use_device(torch.device("cpu"))
    placement.use_device(None)
