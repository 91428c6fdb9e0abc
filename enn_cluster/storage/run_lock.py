"""The run lock: a file made with O_EXCL that names its owner, at `<run>/run.lock`.

A stale local owner (a dead pid on this host, told apart from a reused pid by its identity)
is taken over by renaming the stale file aside (only one renamer wins), never by a blind
unlink; a live owner, or a Slurm job still known to Slurm, is refused. The descriptor stays
open while the lock is held: the open file is what proves to `cancel` that a pid is this
run's launcher (storage/process_identity.py).
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import time
from typing import TYPE_CHECKING, Optional

from enn_cluster.errors import UserError
from enn_cluster.storage.lock_files import close_held, hold, take_aside
from enn_cluster.storage.run_files import read_run_bytes

if TYPE_CHECKING:
    from enn_cluster.storage.rundir import RunDir


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
    if type(owner.get("pid")) is not int or owner["pid"] < 1:  # 1: a container's launcher
        return f"pid {str(owner.get('pid'))[:40]!r} is not a process id"
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


def _judged(ask):
    """A lock's Slurm job judged alive or not. Inside a container image there is no Slurm
    client: the host-side setup asked before srun and passed the answer in
    (LOCK_JOB_STATE_VAR, 'ID:alive' or 'ID:gone'). Else `ask` (cluster/slurm.job_alive,
    passed in by a caller that can reach Slurm; storage does not talk to Slurm). Where
    nobody could ask, the job is taken for alive (and the refusal says so)."""
    def alive(job_id, ended_by_itself: bool = False) -> bool:
        told = _told_state(job_id)
        if told is not None:
            return told == "alive"
        if ask is None:
            return True
        return ask(str(job_id), True) if ended_by_itself else ask(str(job_id))
    return alive


def for_run(run_path, slurm_job_alive=None):
    """`slurm_job_alive` (Slurm's answer, where the caller passes one) for the lock of the
    run at `run_path`: a job whose batch shell recorded its end (node_loss.ended_by_itself)
    is asked as such, so that one Slurm holds COMPLETING for a lost node's cleanup frees
    the run at once."""
    from enn_cluster.storage.node_loss import ended_by_itself

    ask = _judged(slurm_job_alive)

    def alive(job_id) -> bool:
        if ended_by_itself(run_path, job_id):
            return ask(str(job_id), True)
        return ask(str(job_id))
    return alive


def _told_state(job_id) -> Optional[str]:
    """'alive' or 'gone' where the host-side setup told us about this job, else None."""
    from enn_cluster.config.launch_env import LOCK_JOB_STATE_VAR

    told_id, _, told = os.environ.get(LOCK_JOB_STATE_VAR, "").partition(":")
    return told if told_id == str(job_id) and told in ("alive", "gone") else None


def _cannot_ask(owner: dict, ask) -> bool:
    job = owner.get("slurm_job_id")
    return bool(job) and _told_state(job) is None and ask is None


def owner_alive(owner: dict, slurm_job_alive=None) -> bool:
    """Is the lock's owner still running? A Slurm job's lock is judged by Slurm (a job that
    ended leaves its lock behind), a local process's by its identity on this host (a pid
    reused by another process, or a lock from before a reboot, is dead)."""
    if owner.get("slurm_job_id"):
        return (slurm_job_alive or _judged(None))(owner["slurm_job_id"])
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
    owner = {**(owner or lock_owner()), "run": run_identity(run.path)}
    for _ in range(3):
        try:
            fd = os.open(run.lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        except FileExistsError:
            current = read_lock(run)
            if current and (current.get("slurm_job_id") and
                            current.get("slurm_job_id") == owner.get("slurm_job_id")):
                return current  # the same Slurm job, requeued or another task
            if current and owner_alive(current, for_run(run.path, slurm_job_alive)):
                unasked = _cannot_ask(current, slurm_job_alive)
                raise UserError(f"run directory {run.path} is in use by {_who(current)}"
                                + (" (taken for alive: no Slurm client here to ask, and no "
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


def run_identity(path) -> str:
    """The run a lock belongs to, written into it: a digest of the run's real path. It is
    also the `--comment` enn-submit gives every job it submits for the run (rendered, so
    `render` shows it): only a submission sets a job's comment, so it proves a job is the
    run's (cluster/slurm.job_belongs_to_run). A lock file linked, copied or bind-mounted
    into another run still names its own."""
    import hashlib

    return "enn-cluster:" + hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:40]


def signal_refusal(run: RunDir, owner: dict) -> Optional[str]:
    """Why `cancel` must not signal the lock's launcher on this run's behalf, as far as the
    lock file itself can tell (None: it may go on to prove the pid): the file must be this
    run's own (one link, no symlink) and name this run."""
    try:
        st = os.lstat(run.lock_path)
    except OSError as exc:
        return f"{run.lock_path.name} cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return f"{run.lock_path.name} is a symbolic link, not this run's own lock file"
    if st.st_nlink != 1:
        return (f"{run.lock_path.name} has {st.st_nlink} links: it may be another run's lock "
                "linked in")
    if owner.get("run") != run_identity(run.path):
        return (f"{run.lock_path.name} names another run (or none: written by an older "
                "enn_cluster?), not this one")
    return None


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
    owner = {**owner, "run": run_identity(run.path)}
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
