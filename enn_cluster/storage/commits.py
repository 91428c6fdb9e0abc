"""Checkpoint directories on the shared filesystem: naming, commit records, verification.

A `step-N` directory is COMPLETE only when DCP's `.metadata` exists and `commit.json`,
written after it, lists every file with its size and checksum. Anything else is a torn
write and is never resumed from. This module has no torch import: `enn-submit verify`
and `status` use it from the login node.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterable, Optional

from enn_cluster.storage.checksum import file_checksum
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import atomic_write_text, fsync_dir
from enn_cluster.storage.run_files import inside_run, read_run_text

COMMIT = "commit.json"
METADATA = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def parse_step(name: str) -> Optional[int]:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def list_steps(root: Path) -> list[int]:
    """Step directories, a symlink to one included (verify refuses it, by name). A run's
    checkpoints/ that is not a directory (a regular file, a symlink loop) is one line."""
    try:
        names = [p.name for p in Path(root).iterdir() if p.is_dir() or p.is_symlink()]
    except FileNotFoundError:
        return []
    except OSError as exc:  # NotADirectoryError, ELOOP, EACCES
        raise UserError(f"checkpoints: {root} cannot be listed ({exc.strerror or exc}); it "
                        "must be the run's directory of step-N folders: move it aside to "
                        "start over, or restore it") from None
    return sorted(s for s in map(parse_step, names) if s is not None)


def read_commit(path: Path) -> Optional[dict]:
    """The commit record of a step directory, None when missing or not one we write (a
    file list of {size, checksum} mappings). A FIFO, device or symlink there: UserError."""
    try:
        record = json.loads(read_run_text(Path(path) / COMMIT))
    except (FileNotFoundError, NotADirectoryError, ValueError, RecursionError):
        return None
    return record if record_problem(record) is None else None


def record_problem(record) -> Optional[str]:
    """Why a parsed commit record is not one this package writes (None when it is). Pure."""
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return "not a mapping with a files mapping"
    for name, info in record["files"].items():
        if not (isinstance(info, dict) and type(info.get("size")) is int
                and isinstance(info.get("checksum"), str)):
            return f"{name}: not a {{size, checksum}} record"
    return None


def is_committed(path: Path) -> bool:
    """Cheap check (no checksums): metadata present and every recorded size right."""
    path = Path(path)
    if path.is_symlink():
        return False  # a step directory is never a symlink (verify says so)
    record = read_commit(path)
    if record is None or not (path / METADATA).exists() or METADATA not in record["files"]:
        return False
    for name, info in record["files"].items():
        try:  # lstat: a symlink (a loop, or out of the run), a FIFO or a directory there is
            st = (path / name).lstat()  # not the file the commit recorded
        except OSError:  # missing, a name too long
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != info["size"]:
            return False
    return True


def committed_steps(root: Path) -> list[int]:
    return [s for s in list_steps(root) if is_committed(step_dir(root, s))]


def latest_committed(root: Path) -> Optional[int]:
    steps = committed_steps(root)
    return steps[-1] if steps else None


def verify_files(path: Path, names: Iterable[str], record: dict) -> list[str]:
    """Problems found in the given files of one checkpoint ([] when all is well)."""
    problems = []
    for name in names:
        info = record["files"][name]
        if os.path.lexists(Path(path) / name) and not inside_run(Path(path) / name, path):
            problems.append(f"{name}: leads outside its step directory (a symlink)")
            continue
        try:
            size, checksum = file_checksum(Path(path) / name, like=info["checksum"])
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        except UserError as exc:  # a FIFO, a device, a directory: the message names it
            problems.append(str(exc))
            continue
        except (OSError, ValueError) as exc:  # unreadable, an unknown checksum algorithm
            problems.append(f"{name}: {exc}")
            continue
        if size != info["size"]:
            problems.append(f"{name}: size {size}, recorded {info['size']}")
        elif checksum != info["checksum"]:
            problems.append(f"{name}: checksum {checksum}, recorded {info['checksum']}")
    return problems


def verify_checkpoint(path: Path) -> list[str]:
    if Path(path).is_symlink():
        return [f"{Path(path).name}: a symbolic link, not a step directory this run wrote"]
    record = read_commit(path)
    if record is None:
        return [f"{COMMIT}: missing or unreadable (incomplete checkpoint)"]
    if not (Path(path) / METADATA).exists():
        return [f"{METADATA}: missing"]
    return verify_files(path, sorted(record["files"]), record)


def loadable_problems(path: Path) -> list[str]:
    """What stops a checkpoint whose checksums agree from loading: its `.metadata` read
    through the loader's own allow-list (this imports torch)."""
    from enn_cluster.storage.dcp_metadata import metadata_problem

    problem = metadata_problem(path)
    return [problem] if problem else []


def sound_steps(root: Path) -> list[int]:
    """Committed steps whose every file verifies and whose metadata loads, oldest first."""
    return [s for s in committed_steps(root)
            if not (verify_checkpoint(step_dir(root, s)) or loadable_problems(step_dir(root, s)))]


def step_problems(path: Path) -> list[str]:
    """Why a checkpoint cannot be resumed from ([] when it can): commit record, checksums
    (an algorithm this version does not know included), metadata."""
    try:
        return verify_checkpoint(path) or loadable_problems(path)
    except ValueError as exc:
        return [str(exc)]


def newest_verified(root: Path, seen: Optional[dict] = None) -> tuple[Optional[int], dict]:
    """The newest committed step whose every file has its recorded size and checksum (its
    bytes are read: no torch), and {newer committed step: its problems}. `seen` keeps
    results keyed by each file's size, inode and ctime (which every write changes), so
    that a caller asking again (status --follow) reads only what changed."""
    seen = {} if seen is None else seen
    corrupt = {}
    for step in reversed(committed_steps(root)):
        path = step_dir(root, step)
        try:
            record = read_commit(path) or {"files": {}}
            key = (str(path), *((name, *_identity(path / name)) for name in sorted(record["files"])))
            if key not in seen:
                seen[key] = verify_checkpoint(path)
            problems = seen[key]
        except (OSError, ValueError) as exc:  # gone meanwhile, an unknown checksum algorithm
            problems = [str(exc)]
        if not problems:
            return step, corrupt
        corrupt[step] = problems
    return None, corrupt


def _identity(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_ino, st.st_ctime_ns


_OWNED_RE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng/rank-(\d+)\.pt)$")


def owner_rank(name: str) -> Optional[int]:
    """The rank that wrote a step file itself (DCP's __<rank>_<i>.distcp, rng/rank-<rank>.pt);
    None for shared files (metadata, trainer state), which rank 0 checksums. Pure."""
    m = _OWNED_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def is_shard(name: str) -> bool:
    """A DCP data file (__<rank>_<i>.distcp): the bulk of a checkpoint's bytes."""
    return name.endswith(".distcp") and owner_rank(name) is not None


def step_files(path: Path) -> list[str]:
    """Every file of a step directory but its commit record and temporaries, in one walk:
    on Lustre each listing is a metadata-server request, so only rank 0 lists, once."""
    out = []
    for folder, _, names in os.walk(path):  # one listing per directory (rglob makes two)
        rel = Path(folder).relative_to(path)
        out += [str(rel / n) for n in names if n != COMMIT and ".tmp" not in n]
    return sorted(out)


def checksum_files(path: Path, names: Iterable[str]) -> dict:
    out = {}
    for name in names:
        size, checksum = file_checksum(Path(path) / name)
        out[name] = {"size": size, "checksum": checksum}
    return out


def commit_gathered(path: Path, step: int, gathered: Iterable[dict], **info) -> int:
    """Rank 0's commit of a step: the ranks' own file checksums, the rest (metadata,
    trainer state) read here after one listing, `commit.json` written last. Returns the
    number of files."""
    files: dict = {}
    for part in gathered:
        files.update(part)
    files.update(checksum_files(path, [n for n in step_files(path) if n not in files]))
    if METADATA not in files:
        raise OSError(f"DCP wrote no {METADATA} in {path}; not committing")
    write_commit(path, step, files, **info)
    return len(files)


def write_commit(path: Path, step: int, files: dict, **info) -> None:
    record = {"step": step, "files": dict(sorted(files.items())), **info}
    atomic_write_text(Path(path) / COMMIT, json.dumps(record, indent=1, sort_keys=True))
    fsync_dir(Path(path).parent)


def storage_problem(path: Path, need_bytes: int = 1 << 20) -> Optional[str]:
    """Name the usual storage faults plainly (DCP reports a full disk as a zip error)."""
    import os

    try:
        st = os.statvfs(path)
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if st.f_flag & os.ST_RDONLY:
        return "Read-only file system"
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        return f"No space left on device ({free} bytes free)"
    return None


def prune_plan(steps: list[int], committed: list[int], keep_last: int,
               protect: Iterable[int] = ()) -> list[int]:
    """Which step directories to delete: committed ones beyond the newest `keep_last`,
    and torn ones older than the newest committed (newer torn ones may be in flight)."""
    protect = set(protect)
    keep = set(committed[-keep_last:]) | protect
    newest = committed[-1] if committed else None
    doomed = [s for s in committed if s not in keep]
    if newest is not None:
        doomed += [s for s in steps if s not in committed and s < newest and s not in protect]
    return sorted(doomed)


_TORN_ASIDE = re.compile(r"^step-(\d+)\.torn-\d+$")  # a torn attempt moved aside (checkpoint.py)


def torn_aside(names: Iterable[str], committed: list[int]) -> list[str]:
    """The torn attempts set aside (`step-N.torn-<ns>`) that a commit has since replaced:
    N at or below the newest committed step. They never count as checkpoints. Pure."""
    newest = committed[-1] if committed else None
    return sorted(n for n in names if (m := _TORN_ASIDE.match(n)) and newest is not None
                  and int(m.group(1)) <= newest)


def prune(root: Path, keep_last: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete what prune_plan dooms, and the torn attempts set aside that a commit replaced."""
    committed = committed_steps(root)
    doomed = prune_plan(list_steps(root), committed, keep_last, protect)
    for s in doomed:
        # the commit record first: a reader (doctor, status on a live run) then finds the
        # step uncommitted, being removed, never committed with its files half gone (a
        # committed step is never a symlink: is_committed)
        if s in committed:
            with contextlib.suppress(OSError):
                (step_dir(root, s) / COMMIT).unlink()
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    for name in torn_aside((p.name for p in Path(root).iterdir()), committed):
        shutil.rmtree(Path(root) / name, ignore_errors=True)
    return doomed


# -- save time against the stop signal's grace -------------------------------------------------
GRACE_FACTOR, GRACE_MARGIN_S = 1.5, 30  # a save may run 1.5x its last time, plus start-up


def last_save_seconds(root: Path) -> Optional[tuple[int, float]]:
    """(step, seconds) of the newest committed checkpoint that recorded how long its save
    took (commit.json `save_seconds`); None when none did."""
    for step in reversed(committed_steps(root)):
        seconds = (read_commit(step_dir(root, step)) or {}).get("save_seconds")
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
            return step, float(seconds)
    return None


def grace_for_save(seconds: float, grace_s: int, limit_s: Optional[int] = None) -> int:
    """The stop signal's grace a save of `seconds` needs: `grace_s` when it fits, else
    1.5x the save plus 30 s, at most `limit_s`. Pure."""
    need = int(math.ceil(seconds * GRACE_FACTOR)) + GRACE_MARGIN_S
    if seconds <= grace_s - GRACE_MARGIN_S:
        return grace_s
    return max(grace_s, need if limit_s is None else min(need, limit_s))


def save_over_grace(step: int, seconds: float, grace_s: float) -> Optional[str]:
    """One line when a save took longer than the stop grace (None when it fits). Pure."""
    if not grace_s or seconds <= grace_s:
        return None
    return (f"checkpoint step-{step} took {seconds:.0f} s, longer than the stop grace "
            f"({grace_s:.0f} s): a stop's checkpoint may not finish; "
            f"raise the grace (--signal-grace {grace_for_save(seconds, int(grace_s))} or "
            "site.signal_grace_s, and parallel.stop_grace_s) or shrink the checkpoint "
            "(async saves, fewer saved states)")
