"""Watch a Slurm job politely: `--wait` and `status --follow` ask the controller at 0, 1, 2,
3, 4, 5.3, 7.1 ... s after the job last changed (each wait a quarter of the time since the
change, so a job that ends is seen within a third of its time in that state), then once a
minute (submitit's InfoWatcher cap), and ask once per poll for everything they show (the
job, then its nodes while it runs).

`Backoff` decides when (pure: the clock is passed in); `SlurmWatch` asks and keeps the
answers in between; `wait_for_job` is `--wait`'s loop. Tests drive both with a fake clock.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.cluster import slurm
from enn_cluster.storage import layout

MAX_DELAY_S = 60.0  # submitit's InfoWatcher default
MIN_DELAY_S = 1.0
# Of the time since the last change, the wait before the next ask. submitit's 1/2 doubles
# the time between asks, so a job's end is seen up to its own duration late (an 8.1 s step
# seen at 16 s); 1/4 asks about twice as often in the first minutes and is 1/3 late at most.
DELAY_FRACTION = 0.25


@dataclass
class Backoff:
    """When to ask next: not before min(MAX, max(MIN, a quarter of the time since the last
    change)) has passed since the last ask (submitit's refresh_delay, with a quarter for
    its half). `changed` starts it over."""

    start: float
    max_delay_s: float = MAX_DELAY_S
    last_ask: Optional[float] = None

    def delay(self, now: float) -> float:
        return min(self.max_delay_s, max(MIN_DELAY_S, (now - self.start) * DELAY_FRACTION))

    def due(self, now: float) -> bool:
        return self.last_ask is None or now - self.last_ask >= self.delay(now)

    def wait_s(self, now: float) -> float:
        """Seconds until the next ask is due (0: now): the first t with
        t - last_ask >= delay(t), as `due` polled finds it: t - last = f (t - start) gives
        t = (last - f start) / (1 - f)."""
        if self.last_ask is None:
            return 0.0
        last, f = self.last_ask, DELAY_FRACTION
        due_at = min(last + self.max_delay_s,
                     max(last + MIN_DELAY_S, (last - f * self.start) / (1 - f)))
        return max(0.0, due_at - now)

    def asked(self, now: float) -> None:
        self.last_ask = now

    def changed(self, now: float) -> None:
        self.start = now


@dataclass
class SlurmWatch:
    """Slurm's answers about a run's jobs, asked once per poll and reused between polls
    (`status` asks for the job's state and whether it is alive: one `squeue` call). With
    `clock`, a new answer is asked for only when the backoff says so (`status --follow`);
    without, every answer is fresh once (a plain `status`)."""

    clock: Optional[Callable[[], float]] = None
    ask_job: Callable[[str], dict] = slurm.job_state
    ask_nodes: Callable[[str], dict] = slurm.nodes_not_answering
    _jobs: dict = field(default_factory=dict)
    _backoff: dict = field(default_factory=dict)

    def job_state(self, job_id: str) -> dict:
        job_id = str(job_id)
        now = self.clock() if self.clock else 0.0
        backoff = self._backoff.setdefault(job_id, Backoff(start=now))
        if job_id in self._jobs and (self.clock is None or not backoff.due(now)):
            return self._jobs[job_id]
        state = self.ask_job(job_id)
        old = self._jobs.get(job_id)
        if old is None or slurm.describe(old) != slurm.describe(state):
            backoff.changed(now)
        if state.get("state") == "RUNNING" and state.get("nodes"):
            state = {**state, "dead_nodes": self.ask_nodes(state["nodes"])}
        backoff.asked(now)
        self._jobs[job_id] = state
        return state

    def job_alive(self, job_id: str, ended_by_itself: bool = False) -> bool:
        """As slurm.job_alive, from this watch's (backed-off) answers."""
        return slurm.alive(self.job_state(job_id), ended_by_itself)


def node_hint(state: dict) -> Optional[str]:
    """What a RUNNING job on a node Slurm no longer hears from means, in one line."""
    dead = state.get("dead_nodes") or {}
    if state.get("state") != "RUNNING" or not dead:
        return None
    named = ", ".join(f"{n} ({s})" for n, s in sorted(dead.items()))
    return (f"{named}: Slurm no longer hears from the job's node; its ranks there are "
            "gone, yet the job stays RUNNING until Slurm declares the node dead "
            "(SlurmdTimeout, 300 s by default), then is requeued, or goes on without the "
            "node when it was submitted with --nodes MIN-MAX")


def wait_for_job(job_id: str, run=None, *, ask: Optional[Callable[[str], dict]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> int:
    """Block until the job leaves Slurm's live states, printing each new state and reason;
    0 only when it COMPLETED. A job Slurm will never start as asked is cancelled at once.
    A job that ended otherwise shows the end of its batch log (srun's and the host-side
    trap's lines) and the command for the ranks' logs, where `run` (a RunDir) is known."""
    ask = ask or slurm.job_state
    backoff, shown = Backoff(start=clock()), None
    while True:
        sleep(backoff.wait_s(clock()))
        state = ask(job_id)
        backoff.asked(clock())
        if slurm.describe(state) != shown:
            shown = slurm.describe(state)
            backoff.changed(clock())
            print(f"Slurm job {job_id}: {shown}", file=sys.stderr, flush=True)
        if slurm.never_starts(state):
            slurm.cancel(job_id)
            raise UserError("Slurm job {job} can never start: Reason={reason} (beyond the "
                            "partition's, account's or QOS's limits); cancelled it",
                            job=job_id, reason=state["reason"],
                            fix="ask for fewer nodes, GPUs, CPUs ({cpus}; unset, it is sized "
                                "from the partition's nodes) or less {time}, or another "
                                "{partition}", cpus=INPUTS["cpus_per_task"],
                            time=INPUTS["time"], partition=INPUTS["partition"])
        if state["state"] not in slurm.LIVE_STATES:
            if state["state"] == "COMPLETED":
                return 0
            if run is not None:
                print("\n".join(failed_job_lines(run.path, job_id)), file=sys.stderr)
            return 1


def failed_job_lines(run_dir: Path, job_id: str, tail_lines: int = 20) -> list[str]:
    """The end of a finished job's batch log (its last 8 KiB at most) and where to look next."""
    log = layout.batch_log(run_dir, job_id)
    lines = [f"Slurm job {job_id}: batch log {log}:"]
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 8192))
            text = fh.read().decode("utf-8", errors="replace")
        lines += [f"  | {line}" for line in text.splitlines()[-tail_lines:]]
    except OSError as exc:
        lines = [f"Slurm job {job_id}: no batch log to show ({exc.strerror}: {log})"]
    return lines + [f"the ranks' logs: enn-submit logs {shlex.quote(str(run_dir))} --rank R"]
