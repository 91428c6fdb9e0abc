"""The run directory on the shared filesystem: its paths, frozen config, atomic writes.
Every file of `<runs_root>/<run_name>/`, with its writer and readers, is listed once in
storage/layout.py; the run lock, run.lock, is storage/run_lock.py."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from enn_cluster.config.loading import config_from_dict, dump_config, without_retired_keys
from enn_cluster.config.run_config import RunConfig
from enn_cluster.config.yaml_file import PlainLoader
from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import Said, UserError
from enn_cluster.storage import layout
from enn_cluster.storage.job_record import JobRecord
from enn_cluster.storage.output_target import missing_parents, remove_empty
from enn_cluster.storage.run_files import (
    LOG_LIMIT,
    append_run_file,
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
        return self.path / layout.CONFIG

    @property
    def has_config(self) -> bool:
        """Whether config.yaml is there in any form (a FIFO or a symlink loop included:
        reading it refuses those by name); False for a path the system cannot look up."""
        return os.path.lexists(self.config_path)

    @property
    def data_dir(self) -> Path:
        return self.path / layout.DATA

    @property
    def checkpoints(self) -> Path:
        return self.path / layout.CHECKPOINTS

    @property
    def metrics(self) -> Path:
        """Where rank 0 writes metrics: `logging.metrics_path` of the frozen config."""
        try:
            return self.path / self.load_config().logging.metrics_path
        except UserError:
            return self.path / layout.METRICS

    @property
    def logs(self) -> Path:
        return self.path / layout.LOGS

    @property
    def predictions(self) -> Path:
        return self.path / layout.PREDICTIONS

    @property
    def requeue(self) -> Path:
        return self.path / layout.REQUEUE

    @property
    def lock_path(self) -> Path:
        return self.path / layout.LOCK

    @classmethod
    def existing(cls, path) -> "RunDir":
        """The run directory a user named (RUN_DIR), resolved; UserError in the one wording
        every command shares when it holds no config.yaml (its config is read later)."""
        try:
            run = cls(Path(path).expanduser().resolve())
        except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long
            raise UserError("{shown!r} cannot be looked up ({why})", field=INPUTS["run_dir"],
                            value=path, shown=str(path)[:200],
                            why=getattr(exc, 'strerror', None) or exc,
                            fix="give the path of a run directory") from None
        if not run.has_config:
            raise UserError("{value} is not a run directory (no config.yaml)",
                            field=INPUTS["run_dir"], value=run.path,
                            fix="give a directory made by enn-submit train or prepare",
                            api_fix="give a directory made by train() or enn-submit")
        return run

    def load_config(self) -> RunConfig:
        if not self.has_config:
            RunDir.existing(self.path)  # raises: the one wording
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

    def record_job(self, record: JobRecord) -> None:
        """Append one launch record (now, unless it says when); appends of one line are
        atomic."""
        line = json.dumps(record.stamped(time.time()).as_json(), sort_keys=True) + "\n"
        with run_umask(), append_run_file(self.path / layout.JOBS) as fh:
            fh.write(line)

    def jobs(self) -> list[JobRecord]:
        """Every record of jobs.jsonl, oldest first, as whichever version wrote it."""
        try:
            text = read_run_text(self.path / layout.JOBS, LOG_LIMIT)
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
        return [JobRecord.from_json(r) for r in records]


_MADE_FOR: dict = {}  # run path -> the runs_root folders create_run_dir made for it here


def run_dir_for(cfg: RunConfig) -> RunDir:
    return RunDir(Path(cfg.runs_root).expanduser().resolve() / cfg.run_name)


def create_run_dir(cfg: RunConfig, populate=None) -> RunDir:
    """Make a new run directory with the frozen config, all or nothing.

    Everything (config, staged data) is written under a hidden temporary name and renamed
    into place at the end, so a failure never leaves a half-made run behind.
    """
    run = run_dir_for(cfg)
    if run.path.exists():
        raise UserError("{path} already exists", field="run_name", path=run.path,
                        fix="use 'enn-submit resume {path}' or pick another {name}",
                        name=Said(INPUTS["set"], "run_name=..."),
                        api_fix="pick another run_dir (or run_name), or resume it with "
                                "'enn-submit resume {path}'")
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
    _MADE_FOR[run.path] = made
    return run


def remove_new_run(run: RunDir) -> None:
    """Undo `create_run_dir` of this process (a submit refused before the run ever ran): the
    run and the runs_root folders made for it go, so the tree is as the command found it."""
    shutil.rmtree(run.path, ignore_errors=True)
    remove_empty(_MADE_FOR.pop(run.path, []))


def update_config(run: RunDir, cfg: RunConfig) -> None:
    """Re-freeze the config on resume (new schedule or shape); keep the old one."""
    history = run.path / layout.CONFIG_HISTORY
    with run_umask():
        if not history.exists():
            _mkdir(history)
        old = read_run_text(run.config_path)
        atomic_write_text(history / f"config-{time.time_ns()}.yaml", old)
        atomic_write_text(run.config_path, dump_config(cfg))
