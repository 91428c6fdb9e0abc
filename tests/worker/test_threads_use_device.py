"""Every thread the worker starts selects its rank's CUDA device first (placement.use_device).

A new thread's current CUDA device is 0: a stager thread that pins memory or a loader thread
that creates a stream without selecting its device puts a context on GPU 0 for every rank
of the node. No GPU here, so the real threads run on CPU with placement.use_device wrapped
by a recorder (it still calls the original) in the modules that start them: each thread
must record the call before its first piece of work. A source check names any other
module that starts a thread, so a new one is looked at too."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from enn_cluster.worker import checkpoint_async, checkpoint_staging, loader, placement

PACKAGE = Path(__file__).resolve().parents[2] / "enn_cluster"
STARTS_THREAD = re.compile(r"threading\.Thread\(|ThreadPoolExecutor\(")
HOST_ONLY = {"storage/staging.py": "runs on the submit host before any worker; no device",
             "storage/text_staging.py": "tokenizes on the submit host before any worker; "
                                        "no device",
             "worker/watchdog.py": "reads the progress record, dumps stacks, exits: no torch call"}
CHECKED_BELOW = {"worker/loader.py", "worker/checkpoint_async.py"}


class ThreadLog:
    """(thread, event) in the order they happened, from any thread."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self.events.append((threading.get_ident(), what))

    def worker_threads(self) -> set[int]:
        return {t for t, what in self.events if what == "work"} - {threading.get_ident()}

    def selected_first(self, thread: int, device) -> bool:
        mine = [what for t, what in self.events if t == thread]
        return f"use_device {device}" in mine[:mine.index("work")]


@pytest.fixture
def thread_log(monkeypatch):
    log, original = ThreadLog(), placement.use_device

    def recording(device):
        log.add(f"use_device {device}")
        original(device)
    for module in (loader, checkpoint_async):  # where the threads look the name up
        monkeypatch.setattr(module, "use_device", recording)
    return log


def test_loader_thread_selects_its_device_before_gathering(thread_log):
    device = torch.device("cpu")

    def gather(rows):
        thread_log.add("work")
        return torch.from_numpy(rows.astype(np.float32)), torch.zeros(len(rows))
    batches = loader.BatchLoader(gather, device)
    try:
        batches.prefetch([np.arange(4), np.arange(4, 8)])
        assert [len(x) for x, _ in batches.batches([np.arange(4), np.arange(4, 8)])] == [4, 4]
    finally:
        batches.close()
    (thread,) = thread_log.worker_threads()
    assert thread_log.selected_first(thread, device), thread_log.events


class RecordingStager(checkpoint_staging.StagingBuffers):
    """The product's stager, noting which thread stages (the copy is the thread's work)."""

    def __init__(self, log: ThreadLog) -> None:
        super().__init__()
        self.log = log

    def stage(self, *args, **kwargs) -> dict:
        self.log.add("work")
        return super().stage(*args, **kwargs)


def test_checkpoint_thread_selects_its_device_before_staging(thread_log, tmp_path):
    import torch.distributed as dist

    from enn_cluster.storage import commits
    from enn_cluster.worker.lanes import Lanes

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        lanes = Lanes(control=dist.new_group(backend="gloo"),
                      checkpoint=dist.new_group(backend="gloo"), device=torch.device("cpu"),
                      rank=0, world_size=1)
        stager = RecordingStager(thread_log)
        pending = checkpoint_async.save_async(tmp_path / "ckpt", 1, torch.nn.Linear(3, 2), None,
                                              {"step": 1}, lanes, stager)
        pending.result()
        stager.close()
    finally:
        dist.destroy_process_group()
    assert commits.committed_steps(tmp_path / "ckpt") == [1]
    (thread,) = thread_log.worker_threads()
    assert thread_log.selected_first(thread, lanes.device), thread_log.events


def test_every_other_thread_starter_is_known():
    starters = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                      if STARTS_THREAD.search(p.read_text()))
    assert CHECKED_BELOW <= set(starters)
    unknown = [name for name in starters if name not in HOST_ONLY and name not in CHECKED_BELOW]
    assert not unknown, (f"{unknown} start threads: check them here like the loader and "
                         "the checkpoint thread, or list them in HOST_ONLY with the reason")


def test_use_device_is_a_no_op_off_cuda():
    placement.use_device(torch.device("cpu"))
    placement.use_device(None)
