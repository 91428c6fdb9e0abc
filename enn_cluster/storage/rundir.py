"""The run directory on the shared filesystem: layout, frozen config, atomic writes, lock.

Layout of `<runs_root>/<run_name>/`:
  config.yaml            resolved config every task reads (history in config-history/)
  data/                  staged memmaps + manifest.json
  checkpoints/step-N/    DCP checkpoints, complete only with commit.json
  metrics.jsonl          rank-0 metrics
  logs/                  per-attempt, per-rank logs
  jobs.jsonl             every launch (local or Slurm job id)
  requeue/<job id>       marker: the host batch script should requeue this job
  requeue/refused-<job>  a rank refused its input (exit 2): never requeue this job
  predictions/<name>/    prediction chunks + manifest
  run.lock               who is writing this run now
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from enn_cluster.config.loading import config_from_dict, dump_config, without_retired_keys
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.yaml_file import PlainLoader
from enn_cluster.errors import UserError
from enn_cluster.storage.lock_files import close_held, hold, take_aside
from enn_cluster.storage.output_target import missing_parents, remove_empty
from enn_cluster.storage.run_files import (
    LOG_LIMIT,
    append_run_file,
    read_run_bytes,
    read_run_text,
)

DIR_MODE = 0o2750  # group-readable, never world-writable
RUN_UMASK = 0o027  # files 0640, directories 0750: the same for whatever the run writes


@contextmanager
def run_umask():
    """Everything under a run gets its mode from the umask of the process that writes it
    (workers inherit the launcher's; under Slurm, sbatch hands the submitter's to the job
    as SLURM_UMASK). Set it, whatever the caller's was: a world-writable checkpoint would let
    any local user replace `.metadata`, which DCP unpickles."""
    old = os.umask(RUN_UMASK)
    try:
        yield
    finally:
        os.umask(old)


@contextmanager
def sigterm_unwinds():
    """Within this block SIGTERM raises SystemExit(143) instead of ending the process on
    the spot, so the `finally` blocks that remove temporary directories still run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, _frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


def _mkdir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE)
    os.chmod(path, DIR_MODE)  # mkdir drops the setgid bit: files keep the run's group


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename, fsync the directory: never half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def has_config(self) -> bool:
        """Whether config.yaml is there in any form (a FIFO or a symlink loop included:
        reading it refuses those by name); False for a path the system cannot look up."""
        return os.path.lexists(self.config_path)

    @property
    def data_dir(self) -> Path:
        return self.path / "data"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics(self) -> Path:
        """Where rank 0 writes metrics: `logging.metrics_path` of the frozen config."""
        try:
            return self.path / self.load_config().logging.metrics_path
        except UserError:
            return self.path / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def predictions(self) -> Path:
        return self.path / "predictions"

    @property
    def requeue(self) -> Path:
        return self.path / "requeue"

    @property
    def lock_path(self) -> Path:
        return self.path / "run.lock"

    def load_config(self) -> RunConfig:
        if not self.has_config:
            raise UserError(f"RUN_DIR: {self.path} has no config.yaml; "
                            "is it a run directory made by enn-submit train?")
        try:
            data = yaml.load(read_run_text(self.config_path),  # noqa: S506 - a SafeLoader
                             Loader=PlainLoader)
        except (yaml.YAMLError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise UserError(f"config.yaml: {self.config_path} does not parse "
                            f"({type(exc).__name__}); {self._restore_hint()}") from None
        if not isinstance(data, dict):
            raise UserError(f"config.yaml: {self.config_path} is not a mapping; "
                            f"{self._restore_hint()}")
        try:
            return config_from_dict(without_retired_keys(data))
        except UserError as exc:
            raise UserError(f"config.yaml: {exc}") from None

    def _restore_hint(self) -> str:  # config-history/ is named only where it exists
        kept = any((self.path / "config-history").glob("config-*.yaml"))
        return "restore it from the newest file in config-history/" if kept else \
            "restore it from the YAML the run was made with (it has no config-history/)"

    def record_job(self, **fields) -> None:
        """Append one launch record (job id, kind, shape); appends of one line are atomic."""
        fields.setdefault("time", time.time())
        line = json.dumps(fields, sort_keys=True) + "\n"
        with run_umask(), append_run_file(self.path / "jobs.jsonl") as fh:
            fh.write(line)

    def jobs(self) -> list[dict]:
        try:
            text = read_run_text(self.path / "jobs.jsonl", LOG_LIMIT)
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except FileNotFoundError:
            return []
        except (ValueError, UnicodeDecodeError, RecursionError):
            records = None
        if records is None or not all(isinstance(r, dict) for r in records):
            raise UserError(f"jobs.jsonl: {self.path / 'jobs.jsonl'} holds a line that is not a "
                            "JSON object; remove that line")
        if any(r.get("kind") == "slurm" and not str(r.get("job_id", "")).replace("_", "").isdigit()
               for r in records):
            raise UserError(f"jobs.jsonl: {self.path / 'jobs.jsonl'} holds a Slurm record without "
                            "a job id (job_id); remove that line")
        return records


def run_dir_for(cfg: RunConfig) -> RunDir:
    return RunDir(Path(cfg.runs_root).expanduser().resolve() / cfg.run_name)


def create_run_dir(cfg: RunConfig, populate=None) -> RunDir:
    """Make a new run directory with the frozen config, all or nothing.

    Everything (config, staged data) is written under a hidden temporary name and renamed
    into place at the end, so a failure never leaves a half-made run behind.
    """
    run = run_dir_for(cfg)
    if run.path.exists():
        raise UserError(f"run_name: {run.path} already exists; use "
                        f"'enn-submit resume {run.path}' or pick another --set run_name=...")
    tmp = RunDir(run.path.with_name(f".{run.path.name}.creating-{os.getpid()}"))
    made = missing_parents(run.path)  # runs_root and its parents this call creates
    with run_umask(), sigterm_unwinds():
        try:
            run.path.parent.mkdir(parents=True, exist_ok=True)
            _mkdir(tmp.path)
        except OSError as exc:
            raise UserError(f"runs_root: cannot create {str(tmp.path)!r} "
                            f"({exc.strerror or exc}); give a runs_root you can write to "
                            "(and a shorter run_name)") from None
        try:
            for sub in (tmp.data_dir, tmp.checkpoints, tmp.logs, tmp.requeue, tmp.predictions):
                _mkdir(sub)
            atomic_write_text(tmp.config_path, dump_config(cfg))
            if populate is not None:
                populate(tmp)
            os.rename(tmp.path, run.path)
        except BaseException:
            shutil.rmtree(tmp.path, ignore_errors=True)
            remove_empty(made)  # a refused run leaves the tree as it found it
            raise
    fsync_dir(run.path.parent)
    return run


def update_config(run: RunDir, cfg: RunConfig) -> None:
    """Re-freeze the config on resume (new schedule or shape); keep the old one."""
    history = run.path / "config-history"
    with run_umask():
        if not history.exists():
            _mkdir(history)
        old = read_run_text(run.config_path)
        atomic_write_text(history / f"config-{time.time_ns()}.yaml", old)
        atomic_write_text(run.config_path, dump_config(cfg))


# ---------------------------------------------------------------------------------------
# Lock: a file made with O_EXCL that names its owner. A stale local owner (dead pid on this
# host) is taken over; a live one, or a Slurm job still known to Slurm, is refused.


def lock_owner() -> dict:
    """The launcher's lock record: enough identity for `cancel` to prove it later."""
    from enn_cluster.storage.process_identity import own_identity

    return {**own_identity(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "time": time.time()}


def lock_format_problem(owner) -> Optional[str]:
    """Why a parsed lock is not one enn-submit writes (None when it is)."""
    if not isinstance(owner, dict):
        return f"it holds a JSON {type(owner).__name__}, not an object"
    if owner.get("slurm_job_id") is not None:
        job = str(owner["slurm_job_id"])
        return None if job.replace("_", "").isdigit() else f"slurm_job_id {job[:40]!r}"
    if type(owner.get("pid")) is not int or owner["pid"] <= 1:
        return f"pid {str(owner.get('pid'))[:40]!r} is not a process id above 1"
    if not isinstance(owner.get("host"), str):
        return "no host"
    return None


def read_lock(run: RunDir, settle_s: float = 0.5) -> Optional[dict]:
    """The lock's owner, or None when there is no lock. A lock that does not parse (after
    `settle_s` for one being written right now) is refused, never taken as absent."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            raw = read_run_bytes(run.lock_path)
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(raw.decode("utf-8"))
            why = lock_format_problem(owner)
        except (ValueError, RecursionError) as exc:
            why = f"not JSON ({str(exc)[:60]})"
        if why is None:
            return owner
        if time.monotonic() >= deadline:
            raise UserError(f"run.lock: {run.lock_path} does not parse ({why}); if no job is "
                            f"running on this run, remove it (rm {shlex.quote(str(run.lock_path))})"
                            " and try again")
        time.sleep(0.05)


def _slurm_job_alive(job_id: str) -> bool:
    """Ask Slurm where we can. Inside a container image there is no scontrol: the host-side
    setup asked before srun and passed the answer in (LOCK_JOB_STATE_VAR, 'ID:alive' or
    'ID:gone'). Where nobody could ask, the job is taken for alive (and the refusal says so)."""
    told = _told_state(job_id)
    if told is not None:
        return told == "alive"
    if shutil.which("scontrol") is None:
        return True
    from enn_cluster.storage.slurm_jobs import job_alive

    return job_alive(str(job_id))


def _told_state(job_id) -> Optional[str]:
    """'alive' or 'gone' where the host-side setup told us about this job, else None."""
    from enn_cluster.config.launch_env import LOCK_JOB_STATE_VAR

    told_id, _, told = os.environ.get(LOCK_JOB_STATE_VAR, "").partition(":")
    return told if told_id == str(job_id) and told in ("alive", "gone") else None


def _cannot_ask(owner: dict) -> bool:
    job = owner.get("slurm_job_id")
    return bool(job) and _told_state(job) is None and shutil.which("scontrol") is None


def owner_alive(owner: dict, slurm_job_alive=None) -> bool:
    """Is the lock's owner still running? A Slurm job's lock is judged by Slurm (a job that
    ended leaves its lock behind), a local process's by its identity on this host (a pid
    reused by another process, or a lock from before a reboot, is dead)."""
    if owner.get("slurm_job_id"):
        return (slurm_job_alive or _slurm_job_alive)(owner["slurm_job_id"])
    if owner.get("host") != socket.gethostname():
        return True  # cannot see it from here: assume alive
    if owner.get("boot_id"):
        from enn_cluster.storage.process_identity import boot_id, identity, launcher_problem

        why = launcher_problem(owner, socket.gethostname(), boot_id(), identity)
        return why is None
    try:  # a lock written before locks recorded identity
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(run: RunDir, owner: Optional[dict] = None, slurm_job_alive=None) -> dict:
    """Take the run lock (O_EXCL) and keep its descriptor open until `release_lock`: the
    open file is what proves to `cancel` that a pid is this run's launcher. A stale lock is
    taken over by renaming it aside (`take_aside`), never by a blind unlink."""
    owner = owner or lock_owner()
    for _ in range(3):
        try:
            fd = os.open(run.lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        except FileExistsError:
            current = read_lock(run)
            if current and (current.get("slurm_job_id") and
                            current.get("slurm_job_id") == owner.get("slurm_job_id")):
                return current  # the same Slurm job, requeued or another task
            if current and owner_alive(current, slurm_job_alive):
                unasked = slurm_job_alive is None and _cannot_ask(current)
                raise UserError(f"run directory {run.path} is in use by {_who(current)}"
                                + (" (taken for alive: no scontrol here to ask Slurm, and no "
                                   "answer passed in)" if unasked else "")
                                + f"; wait for it, cancel it, or remove {run.lock_path} if "
                                "it is dead")
            if current:
                take_aside(run.lock_path, current)
            continue
        os.write(fd, json.dumps(owner).encode("utf-8"))
        os.fsync(fd)
        hold(run.lock_path, fd)
        return owner
    raise UserError(f"run directory {run.path}: could not take {run.lock_path}; try again")


def _who(owner: dict) -> str:
    job = owner.get("slurm_job_id")
    return f"Slurm job {job}" if job else f"pid {owner.get('pid')} on {owner.get('host')}"


def clear_lock_of_job(run: RunDir, job_id: str) -> bool:
    """After `cancel` cancelled Slurm job `job_id`: its lock goes too (a job cancelled while
    pending never starts, so nothing else would clear it). Only a lock naming that job."""
    try:
        current = read_lock(run, settle_s=0)
    except UserError:
        return False
    if not current or str(current.get("slurm_job_id")) != str(job_id):
        return False
    return take_aside(run.lock_path, current)


def replace_lock(run: RunDir, owner: dict) -> None:
    """Hand a lock we hold to a new owner in one step (write aside, rename over it): no
    moment without a lock for a racing submitter to take."""
    tmp = run.lock_path.with_name(f".{run.lock_path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w") as fh:
        json.dump(owner, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, run.lock_path)
    close_held(run.lock_path)


def release_lock(run: RunDir, owner: dict) -> None:
    try:
        current = read_lock(run, settle_s=0)
    except UserError:
        current = None  # not ours any more: whoever rewrote it clears it
    if current and current.get("pid") == owner.get("pid") and current.get("host") == owner.get("host"):
        run.lock_path.unlink(missing_ok=True)
    close_held(run.lock_path)
