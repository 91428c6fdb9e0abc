"""The one worker entry point, identical on every task of every launcher.

    python -m enn_cluster.worker RUN_DIR --task train
    python -m enn_cluster.worker RUN_DIR --task predict --name NAME

Flow: clean env -> discover rank/world/master -> NCCL profile (GPU) -> device and CPU
placement -> lanes -> task.
Exit codes: 0 done, 2 bad input, 75 stopped with a checkpoint ("requeue me"; under Slurm 0,
the requeue marker says it), 1 failure.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Optional

from enn_cluster.config import nccl
from enn_cluster.config.launch_env import LAUNCH_ID_VAR, LAUNCHER_PID_VAR
from enn_cluster.errors import UserError
from enn_cluster.models import quiet_library_logs
from enn_cluster.storage import backend_report, layout
from enn_cluster.storage.rundir import RunDir
from enn_cluster.worker import control_net
from enn_cluster.worker.environment import clean_environment, detect_launcher, discover
from enn_cluster.worker.exec_env import fallback_allowed, process_defaults, reexec_if_needed
from enn_cluster.worker.code_identity import code_identity, skew_problem
from enn_cluster.worker.placement import place_task
from enn_cluster.worker.refusal import (leave_if_peer_refused, record_refusal,
                                         to_rank_log_only)
from enn_cluster.worker.stop_signals import STOP_SIGNALS

EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_REQUEUE = 0, 1, 2, 75
WORKER_COMMAND = ("-u", "-m", "enn_cluster.worker")  # the interpreter's arguments before ours
log = logging.getLogger("enn_cluster.worker")
# how this worker began (the backend report's worker_start): a fresh interpreter, or a copy
# of the local launcher (forked_main)
STARTED = {"how": "fresh"}
_early_signals: list[int] = []  # stop signals that came before the trainer's handlers


def install_early_stop_handlers(run_dir: str = "", slurm_job: Optional[str] = None) -> None:
    """First thing in a task: a stop signal that arrives while torch imports or the
    groups form is remembered, and the trainer honours it at its first step boundary
    (Python's defaults would end the task with no checkpoint, or a traceback). Under Slurm,
    a stop signal after another rank refused the job is srun tearing the step down
    (--kill-on-bad-exit): nothing to save, so the task leaves at once in one line."""
    def remember(signum, frame):
        if slurm_job and leave_if_peer_refused(run_dir, slurm_job):
            os._exit(EXIT_FAILED)
        _early_signals.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, remember)


_process_defaults: dict = {}  # what process_defaults set in this task (logged once logging is up)
_tmpdir_given = ""  # TMPDIR as the launcher handed it down (process_defaults may replace it)


def _attempt_tag(env) -> str:
    """logs/<attempt>/: one folder per launch and restart, so no attempt appends to another's."""
    if os.environ.get("ENN_ATTEMPT_TAG"):
        return os.environ["ENN_ATTEMPT_TAG"]
    if os.environ.get(LAUNCH_ID_VAR):
        return f"{os.environ[LAUNCH_ID_VAR]}-r{env.restart_count}"
    if env.launcher == "slurm":
        # a relaunch on the nodes left after a lost node: a new folder (-kK), same attempt
        return f"slurm-{env.job_id}-r{env.restart_count}" + (f"-k{env.relaunch}" if env.relaunch else "")
    return f"{env.launcher}-r{env.restart_count}"


def _setup_logging(run: RunDir, env) -> Path:
    log_dir = run.logs / _attempt_tag(env)
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(nccl.flight_recorder_env(str(log_dir), os.environ))
    fmt = logging.Formatter(f"%(asctime)s rank{env.rank} %(name)s %(levelname)s %(message)s")
    root = logging.getLogger("enn_cluster")
    root.handlers.clear()
    root.setLevel(logging.INFO)
    fh = logging.FileHandler(log_dir / f"rank-{env.rank}.log")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if env.rank == 0:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    log.info("worker rank %d/%d local %d node %d pid %d host %s launcher %s restart %d",
             env.rank, env.world_size, env.local_rank, env.node_rank, os.getpid(),
             socket.gethostname(), env.launcher, env.restart_count)
    if "TMPDIR" in _process_defaults:  # a site's per-job path that the container lacks
        log.info("TMPDIR %s is not a writable directory here: temporary files go to %s",
                 _tmpdir_given, _process_defaults["TMPDIR"])
    if "HOME" in _process_defaults:  # --no-container-mount-home: a HOME the image lacks
        log.info("HOME is not a writable directory here: HOME and caches under %s",
                 _process_defaults["HOME"])
    return log_dir


def _say_cpu_only(env, torch_version: str) -> None:
    """GPUs were asked for (Slurm gave this node some) but this torch has no CUDA: say so."""
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "0")
    if env.rank == 0 and gpus not in ("", "0"):
        msg = (f"--gpus-per-node: the job has {gpus} GPUs per node, but torch {torch_version} "
               "here has no CUDA (a CPU-only build?): training runs on the CPU")
        log.warning(msg)
        print(f"enn_cluster: {msg}", file=sys.stderr, flush=True)


def _configure_nccl(env, timeout_s: float) -> None:
    """On GPU nodes, pick the fabric profile unless the user set the variables."""
    try:
        import torch

        if not torch.cuda.is_available():
            _say_cpu_only(env, torch.__version__)
            return
    except ImportError:
        return
    for key, value in nccl.heartbeat_env(timeout_s).items():
        os.environ.setdefault(key, value)
    profile = os.environ.get("ENN_NCCL_PROFILE", "auto")
    chosen = nccl.configure(os.environ, profile=profile) if hasattr(nccl, "configure") else None
    if env.rank == 0 and chosen is not None:
        log.info("NCCL profile: %s", chosen)
    problem = nccl.memlock_problem(chosen or "none", memlock_limit())
    if problem:  # every rank checks its own: the limit is per task, set where it started
        raise UserError(problem)
    for level, line in nccl.report(os.environ, chosen or "none"):
        getattr(log, level)(line)


def memlock_limit() -> Optional[int]:
    """This task's soft `ulimit -l` in bytes; None: unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def run_task(run_dir: str, task: str = "train", name: Optional[str] = None,
             step: Optional[int] = None, submitted: Optional[str] = None) -> int:
    """Run one task of the job in this process; returns the exit code. `submitted`: the
    code identity the job was submitted with (Slurm), refused when it is not this one."""
    reexec_if_needed()  # the EFA plugin's library path must be there at exec
    problem = skew_problem(submitted, code_identity()) if submitted else None
    if problem:
        raise UserError(problem)
    run = RunDir(Path(run_dir).resolve())
    cfg = run.load_config()
    env = discover(os.environ)
    cleaned = clean_environment(os.environ, env)
    os.environ.clear()
    os.environ.update(cleaned)
    global _tmpdir_given
    _tmpdir_given = os.environ.get("TMPDIR", "")
    _process_defaults.update(process_defaults(os.environ))  # before CUDA starts; logged
    os.environ.update(_process_defaults)
    Path(os.environ["HOME"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    code = EXIT_FAILED  # an exception on the way out is a failure (exit 2 for UserError)
    try:
        code = _run(run, cfg, env, task, name, step)
    except UserError:
        code = EXIT_USER
        raise
    finally:
        record_exit(run, env, task, code)
    return code


def record_exit(run: RunDir, env, task: str, code: int) -> None:
    """logs/<attempt>/exit-rank-R.json: how this rank ended, for `doctor` (a rank killed
    by a signal leaves none, which is itself the finding)."""
    import json
    import time

    from enn_cluster.storage.rundir import atomic_write_text

    try:
        log_dir = run.logs / _attempt_tag(env)
        log_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(log_dir / f"exit-rank-{env.rank}.json", json.dumps(
            {"rank": env.rank, "task": task, "code": code, "time": time.time()}))
    except OSError as exc:  # never turn a finished task into a failed one
        log.warning("could not record the exit code: %s", exc)


def _run(run: RunDir, cfg, env, task: str, name: Optional[str], step: Optional[int]) -> int:
    import torch

    from enn_cluster.worker.lanes import close_lanes, lane_device, open_lanes

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    log_dir = _setup_logging(run, env)
    log.info(control_net.apply(os.environ))  # before the profile: one interface for both
    _configure_nccl(env, cfg.parallel.timeout_s)
    if torch.cuda.is_available():  # NCCL's init log tells the report the transport
        os.environ.update(backend_report.nccl_log_env(log_dir, env.rank, os.environ))
    from enn_cluster.worker.worker_lock import hold_run_lock

    device = lane_device(env)
    placed = place_task(env, device)  # before the lanes: their threads inherit the binding
    log.info(placed.line())
    lanes = open_lanes(env, cfg.parallel.timeout_s, cfg.parallel.rendezvous_timeout_s,
                       cfg.checkpoint.barrier_timeout_s, device=device)
    try:
        _report_backends(log_dir, cfg, env, lanes, placed)
        with hold_run_lock(run, env, lanes, task):
            if task == "train":
                return _train(run, cfg, env, lanes)
            from enn_cluster.worker.predict import run_prediction

            run_prediction(run, cfg, env, lanes, name=name, step=step)
            return EXIT_OK
    except UserError as exc:  # before the lanes close: a peer that fails on their closing
        if env.launcher == "slurm" and str(env.job_id).isdigit():  # reads why (run_entry)
            record_refusal(str(run.path), str(env.job_id), str(exc))
        raise
    finally:
        close_lanes()


def _report_backends(log_dir: Path, cfg, env, lanes, placed) -> None:
    """backend-rank-R.json: what runs here, for status and doctor; mismatches are logged.
    The model's module is imported first: kernel switches it flips when imported (SDPA
    backends are process-wide) are what the task will run with."""
    import torch.distributed as dist

    from enn_cluster.models import kind_of
    from enn_cluster.worker.model_setup import use_bf16
    from enn_cluster.worker.parallel import float8_emulated

    kind_of(cfg).load_code(cfg)  # its kernel choices, as the model will see them

    backends = {"accelerator": str(dist.get_backend()),
                "control": str(dist.get_backend(lanes.control)),
                "checkpoint": str(dist.get_backend(lanes.checkpoint))}
    nccl_log = log_dir / backend_report.NCCL_LOG_NAME.format(rank=env.rank)
    report = backend_report.gather(env.rank, lanes.device, backends,
                                   use_bf16(cfg, lanes.device), os.environ, nccl_log,
                                   compiled=cfg.training.compile, started=STARTED["how"])
    report["placement"] = placed.report()
    report["float8"] = "off" if not cfg.training.float8 else \
        "emulated" if float8_emulated(lanes.device) else "on"
    backend_report.write_report(log_dir, report)
    for line in backend_report.mismatches(report):
        log.warning("backend: %s", line)
    refusal = backend_report.transport_refusal(report)
    if refusal and not fallback_allowed(os.environ):
        raise UserError(refusal)


def _train(run: RunDir, cfg, env, lanes) -> int:
    from enn_cluster.worker.oom_governor import OutOfMemoryRecorded
    from enn_cluster.worker.saving import TrainingAborted
    from enn_cluster.worker.trainer import Trainer

    trainer = Trainer(cfg, run, env, lanes)
    trainer.install_signal_handlers()
    if _early_signals:
        trainer.request_stop(_early_signals[-1])
    try:
        outcome = trainer.fit()
    except TrainingAborted as exc:
        log.error("training aborted: %s", exc)
        if env.rank == 0:
            print(f"enn_cluster: training aborted: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except OutOfMemoryRecorded as exc:  # the next attempt runs a smaller micro-batch
        log.error("%s: this attempt ends; see oom.json in the run directory", exc)
        return EXIT_FAILED
    except UserError:
        raise
    except Exception as exc:  # a collective timed out, a peer died: leave the evidence
        from enn_cluster.worker.watchdog import dump, rank_log_stream

        dump(trainer.progress, rank_log_stream(),
             f"training failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        raise
    finally:
        trainer.close()
    if outcome == "stopped":
        # every rank writes the marker: with --kill-on-bad-exit the first rank to exit may
        # get the others killed before rank 0 alone would have written it
        marker = run.requeue / str(env.job_id or layout.LOCAL_MARKER)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(str(trainer.step))
        log.warning("stopped at step %d with a committed checkpoint: %s", trainer.step,
                    "Slurm requeues the job to continue" if env.launcher == "slurm" else
                    f"continue with: enn-submit resume {shlex.quote(str(run.path))}")
        return EXIT_REQUEUE
    if outcome == "paused":
        log.info("paused at step %d of %d (training.pause_at_step), checkpointed: continue "
                 "with: enn-submit resume %s", trainer.step, trainer.total_steps,
                 shlex.quote(str(run.path)))
        return EXIT_OK
    log.info("training done at step %d", trainer.step)
    return EXIT_OK


def die_with_launcher(environ) -> None:
    """Our local launcher's workers run in sessions of their own (torch's elastic agent
    starts them so): if the launcher is killed (kill -9, a crashed login shell), the
    kernel kills them too, instead of leaving a headless group training on, writing a
    run whose lock is gone."""
    launcher = environ.get(LAUNCHER_PID_VAR, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != int(launcher):  # it died before the line above
        os._exit(128 + int(signal.SIGKILL))


def run_entry(run_dir: str, task: str = "train", name: Optional[str] = None,
              step: Optional[int] = None, submitted: Optional[str] = None) -> int:
    """Every launcher's way in (the module's main, Slurm's submitit entry): the same
    signal handling and the same exit codes, 2 for bad input (never retried)."""
    slurm_job = os.environ.get("SLURM_JOB_ID") if detect_launcher(os.environ) == "slurm" else None
    slurm_job = slurm_job if slurm_job and slurm_job.isdigit() else None
    install_early_stop_handlers(run_dir, slurm_job)
    no_keyboard()
    die_with_launcher(os.environ)
    from enn_cluster.worker.lanes import PortTaken

    try:
        return slurm_exit_code(run_task(run_dir, task, name, step, submitted),
                               slurm_job is not None)
    except UserError as exc:
        print(f"enn_cluster worker: {exc}", file=sys.stderr, flush=True)
        if slurm_job:
            record_refusal(run_dir, slurm_job, str(exc))
        return EXIT_USER
    except PortTaken as exc:  # retried (the host side probes again), unlike bad input
        print(f"enn_cluster worker: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Exception:
        if leave_if_peer_refused(run_dir, slurm_job):  # the refusal, not this, is why
            to_rank_log_only("this rank's own failure, after another rank refused:")
            return EXIT_FAILED
        raise


def slurm_exit_code(code: int, under_slurm: bool) -> int:
    """A Slurm task stopped with a checkpoint exits 0, not 75: every rank has written the
    requeue marker the host-side trap acts on, and a non-zero exit would trip srun's
    --kill-on-bad-exit, killing the peers still on their way out ("Terminated" noise)."""
    return EXIT_OK if under_slurm and code == EXIT_REQUEUE else code


def no_keyboard() -> None:
    """Nothing a worker runs may wait for a keyboard (a library's prompt, a debugger): its
    stdin is /dev/null, whatever the launcher handed down (the local launcher's is the
    user's terminal)."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


def main(argv: Optional[list[str]] = None) -> int:
    install_early_stop_handlers()
    quiet_library_logs()
    parser = argparse.ArgumentParser(prog="python -m enn_cluster.worker",
                                     description="enn_cluster worker (same on every task)")
    parser.add_argument("run_dir")
    parser.add_argument("--task", choices=("train", "predict"), default="train")
    parser.add_argument("--name", default=None, help="prediction name (predict task)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (predict task)")
    args = parser.parse_args(argv)
    try:
        return run_entry(args.run_dir, args.task, args.name, args.step)
    except Exception:  # a peer died, a collective timed out: the traceback, then exit_now,
        traceback.print_exc()  # not a second of finalisation the launcher's restart waits for
        return EXIT_FAILED


def forked_main(*argv: str) -> None:
    """`main` in a copy of the local launcher (`launch_local(fork=True)`), which imported
    torch's distributed stack and the model's libraries once for all its workers. The copy is
    made to start as `python -u -m enn_cluster.worker ARGV` would: the launcher's signal
    handlers (the elastic agent's) undone, a session of its own as the agent's subprocesses
    get, that command line for a re-exec (exec_env), unbuffered output. The agent waits for
    a return value from a worker that succeeds; any other exit is at once, as `exit_now`."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    sys.orig_argv = [sys.executable, *WORKER_COMMAND, *argv]
    sys.argv = [WORKER_COMMAND[-1], *argv]
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # None where the launcher had no such stream
            stream.reconfigure(line_buffering=True, write_through=True)
    STARTED["how"] = "forked"
    code = main(list(argv))
    if code != EXIT_OK:
        exit_now(code)


def exit_now(code: int) -> None:
    """Leave without interpreter finalisation: the process groups and our threads are
    closed by then, and a native thread (gloo, NCCL's watchdog) still winding down at
    finalisation aborts the process ("terminate called without an active exception"),
    turning a finished task into a failed one."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

