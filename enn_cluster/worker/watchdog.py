"""A rank that makes no progress is found and ended, with the evidence in its log.

A stopped peer, a deadlocked collective or a stuck filesystem leave the other ranks
waiting. Collectives give up after parallel.timeout_s; the watchdog covers what has no
timeout of its own (file I/O, a Python deadlock, a collective that never returns): when
no step, collective or checkpoint has started for parallel.watchdog_s, the rank logs where
each lane was last, dumps every Python thread's stack (faulthandler) into its log and
exits EXIT_HANG. The launcher's restart path (elastic locally, the host-side requeue on
Slurm) resumes from the newest checkpoint. A rank that fails in a collective (a timeout, a
dead peer) leaves the same evidence on its way out (`dump`).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import IO, Optional

log = logging.getLogger("enn_cluster.worker.watchdog")

EXIT_HANG = 70  # EX_SOFTWARE: no progress; retried like any failure
# More time for the first step of each process with training.compile: inductor compiles
# every block then (seconds on a tiny model, 5-15 minutes on a 70B one), and its all-gathers
# wait for the slowest rank's compile within the collectives' own timeout.
COMPILE_GRACE_S = 1800.0


class Progress:
    """Where this rank is: the newest thing it started on each lane, and when."""

    def __init__(self) -> None:
        self.lanes: dict[str, tuple[str, float]] = {}
        self.beat = time.monotonic()
        self.paused = False
        self.extra_s = 0.0  # more time granted for a phase known to be slow once

    def at(self, lane: str, what: str) -> None:
        self.lanes[lane] = (what, time.time())
        self.beat = time.monotonic()

    @contextmanager
    def untimed(self, what: str):
        """A checkpoint save or load may take long on a busy filesystem: its barriers have
        their own timeout (checkpoint.barrier_timeout_s), so the watchdog waits."""
        self.at("checkpoint", what)
        self.paused = True
        try:
            yield
        finally:
            self.paused = False
            self.beat = time.monotonic()

    @contextmanager
    def longer(self, extra_s: float):
        """A phase slow once and without a collective's timeout of its own, such as the
        first step of a compiled model (inductor compiling every block, minutes on a big
        model): the watchdog waits `extra_s` more during it, and the normal limit after."""
        self.extra_s = extra_s
        try:
            yield
        finally:
            self.extra_s = 0.0
            self.beat = time.monotonic()

    def describe(self) -> str:
        now = time.time()
        return "; ".join(f"{lane}: {what} ({now - when:.0f} s ago)"
                         for lane, (what, when) in sorted(self.lanes.items())) or "nothing yet"


def dump(progress: Progress, stream: Optional[IO], why: str) -> None:
    """Log where each lane was and every thread's stack (to `stream`, the rank's log)."""
    log.error("%s; last on each lane: %s; every thread's stack follows", why,
              progress.describe())
    for handler in logging.getLogger("enn_cluster").handlers:
        handler.flush()
    if stream is not None:
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()


def rank_log_stream() -> Optional[IO]:
    """The rank's log file (entry's FileHandler), where the stacks go."""
    for handler in logging.getLogger("enn_cluster").handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            return handler.stream
    return None


class Watchdog:
    def __init__(self, progress: Progress, limit_s: float, stream: Optional[IO]) -> None:
        self.progress, self.limit_s, self.stream = progress, limit_s, stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="enn-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(max(self.limit_s / 4, 0.2), 5.0)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self.progress.beat
            limit = self.limit_s + self.progress.extra_s
            if idle > limit and not self.progress.paused:
                dump(self.progress, self.stream,
                     f"watchdog: no progress for {idle:.0f} s (parallel.watchdog_s "
                     f"{self.limit_s:g}" + (f" + {self.progress.extra_s:g} for a first "
                                            "compiled step" if self.progress.extra_s else "")
                     + f"); ending this rank (exit {EXIT_HANG})")
                logging.shutdown()
                os._exit(EXIT_HANG)
