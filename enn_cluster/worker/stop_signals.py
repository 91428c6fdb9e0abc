"""Stop signals: USR2 (Slurm's warning before the time limit), TERM (preemption, scancel,
a launcher stopping) and INT (Ctrl-C through a launcher) all ask for an agreed
checkpoint-and-exit at the next step boundary; after TERM or INT a hard exit follows if
that boundary is not reached in time (a peer may be dead). The handlers only set the
trainer's flag; the loop agrees on it with the other ranks."""
from __future__ import annotations

import os
import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def arm_hard_exit(signum: int, grace_s: float) -> None:
    """After TERM or INT: exit 128 + signum unless the step boundary comes within
    `grace_s` (parallel.stop_grace_s, at least one second)."""
    if signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal.SIGALRM, lambda *_: os._exit(128 + signum))
        signal.alarm(max(int(grace_s), 1))


def install_stop_handlers(on_stop: Callable[[int], None]) -> None:
    """Every stop signal calls `on_stop(signum)`."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: on_stop(signum))
