"""The embedded default: N local worker processes under torch's elastic launcher.

torchrun's machinery (not hand-written multiprocessing) gives us what a cluster gives:
the whole group is torn down when one worker dies. The restarts (up to `max_restarts`, each
resuming from the newest complete checkpoint) are ours, one elastic launch per attempt, so
that exit 2 (bad input) ends the launch as it does under Slurm's host-side trap: elastic's
own restarts would rerun any non-zero exit. Each worker is a fresh
`python -m enn_cluster.worker` process, as under torchrun and Slurm: nothing of the
caller's `__main__` (a plain script, a notebook, `python -c`) is re-run in the workers.

A launcher that is a process of our own (the CLI, a notebook's detached launcher) forks
its workers instead, once it has imported what every worker imports (torch's distributed
stack, the model kind's libraries): 4-6 s of imports per worker per launch, done once
(`worker.entry.forked_main` starts the copy as the module would). A caller's own process
is never forked: it may hold CUDA, threads or state that a copy would inherit broken; nor
is a launcher that has initialised the CUDA driver (`cuda_started`), and a forking one asks
torch whether CUDA is there through NVML, which leaves the fork safe (seen on an H200:
elastic's own question, through the CUDA runtime, failed every forked worker's first CUDA
call with "Cannot re-initialize CUDA in forked subprocess").
"""
from __future__ import annotations

import gc
import importlib
import logging
import math
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Optional

from enn_cluster.errors import UserError
from enn_cluster.storage import layout
from enn_cluster.config.launch_env import (
    ATTEMPT_VAR,
    GPUS_REQUESTED_VAR,
    LAUNCH_ID_VAR,
    LAUNCHER_PID_VAR,
    LOCK_HELD_VAR,
    SIM_NODES_VAR,
    handed_to_workers,
)

EXIT_STOPPED = 75  # as the worker's: stopped with a committed checkpoint
EXIT_BAD_INPUT = UserError.exit_code  # a worker refused its input: never retried
SHUTDOWN_MARGIN_S = 10  # past a worker's own hard exit: its log lines and exit record
log = logging.getLogger("enn_cluster.client.launch_local")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what every worker imports (torch._dynamo: DTensor's constructor, at the first sharded
# parameter): imported once by a forking launcher
WORKER_IMPORTS = ("enn_cluster.worker.entry", "enn_cluster.worker.lanes",
                  "enn_cluster.worker.saving", "enn_cluster.worker.trainer",
                  "enn_cluster.worker.model_setup", "torch._dynamo")


def worker_args(run_dir: str, task: str, name: Optional[str], step: Optional[int]) -> list[str]:
    """The worker's arguments, after the interpreter's (`python -u -m enn_cluster.worker`):
    the same entry point as every launcher."""
    args = [run_dir, "--task", task]
    if name is not None:
        args += ["--name", name]
    if step is not None:
        args += ["--step", str(step)]
    return args


def caller_pythonpath(path: list[str], prefixes: tuple[str, ...], existing: str = "") -> str:
    """PYTHONPATH for workers: what the caller could import from (its script's folder, a
    notebook's cwd, tests' folders), as multiprocessing's spawn would have passed on;
    the interpreter's own stdlib and site-packages come by themselves."""
    dirs = [p for p in existing.split(os.pathsep) if p]
    for entry in path:
        full = os.path.abspath(entry or os.curdir)
        if any(full == pre or full.startswith(pre + os.sep) for pre in prefixes):
            continue
        if full not in dirs and os.path.isdir(full):
            dirs.append(full)
    return os.pathsep.join(dirs)


def parse_parent_pid(stat: str) -> int:
    """The ppid field of /proc/PID/stat (the command name may hold spaces and ')')."""
    return int(stat[stat.rindex(")") + 2:].split()[1])


def child_pids(parent: int) -> list[int]:
    """Live direct children of `parent`, from /proc (workers run in sessions of their own)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                if parse_parent_pid(fh.read()) == parent:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def launch_local(run_dir: str, task: str = "train", *, nodes: int = 1, procs_per_node: int = 2,
                 gpus_per_node: int = 0, max_restarts: int = 0, name: Optional[str] = None,
                 step: Optional[int] = None, launch_id: str = "local",
                 stop_grace_s: float = 60.0, preload: Optional[tuple[str, ...]] = None) -> int:
    """Run the worker on nodes x procs_per_node local processes; return the job's exit code.
    A failed attempt is restarted up to `max_restarts` times, unless a worker refused its
    input (exit 2) or a signal stopped the launcher. `stop_grace_s`: how long a worker
    may take to checkpoint after a TERM or INT before the agent kills it. `preload`: fork
    the workers from this process, a process of our own, once it has imported these
    modules beside WORKER_IMPORTS (None: start each as a fresh interpreter)."""
    worker_env = {
        SIM_NODES_VAR: str(nodes),
        GPUS_REQUESTED_VAR: str(gpus_per_node),  # the backend report's gpus_requested
        "PYTHONPATH": caller_pythonpath(sys.path, tuple({sys.prefix, sys.base_prefix,
                                                          sys.exec_prefix}),
                                        os.environ.get("PYTHONPATH", "")),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        LOCK_HELD_VAR: "1",  # run_local holds the run lock for them
        LAUNCHER_PID_VAR: str(os.getpid()),  # they die with us (worker.die_with_launcher)
        LAUNCH_ID_VAR: launch_id}
    args = worker_args(run_dir, task, name, step)
    fork = preload is not None
    if fork:
        # torch.cuda.is_available() through NVML, not the CUDA runtime, which "poisons fork"
        # (elastic's LaunchConfig asks it): for the launcher and, inherited, the workers
        worker_env[NVML_CHECK_VAR] = "1"
        with handed_to_workers(worker_env):  # as the workers would have imported them
            for module in (*WORKER_IMPORTS, *preload):
                importlib.import_module(module)
    code = 0
    for attempt in range(max_restarts + 1):
        code = _attempt(run_dir, nodes * procs_per_node,
                        {**worker_env, ATTEMPT_VAR: str(attempt)}, args, stop_grace_s,
                        fork=fork)
        if not retried(code):
            return code
        if attempt < max_restarts:
            log.warning("attempt %d failed (exit %d): restarting from the newest checkpoint "
                        "(%d of %d)", attempt, code, attempt + 1, max_restarts)
    return code


CUDA_ERROR_NOT_INITIALIZED = 3  # the driver's answer to any call before cuInit
NVML_CHECK_VAR = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's fork-safe is_available()


def cuda_started(maps: str) -> bool:
    """Whether this process has initialised CUDA, which a forked copy could not use: its
    workers are then started fresh. Not only torch's own context: any runtime call (a
    device count at import, torch.cuda.is_available: "poisons fork") runs the driver's
    cuInit. The driver loaded (libcuda in `maps`, this process's /proc/self/maps) is asked
    whether it was initialised (driver_initialized); loaded by a library that never called
    it, it leaves the fork safe."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    paths = {fields[5] for fields in map(str.split, maps.splitlines()) if len(fields) >= 6}
    return any(driver_initialized(path) for path in paths
               if os.path.basename(path).startswith("libcuda.so"))


def driver_initialized(path: str) -> bool:
    """cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED until cuInit has run, and
    initialises nothing itself; a driver that cannot be asked counts as initialised."""
    import ctypes

    try:
        count = ctypes.c_int()
        return ctypes.CDLL(path).cuDeviceGetCount(ctypes.byref(count)) \
            != CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True


def maps_text() -> str:
    """This process's memory map ("" where /proc is not there to read)."""
    try:
        with open("/proc/self/maps") as fh:
            return fh.read()
    except OSError:
        return ""


def retried(code: int) -> bool:
    """Which exits of an attempt a restart may mend: failures, not success, a stop with a
    checkpoint, bad input, or a signal to the launcher (128 + N)."""
    return code not in (0, EXIT_STOPPED, EXIT_BAD_INPUT) and code <= 128


def shutdown_options(stop_grace_s: float, launch_fields: set[str]) -> dict:
    """The elastic agent passes a TERM or INT of the launcher on to the workers and kills
    them `shutdown_timeout` later (default 30 s), which must not cut short the checkpoint
    a worker may take stop_grace_s to reach (it exits hard itself after that). Torch
    releases whose LaunchConfig lacks the field keep their 30 s (docs/config.md)."""
    if "shutdown_timeout" not in launch_fields:
        return {}
    return {"shutdown_timeout": math.ceil(stop_grace_s) + SHUTDOWN_MARGIN_S}


def failure_code(exit_codes: list[int]) -> int:
    """The attempt's exit code from its failed workers': 2 if any refused its input (the
    others were then stopped by the agent), else the first failure's (a signal is 1)."""
    if EXIT_BAD_INPUT in exit_codes:
        return EXIT_BAD_INPUT
    first = exit_codes[0] if exit_codes else 1
    return first if first > 0 else 1


def _attempt(run_dir: str, nprocs: int, worker_env: dict, args: list[str],
             stop_grace_s: float, fork: bool) -> int:
    """One elastic launch of the whole group, with no restart of its own: forked copies of
    this process (`fork`), or fresh interpreters."""
    import dataclasses

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

    with handed_to_workers(worker_env):
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
            run_id=f"enn-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
            # the workers' MASTER_ADDR, numeric: no worker asks the resolver for it. A forked
            # worker inherits the launcher's locks as they were at the fork: one forked while
            # a launcher thread was inside getaddrinfo waited on glibc's resolver lock for
            # good at its first lookup of "localhost" (socket.getfqdn's name, by default)
            local_addr="127.0.0.1",
            monitor_interval=0.1,  # torchrun's: a failure seen in 0.1 s
            **shutdown_options(stop_grace_s, {f.name for f in dataclasses.fields(LaunchConfig)}))
    # asked last: the config itself asks torch whether CUDA is there (on a GPU without NVML,
    # through the runtime, which initialises the driver)
    fork = fork and not cuda_started(maps_text())
    config.start_method = "fork" if fork else "spawn"
    marker = Path(run_dir) / layout.REQUEUE / layout.LOCAL_MARKER
    marker.unlink(missing_ok=True)
    previous = signal.signal(signal.SIGUSR2, _forward_to_workers)
    one_line, agent_log = OneLineExits(), logging.getLogger(AGENT_LOGGER)
    agent_log.addFilter(one_line)
    try:
        if fork:
            from enn_cluster.worker.entry import forked_main

            # the launcher's objects out of the collector's reach: a worker's collections
            # would write to each one's header, copying every page they sit on
            gc.freeze()
            results = elastic_run(config, worker_env, forked_main, *args)
        else:
            from enn_cluster.worker.entry import WORKER_COMMAND

            results = elastic_run(config, worker_env, sys.executable, *WORKER_COMMAND, *args)
    except SignalException as exc:
        # TERM/INT/HUP reached the launcher; the agent passed it on to the workers, which
        # checkpoint at the next step boundary and leave the marker ("requeue me")
        log.warning("launcher stopped by signal %s", exc.sigval)
        if marker.exists():
            marker.unlink()
            return EXIT_STOPPED
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return failure_code([getattr(f, "exitcode", 1) for f in exc.failures.values()])
    finally:
        signal.signal(signal.SIGUSR2, previous)
        agent_log.removeFilter(one_line)
    marker.unlink(missing_ok=True)
    return 0 if results is not None else 1  # every worker exited 0 (else ChildFailedError)


ELASTIC_SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"


def elastic_run(config, worker_env: dict, entry, *args):
    """torch's elastic_launch(config, entry)(*args) with `worker_env` for the workers, and
    the caller's environment as it was afterwards: elastic_launch sets its signal list
    there, so it is handed over with ours and taken back with it (a notebook's environment
    stays its own)."""
    from torch.distributed.launcher.api import elastic_launch

    with handed_to_workers({**worker_env, ELASTIC_SIGNALS_VAR: config.signals_to_handle}):
        return elastic_launch(config, entry)(*args)


AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # where it logs a worker's exit


class OneLineExits(logging.Filter):
    """Elastic logs a forked worker's non-zero exit with the traceback of its own poll
    (ProcessExitedException, in the launcher): the exit code is the whole story there (the
    worker said why in its own output), in one line, as elastic says it for a subprocess."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and getattr(record.exc_info[0], "__name__", "") == \
                "ProcessExitedException":
            record.exc_info = record.exc_text = None
        return True


def _forward_to_workers(signum, frame) -> None:
    """USR2 to the launcher means what it means to a worker: checkpoint and stop."""
    for pid in child_pids(os.getpid()):
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
